"""The operator's fault suite: `python -m train` under faults, as an operator meets them.

Each fault is one row of a table (printed at the end; written to
benchmarks/results/faults.json when SIMIGRAD_FAULTS_TABLE is set, with every
row, its result and, for SIGTERM, the seconds from the signal to the exit):

* expected failures of the command line (a config typo, a bad value, the
  workdir in use, unsafe, a file, planted folder links, a missing data
  folder, no readable checkpoint, a file-size limit): one line on stderr
  starting ``simigrad:``, no traceback, a non-zero exit status, and nothing
  left behind in a new workdir;
* damage to ``metrics.jsonl`` (torn, truncated mid-line or at a line,
  NUL lines, garbage, deleted): the resume goes on, every record restored;
* disk errors (ENOSPC, EDQUOT, EROFS, EACCES): the line names the file and
  the last good checkpoint; a save that the disk stops before the first
  checkpoint completes (a full disk, a read-only ``checkpoints/``) keeps
  every step in an emergency checkpoint that the line names, and the resume
  from it is the uninterrupted run;
* umask 000 and a 0755 workdir: every file 0600, every folder 0700;
* SIGKILL and SIGTERM at seeded random moments (while starting and
  compiling, between and during steps, during saves) under an artificial
  CPU load, with the digits demo's default settings: SIGTERM exits 0;
  nothing is lost beyond the steps since the last save (a SIGTERM's stop
  loses none); the resumed run is the uninterrupted one (the same steps and
  batch sizes, the same accuracy exactly, losses to 1e-5).

The digits demo runs for one epoch (30 steps, its batch adapting from 32)
with a checkpoint every 5 steps. One uninterrupted run serves every test
(made once per session, shared by pytest-xdist's workers), and its
compilation cache serves every run; the refusals and the damaged metrics
need no training. The kill moments are drawn from SIMIGRAD_RELIABILITY_SEED.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import json
import os
import pathlib
import random
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
from typing import Any, NamedTuple

import pytest

from reliability_helpers import SEED
from reliability_helpers import driver_env
from reliability_helpers import finished_checkpoints
from reliability_helpers import wait_until_caught
from simigrad_jax.checkpoint import metrics_recovery
from simigrad_jax.multihost import cpu_devices
from simigrad_jax.multihost import workdir as workdir_module
from train import failures

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "train" / "configs" / "digits_demo.py")
TIMEOUT = 300
STEPS = 30  # the baseline's, one epoch of 1,500 examples
RUN_FLAGS = (
  "--config.num_epochs=1",
  "--config.progress=False",
  "--config.plot=False",
  "--config.checkpoint_every_steps=5",
)
TABLE_FILE = ROOT / "benchmarks" / "results" / "faults.json"
# A SIGTERM's exit is measured and recorded; the bound asserted is loose (a loaded CI machine).
SIGTERM_EXIT_BOUND_SECONDS = 60


def shared_folder(tmp_path_factory) -> pathlib.Path:
  """This session's folder, the same for every pytest-xdist worker."""
  base = tmp_path_factory.getbasetemp()
  return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def locked(path: pathlib.Path):
  with open(path, "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    yield


def train_command(workdir: pathlib.Path, cache: pathlib.Path, *flags: str) -> list[str]:
  return [
    sys.executable,
    "-m",
    "train",
    "--config",
    CONFIG,
    "--workdir",
    str(workdir),
    f"--config.compilation_cache_dir={cache}",
    *RUN_FLAGS,
    *flags,
  ]


def run_train(
  workdir, cache, *flags, preexec=None, timeout=TIMEOUT, env=None
) -> subprocess.CompletedProcess:
  return subprocess.run(
    train_command(workdir, cache, *flags),
    cwd=ROOT,
    env=env or driver_env(),
    capture_output=True,
    text=True,
    timeout=timeout,
    preexec_fn=preexec,
  )


def start_train(workdir, cache, *flags, env=None) -> subprocess.Popen:
  """``python -m train`` started, its output piped (for a signal sent while it runs)."""
  return subprocess.Popen(
    train_command(workdir, cache, *flags),
    cwd=ROOT,
    env=env or driver_env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def one_clear_line(result: subprocess.CompletedProcess) -> str:
  """The failure's last stderr line, after checking there is no traceback and a non-zero status."""
  lines = result.stderr.strip().splitlines()
  assert result.returncode not in (0, None), result.stderr[-2000:]
  assert lines and lines[-1].startswith("simigrad: "), result.stderr[-2000:]
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  return lines[-1]


class Baseline(NamedTuple):
  """The uninterrupted run: its session folder, compilation cache, workdir, summary, step records."""

  base: pathlib.Path
  cache: pathlib.Path
  workdir: pathlib.Path
  summary: dict[str, Any]
  steps: dict[int, dict[str, Any]]


@pytest.fixture(scope="session")
def baseline(tmp_path_factory) -> Baseline:
  """The uninterrupted run, under umask 000 in a 0755 workdir, made once per session; its
  compilation cache serves every run."""
  base = shared_folder(tmp_path_factory) / "faults"
  base.mkdir(exist_ok=True)
  cache, workdir = base / "cache", base / "baseline"
  with locked(base / "baseline.lock"):
    if not (workdir / "summary.json").exists():
      shutil.rmtree(workdir, ignore_errors=True)
      workdir.mkdir(mode=0o755)
      workdir.chmod(0o755)
      result = run_train(workdir, cache, preexec=lambda: os.umask(0))
      assert result.returncode == 0, result.stderr[-3000:]
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["steps"] == STEPS and summary["average_batch_size"] != 32, summary
  return Baseline(base, cache, workdir, summary, step_records(workdir))


def records(workdir: pathlib.Path) -> list[dict]:
  path = workdir / "metrics.jsonl"
  if not path.exists():
    return []
  return [r for _, r in metrics_recovery.parse_records(path.read_bytes())[0]]


def step_records(workdir: pathlib.Path) -> dict[int, dict[str, Any]]:
  return {r["step"]: r for r in records(workdir) if "batch_size" in r}


def differences(want: Baseline, workdir: pathlib.Path) -> list[str]:
  """How the finished run in ``workdir`` differs from the uninterrupted one ([]: identical:
  the same steps and batch sizes, the same accuracy exactly, losses to 1e-5)."""
  path = workdir / "summary.json"
  if not path.exists():
    return ["no summary.json"]
  summary = json.loads(path.read_text())
  found = [
    f"{key} {summary.get(key)} != {want.summary[key]}"
    for key in ("steps", "examples_seen", "eval_accuracy", "final_batch_size", "missing_steps")
    if summary.get(key) != want.summary[key]
  ]
  got = step_records(workdir)
  if sorted(got) != sorted(want.steps):
    found.append(f"steps {sorted(set(got) ^ set(want.steps))} differ")
  for step, record in sorted(got.items()):
    other = want.steps.get(step)
    if other is None:
      continue
    if record["batch_size"] != other["batch_size"]:
      found.append(f"step {step}: batch {record['batch_size']} != {other['batch_size']}")
    if abs(record["loss"] - other["loss"]) > 1e-5:
      found.append(f"step {step}: loss {record['loss']} != {other['loss']}")
  return found


def resumed_at(workdir: pathlib.Path) -> int:
  """The step the last start in ``workdir`` resumed from (config.json's history)."""
  return json.loads((workdir / "config.json").read_text())["starts"][-1]["resumed_at_step"]


def record(fault: str, kind: str, outcome: str, ok: bool, **more: Any) -> None:
  """One row of the table, kept in this session's file (every xdist worker's rows in one)."""
  row = {"fault": fault, "kind": kind, "outcome": outcome[:400], "ok": bool(ok), **more}
  rows = ROWS["file"]
  with locked(rows.with_suffix(".lock")), open(rows, "a") as f:
    f.write(json.dumps(row) + "\n")


ROWS: dict[str, pathlib.Path] = {}  # "file": this session's rows


@pytest.fixture(scope="session", autouse=True)
def fault_table(tmp_path_factory):
  """Collects the rows of every worker; at the end, prints them and (with SIMIGRAD_FAULTS_TABLE)
  writes them to benchmarks/results/faults.json (the last worker to end writes all of them)."""
  rows = shared_folder(tmp_path_factory) / "faults-rows.jsonl"
  ROWS["file"] = rows
  started, load = time.monotonic(), os.getloadavg()[0]
  yield
  with locked(rows.with_suffix(".lock")):
    table = [json.loads(line) for line in rows.read_text().splitlines()] if rows.exists() else []
  if not table:
    return
  table.sort(key=lambda row: (KIND_ORDER.index(row["kind"]), row["fault"]))
  print("\nfaults tried:", len(table), "ok:", sum(r["ok"] for r in table))
  for row in table:
    print(f"  {'ok  ' if row['ok'] else 'FAIL'} {row['kind']:16} {row['fault']}: {row['outcome']}")
  if os.environ.get("SIMIGRAD_FAULTS_TABLE"):
    sigterm = [r["sigterm_exit_seconds"] for r in table if "sigterm_exit_seconds" in r]
    TABLE_FILE.write_text(
      json.dumps(
        {
          "machine": f"{os.cpu_count()}-core CPU machine, shared, 1-minute load average "
          f"{load:.1f} at the start; 8 simulated CPU devices",
          "seed": SEED,
          "faults": len(table),
          "ok": sum(r["ok"] for r in table),
          "by_kind": {
            kind: sum(r["kind"] == kind for r in table)
            for kind in KIND_ORDER
            if any(r["kind"] == kind for r in table)
          },
          "sigterm_exits": len(sigterm),
          "sigterm_exit_seconds_max": round(max(sigterm, default=0.0), 1),
          "sigterm_exits_within_10_s": sum(s <= 10 for s in sigterm),
          "suite_seconds": round(time.monotonic() - started, 1),
          "table": table,
        },
        indent=2,
      )
      + "\n"
    )


KIND_ORDER = ["permissions", "refused start", "disk", "damaged metrics", "kill"]


# ------------------------------------------------------------------ umask 000, 0755 workdir


def test_umask_000_and_a_0755_workdir_keep_every_file_private(baseline):
  workdir, summary = baseline.workdir, baseline.summary
  wrong = []
  for path in [workdir / p for p in ("checkpoints", "tensorboard")] + list(workdir.rglob("*")):
    mode = stat.S_IMODE(path.lstat().st_mode)
    want = 0o700 if path.is_dir() else 0o600
    if mode & ~want & 0o777:
      wrong.append(f"{path.relative_to(workdir)} {mode:#o}")
  record("umask 000, workdir 0755", "permissions", f"{len(wrong)} not private", not wrong)
  assert not wrong
  assert summary["missing_steps"] == [] and summary["examples_seen"] == 1500


# ------------------------------------------------------------------ expected CLI failures


def _foreign_parent(base: pathlib.Path) -> pathlib.Path:
  shared = base / "shared"
  shared.mkdir()
  shared.chmod(0o1777)
  os.chown(shared, 4242, 4242)
  return shared / "run"


def _planted(base: pathlib.Path, name: str) -> pathlib.Path:
  workdir = base / f"link-{name}"
  workdir.mkdir(mode=0o700)
  target = base / f"target-{name}"
  target.mkdir(mode=0o755)
  (workdir / name).symlink_to(target)
  return workdir


def _no_readable_checkpoint(base: pathlib.Path) -> pathlib.Path:
  """A checkpoint orbax wrote (its files' names), every file garbage."""
  workdir = base / "damaged-checkpoints"
  (workdir / "checkpoints" / "5" / "state").mkdir(parents=True, mode=0o700)
  for name in ("_CHECKPOINT_METADATA", "state/_METADATA"):
    (workdir / "checkpoints" / "5" / name).write_bytes(b"\0" * 64)
  workdir.chmod(0o700)
  (workdir / "checkpoints").chmod(0o700)
  return workdir


def _link_ahead(base: pathlib.Path) -> pathlib.Path:
  """A link named like a step the run would save, to a folder outside the workdir."""
  workdir = base / "link-ahead"
  (workdir / "checkpoints").mkdir(parents=True, mode=0o700)
  workdir.chmod(0o700)
  (base / "target-ahead").mkdir(mode=0o755)
  (workdir / "checkpoints" / "99").symlink_to(base / "target-ahead")
  return workdir


def _fifo_metrics(base: pathlib.Path) -> pathlib.Path:
  """A FIFO where the run's metrics file goes: opened blocking, the start would wait forever."""
  workdir = base / "fifo-metrics"
  workdir.mkdir(mode=0o700)
  os.mkfifo(workdir / "metrics.jsonl")
  return workdir


def _metrics_without_checkpoints(base: pathlib.Path) -> pathlib.Path:
  """A run's records, its checkpoints folder deleted."""
  workdir = base / "no-checkpoints"
  workdir.mkdir(mode=0o700)
  (workdir / "metrics.jsonl").write_text('{"step": 1, "batch_size": 32}\n')
  return workdir


def _a_file(base: pathlib.Path) -> pathlib.Path:
  (base / "a-file").write_text("")
  return base / "a-file"


def _limit_file_size() -> None:
  resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))


