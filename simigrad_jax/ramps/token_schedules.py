"""Host: batch-size ramps counted in tokens or examples, the forms language-model trainers use.

Built by name (:mod:`simigrad_jax.registry`) as ``"step_schedule"``
(Megatron-LM's thresholds, ``"0:16,200k:32,600k:64"``), ``"linear_ramp"``
(MaxText's and Megatron's ``--rampup-batch-size``: a start size, an increment
and a ramp length) and ``"doubling_warmup"`` (Merrill et al. 2025: double the
batch at fixed points); ``"seesaw"`` is in
:mod:`simigrad_jax.ramps.seesaw`. Every one is a step schedule: a list
of thresholds, each the count from which a size holds.

The counts are examples seen (``stats["examples_seen"]``), or tokens with
``tokens_per_example`` (a sequence has a fixed length, so ``tokens =
examples * tokens_per_example``); either may be written with a suffix: ``k``
(10^3), ``M`` (10^6), ``B`` or ``G`` (10^9), ``T`` (10^12), e.g. ``"250B"``.
A threshold counts from the first step that starts at or past it, whatever
the sizes of the steps before.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from simigrad_jax import validation
from simigrad_jax.ramps.schedules import PositionSchedule

# The multipliers of a count's suffix.
COUNT_SUFFIXES: dict[str, int] = {
  "": 1,
  "k": 10**3,
  "K": 10**3,
  "M": 10**6,
  "B": 10**9,
  "G": 10**9,
  "T": 10**12,
}
_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")

Thresholds = str | Mapping[Any, Any] | Sequence[Any]


def parse_count(name: str, value: Any) -> int:
  """A count of tokens or examples: an integer >= 0, or a string such as ``"200k"`` or ``"1.5M"``.

  Args:
    name: what the count is, for the error message.
    value: an integer, an integral float, or a number with one of the
      suffixes of :data:`COUNT_SUFFIXES`.

  Returns:
    The count, an int >= 0.

  Raises:
    ValueError: naming the value, for a negative or fractional count or an
      unknown suffix.

  Example:
    >>> from simigrad_jax.ramps.token_schedules import parse_count
    >>> parse_count("threshold", "200k"), parse_count("threshold", "1.5M"), parse_count("t", 64)
    (200000, 1500000, 64)
  """
  if validation.is_int(value):
    count: float = int(value)
  elif validation.is_real(value):
    count = float(value)
  elif isinstance(value, str) and (match := _COUNT.match(value)):
    number, suffix = match.groups()
    if suffix not in COUNT_SUFFIXES:
      raise ValueError(
        f"{name} {value!r} has an unknown suffix {suffix!r}; use one of "
        f"{[s for s in COUNT_SUFFIXES if s]} (10^3, 10^3, 10^6, 10^9, 10^9, 10^12) or none"
      )
    count = float(number) * COUNT_SUFFIXES[suffix]
    if "." not in number and "e" not in number.lower():
      count = int(number) * COUNT_SUFFIXES[suffix]  # exact for any size
  else:
    raise ValueError(
      f"{name} must be a count (an integer >= 0, or a number with a suffix k, M, B, T "
      f"such as '200k'), got {value!r}"
    )
  if not math.isfinite(count) or count < 0 or count != math.floor(count):
    raise ValueError(f"{name} must be a whole count >= 0, got {value!r}")
  return int(count)


def parse_thresholds(thresholds: Thresholds) -> list[tuple[int, int]]:
  """Megatron-style thresholds as a list of ``(count, batch size)``, checked.

  Args:
    thresholds: ``"count:size"`` pairs separated by commas or spaces
      (``"0:16,200k:32,600k:64"``), a mapping ``{count: size}``, or a
      sequence of ``(count, size)`` pairs. Counts take the suffixes of
      :func:`parse_count`.

  Returns:
    The pairs, counts strictly increasing, sizes integers >= 1.

  Raises:
    ValueError: naming the entry, for a malformed pair, a bad count or size,
      or counts that do not increase.

  Example:
    >>> from simigrad_jax.ramps.token_schedules import parse_thresholds
    >>> parse_thresholds("0:16, 200k:32 600k:64")
    [(0, 16), (200000, 32), (600000, 64)]
  """
  if isinstance(thresholds, str):
    pairs: list[Any] = [p.split(":") for p in re.split(r"[,\s]+", thresholds.strip()) if p]
  elif isinstance(thresholds, Mapping):
    pairs = list(thresholds.items())
  elif isinstance(thresholds, Sequence):
    pairs = list(thresholds)
  else:
    raise ValueError(
      f"thresholds must be a string such as '0:16,200k:32', a mapping or a list of "
      f"(count, size) pairs, got {thresholds!r}"
    )
  if not pairs:
    raise ValueError(f"thresholds must hold at least one 'count:size' pair, got {thresholds!r}")
  parsed = []
  for pair in pairs:
    if isinstance(pair, str) or not isinstance(pair, Sequence) or len(pair) != 2:
      raise ValueError(f"each threshold must be a 'count:size' pair, got {pair!r}")
    count, size = pair
    if isinstance(size, str) and size.strip().isdigit():
      size = int(size)
    parsed.append(
      (
        parse_count(f"threshold {pair!r}: the count", count),
        validation.check_int(f"threshold {pair!r}: the batch size", size, 1),
      )
    )
  for (a, _), (b, _) in zip(parsed, parsed[1:], strict=False):
    if b <= a:
      raise ValueError(
        f"threshold counts must increase strictly, got {b} after {a} in {thresholds!r}"
      )
  return parsed


def format_thresholds(thresholds: Sequence[tuple[int, int]]) -> str:
  """The thresholds as a Megatron-style string, ``"0:16,200000:32"`` (what :func:`parse_thresholds` reads)."""
  return ",".join(f"{count}:{size}" for count, size in thresholds)


class StepScheduleController(PositionSchedule):
  """A batch size set by thresholds in tokens or examples: Megatron-LM's step schedule.

  With thresholds ``(t_0, B_0), (t_1, B_1), ...`` (counts increasing) and
  ``n`` the tokens seen (``examples_seen * tokens_per_example``; examples
  without ``tokens_per_example``), the size of the next step is ``B_i`` for
  the largest ``t_i <= n``, and ``initial_batch_size`` before ``t_0``. E.g.
  Megatron-LM's ``"0:768 250B:1536"``. Sizes are clamped to the bounds when
  given; the bounds in :attr:`config` are the range the schedule can reach.
  A resume continues exactly mid-ramp: the state holds ``examples_seen``.

  Args:
    thresholds: ``"count:size"`` pairs (``"0:16,200k:32,600k:64"``), a
      mapping or a list of pairs (see :func:`parse_thresholds`).
    initial_batch_size: the size before the first threshold; optional when
      the first threshold is at 0, and then equal to its size.
    tokens_per_example: optional: the counts are tokens, this many per
      example (integer >= 1); without it they are examples.
    batch_size_lower_bound: optional smallest batch size.
    batch_size_upper_bound: optional largest batch size.
    verbose: log each decision (logger ``"simigrad_jax"``, level INFO).

  Note:
    Needs ``stats["examples_seen"]`` in :meth:`update`
    (:class:`simigrad_jax.Trainer` passes it).

  Example:
    >>> import simigrad_jax
    >>> c = simigrad_jax.make_controller(
    ...     "step_schedule", thresholds="0:16,2k:32,6k:64", tokens_per_example=128)
    >>> [c.update(0.0, stats={"examples_seen": n}) for n in (8, 16, 40, 46, 47)]
    [16, 32, 32, 32, 64]
  """

  KIND = "step_schedule"
  POSITION = "examples_seen"

  def __init__(
    self,
    thresholds: Thresholds,
    *,
    initial_batch_size: int | None = None,
    tokens_per_example: int | None = None,
    batch_size_lower_bound: int | None = None,
    batch_size_upper_bound: int | None = None,
    verbose: bool = False,
  ):
    self._thresholds = parse_thresholds(thresholds)
    self._tokens_per_example = (
      None
      if tokens_per_example is None
      else validation.check_int("tokens_per_example", tokens_per_example, 1)
    )
    first_count, first_size = self._thresholds[0]
    if initial_batch_size is None:
      if first_count != 0:
        raise ValueError(
          f"the first threshold is at {first_count}, not 0: give initial_batch_size, "
          f"the size before it (thresholds {thresholds!r})"
        )
      initial_batch_size = first_size
    initial = validation.check_int("initial_batch_size", initial_batch_size, 1)
    if first_count == 0 and initial != first_size:
      raise ValueError(
        f"initial_batch_size={initial} differs from the schedule's size at 0, {first_size} "
        f"(thresholds {thresholds!r}): set it to {first_size} or leave it out"
      )
    self._counts = [count for count, _ in self._thresholds]
    super().__init__(
      initial,
      batch_size_lower_bound=batch_size_lower_bound,
      batch_size_upper_bound=batch_size_upper_bound,
      verbose=verbose,
    )
    sizes = [initial] + [size for _, size in self._thresholds]
    self._narrow_bounds(min(sizes), max(sizes))

  @property
  def thresholds(self) -> list[tuple[int, int]]:
    """The ``(count, size)`` pairs, counts in tokens with ``tokens_per_example``, else examples."""
    return list(self._thresholds)

  @property
  def examples_seen(self) -> int:
    """The examples seen, as the last update reported them."""
    return int(self._position)

  def count_of(self, examples_seen: int) -> int:
    """The schedule's count after ``examples_seen`` examples: tokens or examples."""
    return int(examples_seen) * (self._tokens_per_example or 1)

  def _unbounded_size_at(self, position: float) -> int:
    index = bisect.bisect_right(self._counts, self.count_of(int(position)))
    return self._initial if index == 0 else self._thresholds[index - 1][1]

  def _parse_position(self, value: Any) -> float:
    if not (validation.is_int(value) or (validation.is_real(value) and float(value).is_integer())):
      raise ValueError(f"examples_seen must be an integer >= 0, got {value!r}")
    return validation.check_int("examples_seen", int(value), 0)

  def settings(self) -> dict[str, Any]:
    return {
      "thresholds": [list(pair) for pair in self._thresholds],
      "tokens_per_example": self._tokens_per_example,
    }


