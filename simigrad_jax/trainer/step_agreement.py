"""Host: every process agrees on a step's decision, and each one's report rides along.

The next step's shapes and learning rate follow the decision (the step's
number, size, similarity, the controller's decision and the next batch size
and learning-rate factor); every process must hold the same one before any of
them uses it. Each process's report comes with it, and every process acts on
all of them alike: the compiled shapes (the next step falls back only to a
shape compiled on all), a signal (every process stops after this step,
:mod:`simigrad_jax.multihost.preemption`), process 0's seconds since the last
checkpoint (``checkpoint_every_seconds``) and a failed background save (raised
now, on every process). With one process nothing is exchanged.
"""

from __future__ import annotations

import time
from typing import Any

from simigrad_jax.checkpoint.hook import CheckpointHook
from simigrad_jax.checkpoint.run_checkpoints import RunCheckpoints
from simigrad_jax.compile.policy import CompilePolicy
from simigrad_jax.multihost import preemption
from simigrad_jax.multihost.process_agreement import ProcessAgreement


class StepAgreement:
  """Agrees on each step's decision across the run's processes, with each process's report.

  Args:
    agreement: the agreement between the run's processes.
    compile_policy: the run's compile policy (its report of the compiled shapes is agreed on).
    checkpoints: the run's checkpoints (a failed background save stops the run).
    checkpoint: the checkpoint hook (a save on time is decided here).
    stop: the ``train()`` call's stop on a signal (set here when agreed).

  Example::

    seconds = step_agreement.agree(step, {"step": step, "next_batch_size": 96, ...})
  """

  def __init__(
    self,
    agreement: ProcessAgreement,
    compile_policy: CompilePolicy,
    checkpoints: RunCheckpoints,
    checkpoint: CheckpointHook,
    stop: preemption.RunStop,
  ):
    self._agreement, self._compiles, self._checkpoints = agreement, compile_policy, checkpoints
    self._checkpoint, self._stop = checkpoint, stop
    self._failed_saves: list[str | None] = []  # agreed, raised once the step's records are out

  def agree(self, step: int, decision: dict[str, Any]) -> float:
    """Makes every process hold ``decision`` of ``step`` and act on every report alike.

    Args:
      step: the optimizer step decided (1 for the run's first).
      decision: the decision as JSON data, the same on every process.

    Returns:
      The seconds the agreement took.

    Raises:
      ProcessDisagreementError: the processes decided differently.
    """
    start = time.perf_counter()
    compiled = self._compiles.compiled_report()
    report = {
      "compiled": compiled,
      **self._stop.report(self._checkpoint.seconds_since_save(), self._checkpoints.failed_save()),
    }
    reports = self._agreement.agree(f"decision of step {step}", decision, report=report)
    assert reports is not None  # one per process, as a report was given
    if compiled is not None:
      self._compiles.agree_on_compiles([r["compiled"] for r in reports])
    agreed = preemption.Agreed.read(reports)
    self._failed_saves = agreed.failed_saves
    self._checkpoint.save_on_time(step, agreed.seconds_since_checkpoint)
    self._stop.agreed = agreed.stop
    return time.perf_counter() - start

  def raise_failed_saves(self, step: int) -> None:
    """Stops every process alike when a background save failed, as agreed at ``step``'s agreement.

    Called once the step's records are written (or handed to the hooks that
    write them), so that the run's last whole step, which an emergency save
    keeps, has its records too.

    Raises:
      Exception: a process's background checkpoint save failed (its error).
    """
    failed, self._failed_saves = self._failed_saves, []
    self._checkpoints.stop_on_failed_saves(failed, step)