# name -> (prepare(base) -> workdir, flags, the line must contain, new workdir left empty)
CLI_FAULTS = {
  "config typo": (None, ["--config.learning_rat=0.1"], "did you mean --config.learning_rate", True),
  "unknown flag": (None, ["--bogus=1"], "Unknown command line flag 'bogus'", True),
  "value not a number": (None, ["--config.learning_rate=abc"], "could not convert", True),
  "bad dtype": (None, ["--config.dtype=float16"], "config.dtype='float16' is not valid", True),
  "bad target": (None, ["--config.similarity_target=2.0"], "similarity_target", True),
  "bad platform": (None, ["--config.platform=gpu2"], "config.platform='gpu2'", True),
  "bad optimizer": (None, ["--config.optimizer=adamw2"], "adamw2", True),
  "missing data folder": (
    None,
    ["--config.dataset=mnist", "--config.model=mlp", "--config.mnist_source=local"]
    + ["--config.local_data_dir=/nonexistent"],
    "/nonexistent",
    True,
  ),
  "workdir is a file": (
    lambda base: _a_file(base),
    [],
    "not a directory",
    False,
  ),
  "foreign 1777 parent": (_foreign_parent, [], "belongs to uid 4242", True),
  "checkpoints/ is a link": (
    lambda base: _planted(base, "checkpoints"),
    [],
    "checkpoints is a symlink",
    False,
  ),
  "tensorboard/ is a link": (
    lambda base: _planted(base, "tensorboard"),
    [],
    "tensorboard is a symlink",
    False,
  ),
  "compilation_cache/ is a link": (
    lambda base: _planted(base, "compilation_cache"),
    ["--config.compilation_cache_dir=None"],
    "compilation_cache is a symlink",
    False,
  ),
  "no readable checkpoint": (_no_readable_checkpoint, [], "no readable checkpoint", False),
  "metrics.jsonl is a FIFO": (_fifo_metrics, [], "metrics.jsonl is a FIFO (named pipe)", False),
  "checkpoints/ gone beside metrics.jsonl": (
    _metrics_without_checkpoints,
    [],
    "its checkpoints folder",
    False,
  ),
  "a link named like a checkpoint ahead": (
    _link_ahead,
    [],
    "checkpoints/99 is named like a checkpoint of step 99 but this run did not make it",
    False,
  ),
}


