"""Checkpointer: orbax saves and restores, the newest kept, a damaged checkpoint skipped for the
one before it, a checkpoint of another model refused.

The fault suite (tests/reliability/reliability_checkpoint_test.py) damages checkpoints in
every way it knows and fails their reads; here is the Checkpointer's everyday behaviour,
on arrays sharded over the 8 simulated devices.
"""

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import compiles
from simigrad_jax.checkpoint import CheckpointMismatchError
from simigrad_jax.checkpoint import checkpointer
from simigrad_jax.checkpoint.checkpointer import Checkpointer


def _state(devices, scale: float) -> dict:
  """Parameters sharded over the devices, and a scalar and a step count replicated on them (the
  Trainer's state lies on its mesh whole)."""
  mesh = Mesh(np.array(devices), ("batch",))
  weights = jnp.arange(64 * 3, dtype=jnp.float32).reshape(64, 3) * scale
  replicated = NamedSharding(mesh, P())
  return {
    "w": jax.device_put(weights, NamedSharding(mesh, P("batch"))),
    "b": jax.device_put(jnp.float32(scale), replicated),
    "count": jax.device_put(jnp.int32(int(scale)), replicated),
  }


def _assert_same(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert a.dtype == b.dtype and a.shape == b.shape
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_save_restores_exactly_with_its_shardings(devices, tmp_path):
  ckpt = Checkpointer(tmp_path / "checkpoints")
  assert ckpt.latest_step() is None and ckpt.all_steps() == []
  state = _state(devices, 2.0)
  ckpt.save(5, state, {"step": 5, "examples_seen": 320})
  assert ckpt.wait() and ckpt.failed_save() is None
  restored, host, step = ckpt.restore(_state(devices, 0.0))
  assert step == 5 and host == {"step": 5, "examples_seen": 320}
  _assert_same(restored, state)
  assert restored["w"].sharding.is_equivalent_to(state["w"].sharding, 2)
  assert ckpt.read_host(5) == {"step": 5, "examples_seen": 320}
  assert ckpt.skipped == [] and ckpt.quarantined == []
  ckpt.close()


def test_the_newest_are_kept_and_any_step_restores(devices, tmp_path):
  ckpt = Checkpointer(tmp_path / "checkpoints", max_to_keep=2, async_save=False)
  for step in (1, 2, 3):
    ckpt.save(step, _state(devices, float(step)), {"step": step})
  assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3
  restored, host, step = ckpt.restore(_state(devices, 0.0), step=2)
  assert step == 2 and host == {"step": 2}
  _assert_same(restored, _state(devices, 2.0))
  ckpt.close()
  # Another Checkpointer on the same directory (a resumed run) finds them.
  again = Checkpointer(tmp_path / "checkpoints")
  assert again.all_steps() == [2, 3]
  again.close()


def test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before_it(devices, tmp_path):
  root = tmp_path / "checkpoints"
  ckpt = Checkpointer(root, max_to_keep=3)
  for step in (1, 2):
    ckpt.save(step, _state(devices, float(step)), {"step": step})
  ckpt.close()
  for data in sorted(p for p in (root / "2").glob("state/**/d/*") if p.is_file()):
    os.truncate(data, data.stat().st_size // 2)
  ckpt = Checkpointer(root)
  restored, host, step = ckpt.restore(_state(devices, 0.0))
  assert step == 1 and host == {"step": 1}
  _assert_same(restored, _state(devices, 1.0))
  assert [s for s, _ in ckpt.skipped] == [2]
  # Moved aside to <directory>.unreadable/, so that the run can save step 2 again.
  assert ckpt.all_steps() == [1] and len(ckpt.quarantined) == 1
  assert pathlib.Path(ckpt.quarantined[0]).parent.name == "checkpoints.unreadable"
  ckpt.close()


@pytest.mark.parametrize("how", ["copied", "renamed"])
def test_a_checkpoint_folder_under_another_steps_name_is_skipped_not_resumed_from(
  devices, tmp_path, how
):
  # A copy of step 1 named 30 was resumed from as step 1 (the run went back 29 steps without a
  # word); a step renamed 99 was taken for the newest.
  import shutil  # pylint: disable=import-outside-toplevel

  root = tmp_path / "checkpoints"
  ckpt = Checkpointer(root, max_to_keep=5, async_save=False)
  for step in (1, 2):
    ckpt.save(step, _state(devices, float(step)), {"step": step})
  ckpt.close()
  if how == "copied":
    shutil.copytree(root / "1", root / "30")
    want, want_all = 2, [1, 2]
  else:
    (root / "2").rename(root / "99")
    want, want_all = 1, [1]
  ckpt = Checkpointer(root)
  restored, host, step = ckpt.restore(_state(devices, 0.0))
  assert step == want and host == {"step": want}
  _assert_same(restored, _state(devices, float(want)))
  (skipped, why), *_ = ckpt.skipped
  assert skipped in (30, 99) and "saved as step" in why and "copied or renamed" in why
  assert ckpt.all_steps() == want_all and len(ckpt.quarantined) == 1
  ckpt.close()


def test_a_checkpoint_of_another_format_is_refused_not_set_aside(devices, tmp_path):
  # It was taken for damage: moved to checkpoints.unreadable/ and an older step resumed, or,
  # with every step so, "every checkpoint is damaged".
  import json  # pylint: disable=import-outside-toplevel

  root = tmp_path / "checkpoints"
  ckpt = Checkpointer(root, max_to_keep=3, async_save=False)
  for step in (1, 2):
    ckpt.save(step, _state(devices, float(step)), {"step": step})
  ckpt.close()
  (metadata,) = (root / "2" / "host").glob("metadata")
  record = json.loads(metadata.read_text())
  record["format"] = "simigrad_jax.checkpoint/2"
  metadata.write_text(json.dumps(record))
  ckpt = Checkpointer(root)
  with pytest.raises(
    ValueError, match=r"step 2 was written by another version of simigrad_jax .*checkpoint/2'"
  ):
    ckpt.restore(_state(devices, 0.0))
  assert ckpt.all_steps() == [1, 2] and not (tmp_path / "checkpoints.unreadable").exists()
  ckpt.close()


def test_a_checkpoint_of_another_model_is_refused_naming_the_difference(devices, tmp_path):
  ckpt = Checkpointer(tmp_path / "checkpoints", async_save=False)
  ckpt.save(1, _state(devices, 1.0), {"step": 1})
  state = _state(devices, 0.0)
  other = dict(state, w=jax.device_put(jnp.zeros((64, 4), jnp.float32), state["b"].sharding))
  with pytest.raises(CheckpointMismatchError, match=r"different model or optimizer: .*\['w'\]"):
    ckpt.restore(other)
  assert ckpt.all_steps() == [1] and ckpt.skipped == []  # nothing skipped or moved
  ckpt.close()


def test_no_checkpoint_and_bad_arguments_are_refused(tmp_path):
  ckpt = Checkpointer(tmp_path / "checkpoints")
  with pytest.raises(FileNotFoundError, match="no checkpoint in"):
    ckpt.restore({"w": jnp.zeros(3)})
  ckpt.close()
  with pytest.raises(ValueError, match="parent .* does not exist"):
    Checkpointer(tmp_path / "missing" / "checkpoints")
  (tmp_path / "file").write_text("")
  with pytest.raises(ValueError, match="exists and is not a directory"):
    Checkpointer(tmp_path / "file")
  with pytest.raises(ValueError, match="max_to_keep must be an integer >= 1, got 0"):
    Checkpointer(tmp_path / "checkpoints", max_to_keep=0)
  for bad in (True, 2.0):
    with pytest.raises(ValueError, match=rf"max_to_keep must be an integer >= 1, got {bad!r}"):
      Checkpointer(tmp_path / "checkpoints", max_to_keep=bad)
  numpy_count = Checkpointer(tmp_path / "checkpoints", max_to_keep=np.int64(2))  # was refused
  assert numpy_count.max_to_keep == 2 and type(numpy_count.max_to_keep) is int
  numpy_count.close()
  assert not os.path.exists(tmp_path / "missing")


def _replicated_state(devices) -> dict:
  """Arrays every device holds whole, of shapes no other test saves (so no program of theirs is
  compiled yet in this process)."""
  replicated = NamedSharding(Mesh(np.array(devices), ("batch",)), P())
  return {
    "w": jax.device_put(jnp.arange(40 * 7, dtype=jnp.float32).reshape(40, 7), replicated),
    "m": jax.device_put(jnp.ones((40, 7), jnp.bfloat16), replicated),
    "key": jax.device_put(jax.random.key(7), replicated),
  }


def test_a_prepared_save_compiles_nothing_in_the_calling_thread(devices, tmp_path):
  # A run's first save, often a stop on a signal: neither the checksums nor orbax's
  # per-replica slices of the replicated arrays may compile in the main thread.
  state = _replicated_state(devices)
  ckpt = Checkpointer(tmp_path / "checkpoints", async_save=False)
  ckpt.prepare(state)
  with compiles.compiled_in_this_thread() as compiled_here:
    ckpt.save(1, state, {"step": 1})
  assert compiled_here == []
  restored, _, step = ckpt.restore(_replicated_state(devices))
  assert step == 1
  _assert_same(restored, state)
  ckpt.close()


def test_a_checkpoint_saved_replica_parallel_restores_identically(devices, tmp_path, monkeypatch):
  # Checkpoints written with orbax's default (each replicated array's save shared out over
  # the devices), as before the state item saved arrays whole, read back the same.
  def orbax_default():
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item, args in (
      ("state", ocp.args.StandardSave),
      ("state", ocp.args.StandardRestore),
      ("host", ocp.args.JsonSave),
      ("host", ocp.args.JsonRestore),
    ):
      registry.add(item, args)
    return registry

  state = {**_state(devices, 3.0), **_replicated_state(devices)}
  with monkeypatch.context() as patched:
    patched.setattr(checkpointer, "_handler_registry", orbax_default)
    old = Checkpointer(tmp_path / "checkpoints", async_save=False)
    old.save(4, state, {"step": 4})
    old.close()
  ckpt = Checkpointer(tmp_path / "checkpoints")
  restored, host, step = ckpt.restore({**_state(devices, 0.0), **_replicated_state(devices)})
  assert step == 4 and host == {"step": 4}
  _assert_same(restored, state)
  for name in state:
    assert restored[name].sharding.is_equivalent_to(state[name].sharding, state[name].ndim)
  ckpt.close()
