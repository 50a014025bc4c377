"""Host side: the Trainer: its step loop, its settings, the step record and the hooks that
consume it (metrics, progress, evaluation, checkpoints), and the checks before its first step."""
