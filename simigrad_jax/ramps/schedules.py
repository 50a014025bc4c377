"""Host: batch-size controllers without gradient feedback: epoch schedules and the loss plateau rule.

Built by name (:mod:`simigrad_jax.registry`) as ``"linear"``,
``"geometric"``, ``"decreasing"`` and ``"loss_plateau"``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from simigrad_jax import validation
from simigrad_jax.controllers.base import BaseController
from simigrad_jax.controllers.state import check_finite_float
from simigrad_jax.controllers.state import saved_section

# ----------------------------------------------------------------------------
# Schedules: the batch size as a function of the epochs trained.
# ----------------------------------------------------------------------------

SCHEDULE_SHAPES: tuple[str, ...] = ("linear", "geometric")


class PositionSchedule(BaseController):
  """A batch size that is a fixed function of how far training has gone (no feedback).

  The base of the schedules here and in
  :mod:`simigrad_jax.ramps.token_schedules`: a subclass names the
  ``stats`` key it follows in ``POSITION`` (``"epochs"`` or
  ``"examples_seen"``, both counted in examples, so the schedule does not
  depend on how many steps it took), writes :meth:`_unbounded_size_at`, and
  calls :meth:`_narrow_bounds` with the smallest and the largest size it can
  take. The position is saved in the state under ``POSITION``, so a resume
  mid-schedule continues exactly. The similarity is not used (a non-finite
  one still holds the size for that step and is counted, like every
  controller here).
  """

  POSITION: str = "epochs"

  def __init__(self, initial_batch_size: int, **options: Any):
    self.REQUIRED_STATS = (self.POSITION,)
    self._position: float = 0
    super().__init__(initial_batch_size, **options)

  def _narrow_bounds(self, smallest: int, largest: int) -> None:
    """The bounds in :attr:`config` become the range the schedule can reach, within the given ones."""
    self._lower = max(smallest, self._lower or 1)
    self._upper = largest if self._upper is None else min(largest, self._upper)

  def size_at(self, position: float) -> int:
    """The schedule's batch size at ``position`` (epochs or examples seen; within the bounds)."""
    return self._clamp(self._unbounded_size_at(position))

  def _unbounded_size_at(self, position: float) -> int:
    raise NotImplementedError(f"{type(self).__name__} must implement _unbounded_size_at()")

  def _parse_position(self, value: Any) -> float:
    """A saved or reported position, checked (a finite float here)."""
    return check_finite_float(self.POSITION, value)

  def observe(
    self, similarity: float, stats: Mapping[str, Any] | None, finite: bool
  ) -> bool | None:
    assert stats is not None  # update() refuses a step without the REQUIRED_STATS
    value = stats[self.POSITION]
    if not (finite and validation.is_real(value) and math.isfinite(float(value))):
      return False
    self._position = self._parse_position(value)
    return True

  def decide(self) -> int:  # The base class clamps to the bounds (decision "clamped").
    return self._unbounded_size_at(self._position)

  def likely_batch_sizes(self, examples_seen: int, epochs: float) -> list[int]:
    """The schedule's size there: what :meth:`update` will decide after a finite step."""
    if self._holds_next():
      return [self._batch_size]
    return [self.size_at(examples_seen if self.POSITION == "examples_seen" else epochs)]

  def extra_state(self) -> dict[str, Any]:
    return {self.POSITION: self._position}

  def parse_extra_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
    return {"_position": self._parse_position(state[self.POSITION])}

  def _log_details(self, before: int) -> str:
    return f"{self.POSITION} {self._position:.6g}"