def test_every_expected_failure_ends_with_one_clear_line(baseline, tmp_path):
  base = tmp_path
  if os.geteuid() != 0:  # only root can give a folder to another user
    CLI_FAULTS.pop("foreign 1777 parent")
  jobs = {}
  with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
    for name, (prepare, flags, _, _) in CLI_FAULTS.items():
      workdir = prepare(base) if prepare else base / name.replace(" ", "-") / "new"
      if name == "compilation_cache/ is a link":
        flags = []  # the default cache, the user's shared one ($SIMIGRAD_JAX_CACHE_DIR)
        command = train_command(workdir, base / "unused", *flags)
        command.remove(f"--config.compilation_cache_dir={base / 'unused'}")
        env = driver_env() | {"SIMIGRAD_JAX_CACHE_DIR": str(workdir / "compilation_cache")}
        jobs[name] = (
          workdir,
          pool.submit(subprocess.run, command, cwd=ROOT, env=env, capture_output=True, text=True),
        )
        continue
      jobs[name] = (workdir, pool.submit(run_train, workdir, baseline.cache, *flags))
    held = base / "held"
    with workdir_module.open_workdir(held):  # the workdir in use
      result = run_train(held, baseline.cache)
    line = one_clear_line(result)
    record("workdir in use", "refused start", line, f"pid {os.getpid()}" in line)
    assert f"pid {os.getpid()}" in line
    limited = base / "file-size-limit"
    result = run_train(limited, baseline.cache, preexec=_limit_file_size)
    line = one_clear_line(result)
    ok = "file-size limit" in line and "checkpoint" in line
    record("file-size limit (RLIMIT_FSIZE 40 kB)", "disk", line, ok)
    assert ok, line
    for name, (workdir, future) in jobs.items():
      result = future.result(timeout=TIMEOUT)
      line = one_clear_line(result)
      expected, left_empty = CLI_FAULTS[name][2], CLI_FAULTS[name][3]
      ok = expected in line and (not left_empty or not workdir.exists())
      record(name, "refused start", line, ok)
      assert expected in line, (name, line)
      if left_empty:
        assert not workdir.exists(), (name, sorted(os.listdir(workdir)))
  for name in (
    "checkpoints",
    "tensorboard",
    "compilation_cache",
    "ahead",
  ):  # never chmodded nor written
    target = base / f"target-{name}"
    assert stat.S_IMODE(target.stat().st_mode) == 0o755 and not list(target.iterdir())


