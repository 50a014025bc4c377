"""Tests for simigrad_jax.data.sampler: every epoch serves each example once."""

import doctest
import json
import math

import numpy as np
import pytest

from simigrad_jax.data import sampler as sampler_lib
from simigrad_jax.data.sampler import EpochSampler


def serve(sampler, sizes):
  """Takes one batch per size; returns the list of batches."""
  return [sampler.take(int(b)) for b in sizes]


def random_sizes(rng, n, steps):
  return rng.integers(1, n + 1, size=steps)


@pytest.mark.parametrize("n,seed", [(1, 0), (2, 3), (37, 0), (100, 7), (257, 12345)])
def test_every_epoch_is_a_permutation_under_varying_batch_sizes(n, seed):
  rng = np.random.default_rng(n + seed)
  sampler = EpochSampler(n, seed)
  sizes = random_sizes(rng, n, 400)
  batches = serve(sampler, sizes)
  stream = np.concatenate(batches)
  assert stream.dtype == np.int64
  assert len(stream) == sizes.sum() == sampler.examples_seen
  epochs = len(stream) // n
  assert epochs >= 3  # several epochs, several boundary crossings
  for e in range(epochs):
    chunk = stream[e * n : (e + 1) * n]
    np.testing.assert_array_equal(np.sort(chunk), np.arange(n))
    np.testing.assert_array_equal(chunk, sampler.permutation(e))
  # The partial last epoch repeats nothing either.
  rest = stream[epochs * n :]
  assert len(np.unique(rest)) == len(rest)
  # A batch within one epoch holds no example twice. One that crosses a
  # boundary is the tail of epoch e then the head of epoch e + 1, so an example
  # can sit in both parts: at most twice, never twice from the same epoch.
  start = 0
  for batch in batches:
    e_first, e_last = start // n, (start + len(batch) - 1) // n
    counts = np.bincount(batch, minlength=n)
    if e_first == e_last:
      assert counts.max() == 1
    else:
      assert e_last == e_first + 1 and counts.max() <= 2
      cut = n - start % n
      for part in (batch[:cut], batch[cut:]):
        assert len(np.unique(part)) == len(part)
    start += len(batch)
  assert sampler.epoch == epochs and sampler.offset == len(rest)


def test_stream_does_not_depend_on_how_it_is_cut():
  n = 53
  rng = np.random.default_rng(0)
  a = np.concatenate(serve(EpochSampler(n, 5), random_sizes(rng, n, 300)))
  b = np.concatenate(serve(EpochSampler(n, 5), random_sizes(rng, n, 300)))
  m = min(len(a), len(b))
  assert m > 3 * n
  np.testing.assert_array_equal(a[:m], b[:m])


def test_crossing_an_epoch_boundary():
  sampler = EpochSampler(5, seed=1, shuffle=False)
  assert sampler.take(3).tolist() == [0, 1, 2]
  assert sampler.take(4).tolist() == [3, 4, 0, 1]
  assert (sampler.examples_seen, sampler.epoch, sampler.offset) == (7, 1, 2)
  assert sampler.take(5).tolist() == [2, 3, 4, 0, 1]
  shuffled = EpochSampler(5, seed=1)
  shuffled.take(3)
  batch = shuffled.take(4)
  np.testing.assert_array_equal(
    batch, np.concatenate([shuffled.permutation(0)[3:], shuffled.permutation(1)[:2]])
  )


def test_full_size_batches_are_whole_epochs():
  n = 31
  sampler = EpochSampler(n, 2)
  for e in range(4):
    np.testing.assert_array_equal(sampler.take(n), sampler.permutation(e))
  sampler.take(10)
  batch = sampler.take(n)  # from offset 10: the rest of epoch 4, start of 5
  np.testing.assert_array_equal(batch[: n - 10], sampler.permutation(4)[10:])
  np.testing.assert_array_equal(batch[n - 10 :], sampler.permutation(5)[:10])


def test_permutations_differ_between_epochs_and_seeds_and_reproduce():
  n = 200
  a, b = EpochSampler(n, 0), EpochSampler(n, 1)
  perms = [a.permutation(e) for e in range(6)]
  for i in range(6):
    np.testing.assert_array_equal(np.sort(perms[i]), np.arange(n))
    assert not np.array_equal(perms[i], np.arange(n))
    for j in range(i):
      assert not np.array_equal(perms[i], perms[j]), (i, j)
    assert not np.array_equal(perms[i], b.permutation(i))
    np.testing.assert_array_equal(perms[i], EpochSampler(n, 0).permutation(i))
  np.testing.assert_array_equal(a.permutation(3), np.random.default_rng([0, 3]).permutation(n))