class ScheduleController(PositionSchedule):
  """A batch size that follows a fixed schedule in epochs (no feedback).

  With ``e`` the fractional epochs trained so far (``stats["epochs"]``, counted
  in examples, so the schedule does not depend on how many steps it took),
  ``p = min(e / ramp_epochs, 1)`` (or, with ``interval_epochs`` = I,
  ``p = min(floor(e / I) * I / ramp_epochs, 1)``: a staircase), B_0 the
  initial and B_1 the final size:

  * ``shape="linear"``: ``B(e) = round(B_0 + (B_1 - B_0) p)``;
  * ``shape="geometric"``: ``B(e) = round(B_0 (B_1 / B_0)^p)``.

  E.g. ``initial_batch_size=32, final_batch_size=512, ramp_epochs=16,
  interval_epochs=4, shape="geometric"`` doubles the batch every 4 epochs
  (Smith et al. 2017). ``final_batch_size`` below ``initial_batch_size`` gives
  a decreasing schedule. Sizes are clamped to the bounds when given; the
  bounds in :attr:`config` are the range the schedule can reach (the smaller
  and the larger of the two sizes, narrowed by the bounds). The similarity is
  not used (a non-finite one still holds the size for that step and is
  counted, like every controller here). Schedules counted in tokens or
  examples: :mod:`simigrad_jax.ramps.token_schedules`.

  Args:
    initial_batch_size: B_0, the size at epoch 0 (integer >= 1).
    final_batch_size: B_1, the size from ``ramp_epochs`` on (integer >= 1).
    ramp_epochs: the epochs over which the size moves (> 0).
    shape: ``"linear"`` or ``"geometric"``.
    interval_epochs: optional: change the size only every this many epochs
      (> 0), as a staircase.
    batch_size_lower_bound: optional smallest batch size.
    batch_size_upper_bound: optional largest batch size.
    verbose: log each decision (logger ``"simigrad_jax"``, level INFO).

  Note:
    Needs ``stats["epochs"]`` in :meth:`update` (:class:`simigrad_jax.Trainer`
    passes it).
  """

  KIND = "linear"
  POSITION = "epochs"

  def __init__(
    self,
    initial_batch_size: int,
    final_batch_size: int,
    ramp_epochs: float,
    *,
    shape: str = "linear",
    interval_epochs: float | None = None,
    batch_size_lower_bound: int | None = None,
    batch_size_upper_bound: int | None = None,
    verbose: bool = False,
  ):
    b0 = validation.check_int("initial_batch_size", initial_batch_size, 1)
    b1 = validation.check_int("final_batch_size", final_batch_size, 1)
    self._final = b1
    self._ramp = validation.check_real(
      "ramp_epochs", ramp_epochs, "(0, inf)", lambda x: 0.0 < x < math.inf
    )
    if shape not in SCHEDULE_SHAPES:
      raise ValueError(f"shape must be one of {SCHEDULE_SHAPES}, got {shape!r}")
    self._shape = shape
    self._interval = (
      None
      if interval_epochs is None
      else validation.check_real(
        "interval_epochs", interval_epochs, "(0, inf)", lambda x: 0.0 < x < math.inf
      )
    )
    self.KIND = shape  # What config["controller"] and the saved state call it.
    # Checks the given bounds (and B_0 within them), then narrows them to the reachable range.
    super().__init__(
      b0,
      batch_size_lower_bound=batch_size_lower_bound,
      batch_size_upper_bound=batch_size_upper_bound,
      verbose=verbose,
    )
    self._narrow_bounds(min(b0, b1), max(b0, b1))

  @property
  def epochs(self) -> float:
    """The epochs trained so far, as the last update reported them."""
    return self._position

  def _unbounded_size_at(self, position: float) -> int:
    e = max(float(position), 0.0)
    if self._interval is not None:
      e = math.floor(e / self._interval + 1e-9) * self._interval
    p = min(e / self._ramp, 1.0)
    b0, b1 = self._initial, self._final
    if self._shape == "linear":
      value = b0 + (b1 - b0) * p
    else:
      value = b0 * (b1 / b0) ** p
    return int(round(value))

  def settings(self) -> dict[str, Any]:
    return {
      "final_batch_size": self._final,
      "ramp_epochs": self._ramp,
      "shape": self._shape,
      "interval_epochs": self._interval,
    }


def linear_schedule(
  initial_batch_size: int, final_batch_size: int, ramp_epochs: float, **options: Any
) -> ScheduleController:
  """A linear schedule from ``initial_batch_size`` to ``final_batch_size``."""
  return ScheduleController(
    initial_batch_size, final_batch_size, ramp_epochs, shape="linear", **options
  )


def geometric_schedule(
  initial_batch_size: int, final_batch_size: int, ramp_epochs: float, **options: Any
) -> ScheduleController:
  """A geometric schedule from ``initial_batch_size`` to ``final_batch_size``."""
  return ScheduleController(
    initial_batch_size, final_batch_size, ramp_epochs, shape="geometric", **options
  )


