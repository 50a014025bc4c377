"""One run per workdir and safe files: the lock, private folders, no symlink followed, the config history.

A second run on a workdir fails at once naming the first, and the lock of a
dead run does not block; a workdir or cache that other users can change is
refused unless ``allow_shared_workdir``; files are replaced atomically and
never written through a planted symlink; checkpoints and the compilation cache
are private; an unreadable cache entry is replaced; ``config.json`` keeps
every start.
"""

import doctest
import json
import os
import pathlib
import signal
import stat
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax._src import compilation_cache as jax_compilation_cache

import simigrad_jax
from reliability_helpers import DRIVER
from reliability_helpers import driver_env
from simigrad_jax import files
from simigrad_jax.compile import persistent_cache
from simigrad_jax.multihost import workdir as workdir_module
from simigrad_jax.multihost.process_agreement import ProcessAgreement
from simigrad_jax.trainer import run_setup
from tiny_run import make_trainer
from tiny_run import trainer_objects
from train import config_history
from train import train
from train.configs import digits_demo
from waiting import wait_until

ROOT = pathlib.Path(__file__).resolve().parents[2]
OTHER_UID = 4242  # a user this test makes the owner of folders (as root), or pretends to be


def mode_of(path) -> int:
  return stat.S_IMODE(os.stat(path).st_mode)


def tiny_demo_config(**changes):
  """The digits demo at a size that compiles once and trains in seconds."""
  config = digits_demo.get_config()
  config.mode, config.cnn_features, config.cnn_dense = "pad", (4, 8), 16
  config.tensorboard = config.progress = False
  config.update(changes)
  return config


# ------------------------------------------------------------------ one run per workdir


def test_a_second_run_fails_at_once_naming_the_first_and_a_dead_runs_lock_does_not_block(
  tmp_path, monkeypatch
):
  workdir = tmp_path / "run"
  # Run A: a real run in its own process, stopped (SIGSTOP) after its first step, holding the
  # workdir as a run paused by a scheduler or a debugger does.
  first = subprocess.Popen(
    [
      sys.executable,
      str(DRIVER),
      "--workdir",
      str(workdir),
      "--steps",
      "20",
      "--freeze-at",
      "1",
      "--agreement-timeout",
      "10",
    ],
    env=driver_env(),
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  try:
    trace = workdir / "trace.0.jsonl"
    wait_until(lambda: trace.exists() and '"freeze"' in trace.read_text(), 120, "run A's step 1")
    objects = trainer_objects(workdir)
    # "At once" is the lock's attempt: it fails without waiting for run A. It is timed alone: the
    # Trainer's set-up before it (the first step's trace, the state placed on the devices) takes
    # over a second on a loaded machine.
    attempts = []

    def timed_open_workdir(*args, **kwargs):
      start = time.perf_counter()
      try:
        return workdir_module.open_workdir(*args, **kwargs)
      finally:
        attempts.append(time.perf_counter() - start)

    monkeypatch.setattr(run_setup, "open_workdir", timed_open_workdir)
    with pytest.raises(simigrad_jax.multihost.WorkdirLockedError) as error:
      simigrad_jax.Trainer(
        **objects,
        config=simigrad_jax.TrainerConfig(
          max_micro_batch_size=4, progress=False, tensorboard=False
        ),
      )
    monkeypatch.undo()
    [seconds] = attempts  # one attempt, not a retry until run A ends
    message = str(error.value)
    assert f"pid {first.pid} on host {os.uname().nodename}" in message, message
    assert "train_driver.py --workdir" in message and "since 20" in message
    assert seconds < 1.0, f"the second run took {seconds:.2f} s to fail"
    assert isinstance(error.value, (simigrad_jax.SimiGradError, RuntimeError))
  finally:
    first.kill()  # SIGKILL: no clean-up, its lock file stays behind
    first.wait(timeout=60)
  assert json.loads((workdir / "run.lock").read_text())["pid"] == first.pid
  with make_trainer(workdir) as trainer:  # the kernel released the dead run's lock
    assert json.loads((workdir / "run.lock").read_text())["pid"] == os.getpid()
    trainer.train(num_steps=1)
  with make_trainer(workdir) as trainer:  # close() released this one's
    assert trainer.step == 1


def test_a_trainer_holds_its_workdir_until_closed(tmp_path):
  trainer = make_trainer(tmp_path / "run")
  with pytest.raises(simigrad_jax.multihost.WorkdirLockedError, match=f"pid {os.getpid()} "):
    make_trainer(tmp_path / "run")
  trainer.close()
  make_trainer(tmp_path / "run").close()


def test_python_m_train_takes_the_lock_before_it_writes_anything(tmp_path):
  workdir = tmp_path / "run"
  with workdir_module.open_workdir(workdir):
    start = time.perf_counter()
    with pytest.raises(
      simigrad_jax.multihost.WorkdirLockedError, match="is in use by another run: pid"
    ):
      train.train_and_evaluate(tiny_demo_config(), workdir)
    assert time.perf_counter() - start < 1.0
  assert sorted(os.listdir(workdir)) == ["run.lock"]  # no config.json, cache or metrics


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
  """A data worker made by fork() shares the lock's descriptor; it closes its copy."""
  lock = workdir_module.open_workdir(tmp_path / "run")
  started, started_child = os.pipe()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # JAX warns that it is multithreaded
    child = os.fork()
  if child == 0:  # the child lives on, as a worker would
    os.write(started_child, b"!")  # (its fork handlers have run)
    time.sleep(30)
    os._exit(0)
  try:
    assert os.read(started, 1) == b"!"
    lock.close()
    workdir_module.open_workdir(tmp_path / "run").close()  # the child does not hold it
  finally:
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)


