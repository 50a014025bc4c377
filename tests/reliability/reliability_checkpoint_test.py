"""Corrupt checkpoints: a damaged newest checkpoint is detected, reported, and skipped for the previous one.

Damage: truncated, emptied or deleted files, garbled JSON, and random single
bit flips anywhere in the checkpoint. orbax alone reads some of these without
an error and returns wrong values (a flipped bit in an array's data file or a
digit of the JSON); the Checkpointer's checksums catch them.
"""

from __future__ import annotations

import errno
import logging
import os
import pathlib
import random
import re
import shutil
import stat
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import simigrad_jax
from reliability_helpers import SEED
from simigrad_jax.checkpoint import checkpointer as checkpointer_module
from simigrad_jax.checkpoint import read_retry
from simigrad_jax.checkpoint.checkpointer import Checkpointer

pytestmark = [
  pytest.mark.reliability,
  # orbax's reader leaves un-awaited coroutines behind when a damaged file fails a read.
  pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


def _files(directory: pathlib.Path, pattern: str) -> list[pathlib.Path]:
  found = sorted(p for p in directory.glob(pattern) if p.is_file())
  assert found, f"no {pattern} in {directory}"
  return found


def truncate_array_data(step_dir):
  for f in _files(step_dir, "state/**/d/*"):
    os.truncate(f, f.stat().st_size // 2)


def flip_bit_in_array_data(step_dir):
  """One flipped bit in the middle of every data file.

  orbax writes each process's b-tree under ``ocdbt.process_<i>/d/`` and merges
  it into ``state/d/``; small arrays are stored inline in the nodes, so which
  copy a restore reads depends on the sizes. Every copy gets the flip, so the
  restore reads a damaged one whatever the layout.
  """
  for f in _files(step_dir, "state/**/d/*"):
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))


def change_a_digit_of_the_json(step_dir):
  """A plausible-looking change orbax cannot see: the sampler position moves by one."""
  f = _files(step_dir, "host/metadata")[0]
  text, count = re.subn(
    r'"examples_seen": (\d+)', lambda m: f'"examples_seen": {int(m[1]) + 1}', f.read_text(), count=1
  )
  assert count == 1
  f.write_text(text)


def truncate_json(step_dir):
  f = _files(step_dir, "host/metadata")[0]
  f.write_text(f.read_text()[:40])


def delete_the_manifest(step_dir):
  for f in _files(step_dir, "state/**/manifest.ocdbt"):
    f.unlink()


def delete_the_arrays(step_dir):
  shutil.rmtree(step_dir / "state")


def empty_every_file(step_dir):
  for f in _files(step_dir, "**/*"):
    f.write_bytes(b"")


def garble_the_metadata(step_dir):
  (step_dir / "state" / "_METADATA").write_text('{"tree_metadata": ')


CORRUPTIONS = [
  truncate_array_data,
  flip_bit_in_array_data,
  change_a_digit_of_the_json,
  truncate_json,
  delete_the_manifest,
  delete_the_arrays,
  empty_every_file,
  garble_the_metadata,
]


def small_state(scale: float):
  return {
    "w": jnp.arange(4000, dtype=jnp.float32).reshape(40, 100) * scale,
    "b": jnp.full((7,), scale, jnp.float32),
    "count": jnp.int32(scale),
    "key": jax.random.key(int(scale)),
  }


def saved_steps(root, steps=(1, 2, 3)):
  ckpt = Checkpointer(root, max_to_keep=5)
  for step in steps:
    ckpt.save(step, small_state(float(step)), {"step": step, "examples_seen": 100 * step})
  ckpt.close()


def _numbers(x):
  """An array's values as NumPy (a PRNG key's data)."""
  return np.asarray(
    jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
  )


