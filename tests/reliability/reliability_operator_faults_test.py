"""The operator's fault suite: `python -m train` under faults, as an operator meets them.

Each fault is one row of a table (printed at the end; written to
benchmarks/results/faults.json when SIMIGRAD_FAULTS_TABLE is set):

* expected failures of the command line (a config typo, a bad value, the
  workdir in use, unsafe, a file, planted folder links, a missing data
  folder, no readable checkpoint, a file-size limit): one line on stderr
  starting ``simigrad:``, no traceback, a non-zero exit status, and nothing
  left behind in a new workdir;
* damage to ``metrics.jsonl`` (torn, truncated mid-line or at a line,
  NUL lines, garbage, deleted): the resume goes on, every record restored;
* disk errors injected (ENOSPC, EDQUOT, EROFS, EACCES): the line names the
  file and the last good checkpoint;
* umask 000 and a 0755 workdir: every file 0600, every folder 0700;
* SIGKILL and SIGTERM at seeded random moments (compiles and saves
  included) under an artificial CPU load, with the digits demo's default
  settings: nothing lost beyond the steps since the last save, and the run
  completes.

The digits demo runs for one epoch (about 30 steps) with a checkpoint every
5 steps; every run shares one compilation cache. The kill moments are drawn
from SIMIGRAD_RELIABILITY_SEED.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import pathlib
import random
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest

from reliability_helpers import SEED
from reliability_helpers import driver_env
from simigrad_jax.checkpoint import metrics_recovery
from simigrad_jax.multihost import workdir as workdir_module
from train import failures

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "train" / "configs" / "digits_demo.py")
TIMEOUT = 300
RUN_FLAGS = (
  "--config.num_epochs=1",
  "--config.progress=False",
  "--config.plot=False",
  "--config.checkpoint_every_steps=5",
)
TABLE: list[dict[str, object]] = []


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


def run_train(workdir, cache, *flags, preexec=None, timeout=TIMEOUT) -> subprocess.CompletedProcess:
  return subprocess.run(
    train_command(workdir, cache, *flags),
    cwd=ROOT,
    env=driver_env(),
    capture_output=True,
    text=True,
    timeout=timeout,
    preexec_fn=preexec,
  )


def one_clear_line(result: subprocess.CompletedProcess) -> str:
  """The failure's last stderr line, after checking there is no traceback and a non-zero status."""
  lines = result.stderr.strip().splitlines()
  assert result.returncode not in (0, None), result.stderr[-2000:]
  assert lines and lines[-1].startswith("simigrad: "), result.stderr[-2000:]
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  return lines[-1]


def record(fault: str, kind: str, outcome: str, ok: bool) -> None:
  TABLE.append({"fault": fault, "kind": kind, "outcome": outcome[:300], "ok": ok})


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
  """The uninterrupted run, under umask 000 in a 0755 workdir; its cache serves every run."""
  base = tmp_path_factory.mktemp("faults")
  cache, workdir = base / "cache", base / "baseline"
  workdir.mkdir(mode=0o755)
  workdir.chmod(0o755)
  result = run_train(workdir, cache, preexec=lambda: os.umask(0))
  assert result.returncode == 0, result.stderr[-3000:]
  return base, cache, workdir, json.loads((workdir / "summary.json").read_text())


# ------------------------------------------------------------------ umask 000, 0755 workdir


def test_umask_000_and_a_0755_workdir_keep_every_file_private(baseline):
  _, _, workdir, summary = baseline
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
  workdir = base / "damaged-checkpoints"
  (workdir / "checkpoints" / "5").mkdir(parents=True, mode=0o700)
  (workdir / "checkpoints" / "5" / "garbage").write_bytes(b"\0" * 64)
  workdir.chmod(0o700)
  (workdir / "checkpoints").chmod(0o700)
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
        flags = []  # the default cache, <workdir>/compilation_cache
        command = train_command(workdir, base / "unused", *flags)
        command.remove(f"--config.compilation_cache_dir={base / 'unused'}")
        jobs[name] = (
          workdir,
          pool.submit(
            subprocess.run, command, cwd=ROOT, env=driver_env(), capture_output=True, text=True
          ),
        )
        continue
      jobs[name] = (workdir, pool.submit(run_train, workdir, baseline[1], *flags))
    held = base / "held"
    with workdir_module.open_workdir(held):  # the workdir in use
      result = run_train(held, baseline[1])
    line = one_clear_line(result)
    record("workdir in use", "refused start", line, f"pid {os.getpid()}" in line)
    assert f"pid {os.getpid()}" in line
    limited = base / "file-size-limit"
    result = run_train(limited, baseline[1], preexec=_limit_file_size)
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
  for name in ("checkpoints", "tensorboard", "compilation_cache"):  # never chmodded nor written
    target = base / f"target-{name}"
    assert stat.S_IMODE(target.stat().st_mode) == 0o755 and not list(target.iterdir())


# ------------------------------------------------------------------ injected disk errors


@pytest.mark.parametrize("number", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES])
def test_a_disk_error_names_the_file_and_the_last_good_checkpoint(tmp_path, number):
  (tmp_path / "checkpoints" / "20").mkdir(parents=True)
  (tmp_path / "checkpoints" / "25.orbax-checkpoint-tmp").mkdir()
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
  _, _, workdir, summary = baseline
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


