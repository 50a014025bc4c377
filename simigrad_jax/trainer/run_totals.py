"""Host: the totals of one ``Trainer.train`` call, added up from its step records (a hook)."""

from __future__ import annotations

import logging
import math
import statistics
from typing import Any

from simigrad_jax.trainer.skipped_steps import SAID
from simigrad_jax.trainer.step_record import StepRecord

logger = logging.getLogger("simigrad_jax")


class RunTotals:
  """Adds up a run's step records: steps, examples, seconds, fallbacks, the host's critical path.

  A hook (:class:`simigrad_jax.trainer.hooks.StepHook`) that the Trainer
  makes for every ``train`` call. It counts the steps skipped as not finite
  (their gradient, loss, update or new parameters), by cause, and logs a
  warning naming the first of them and its cause.

  Example::

    totals = RunTotals()
    totals.on_step(record)  # once per step, in order
    summary = totals.summary()
  """

  def __init__(self):
    self.steps = 0
    self.examples = 0
    self.padded_rows = 0
    self.wall_seconds = 0.0
    self.data_seconds = 0.0
    self.fallback_steps = 0
    self.first_run_steps = 0
    self.first_run_seconds = 0.0
    self.first_run_wait_seconds = 0.0
    self.compile_wait_seconds = 0.0
    self.nonfinite_steps = 0
    self.nonfinite_causes: dict[str, int] = {}
    self.first_nonfinite: StepRecord | None = None
    self.host_seconds: list[float] = []
    self.last: StepRecord | None = None

  def on_step(self, record: StepRecord) -> None:
    """Counts one step's record."""
    self.examples += record.batch_size
    self.padded_rows += record.padded_examples
    self.steps += 1
    self.wall_seconds += record.step_seconds
    self.data_seconds += record.data_seconds
    self.fallback_steps += record.compile_fallback
    self.compile_wait_seconds += record.compile_wait_step_seconds
    if record.first_run:
      self.first_run_steps += 1
      self.first_run_seconds += record.step_seconds
      self.first_run_wait_seconds += record.compile_wait_step_seconds
    if record.skipped:
      cause = record.nonfinite_cause or "gradient"
      self.nonfinite_steps += 1
      self.nonfinite_causes[cause] = self.nonfinite_causes.get(cause, 0) + 1
      if self.first_nonfinite is None:
        self.first_nonfinite = record
        logger.warning(
          "step %d (batch size %d, epoch %d): %s NaN or infinite; the step was skipped "
          "(parameters, optimizer and model state kept, batch size held). Such steps are "
          "counted in the summary's nonfinite_steps and nonfinite_causes and in each step's "
          "record (nonfinite_cause, nonfinite_steps)",
          record.step,
          record.batch_size,
          record.epoch,
          SAID[cause],
        )
    if math.isfinite(record.host_seconds):
      self.host_seconds.append(record.host_seconds)
    self.last = record

  def summary(self, steps: int | None = None, examples_seen: int | None = None) -> dict[str, Any]:
    """The run's totals, and the last step's loss and similarity (None without a step).

    ``steps``, ``examples_seen`` and ``average_batch_size`` cover the whole
    run, resumed parts included (the Trainer's counts, given; without them,
    this call's); ``run_steps``, ``run_examples`` and
    ``run_average_batch_size`` cover this call's steps, as every other
    number here does. ``run_nonfinite_steps`` counts the skipped steps,
    ``nonfinite_causes`` counts them by cause (``{"update": 2}``) and
    ``first_nonfinite_step`` names the first (None without one);
    ``padding_fraction`` is the share of the rows computed that were
    zero-weight padding (NaN without a step); ``first_run_steps`` counts
    the steps that ran a program for the first time in the Trainer, and
    ``first_run_seconds`` adds up their step seconds.

    ``wall_seconds`` adds up the steps' seconds, each counted once:
    ``step_compile_wait_seconds`` of them the steps waited for compiles (the
    first runs' waits, ``first_run_wait_seconds``, among them), so that
    ``first_run_seconds - first_run_wait_seconds`` is what the first runs
    took besides the wait.
    """
    rows = self.examples + self.padded_rows
    steps = self.steps if steps is None else steps
    examples_seen = self.examples if examples_seen is None else examples_seen
    return {
      "steps": steps,
      "examples_seen": examples_seen,
      "average_batch_size": examples_seen / steps if steps else math.nan,
      "run_steps": self.steps,
      "run_examples": self.examples,
      "run_average_batch_size": self.examples / self.steps if self.steps else math.nan,
      "padding_fraction": self.padded_rows / rows if rows else math.nan,
      "loss": None if self.last is None else self.last.loss,
      "similarity": None if self.last is None else self.last.similarity,
      "wall_seconds": self.wall_seconds,
      "data_seconds": self.data_seconds,
      "host_seconds_median": (
        statistics.median(self.host_seconds) if self.host_seconds else math.nan
      ),
      "compile_fallback_steps": self.fallback_steps,
      "first_run_steps": self.first_run_steps,
      "first_run_seconds": self.first_run_seconds,
      "first_run_wait_seconds": self.first_run_wait_seconds,
      "step_compile_wait_seconds": self.compile_wait_seconds,
      "run_nonfinite_steps": self.nonfinite_steps,
      "nonfinite_causes": dict(self.nonfinite_causes),
      "first_nonfinite_step": None if self.first_nonfinite is None else self.first_nonfinite.step,
    }