def assert_state_equal(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(_numbers(a), _numbers(b))


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__)
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(corrupt, tmp_path, caplog):
  root = tmp_path / "checkpoints"
  saved_steps(root)
  corrupt(root / "3")
  ckpt = Checkpointer(root)
  with caplog.at_level(logging.WARNING, logger="simigrad_jax"):
    state, host, step = ckpt.restore(small_state(0.0))
  assert step == 2 and host == {"step": 2, "examples_seen": 200}
  assert_state_equal(state, small_state(2.0))
  assert "checkpoint at step 3" in caplog.text and "unreadable" in caplog.text  # it says so
  assert [s for s, _ in ckpt.skipped] == [3]
  # The damaged one is moved aside (kept for inspection), so step 3 can be saved again.
  assert ckpt.all_steps() == [1, 2] and len(ckpt.quarantined) == 1
  assert pathlib.Path(ckpt.quarantined[0]).is_dir()
  ckpt.save(3, small_state(3.0), {"step": 3, "examples_seen": 300})
  ckpt.wait()
  state, host, step = ckpt.restore(small_state(0.0))
  assert step == 3 and host["examples_seen"] == 300
  ckpt.close()


def _json_write(monkeypatch, write):
  """Replaces the background write of a checkpoint's JSON item (orbax's) by ``write``."""
  monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "_save_fn", write)


def test_a_bounded_wait_says_whether_the_save_has_finished(tmp_path, monkeypatch):
  """``wait(timeout)`` (the multi-host Trainer's rounds) returns False while the save is under
  way, True once it has finished, and raises the save's error once."""
  release, write = threading.Event(), ocp.handlers.JsonCheckpointHandler._save_fn

  async def held_write(self, item, directory):
    release.wait()  # (orbax runs the write in a thread of its own)
    await write(self, item, directory)

  _json_write(monkeypatch, held_write)
  ckpt = Checkpointer(tmp_path / "checkpoints")
  ckpt.save(1, small_state(1.0), {"step": 1})
  assert ckpt.wait(timeout=0.05) is False
  assert ckpt.wait(timeout=0.05) is False and ckpt.failed_save() is None  # the same save goes on
  release.set()
  assert ckpt.wait(timeout=30) is True and ckpt.all_steps() == [1]

  async def failed_write(self, item, directory):
    raise OSError(errno.ENOSPC, "No space left on device")

  _json_write(monkeypatch, failed_write)
  ckpt.save(2, small_state(2.0), {"step": 2})
  with pytest.raises(OSError, match="No space left on device"):
    ckpt.wait(timeout=30)
  assert ckpt.wait(timeout=30) is True  # raised once
  _json_write(monkeypatch, write)
  ckpt.save(3, small_state(3.0), {"step": 3})
  ckpt.close()
  assert Checkpointer(tmp_path / "checkpoints").all_steps() == [1, 3]


def _failing_reads(ckpt, error, steps, times=None):
  """Makes orbax's reads of the checkpoints of ``steps`` raise ``error`` (the first ``times`` reads
  only, if given); returns the steps of every read."""
  restore, reads = ckpt._manager.restore, []

  def flaky_restore(step, *args, **kwargs):
    reads.append(step)
    if step in steps and (times is None or reads.count(step) <= times):
      raise error
    return restore(step, *args, **kwargs)

  ckpt._manager.restore = flaky_restore
  return reads


# Read errors of the file system: Python's, and tensorstore's report of one (as orbax raises it).
READ_ERRORS = [
  OSError(errno.EIO, "Input/output error"),
  ValueError(
    'UNKNOWN: Error reading local file "/ckpt/3/state/d/0": read failed '
    "[OS error 5: Input/output error]"
  ),
]


@pytest.mark.parametrize("error", READ_ERRORS, ids=["OSError", "tensorstore"])
def test_a_transient_read_error_is_tried_again_and_restores_the_newest(
  error, tmp_path, caplog, monkeypatch
):
  monkeypatch.setattr(read_retry, "READ_RETRY_SECONDS", 0.01)
  root = tmp_path / "checkpoints"
  saved_steps(root)
  ckpt = Checkpointer(root)
  reads = _failing_reads(ckpt, error, steps={3}, times=2)
  with caplog.at_level(logging.WARNING, logger="simigrad_jax"):
    state, host, step = ckpt.restore(small_state(0.0))
  assert step == 3 and host["step"] == 3 and reads[:3] == [3, 3, 3]
  assert_state_equal(state, small_state(3.0))
  assert ckpt.skipped == [] and ckpt.quarantined == [] and ckpt.all_steps() == [1, 2, 3]
  assert (
    caplog.text.count("reading the checkpoint at step 3") == 2 and "trying again" in caplog.text
  )
  assert not (tmp_path / "checkpoints.unreadable").exists()
  ckpt.close()