# ------------------------------------------------------------------ injected disk errors


@pytest.mark.parametrize("number", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES])
def test_a_disk_error_names_the_file_and_the_last_good_checkpoint(tmp_path, number):
  (tmp_path / "checkpoints" / "20").mkdir(parents=True)
  (tmp_path / "checkpoints" / "20" / "_CHECKPOINT_METADATA").write_text("{}")  # orbax's folder
  (tmp_path / "checkpoints" / "25.orbax-checkpoint-tmp").mkdir()
  (tmp_path / "checkpoints" / "30").symlink_to(tmp_path)  # a link is no checkpoint
  error = OSError(number, os.strerror(number), str(tmp_path / "metrics.jsonl"))
  try:
    raise RuntimeError("the save failed") from error
  except RuntimeError as wrapped:
    line = failures.one_line(wrapped, tmp_path, step=27)
  ok = (
    "metrics.jsonl" in line
    and "last good checkpoint is step 20" in line
    and "steps 21-27" in line
    and "\n" not in line
  )
  record(f"{errno.errorcode[number]} injected", "disk", line, ok)
  assert ok, line


# ------------------------------------------------------------------ a disk that stops the first save

FULL_DISK_AT_FIRST_SAVE = """
import errno, os, runpy, sys
from simigrad_jax.checkpoint import checkpointer

real_save = checkpointer.Checkpointer.save

def full_disk(self, step, state, host):
  if os.path.basename(self.directory) == "checkpoints":
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(self.directory, str(step)))
  return real_save(self, step, state, host)

checkpointer.Checkpointer.save = full_disk
sys.argv = ["train", *sys.argv[1:]]
runpy.run_module("train", run_name="__main__", alter_sys=True)
"""


