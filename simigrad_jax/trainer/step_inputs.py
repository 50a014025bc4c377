"""Host: a step's scalars on the devices, and the learning-rate factor that follows the batch size.

A step's program takes three float32 scalars, one
:class:`~simigrad_jax.ingraph.train_step.StepScalars`: the step's real
examples, the learning-rate factor and half A's real examples. The
learning-rate factor follows the batch size the controller decides
(:func:`simigrad_jax.lr_factor`), times the schedule's factor at the epochs
trained so far; the program writes it into the optimizer state, so a new
factor costs no recompilation. The scalars go to the devices in one
``jax.device_put`` only when they change (at a fixed batch size, no
transfer), and while the batch moves, ahead of the decision, for each size
the controller is likely to decide (:meth:`StepInputs.place_ahead`, from the
data thread).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from simigrad_jax import optimizer_state
from simigrad_jax.controllers import learning_rate
from simigrad_jax.ingraph.train_step import StepScalars
from simigrad_jax.shapes.layout import StepLayout
from simigrad_jax.trainer.config import TrainerConfig


class StepInputs:
  """The learning-rate factor the next step runs with, and a step's scalars on the devices.

  Args:
    base_batch_size: the batch size the base learning rate was tuned for
      (the controller's initial one).
    lr_rule: ``"sqrt"``, ``"linear"`` or ``"none"``.
    lr_adjust_factor: optional damping of the factor.
    lr_coupling: how it meets the schedule (``"full"`` or ``"peak"``).
    lr_schedule: optional ``lr_schedule(epochs) -> float``, a multiplier of
      the base learning rate.
    lr_factor: the factor to start from (the optimizer state's).
    replicated: the replicated sharding of the scalars.

  Example::

    inputs.set_lr_factor(inputs.lr_factors(next_batch_size, epochs))
    state, measurements = programs.run(state, data, inputs.on_devices(plan.global_batch_size))
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
    lr_coupling: learning_rate.LrCoupling = "full",
  ):
    self.base_batch_size = base_batch_size
    self.lr_rule, self.lr_adjust_factor, self.lr_schedule = lr_rule, lr_adjust_factor, lr_schedule
    self.lr_coupling = lr_coupling
    self.lr_factor = lr_factor  # as float32 holds it
    self.schedule_factor = 1.0
    self._replicated = replicated
    # The scalars last placed (as NumPy scalars) and their placement; those placed ahead.
    self._placed: tuple[StepScalars | None, StepScalars | None] = (None, None)
    self._ahead: dict[StepScalars, StepScalars] = {}  # placed by place_ahead

  @classmethod
  def for_run(
    cls,
    config: TrainerConfig,
    controller: Any,
    lr_schedule: Callable[[float], float] | None,
    state: dict[str, Any],
    mesh: Mesh,
  ) -> StepInputs:
    """The inputs of a run with these settings, from the factor its optimizer state holds."""
    return cls(
      base_batch_size=controller.initial_batch_size,
      lr_rule=config.lr.rule,
      lr_adjust_factor=config.lr.adjust_factor,
      lr_schedule=lr_schedule,
      lr_factor=optimizer_state.lr_factor_of(state["opt_state"]),
      replicated=NamedSharding(mesh, P()),
      lr_coupling=config.lr.coupling,
    )

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
      self.lr_coupling,
    )

  def set_lr_factor(self, factors: tuple[float, float]) -> None:
    """Makes ``factors`` (from :meth:`lr_factors`) those of the next step."""
    factor, self.schedule_factor = factors
    self.lr_factor = float(np.float32(factor))

  def on_devices(self, batch_size: int) -> StepScalars:
    """The scalars of a step of ``batch_size`` real examples at the current factor, on the devices."""
    scalars = _scalars(batch_size, self.lr_factor)
    placed_scalars, placed = self._placed
    if placed is None or placed_scalars != scalars:
      placed = self._ahead.get(scalars)
      if placed is None:
        placed = jax.device_put(scalars, self._replicated)
      self._placed = (scalars, placed)
    return placed

  def place_ahead(self, batch_sizes: Sequence[int], epochs: float, remaining: float) -> None:
    """Places the scalars of the next step for each of ``batch_sizes`` the controller may decide.

    The step after ``epochs`` epochs, with ``remaining`` examples left in the
    run. Replaces the last call's; :meth:`on_devices` then finds the
    scalars on the devices already. A size whose factor fails is skipped
    (the decision raises it).
    """
    placed: dict[StepScalars, StepScalars] = {}
    for size in batch_sizes:
      try:
        factor, _ = self.lr_factors(size, epochs)
      except Exception:  # pylint: disable=broad-except  # raised again, at the decision
        continue
      scalars = _scalars(int(min(size, remaining)), float(np.float32(factor)))
      placed[scalars] = jax.device_put(scalars, self._replicated)
    self._ahead = placed  # (one assignment: on_devices may read it from another thread)


def _scalars(batch_size: int, lr_factor: float) -> StepScalars:
  """The scalars of a step of ``batch_size`` real examples at ``lr_factor``, float32 on the host."""
  return StepScalars(
    total_weight=np.float32(batch_size),
    lr_factor=np.float32(lr_factor),
    first_half_weight=np.float32(StepLayout.first_half_weight(batch_size)),
  )
