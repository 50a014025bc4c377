"""Host: a training run's checkpoints: the host state saved beside the arrays, resume, waits.

Plain Python between steps; nothing here is traced. The arrays (parameters,
optimizer and model state) go through :class:`~simigrad_jax.runtime.checkpointer.
Checkpointer` (orbax); beside them each checkpoint holds what the host needs to
continue exactly: the step, the seed, the controller's and the sampler's state
and the count of non-finite steps.
"""

from __future__ import annotations

import logging
import os
from typing import Any, NamedTuple

from simigrad_jax.errors import SimiGradError
from simigrad_jax.runtime.checkpointer import CheckpointMismatchError
from simigrad_jax.runtime.checkpointer import Checkpointer
from simigrad_jax.runtime.process_agreement import ProcessAgreement

logger = logging.getLogger("simigrad_jax")

# Multi-host: how long a process waits for a checkpoint save before it checks on the others.
SAVE_WAIT_ROUND_SECONDS = 1.0


class CheckpointSaveError(SimiGradError, RuntimeError):
  """Multi-host: another process's background checkpoint save failed, so every process stops.

  The process whose save failed raises the save's own error instead.
  """


class Resumed(NamedTuple):
  """What a run continues from: the restored arrays, the step and the non-finite steps so far."""

  state: Any
  step: int
  nonfinite_steps: int


class RunCheckpoints:
  """Saves a run's state every so often and resumes it from the newest readable checkpoint.

  Args:
    directory: where the checkpoints go (created if missing).
    seed: the run's seed; a checkpoint made with another seed is refused.
    max_to_keep: how many checkpoints are kept.
    agreement: the run's :class:`~simigrad_jax.runtime.process_agreement.
      ProcessAgreement`: with several processes, they wait for each other's
      saves through it, and a lost one is reported within its timeout.

  Example::

    checkpoints = RunCheckpoints(workdir / "checkpoints", seed=0, max_to_keep=3,
                                 agreement=ProcessAgreement(timeout=300.0))
    resumed = checkpoints.resume(state, sampler, controller)
  """

  def __init__(self, directory: str | os.PathLike, *, seed: int, max_to_keep: int,
               agreement: ProcessAgreement):
    self.checkpointer = Checkpointer(directory, max_to_keep=max_to_keep)
    self.seed = seed
    self._agreement = agreement
    self._last_saved: int | None = None  # the step of the last save

  def resume(self, like: Any, sampler: Any, controller: Any) -> Resumed | None:
    """Restores the newest readable checkpoint into ``sampler`` and ``controller``.

    Args:
      like: the train state whose structure, shapes and shardings the arrays
        are restored to.
      sampler: the run's :class:`~simigrad_jax.data.sampler.EpochSampler`.
      controller: the run's controller.

    Returns:
      The restored state, step and non-finite step count, or None when the
      directory holds no checkpoint.

    Raises:
      ValueError: the checkpoints belong to another run (other shapes, another
        seed, other controller or sampler settings); nothing is changed.
    """
    checkpointer = self.checkpointer
    if checkpointer.latest_step() is None:
      return None
    directory = checkpointer.directory
    try:
      state, host, step = checkpointer.restore(like)
    except CheckpointMismatchError as error:
      raise ValueError(f"the workdir {os.path.dirname(directory)!r} holds checkpoints of another run: "
                       f"{error}") from error
    if host.get("seed") != self.seed:
      raise ValueError(f"the checkpoint at step {step} in {directory} was made with "
                       f"seed={host.get('seed')!r}, this run has seed={self.seed}; use the same "
                       "seed to resume, or a new workdir")
    try:  # both refuse without changing anything
      sampler.load_state_dict(host["sampler"])
      controller.load_state_dict(host["controller"])
    except (KeyError, TypeError, ValueError) as error:
      raise ValueError(f"the checkpoint at step {step} in {directory} does not match this run's "
                       f"settings: {error}; resume with the settings it was made with, or use a "
                       "new workdir") from error
    skipped = checkpointer.skipped
    if skipped:
      logger.warning("resumed from the checkpoint at step %d in %s after skipping %d unreadable "
                     "newer one(s): %s", step, directory, len(skipped),
                     "; ".join(f"step {s}: {why}" for s, why in skipped))
    else:
      logger.info("resumed from the checkpoint at step %d in %s", step, directory)
    return Resumed(state, int(host["step"]), int(host.get("nonfinite_steps", 0)))

  def save(self, step: int, state: Any, *, sampler: Any, controller: Any,
           nonfinite_steps: int) -> None:
    """Saves ``state`` and the host state as the checkpoint of ``step`` (once per step).

    The last save is waited for first, on every process.
    """
    if self.checkpointer.latest_step() == step:
      return
    self.wait(f"checkpoint of step {step}")
    host = {"step": step, "seed": self.seed, "controller": controller.state_dict(),
            "sampler": sampler.state_dict(), "nonfinite_steps": nonfinite_steps}
    self.checkpointer.save(step, state, host)
    self._last_saved = step

  def failed_save(self) -> str | None:
    """``"ErrorType: message"`` (short) when this process's last save failed in the background,
    else None (also while it is under way); never waits. See :meth:`stop_on_failed_saves`."""
    error = self.checkpointer.failed_save()
    if error is None:
      return None
    text = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
    return text.encode("ascii", "replace").decode()[:150]  # (it rides in the step's agreement)

  def stop_on_failed_saves(self, failed: list[str | None], step: int) -> None:
    """Raises when a process's last save failed in the background; every process calls it.

    Args:
      failed: every process's :meth:`failed_save`, in process order (the
        same list on every process, gathered at a step's agreement).
      step: the step training stops at.

    Raises:
      Exception: on a process whose save failed, the save's own error (e.g.
        ``OSError`` of a full disk), with a note naming the checkpoint.
      CheckpointSaveError: on the other processes, naming the process and
        its error.
    """
    failures = {process: text for process, text in enumerate(failed) if text is not None}
    if not failures:
      return
    saved = (f"the background save of the checkpoint of step {self._last_saved} in "
             f"{self.checkpointer.directory}")
    then = f"training stopped at step {step}; a restart resumes from the newest finished checkpoint"
    error = self.checkpointer.failed_save()
    if error is not None:
      newest = self.checkpointer.latest_step()
      error.add_note(f"{saved} failed: {then} ({'none' if newest is None else f'step {newest}'})")
      raise error
    processes = ", ".join(f"process {p} ({text})" for p, text in failures.items())
    raise CheckpointSaveError(f"{saved} failed on {processes}: {then}")

  def wait(self, what: str) -> None:
    """Waits until the last checkpoint save has finished on every process.

    Multi-host: orbax's commit waits for every process with a timeout of 20
    minutes, so the processes wait in rounds of at most
    :data:`SAVE_WAIT_ROUND_SECONDS` and tell each other after each round
    whether theirs has finished (all of them go on together): a process lost
    meanwhile is reported within the agreement timeout.

    Args:
      what: names the wait in a report of a lost process.
    """
    if self._agreement.num_processes == 1:
      self.checkpointer.wait()
      return
    while True:
      finished = self.checkpointer.wait(timeout=SAVE_WAIT_ROUND_SECONDS)
      if all(self._agreement.gather(what, finished)):
        return

  def close(self) -> None:
    """Waits for the last save and releases orbax's resources.

    After a lost process it does not wait for a save under way: the save
    would wait for the lost process.
    """
    if not self._agreement.lost_processes():
      self.checkpointer.close()
