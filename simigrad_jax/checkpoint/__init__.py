"""Host: a run's checkpoints: orbax saves and restores, integrity, the run's record, resume.

Documented API:
  Checkpointer: training state saved and restored with orbax-checkpoint; a
    damaged checkpoint is detected, moved aside and the one before it restored.
  missing_steps: the steps of a run whose records its metrics file lost
    (metrics_recovery restores what the TensorBoard events hold on resume).
  Errors: CheckpointMismatchError (a checkpoint made by a run with other
    settings, or of another model), CheckpointSaveError (another process's
    background save failed, so every process stops), CheckpointsMissingError
    (a workdir whose metrics record steps but whose checkpoints folder is gone),
    CheckpointFolderGoneError (the checkpoints folder removed or replaced by a
    file while the run trains), OtherFormatError (a checkpoint in the format
    of another version of simigrad_jax: refused, not taken for damage).

Modules: ``checkpointer``, ``integrity`` (what a checkpoint carries to be
verified), ``run_record`` (what a run is, recorded in every checkpoint) and
``run_checkpoints`` (a training run's checkpoints and its resume) and
``metrics_recovery`` (``metrics.jsonl`` read back on resume, whatever damage it took)
and ``emergency`` (a save its disk stopped: the last whole step saved elsewhere).

Example:
  >>> from simigrad_jax import checkpoint
  >>> issubclass(checkpoint.CheckpointMismatchError, ValueError)
  True
"""

from simigrad_jax.checkpoint.checkpointer import Checkpointer
from simigrad_jax.checkpoint.checkpointer import CheckpointFolderGoneError
from simigrad_jax.checkpoint.checkpointer import CheckpointMismatchError
from simigrad_jax.checkpoint.integrity import OtherFormatError
from simigrad_jax.checkpoint.metrics_recovery import missing_steps
from simigrad_jax.checkpoint.run_checkpoints import CheckpointSaveError
from simigrad_jax.checkpoint.run_checkpoints import CheckpointsMissingError

__all__ = [
  "CheckpointFolderGoneError",
  "CheckpointMismatchError",
  "CheckpointSaveError",
  "Checkpointer",
  "CheckpointsMissingError",
  "OtherFormatError",
  "missing_steps",
]