@pytest.mark.parametrize("error", READ_ERRORS, ids=["OSError", "tensorstore"])
def test_a_read_error_that_persists_is_raised_and_moves_nothing(error, tmp_path, monkeypatch):
  """The newest checkpoint is damaged, the one before fails every read: no checkpoint is
  restored, skipped for good or moved (the failing one may be intact)."""
  monkeypatch.setattr(read_retry, "READ_RETRY_SECONDS", 0.01)
  root = tmp_path / "checkpoints"
  saved_steps(root)
  truncate_array_data(root / "3")
  ckpt = Checkpointer(root)
  reads = _failing_reads(ckpt, error, steps={2})
  with pytest.raises(
    OSError,
    match=r"\[Errno 5\] reading the checkpoint at step 2 in .* failed "
    r"4 times with an error of the file system .*nothing was "
    r"skipped or moved",
  ) as raised:
    ckpt.restore(small_state(0.0))
  assert raised.value.errno == errno.EIO and raised.value.__cause__ is error
  assert reads.count(2) == read_retry.READ_ATTEMPTS
  assert ckpt.all_steps() == [1, 2, 3] and ckpt.quarantined == []
  assert not (tmp_path / "checkpoints.unreadable").exists()
  ckpt.close()


def test_two_damaged_checkpoints_fall_back_two_steps(tmp_path, caplog):
  root = tmp_path / "checkpoints"
  saved_steps(root)
  truncate_array_data(root / "3")
  change_a_digit_of_the_json(root / "2")
  ckpt = Checkpointer(root)
  with caplog.at_level(logging.WARNING, logger="simigrad_jax"):
    _, host, step = ckpt.restore(small_state(0.0))
  assert step == 1 and host["step"] == 1
  assert [s for s, _ in ckpt.skipped] == [3, 2]
  ckpt.close()


def test_every_checkpoint_damaged_is_an_error_naming_each(tmp_path):
  root = tmp_path / "checkpoints"
  saved_steps(root, steps=(1, 2))
  truncate_json(root / "1")
  delete_the_arrays(root / "2")
  ckpt = Checkpointer(root)
  with pytest.raises(ValueError, match=r"no readable checkpoint in .*step 2: .*; step 1: "):
    ckpt.restore(small_state(0.0))
  assert ckpt.all_steps() == [1, 2]  # nothing moved when nothing could be restored
  ckpt.close()


def test_a_checkpoint_of_another_model_is_refused_not_skipped(tmp_path):
  root = tmp_path / "checkpoints"
  saved_steps(root, steps=(1, 2))
  ckpt = Checkpointer(root)
  other = {**small_state(0.0), "w": jnp.zeros((40, 99), jnp.float32)}
  with pytest.raises(
    simigrad_jax.checkpoint.CheckpointMismatchError,
    match=r"step 2 .* different model or optimizer: \['w'\] is float32\[40, 100\] "
    r"there and float32\[40, 99\] here",
  ):
    ckpt.restore(other)
  assert ckpt.all_steps() == [1, 2]
  ckpt.close()


def test_random_bit_flips_never_restore_wrong_values(tmp_path):
  """Flip one random bit of one file of the newest checkpoint, 40 times.

  Each time the restore must return step 2 exactly or fall back to step 1
  exactly; it never returns values that differ from what was saved. Counts how
  often orbax alone (no checksums) would have restored wrong values silently.
  """
  base = tmp_path / "base"
  saved_steps(base, steps=(1, 2))
  # Sorted by folder and size: orbax names data files at random, their sizes do not change.
  files = sorted(
    (p for p in (base / "2").rglob("*") if p.is_file() and p.stat().st_size),
    key=lambda p: (str(p.parent.relative_to(base)), p.stat().st_size, p.name),
  )
  # Two flips in three hit the array data or the JSON, the damage orbax can miss.
  payload_files = [p for p in files if p.parent.name == "d" or p.name == "metadata"]
  rng = random.Random(SEED)
  outcomes = {"exact": 0, "fallback": 0, "orbax_alone_wrong": 0}
  for trial in range(40):
    root = tmp_path / f"trial{trial}"
    shutil.copytree(base, root)
    target = root / rng.choice(payload_files if trial % 3 else files).relative_to(base)
    data = bytearray(target.read_bytes())
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    target.write_bytes(bytes(data))
    # What orbax alone returns for this damage.
    manager = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(create=False))
    try:
      raw = manager.restore(
        2,
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(small_state(0.0)), host=ocp.args.JsonRestore()
        ),
      )
      payload = raw.host.get("payload", {}) if isinstance(raw.host, dict) else {}
      host = payload.get("host")
      if isinstance(host, dict):  # (the directory's ledger of the steps it wrote, not the run's)
        host = {k: v for k, v in host.items() if k != checkpointer_module.WRITTEN_STEPS}
      same = host == {"step": 2, "examples_seen": 200} and all(
        np.array_equal(_numbers(a), _numbers(b))
        for a, b in zip(jax.tree.leaves(raw.state), jax.tree.leaves(small_state(2.0)))
      )
      outcomes["orbax_alone_wrong"] += not same
    except Exception:  # pylint: disable=broad-except  (orbax noticed)
      pass
    manager.close()
    ckpt = Checkpointer(root)
    state, host, step = ckpt.restore(small_state(0.0))
    ckpt.close()
    assert_state_equal(state, small_state(float(step)))
    assert host == {"step": step, "examples_seen": 100 * step}
    outcomes["exact" if step == 2 else "fallback"] += 1
  print(f"\nbit flips: {outcomes}")
  assert outcomes["fallback"] >= outcomes["orbax_alone_wrong"]


