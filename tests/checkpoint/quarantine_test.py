"""quarantine: unreadable checkpoints are moved aside under names that are never taken twice.

A restore that quarantines damaged checkpoints of a real run is tested in
reliability/reliability_checkpoint_test.py.
"""

import doctest
import os
import stat

from simigrad_jax.checkpoint import quarantine as quarantine_module
from simigrad_jax.checkpoint.quarantine import free_names
from simigrad_jax.checkpoint.quarantine import quarantine


def checkpoints(root, steps):
  for step in steps:
    (root / str(step)).mkdir(parents=True)
    (root / str(step) / "data").write_text(f"step {step}")
  return str(root)


def test_free_names_skip_the_taken_ones_and_each_other():
  assert free_names([3, 2], taken=[]) == ["3.0", "2.0"]
  assert free_names([3, 3, 3], taken=["3.1"]) == ["3.0", "3.2", "3.3"]
  assert free_names([], taken=["3.0"]) == []


def test_the_checkpoints_move_to_a_private_folder_beside_the_directory(tmp_path):
  directory = checkpoints(tmp_path / "checkpoints", [1, 2, 3])
  moved = quarantine(directory, [3, 2])
  root = tmp_path / "checkpoints.unreadable"
  assert moved == [str(root / "3.0"), str(root / "2.0")]
  assert sorted(os.listdir(directory)) == ["1"]
  assert (root / "3.0" / "data").read_text() == "step 3"
  assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_a_step_quarantined_again_gets_the_next_number(tmp_path):
  directory = checkpoints(tmp_path / "checkpoints", [3])
  assert quarantine(directory, [3]) == [str(tmp_path / "checkpoints.unreadable" / "3.0")]
  checkpoints(tmp_path / "checkpoints", [3])  # saved again by the resumed run, damaged again
  assert quarantine(directory, [3]) == [str(tmp_path / "checkpoints.unreadable" / "3.1")]
  assert sorted(os.listdir(tmp_path / "checkpoints.unreadable")) == ["3.0", "3.1"]


def test_a_step_whose_folder_is_gone_is_not_moved(tmp_path):
  directory = checkpoints(tmp_path / "checkpoints", [])
  assert quarantine(directory, [4]) == [str(tmp_path / "checkpoints.unreadable" / "4.0")]
  assert not (tmp_path / "checkpoints.unreadable").exists()


def test_doctests():
  result = doctest.testmod(quarantine_module)
  assert result.attempted > 0 and result.failed == 0
