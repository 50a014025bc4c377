"""Host: what a grid of compiled shapes costs a run: its programs, and the padding of its steps.

Host side: plain Python, pure functions, no JAX.

A finer grid (more shapes per octave, :class:`~simigrad_jax.shapes.BucketPolicy`)
pads less and compiles more. Each shape of the grid that a run's batch sizes
need is a compiled program (one for a step of one micro-batch; a micro-step
where a step accumulates), each a few seconds of XLA; each step pads its
batch up to ``num_devices * micro_batch_size * accumulation_steps`` rows.
Part of that padding no grid removes: every device computes the same number
of rows, so a batch is at least padded to a whole number of rows per device
(the *floor*, which dominates where a batch is a few rows per device).

:func:`grid_cost` measures one grid over a run whose batch sizes spread
evenly in log scale over ``[lower, upper]`` (as a batch that grows or shrinks
by a fixed factor per step visits them), each step's padding counted against
the rows it computes. :func:`choose_shapes_per_octave` picks the coarsest
grid whose padding stays within a budget: the grid the Trainer compiles when
``CompileConfig.shapes_per_octave`` is None.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from simigrad_jax import validation
from simigrad_jax.shapes import batch_plan

__all__ = ["GridCost", "choose_shapes_per_octave", "grid_cost"]

# The padding a grid chosen by :func:`choose_shapes_per_octave` may cost, as a fraction of the
# rows computed, above the floor where the floor itself exceeds it.
PADDING_BUDGET = 0.06
# The batch sizes a cost is measured on: every one of the bounds up to this many, else this many
# spread evenly in log scale.
_SAMPLES = 1 << 17


@dataclasses.dataclass(frozen=True)
class GridCost:
  """What one grid costs a run over ``[lower, upper]``.

  Attributes:
    shapes_per_octave: the grid's shapes per factor of two.
    shapes: the grid's shapes that batch sizes in ``[lower, upper]`` use
      (rows per device): each one a program to compile.
    padding_fraction: padded rows over rows computed, the batch sizes spread
      evenly in log scale over ``[lower, upper]``.
    floor_fraction: the part of it no grid removes: the padding to whole rows
      per device.
    shapes_per_step: the most micro-steps that hold a step's rows beyond its
      micro-steps of the largest shape (:class:`~simigrad_jax.shapes.BucketPolicy`).
  """

  shapes_per_octave: int
  shapes: tuple[int, ...]
  padding_fraction: float
  floor_fraction: float
  shapes_per_step: int = 1

  @property
  def programs(self) -> int:
    """The shapes to compile."""
    return len(self.shapes)


def _batch_sizes(lower: int, upper: int) -> tuple[np.ndarray, np.ndarray]:
  """The sizes a cost is measured on, and their weights: every size of ``[lower, upper]``,
  weighing ``1 / B``; or, for wider bounds, :data:`_SAMPLES` sizes spread evenly in log scale
  (their spacing weighs them ``1 / B`` already), weighing one each."""
  if upper - lower < _SAMPLES:
    sizes = np.arange(lower, upper + 1, dtype=np.int64)
    return sizes, 1.0 / sizes
  points = np.geomspace(lower, upper, _SAMPLES)
  return np.round(points).astype(np.int64), np.ones(_SAMPLES)


def grid_cost(
  num_devices: int,
  max_micro_batch_size: int,
  lower: int,
  upper: int,
  shapes_per_octave: int,
  min_micro_batch_size: int = 1,
  shapes_per_step: int = 1,
) -> GridCost:
  """The programs and the padding of one grid over a run in ``[lower, upper]``.

  Each batch size ``B`` weighs ``1 / B`` (a batch that moves by a fixed factor
  per step spends as many steps in each octave), so the padding fraction is
  ``sum(padded / B) / sum(rows / B)`` over the sizes.

  Args:
    num_devices: the data-parallel devices (slots) a batch is planned over.
    max_micro_batch_size: the largest shape, rows per device.
    lower: the smallest global batch size of the run.
    upper: the largest, at least ``lower``.
    shapes_per_octave: the grid's shapes per factor of two.
    min_micro_batch_size: the smallest shape the grid may have.
    shapes_per_step: the most micro-steps that hold a step's rows beyond its
      micro-steps of the largest shape (1: a step on one shape).

  Returns:
    A :class:`GridCost`.

  Example:
    >>> cost = grid_cost(8, 64, 32, 256, shapes_per_octave=1)
    >>> cost.shapes, cost.programs
    ((4, 8, 16, 32), 4)
  """
  n = validation.check_int("num_devices", num_devices)
  lo, hi = validation.check_int("lower", lower), validation.check_int("upper", upper)
  if hi < lo:
    raise ValueError(f"upper must be an int >= lower={lo}, got {hi!r}")
  policy = batch_plan.BucketPolicy(
    max_micro_batch_size,
    min_micro_batch_size,
    shapes_per_octave=shapes_per_octave,
    shapes_per_step=shapes_per_step,
  )
  first = batch_plan.bucket_shapes(policy, n, lo, hi)
  grid = batch_plan.BucketPolicy(
    max_micro_batch_size, min(first), shapes_per_octave=shapes_per_octave
  ).micro_batch_sizes()
  shapes = batch_plan.bucket_shapes(
    dataclasses.replace(policy, min_micro_batch_size=min(first)), n, lo, hi
  )
  sizes, weights = _batch_sizes(lo, hi)
  # plan_batch's plans, for every size at once.
  top = grid[-1]
  per_device = -(-sizes // n)
  steps = -(-per_device // top)
  if shapes_per_step == 1:  # the fewest micro-steps, the smallest shape
    compiled = np.asarray(grid)
    rows = n * steps * compiled[np.searchsorted(compiled, -(-per_device // steps))]
  else:  # ``top`` and the rest, whose rows per device depend on the rest alone
    rest_rows = np.array(
      [0] + [sum(batch_plan.step_shapes(r, grid, shapes_per_step)) for r in range(1, top + 1)]
    )
    rows = n * ((steps - 1) * top + rest_rows[per_device - (steps - 1) * top])
  padded = float(np.sum((rows - sizes) * weights))
  floor = float(np.sum((-(-sizes // n) * n - sizes) * weights))
  computed = float(np.sum(rows * weights))
  return GridCost(shapes_per_octave, shapes, padded / computed, floor / computed, shapes_per_step)


def choose_shapes_per_octave(
  num_devices: int,
  max_micro_batch_size: int,
  lower: int,
  upper: int,
  min_micro_batch_size: int = 1,
  budget: float = PADDING_BUDGET,
  shapes_per_step: int = 1,
) -> int:
  """The coarsest grid whose padding over ``[lower, upper]`` stays within ``budget``.

  The fewest shapes per octave whose :func:`grid_cost` padding is at most
  ``budget``, or, where the floor (whole rows per device, which no grid
  removes) takes more than half of it, at most ``budget / 2`` above the
  floor; when none is, the coarsest of those that pad least.

  Args:
    num_devices: the data-parallel devices (slots).
    max_micro_batch_size: the largest shape, rows per device.
    lower: the smallest global batch size of the run.
    upper: the largest.
    min_micro_batch_size: the smallest shape the grid may have.
    budget: the padding allowed, a fraction of the rows computed.
    shapes_per_step: the most micro-steps that hold a step's rows beyond its
      micro-steps of the largest shape.

  Returns:
    An int in ``[1, MAX_SHAPES_PER_OCTAVE]``.

  Example:
    >>> choose_shapes_per_octave(8, 64, 16, 512)
    6
  """
  best = None
  for per_octave in range(1, batch_plan.MAX_SHAPES_PER_OCTAVE + 1):
    cost = grid_cost(
      num_devices,
      max_micro_batch_size,
      lower,
      upper,
      per_octave,
      min_micro_batch_size,
      shapes_per_step,
    )
    if cost.padding_fraction <= max(budget, cost.floor_fraction + budget / 2):
      return per_octave
    if best is None or cost.padding_fraction < best.padding_fraction:
      best = cost
  assert best is not None
  return best.shapes_per_octave
