"""Host: the learning-rate factor that follows the batch size."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

from simigrad_jax import validation

LrRule = Literal["sqrt", "linear", "none"]
LR_RULES: tuple[str, ...] = ("sqrt", "linear", "none")
# How the batch-size factor meets the schedule (scheduled_lr_factor): "full" multiplies them at
# every step; "peak" applies the batch-size factor in full at the schedule's peak only, fading
# with the schedule as it decays.
LrCoupling = Literal["full", "peak"]
LR_COUPLINGS: tuple[str, ...] = ("full", "peak")


def lr_factor(
  batch_size: int,
  base_batch_size: int,
  rule: LrRule = "sqrt",
  lr_adjust_factor: float | None = None,
) -> float:
  """Returns the factor by which the base learning rate is multiplied at ``batch_size``.

  ``sqrt`` (the reference's rule) gives ``sqrt(B / B0)``, ``linear`` gives
  ``B / B0`` and ``none`` gives 1. With ``lr_adjust_factor`` f the factor r
  becomes ``(r - 1) * f + 1``, damping (f < 1) or amplifying (f > 1) the change,
  as in the reference.

  Args:
    batch_size: the current global batch size B (>= 1).
    base_batch_size: the batch size B0 the base learning rate was tuned for
      (the initial global batch size).
    rule: ``"sqrt"``, ``"linear"`` or ``"none"`` (the reference's
      ``disable_lr_adjust``).
    lr_adjust_factor: optional finite f >= 0.

  Returns:
    The factor, a Python float (> 0 unless f > 1 drives it to or below 0,
    which is refused).

  Example:
    >>> import simigrad_jax
    >>> simigrad_jax.lr_factor(512, 128)
    2.0
    >>> simigrad_jax.lr_factor(512, 128, lr_adjust_factor=0.5)
    1.5
  """
  batch_size = validation.check_int("batch_size", batch_size)
  base_batch_size = validation.check_int("base_batch_size", base_batch_size)
  ratio = batch_size / base_batch_size
  if rule == "sqrt":
    factor = math.sqrt(ratio)
  elif rule == "linear":
    factor = ratio
  elif rule == "none":
    factor = 1.0
  else:
    raise ValueError(f"rule={rule!r} is not valid; choose one of {LR_RULES}")
  if lr_adjust_factor is not None:
    lr_adjust_factor = validation.check_real(
      "lr_adjust_factor", lr_adjust_factor, "[0, inf)", lambda f: 0 <= f < math.inf
    )
    factor = (factor - 1.0) * lr_adjust_factor + 1.0
  if factor <= 0:
    raise ValueError(
      f"lr_factor would be {factor} (<= 0) at batch_size={batch_size}, "
      f"base_batch_size={base_batch_size}, lr_adjust_factor={lr_adjust_factor}; "
      "use an lr_adjust_factor <= 1 when the batch shrinks"
    )
  return factor


def scheduled_lr_factor(
  batch_size: int,
  base_batch_size: int,
  rule: LrRule,
  lr_adjust_factor: float | None,
  lr_schedule: Callable[[float], float] | None,
  epochs: float,
  coupling: LrCoupling = "full",
) -> tuple[float, float]:
  """The batch-size factor of :func:`lr_factor` coupled to a schedule's factor at ``epochs``.

  With ``coupling="full"`` the two multiply: ``r(B) s(e)``. A batch that
  grows while the schedule decays then raises the learning rate by ``r(B)``
  even where the schedule has brought it near zero. ``"peak"`` applies the
  batch-size factor in full at the schedule's peak (``s = 1``) and fades it
  with the schedule, ``s (1 + (r(B) - 1) min(s, 1))``: the rate still ends
  where the schedule ends it, whatever the batch, and a batch that grows at
  schedule value s raises the rate by at most ``(r - 1) s`` of the
  schedule's (e.g. 1.6% for ``r = 2.6`` at ``s = 0.01``, against 160%).

  Args:
    batch_size, base_batch_size, rule, lr_adjust_factor: as for
      :func:`lr_factor`.
    lr_schedule: a function of the epochs trained (fractional) that returns a
      factor, or None (1).
    epochs: the epochs trained so far.
    coupling: ``"full"`` or ``"peak"`` (:data:`LR_COUPLINGS`); the same
      without a schedule.

  Returns:
    ``(factor, schedule factor)``.

  Raises:
    ValueError: the product is not finite and > 0 (the schedule returned 0,
      a negative value or NaN).

  Example:
    >>> from simigrad_jax.controllers import learning_rate
    >>> learning_rate.scheduled_lr_factor(512, 128, "sqrt", None, lambda e: 0.5, 1.0)
    (1.0, 0.5)
    >>> learning_rate.scheduled_lr_factor(512, 128, "sqrt", None, lambda e: 0.5, 1.0, "peak")
    (0.75, 0.5)
  """
  if coupling not in LR_COUPLINGS:
    raise ValueError(f"lr_coupling={coupling!r} is not valid; choose one of {LR_COUPLINGS}")
  answer = 1.0 if lr_schedule is None else lr_schedule(epochs)
  if validation.is_flag(answer):
    raise ValueError(  # float(True) is 1.0: the run would train at the full rate
      f"lr_schedule({epochs:.3f}) must return a number, not a bool, got {answer!r}"
    )
  schedule = float(answer)
  batch_factor = lr_factor(batch_size, base_batch_size, rule, lr_adjust_factor)
  if coupling == "peak" and math.isfinite(schedule):
    batch_factor = (batch_factor - 1.0) * min(max(schedule, 0.0), 1.0) + 1.0
  factor = batch_factor * schedule
  if not 0.0 < factor <= validation.FLOAT32_MAX:  # the step's float32 scalar holds it; NaN fails
    raise ValueError(
      f"the learning-rate factor at epoch {epochs:.3f} would be {factor} "
      f"(lr_schedule returned {schedule}); it must be finite and > 0, within float32's range"
    )
  return factor, schedule