def _mount(*args: str) -> None:
  subprocess.run(["mount", *args], check=True, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def can_mount(tmp_path_factory) -> bool:
  """Whether this process may mount (root with CAP_SYS_ADMIN): a real full or read-only disk."""
  folder = tmp_path_factory.mktemp("mount-check")
  try:
    _mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder))
  except (OSError, subprocess.SubprocessError):
    return False
  subprocess.run(["umount", str(folder)], check=False, timeout=60)
  return True


def _wait_for_step(workdir: pathlib.Path, step: int, proc: subprocess.Popen) -> None:
  """Waits until the run logged ``step`` (or ended)."""
  deadline = time.monotonic() + TIMEOUT
  while proc.poll() is None and time.monotonic() < deadline:
    if step_records(workdir).keys() >= set(range(1, step + 1)):
      return
    time.sleep(0.02)


WHERE_KEPT = ("emergency", "checkpoints")  # <workdir>/emergency/N, $TMPDIR/.../checkpoints/N


def _resume_after_emergency(
  want: Baseline,
  fault: str,
  workdir: pathlib.Path,
  result: subprocess.CompletedProcess,
  kept_in: pathlib.Path,
  *,
  or_lost_said: bool = False,
) -> None:
  """Checks the failure's line, moves the emergency checkpoint as it says, resumes, compares.

  With ``or_lost_said``, no emergency checkpoint is also right when the line
  says which steps are lost: those since the last completed save (all, before
  the first), as when the disk stopped a write of the metrics mid-step.
  """
  line = one_clear_line(result)
  saved = sorted(
    (p for p in kept_in.rglob("*") if p.name.isdigit() and p.parent.name in WHERE_KEPT),
    key=lambda p: int(p.name),
  )
  if saved:  # named, with nothing lost
    kept = str(saved[-1]) in line and "nothing is lost" in line
    from_wanted = int(saved[-1].name)
    if saved[-1].parent.parent != workdir:  # in $TMPDIR: moved back as the line says
      assert f"mv {saved[-1]} {workdir / 'emergency'}/" in line, line
      (workdir / "emergency").mkdir(mode=0o700, exist_ok=True)
      shutil.move(saved[-1], workdir / "emergency" / saved[-1].name)
  else:  # the steps since the last completed save, said in the line: all of them here
    kept = or_lost_said and re.search(r"the steps trained \(1-\d+\) are lost", line) is not None
    from_wanted = 0
  resumed = run_train(workdir, want.cache)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  diff = differences(want, workdir)
  from_step = resumed_at(workdir)
  ok = kept and not diff and from_step == from_wanted
  record(
    fault,
    "disk",
    f"{line} | resumed from step {from_step}; identical to the uninterrupted run: {not diff}",
    ok,
  )
  assert kept, line
  assert not diff, diff
  assert from_step == from_wanted, (from_step, from_wanted)


