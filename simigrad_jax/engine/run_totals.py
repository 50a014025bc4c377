"""Host: the totals of one ``Trainer.train`` call, added up from its step records (a hook)."""

from __future__ import annotations

import math
import statistics
from typing import Any

from simigrad_jax.engine.step_record import StepRecord


class RunTotals:
  """Adds up a run's step records: steps, examples, seconds, fallbacks, the host's critical path.

  A hook (:class:`simigrad_jax.engine.hooks.StepHook`) that the Trainer
  makes for every ``train`` call.

  Example::

    totals = RunTotals()
    totals.on_step(record)  # once per step, in order
    summary = totals.summary()
  """

  def __init__(self):
    self.steps = 0
    self.examples = 0
    self.wall_seconds = 0.0
    self.data_seconds = 0.0
    self.fallback_steps = 0
    self.host_seconds: list[float] = []
    self.last: StepRecord | None = None

  def on_step(self, record: StepRecord) -> None:
    """Counts one step's record."""
    self.examples += record.batch_size
    self.steps += 1
    self.wall_seconds += record.step_seconds
    self.data_seconds += record.data_seconds
    self.fallback_steps += record.compile_fallback
    if math.isfinite(record.host_seconds):
      self.host_seconds.append(record.host_seconds)
    self.last = record

  def summary(self) -> dict[str, Any]:
    """The run's totals, and the last step's loss and similarity (None without a step)."""
    return {
        "run_steps": self.steps, "run_examples": self.examples,
        "average_batch_size": self.examples / self.steps if self.steps else math.nan,
        "loss": None if self.last is None else self.last.loss,
        "similarity": None if self.last is None else self.last.similarity,
        "wall_seconds": self.wall_seconds, "data_seconds": self.data_seconds,
        "host_seconds_median": (statistics.median(self.host_seconds) if self.host_seconds
                                else math.nan),
        "compile_fallback_steps": self.fallback_steps,
    }
