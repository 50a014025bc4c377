"""Tests for simigrad_jax.shapes.batch_plan against brute-force references."""

import bisect
import dataclasses
import doctest
import math
import time

import numpy as np
import pytest

from simigrad_jax.shapes import batch_plan
from simigrad_jax.shapes.batch_plan import BatchPlan
from simigrad_jax.shapes.batch_plan import BucketPolicy
from simigrad_jax.shapes.batch_plan import bucket_shapes
from simigrad_jax.shapes.batch_plan import plan_batch
from simigrad_jax.shapes.batch_plan import representable_batch_sizes

DEVICES = [1, 2, 3, 8]
PAD_POLICIES = [
  BucketPolicy(8),  # single shape: "pad" mode
  BucketPolicy(16, 2),
  BucketPolicy(12, 1),
  BucketPolicy(7, 3),
  BucketPolicy(3, 1),
  BucketPolicy(1),
  BucketPolicy(16, 2, shapes_per_octave=4),
  BucketPolicy(24, 3, shapes_per_octave=8),
]
ROUND_POLICIES = [
  BucketPolicy(8, 1, padding=False),
  BucketPolicy(12, 3, padding=False),
  BucketPolicy(5, padding=False),
  BucketPolicy(16, 4, padding=False),
  BucketPolicy(3, 1, padding=False),
  BucketPolicy(20, 2, padding=False, shapes_per_octave=3),
]


# ---------------------------------------------------------------- references


def ref_representable(size, n, grid):
  """The definition: size == n * k * g with k the fewest steps."""
  k = math.ceil(size / (n * max(grid)))
  return any(size == n * k * g for g in grid)


def ref_sizes(n, grid, lo, hi):
  return [s for s in range(lo, hi + 1) if ref_representable(s, n, grid)]


def ref_round(request, previous, sizes):
  """The rounding rule by scanning the sorted candidate list ``sizes``."""
  i = bisect.bisect_left(sizes, request)
  up = sizes[i] if i < len(sizes) else None
  j = bisect.bisect_right(sizes, request) - 1
  down = sizes[j] if j >= 0 else None
  if up == request:
    return request
  if previous is None or previous == request:
    if up is None or down is None:
      return up if down is None else down
    return up if up - request <= request - down else down
  if request > previous:
    return up if up is not None else down
  return down if down is not None else up


def prev_or_less(previous, request, sizes):
  """Upper limit for a shrink: <= request when possible, else <= previous."""
  return request if sizes[0] <= request else previous


def check_layout(plan):
  """Layout and weights follow the documented placement of examples."""
  n, micro, k = (plan.num_devices, plan.micro_batch_size, plan.accumulation_steps)
  layout, weights = plan.example_layout(), plan.example_weights()
  assert layout.shape == weights.shape == (k, n, micro)
  assert layout.dtype == np.int64 and weights.dtype == np.float32
  np.testing.assert_array_equal(weights, (layout >= 0).astype(np.float32))
  assert weights.sum() == plan.global_batch_size
  real = np.sort(layout[layout >= 0])
  np.testing.assert_array_equal(real, np.arange(plan.global_batch_size))
  assert (layout == -1).sum() == plan.padded_examples
  assert ((layout >= 0) | (layout == -1)).all()
  per_device = (layout >= 0).sum(axis=(0, 2))
  assert per_device.max() - per_device.min() <= 1
  per_step_device = (layout >= 0).sum(axis=2)  # (k, n)
  assert (per_step_device.max(axis=1) - per_step_device.min(axis=1) <= 1).all()
  for d in range(n):
    # Position p of a device sits in micro-step p % k, row p // k.
    rows = layout[:, d, :].T.reshape(-1)
    num_real = int((rows >= 0).sum())
    assert (rows[num_real:] == -1).all()  # padding ends each device
    np.testing.assert_array_equal(rows[:num_real], d + n * np.arange(num_real))
  if plan.global_batch_size >= n and (micro >= 2 or k == 1):
    # Every device holds real rows in every micro-step (BatchNorm masks never empty).
    assert (per_step_device >= 1).all(), per_step_device


def effective_min(policy):
  return (
    policy.max_micro_batch_size
    if policy.min_micro_batch_size is None
    else policy.min_micro_batch_size
  )


# ---------------------------------------------------------------- grid


