"""Host: a step's decision: its statistics read, the next batch size, agreed on, as its record.

Once a step is dispatched (:class:`~simigrad_jax.trainer.step_record.
DispatchedStep`), :class:`StepDecider` waits for its statistics, hands them
to the controller, sets the learning-rate factor that follows the controller's
next batch size, and makes every process agree on the decision before any of
them uses it. The agreement also carries each process's report: the shapes it
has compiled, a stop signal, its seconds since the last checkpoint and a
failed background save (:mod:`simigrad_jax.multihost.preemption`). The result is
the step's :class:`~simigrad_jax.trainer.step_record.StepRecord`.
"""

from __future__ import annotations

import time
from typing import Any

from simigrad_jax.data.sampler import EpochSampler
from simigrad_jax.multihost import preemption
from simigrad_jax.multihost.process_agreement import ProcessAgreement
from simigrad_jax.trainer.hooks import CheckpointHook
from simigrad_jax.trainer.run_setup import Run
from simigrad_jax.trainer.step_record import DispatchedStep
from simigrad_jax.trainer.step_record import StepRecord
from simigrad_jax.trainer.step_record import StepStats


def epochs_trained(sampler: EpochSampler) -> float:
  """The epochs ``sampler`` has served so far (fractional, counted in examples)."""
  return sampler.examples_seen / sampler.num_examples


class StepDecider:
  """Turns each dispatched step into its record: statistics read, next batch size decided, agreed.

  It counts the run's steps and those whose gradient was not finite.

  Args:
    run: the run it decides for: its sampler (read, not moved), layout,
      step inputs (the next step's learning-rate factor is set there),
      programs (their compiled shapes are agreed on), checkpoints (a failed
      background save stops the run) and the steps done so far.
    controller: the run's batch-size controller (updated in place).
    agreement: the agreement between the run's processes.
    checkpoint: the checkpoint hook (a save on time is decided here).
    stop: the ``train()`` call's stop on a signal (set here when agreed).

  Example::

    dispatched = dispatcher.dispatch(batch_size, total_examples, decider.step, decider.last_read)
    record = decider.decide(dispatched)  # decider.step == record.step
  """

  def __init__(
    self,
    run: Run,
    controller: Any,
    agreement: ProcessAgreement,
    checkpoint: CheckpointHook,
    stop: preemption.RunStop,
  ):
    self._controller, self._sampler, self._layout = controller, run.sampler, run.layout
    # A setting, read once: a schedule's config lists all its thresholds (a replay's, one a step).
    self._similarity_target = controller.config["similarity_target"]
    self._step_inputs, self._programs, self._agreement = run.step_inputs, run.programs, agreement
    self._checkpoints, self._checkpoint, self._stop = run.checkpoints, checkpoint, stop
    self.step, self.nonfinite_steps = run.step, run.nonfinite_steps
    self.last_read: float | None = None  # when the last step's statistics were read

  def decide(self, dispatched: DispatchedStep) -> StepRecord:
    """Waits for the step's statistics, lets the controller decide, agrees on the decision with
    the other processes, and returns the step's record."""
    stats = StepStats.read(dispatched.stats)
    read = time.perf_counter()
    step_seconds = read - (dispatched.start if self.last_read is None else self.last_read)
    self.last_read = read
    self.nonfinite_steps += not stats.grads_finite
    batch_size, examples_seen = dispatched.plan.global_batch_size, self._sampler.examples_seen
    epoch_end = self._sampler.epoch > dispatched.epoch
    next_batch_size = self._controller.update(
      stats.similarity,
      stats=stats.for_controller(
        batch_size=batch_size,
        examples_seen=examples_seen,
        epochs=epochs_trained(self._sampler),
        epoch_end=epoch_end,
      ),
    )
    self.step += 1
    inputs = self._step_inputs
    inputs.set_lr_factor(inputs.lr_factors(next_batch_size, epochs_trained(self._sampler)))
    agreement_seconds = self._agree(
      {
        "step": self.step,
        "batch_size": batch_size,
        "examples_seen": examples_seen,
        "similarity": stats.similarity,
        "decision": self._controller.last_decision,
        "next_batch_size": next_batch_size,
        "next_lr_factor": inputs.lr_factor,
      }
    )
    return StepRecord.create(
      dispatched,
      stats,
      step=self.step,
      examples_seen=examples_seen,
      micro_batch_size=self._layout.device_rows(dispatched.plan.micro_batch_size),
      decision=self._controller.last_decision,
      similarity_target=self._similarity_target,
      next_batch_size=next_batch_size,
      next_lr_factor=inputs.lr_factor,
      nonfinite_steps=self.nonfinite_steps,
      step_seconds=step_seconds,
      agreement_seconds=agreement_seconds,
      epoch_end=epoch_end,
    )

  def _agree(self, decision: dict[str, Any]) -> float:
    """Multi-host: the next step's shapes and learning rate follow ``decision``; every process
    must hold the same one before any of them uses it. Returns the seconds it took.

    Each process's report rides along, and every process acts on all of them alike: the
    compiled shapes (the next step falls back only to a shape compiled on all), a signal
    (every process stops after this step), process 0's seconds since the last checkpoint
    (``checkpoint_every_seconds``) and a failed background save (raised now, on every process).
    """
    start = time.perf_counter()
    compiled = self._programs.compiled_report()
    report = {
      "compiled": compiled,
      **self._stop.report(self._checkpoint.seconds_since_save(), self._checkpoints.failed_save()),
    }
    reports = self._agreement.agree(f"decision of step {self.step}", decision, report=report)
    assert reports is not None  # one per process, as a report was given
    if compiled is not None:
      self._programs.agree_on_compiles([r["compiled"] for r in reports])
    agreed = preemption.Agreed.read(reports)
    self._checkpoints.stop_on_failed_saves(agreed.failed_saves, self.step)
    self._checkpoint.save_on_time(self.step, agreed.seconds_since_checkpoint)
    self._stop.agreed = agreed.stop
    return time.perf_counter() - start
