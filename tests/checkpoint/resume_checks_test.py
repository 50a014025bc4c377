"""resume_checks: a resume refuses another seed and changed settings unless allowed, and says why.

Resumes of real runs (a changed optimizer, data or model; allowed changes kept
in the run's history) are tested in reliability/reliability_run_record_test.py.
"""

import doctest
import logging

import pytest

from simigrad_jax.checkpoint import resume_checks
from simigrad_jax.checkpoint.checkpointer import CheckpointMismatchError

WHERE = "the checkpoint at step 3 in /run/checkpoints"
SAVED = {"optimizer": {"lr": 0.1}, "devices": {"num_devices": 8}}


def test_the_same_seed_passes_and_another_is_refused_naming_both():
  resume_checks.check_seed({"seed": 5}, 5, WHERE)
  with pytest.raises(CheckpointMismatchError, match=rf"^{WHERE} was made with seed=4, .*seed=5"):
    resume_checks.check_seed({"seed": 4}, 5, WHERE)
  with pytest.raises(CheckpointMismatchError, match="seed=None"):
    resume_checks.check_seed({}, 5, WHERE)


def test_without_a_record_on_either_side_nothing_is_compared(caplog):
  assert (
    resume_checks.changes_since({"run": SAVED}, None, allow_changed_settings=False, where=WHERE)
    is None
  )
  with caplog.at_level(logging.WARNING, logger="simigrad_jax"):
    assert resume_checks.changes_since({}, SAVED, allow_changed_settings=False, where=WHERE) is None
  assert f"{WHERE} was written before simigrad_jax recorded a run's settings" in caplog.text


def test_a_changed_environment_is_allowed_and_returned():
  current = {**SAVED, "devices": {"num_devices": 4}}
  changes = resume_checks.changes_since(
    {"run": SAVED}, current, allow_changed_settings=False, where=WHERE
  )
  assert changes.checked == [] and changes.recorded == ["devices.num_devices: 8 there, 4 here"]


def test_a_changed_setting_is_refused_unless_allowed():
  current = {**SAVED, "optimizer": {"lr": 0.2}}
  with pytest.raises(CheckpointMismatchError) as refused:
    resume_checks.changes_since({"run": SAVED}, current, allow_changed_settings=False, where=WHERE)
  assert str(refused.value) == (
    f"{WHERE} was made by a run with other settings:\n"
    "  - optimizer.lr: 0.1 there, 0.2 here\n" + resume_checks.HOW_TO_ALLOW
  )
  changes = resume_checks.changes_since(
    {"run": SAVED}, current, allow_changed_settings=True, where=WHERE
  )
  assert changes.checked == ["optimizer.lr: 0.1 there, 0.2 here"]


def test_another_run_is_described_by_its_record_when_that_says_how_it_differs():
  error = CheckpointMismatchError("w is float32[3] there and float32[4] here")
  layouts = "the workdir '/run' holds checkpoints of another run: w is float32[3] there"
  for saved, record in [(None, SAVED), (SAVED, None), (SAVED, SAVED)]:  # nothing checked differs
    assert resume_checks.other_run_message(error, "/run", saved, record).startswith(layouts)
  current = {"optimizer": {"lr": 0.2}, "devices": {"num_devices": 4}}
  message = resume_checks.other_run_message(error, "/run", SAVED, current)
  assert message.startswith("the workdir '/run' holds checkpoints of another run, whose arrays")
  assert (
    "  - optimizer.lr: 0.1 there, 0.2 here\n  - devices.num_devices: 8 there, 4 here" in message
  )
  assert "cannot be resumed, allowed or not" in message and "float32" not in message


def test_allowed_changes_are_logged_by_kind(caplog):
  changes = resume_checks.run_record.RecordChanges(["optimizer.lr: 0.1 there, 0.2 here"], [])
  with caplog.at_level(logging.WARNING, logger="simigrad_jax"):
    resume_checks.log_changes(changes, WHERE)
  assert "allow_changed_settings=True allows" in caplog.text and "other devices" not in caplog.text
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="simigrad_jax"):
    resume_checks.log_changes(changes._replace(checked=[], recorded=["devices: x"]), WHERE)
  assert "other devices" in caplog.text and "allow_changed_settings" not in caplog.text


def test_doctests():
  result = doctest.testmod(resume_checks)
  assert result.attempted > 0 and result.failed == 0
