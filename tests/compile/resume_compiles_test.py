"""A resume with a warm compilation cache and the timed fallback: its first step loads a program,
it compiles none first."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import simigrad_jax
from simigrad_jax.checkpoint.checkpointer import Checkpointer
from simigrad_jax.compile import persistent_cache
from tiny_run import train_records

# 32 rows (4 a device) for the first two steps, then 16 (2 a device): a shape a whole
# octave below, outside the window of shapes compiled around the first one.
THRESHOLDS = "0:32,64:16"


def _train(workdir, cache_dir, num_steps):
  """The tiny run on the schedule, resumed from ``workdir``: its summary, optimizer state and
  records."""
  schedule = simigrad_jax.make_controller("step_schedule", thresholds=THRESHOLDS)
  return train_records(
    workdir,
    cache_dir,
    num_steps,
    controller=schedule,
    compile=simigrad_jax.CompileConfig(timed_fallback=True),
  )


def _assert_same_updates(records, opt_state, straight_run):
  """The batch sizes, losses and optimizer state of the run in one process (on whichever shapes
  its compiles allowed)."""
  _, straight_opt_state, straight_records = straight_run
  assert [r["batch_size"] for r in records] == [r["batch_size"] for r in straight_records]
  np.testing.assert_allclose(
    [r["loss"] for r in records], [r["loss"] for r in straight_records], rtol=0, atol=1e-5
  )
  for leaf, straight_leaf in zip(
    jax.tree.leaves(opt_state), jax.tree.leaves(straight_opt_state), strict=True
  ):
    np.testing.assert_allclose(leaf, straight_leaf, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
  """Four steps in one process (the cache is this run's alone)."""
  tmp = tmp_path_factory.mktemp("straight")
  return _train(tmp / "run", tmp / "cache", 4)


def test_a_resumed_first_step_runs_on_a_program_the_cache_holds(straight_run, tmp_path):
  cache = tmp_path / "cache"
  _train(tmp_path / "run", cache, 2)  # at 32 rows; then checkpointed
  host = Checkpointer(tmp_path / "run" / "checkpoints").read_host(2)
  saved = host["compiled_programs"]
  assert saved["compilation_cache_dir"] == str(cache) and 4 in saved["fused"]
  assert 2 not in saved["fused"]  # the resumed step's own shape: never compiled

  summary, opt_state, records = _train(tmp_path / "run", cache, 4)
  first = records[2]
  assert (first["step"], first["batch_size"]) == (3, 16)
  # It ran on a shape the cache held, padded, instead of waiting for its own to compile.
  assert first["compile_fallback"] and first["micro_batch_size"] in saved["fused"]
  assert first["micro_batch_size"] != 2 and first["padded_examples"] > 0
  assert summary["compile_cache_hits"] > 0
  _assert_same_updates(records, opt_state, straight_run)
  # The next checkpoint still lists what the first process compiled, with this one's.
  later = Checkpointer(tmp_path / "run" / "checkpoints").read_host(4)["compiled_programs"]
  assert set(saved["fused"]) | set(summary["compiled_step_sizes"]) >= set(later["fused"])
  assert set(later["fused"]) >= set(saved["fused"]) and later["apply"] >= saved["apply"]


def _evict_everything(cache):
  """What another run sharing the cache may do meanwhile: its entries go.

  A compile the run before left under way may still write to the cache, and
  its eviction then deletes a time of use whose entry went first: a file
  listed here may be gone when its turn comes.
  """
  for entry in cache.iterdir():
    entry.unlink(missing_ok=True)


def test_a_resume_whose_cached_programs_another_run_evicted_only_compiles_them_again(
  straight_run, tmp_path
):
  cache = tmp_path / "cache"
  _train(tmp_path / "run", cache, 2)
  saved = Checkpointer(tmp_path / "run" / "checkpoints").read_host(2)["compiled_programs"]
  _evict_everything(cache)
  summary, opt_state, records = _train(tmp_path / "run", cache, 4)
  # The checkpoint's record still decides the first step's program (the cached shape it names,
  # now compiled again): the same steps as with the entries there, and as the run in one process.
  first = records[2]
  assert first["compile_fallback"] and first["micro_batch_size"] in saved["fused"]
  assert summary["compile_cache_hits"] == 0  # nothing was there to load
  _assert_same_updates(records, opt_state, straight_run)


def test_an_exact_resume_stays_exact_when_another_run_evicted_its_programs(tmp_path):
  def scheduled(workdir, num_steps):  # the default policy: programs chosen by the step count
    schedule = simigrad_jax.make_controller("step_schedule", thresholds=THRESHOLDS)
    return train_records(workdir, tmp_path / "cache", num_steps, controller=schedule)

  _, straight_opt_state, straight = scheduled(tmp_path / "straight", 4)
  scheduled(tmp_path / "run", 2)
  _evict_everything(tmp_path / "cache")
  _, opt_state, resumed = scheduled(tmp_path / "run", 4)
  plan = ("batch_size", "micro_batch_size", "accumulation_steps", "compile_fallback", "loss")
  assert [[r[k] for k in plan] for r in resumed] == [[r[k] for k in plan] for r in straight]
  for leaf, straight_leaf in zip(
    jax.tree.leaves(opt_state), jax.tree.leaves(straight_opt_state), strict=True
  ):
    np.testing.assert_array_equal(leaf, straight_leaf)


def test_a_checkpoint_naming_another_cache_is_not_used(tmp_path):
  _train(tmp_path / "run", tmp_path / "cache", 2)
  _, _, records = _train(tmp_path / "run", tmp_path / "other_cache", 3)
  # Its first step waits for its own shape: the other cache holds nothing of this run.
  assert records[2]["micro_batch_size"] == 2 and not records[2]["compile_fallback"]


@pytest.mark.parametrize(
  "record",
  [
    None,
    "fused",
    {"compilation_cache_dir": "/elsewhere", "fused": [4], "micro": [], "apply": True},
    {"compilation_cache_dir": "/cache", "fused": [4.0], "micro": [], "apply": True},
    {"compilation_cache_dir": "/cache", "fused": None, "micro": [], "apply": True},
  ],
)
def test_a_record_the_run_cannot_use_is_ignored(record):
  assert persistent_cache.cached_view(record, "/cache", {2, 4}) is None


def test_a_record_keeps_only_the_shapes_of_the_grid():
  record = {"compilation_cache_dir": "/cache", "fused": [4, 9], "micro": [2], "apply": 1}
  assert persistent_cache.cached_view(record, "/cache", {2, 4}) == {
    "fused": {4},
    "micro": {2},
    "apply": False,  # only True counts
  }
