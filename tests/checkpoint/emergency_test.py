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


def test_an_emergency_checkpoint_older_than_the_newest_is_dropped_not_adopted(tmp_path, caplog):
  (tmp_path / "checkpoints").mkdir()
  emergency.save_after(_disk_error(), tmp_path / "checkpoints", 4, STATE, {"step": 4})
  with caplog.at_level("WARNING", logger="simigrad_jax"):
    assert emergency.adopt(tmp_path / "checkpoints", 5) is None
  assert not (tmp_path / "emergency").exists()
  # Said, not silent: a folder someone put there goes too.
  assert "removed the emergency checkpoint of step 4" in caplog.text


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


# -------------------------------------------- an emergency checkpoint in $TMPDIR, cleaned up


def _full_disk_in(*folders):
  """A ``Checkpointer.save`` that fails with ENOSPC in ``folders`` (a full disk there)."""
  real_save = checkpointer_module.Checkpointer.save

  def save(self, step, state, host):
    if os.path.abspath(self.directory) in {os.path.abspath(f) for f in folders}:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{self.directory}/{step}")
    return real_save(self, step, state, host)

  return save


@pytest.fixture
def saved_in_tmpdir(tmp_path, monkeypatch):
  """The checkpoint of step 3 saved in $TMPDIR: the workdir's emergency/ takes the record alone."""
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
  (tmp_path / "tmp").mkdir()
  (tmp_path / "checkpoints").mkdir()
  with monkeypatch.context() as patch:
    patch.setattr(checkpointer_module.Checkpointer, "save", _full_disk_in(tmp_path / "emergency"))
    error = _disk_error()
    emergency.save_after(error, tmp_path / "checkpoints", 3, STATE, {"step": 3})
  made = error.emergency_checkpoint.parent.parent
  assert made.parent == tmp_path / "tmp" and made.name.startswith("simigrad-emergency-")
  return made


def test_the_folder_in_tmpdir_is_recorded_and_removed_once_a_later_checkpoint_is_held(
  tmp_path, saved_in_tmpdir
):
  record = tmp_path / "emergency" / "elsewhere.json"
  assert json.loads(record.read_text()) == {"saves": [{"folder": str(saved_in_tmpdir), "step": 3}]}
  assert oct(record.stat().st_mode & 0o777) == "0o600"
  other = tmp_path / "tmp" / "simigrad-emergency-another-run"  # not this run's: never touched
  (other / "checkpoints").mkdir(parents=True)
  assert emergency.remove_superseded(tmp_path / "checkpoints", 2) == []  # still needed
  assert (saved_in_tmpdir / "checkpoints" / "3" / "state").is_dir() and record.exists()
  assert emergency.remove_superseded(tmp_path / "checkpoints", 3) == [saved_in_tmpdir]
  assert not saved_in_tmpdir.exists() and not (tmp_path / "emergency").exists()
  assert (other / "checkpoints").is_dir()


def _replace_by_a_link(folder, tmp_path):
  target = tmp_path / "moved"
  os.rename(folder, target)
  folder.symlink_to(target)
  return target / "checkpoints" / "3" / "state"


def _add_a_file(folder, tmp_path):
  (folder / "notes.txt").write_text("the user's own")
  return folder / "notes.txt"


def _add_a_step(folder, tmp_path):
  (folder / "checkpoints" / "9").mkdir()
  return folder / "checkpoints" / "3" / "state"


def _point_the_record_elsewhere(folder, tmp_path):
  precious = tmp_path / "precious"
  (precious / "checkpoints").mkdir(parents=True)
  record = {"saves": [{"folder": str(precious), "step": 3}]}
  (tmp_path / "emergency" / "elsewhere.json").write_text(json.dumps(record))
  return precious / "checkpoints"


@pytest.mark.parametrize(
  "change, why",
  [
    (_replace_by_a_link, "no longer a folder"),
    (_add_a_file, "holds more than checkpoints/"),
    (_add_a_step, "holds more than the checkpoint of step 3"),
    (_point_the_record_elsewhere, "not named simigrad-emergency-"),
  ],
  ids=["a-link", "a-file-beside", "another-step", "a-foreign-folder"],
)
def test_a_recorded_folder_that_is_no_longer_what_the_run_made_is_left_alone(
  tmp_path, saved_in_tmpdir, caplog, change, why
):
  kept = change(saved_in_tmpdir, tmp_path)
  assert emergency.remove_superseded(tmp_path / "checkpoints", 5) == []
  assert os.path.lexists(kept)
  assert why in caplog.text and "left" in caplog.text
  assert not (tmp_path / "emergency").exists()  # the record's entry is dropped, and the record


@pytest.mark.parametrize("how", ["adopted", "superseded by a later save"])
def test_a_trainers_emergency_checkpoint_in_tmpdir_is_removed_once_not_needed(
  tmp_path, monkeypatch, how
):
  """The workdir's disk takes no checkpoint, so step 3 goes to $TMPDIR. Moved into emergency/
  as the failure's line says, it is adopted and the folder left in $TMPDIR removed; not moved,
  it is removed once the resumed run has saved step 3 again."""
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
  (tmp_path / "tmp").mkdir()
  workdir = tmp_path / "run"
  with monkeypatch.context() as patch:
    patch.setattr(
      checkpointer_module.Checkpointer,
      "save",
      _full_disk_in(workdir / "checkpoints", workdir / "emergency"),
    )
    trainer = make_trainer(workdir, checkpoints=EVERY_3_STEPS)
    with pytest.raises(OSError) as error, trainer:
      trainer.train(num_steps=3)
  rescued = error.value.emergency_checkpoint
  made = rescued.parent.parent
  assert error.value.emergency_step == 3 and made.parent == tmp_path / "tmp"
  assert (workdir / "emergency" / "elsewhere.json").is_file()
  if how == "adopted":
    os.rename(rescued, workdir / "emergency" / "3")
  resumed = make_trainer(workdir, checkpoints=EVERY_3_STEPS)
  assert resumed.step == (3 if how == "adopted" else 0)
  assert made.exists() == (how != "adopted")
  with resumed:
    resumed.train(num_steps=3)  # (adopted: nothing left to train)
  assert not made.exists() and not (workdir / "emergency").exists()
  assert checkpointer_module.Checkpointer(workdir / "checkpoints").latest_step() == 3