def test_permutation_cache_returns_the_same_order_and_is_read_only():
  sampler = EpochSampler(50, 9)
  first = [sampler.permutation(e).copy() for e in range(5)]
  for e in reversed(range(5)):  # evicted and recomputed in another order
    np.testing.assert_array_equal(sampler.permutation(e), first[e])
  order = sampler.permutation(2)
  assert order.dtype == np.int64
  with pytest.raises(ValueError):
    order[0] = 1
  batch = sampler.take(10)
  batch[:] = -5  # the caller owns returned batches
  np.testing.assert_array_equal(sampler.indices_at(0, 10), sampler.permutation(0)[:10])


def test_no_shuffle_is_the_identity_every_epoch():
  n = 17
  sampler = EpochSampler(n, 3, shuffle=False)
  stream = np.concatenate(serve(sampler, random_sizes(np.random.default_rng(1), n, 100)))
  np.testing.assert_array_equal(stream, np.arange(len(stream)) % n)


def test_peek_equals_take_and_does_not_advance():
  n = 23
  sampler = EpochSampler(n, 4)
  rng = np.random.default_rng(3)
  for b in random_sizes(rng, n, 60):
    seen = sampler.examples_seen
    peeked = sampler.peek(int(b))
    assert sampler.peek(int(b)).tolist() == peeked.tolist()
    assert sampler.examples_seen == seen
    np.testing.assert_array_equal(sampler.take(int(b)), peeked)
    assert sampler.examples_seen == seen + b


def test_indices_at_is_pure():
  n = 29
  sampler = EpochSampler(n, 8)
  rng = np.random.default_rng(4)
  sizes = random_sizes(rng, n, 80)
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  batches = serve(sampler, sizes)
  seen = sampler.examples_seen
  fresh = EpochSampler(n, 8)
  for start, b, batch in reversed(list(zip(starts, sizes, batches))):
    np.testing.assert_array_equal(sampler.indices_at(int(start), int(b)), batch)
    np.testing.assert_array_equal(fresh.indices_at(int(start), int(b)), batch)
  assert sampler.examples_seen == seen and fresh.examples_seen == 0
  # Far ahead, without serving anything before it.
  big = 10**12 + 5
  e, o = divmod(big, n)
  np.testing.assert_array_equal(fresh.indices_at(big, 3), fresh.permutation(e)[o : o + 3])


def test_state_round_trip_through_json_mid_epoch():
  n = 41
  rng = np.random.default_rng(5)
  sizes = random_sizes(rng, n, 120)
  reference = EpochSampler(n, 11)
  expected = serve(reference, sizes)

  first = EpochSampler(n, 11)
  served = serve(first, sizes[:57])
  assert first.offset != 0  # really mid-epoch
  text = json.dumps(first.state_dict())
  state = json.loads(text)
  assert state == {
    "version": 1,
    "num_examples": n,
    "seed": 11,
    "shuffle": True,
    "examples_seen": first.examples_seen,
  }
  resumed = EpochSampler(n, 11)
  resumed.load_state_dict(state)
  assert (resumed.examples_seen, resumed.epoch, resumed.offset) == (
    first.examples_seen,
    first.epoch,
    first.offset,
  )
  served += serve(resumed, sizes[57:])
  for got, want in zip(served, expected):
    np.testing.assert_array_equal(got, want)
  assert resumed.state_dict() == reference.state_dict()


@pytest.mark.parametrize(
  "key,value",
  [("num_examples", 42), ("seed", 12), ("shuffle", False), ("shuffle", 1), ("num_examples", True)],
)
def test_load_refuses_other_settings_and_changes_nothing(key, value):
  sampler = EpochSampler(41, 11)
  sampler.take(7)
  state = {**sampler.state_dict(), key: value, "examples_seen": 99}
  with pytest.raises(ValueError, match=key) as info:
    sampler.load_state_dict(state)
  assert repr(value) in str(info.value)
  assert sampler.examples_seen == 7


