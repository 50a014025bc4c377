"""The workdir's refusals: who holds its lock, a foreign parent, a folder link, permissions."""

import json
import os
import pathlib
import stat
import subprocess
import sys

import pytest

from simigrad_jax import files
from simigrad_jax.multihost import workdir as workdir_module


def test_a_lock_held_by_an_unrelated_live_process_names_that_process(tmp_path):
  workdir = tmp_path / "run"
  with workdir_module.open_workdir(workdir):
    pass  # the lock file now names this process, as a finished run leaves it
  dead = {"pid": 999999, "host": os.uname().nodename}
  (workdir / "run.lock").write_text(json.dumps(dead) + "\n")
  holder = subprocess.Popen(
    [
      sys.executable,
      "-c",
      "import fcntl,sys,time; f=open(sys.argv[1]); "
      "fcntl.flock(f, fcntl.LOCK_EX); print(1, flush=True); time.sleep(60)",
      str(workdir / "run.lock"),
    ],
    stdout=subprocess.PIPE,
  )
  try:
    holder.stdout.readline()
    with pytest.raises(workdir_module.WorkdirLockedError) as error:
      workdir_module.open_workdir(workdir)
    message = str(error.value)
    assert f"pid {holder.pid}" in message and "a process it started" not in message
  finally:
    holder.kill()
    holder.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a folder to another user")
def test_a_refused_foreign_1777_parent_gets_no_folder_made_in_it(tmp_path):
  shared = tmp_path / "shared"
  shared.mkdir()
  shared.chmod(0o1777)
  os.chown(shared, 4242, 4242)
  with pytest.raises(files.UnsafePathError, match="belongs to uid 4242"):
    workdir_module.open_workdir(shared / "run")
  assert not (shared / "run").exists()


@pytest.mark.parametrize("name", ["checkpoints", "tensorboard", "compilation_cache"])
def test_a_folder_link_in_the_workdir_is_refused_and_its_target_untouched(tmp_path, name):
  target = tmp_path / "elsewhere"
  target.mkdir(mode=0o755)
  target.chmod(0o755)
  (tmp_path / name).symlink_to(target)
  with pytest.raises(files.UnsafePathError, match=f"{name} is a symlink to .*remove the link"):
    files.make_private_dir(tmp_path / name, what="folder", tighten=True)
  assert stat.S_IMODE(target.stat().st_mode) == 0o755


def test_made_folders_are_0700_whatever_the_umask(tmp_path):
  old = os.umask(0)
  try:
    folder = files.make_private_dir(tmp_path / "a" / "b")
    with files.open_for_append(folder / "f") as f:
      f.write("x")
  finally:
    os.umask(old)
  assert stat.S_IMODE(folder.stat().st_mode) == stat.S_IMODE(folder.parent.stat().st_mode) == 0o700
  assert stat.S_IMODE((folder / "f").stat().st_mode) == 0o600


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_workdir_without_permission_says_workdir(tmp_path):
  locked = tmp_path / "locked"
  locked.mkdir(mode=0o500)
  with pytest.raises(files.WorkdirAccessError, match="workdir"):
    workdir_module.open_workdir(locked / "run")
  with pytest.raises(files.WorkdirAccessError, match="workdir .* is not writable"):
    workdir_module.open_workdir(locked)


def test_a_workdir_the_os_refuses_says_workdir_as_root_too(tmp_path, monkeypatch):
  """The refusals of the test above, made by hand, so that they run as root (CI) too: each is
  reported as a WorkdirAccessError that names the workdir."""
  locked = tmp_path / "locked"
  locked.mkdir(mode=0o700)
  real_mkdir, real_open = pathlib.Path.mkdir, files.open_nofollow

  def refused(path):
    return PermissionError(13, "Permission denied", str(path))

  def mkdir(self, *args, **kwargs):
    if locked in self.parents:
      raise refused(self)
    return real_mkdir(self, *args, **kwargs)

  def open_nofollow(path, *args, **kwargs):
    if pathlib.Path(path).parent == locked:
      raise refused(path)
    return real_open(path, *args, **kwargs)

  monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
  monkeypatch.setattr(files, "open_nofollow", open_nofollow)
  with pytest.raises(files.WorkdirAccessError, match="workdir .* cannot be created: permission"):
    workdir_module.open_workdir(locked / "run")
  with pytest.raises(files.WorkdirAccessError, match="workdir .* is not writable"):
    workdir_module.open_workdir(locked)
