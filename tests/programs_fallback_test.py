"""fallback_plan: a step whose shape is compiling runs in the fewest micro-steps compiled."""

import math

import pytest

from simigrad_jax.engine.batch_plan import BucketPolicy
from simigrad_jax.engine.batch_plan import plan_batch
from simigrad_jax.engine.programs import fallback_plan

POLICY = BucketPolicy(32, 1, shapes_per_octave=8)


def everything_ready(size, steps):
  return True


@pytest.mark.parametrize(
  "batch_size, compiled, want",
  [
    (100, {8, 32}, (32, 1)),  # pad in one step rather than accumulate two of 8
    (100, {12, 16, 32}, (16, 1)),  # the nearest of those in one step
    (300, {16, 20, 32}, (20, 2)),  # two steps at the least: the nearest that holds it in two
    (100, {4}, (4, 4)),  # only a smaller one: accumulate
  ],
)
def test_fewest_micro_steps_then_the_nearest_shape(batch_size, compiled, want):
  plan = plan_batch(batch_size, 8, POLICY)
  got = fallback_plan(plan, compiled, everything_ready)
  assert (got.micro_batch_size, got.accumulation_steps) == want
  assert got.global_batch_size == batch_size
  assert got.padded_examples == got.rows_per_step - batch_size
  assert got.accumulation_steps == math.ceil(batch_size / (8 * got.micro_batch_size))


def test_only_ready_programs_and_none_keeps_the_plan():
  plan = plan_batch(100, 8, POLICY)
  one_step_only_for_32 = lambda size, steps: steps == 1 and size == 32 or size == 8
  assert fallback_plan(plan, {8, 32}, one_step_only_for_32).micro_batch_size == 32
  assert fallback_plan(plan, {8}, lambda size, steps: False) == plan