def _kills() -> list[tuple[str, int, int, float]]:
  """(signal name, signal, the step record to wait for, then seconds more): seeded."""
  rng = random.Random(SEED)
  return [
    (name, number, rng.randrange(1, 29), rng.uniform(0.0, 1.0))
    for name, number in [("SIGKILL", signal.SIGKILL)] * 5 + [("SIGTERM", signal.SIGTERM)] * 5
  ]


def _wait_for_step(workdir: pathlib.Path, step: int, proc: subprocess.Popen) -> None:
  """Waits until the run logged ``step`` (or ended): a kill lands in training, whatever the load."""
  deadline = time.monotonic() + TIMEOUT
  while proc.poll() is None and time.monotonic() < deadline:
    if any(r.get("step", 0) >= step for r in _records(workdir)):
      return
    time.sleep(0.05)


def _kill_and_resume(base: pathlib.Path, cache: pathlib.Path, index: int, kill) -> dict:
  name, number, at_step, after = kill
  workdir = base / f"kill-{index}"
  proc = subprocess.Popen(
    train_command(workdir, cache),
    cwd=ROOT,
    env=driver_env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  _wait_for_step(workdir, at_step, proc)
  time.sleep(after)
  proc.send_signal(number)
  start = time.monotonic()
  _, err = proc.communicate(timeout=TIMEOUT)
  stopped = time.monotonic() - start
  saved = failures.last_checkpoint(workdir) or 0
  done = max(
    (r["step"] for r in _records(workdir) if "batch_size" in r), default=0
  )  # the steps the killed run finished
  result = run_train(workdir, cache)
  summary = json.loads((workdir / "summary.json").read_text()) if result.returncode == 0 else {}
  return {
    "fault": f"{name} {after:.2f} s after step {at_step}",
    "returncode": proc.returncode,
    "stop_seconds": stopped,
    "saved": saved,
    "done": done,
    "resume": result,
    "summary": summary,
    "records": _records(workdir),
    "stderr": err,
  }


def _records(workdir: pathlib.Path) -> list[dict]:
  path = workdir / "metrics.jsonl"
  if not path.exists():
    return []
  return [r for _, r in metrics_recovery.parse_records(path.read_bytes())[0]]


def test_kills_and_preemptions_under_load_lose_nothing_beyond_the_last_save(baseline):
  base, cache, _, want = baseline
  load = [
    subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)
  ]  # an artificial CPU load on the 2 cores
  try:
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
      outcomes = list(
        pool.map(lambda item: _kill_and_resume(base, cache, *item), enumerate(_kills()))
      )
  finally:
    for proc in load:
      proc.kill()
      proc.wait()
  base_steps = {r["step"]: r for r in _records(baseline[2]) if "batch_size" in r}
  for outcome in outcomes:
    summary = outcome["summary"]
    completed = outcome["resume"].returncode == 0 and summary.get("examples_seen") == 1500
    steps = sorted(r["step"] for r in outcome["records"] if "batch_size" in r)
    nothing_lost = (
      completed and summary["missing_steps"] == [] and steps == list(range(1, summary["steps"] + 1))
    )
    if outcome["fault"].startswith("SIGTERM"):
      nothing_lost = nothing_lost and outcome["returncode"] == 0
    identical = completed and (
      summary["steps"] == want["steps"]
      and summary["eval_accuracy"] == want["eval_accuracy"]
      and all(
        r["batch_size"] == base_steps.get(r["step"], {}).get("batch_size")
        and abs(r["loss"] - base_steps[r["step"]]["loss"]) <= 1e-5
        for r in outcome["records"]
        if "batch_size" in r and r["step"] in base_steps
      )
    )
    record(
      outcome["fault"],
      "kill",
      f"exit {outcome['returncode']} in {outcome['stop_seconds']:.1f} s, after step "
      f"{outcome['done']}, last save {outcome['saved']}; resumed: "
      f"{summary.get('steps')} steps, accuracy {summary.get('eval_accuracy')}; "
      f"identical to the uninterrupted run: {identical}",
      nothing_lost,
    )
    outcome["identical"] = identical
  assert all(r["ok"] for r in TABLE if r["kind"] == "kill"), [
    r for r in TABLE if r["kind"] == "kill" and not r["ok"]
  ]


def teardown_module(module):
  del module
  if not TABLE:
    return
  print("\nfaults tried:", len(TABLE), "ok:", sum(bool(r["ok"]) for r in TABLE))
  for row in TABLE:
    print(f"  {'ok  ' if row['ok'] else 'FAIL'} {row['kind']:16} {row['fault']}: {row['outcome']}")
  if os.environ.get("SIMIGRAD_FAULTS_TABLE"):
    out = ROOT / "benchmarks" / "results" / "faults.json"
    out.write_text(
      json.dumps(
        {
          "machine": "2-core shared CPU machine (loaded), 8 simulated CPU devices",
          "seed": SEED,
          "faults": len(TABLE),
          "ok": sum(bool(r["ok"]) for r in TABLE),
          "table": TABLE,
        },
        indent=2,
      )
      + "\n"
    )
