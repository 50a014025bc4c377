"""Host: the base class of every error simigrad-jax defines, and where each error is imported from.

Each error also keeps the built-in parent it always had (``ValueError`` for a
bad input or a checkpoint of another run, ``RuntimeError`` for a failure while
running), so code that catches those keeps working; ``except
simigrad_jax.SimiGradError`` catches every one of them.

Each error is imported from the room that raises it (the room's
``__init__``); the top level holds only ``SimiGradError`` and ``Preempted``:

* ``simigrad_jax.errors.SimiGradError`` (``Exception``): the base class, also
  ``simigrad_jax.SimiGradError``.
* ``simigrad_jax.ingraph.AxisNameError``, ``simigrad_jax.ingraph.HalvesContractError``,
  ``simigrad_jax.ingraph.LossContractError``, ``simigrad_jax.ingraph.ChainOrderError``
  and ``simigrad_jax.ingraph.HalfBatchArgumentError`` (``ValueError``): a
  transform not named for its step's axis, half gradients not passed on to it,
  a loss function that breaks the Trainer's contract, an optimizer chain
  without the transform first and ``scale_by_lr_factor`` last, arguments that
  ``value_and_half_grads`` cannot split into halves.
* ``simigrad_jax.flax_nnx.NNXStateError`` (``ValueError``): an NNX loss that
  changes a stream it reaches from outside the gradient.
* ``simigrad_jax.data.BadRecordError`` (``ValueError``): a record that cannot
  be read or decoded.
* ``simigrad_jax.files.UnsafePathError`` (``ValueError``): a folder other
  users can change, or a symlink where a file is written;
  ``simigrad_jax.files.WorkdirAccessError`` (``PermissionError``, ``RuntimeError``):
  a run's folder this user may not create or write to.
* ``simigrad_jax.checkpoint.CheckpointMismatchError`` (``ValueError``): a
  checkpoint of a run with other settings; ``simigrad_jax.checkpoint.CheckpointSaveError``
  (``RuntimeError``): another process's background save failed;
  ``simigrad_jax.checkpoint.CheckpointsMissingError`` (``ValueError``): a
  workdir whose metrics record steps but whose checkpoints folder is gone;
  ``simigrad_jax.checkpoint.CheckpointFolderGoneError`` (``OSError``): the
  checkpoints folder removed, or replaced by a file, while the run trains;
  ``simigrad_jax.checkpoint.OtherFormatError`` (``ValueError``): a checkpoint
  in the format of another version of simigrad_jax.
* ``simigrad_jax.trainer.NonFiniteRunError`` (``RuntimeError``): a streak of
  steps skipped as not finite (the run trained nothing).
* ``simigrad_jax.compile.StepCompileError`` (``RuntimeError``): a step's
  compile failed; ``simigrad_jax.compile.CompileAbandoned`` (``RuntimeError``):
  a wait for a compile given up, the run stopping.
* ``simigrad_jax.multihost.ProcessDisagreementError`` and its
  ``simigrad_jax.multihost.ProcessLostError``, ``simigrad_jax.multihost.WorkdirLockedError``
  and ``simigrad_jax.multihost.Preempted`` (``RuntimeError``; ``Preempted``
  also ``simigrad_jax.Preempted``): processes that disagree or are gone, a
  workdir another run holds, a run stopped by a signal.
* ``simigrad_jax.trainer.AdaptiveBatchError`` (``ValueError``): a batch an
  own loop's ``AdaptiveStep`` cannot run.

Example:
  >>> import simigrad_jax
  >>> from simigrad_jax import checkpoint
  >>> issubclass(checkpoint.CheckpointMismatchError, simigrad_jax.SimiGradError)
  True
  >>> issubclass(checkpoint.CheckpointMismatchError, ValueError)
  True
"""

from __future__ import annotations

__all__ = ["SimiGradError"]


class SimiGradError(Exception):
  """An error raised by simigrad-jax (every error class it defines derives from this one)."""
