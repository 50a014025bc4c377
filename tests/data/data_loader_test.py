"""StepDataLoader: a step's rows loaded and placed ahead for each plan it is likely to run."""

import threading

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import simigrad_jax
from simigrad_jax.data import data_loader
from simigrad_jax.data.data_loader import StepDataLoader
from simigrad_jax.shapes.layout import StepLayout


def _loader():
  """A loader of 400 examples on 8 devices, bounds [16, 128], and its layout and sampler."""
  mesh = Mesh(np.array(jax.devices()), ("batch",))
  layout = StepLayout.create(
    "device", 8, mode="recompile", max_micro=8, min_micro=None, lower=16, upper=128,
    shapes_per_octave=8,
  )  # fmt: skip
  data = {"x": np.arange(400, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)}
  sampler = simigrad_jax.data.EpochSampler(400, 0)
  loader = StepDataLoader(
    simigrad_jax.ArraySource(data),
    sampler,
    NamedSharding(mesh, P("batch")),
    NamedSharding(mesh, P()),
    layout.slot_positions(np.arange(8)),
    layout.num_slots,
    place_ahead=True,
  )
  return loader, layout, sampler


@pytest.fixture
def loader_and_layout():
  loader, layout, sampler = _loader()
  yield loader, layout, sampler
  loader.close()


@pytest.mark.parametrize("decided", [55, 45])
def test_a_likely_decision_finds_its_rows_placed(loader_and_layout, decided):
  loader, layout, sampler = loader_and_layout
  placed = []
  place = loader.place
  loader.place = lambda plan, loaded, step: placed.append(plan) or place(plan, loaded, step)
  loader.submit(0, 55, step=0, expected=[layout.plan(55), layout.plan(45)])
  plan = layout.plan(decided)
  batch, _ = loader.take(plan, 0, 0)
  assert {p.global_batch_size for p in placed} == {55, 45}  # both ahead, none now
  # The rows are the sampler's first examples, in the plan's layout, padding zero.
  where = plan.example_layout()
  want = np.where(where >= 0, sampler.indices_at(0, decided)[np.maximum(where, 0)], 0)
  ((x, weights),) = batch.micro_batches
  got = np.asarray(x["x"])[:, 0].reshape(where.shape[1:])
  np.testing.assert_array_equal(got, want[0].astype(np.float32))
  np.testing.assert_array_equal(np.asarray(weights).reshape(where.shape[1:]), where[0] >= 0)


def test_an_unlikely_decision_is_placed_when_taken(loader_and_layout):
  loader, layout, _ = loader_and_layout
  loader.submit(0, 55, step=0, expected=[layout.plan(55), layout.plan(45)])
  batch, _ = loader.take(layout.plan(50), 0, 0)  # neither: placed now, from the rows loaded
  assert batch.plan == layout.plan(50)
  assert float(np.asarray(batch.micro_batches[0][1]).sum()) == 50
  assert np.asarray(batch.counters[0]).tolist() == [0, 0]


def test_a_plans_weights_are_placed_once_and_kept_for_the_last_plans(loader_and_layout):
  loader, layout, _ = loader_and_layout
  placed = []
  to_devices = loader._to_devices
  loader._to_devices = lambda tree, micro: placed.append(tree) or to_devices(tree, micro)
  loaded = loader._local_rows(0, 128)
  first = loader.place(layout.plan(45), loaded, step=0)
  again = loader.place(layout.plan(45), loaded, step=1)
  assert len(placed) == 3  # rows, weights; then the rows alone
  assert again.micro_batches[0][1] is first.micro_batches[0][1]
  assert float(np.asarray(again.micro_batches[0][1]).sum()) == 45
  # A plan evicted by WEIGHTS_KEPT later ones is placed again, with the same values.
  for size in range(46, 46 + data_loader.WEIGHTS_KEPT):
    loader.place(layout.plan(size), loaded, step=2)
  evicted = loader.place(layout.plan(45), loaded, step=3)
  assert evicted.micro_batches[0][1] is not first.micro_batches[0][1]
  np.testing.assert_array_equal(
    np.asarray(evicted.micro_batches[0][1]), np.asarray(first.micro_batches[0][1])
  )


def test_rows_are_gathered_and_padding_rows_are_zero():
  rows = np.arange(1, 13, dtype=np.float32).reshape(4, 3)
  take = np.array([2, 0, 0, 3])
  real = np.array([True, True, False, True])
  got = data_loader._gather_rows(rows, take, real)
  np.testing.assert_array_equal(got, [rows[2], rows[0], [0, 0, 0], rows[3]])
  # A process that loaded no rows: all padding, of the rows' shape and dtype.
  empty = data_loader._gather_rows(np.zeros((0, 3), np.int32), np.zeros(2, int), np.zeros(2, bool))
  assert empty.shape == (2, 3) and empty.dtype == np.int32 and not empty.any()


def _placements(loader):
  """Records the batch size of every plan ``loader`` places, and whether it was ahead (in the
  data thread) or when taken."""
  placed = []
  place = loader.place

  def recording(plan, loaded, step):
    ahead = threading.current_thread() is not threading.main_thread()
    placed.append((plan.global_batch_size, ahead))
    return place(plan, loaded, step)

  loader.place = recording
  return placed


def test_only_the_expected_plans_the_rows_hold_are_placed_ahead_then_the_follow_up(
  loader_and_layout,
):
  loader, layout, _ = loader_and_layout
  placed = _placements(loader)
  after = []
  then = lambda: after.append((list(placed), threading.current_thread().name))
  loader.submit(0, 96, step=0, expected=[layout.plan(96), layout.plan(128)], then=then)
  batch, _ = loader.take(layout.plan(96), 0, 0)
  loader.close()  # waits for the data thread
  assert placed == [(96, True)]  # 128 rows were not loaded: not placed
  assert after == [([(96, True)], after[0][1])] and after[0][1].startswith("simigrad-data")
  assert sum(float(np.asarray(weights).sum()) for _, weights in batch.micro_batches) == 96


def test_a_step_larger_than_the_rows_loaded_loads_its_own(loader_and_layout):
  loader, layout, _ = loader_and_layout
  placed = _placements(loader)
  loader.submit(0, 50, step=0, expected=[layout.plan(50)])
  batch, _ = loader.take(layout.plan(96), 0, 0)
  assert placed == [(50, True), (96, False)]
  assert sum(float(np.asarray(weights).sum()) for _, weights in batch.micro_batches) == 96