def test_a_full_disk_at_the_first_save_keeps_every_step_in_an_emergency_checkpoint(
  baseline, tmp_path
):
  """ENOSPC from every save in checkpoints/ (injected into the writer, any machine)."""
  workdir = tmp_path / "run"
  env = dict(driver_env(), **cpu_devices.simulated_cpu_devices_env(8))
  flags = train_command(workdir, baseline.cache)[3:]  # (after python -m train)
  command = [sys.executable, "-c", FULL_DISK_AT_FIRST_SAVE, *flags]
  result = subprocess.run(
    command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT
  )
  assert finished_checkpoints(workdir) == []
  _resume_after_emergency(
    baseline, "ENOSPC at the first save (injected)", workdir, result, workdir / "emergency"
  )


def test_a_read_only_checkpoints_folder_keeps_every_step_in_the_workdir(
  baseline, tmp_path, can_mount
):
  """checkpoints/ made read-only (a read-only bind mount: root too) before the first save."""
  if not can_mount:
    pytest.skip("needs mount (root with CAP_SYS_ADMIN)")
  workdir = tmp_path / "run"
  proc = start_train(workdir, baseline.cache)
  _wait_for_step(workdir, 2, proc)
  folder = str(workdir / "checkpoints")
  _mount("--bind", folder, folder)
  try:
    _mount("-o", "remount,ro,bind", folder)
    out, err = proc.communicate(timeout=TIMEOUT)
  finally:
    subprocess.run(["umount", folder], check=True, timeout=60)
  result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
  assert finished_checkpoints(workdir) == []
  _resume_after_emergency(
    baseline,
    "checkpoints/ read-only before the first save (bind mount)",
    workdir,
    result,
    workdir / "emergency",
  )


def test_a_full_disk_before_the_first_save_keeps_every_step_in_tmpdir(
  baseline, tmp_path, can_mount
):
  """The workdir on a tmpfs that fills up before the first save: the emergency save goes to
  $TMPDIR, and the line says how to move it back."""
  if not can_mount:
    pytest.skip("needs mount (root with CAP_SYS_ADMIN)")
  disk, tmp = tmp_path / "disk", tmp_path / "tmp"
  disk.mkdir()
  tmp.mkdir()
  _mount("-t", "tmpfs", "-o", "size=32m,mode=0700", "tmpfs", str(disk))
  try:
    workdir = disk / "run"
    proc = start_train(workdir, baseline.cache, env=dict(driver_env(), TMPDIR=str(tmp)))
    _wait_for_step(workdir, 2, proc)
    with open(disk / "filler", "wb") as filler:  # until the disk is full
      with contextlib.suppress(OSError):
        while True:
          filler.write(b"\0" * (1 << 16))
          filler.flush()
    out, err = proc.communicate(timeout=TIMEOUT)
    (disk / "filler").unlink()
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert finished_checkpoints(workdir) == []
    _resume_after_emergency(
      baseline, "disk full before the first save (tmpfs)", workdir, result, tmp, or_lost_said=True
    )
  finally:
    subprocess.run(["umount", "-l", str(disk)], check=False, timeout=60)