@pytest.mark.parametrize(
  "state,match",
  [
    (
      {"version": 2, "num_examples": 4, "seed": 0, "shuffle": True, "examples_seen": 0},
      "version must be 1, got 2",
    ),
    (
      {"num_examples": 4, "seed": 0, "shuffle": True, "examples_seen": 0},
      "version must be 1, got None",
    ),
    ([1, 2], "version must be 1"),
    (
      {"version": 1, "num_examples": 4, "seed": 0, "shuffle": True, "examples_seen": -1},
      "examples_seen must be an integer >= 0, got -1",
    ),
    (
      {"version": 1, "num_examples": 4, "seed": 0, "shuffle": True, "examples_seen": 2.0},
      "examples_seen must be an integer",
    ),
    ({"version": 1, "num_examples": 4, "seed": 0, "shuffle": True}, "no examples_seen"),
    (
      {"version": 1, "seed": 0, "shuffle": True, "examples_seen": 0},
      "num_examples .saved '<missing>'",
    ),
  ],
)
def test_load_refuses_malformed_states(state, match):
  sampler = EpochSampler(4, 0)
  sampler.take(3)
  with pytest.raises(ValueError, match=match):
    sampler.load_state_dict(state)
  assert sampler.examples_seen == 3


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(num_examples=0, seed=0), "num_examples must be an integer >= 1, got 0"),
    (dict(num_examples=-3, seed=0), "num_examples must be an integer >= 1, got -3"),
    (dict(num_examples=2.5, seed=0), "num_examples must be an integer >= 1, got 2.5"),
    (dict(num_examples=True, seed=0), "num_examples must be an integer"),
    (dict(num_examples=4, seed=-1), "seed must be an integer >= 0, got -1"),
    (dict(num_examples=4, seed="a"), "seed must be an integer >= 0, got 'a'"),
    (dict(num_examples=4, seed=0, shuffle=1), "shuffle must be True or False, got 1"),
  ],
)
def test_constructor_refuses_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    EpochSampler(**kwargs)


@pytest.mark.parametrize("size", [0, -1, -3, 5.5, 2.0, math.nan, True, None, "3"])
def test_batch_size_must_be_an_integer_of_at_least_one(size):
  sampler = EpochSampler(10, 0)
  for method in (sampler.peek, sampler.take, lambda b: sampler.indices_at(0, b)):
    with pytest.raises(ValueError, match=r"batch_size must be an integer >= 1, got ") as info:
      method(size)
    assert "repeat" not in str(info.value)  # not the message of a batch larger than the data
  assert sampler.examples_seen == 0


def test_batch_size_must_be_at_most_the_data_set():
  sampler = EpochSampler(10, 0)
  for method in (sampler.peek, sampler.take, lambda b: sampler.indices_at(0, b)):
    with pytest.raises(ValueError, match=r"batch_size must be an int in \[1, num_examples=10\]"):
      method(11)
  assert sampler.examples_seen == 0


def test_batch_size_error_names_both_numbers_and_explains():
  with pytest.raises(ValueError) as info:
    EpochSampler(10, 0).take(11)
  message = str(info.value)
  assert "10" in message and "11" in message and "repeat" in message


def test_numpy_integers_are_accepted():
  sampler = EpochSampler(np.int64(10), np.int32(3))
  assert sampler.take(np.int64(4)).shape == (4,)
  assert sampler.indices_at(np.uint8(9), np.int16(2)).tolist() == (
    sampler.indices_at(9, 2).tolist()
  )
  state = json.loads(json.dumps(sampler.state_dict()))
  assert state["num_examples"] == 10 and type(state["seed"]) is int


@pytest.mark.parametrize(
  "call,match",
  [
    (lambda s: s.indices_at(-1, 2), "examples_seen must be an integer >= 0, got -1"),
    (lambda s: s.indices_at(1.5, 2), "examples_seen must be an integer"),
    (lambda s: s.indices_at(True, 2), "examples_seen must be an integer"),
    (lambda s: s.permutation(-2), "epoch must be an integer >= 0, got -2"),
    (lambda s: s.permutation(1.0), "epoch must be an integer >= 0, got 1.0"),
  ],
)
def test_positions_must_be_non_negative_ints(call, match):
  with pytest.raises(ValueError, match=match):
    call(EpochSampler(10, 0))


def test_imagenet_sized_epochs_are_fast():
  """A step costs O(batch), not O(data set), once an epoch's order exists."""
  import time  # pylint: disable=import-outside-toplevel

  sampler = EpochSampler(1_281_167, 0)
  sampler.take(1)
  start = time.perf_counter()
  for _ in range(500):
    sampler.take(2048)
  assert time.perf_counter() - start < 2.0
  assert sampler.epoch == 0 and sampler.examples_seen == 1 + 500 * 2048


def test_docstring_examples():
  result = doctest.testmod(sampler_lib, optionflags=doctest.ELLIPSIS)
  assert result.attempted >= 6 and result.failed == 0