# ------------------------------------------------------------ in the Trainer


class _Data:
  """The trainer test's tiny MLP problem."""

  @staticmethod
  def make_trainer(workdir, **kwargs):
    from tiny_run import TinyMLP  # pylint: disable=import-outside-toplevel
    from tiny_run import dataset  # pylint: disable=import-outside-toplevel
    from tiny_run import mlp_loss  # pylint: disable=import-outside-toplevel

    params = TinyMLP().init(jax.random.key(0), np.zeros((1, 5), np.float32))["params"]
    optimizer = optax.chain(
      simigrad_jax.transform("batch"),
      optax.sgd(0.1, momentum=0.9),
      simigrad_jax.scale_by_lr_factor(),
    )
    controller = simigrad_jax.Controller(
      24, 0.3, batch_size_lower_bound=8, batch_size_upper_bound=64
    )
    return simigrad_jax.Trainer(
      loss_fn=mlp_loss,
      params=params,
      optimizer=optimizer,
      source=simigrad_jax.ArraySource(dataset(num_examples=200)),
      controller=controller,
      workdir=workdir,
      **kwargs,
      config=simigrad_jax.TrainerConfig(
        max_micro_batch_size=4,
        seed=3,
        progress=False,
        tensorboard=False,
        checkpoints=simigrad_jax.CheckpointConfig(every_steps=2),
      ),
    )


def _records(workdir):
  return [
    r for r in simigrad_jax.read_metrics(pathlib.Path(workdir) / "metrics.jsonl") if "loss" in r
  ]


@pytest.fixture(scope="module")
def straight_trainer_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("straight_trainer")
  with _Data.make_trainer(workdir) as trainer:
    trainer.train(num_steps=8)
  return _records(workdir)


@pytest.mark.parametrize(
  "corrupt", [flip_bit_in_array_data, change_a_digit_of_the_json], ids=lambda f: f.__name__
)
def test_trainer_resumes_from_the_previous_checkpoint_and_continues_exactly(
  corrupt, straight_trainer_run, tmp_path, caplog
):
  with _Data.make_trainer(tmp_path) as trainer:
    trainer.train(num_steps=6)  # checkpoints at steps 2, 4, 6
  corrupt(tmp_path / "checkpoints" / "6")
  with caplog.at_level(logging.WARNING, logger="simigrad_jax"):
    trainer = _Data.make_trainer(tmp_path)
  assert trainer.step == 4
  assert (
    "checkpoint at step 6" in caplog.text and "resumed from the checkpoint at step 4" in caplog.text
  )
  with trainer:
    trainer.train(num_steps=8)
  records = _records(tmp_path)
  assert [r["step"] for r in records] == list(range(1, 9))
  for key in ("batch_size", "lr_factor", "next_batch_size", "examples_seen"):
    assert [r[key] for r in records] == [r[key] for r in straight_trainer_run], key
  np.testing.assert_allclose(
    [r["loss"] for r in records], [r["loss"] for r in straight_trainer_run], rtol=0, atol=1e-5
  )
  assert 6 in Checkpointer(tmp_path / "checkpoints").all_steps()  # step 6 was saved again
  assert list((tmp_path / "checkpoints.unreadable").iterdir())  # the damaged one, kept aside
  # other users can read neither the checkpoints nor the damaged ones
  assert (tmp_path / "checkpoints.unreadable").stat().st_mode & 0o077 == 0