def test_when_another_process_cannot_lock_every_process_raises(tmp_path, monkeypatch):
  """Several processes exchange their outcomes: process 0 releases its lock and names process 1."""
  other = ["WorkdirLockedError", "the workdir is in use by another run: pid 7 on host h"]
  monkeypatch.setattr(ProcessAgreement, "gather", lambda self, what, value: [value, other])
  with pytest.raises(
    simigrad_jax.multihost.WorkdirLockedError,
    match=r"process 1 could not open the workdir: .* pid 7 on host h",
  ):
    workdir_module.open_workdir(tmp_path / "run")
  monkeypatch.undo()
  workdir_module.open_workdir(tmp_path / "run").close()  # released


# ------------------------------------------------------------------ folders other users can change


def make_foreign(path, monkeypatch) -> None:
  """Makes ``path`` belong to another user: for real as root, else by pretending to be another."""
  if os.geteuid() == 0:
    os.chown(path, OTHER_UID, -1)
  else:
    monkeypatch.setattr(files, "current_uid", lambda: OTHER_UID)


def test_a_foreign_or_writable_workdir_is_refused_unless_allowed(tmp_path, monkeypatch):
  foreign = tmp_path / "foreign"
  foreign.mkdir()
  make_foreign(foreign, monkeypatch)
  with pytest.raises(
    simigrad_jax.files.UnsafePathError,
    match=r"the workdir '.*foreign' belongs to "
    r".*, not to this user, .*allow_shared_workdir=True",
  ):
    make_trainer(foreign)
  assert os.listdir(foreign) == []  # nothing read or written there
  monkeypatch.undo()
  for mode, who in ((0o777, "group and world"), (0o775, "group"), (0o757, "world")):
    shared = tmp_path / f"shared_{mode:o}"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(
      simigrad_jax.files.UnsafePathError, match=f"has mode {mode:#o}: it is {who}-writable"
    ):
      make_trainer(shared)
  # A parent other users can write to, without the sticky bit: they could swap the workdir.
  (tmp_path / "open").mkdir()
  (tmp_path / "open").chmod(0o777)
  with pytest.raises(
    simigrad_jax.files.UnsafePathError,
    match=r"is inside '.*open', which has mode 0o777: .*without the sticky bit",
  ):
    make_trainer(tmp_path / "open" / "run")
  # The option lets a shared pod file system through, and leaves its mode as it is.
  with make_trainer(tmp_path / "shared_777", allow_shared_workdir=True) as trainer:
    trainer.train(num_steps=1)
  assert mode_of(tmp_path / "shared_777") == 0o777


def test_a_foreign_or_writable_compilation_cache_is_refused(tmp_path, monkeypatch):
  cache = tmp_path / "cache"
  cache.mkdir()
  cache.chmod(0o777)
  with simigrad_jax.compile.persistent_cache_settings():
    with pytest.raises(
      simigrad_jax.files.UnsafePathError, match="the compilation cache .* has mode 0o777"
    ):
      simigrad_jax.compile.enable_persistent_cache(cache)
    cache.chmod(0o755)
    make_foreign(cache, monkeypatch)
    with pytest.raises(
      simigrad_jax.files.UnsafePathError, match="the compilation cache .* belongs to"
    ):
      simigrad_jax.compile.enable_persistent_cache(cache)


def test_python_m_train_refuses_a_workdir_another_user_prepared(tmp_path, monkeypatch):
  """The issue's case: another user made the workdir (mode 777) with config.json a symlink."""
  workdir = tmp_path / "digits_demo"
  workdir.mkdir()
  secret = tmp_path / "secret"
  secret.write_text("root only\n")
  (workdir / "config.json").symlink_to(secret)
  workdir.chmod(0o777)
  make_foreign(workdir, monkeypatch)
  with pytest.raises(simigrad_jax.files.UnsafePathError, match="belongs to"):
    train.train_and_evaluate(tiny_demo_config(), workdir)
  assert secret.read_text() == "root only\n"