# ------------------------------------------------------------------ damaged metrics


def _damage(data: bytes, how: str) -> bytes:
  lines = data.split(b"\n")
  middle = len(lines) // 2
  return {
    "torn last line": data[:-40],
    "truncated mid-line at half": data[: len(data) // 2],
    "truncated at a line at half": b"\n".join(lines[:middle]) + b"\n",
    "NUL line in the middle": b"\n".join(lines[:middle] + [b"\0" * 80] + lines[middle + 1 :]),
    "NUL bytes over three lines": b"\n".join(lines[:5] + [b"\0" * 30] * 3 + lines[8:]),
    "garbage line": b"\n".join(lines[:7] + [b"}{ not json"] + lines[8:]),
    "binary junk appended": data + b"\xff\xfe\x00junk",
    "a line cut in two": b"\n".join(lines[:9] + [lines[9][:20], lines[9][20:]] + lines[10:]),
    "emptied": b"",
    "deleted": b"DELETE",
  }[how]


@pytest.mark.parametrize(
  "how",
  [
    "torn last line",
    "truncated mid-line at half",
    "truncated at a line at half",
    "NUL line in the middle",
    "NUL bytes over three lines",
    "garbage line",
    "binary junk appended",
    "a line cut in two",
    "emptied",
    "deleted",
  ],
)
def test_damaged_metrics_never_block_a_resume_and_lose_nothing(baseline, tmp_path, how):
  workdir, summary = baseline.workdir, baseline.summary
  copy = tmp_path / "run"
  shutil.copytree(workdir, copy, symlinks=True, ignore=shutil.ignore_patterns("run.lock"))
  path = copy / "metrics.jsonl"
  original = metrics_recovery.parse_records(path.read_bytes())[0]
  damaged = _damage(path.read_bytes(), how)
  if damaged == b"DELETE":
    path.unlink()
  else:
    path.write_bytes(damaged)
  last = summary["steps"]
  lost = metrics_recovery.prepare_for_append(path, last, copy / "tensorboard")
  records = [r for _, r in metrics_recovery.parse_records(path.read_bytes())[0]]
  steps = sorted(r["step"] for r in records if "batch_size" in r)
  evals = sorted(r["step"] for r in records if "eval_accuracy" in r)
  want_evals = sorted(r["step"] for _, r in original if "eval_accuracy" in r)
  by_step = {r["step"]: r for _, r in original if "batch_size" in r}
  same = all(
    r["batch_size"] == by_step[r["step"]]["batch_size"]
    and abs(r["loss"] - by_step[r["step"]]["loss"]) <= 1e-5 * max(1.0, abs(r["loss"]))
    for r in records
    if "batch_size" in r
  )
  ok = lost == [] and steps == list(range(1, last + 1)) and evals == want_evals and same
  restored = sum(1 for r in records if r.get("restored_from"))
  record(f"metrics.jsonl: {how}", "damaged metrics", f"{restored} records restored", ok)
  assert ok, (how, lost, steps[:5], evals)


# ------------------------------------------------------------------ kills under load


class Kill(NamedTuple):
  """A signal at a seeded moment: ``when`` is "start" (``value`` seconds after the process
  started: importing, loading, compiling; or as the first step is recorded, if sooner), "step"
  (``value`` seconds after the record of step ``at``) or "save" (as the checkpoint of step
  ``at`` is being written)."""

  signal: signal.Signals
  when: str
  at: int
  value: float

  def __str__(self) -> str:
    name = self.signal.name
    if self.when == "start":
      return f"{name} {self.value:.1f} s after the start"
    if self.when == "save":
      return f"{name} while saving the checkpoint of step {self.at}"
    return f"{name} {self.value:.2f} s after step {self.at}"


def _kills() -> list[Kill]:
  """Seeded: per signal, 2 while starting, 4 between or during steps, 1 during a save."""
  rng = random.Random(SEED)
  kills = []
  for sig in (signal.SIGKILL, signal.SIGTERM):
    kills += [Kill(sig, "start", 0, rng.uniform(0.5, 8.0)) for _ in range(2)]
    kills += [
      Kill(sig, "step", rng.randrange(1, STEPS - 1), rng.uniform(0.0, 1.0)) for _ in range(4)
    ]
    kills += [Kill(sig, "save", 5 * rng.randrange(1, STEPS // 5), 0.0)]
  return kills


KILLS = _kills()


@pytest.fixture(scope="module")
def cpu_load():
  """An artificial CPU load: a busy process beside the runs (one per xdist worker)."""
  load = subprocess.Popen([sys.executable, "-c", "while True: pass"])
  yield
  load.kill()
  load.wait()


def _saving(workdir: pathlib.Path, step: int) -> bool:
  """Whether the checkpoint of ``step`` is being written (orbax's temporary folder) or done."""
  folder = workdir / "checkpoints"
  with contextlib.suppress(OSError):
    return any(p.name.startswith(f"{step}.") or p.name == str(step) for p in folder.iterdir())
  return False


def _signal_at(kill: Kill, workdir: pathlib.Path, proc: subprocess.Popen) -> str:
  """Waits for ``kill``'s moment, sends its signal; returns where the run was."""
  if kill.signal != signal.SIGKILL:  # "while starting" counts from the run's handler on
    wait_until_caught(proc.pid, kill.signal)
  started = time.monotonic()
  deadline = started + TIMEOUT
  while proc.poll() is None and time.monotonic() < deadline:
    if kill.when == "start" and (
      time.monotonic() - started >= kill.value or step_records(workdir)
    ):  # while starting: at its moment, or as the first step is recorded if that comes first
      break
    if kill.when == "step" and kill.at in step_records(workdir):
      # ``value`` seconds on, or as the last step is recorded if sooner: on a fast or a loaded
      # machine the signal still finds the run under way (its last evaluation and save to go)
      moment = time.monotonic() + kill.value
      while time.monotonic() < moment and STEPS not in step_records(workdir):
        time.sleep(0.005)
      break
    if kill.when == "save" and _saving(workdir, kill.at):
      break
    time.sleep(0.005)
  done = max(step_records(workdir), default=0)
  proc.send_signal(kill.signal)
  tmp = [p.name for p in (workdir / "checkpoints").glob("*tmp*")] if workdir.exists() else []
  return f"after step {done}" + (f", during the save of {tmp[0]}" if tmp else "")


@pytest.mark.parametrize("kill", KILLS, ids=[str(k) for k in KILLS])
def test_a_kill_or_preemption_under_load_resumes_the_uninterrupted_run(baseline, cpu_load, kill):
  workdir = baseline.base / f"kill-{KILLS.index(kill)}"
  shutil.rmtree(workdir, ignore_errors=True)
  proc = start_train(workdir, baseline.cache)
  where = _signal_at(kill, workdir, proc)
  sent = time.monotonic()
  out, err = proc.communicate(timeout=TIMEOUT)
  seconds = time.monotonic() - sent
  saved = max(finished_checkpoints(workdir), default=0)
  done = max(step_records(workdir), default=0)  # the steps the stopped run finished
  resumed = run_train(workdir, baseline.cache)
  diff = differences(baseline, workdir) if resumed.returncode == 0 else [resumed.stderr[-500:]]
  from_step = resumed_at(workdir) if (workdir / "config.json").exists() else 0
  if kill.signal == signal.SIGTERM:  # a clean stop: exit 0, the step under way saved
    stopped_ok = proc.returncode == 0 and saved == done and seconds < SIGTERM_EXIT_BOUND_SECONDS
    more = {"sigterm_exit_seconds": round(seconds, 2)}
  else:
    stopped_ok, more = proc.returncode == -signal.SIGKILL, {}
  lost = done - from_step  # the steps done again: those since the last save
  ok = stopped_ok and not diff and from_step == saved
  record(
    str(kill),
    "kill",
    f"{where}: exit {proc.returncode} in {seconds:.1f} s, last save {saved}; resumed from step "
    f"{from_step} ({lost} steps done again): {STEPS} steps wanted, "
    f"identical to the uninterrupted run: {not diff}",
    ok,
    **more,
  )
  assert stopped_ok, (proc.returncode, seconds, saved, done, out[-1000:], err[-2000:])
  assert not diff, diff
  assert from_step == saved, (from_step, saved)
