"""The compile schedule: programs admitted by the step count, its state saved and restored."""

import doctest

import pytest

from simigrad_jax.compile import schedule
from simigrad_jax.compile.schedule import CompileSchedule
from simigrad_jax.shapes.layout import StepLayout


def layout():
  # 8 devices, 1 to 16 rows a device, 8 shapes an octave (rows 1, 2, ..., 16).
  return layout_of()


def layout_of(shapes_per_step=1, lower=8, upper=128, max_micro=16):
  """8 devices, 1 to ``max_micro`` rows a device (every count a shape), steps of up to
  ``shapes_per_step`` shapes, batches in ``[lower, upper]``."""
  return StepLayout.create(
    "device",
    8,
    mode="recompile",
    max_micro=max_micro,
    min_micro=None,
    shapes_per_octave=None,
    shapes_per_step=shapes_per_step,
    lower=lower,
    upper=upper,
  )


def replay(sizes, steps_per_compile=0.5, state=None, start=0):
  """The plans a schedule chooses for the batch sizes ``sizes`` from step ``start``."""
  grid = layout()
  plans = CompileSchedule(grid, steps_per_compile, [])
  if state is not None:
    assert plans.load_state_dict(state)
  plans.start(grid.plan(sizes[0]), start)
  chosen = []
  for step, size in enumerate(sizes, start):
    exact = grid.plan(size)
    chosen.append(plans.choose(exact, step))
    plans.advance(exact, step)
  return chosen, plans


def test_the_first_plan_is_admitted_at_once_and_a_new_shape_after_its_steps():
  chosen, _ = replay([8, 24, 24, 24, 24])
  # 24 on 8 devices: 3 rows; asked for at step 1 after the window near 1 row (only 1 itself).
  assert [plan.micro_batch_size for plan in chosen] == [1, 1, 3, 3, 3]
  assert [plan.accumulation_steps for plan in chosen] == [1, 3, 1, 1, 1]  # 24 on 1-row steps
  assert all(plan.global_batch_size == size for plan, size in zip(chosen, [8, 24, 24, 24, 24]))


def test_more_steps_per_compile_fall_back_longer():
  fast, _ = replay([8, 24, 24, 24, 24, 24], steps_per_compile=0.5)
  slow, _ = replay([8, 24, 24, 24, 24, 24], steps_per_compile=3)
  assert sum(p.micro_batch_size != 3 for p in slow) > sum(p.micro_batch_size != 3 for p in fast)


def test_near_lists_the_plans_programs_then_the_window_nearest_first():
  grid = layout()
  plans = CompileSchedule(grid, 0.5, accumulation_shapes=[8])
  plans.start(grid.plan(8), 0)
  exact = grid.plan(48)  # 6 rows a device
  near = plans.near(exact)
  assert near[0] == ("fused", 6)
  assert [size for kind, size in near if kind == "fused"] == grid.shapes_near(6, 0.5)
  assert ("micro", 8) in near and ("apply", 0) in near  # 8 rows: a shape a step accumulates on
  requested = plans.advance(exact, 1)
  assert requested == [program for program in near if program != ("apply", 0)]  # (admitted)
  assert plans.near(exact) == near  # the same whether requested before or not
  assert plans.advance(exact, 2) == []


def test_a_restored_schedule_chooses_as_the_one_never_interrupted():
  sizes = [8, 12, 20, 32, 48, 64, 40, 24, 16, 24]
  straight, _ = replay(sizes)
  _, first = replay(sizes[:4])
  resumed, _ = replay(sizes[4:], state=first.state_dict(), start=4)
  assert resumed == straight[4:]


def test_a_saved_state_of_another_schedule_is_not_restored_and_the_resume_is_told_why(caplog):
  _, plans = replay([8, 24, 24])
  state = plans.state_dict()
  grid = layout()
  with caplog.at_level("WARNING", logger="simigrad_jax"):
    assert not CompileSchedule(grid, 0.5, []).load_state_dict(None)  # a new run: nothing to say
    assert not caplog.records
    assert not CompileSchedule(grid, 1.0, []).load_state_dict(state)  # another pace
    bad = {**state, "admitted": [["fused", 99, 0]]}  # a shape off the grid
    assert not CompileSchedule(grid, 0.5, []).load_state_dict(bad)
    assert not CompileSchedule(grid, 0.5, []).load_state_dict({"admitted": []})
  said = [record.getMessage() for record in caplog.records]
  assert len(said) == 3 and all("compile schedule is not restored" in line for line in said)
  assert "saved with steps_per_compile=0.5, this run has 1.0" in said[0]
  assert "not a program of this grid: ['fused', 99, 0]" in said[1]
  assert "malformed: KeyError('steps_per_compile')" in said[2]
  assert CompileSchedule(grid, 0.5, []).load_state_dict(state)


def test_steps_per_compile_is_checked():
  with pytest.raises(ValueError, match="steps_per_compile must be a finite number > 0, got 0"):
    CompileSchedule(layout(), 0, [])


def test_doctests():
  result = doctest.testmod(schedule)
  assert result.attempted > 0 and result.failed == 0
