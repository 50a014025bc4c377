"""Host: a step's inputs: its plan, its examples and its scalars, handed to its program.

:class:`StepDispatcher` plans the controller's batch size onto the devices,
takes the step's examples (placed ahead for each size it is likely to decide)
and calls the step's program; the step runs while the host goes on.

A step's program takes three float32 scalars (:data:`simigrad_jax.engine.
train_step.STEP_INPUTS`): the step's real examples, the learning-rate factor
and half A's real examples. The learning-rate factor follows the batch size
the controller decides (:func:`simigrad_jax.lr_factor`), times the schedule's
factor at the epochs trained so far; the program writes it into the optimizer
state, so a new factor costs no recompilation. The scalars go to the devices
only when they change (at a fixed batch size, no transfer), and while the
batch moves, ahead of the decision, for each size the controller is likely
to decide (:meth:`StepInputs.place_ahead`, from the data thread).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import numpy.typing as npt
from jax.sharding import NamedSharding

from simigrad_jax.compile.programs import StepPrograms
from simigrad_jax.controllers import learning_rate
from simigrad_jax.data.data_loader import StepDataLoader
from simigrad_jax.data.sampler import EpochSampler
from simigrad_jax.shapes import batch_plan
from simigrad_jax.shapes.layout import StepLayout
from simigrad_jax.trainer.step_record import DispatchedStep


def host_scalars(values: list[float], dtype: npt.DTypeLike, sharding: NamedSharding) -> jax.Array:
  """A small replicated vector for a step's inputs (one host-to-device transfer)."""
  return jax.device_put(np.asarray(values, dtype), sharding)


class StepInputs:
  """The learning-rate factor the next step runs with, and a step's scalars on the devices.

  Args:
    base_batch_size: the batch size the base learning rate was tuned for
      (the controller's initial one).
    lr_rule: ``"sqrt"``, ``"linear"`` or ``"none"``.
    lr_adjust_factor: optional damping of the factor.
    lr_schedule: optional ``lr_schedule(epochs) -> float``, a multiplier of
      the base learning rate.
    lr_factor: the factor to start from (the optimizer state's).
    replicated: the replicated sharding of the scalars.

  Example::

    inputs.set_lr_factor(inputs.lr_factors(next_batch_size, epochs))
    state, stats = program(state, data, inputs.on_devices(plan.global_batch_size))
  """

  def __init__(
    self,
    *,
    base_batch_size: int,
    lr_rule: learning_rate.LrRule,
    lr_adjust_factor: float | None,
    lr_schedule: Callable[[float], float] | None,
    lr_factor: float,
    replicated: NamedSharding,
  ):
    self.base_batch_size = base_batch_size
    self.lr_rule, self.lr_adjust_factor, self.lr_schedule = lr_rule, lr_adjust_factor, lr_schedule
    self.lr_factor = lr_factor  # as float32 holds it
    self.schedule_factor = 1.0
    self._replicated = replicated
    self._placed: tuple[tuple[float, ...] | None, jax.Array | None] = (None, None)
    self._ahead: dict[tuple[float, ...], jax.Array] = {}  # placed by place_ahead

  def lr_factors(self, batch_size: int, epochs: float) -> tuple[float, float]:
    """``(learning-rate factor, schedule factor)`` for ``batch_size`` after ``epochs`` epochs.

    Raises:
      ValueError: the factor is not finite and > 0.
    """
    return learning_rate.scheduled_lr_factor(
      batch_size,
      self.base_batch_size,
      self.lr_rule,
      self.lr_adjust_factor,
      self.lr_schedule,
      epochs,
    )

  def set_lr_factor(self, factors: tuple[float, float]) -> None:
    """Makes ``factors`` (from :meth:`lr_factors`) those of the next step."""
    factor, self.schedule_factor = factors
    self.lr_factor = float(np.float32(factor))

  def on_devices(self, batch_size: int) -> jax.Array:
    """The scalars of a step of ``batch_size`` real examples at the current factor, on the devices."""
    inputs = _step_inputs(batch_size, self.lr_factor)
    placed_inputs, placed = self._placed
    if placed is None or placed_inputs != inputs:
      placed = self._ahead.get(inputs)
      if placed is None:
        placed = host_scalars(list(inputs), np.float32, self._replicated)
      self._placed = (inputs, placed)
    return placed

  def place_ahead(self, batch_sizes: Sequence[int], epochs: float, remaining: float) -> None:
    """Places the scalars of the next step for each of ``batch_sizes`` the controller may decide.

    The step after ``epochs`` epochs, with ``remaining`` examples left in the
    run. Replaces the last call's; :meth:`on_devices` then finds the
    scalars on the devices already. A size whose factor fails is skipped
    (the decision raises it).
    """
    placed: dict[tuple[float, ...], jax.Array] = {}
    for size in batch_sizes:
      try:
        factor, _ = self.lr_factors(size, epochs)
      except Exception:  # pylint: disable=broad-except  # raised again, at the decision
        continue
      inputs = _step_inputs(int(min(size, remaining)), float(np.float32(factor)))
      placed[inputs] = host_scalars(list(inputs), np.float32, self._replicated)
    self._ahead = placed  # (one assignment: on_devices may read it from another thread)


