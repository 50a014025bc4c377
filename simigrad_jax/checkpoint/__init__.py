"""Host side: a run's checkpoints: orbax saves and restores, integrity, the run's record, resume."""
