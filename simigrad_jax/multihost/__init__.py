"""Host side: what several processes share: their agreement on settings and decisions, a clean
stop on a signal at the same step, the workdir's lock, and simulated CPU devices."""
