"""Tests for simigrad_jax.shapes.grid_costs: a grid's programs and padding, and the grid chosen."""

import doctest
import pathlib

import pytest

from simigrad_jax.shapes import batch_plan
from simigrad_jax.shapes import grid_costs

ROOT = pathlib.Path(__file__).resolve().parents[2]
# docs/compiling.md's table: the two recipes' devices, largest shape and bounds.
RECIPES = {
  "digits demo": (8, 64, 16, 512),
  "shakespeare LM": (8, 32, 16, 256),
}
TABLE_SHAPES_PER_OCTAVE = (1, 2, 3, 4, 6, 8, 16)


def test_doctests():
  assert doctest.testmod(grid_costs).failed == 0


def _plan_by_plan(num_devices, top, lower, upper, per_octave, per_step=1):
  """The padding and the floor over every size in the bounds, weighted 1 / B, by plan_batch;
  and the shapes its plans use."""
  grid = batch_plan.BucketPolicy(top, 1, shapes_per_octave=per_octave, shapes_per_step=per_step)
  shapes = batch_plan.bucket_shapes(grid, num_devices, lower, upper)
  policy = batch_plan.BucketPolicy(
    top, min(shapes), shapes_per_octave=per_octave, shapes_per_step=per_step
  )
  padded = rows = floor = 0.0
  used = set()
  for size in range(lower, upper + 1):
    plan = batch_plan.plan_batch(size, num_devices, policy)
    used.update(plan.shapes)
    padded += plan.padded_examples / size
    rows += plan.rows_per_step / size
    floor += (-(-size // num_devices) * num_devices - size) / size
  assert used == set(shapes), (sorted(used), shapes)  # bucket_shapes: exactly those used
  return shapes, padded / rows, floor / rows


@pytest.mark.parametrize("per_step", [1, 2, 3])
@pytest.mark.parametrize("per_octave", [1, 3, 8])
@pytest.mark.parametrize("bounds", [(8, 64, 16, 400), (4, 7, 3, 100), (1, 16, 1, 40)])
def test_grid_cost_is_plan_batch_over_the_bounds(bounds, per_octave, per_step):
  cost = grid_costs.grid_cost(*bounds, shapes_per_octave=per_octave, shapes_per_step=per_step)
  shapes, padding, floor = _plan_by_plan(*bounds, per_octave, per_step)
  assert cost.shapes == shapes and cost.programs == len(shapes)
  assert cost.padding_fraction == pytest.approx(padding, rel=1e-9)
  assert cost.floor_fraction == pytest.approx(floor, rel=1e-9)
  assert 0 <= cost.floor_fraction <= cost.padding_fraction < 1


def test_wide_bounds_are_sampled_in_log_scale_close_to_every_size(monkeypatch):
  monkeypatch.setattr(grid_costs, "_SAMPLES", 2048)  # [16, 8192] sampled, not every size
  cost = grid_costs.grid_cost(8, 64, 16, 8192, shapes_per_octave=4)
  _, padding, floor = _plan_by_plan(8, 64, 16, 8192, 4)
  assert cost.padding_fraction == pytest.approx(padding, abs=0.005)
  assert cost.floor_fraction == pytest.approx(floor, abs=0.005)


@pytest.mark.parametrize("per_step", [1, 3])
@pytest.mark.parametrize("bounds", [*RECIPES.values(), (8, 300, 8, 1600), (2, 64, 2, 128)])
def test_the_chosen_grid_is_the_coarsest_within_the_budget(bounds, per_step):
  chosen = grid_costs.choose_shapes_per_octave(*bounds, shapes_per_step=per_step)
  allowed = lambda cost: cost.padding_fraction <= max(0.06, cost.floor_fraction + 0.03)
  cost_of = lambda s: grid_costs.grid_cost(*bounds, shapes_per_octave=s, shapes_per_step=per_step)
  assert allowed(cost_of(chosen))
  for coarser in range(1, chosen):
    assert not allowed(cost_of(coarser))


def test_steps_of_several_shapes_reach_the_budget_on_a_coarser_grid():
  for bounds in RECIPES.values():
    one = grid_costs.choose_shapes_per_octave(*bounds, shapes_per_step=1)
    three = grid_costs.choose_shapes_per_octave(*bounds, shapes_per_step=3)
    assert three < one
    cost_one = grid_costs.grid_cost(*bounds, shapes_per_octave=one)
    cost_three = grid_costs.grid_cost(*bounds, shapes_per_octave=three, shapes_per_step=3)
    assert cost_three.programs < cost_one.programs
    assert cost_three.padding_fraction <= cost_one.padding_fraction


def test_bounds_no_grid_meets_get_the_coarsest_grid_that_pads_least():
  # 4 rows a device at most, up to 256: accumulation pads whatever the grid.
  chosen = grid_costs.choose_shapes_per_octave(8, 4, 16, 256, budget=0.0)
  costs = [grid_costs.grid_cost(8, 4, 16, 256, s) for s in range(1, 17)]
  least = min(cost.padding_fraction for cost in costs)
  assert costs[chosen - 1].padding_fraction == least
  assert all(cost.padding_fraction > least for cost in costs[: chosen - 1])


def test_bad_bounds_are_named():
  with pytest.raises(ValueError, match="upper must be an int >= lower=16, got 8"):
    grid_costs.grid_cost(8, 64, 16, 8, shapes_per_octave=2)
  with pytest.raises(ValueError, match="shapes_per_octave must be an int in"):
    grid_costs.grid_cost(8, 64, 16, 64, shapes_per_octave=0)


def markdown_table():
  """docs/compiling.md's table, from grid_cost: steps on one shape on each grid, and steps of
  two and three shapes on the coarse grids and the one chosen for them."""
  lines = [
    "| recipe (devices, largest shape, bounds) | shapes a step | shapes per octave | shapes"
    " | padding | of it, whole rows per device |",
    "|---|---|---|---|---|---|",
  ]
  for name, bounds in RECIPES.items():
    devices, top, lower, upper = bounds
    label = f"{name} ({devices}, {top}, [{lower}, {upper}])"
    for per_step in (1, 2, 3):
      chosen = grid_costs.choose_shapes_per_octave(*bounds, shapes_per_step=per_step)
      octaves = TABLE_SHAPES_PER_OCTAVE if per_step == 1 else TABLE_SHAPES_PER_OCTAVE[:3]
      for per_octave in sorted({*octaves, chosen}):
        cost = grid_costs.grid_cost(*bounds, shapes_per_octave=per_octave, shapes_per_step=per_step)
        mark = " (chosen)" if per_octave == chosen else ""
        lines.append(
          f"| {label} | {per_step} | {per_octave}{mark} | {cost.programs}"
          f" | {100 * cost.padding_fraction:.1f}% | {100 * cost.floor_fraction:.1f}% |"
        )
  return "\n".join(lines)


def test_the_docs_table_is_computed():
  page = (ROOT / "docs" / "compiling.md").read_text()
  start = "<!-- grid costs table: tests/shapes/grid_costs_test.py markdown_table() -->\n"
  end = "\n<!-- end grid costs table -->"
  assert start in page and end in page, "docs/compiling.md lost the markers of its table"
  assert page[page.index(start) + len(start) : page.index(end)] == markdown_table(), (
    "docs/compiling.md's table differs from grid_cost: regenerate it with "
    "python -c 'from tests.shapes.grid_costs_test import markdown_table; print(markdown_table())'"
  )
