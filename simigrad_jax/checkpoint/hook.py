"""Host: when a run saves a checkpoint: every epoch's end, every N steps and on time.

:class:`CheckpointHook` is one of the Trainer's step hooks
(:class:`simigrad_jax.StepHook`): it reads a step's number and whether the
step ended an epoch, and calls the save it was given when the step is due.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol


class CheckpointedStep(Protocol):
  """What :class:`CheckpointHook` reads of a step's record (a :class:`simigrad_jax.StepRecord`)."""

  @property
  def step(self) -> int:
    """The optimizer step (1 for the run's first)."""

  @property
  def epoch_end(self) -> bool:
    """Whether the step ended an epoch."""


class CheckpointHook:
  """Saves a checkpoint at every epoch's end, every ``every_steps`` steps and on time.

  Args:
    save: saves the run's current state as the checkpoint of its step.
    every_steps: save every this many steps too (None: only at epoch ends).
    every_seconds: save at the first step that ends this many seconds after
      the last checkpoint (or the start of the ``train`` call) too (None:
      never on time). The Trainer decides it at each step's agreement, on
      process 0's clock (:meth:`save_on_time`), so that every process saves
      at the same step.
    clock: the clock in seconds (default ``time.monotonic``).
  """

  def __init__(
    self,
    save: Callable[[], None],
    every_steps: int | None,
    every_seconds: float | None = None,
    clock: Callable[[], float] = time.monotonic,
  ):
    self._save, self._every_steps, self._every_seconds = save, every_steps, every_seconds
    self._clock = clock
    self._last_save = clock()
    self._on_time: int | None = None  # a step due on time

  def restart_clock(self) -> None:
    """Counts the seconds to the next checkpoint on time from now."""
    self._last_save = self._clock()

  def seconds_since_save(self) -> float:
    """Seconds since the last checkpoint (or :meth:`restart_clock`)."""
    return self._clock() - self._last_save

  def save_on_time(self, step: int, seconds_since_save: float) -> None:
    """Makes ``step`` due if ``seconds_since_save`` (process 0's) reach ``every_seconds``."""
    if self._every_seconds is not None and seconds_since_save >= self._every_seconds:
      self._on_time = step

  def due(self, record: CheckpointedStep) -> bool:
    """Whether the step of ``record`` is checkpointed."""
    return (
      record.epoch_end
      or record.step == self._on_time
      or bool(self._every_steps and record.step % self._every_steps == 0)
    )

  def on_step(self, record: CheckpointedStep) -> None:
    if self.due(record):
      self._save()
      self.restart_clock()