def _step_inputs(batch_size: int, lr_factor: float) -> tuple[float, float, float]:
  """The scalars of a step of ``batch_size`` real examples at ``lr_factor``."""
  return (float(batch_size), lr_factor, float(StepLayout.first_half_weight(batch_size)))


class StepDispatcher:
  """Plans a batch size onto the devices, takes its examples and dispatches the step.

  It holds the run's state, which each step's program takes (donated) and
  replaces.

  Args:
    state: the run's replicated ``{"params", "opt_state", "model_state"}``.
    layout: the step's layout (its plans).
    programs: the step's compiled programs.
    data: loads each step's examples, ahead of the step.
    sampler: the run's example order (moved past each step's examples).
    inputs: the step's scalars and learning-rate factor.

  Example::

    dispatcher.prepare(controller.batch_size, total_examples, step, epochs)
    dispatched = dispatcher.dispatch(controller.batch_size, total_examples, step, last_read=None)
  """

  def __init__(
    self,
    state: dict[str, Any],
    layout: StepLayout,
    programs: StepPrograms,
    data: StepDataLoader,
    sampler: EpochSampler,
    inputs: StepInputs,
  ):
    self.state = state
    self._layout, self._programs, self._data = layout, programs, data
    self._sampler, self._inputs = sampler, inputs
    self._programs_run: set[tuple[str, int]] = set()  # see _first_run

  def prepare(self, batch_size: int, total_examples: float, step: int, epochs: float) -> None:
    """Before a ``train()`` call's first step: its learning-rate factor, its programs and its
    examples, asked for ahead."""
    self._inputs.set_lr_factor(self._inputs.lr_factors(batch_size, epochs))
    self._programs.prefetch_for(batch_size)
    self._data.submit_ahead(batch_size, total_examples, step)

  def dispatch(
    self, batch_size: int, total_examples: float, step: int, last_read: float | None
  ) -> DispatchedStep:
    """Dispatches the step after ``step`` at ``batch_size`` (cut to land on ``total_examples``).

    The step's new state (not computed yet) is :attr:`state` from then on.

    Args:
      batch_size: the controller's batch size, of this step and (expected) of the next.
      total_examples: the examples the run ends at.
      step: the optimizer steps done.
      last_read: when the last step's statistics were read (None: the first step of a
        ``train()`` call).

    Returns:
      The step as dispatched.
    """
    start = time.perf_counter()
    # The run's last step lands exactly on num_epochs.
    remaining = total_examples - self._sampler.examples_seen
    exact = self._layout.plan(int(min(batch_size, remaining)))
    # No step follows the run's last one: a compile asked for now would never be used.
    last = remaining <= batch_size
    plan = self._programs.ready_plan(exact, prefetch=not last)
    if not last:
      self._programs.prefetch_near(exact.micro_batch_size)  # the compiles follow the batch
    data, data_seconds = self._data.take(plan, self._sampler.examples_seen, step)
    epoch = self._sampler.epoch
    self._sampler.take(plan.global_batch_size)
    step_inputs = self._inputs.on_devices(plan.global_batch_size)
    wait_before = self._programs.wait_seconds()
    # The host's critical path ends here: the program call is the runtime's (on CPU the
    # simulated devices are host threads, and the call runs part of the step).
    host_seconds = math.nan if last_read is None else time.perf_counter() - last_read
    first_run = self._first_run(plan)
    self.state, stats = self._programs.run(self.state, data, step_inputs)
    # While the first step runs: the programs that let every later step fall back.
    self._programs.await_fallback(plan.micro_batch_size)
    compile_wait = self._programs.wait_seconds() - wait_before
    # Load the next step's rows while the devices work.
    self._data.submit_ahead(batch_size, total_examples, step + 1)
    return DispatchedStep(
      plan=plan,
      exact_plan=exact,
      stats=stats,
      start=start,
      epoch=epoch,
      data_seconds=data_seconds,
      host_seconds=host_seconds,
      compile_wait_seconds=compile_wait,
      first_run=first_run,
      lr_factor=self._inputs.lr_factor,
      schedule_factor=self._inputs.schedule_factor,
    )

  def _first_run(self, plan: batch_plan.BatchPlan) -> bool:
    """Whether ``plan`` runs a program that no step of this Trainer has run yet (and notes it)."""
    if plan.accumulation_steps == 1:
      programs = {("step", plan.micro_batch_size)}
    else:
      programs = {("micro_step", plan.micro_batch_size), ("update", 0)}
    first = not programs <= self._programs_run
    self._programs_run |= programs
    return first