# ------------------------------------------------------------------ files


def test_a_symlink_is_replaced_never_written_through(tmp_path, caplog):
  secret = tmp_path / "secret"
  secret.write_text("root only\n")
  (tmp_path / "summary.json").symlink_to(secret)
  files.write_atomic(tmp_path / "summary.json", '{"steps": 3}\n')
  assert secret.read_text() == "root only\n"
  assert not (tmp_path / "summary.json").is_symlink()
  assert (tmp_path / "summary.json").read_text() == '{"steps": 3}\n'
  assert f"symlink to {secret}" in caplog.text
  assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left
  # The metrics file, appended to and read on resume, is refused instead.
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "metrics.jsonl").symlink_to(secret)
  for resume_step in (None, 3):
    with pytest.raises(simigrad_jax.files.UnsafePathError, match="metrics.jsonl is a symlink to"):
      simigrad_jax.trainer.MetricsWriter(
        tmp_path / "run", tensorboard=False, resume_step=resume_step
      )
  (tmp_path / "run" / "run.lock").symlink_to(secret)  # and so is the lock file
  with pytest.raises(simigrad_jax.files.UnsafePathError, match="run.lock is a symlink to"):
    workdir_module.open_workdir(tmp_path / "run")
  assert secret.read_text() == "root only\n"


def test_an_atomic_rewrite_keeps_the_mode_of_the_file_it_replaces(tmp_path):
  path = tmp_path / "metrics.png"
  old = os.umask(0)
  try:
    files.write_atomic(path, b"one")  # a new file is private whatever the umask
  finally:
    os.umask(old)
  assert mode_of(path) == 0o600
  path.chmod(0o640)
  files.write_atomic(path, b"two")
  assert path.read_bytes() == b"two" and mode_of(path) == 0o640


def test_checkpoints_and_the_compilation_cache_are_private(tmp_path, caplog):
  (tmp_path / "run" / "checkpoints").mkdir(parents=True)  # made by hand, readable by all
  (tmp_path / "run" / "checkpoints").chmod(0o755)
  (tmp_path / "run").chmod(0o700)
  cache = tmp_path / "cache"
  with simigrad_jax.compile.persistent_cache_settings():
    cached = simigrad_jax.CompileConfig(cache_dir=cache)
    with make_trainer(tmp_path / "run", compile=cached) as trainer:
      trainer.train(num_steps=1)
    with make_trainer(tmp_path / "new", compile=cached) as trainer:
      trainer.train(num_steps=1)
  # Not the run's to chmod: left as it is, with a warning that says how.
  assert mode_of(tmp_path / "run" / "checkpoints") == 0o755
  assert "chmod 700 " + str(tmp_path / "run" / "checkpoints") in caplog.text
  assert mode_of(tmp_path / "new") == mode_of(tmp_path / "new" / "checkpoints") == 0o700
  assert mode_of(cache) == 0o700 and list(cache.iterdir())
  assert os.listdir(tmp_path / "new" / "checkpoints")  # the final save is in there


def test_an_unreadable_compilation_cache_entry_is_replaced(tmp_path, caplog):
  cache = tmp_path / "cache"

  def unreadable_cache_probe(x):
    return x * 3 + 1

  def compile_and_collect_warnings():
    jax.clear_caches()  # so that the program is read from the persistent cache
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      assert float(jax.jit(unreadable_cache_probe)(jnp.float32(2))) == 7
    return [str(w.message) for w in caught if "compilation cache" in str(w.message)]

  with simigrad_jax.compile.persistent_cache_settings():
    jax_compilation_cache.reset_cache()  # whatever cache an earlier test of this process opened
    persistent_cache.enable_persistent_cache(cache)
    assert compile_and_collect_warnings() == []
    # This program's entries only: a compile left running in the background by an earlier test
    # of this process may write its own into the process-wide cache meanwhile.
    entries = sorted(cache.glob("jit_unreadable_cache_probe-*-cache"))
    assert entries
    for entry in entries:  # as a process killed while writing, or a bad disk, leaves them
      entry.write_bytes(entry.read_bytes()[:20])
    assert any(
      "Error reading persistent compilation cache entry" in w
      for w in compile_and_collect_warnings()
    )
    assert all(len(entry.read_bytes()) > 20 for entry in entries)  # replaced
    assert "replacing the unreadable compilation cache entry" in caplog.text
    assert compile_and_collect_warnings() == []  # and read from then on