def test_a_checkpoint_written_before_checksums_still_restores(tmp_path, caplog):
  """Checkpoints of an older simigrad_jax (host JSON without checksums) restore, with a warning."""
  manager = ocp.CheckpointManager(tmp_path / "checkpoints")
  manager.save(
    5,
    args=ocp.args.Composite(
      state=ocp.args.StandardSave(small_state(5.0)), host=ocp.args.JsonSave({"step": 5})
    ),
  )
  manager.wait_until_finished()
  manager.close()
  ckpt = Checkpointer(tmp_path / "checkpoints")
  with caplog.at_level(logging.WARNING, logger="simigrad_jax"):
    state, host, step = ckpt.restore(small_state(0.0))
  assert step == 5 and host == {"step": 5}
  assert_state_equal(state, small_state(5.0))
  assert "has no checksums" in caplog.text
  ckpt.close()


def test_a_failed_background_save_stops_training_at_the_next_step(tmp_path, monkeypatch):
  """A full disk while step 4's checkpoint is written in the background: training stops at step 5
  with the save's error, not at the next save (step 6) or at the end, once step 5's record is
  written; step 5 is kept in an emergency checkpoint in the workdir."""
  write = ocp.handlers.JsonCheckpointHandler._save_fn

  async def full_disk_at_step_4(self, item, directory):
    if item["payload"]["host"]["step"] == 4:
      raise OSError(errno.ENOSPC, "No space left on device")
    await write(self, item, directory)

  _json_write(monkeypatch, full_disk_at_step_4)
  trainer = _Data.make_trainer(tmp_path)  # a checkpoint every 2 steps
  checkpointer = trainer._checkpoints.checkpointer
  save = checkpointer.save

  def save_then_let_it_fail(step, state, host):  # the failure happens before the next step
    save(step, state, host)
    deadline = time.monotonic() + 60
    while step == 4 and checkpointer.failed_save() is None and time.monotonic() < deadline:
      time.sleep(0.005)

  checkpointer.save = save_then_let_it_fail
  with trainer:  # (closing does not raise the error again)
    with pytest.raises(OSError, match="No space left on device") as raised:
      trainer.train(num_steps=10)
    assert trainer.step == 5
  assert raised.value.errno == errno.ENOSPC
  assert any(
    re.search(
      r"the background save of the checkpoint of step 4 in .* failed: training "
      r"stopped at step 5; a restart resumes from the newest finished "
      r"checkpoint \(step 2\)",
      note,
    )
    for note in raised.value.__notes__
  )
  assert [r["step"] for r in _records(tmp_path)] == [1, 2, 3, 4, 5]
  assert raised.value.emergency_checkpoint == tmp_path / "emergency" / "5"
  resumed = Checkpointer(tmp_path / "checkpoints")
  assert resumed.all_steps() == [2]
  resumed.close()


# ------------------------------------------------------ what the run did not make


def _plant_foreign_entries(directory: pathlib.Path, outside: pathlib.Path) -> dict[str, str]:
  """A folder someone made, a link to a folder outside, a file and a FIFO, named like steps."""
  (directory / "1").mkdir(parents=True)
  (directory / "1" / "precious.txt").write_text("someone's")
  outside.mkdir()
  (outside / "theirs.txt").write_text("outside the workdir")
  (directory / "2").symlink_to(outside)
  (directory / "3").write_text("a file")
  os.mkfifo(directory / "4")
  return {"1": "someone's folder", "2": "a link", "3": "a file", "4": "a FIFO"}


