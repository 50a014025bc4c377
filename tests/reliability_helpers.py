"""Helpers for the reliability tests: run tests/train_driver.py in subprocesses and read its traces.

Every subprocess runs under a timeout, so that a hang fails the test instead of CI.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from waiting import wait_until

ROOT = pathlib.Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "train_driver.py"
DRIVER_TIMEOUT_SECONDS = 180
# The kill points are drawn from this seed; set SIMIGRAD_RELIABILITY_SEED to draw others.
SEED = int(os.environ.get("SIMIGRAD_RELIABILITY_SEED", "20261123"))


def driver_env() -> dict[str, str]:
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  env.pop("XLA_FLAGS", None)  # the driver sets its own device count
  return env


def default_signals() -> None:
  """A child's ``preexec_fn``: SIGINT and SIGHUP at their default actions in the child.

  A shell starts a background job (``pytest ... &``) with SIGINT ignored, and a
  child inherits an ignored signal, so a run under test would never see the
  Ctrl-C the test sends it.
  """
  for number in (signal.SIGINT, signal.SIGHUP):
    signal.signal(number, signal.SIG_DFL)


def wait_until_caught(pid: int, signum: int, timeout: float = DRIVER_TIMEOUT_SECONDS) -> None:
  """Waits until process ``pid`` catches ``signum`` (its handler is installed; Linux's
  ``/proc/<pid>/status``), or it has ended.

  A signal sent before the handler exists takes its default action: the
  interpreter's start, on a loaded machine, can outlast a test's "soon after
  the start".
  """
  status = pathlib.Path(f"/proc/{pid}/status")

  def caught_or_gone() -> bool:
    try:
      caught = next(line for line in status.read_text().splitlines() if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
      return True  # ended (or no /proc: nothing to wait for)
    return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)

  wait_until(caught_or_gone, timeout, f"process {pid} to install its handler of signal {signum}")


def run_driver(
  workdir: os.PathLike, *args: Any, timeout: float = DRIVER_TIMEOUT_SECONDS
) -> subprocess.CompletedProcess:
  """Runs the driver once in its own process; raises subprocess.TimeoutExpired on a hang."""
  command = [sys.executable, str(DRIVER), "--workdir", str(workdir), *map(str, args)]
  return subprocess.run(command, env=driver_env(), capture_output=True, text=True, timeout=timeout)


def run_processes(
  workdir: os.PathLike, per_process_args: list[list[Any]], timeout: float = DRIVER_TIMEOUT_SECONDS
) -> list[tuple[int, str, str, float]]:
  """Runs one driver per entry of ``per_process_args`` as the processes of one jax.distributed run.

  Returns ``(returncode, stdout, stderr, seconds)`` per process. A process
  still running after ``timeout`` seconds is killed and reported with
  returncode None (the caller's assertion then fails instead of hanging).
  """
  coordinator = f"127.0.0.1:{free_port()}"
  count = len(per_process_args)
  start = time.monotonic()
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        str(DRIVER),
        "--workdir",
        str(workdir),
        "--num-processes",
        str(count),
        "--process-id",
        str(i),
        "--coordinator",
        coordinator,
        *map(str, extra),
      ],
      env=driver_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i, extra in enumerate(per_process_args)
  ]
  results = []
  for proc in procs:
    remaining = max(1.0, timeout - (time.monotonic() - start))
    try:
      out, err = proc.communicate(timeout=remaining)
      results.append((proc.returncode, out, err, time.monotonic() - start))
    except subprocess.TimeoutExpired:
      for other in procs:
        if other.poll() is None:
          other.kill()
      out, err = proc.communicate()
      results.append((None, out, err, time.monotonic() - start))
  return results


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def read_jsonl(path: os.PathLike) -> list[dict[str, Any]]:
  """The complete lines of a JSON-lines file (a line torn by SIGKILL is dropped)."""
  records = []
  for line in pathlib.Path(path).read_text().splitlines():
    try:
      records.append(json.loads(line))
    except ValueError:
      pass
  return records


def read_trace(workdir: os.PathLike, process: int = 0) -> list[dict[str, Any]]:
  """The driver's test-only trace of one process ([] if it never got past the Trainer's set-up)."""
  path = pathlib.Path(workdir) / f"trace.{process}.jsonl"
  return read_jsonl(path) if path.exists() else []


def attempts(trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Splits a trace into the driver's runs: ``{"start", "steps", "kill"}`` each."""
  runs = []
  for event in trace:
    if event["event"] == "start":
      runs.append({"start": event, "steps": [], "kill": None})
    elif event["event"] == "step":
      runs[-1]["steps"].append(event)
    elif event["event"] == "kill":
      runs[-1]["kill"] = event
  return runs


def step_records(workdir: os.PathLike) -> list[dict[str, Any]]:
  """The per-step lines of the run's metrics file."""
  return [r for r in read_jsonl(pathlib.Path(workdir) / "metrics.jsonl") if "loss" in r]


def finished_checkpoints(workdir: os.PathLike) -> list[int]:
  """The steps of the finished checkpoints in the workdir (orbax's temporary folders excluded)."""
  directory = pathlib.Path(workdir) / "checkpoints"
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
