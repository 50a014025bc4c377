"""Host side: run services: checkpoints, multi-process agreement, metrics files, progress, simulated devices."""