# ------------------------------------------------------------------ python -m train's files


def test_config_json_keeps_every_start_and_summary_json_replaces_a_symlink(tmp_path):
  workdir = tmp_path / "run"
  workdir.mkdir(mode=0o700)
  (workdir / "config.json").write_text(json.dumps({"seed": 9, "model": "old"}))  # an old version's
  with simigrad_jax.compile.persistent_cache_settings():
    train.train_and_evaluate(tiny_demo_config(num_steps=2, plot=False), workdir)
    assert not (workdir / "metrics.png").exists()
    secret = tmp_path / "secret"
    secret.write_text("root only\n")
    (workdir / "summary.json").unlink()
    (workdir / "summary.json").symlink_to(secret)
    summary = train.train_and_evaluate(tiny_demo_config(num_steps=3), workdir)
  starts = config_history.read_starts(workdir)
  assert [s["config"].get("num_steps") for s in starts] == [None, 2, 3]
  assert starts[0] == {"started": None, "config": {"seed": 9, "model": "old"}}
  assert [s["resumed_at_step"] for s in starts[1:]] == [0, 2]
  assert [s["config"]["plot"] for s in starts[1:]] == [False, True]
  assert all(
    s["started"].startswith("20")
    and s["processes"] == 1
    and s["devices"] == "8 x cpu, device halves"
    and s["versions"]["jax"] == jax.__version__
    for s in starts[1:]
  )
  assert secret.read_text() == "root only\n"
  assert json.loads((workdir / "summary.json").read_text())["steps"] == summary["steps"] == 3
  assert (workdir / "metrics.png").stat().st_size > 1000


def test_python_m_train_keeps_its_default_workdir_in_the_users_cache(tmp_path):
  env = dict(os.environ, PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(tmp_path / "xdg"))
  env.pop("XLA_FLAGS", None)
  result = subprocess.run(  # a bad value fails after the workdir is made, before any training
    [
      sys.executable,
      "-m",
      "train",
      "--config",
      "train/configs/digits_demo.py",
      "--config.dtype=float16",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 1 and "config.dtype='float16' is not valid" in result.stderr
  assert result.stderr.strip().splitlines()[-1].startswith("simigrad: ")
  assert "Traceback" not in result.stderr
  # The workdir ($XDG_CACHE_HOME/simigrad/digits_demo) was made, locked, refused, and removed
  # again with the parents the start made: a refused start leaves nothing behind.
  assert not (tmp_path / "xdg").exists()


def test_doctests():
  for module in (files, workdir_module, config_history):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted and not result.failed, module.__name__


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_special_file_where_a_run_file_should_be_is_refused_at_once(tmp_path, kind):
  """A FIFO would block the start forever waiting for a writer; a device is another program's."""
  path = tmp_path / "metrics.jsonl"
  if kind == "fifo":
    os.mkfifo(path)
  else:
    path.symlink_to("/dev/null")
    path = pathlib.Path("/dev/null")  # (a device itself: never read as a run's file)
  with pytest.raises(files.UnsafePathError, match="where the run keeps a plain file"):
    files.read_plain_file(path)
  with pytest.raises(files.UnsafePathError, match="where the run keeps a plain file"):
    files.open_for_append(path)


def test_the_fix_for_a_folder_where_a_file_is_kept_removes_a_folder(tmp_path):
  # It said "rm <path>", which refuses a folder.
  (tmp_path / "metrics.jsonl").mkdir()
  error = files.refuse_special(tmp_path / "metrics.jsonl")
  assert "is a folder, where the run keeps a plain file" in str(error)
  assert f"(rm -r {tmp_path / 'metrics.jsonl'})" in str(error)
  os.mkfifo(tmp_path / "pipe")
  assert f"(rm {tmp_path / 'pipe'})" in str(files.refuse_special(tmp_path / "pipe"))


def test_a_compilation_cache_path_that_is_a_file_names_the_settings_that_move_it(tmp_path):
  (tmp_path / "cache").write_text("")
  with pytest.raises(
    ValueError, match=r"is a file: move it away.*SIMIGRAD_JAX_CACHE_DIR.*compilation_cache_dir"
  ):
    persistent_cache.enable_persistent_cache(tmp_path / "cache")


def test_a_trainer_refuses_a_fifo_as_its_metrics_file_instead_of_hanging(tmp_path):
  os.mkfifo(tmp_path / "metrics.jsonl")
  with pytest.raises(files.UnsafePathError, match=r"metrics.jsonl is a FIFO \(named pipe\)"):
    make_trainer(tmp_path)
  assert stat.S_ISFIFO(os.lstat(tmp_path / "metrics.jsonl").st_mode)  # left as it was