def test_cleanup_deletes_only_the_checkpoints_the_run_wrote(tmp_path, caplog):
  """orbax would delete every folder named like a step (and crash on a link); the run keeps its
  own newest checkpoints, by its ledger, and never reads, moves or deletes the rest."""
  directory, outside = tmp_path / "checkpoints", tmp_path / "outside"
  planted = _plant_foreign_entries(directory, outside)
  ckpt = Checkpointer(directory, max_to_keep=2)
  for step in (10, 11, 12, 13):
    ckpt.save(step, small_state(float(step)), {"step": step})
  ckpt.close()
  assert sorted(os.listdir(directory), key=int) == [*planted, "12", "13"]
  assert (directory / "1" / "precious.txt").read_text() == "someone's"
  assert (outside / "theirs.txt").read_text() == "outside the workdir"
  # A resumed run takes the ledger from the checkpoint it restores, and goes on keeping two.
  again = Checkpointer(directory, max_to_keep=2)
  with caplog.at_level(logging.WARNING, logger="simigrad_jax"):
    assert again.all_steps() == [12, 13]
  assert "checkpoints/1 is named like a checkpoint but is not a folder this run wrote" in (
    caplog.text
  )
  assert "checkpoints/2 is named like a checkpoint" in caplog.text and "a link to" in caplog.text
  _, host, step = again.restore(small_state(0.0))
  assert step == 13 and host == {"step": 13}  # (the ledger is the directory's, not given back)
  again.save(14, small_state(14.0), {"step": 14})
  again.close()
  assert sorted(os.listdir(directory), key=int) == [*planted, "13", "14"]
  assert (outside / "theirs.txt").exists() and (directory / "1" / "precious.txt").exists()


def test_an_entry_the_run_did_not_make_is_never_written_through(tmp_path):
  """A link planted where the next checkpoint goes: the save refuses it, naming it."""
  directory, outside = tmp_path / "checkpoints", tmp_path / "outside"
  ckpt = Checkpointer(directory, max_to_keep=2, async_save=False)
  ckpt.save(1, small_state(1.0), {"step": 1})
  outside.mkdir()
  (directory / "2").symlink_to(outside)
  with pytest.raises(
    simigrad_jax.files.UnsafePathError, match=r"checkpoints/2 exists and is a link"
  ):
    ckpt.save(2, small_state(2.0), {"step": 2})
  ckpt.close()
  assert not list(outside.iterdir()) and ckpt.all_steps() == [1]


def test_a_link_as_the_folder_of_unreadable_checkpoints_is_never_followed(tmp_path):
  """A damaged newest checkpoint is moved aside only into a real folder of the workdir."""
  directory, outside = tmp_path / "checkpoints", tmp_path / "outside"
  saved_steps(directory, steps=(1, 2))
  flip_bit_in_array_data(directory / "2")
  outside.mkdir()
  (tmp_path / "checkpoints.unreadable").symlink_to(outside)
  ckpt = Checkpointer(directory)
  with pytest.raises(simigrad_jax.files.UnsafePathError, match=r"checkpoints.unreadable.*link"):
    ckpt.restore(small_state(0.0))
  ckpt.close()
  assert not list(outside.iterdir())  # nothing moved out of the workdir
  assert (directory / "2" / "state").is_dir()  # the damaged checkpoint is where it was


def test_a_trainer_refuses_an_entry_it_did_not_make_where_it_will_save(tmp_path):
  """checkpoints/<step> that the run would reach, planted: refused at the start, not mid-run."""
  from tiny_run import make_trainer

  (tmp_path / "checkpoints").mkdir(mode=0o700)
  os.mkfifo(tmp_path / "checkpoints" / "7")
  with pytest.raises(simigrad_jax.files.UnsafePathError, match=r"checkpoints/7 is named like"):
    make_trainer(tmp_path)
  assert stat.S_ISFIFO(os.lstat(tmp_path / "checkpoints" / "7").st_mode)


def test_a_missing_checkpoints_folder_beside_the_metrics_is_refused(tmp_path):
  """Deleting checkpoints/ and keeping metrics.jsonl would restart from step 0 and rewrite the
  records: refused, naming both choices; nothing is written."""
  from simigrad_jax.checkpoint.run_checkpoints import CheckpointsMissingError
  from tiny_run import make_trainer

  with make_trainer(tmp_path) as trainer:
    trainer.train(num_steps=2)
  shutil.rmtree(tmp_path / "checkpoints")
  before = (tmp_path / "metrics.jsonl").read_bytes()
  with pytest.raises(CheckpointsMissingError) as refused:
    make_trainer(tmp_path)
  message = str(refused.value)
  assert "records steps 1-2 of a run, but its checkpoints folder" in message
  assert "put the checkpoints back" in message and "metrics.jsonl.old" in message
  assert (tmp_path / "metrics.jsonl").read_bytes() == before
  assert not (tmp_path / "checkpoints").exists()


