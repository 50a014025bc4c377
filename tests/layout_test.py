"""StepLayout: the grid of compiled shapes a run's bounds need, and the shapes of accumulation."""

import pytest

from simigrad_jax.engine.layout import StepLayout


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


@pytest.mark.parametrize(
  "max_micro, lower, upper, per_octave",
  [(32, 64, 1024, 7), (64, 16, 512, 3), (8, 64, 64, 8), (2, 16, 16, 8)],
)
def test_the_default_grid_holds_at_most_16_shapes(max_micro, lower, upper, per_octave):
  layout = StepLayout.create(
    "device", 8, mode="recompile", max_micro=max_micro, min_micro=None, lower=lower,
    upper=upper, shapes_per_octave=None,
  )  # fmt: skip
  assert layout.policy.shapes_per_octave == per_octave
  assert len(layout.grid) <= 16
