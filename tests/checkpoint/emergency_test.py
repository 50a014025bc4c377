"""An emergency checkpoint when a disk stops a save: saved elsewhere, adopted on resume, exact."""

from __future__ import annotations

import errno
import json
import os
import tempfile

import numpy as np
import pytest

import simigrad_jax
from simigrad_jax.checkpoint import checkpointer as checkpointer_module
from simigrad_jax.checkpoint import emergency
from tiny_run import make_trainer

EVERY_3_STEPS = simigrad_jax.CheckpointConfig(every_steps=3)

STATE = {"w": np.arange(6, dtype=np.float32)}


def _disk_error(number: int = errno.ENOSPC) -> OSError:
  return OSError(number, os.strerror(number), "/w/checkpoints/5/state")


@pytest.mark.parametrize(
  "error, number",
  [
    (_disk_error(), errno.ENOSPC),
    (_disk_error(errno.EROFS), errno.EROFS),
    (RuntimeError("tensorstore: Permission denied [source locations...]"), errno.EACCES),
    (ValueError("a bad value"), None),
  ],
)
def test_disk_errno_reads_the_chain_and_the_texts_of_compiled_libraries(error, number):
  try:
    raise RuntimeError("the save failed") from error
  except RuntimeError as wrapped:
    assert emergency.disk_errno(wrapped) == number


def test_a_disk_error_saves_the_step_in_the_workdirs_emergency_folder(tmp_path):
  (tmp_path / "checkpoints").mkdir()
  error = _disk_error()
  emergency.save_after(error, tmp_path / "checkpoints", 7, STATE, {"step": 7})
  assert error.emergency_checkpoint == tmp_path / "emergency" / "7"
  assert error.emergency_step == 7
  assert "emergency checkpoint" in error.__notes__[0]
  assert oct((tmp_path / "emergency").stat().st_mode & 0o777) == "0o700"
  assert emergency.adopt(tmp_path / "checkpoints", None) == 7
  assert not (tmp_path / "emergency").exists()
  state, host, step = checkpointer_module.Checkpointer(tmp_path / "checkpoints").restore(STATE)
  assert step == 7 and host["step"] == 7
  np.testing.assert_array_equal(state["w"], STATE["w"])


def test_the_emergency_save_goes_to_tmpdir_when_the_workdir_takes_nothing(tmp_path, monkeypatch):
  (tmp_path / "checkpoints").mkdir()
  (tmp_path / "emergency").write_text("")  # not a folder: refused
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
  (tmp_path / "tmp").mkdir()
  error = _disk_error()
  emergency.save_after(error, tmp_path / "checkpoints", 3, STATE, {"step": 3})
  folder = error.emergency_checkpoint
  assert folder.parent.parent.parent == tmp_path / "tmp" and folder.name == "3"
  assert (folder / "state").is_dir()


def test_no_place_taking_it_is_said_and_other_errors_save_nothing(tmp_path, monkeypatch):
  (tmp_path / "emergency").write_text("")
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "not-there"))
  error = _disk_error()
  emergency.save_after(error, tmp_path / "checkpoints", 3, STATE, {"step": 3})
  assert error.emergency_checkpoint is None
  assert "no emergency checkpoint" in error.__notes__[0] and "not-there" in error.__notes__[0]
  other = ValueError("a bug")
  emergency.save_after(other, tmp_path / "checkpoints", 3, STATE, {"step": 3})
  assert not hasattr(other, "emergency_checkpoint")


def test_an_emergency_checkpoint_older_than_the_newest_is_dropped_not_adopted(tmp_path):
  (tmp_path / "checkpoints").mkdir()
  emergency.save_after(_disk_error(), tmp_path / "checkpoints", 4, STATE, {"step": 4})
  assert emergency.adopt(tmp_path / "checkpoints", 5) is None
  assert not (tmp_path / "emergency").exists()


def _metrics(workdir):
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return [json.loads(line) for line in lines if '"batch_size"' in line]


@pytest.mark.parametrize("where", ["in the save", "in the background"])
def test_a_full_disk_before_the_first_save_loses_no_step_and_the_resume_is_exact(
  tmp_path, monkeypatch, where
):
  """A Trainer whose saves in checkpoints/ fail (a full disk there) before its first checkpoint,
  at once or in the background (then known at the next step): the steps done, their records
  too, are kept in emergency/, and the resume ends as a run never stopped."""
  straight = make_trainer(tmp_path / "straight", checkpoints=EVERY_3_STEPS)
  with straight:
    want = straight.train(num_steps=6)
  cls = checkpointer_module.Checkpointer
  real_save, real_failed = cls.save, cls.failed_save
  failed: list[OSError] = []

  def full_disk(self, step, state, host):
    if os.path.basename(self.directory) != "checkpoints":
      return real_save(self, step, state, host)
    error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{self.directory}/{step}")
    if where == "in the save":
      raise error
    failed.append(error)  # nothing written; the failure is reported by failed_save()

  monkeypatch.setattr(cls, "save", full_disk)
  monkeypatch.setattr(cls, "failed_save", lambda self: failed[-1] if failed else None)
  workdir = tmp_path / "full"
  trainer = make_trainer(workdir, checkpoints=EVERY_3_STEPS)
  with pytest.raises(OSError) as error, trainer:
    trainer.train(num_steps=6)
  kept = 3 if where == "in the save" else 4  # the step whose agreement learnt of it
  assert error.value.emergency_step == kept
  assert error.value.emergency_checkpoint == workdir / "emergency" / str(kept)
  assert [r["step"] for r in _metrics(workdir)] == list(range(1, kept + 1))
  monkeypatch.setattr(cls, "save", real_save)
  monkeypatch.setattr(cls, "failed_save", real_failed)
  resumed = make_trainer(workdir, checkpoints=EVERY_3_STEPS)
  assert resumed.step == kept
  with resumed:
    got = resumed.train(num_steps=6)
  assert got["steps"] == want["steps"] == 6
  for a, b in zip(_metrics(tmp_path / "straight"), _metrics(workdir), strict=True):
    assert (a["step"], a["batch_size"]) == (b["step"], b["batch_size"])
    assert abs(a["loss"] - b["loss"]) <= 1e-5