class LinearRampController(StepScheduleController):
  """A batch size that grows by a fixed increment at evenly spaced counts: MaxText's ramp.

  Megatron-LM's ``--rampup-batch-size <start> <increment> <samples>`` and
  MaxText's batch-size ramp-up (``per_device_batch_size_start``,
  ``per_device_batch_size_increment``, ``global_rampup_samples``): with
  ``n = (final - initial) / increment`` increments over ``ramp`` tokens (or
  examples), the size after ``c`` of them is
  ``min(initial + increment * floor(c / (ramp / n)), final)``: it reaches
  ``final_batch_size`` at ``ramp``.

  Args:
    initial_batch_size: the size at 0 (integer >= 1).
    final_batch_size: the size from ``ramp`` on (integer > initial).
    increment: the growth at each threshold (integer >= 1 that divides
      ``final - initial``).
    ramp: the tokens (or examples) over which the size grows (a count, e.g.
      ``"600k"``; at least one per increment).
    tokens_per_example: optional: ``ramp`` is in tokens, this many per
      example; without it, in examples.
    batch_size_lower_bound, batch_size_upper_bound, verbose: as for
      :class:`StepScheduleController`.

  Example:
    >>> import simigrad_jax
    >>> c = simigrad_jax.make_controller("linear_ramp", initial_batch_size=16,
    ...     final_batch_size=64, increment=16, ramp=300)
    >>> c.thresholds
    [(0, 16), (100, 32), (200, 48), (300, 64)]
  """

  KIND = "linear_ramp"

  def __init__(
    self,
    initial_batch_size: int,
    final_batch_size: int,
    increment: int,
    ramp: int | str,
    *,
    tokens_per_example: int | None = None,
    batch_size_lower_bound: int | None = None,
    batch_size_upper_bound: int | None = None,
    verbose: bool = False,
  ):
    b0 = validation.check_int("initial_batch_size", initial_batch_size, 1)
    b1 = validation.check_int("final_batch_size", final_batch_size, b0 + 1)
    step = validation.check_int("increment", increment, 1)
    if (b1 - b0) % step:
      raise ValueError(
        f"increment={step} must divide final_batch_size - initial_batch_size = {b1 - b0}"
      )
    length = parse_count("ramp", ramp)
    increments = (b1 - b0) // step
    if length < increments:
      raise ValueError(
        f"ramp={ramp!r} is shorter than its {increments} increments: give a ramp >= {increments}"
      )
    self._ramp_settings = {"final_batch_size": b1, "increment": step, "ramp": length}
    per = length / increments
    thresholds = [(0, b0)] + [(math.ceil(k * per), b0 + k * step) for k in range(1, increments + 1)]
    super().__init__(
      thresholds,
      initial_batch_size=b0,
      tokens_per_example=tokens_per_example,
      batch_size_lower_bound=batch_size_lower_bound,
      batch_size_upper_bound=batch_size_upper_bound,
      verbose=verbose,
    )

  def settings(self) -> dict[str, Any]:
    return {**self._ramp_settings, **super().settings()}


