"""Host: Seesaw, a batch that doubles where the learning-rate schedule would halve the rate.

Built by name (:mod:`simigrad_jax.registry`) as ``"seesaw"``.
Meterez et al. 2025 ("Seesaw: Accelerating Training by Balancing Learning
Rate and Batch Size Scheduling", arXiv 2510.14717): wherever a standard
schedule (e.g. cosine decay) would halve the learning rate, multiply it by
``1/sqrt(2)`` instead and double the batch size. It matches cosine decay at
equal FLOPs with about 36% fewer serial steps.

The batch follows the halving points like
:class:`~simigrad_jax.ramps.token_schedules.DoublingWarmupController`;
the learning rate is the Trainer's: its ``LearningRateConfig(rule="sqrt")`` already gives
``sqrt(B / B_0)``, so the schedule that makes it Seesaw's is the step schedule
that halves at the same points (:meth:`SeesawController.lr_schedule`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from typing import Any

from simigrad_jax import validation
from simigrad_jax.controllers import learning_rate
from simigrad_jax.ramps.token_schedules import StepScheduleController
from simigrad_jax.ramps.token_schedules import doubling_thresholds
from simigrad_jax.ramps.token_schedules import parse_count


def cosine_halving_points(
  decay_start: int | str,
  decay_end: int | str,
  num_halvings: int,
  final_lr_fraction: float = 0.0,
) -> list[int]:
  """The counts at which a cosine decay halves the learning rate, 1, 2, ... times.

  The cosine goes from 1 at ``decay_start`` to ``f = final_lr_fraction`` at
  ``decay_end``: ``lr(t) = f + (1 - f) (1 + cos(pi p)) / 2`` with
  ``p = (t - decay_start) / (decay_end - decay_start)``. It reaches ``2^-k`` at
  ``p_k = arccos(2 (2^-k - f) / (1 - f) - 1) / pi``; the point is rounded up
  to a whole count.

  Args:
    decay_start: where the decay starts (the end of the warmup), a count
      (tokens or examples; suffixes as in
      :func:`~simigrad_jax.ramps.token_schedules.parse_count`).
    decay_end: where it ends (> decay_start).
    num_halvings: how many points (integer >= 1); ``2^-num_halvings`` must
      lie above ``final_lr_fraction``.
    final_lr_fraction: the cosine's last value, in [0, 1).

  Returns:
    The increasing counts.

  Example:
    >>> from simigrad_jax.ramps.seesaw import cosine_halving_points
    >>> cosine_halving_points(0, 1200, 3)
    [600, 800, 924]
  """
  start, end = parse_count("decay_start", decay_start), parse_count("decay_end", decay_end)
  if end <= start:
    raise ValueError(f"decay_end ({decay_end!r}) must lie after decay_start ({decay_start!r})")
  count = validation.check_int("num_halvings", num_halvings, 1)
  floor = validation.check_real(
    "final_lr_fraction", final_lr_fraction, "[0, 1)", lambda f: 0.0 <= f < 1.0
  )
  if 0.5**count <= floor:
    raise ValueError(
      f"a cosine that ends at final_lr_fraction={floor} halves the rate fewer than "
      f"num_halvings={count} times: use num_halvings <= {math.floor(-math.log2(floor))}"
      if floor > 0
      else f"num_halvings={count} is too large"
    )
  points = []
  for k in range(1, count + 1):
    p = math.acos(2.0 * (0.5**k - floor) / (1.0 - floor) - 1.0) / math.pi
    points.append(math.ceil(start + p * (end - start) - 1e-9))
  return points


class SeesawController(StepScheduleController):
  """Seesaw: the batch doubles, and the learning rate falls by ``1/sqrt(2)``, at each halving point.

  With ``k`` the halving points passed (counted in tokens with
  ``tokens_per_example``, else in examples), the batch size is
  ``B_k = min(B_0 2^k, batch_size_upper_bound)`` and the learning rate
  ``lr_0 2^-k sqrt(B_k / B_0)``: ``lr_0 / sqrt(2)^k`` while the batch can double
  (Seesaw's rule), and a plain halving per point once the batch is at its
  bound (the standard schedule again). Both keep ``lr / sqrt(B)`` halving at
  each point, the product that Seesaw's analysis holds fixed for Adam.

  The batch-size half is this controller; the learning-rate half is the
  Trainer's ``lr_schedule``, built by :meth:`lr_schedule`: with the
  Trainer's ``LearningRateConfig(rule="sqrt")`` it is ``2^-k`` (times your warmup, if any).

  Args:
    initial_batch_size: B_0, the size at 0 (integer >= 1).
    halving_points: the counts at which the standard schedule would halve the
      learning rate: a list or a string such as ``"600k,800k"``; or give
      ``decay_start``, ``decay_end`` and ``num_halvings`` instead (the points
      of a cosine decay, :func:`cosine_halving_points`).
    decay_start, decay_end, num_halvings, final_lr_fraction: the cosine
      decay whose halving points to use (see :func:`cosine_halving_points`).
    tokens_per_example: optional: the counts are tokens, this many per example.
    batch_size_lower_bound, batch_size_upper_bound, verbose: as for
      :class:`~simigrad_jax.ramps.token_schedules.StepScheduleController`.

  Example:
    >>> import simigrad_jax
    >>> c = simigrad_jax.make_controller("seesaw", initial_batch_size=16,
    ...     halving_points="1k,2k", tokens_per_example=100)
    >>> schedule = c.lr_schedule(num_examples=100)  # epochs of 100 examples
    >>> [(c.size_at(n), schedule(n / 100)) for n in (0, 10, 20)]
    [(16, 1.0), (32, 0.5), (64, 0.25)]
  """

  KIND = "seesaw"

  def __init__(
    self,
    initial_batch_size: int,
    halving_points: Sequence[Any] | str | None = None,
    *,
    decay_start: int | str | None = None,
    decay_end: int | str | None = None,
    num_halvings: int | None = None,
    final_lr_fraction: float = 0.0,
    tokens_per_example: int | None = None,
    batch_size_lower_bound: int | None = None,
    batch_size_upper_bound: int | None = None,
    verbose: bool = False,
  ):
    cosine = (decay_start, decay_end, num_halvings)
    if halving_points is None:
      if any(value is None for value in cosine):
        raise ValueError(
          "seesaw needs halving_points, or decay_start, decay_end and num_halvings (the "
          f"points of a cosine decay); got decay_start={decay_start!r}, "
          f"decay_end={decay_end!r}, num_halvings={num_halvings!r}"
        )
      halving_points = cosine_halving_points(
        decay_start,  # type: ignore[arg-type]  # (checked above)
        decay_end,  # type: ignore[arg-type]
        num_halvings,  # type: ignore[arg-type]
        final_lr_fraction,
      )
    elif any(value is not None for value in cosine):
      raise ValueError("give halving_points or decay_start, decay_end and num_halvings, not both")
    thresholds = doubling_thresholds(initial_batch_size, halving_points, "halving_points")
    self._halvings = [count for count, _ in thresholds[1:]]
    super().__init__(
      thresholds,
      initial_batch_size=initial_batch_size,
      tokens_per_example=tokens_per_example,
      batch_size_lower_bound=batch_size_lower_bound,
      batch_size_upper_bound=batch_size_upper_bound,
      verbose=verbose,
    )

  @property
  def halving_points(self) -> list[int]:
    """The counts at which the batch doubles and the learning rate falls."""
    return list(self._halvings)

  def halvings_at(self, examples_seen: int) -> int:
    """``k``: how many halving points lie at or before ``examples_seen`` examples."""
    return bisect.bisect_right(self._halvings, self.count_of(examples_seen))

  def lr_schedule_factor(
    self,
    examples_seen: int,
    lr_rule: learning_rate.LrRule = "sqrt",
    lr_adjust_factor: float | None = None,
  ) -> float:
    """The Trainer's ``lr_schedule`` value after ``examples_seen`` examples.

    Seesaw's learning rate ``2^-k sqrt(B_k / B_0)`` divided by what the
    Trainer's batch-size rule already gives at ``B_k``
    (:func:`simigrad_jax.lr_factor`); ``2^-k`` under ``LearningRateConfig(rule="sqrt")``.
    """
    size = self.size_at(examples_seen)
    seesaw = 0.5 ** self.halvings_at(examples_seen) * math.sqrt(size / self._initial)
    return seesaw / learning_rate.lr_factor(size, self._initial, lr_rule, lr_adjust_factor)

  def lr_schedule(
    self,
    num_examples: int,
    lr_rule: learning_rate.LrRule = "sqrt",
    lr_adjust_factor: float | None = None,
    base_schedule: Callable[[float], float] | None = None,
  ) -> Callable[[float], float]:
    """The ``lr_schedule`` to give :class:`simigrad_jax.Trainer` with this controller.

    Args:
      num_examples: the examples in one epoch (the Trainer's schedule is a
        function of epochs, ``examples_seen / num_examples``).
      lr_rule, lr_adjust_factor: the Trainer's (its defaults: ``"sqrt"``,
        None).
      base_schedule: optional ``base_schedule(epochs) -> float`` to multiply,
        e.g. the warmup (not the decay: Seesaw replaces it).

    Returns:
      ``schedule(epochs) -> float``.
    """
    size = validation.check_int("num_examples", num_examples, 1)
    learning_rate.lr_factor(self._initial, self._initial, lr_rule, lr_adjust_factor)  # checks

    def schedule(epochs: float) -> float:
      factor = self.lr_schedule_factor(round(epochs * size), lr_rule, lr_adjust_factor)
      return factor * (1.0 if base_schedule is None else float(base_schedule(epochs)))

    return schedule

  def settings(self) -> dict[str, Any]:
    return {"halving_points": list(self._halvings), **super().settings()}