# ------------------------------------------------------ a folder gone, a failure after a step


class _AtStep:
  """A hook that does ``then(workdir)`` once the record of ``step`` is out."""

  runs_at_once = True

  def __init__(self, step, then, workdir):
    self.step, self.then, self.workdir = step, then, workdir

  def on_step(self, record):
    if record.step == self.step:
      self.then(self.workdir)


def _replace_checkpoints_by_a_file(workdir):
  shutil.rmtree(workdir / "checkpoints")
  (workdir / "checkpoints").write_text("not a folder")


def _remove_the_workdir(workdir):
  shutil.rmtree(workdir)


@pytest.mark.parametrize(
  "fault, cause",
  [
    (_replace_checkpoints_by_a_file, "replaced by a file or a link"),
    (_remove_the_workdir, "removed while the run trained"),
  ],
  ids=["checkpoints-replaced-by-a-file", "workdir-removed"],
)
def test_a_checkpoints_folder_gone_mid_run_ends_in_one_line_with_an_emergency_save(
  tmp_path, monkeypatch, fault, cause
):
  """The save finds its folder gone (orbax gave a raw FAILED_PRECONDITION or a message about
  ArrayMetadata): one error naming the folder, and the step saved elsewhere."""
  from simigrad_jax.checkpoint import CheckpointFolderGoneError
  from tiny_run import make_trainer
  from train import failures

  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
  (tmp_path / "tmp").mkdir()
  workdir = tmp_path / "run"
  trainer = make_trainer(workdir, checkpoints=simigrad_jax.CheckpointConfig(every_steps=3))
  trainer.add_hook(_AtStep(2, fault, workdir))
  with pytest.raises(CheckpointFolderGoneError) as failed, trainer:
    trainer.train(num_steps=6)
  error = failed.value
  assert error.emergency_step == 3 and error.emergency_checkpoint is not None
  assert (error.emergency_checkpoint / "state").is_dir()  # the whole step, saved elsewhere
  line = failures.one_line(error, workdir, step=3)
  assert line.startswith(f"simigrad: the checkpoints folder was {cause}")
  assert "step 3 was saved in an emergency checkpoint" in line and "\n" not in line


def test_a_failing_evaluation_at_an_epochs_end_still_leaves_that_steps_checkpoint(tmp_path):
  """The epoch's end is evaluated, then checkpointed: an evaluation that fails (a bad eval
  batch size, a bug) would lose the whole epoch; the step is saved before the error is raised."""
  from tiny_run import make_trainer

  def broken_eval(params, model_state):
    raise ValueError("the evaluation failed")

  trainer = make_trainer(tmp_path, eval_fn=broken_eval)
  with pytest.raises(ValueError, match="the evaluation failed") as failed, trainer:
    trainer.train(num_epochs=2)
  step = trainer.step
  assert Checkpointer(tmp_path / "checkpoints").latest_step() == step
  assert f"the checkpoint of step {step} was saved before stopping" in failed.value.__notes__
  resumed = make_trainer(tmp_path)
  assert resumed.step == step
  resumed.close()


def test_a_failed_emergency_save_leaves_no_partial_copy_of_the_model(tmp_path, monkeypatch):
  """Both places fail mid-save (the workdir's emergency/ and $TMPDIR): nothing of the model is
  left in either, and the error says why for each."""
  from simigrad_jax.checkpoint import emergency

  (tmp_path / "checkpoints").mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
  (tmp_path / "tmp").mkdir()
  real_save = Checkpointer.save

  def save_then_fail(self, step, state, host):
    real_save(self, step, state, host)  # the arrays are on disk: a partial copy
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.directory)

  monkeypatch.setattr(Checkpointer, "save", save_then_fail)
  error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "checkpoints"))
  emergency.save_after(error, tmp_path / "checkpoints", 3, small_state(3.0), {"step": 3})
  assert error.emergency_checkpoint is None and "No space left" in error.emergency_why
  assert not list((tmp_path / "tmp").iterdir())  # no simigrad-emergency-* copy left
  assert not [p for p in (tmp_path / "emergency").iterdir() if p.name.startswith("3")]