def doubling_thresholds(
  initial_batch_size: int, points: Sequence[Any] | str, name: str
) -> list[tuple[int, int]]:
  """``[(0, B), (p_1, 2B), (p_2, 4B), ...]``: the batch doubled at each of ``points`` (counts)."""
  b0 = validation.check_int("initial_batch_size", initial_batch_size, 1)
  if isinstance(points, str):
    points = [p for p in re.split(r"[,\s]+", points.strip()) if p]
  if isinstance(points, Mapping) or not isinstance(points, Sequence) or not points:
    raise ValueError(
      f"{name} must be a non-empty list of counts such as '200k,600k', got {points!r}"
    )
  counts = [parse_count(f"{name}[{i}]", p) for i, p in enumerate(points)]
  if counts[0] == 0:
    raise ValueError(f"{name} must be > 0 (the batch starts at initial_batch_size), got {points!r}")
  return [(0, b0)] + [(count, b0 * 2 ** (k + 1)) for k, count in enumerate(counts)]


class DoublingWarmupController(StepScheduleController):
  """Batch-size warmup: the batch doubles at fixed token counts (Merrill et al. 2025).

  "Critical Batch Size Revisited" (Merrill, Arora, Groeneveld, Hajishirzi,
  arXiv 2505.23971) measures that the critical batch size grows quickly early
  in training and then levels off, and trains OLMo 1B with a batch that starts
  small and doubles at fixed token counts, to a slightly better loss with 43%
  fewer gradient steps. Here: ``B = initial * 2^k`` after the ``k``-th of
  ``doubling_points``, clamped to ``batch_size_upper_bound``.

  Args:
    initial_batch_size: the size at 0 (integer >= 1).
    doubling_points: the counts (tokens with ``tokens_per_example``, else
      examples) at which the batch doubles, increasing and > 0: a list or a
      string such as ``"200k,600k"``.
    tokens_per_example: optional: the counts are tokens, this many per example.
    batch_size_lower_bound, batch_size_upper_bound, verbose: as for
      :class:`StepScheduleController`.

  Example:
    >>> import simigrad_jax
    >>> simigrad_jax.make_controller("doubling_warmup", initial_batch_size=16,
    ...     doubling_points="2k,6k", tokens_per_example=64).thresholds
    [(0, 16), (2000, 32), (6000, 64)]
  """

  KIND = "doubling_warmup"

  def __init__(
    self,
    initial_batch_size: int,
    doubling_points: Sequence[Any] | str,
    *,
    tokens_per_example: int | None = None,
    batch_size_lower_bound: int | None = None,
    batch_size_upper_bound: int | None = None,
    verbose: bool = False,
  ):
    super().__init__(
      doubling_thresholds(initial_batch_size, doubling_points, "doubling_points"),
      initial_batch_size=initial_batch_size,
      tokens_per_example=tokens_per_example,
      batch_size_lower_bound=batch_size_lower_bound,
      batch_size_upper_bound=batch_size_upper_bound,
      verbose=verbose,
    )
