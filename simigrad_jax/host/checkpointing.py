"""Host: save and restore training state with orbax-checkpoint.

A checkpoint holds two items: ``state`` (a pytree of arrays: parameters,
optimizer state, model state) saved with ``StandardSave``, and ``host`` (plain
JSON: step, controller, sampler position, counters) saved with ``JsonSave``.
orbax writes each checkpoint into a temporary directory and renames it when
complete, so a crash mid-save leaves the previous checkpoint usable; restore
skips a checkpoint that cannot be read and falls back to the one before it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

logger = logging.getLogger("simigrad_jax")


class Checkpointer:
  """Keeps the newest ``max_to_keep`` checkpoints of a run in ``directory``.

  Args:
    directory: where the checkpoints live (created if missing; its parent must exist).
    max_to_keep: how many of the newest checkpoints to keep (>= 1).
    async_save: save in the background (the next save, :meth:`wait` and
      :meth:`close` wait for it).

  Example:
    >>> ckpt = Checkpointer("/tmp/run/checkpoints")  # doctest: +SKIP
    >>> ckpt.save(10, {"params": params}, {"step": 10})  # doctest: +SKIP
    >>> state, host = ckpt.restore({"params": params})  # doctest: +SKIP
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3, async_save: bool = True):
    directory = os.path.abspath(os.fspath(directory))
    parent = os.path.dirname(directory)
    if not os.path.isdir(parent):
      raise ValueError(f"the checkpoint directory's parent {parent!r} does not exist")
    if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
      raise ValueError(f"max_to_keep must be an integer >= 1, got {max_to_keep!r}")
    self.directory = directory
    self._manager = ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True),
    )

  def all_steps(self) -> list[int]:
    """The steps of the checkpoints on disk, oldest first."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest checkpoint's step, or None when there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def save(self, step: int, state: Any, host: dict[str, Any]) -> None:
    """Saves ``state`` (arrays) and ``host`` (JSON) as the checkpoint of ``step``."""
    self._manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), host=ocp.args.JsonSave(host)),
        force=True,
    )

  def restore(self, like: Any, step: int | None = None) -> tuple[Any, dict[str, Any], int]:
    """Restores the newest readable checkpoint (or ``step``) into the structure of ``like``.

    Args:
      like: a pytree with the structure, shapes, dtypes and shardings to
        restore into (arrays or ``jax.ShapeDtypeStruct``).
      step: a specific step; None tries the newest first and falls back to
        older ones when a checkpoint is unreadable (logged as a warning).

    Returns:
      ``(state, host, step)``.

    Raises:
      FileNotFoundError: no checkpoint exists.
      ValueError: no checkpoint could be read, or one does not match ``like``
        (for example a checkpoint of a different model); the message names
        the step and the error.
    """
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), like)
    candidates = [step] if step is not None else list(reversed(self.all_steps()))
    if not candidates:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    errors = []
    for candidate in candidates:
      try:
        restored = self._manager.restore(
            candidate,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), host=ocp.args.JsonRestore()),
        )
        _check_matches(abstract, restored.state, candidate)
        return restored.state, dict(restored.host), candidate
      except Exception as error:  # pylint: disable=broad-except
        logger.warning("checkpoint at step %d in %s is unreadable (%s: %s); trying an older one",
                       candidate, self.directory, type(error).__name__, error)
        errors.append(f"step {candidate}: {type(error).__name__}: {error}")
    raise ValueError(f"no readable checkpoint in {self.directory}: " + "; ".join(errors))

  def wait(self) -> None:
    """Blocks until a background save has finished."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def _check_matches(abstract: Any, restored: Any, step: int) -> None:
  want = jax.tree.structure(abstract)
  got = jax.tree.structure(restored)
  if want != got:
    raise ValueError(f"the checkpoint at step {step} has a different structure: {got} != {want}")
  for a, r in zip(jax.tree.leaves(abstract), jax.tree.leaves(restored)):
    if tuple(a.shape) != tuple(r.shape) or a.dtype != r.dtype:
      raise ValueError(
          f"the checkpoint at step {step} holds {r.dtype}{list(r.shape)} where the model "
          f"has {a.dtype}{list(a.shape)}")