@pytest.mark.parametrize(
  "top,low,expected",
  [
    (8, None, (8,)),
    (8, 8, (8,)),
    (64, 8, (8, 16, 32, 64)),
    (64, 9, (16, 32, 64)),
    (96, 1, (1, 2, 3, 6, 12, 24, 48, 96)),
    (100, 10, (13, 25, 50, 100)),
    (5, 2, (2, 3, 5)),
    (3, 1, (1, 2, 3)),
    (1, 1, (1,)),
  ],
)
def test_grid_examples(top, low, expected):
  assert BucketPolicy(top, low).micro_batch_sizes() == expected


def test_grid_properties_and_size():
  for top in range(1, 150):
    for low in range(1, top + 1):
      grid = BucketPolicy(top, low).micro_batch_sizes()
      assert grid[-1] == top and grid[0] >= low
      assert all(a == -(-b // 2) for a, b in zip(grid, grid[1:]))
      assert all(a < b for a, b in zip(grid, grid[1:]))
      assert grid[0] == 1 or -(-grid[0] // 2) < low  # last one >= low
      assert len(grid) <= math.log2(top / low) + 2


@pytest.mark.parametrize("per_octave", [2, 4, 8])
def test_finer_grid_properties(per_octave):
  ratio = 2 ** (1 / per_octave)
  for top in range(1, 150):
    for low in range(1, top + 1):
      grid = BucketPolicy(top, low, shapes_per_octave=per_octave).micro_batch_sizes()
      assert grid[-1] == top and grid[0] >= low
      assert all(a < b for a, b in zip(grid, grid[1:]))
      # neighbours differ by the ratio, rounded up to whole rows (or by one row)
      assert all(b <= max(math.ceil(a * ratio), a + 1) for a, b in zip(grid, grid[1:]))
      assert len(grid) <= per_octave * math.log2(top / low) + 2
      # the halving grid's shapes are all in it (whole octaves divide exactly)
      assert set(BucketPolicy(top, low).micro_batch_sizes()) <= set(grid)


def test_finer_grid_pads_less_over_a_moving_batch():
  """A batch moving by 10% a step between 64 and 2,048 on 8 devices: padding per grid."""
  rng = np.random.default_rng(0)
  sizes, size = [], 468
  for _ in range(2000):
    size = max(size + 1, int(size * 1.1)) if rng.random() < 0.5 else int(size * 0.9)
    size = min(max(size, 64), 2048)
    sizes.append(size)
  shares = {}
  for per_octave in (1, 8):
    plans = [plan_batch(s, 8, BucketPolicy(32, 1, shapes_per_octave=per_octave)) for s in sizes]
    padded = sum(p.padded_examples for p in plans)
    shares[per_octave] = padded / sum(p.rows_per_step for p in plans)
    assert all(p.accumulation_steps == -(-p.global_batch_size // (8 * 32)) for p in plans)
  assert shares[8] <= 0.05 < shares[1]


# ---------------------------------------------------------------- padding=True


@pytest.mark.parametrize("policy", PAD_POLICIES, ids=repr)
@pytest.mark.parametrize("n", DEVICES)
def test_padding_realises_exactly(n, policy):
  grid = policy.micro_batch_sizes()
  top = grid[-1]
  for b in range(1, 601):
    plan = plan_batch(b, n, policy)
    k, micro = plan.accumulation_steps, plan.micro_batch_size
    assert plan.requested_batch_size == plan.global_batch_size == b
    assert plan.num_devices == n and micro in grid
    assert n * k * micro >= b and (k - 1) * n * top < b  # fits, fewest steps
    assert all(n * k * g < b for g in grid if g < micro)  # smallest shape
    assert plan.padded_examples == plan.rows_per_step - b >= 0
    assert plan.padding_fraction == plan.padded_examples / plan.rows_per_step
    if b >= n * effective_min(policy):
      assert plan.padding_fraction < 0.5
    check_layout(plan)


def test_padding_ignores_previous_and_clamps_to_bounds():
  policy = BucketPolicy(16, 2)
  for b in range(1, 200):
    assert plan_batch(b, 3, policy, previous_batch_size=50) == plan_batch(b, 3, policy)
    plan = plan_batch(b, 3, policy, lower=20, upper=150)
    assert plan.global_batch_size == min(max(b, 20), 150)
    assert plan.requested_batch_size == b


def test_plan_example_values():
  plan = plan_batch(100, 8, BucketPolicy(16, 4))
  assert (plan.accumulation_steps, plan.micro_batch_size) == (1, 16)
  assert plan.rows_per_step == 128 and plan.padded_examples == 28
  assert plan.padding_fraction == pytest.approx(28 / 128)
  plan = plan_batch(300, 8, BucketPolicy(16, 4))  # k = 3, 3 * 8 * 16 = 384
  assert (plan.accumulation_steps, plan.micro_batch_size) == (3, 16)
  plan = plan_batch(5, 2, BucketPolicy(2))
  assert plan.example_layout().tolist() == [[[0, 4], [1, -1]], [[2, -1], [3, -1]]]


# ---------------------------------------------------------------- padding=False


@pytest.mark.parametrize("policy", ROUND_POLICIES, ids=repr)
@pytest.mark.parametrize("n", DEVICES)
def test_round_every_previous_request_pair(n, policy):
  grid = policy.micro_batch_sizes()
  sizes = ref_sizes(n, grid, 1, 150 + 2 * n * grid[-1])
  for previous in [None] + list(range(1, 151)):
    for request in range(1, 151):
      plan = plan_batch(request, n, policy, previous_batch_size=previous)
      got = plan.global_batch_size
      assert got == ref_round(request, previous, sizes), (previous, request)
      assert ref_representable(got, n, grid)
      assert plan.padded_examples == 0 and plan.rows_per_step == got
      assert plan.micro_batch_size in grid
      assert plan.accumulation_steps == math.ceil(got / (n * grid[-1]))
      if request in sizes:
        assert got == request
      if previous is not None and previous in sizes:
        if request > previous:  # grow: unbounded, so never stays
          assert got >= request
        elif request < previous:
          assert got <= prev_or_less(previous, request, sizes)
  check_layout(plan_batch(149, n, policy))


@pytest.mark.parametrize("policy", ROUND_POLICIES[:4], ids=repr)
@pytest.mark.parametrize("n", [1, 3, 8])
def test_round_within_bounds(n, policy):
  grid = policy.micro_batch_sizes()
  for lo in [1, 5, 17, 40, 64, 100]:
    for hi in [lo, lo + 3, lo + 10, lo + 45]:
      sizes = ref_sizes(n, grid, lo, hi)
      if not sizes:
        with pytest.raises(ValueError, match=f"lower={lo}, upper={hi}"):
          plan_batch(lo, n, policy, lower=lo, upper=hi)
        with pytest.raises(ValueError, match=f"lower={lo}, upper={hi}"):
          bucket_shapes(policy, n, lo, hi)
        continue
      shapes = set()
      for previous in [None] + list(range(lo, hi + 1)):
        for request in list(range(lo, hi + 1)) + [1, hi + 50]:
          plan = plan_batch(request, n, policy, previous_batch_size=previous, lower=lo, upper=hi)
          got = plan.global_batch_size
          shapes.add(plan.micro_batch_size)
          assert got in sizes  # representable and in [lo, hi]
          clamped = min(max(request, lo), hi)
          assert got == ref_round(clamped, previous, sizes)
          if previous in sizes and clamped > previous:
            assert got >= previous
            assert got > previous or sizes[-1] == previous  # stays only at top
          if previous in sizes and clamped < previous:
            assert got <= previous
            assert got < previous or sizes[0] == previous
      assert bucket_shapes(policy, n, lo, hi) == tuple(sorted(shapes))


def test_round_documented_edges():
  policy = BucketPolicy(8, 2, padding=False)  # n=4: 8, 16, 32, 64, 96, ...
  plan = lambda b, **kw: plan_batch(b, 4, policy, **kw).global_batch_size
  assert plan(3) == 8  # below n * min: rounds up
  assert plan(3, previous_batch_size=16) == 8  # a shrink, still up to 8
  assert plan(20) == 16 and plan(24) == 32  # nearest, tie to the larger
  assert plan(20, previous_batch_size=16) == 32  # grow rounds up
  assert plan(30, previous_batch_size=32) == 16  # shrink rounds down
  assert plan(70, previous_batch_size=64) == 96  # k = 3 band: 96
  assert plan(38, previous_batch_size=32, upper=40) == 32  # no grow: stay
  assert plan(50, previous_batch_size=16, upper=60) == 32  # grow to the top
  assert plan(6, previous_batch_size=8, lower=5) == 8  # no shrink: stay
  assert plan(100, upper=40) == 32 and plan(1, lower=10) == 16  # clamped
  # A previous size that is not representable gives no direction guarantee.
  assert plan(25, previous_batch_size=20, upper=30) == 16


# ---------------------------------------------------------------- bucket_shapes


@pytest.mark.parametrize("policy", PAD_POLICIES + ROUND_POLICIES, ids=repr)
@pytest.mark.parametrize("n", DEVICES)
def test_bucket_shapes_brute_force(n, policy):
  if policy.padding:
    shape_of = [None] + [plan_batch(b, n, policy).micro_batch_size for b in range(1, 600)]
  for lo in range(1, 300):
    for hi in [lo + d for d in (0, 1, 2, 3, 7, 15, 31, 63, 127, 255)]:
      if policy.padding:
        expected = tuple(sorted(set(shape_of[lo : hi + 1])))
      else:
        sizes = representable_batch_sizes(policy, n, lo, hi)
        if not sizes:
          with pytest.raises(ValueError, match="realisable"):
            bucket_shapes(policy, n, lo, hi)
          continue
        expected = tuple(sorted({plan_batch(s, n, policy).micro_batch_size for s in sizes}))
      assert bucket_shapes(policy, n, lo, hi) == expected, (lo, hi)


@pytest.mark.parametrize(
  "policy",
  [
    BucketPolicy(1),
    BucketPolicy(1, padding=False),
    BucketPolicy(64),
    BucketPolicy(96, 1),
    BucketPolicy(100, 10, padding=False),
    BucketPolicy(4096, 1),
    BucketPolicy(3, 1, padding=False),
  ],
  ids=repr,
)
def test_bucket_shapes_large_range_is_fast_and_small(policy):
  start = time.perf_counter()
  shapes = bucket_shapes(policy, 8, 1, 1_000_000)
  far = bucket_shapes(policy, 8, 500_000, 1_000_000)
  assert time.perf_counter() - start < 1.0
  grid = policy.micro_batch_sizes()
  assert shapes == grid  # from lower=1 every shape is used
  assert far == (grid[-1],)  # k >= 2 far out: only the largest shape
  low = effective_min(policy)
  assert len(shapes) <= math.log2(policy.max_micro_batch_size / low) + 2


def test_bucket_shapes_single_shape_pad_mode():
  assert bucket_shapes(BucketPolicy(32), 8, 1, 100_000) == (32,)


# ---------------------------------------------------------------- representable


@pytest.mark.parametrize("policy", ROUND_POLICIES, ids=repr)
@pytest.mark.parametrize("n", DEVICES)
def test_representable_matches_definition(n, policy):
  grid = policy.micro_batch_sizes()
  for lo, hi in [(1, 1), (1, 500), (7, 9), (33, 400), (250, 260)]:
    assert representable_batch_sizes(policy, n, lo, hi) == ref_sizes(n, grid, lo, hi)


def test_representable_empty_and_padding_rejected():
  policy = BucketPolicy(32, padding=False)
  assert representable_batch_sizes(policy, 8, 10, 20) == []
  with pytest.raises(ValueError, match="lower=10, upper=20"):
    plan_batch(15, 8, policy, lower=10, upper=20)
  with pytest.raises(ValueError, match="padding=False"):
    representable_batch_sizes(BucketPolicy(32), 8, 1, 100)


# ---------------------------------------------------------------- validation


GOOD = BucketPolicy(8, 2)


@pytest.mark.parametrize(
  "make,message",
  [
    (lambda: BucketPolicy(0), "max_micro_batch_size .*got 0"),
    (lambda: BucketPolicy(True), "max_micro_batch_size .*got True"),
    (lambda: BucketPolicy(8.0), "max_micro_batch_size .*got 8.0"),
    (lambda: BucketPolicy(8, 16), r"min_micro_batch_size .*\[1, .*=8\], got 16"),
    (lambda: BucketPolicy(8, 0), "min_micro_batch_size .*got 0"),
    (lambda: BucketPolicy(8, 2.0), "min_micro_batch_size .*got 2.0"),
    (lambda: BucketPolicy(8, True), "min_micro_batch_size .*got True"),
    (lambda: BucketPolicy(8, padding="yes"), "padding .*got 'yes'"),
    (lambda: BucketPolicy(8, shapes_per_octave=0), r"shapes_per_octave .*\[1, 16\].*got 0"),
    (lambda: BucketPolicy(8, shapes_per_octave=2.0), "shapes_per_octave .*got 2.0"),
    (lambda: BucketPolicy(8, shapes_per_octave=17), "shapes_per_octave .*got 17"),
    (lambda: plan_batch(0, 1, GOOD), "batch_size must be an integer >= 1, got 0"),
    (lambda: plan_batch(-3, 1, GOOD), "batch_size .*got -3"),
    (lambda: plan_batch(2.5, 1, GOOD), "batch_size .*got 2.5"),
    (lambda: plan_batch(True, 1, GOOD), "batch_size .*got True"),
    (lambda: plan_batch(8, 0, GOOD), "num_devices .*>= 1, got 0"),
    (lambda: plan_batch(8, 2.0, GOOD), "num_devices .*got 2.0"),
    (lambda: plan_batch(8, 1, "big"), "policy .*got 'big'"),
    (lambda: plan_batch(8, 1, GOOD, previous_batch_size=0), "previous_batch_size .*got 0"),
    (lambda: plan_batch(8, 1, GOOD, lower=0), "lower .*got 0"),
    (lambda: plan_batch(8, 1, GOOD, lower=10, upper=5), "upper .*lower=10, got 5"),
    (lambda: bucket_shapes(GOOD, 1, 10, 5), "upper .*lower=10, got 5"),
    (lambda: bucket_shapes(GOOD, 0, 1, 5), "num_devices .*got 0"),
    (lambda: bucket_shapes(GOOD, 1, 0, 5), "lower .*got 0"),
    (lambda: bucket_shapes(GOOD, 1, 1, None), "upper .*got None"),
    (
      lambda: representable_batch_sizes(BucketPolicy(8, padding=False), 1, 1.5, 9),
      "lower .*got 1.5",
    ),
    (lambda: BatchPlan(10, 10, 2, 4, 1, 0), "= 8, got 10 \\+ 0"),
    (lambda: BatchPlan(8, 8, 2, 4, 1, -1), "padded_examples .*got -1"),
    (lambda: BatchPlan(8, 0, 2, 4, 1, 8), "global_batch_size .*got 0"),
  ],
)
def test_bad_inputs_raise(make, message):
  with pytest.raises(ValueError, match=message):
    make()


def test_numpy_ints_accepted_and_dataclasses_frozen():
  plan = plan_batch(np.int64(100), np.int32(8), BucketPolicy(np.int64(16), 4))
  assert plan == plan_batch(100, 8, BucketPolicy(16, 4))
  assert type(plan.global_batch_size) is int
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.global_batch_size = 3
  with pytest.raises(dataclasses.FrozenInstanceError):
    GOOD.padding = False


def test_docstring_examples():
  result = doctest.testmod(batch_plan)
  assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------- steps of several shapes

MIXED_POLICIES = [
  BucketPolicy(16, 1, shapes_per_step=2),
  BucketPolicy(16, 2, shapes_per_step=3),
  BucketPolicy(12, 1, shapes_per_octave=2, shapes_per_step=4),
  BucketPolicy(7, 3, shapes_per_step=3),
]


def check_mixed_layout(plan):
  """Each micro-step's rows hold each example once, devices balanced in every micro-step, padding
  at the end of each device's rows in every micro-step."""
  layout = plan.example_layout()
  n, k = plan.num_devices, plan.accumulation_steps
  assert layout.shape == (k, n, plan.micro_batch_size)
  own = [layout[j, :, :size] for j, size in enumerate(plan.shapes)]
  beyond = [layout[j, :, size:] for j, size in enumerate(plan.shapes)]
  assert all((rows == -1).all() for rows in beyond)  # no example beyond a micro-step's shape
  real = np.sort(np.concatenate([rows[rows >= 0] for rows in own]))
  np.testing.assert_array_equal(real, np.arange(plan.global_batch_size))
  assert sum(int((rows == -1).sum()) for rows in own) == plan.padded_examples
  for rows in own:
    counts = (rows >= 0).sum(axis=1)  # per device
    assert counts.max() - counts.min() <= 1
    for device_rows in rows:
      num_real = int((device_rows >= 0).sum())
      assert (device_rows[num_real:] == -1).all()
  # The two device halves (even, odd) differ by at most one example in all.
  if n % 2 == 0:
    per_device = sum((rows >= 0).sum(axis=1) for rows in own)
    assert abs(int(per_device[0::2].sum()) - int(per_device[1::2].sum())) <= n // 2
  np.testing.assert_array_equal(plan.example_weights(), (layout >= 0).astype(np.float32))


@pytest.mark.parametrize("policy", MIXED_POLICIES)
@pytest.mark.parametrize("n", [1, 2, 8])
def test_a_step_of_several_shapes_pads_less_than_its_smallest_shape(policy, n):
  grid = policy.micro_batch_sizes()
  top = grid[-1]
  for size in range(1, 3 * n * top + 2):
    plan = plan_batch(size, n, policy)
    shapes = plan.shapes
    assert plan.global_batch_size == size and set(shapes) <= set(grid)
    assert list(shapes) == sorted(shapes, reverse=True)
    per_device = -(-size // n)
    full = -(-per_device // top) - 1  # micro-steps of the largest shape before the rest
    assert shapes[:full] == (top,) * full
    assert len(shapes) - full <= policy.shapes_per_step
    # Beyond the whole rows per device, less than the smallest shape it uses.
    assert 0 <= sum(shapes) - per_device < shapes[-1]
    uniform = plan_batch(size, n, dataclasses.replace(policy, shapes_per_step=1))
    if full == 0:  # one band: never more rows than a step on one shape
      assert plan.rows_per_step <= uniform.rows_per_step
    check_mixed_layout(plan)


def test_split_rows_takes_the_largest_shapes_then_the_one_that_holds_the_rest():
  grid = (1, 2, 4, 8, 16)
  assert batch_plan.split_rows(13, grid, 1) == (16,)
  assert batch_plan.split_rows(13, grid, 2) == (16,)  # 8 + 8 pads as much, in two steps
  assert batch_plan.split_rows(11, grid, 2) == (8, 4)
  assert batch_plan.split_rows(13, grid, 3) == (8, 4, 1)
  assert batch_plan.split_rows(12, grid, 4) == (8, 4)  # exact: no more micro-steps
  assert batch_plan.split_rows(16, grid, 3) == (16,)
  assert batch_plan.step_shapes(40, (4, 8, 16), 3) == (16, 16, 8)


@pytest.mark.parametrize(
  "make, message",
  [
    (lambda: BucketPolicy(8, shapes_per_step=0), "shapes_per_step must be an int in \\[1, 4\\]"),
    (lambda: BucketPolicy(8, shapes_per_step=5), "got 5"),
    (lambda: BucketPolicy(8, padding=False, shapes_per_step=2), "needs padding=True"),
    (lambda: BatchPlan(10, 10, 2, 4, 2, 2, (2, 4)), "largest first"),
    (lambda: BatchPlan(10, 10, 2, 4, 2, 2, (4,)), "must be 2 ints"),
  ],
)
def test_bad_mixed_settings_are_refused_with_one_line(make, message):
  with pytest.raises(ValueError, match=message):
    make()


def test_bucket_shapes_of_steps_of_several_shapes_are_those_the_plans_use():
  for policy in MIXED_POLICIES:
    for n, lower, upper in [(8, 16, 512), (2, 3, 40), (1, 1, 5)]:
      grid = dataclasses.replace(policy, min_micro_batch_size=1)
      used = {g for size in range(lower, upper + 1) for g in plan_batch(size, n, grid).shapes}
      assert set(bucket_shapes(grid, n, lower, upper)) == used


@pytest.mark.parametrize(
  "request_, previous, lower, upper, rounded",
  [
    (17, 16, 16, 256, 24),  # a grow: the next multiple up, never back to 16
    (21, 24, 16, 256, 16),  # a shrink: the multiple below
    (24, 16, 16, 256, 24),  # a multiple stays
    (20, 20, 16, 256, 20),  # unchanged: kept as it is, a multiple or not
    (250, 240, 16, 252, 248),  # no multiple above in bounds: the largest in them
    (12, 16, 10, 20, 16),  # no multiple below in bounds: the smallest in them
    (300, 200, None, None, 304),  # unbounded
  ],
)
def test_round_to_whole_rows_rounds_in_the_direction_of_the_change(
  request_, previous, lower, upper, rounded
):
  assert batch_plan.round_to_whole_rows(request_, previous, 8, lower, upper) == rounded


def test_round_to_whole_rows_keeps_every_size_in_bounds_and_the_direction():
  for previous in range(16, 257, 8):
    for request_ in range(16, 257):
      rounded = batch_plan.round_to_whole_rows(request_, previous, 8, 16, 256)
      assert 16 <= rounded <= 256
      if request_ != previous:
        assert rounded % 8 == 0 and abs(rounded - request_) < 8
        assert (rounded > previous) == (request_ > previous)  # a move stays a move, its way


def test_whole_rows_bounds_without_a_multiple_are_refused():
  batch_plan.check_whole_rows_bounds(8, 9, 16)
  with pytest.raises(ValueError, match=r"the bounds \[9, 15\] hold none"):
    batch_plan.check_whole_rows_bounds(8, 9, 15)
