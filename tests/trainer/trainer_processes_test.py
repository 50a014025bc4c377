"""The Trainer in processes of its own (tests/train_driver.py): killed and resumed, two hosts as one."""

import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

import simigrad_jax

ROOT = pathlib.Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "train_driver.py"


def run_driver(workdir, *extra, processes=None):
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  env.pop("XLA_FLAGS", None)
  command = [sys.executable, str(DRIVER), "--workdir", str(workdir), *extra]
  return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def step_records(workdir):
  return [
    r for r in simigrad_jax.read_metrics(pathlib.Path(workdir) / "metrics.jsonl") if "loss" in r
  ]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("straight")
  result = run_driver(workdir, "--steps", "12")
  assert result.returncode == 0, result.stderr[-3000:]
  return step_records(workdir)


def test_sigkill_and_resume_continue_exactly(straight_run, tmp_path):
  killed = run_driver(tmp_path, "--steps", "12", "--kill-at", "8")
  assert killed.returncode == -9  # SIGKILL: no clean-up, no final checkpoint
  resumed = run_driver(tmp_path, "--steps", "12")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  records = step_records(tmp_path)
  assert [r["step"] for r in records] == list(range(1, 13))  # no step duplicated or lost
  for key in ("batch_size", "lr_factor", "examples_seen", "micro_batch_size", "next_batch_size"):
    assert [r[key] for r in records] == [r[key] for r in straight_run], key
  np.testing.assert_allclose(
    [r["loss"] for r in records], [r["loss"] for r in straight_run], rtol=1e-5, atol=1e-5
  )


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_two_processes(workdir, *extra):
  """Runs the driver as two processes of one multi-host run; asserts that both succeed."""
  coordinator = f"127.0.0.1:{free_port()}"
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  env.pop("XLA_FLAGS", None)
  common = [sys.executable, str(DRIVER), "--workdir", str(workdir), *extra]
  common += ["--num-processes", "2", "--coordinator", coordinator]
  procs = [
    subprocess.Popen(
      [*common, "--process-id", str(i)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  outputs = [p.communicate(timeout=300) for p in procs]
  for p, (_, err) in zip(procs, outputs, strict=True):
    assert p.returncode == 0, err[-3000:]


def test_two_processes_take_the_same_decisions_as_one(straight_run, tmp_path):
  run_two_processes(tmp_path, "--steps", "12")
  records = step_records(tmp_path)
  assert [r["batch_size"] for r in records] == [r["batch_size"] for r in straight_run]
  np.testing.assert_allclose(
    [r["loss"] for r in records], [r["loss"] for r in straight_run], rtol=1e-5, atol=1e-5
  )
  np.testing.assert_allclose(
    [r["similarity"] for r in records],
    [r["similarity"] for r in straight_run],
    rtol=1e-4,
    atol=1e-5,
  )