def decreasing_schedule(
  initial_batch_size: int,
  final_batch_size: int,
  ramp_epochs: float,
  shape: str = "geometric",
  **options: Any,
) -> ScheduleController:
  """A schedule that shrinks the batch from ``initial_batch_size`` to ``final_batch_size``."""
  if (
    validation.is_int(initial_batch_size)
    and validation.is_int(final_batch_size)
    and not final_batch_size < initial_batch_size
  ):
    raise ValueError(
      f"a decreasing schedule needs final_batch_size < initial_batch_size "
      f"({initial_batch_size}), got {final_batch_size}"
    )
  return ScheduleController(
    initial_batch_size, final_batch_size, ramp_epochs, shape=shape, **options
  )


# ----------------------------------------------------------------------------
# Loss plateau: grow the batch when the epoch loss stops improving.
# ----------------------------------------------------------------------------


class LossPlateauController(BaseController):
  """Multiplies the batch size when the epoch's training loss plateaus.

  The rule of PyTorch's ``ReduceLROnPlateau`` applied to the batch size
  instead of the learning rate (as in the dynamic-batching literature, e.g.
  AdaBatch, Devarakonda et al. 2017, which grows the batch where others decay
  the learning rate). Over each epoch the controller averages the training
  loss, weighting each step by its realised batch size:
  ``L_epoch = sum_t B_t L_t / sum_t B_t``. At the end of the epoch, with
  ``L_best`` the best epoch loss so far:

  * ``L_epoch < L_best - threshold * |L_best|``: an improvement; it becomes
    ``L_best`` and the count of bad epochs restarts at 0;
  * otherwise the count of bad epochs grows by one (not during the
    ``cooldown`` epochs that follow a change);
  * when it reaches ``patience``: ``B -> max(B + 1, round(B * factor))``,
    clamped to ``batch_size_upper_bound``, and the count restarts.

  Args:
    initial_batch_size: B_0 (integer >= 1); the batch never shrinks below it.
    factor: the growth factor (> 1).
    patience: the number of bad epochs in a row that makes the batch grow
      (integer >= 1; PyTorch's ``patience`` counts one fewer).
    threshold: the relative improvement that counts (>= 0).
    cooldown: epochs after a change during which bad epochs are not counted
      (integer >= 0).
    batch_size_lower_bound: optional smallest batch size (at most
      ``initial_batch_size``; :attr:`config` reports ``initial_batch_size``,
      below which the size never goes).
    batch_size_upper_bound: optional largest batch size.
    verbose: log each decision (logger ``"simigrad_jax"``, level INFO).

  Note:
    Needs ``stats["loss"]``, ``stats["batch_size"]`` and ``stats["epoch_end"]``
    in :meth:`update` (:class:`simigrad_jax.Trainer` passes them). A step with
    a non-finite loss is left out of the epoch mean and counted as non-finite;
    if the epoch ends on it, the epoch is still judged, and a growth that is
    due waits for the next finite step. Decisions are ``"hold"`` except at the
    end of a plateau.
  """

  KIND = "loss_plateau"
  REQUIRED_STATS = ("loss", "batch_size", "epoch_end")

  def __init__(
    self,
    initial_batch_size: int,
    *,
    factor: float = 2.0,
    patience: int = 1,
    threshold: float = 0.01,
    cooldown: int = 0,
    batch_size_lower_bound: int | None = None,
    batch_size_upper_bound: int | None = None,
    verbose: bool = False,
  ):
    self._factor = validation.check_real("factor", factor, "(1, inf)", lambda x: 1.0 < x < math.inf)
    self._patience = validation.check_int("patience", patience, 1)
    self._threshold = validation.check_real(
      "threshold", threshold, "[0, inf)", lambda x: 0.0 <= x < math.inf
    )
    self._cooldown = validation.check_int("cooldown", cooldown, 0)
    super().__init__(
      initial_batch_size,
      batch_size_lower_bound=batch_size_lower_bound,
      batch_size_upper_bound=batch_size_upper_bound,
      verbose=verbose,
    )
    self._lower = self._initial
    self._loss_sum = 0.0
    self._loss_weight = 0.0
    self._best: float | None = None
    self._bad_epochs = 0
    self._cooldown_left = 0
    self._epoch_losses: list[float] = []
    self._grow_pending = False

  @property
  def epoch_losses(self) -> list[float]:
    """The mean training loss of every completed epoch."""
    return list(self._epoch_losses)

  @property
  def best_loss(self) -> float | None:
    """The best epoch loss so far (None before the first epoch ends)."""
    return self._best

  def observe(
    self, similarity: float, stats: Mapping[str, Any] | None, finite: bool
  ) -> bool | None:
    assert stats is not None  # update() refuses a step without the REQUIRED_STATS
    loss, weight = stats["loss"], stats["batch_size"]
    finite = (
      finite
      and validation.is_real(loss)
      and math.isfinite(float(loss))
      and validation.is_real(weight)
      and math.isfinite(float(weight))
      and float(weight) > 0
    )
    if finite:
      self._loss_sum += float(loss) * float(weight)
      self._loss_weight += float(weight)
    if stats["epoch_end"]:  # A non-finite last step still ends the epoch.
      self._end_epoch()
    return finite

  def _end_epoch(self) -> None:
    """Closes the epoch: judges its mean loss; a due growth waits in ``_grow_pending``."""
    if self._loss_weight <= 0:
      return
    epoch_loss = self._loss_sum / self._loss_weight
    self._loss_sum, self._loss_weight = 0.0, 0.0
    self._epoch_losses.append(epoch_loss)
    if self._best is None or epoch_loss < self._best - self._threshold * abs(self._best):
      self._best = epoch_loss
      self._bad_epochs = 0
    elif self._cooldown_left > 0:
      self._bad_epochs = 0
    else:
      self._bad_epochs += 1
    self._cooldown_left = max(self._cooldown_left - 1, 0)
    if self._bad_epochs >= self._patience:
      self._bad_epochs = 0
      self._cooldown_left = self._cooldown
      self._grow_pending = True

  def decide(self) -> int:
    if not self._grow_pending:
      return self._batch_size
    self._grow_pending = False
    return self._grown()

  def likely_batch_sizes(self, examples_seen: int, epochs: float) -> list[int]:
    """The size itself, and its growth where the next update may end a plateau.

    The size grows at the end of an epoch that makes ``patience`` bad ones
    in a row (out of the cooldown), or at the first finite step after an
    epoch that ended on a non-finite one (a growth due first); else it holds.
    """
    del examples_seen, epochs
    b, grown = self._batch_size, self._clamp(self._grown())
    if self._holds_next():
      return [b]
    if self._grow_pending:
      return list(dict.fromkeys([grown, b]))
    if self._cooldown_left == 0 and self._bad_epochs + 1 >= self._patience:
      return list(dict.fromkeys([b, grown]))
    return [b]

  def _grown(self) -> int:
    """The size one growth makes of the current one (before the bounds)."""
    b = self._batch_size
    return max(b + 1, int(round(b * self._factor)))

  def settings(self) -> dict[str, Any]:
    return {
      "factor": self._factor,
      "patience": self._patience,
      "threshold": self._threshold,
      "cooldown": self._cooldown,
    }

  def extra_state(self) -> dict[str, Any]:
    return {
      "loss_sum": self._loss_sum,
      "loss_weight": self._loss_weight,
      "best_loss": self._best,
      "bad_epochs": self._bad_epochs,
      "cooldown_left": self._cooldown_left,
      "epoch_losses": list(self._epoch_losses),
      "grow_pending": self._grow_pending,
    }

  def parse_extra_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
    best = state["best_loss"]
    return {
      "_loss_sum": check_finite_float("loss_sum", state["loss_sum"]),
      "_loss_weight": check_finite_float("loss_weight", state["loss_weight"]),
      "_best": None if best is None else check_finite_float("best_loss", best),
      "_bad_epochs": validation.check_int("bad_epochs", state["bad_epochs"], 0),
      "_cooldown_left": validation.check_int("cooldown_left", state["cooldown_left"], 0),
      "_epoch_losses": [
        check_finite_float("epoch_losses[]", x) for x in saved_section(state, "epoch_losses", list)
      ],
      "_grow_pending": validation.check_bool("grow_pending", state["grow_pending"]),
    }

  def _log_details(self, before: int) -> str:
    return f"best epoch loss {self._best}, bad epochs {self._bad_epochs}"


for _factory, _sets in (
  (linear_schedule, ("shape",)),
  (geometric_schedule, ("shape",)),
  (decreasing_schedule, ()),
):
  # Function attributes that the registry's option listing reads, set through __dict__: a
  # function's type declares no such attributes.
  vars(_factory).update(forwards_options_to=ScheduleController, sets_options=_sets)
