"""StepLayout: the grid of compiled shapes a run's bounds need, and the shapes of accumulation."""

import math

import pytest

from simigrad_jax.shapes import grid_costs
from simigrad_jax.shapes.batch_plan import BucketPolicy
from simigrad_jax.shapes.layout import StepLayout


@pytest.mark.parametrize("halves, num_devices", [("device", 8), ("local", 3)])
@pytest.mark.parametrize("per_octave", [1, 8])
def test_grid_and_accumulation_shapes_are_those_the_plans_use(halves, num_devices, per_octave):
  lower, upper = 20, 300
  layout = StepLayout.create(
    halves,
    num_devices,
    mode="recompile",
    max_micro=8,
    min_micro=None,
    lower=lower,
    upper=upper,
    shapes_per_octave=per_octave,
  )
  plans = [layout.plan(size) for size in range(lower, upper + 1)]
  assert set(layout.grid) == {p.micro_batch_size for p in plans}
  accumulating = {p.micro_batch_size for p in plans if p.accumulation_steps > 1}
  assert layout.accumulation_shapes(upper) == sorted(accumulating, reverse=True)
  assert layout.accumulation_shapes(layout.num_slots * max(layout.grid)) == []
  # The fewest micro-steps the largest shape allows.
  top = layout.num_slots * max(layout.grid)
  assert all(p.accumulation_steps == -(-p.global_batch_size // top) for p in plans)


def test_the_finer_grid_pads_less():
  def padding(per_octave):
    layout = StepLayout.create(
      "device", 8, mode="recompile", max_micro=32, min_micro=None, lower=64, upper=256,
      shapes_per_octave=per_octave,
    )  # fmt: skip
    plans = [layout.plan(size) for size in range(64, 257)]
    return sum(p.padded_examples for p in plans) / sum(p.rows_per_step for p in plans)

  assert padding(8) < 0.05 < 0.15 < padding(1)


def test_the_default_grid_is_the_coarsest_within_the_padding_budget():
  layout = StepLayout.create(
    "device", 8, mode="recompile", max_micro=128, min_micro=None, lower=64, upper=1024,
    shapes_per_octave=None,
  )  # fmt: skip
  chosen = grid_costs.choose_shapes_per_octave(8, 128, 64, 1024)
  assert layout.policy.shapes_per_octave == chosen == 6
  assert grid_costs.grid_cost(8, 128, 64, 1024, chosen).padding_fraction <= 0.06
  assert grid_costs.grid_cost(8, 128, 64, 1024, chosen - 1).padding_fraction > 0.06
  assert layout.grid == BucketPolicy(128, 8, shapes_per_octave=6).micro_batch_sizes()
  assert layout.grid[0] == 8 and layout.grid[-1] == 128 and len(layout.grid) == 25


def test_shapes_near_a_shape_are_those_within_the_window_nearest_first():
  layout = StepLayout.create(
    "device", 8, mode="recompile", max_micro=128, min_micro=None, lower=64, upper=1024,
    shapes_per_octave=None,
  )  # fmt: skip
  near = layout.shapes_near(32, 0.5)
  assert near[0] == 32 and set(near) == {m for m in layout.grid if 32 / 2**0.5 <= m <= 32 * 2**0.5}
  distances = [abs(math.log2(m / 32)) for m in near]
  assert distances == sorted(distances) and 23 in near and 46 not in near
  assert layout.shapes_near(32) == layout.shapes_by_distance(8 * 32)  # no window: the whole grid
  assert len(layout.shapes_near(32)) == len(layout.grid)
  assert layout.shapes_by_distance(8 * 32, 0.5) == near
