"""Faults on pods: one process of a 2-process run dies mid-run (jax.distributed on 127.0.0.1, CPU).

Process 1 SIGKILLs itself (tests/train_driver.py) between steps or while a
checkpoint is being saved, or freezes (SIGSTOP) between steps. Process 0 must
end within the agreement timeout with a ProcessLostError that names process
1, not hang:

* killed between steps: process 0's next collective fails with a transport
  error that names no process, and the roll call finds process 1 missing;
* frozen: process 0's next collective never returns (its peer's sockets stay
  open, as when a peer dies in the middle of a collective, or under NCCL);
  the watchdog sees process 1's heartbeats stop and ends process 0;
* killed while saving: process 0 never sees process 1 at the next check.

A restart of both processes then resumes from the newest finished checkpoint
and trains exactly what an uninterrupted run trains. Every run has a timeout.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from reliability_helpers import attempts
from reliability_helpers import read_trace
from reliability_helpers import run_processes
from reliability_helpers import step_records

pytestmark = pytest.mark.reliability

STEPS = 8  # a checkpoint every 3 steps: at 3 and 6
AGREEMENT_TIMEOUT = 10  # seconds a process waits for the others (the Trainer's default is 300)
SLACK_SECONDS = 15  # on top of it, for a busy machine
TIMEOUT_SECONDS = 150  # per two-process run; a hang fails the test here
COMPARED = (
  "batch_size",
  "lr_factor",
  "next_batch_size",
  "next_lr_factor",
  "decision",
  "examples_seen",
  "indices",
)
# Equal up to float rounding: a step may run on a compile-fallback shape in one run and not in
# the other (which shapes are compiled in time differs between runs), which reorders sums.
CLOSE = ("loss", "similarity")


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
  """One persistent compilation cache per process, shared by this module's runs."""
  root = tmp_path_factory.mktemp("compile_caches")
  return [["--compile-cache", root / f"process{i}"] for i in range(2)]


def _run(workdir, caches, process1_args=()):
  """Both processes train up to STEPS steps; process 1 also gets ``process1_args``."""
  common = ["--steps", STEPS, "--agreement-timeout", AGREEMENT_TIMEOUT]
  return run_processes(
    workdir, [[*common, *caches[0]], [*common, *caches[1], *process1_args]], timeout=TIMEOUT_SECONDS
  )


def _run_with_fault(workdir, caches, fault, kind):
  """Process 1 gets ``fault`` and must be killed there; process 0 must end within the agreement
  timeout with a ProcessLostError naming process 1. Returns process 0's stderr and the seconds
  from the fault to its end."""
  started = time.time()
  (code0, _, err0, seconds0), (code1, _, err1, _) = _run(workdir, caches, fault)
  kill = attempts(read_trace(workdir, 1))[-1]["kill"]
  assert code1 == -9 and kill is not None and kill["kind"] == kind, (code1, err1[-2000:])
  assert code0 == 1, f"process 0 was not ended by a ProcessLostError (rc {code0})\n{err0[-3000:]}"
  assert "ProcessLostError: process 1 " in err0, err0[-3000:]
  seconds = started + seconds0 - kill["time"]
  assert 0 < seconds <= AGREEMENT_TIMEOUT + SLACK_SECONDS, f"ended {seconds:.1f} s after the fault"
  return err0, seconds


@pytest.mark.parametrize(
  "fault,kind,reported",
  [
    ("--kill-at", "between_steps", "did not answer within"),  # the roll call after step 5 failed
    ("--freeze-at", "freeze", "sent no heartbeat"),  # the watchdog: step 5 never returns
  ],
)
def test_a_dead_process_is_named_within_the_agreement_timeout(
  tmp_path, caches, fault, kind, reported
):
  """Process 1 dies (or freezes) after step 4: process 0 names it and ends, at step 5."""
  err0, seconds = _run_with_fault(tmp_path, caches, [fault, 4], kind)
  assert f"ProcessLostError: process 1 {reported}" in err0, err0[-3000:]
  steps = [e["step"] for e in read_trace(tmp_path, 0) if e["event"] == "step"]
  assert steps == [1, 2, 3, 4], steps  # step 5 was the first without process 1
  print(f"\n{fault} 4: process 0 named process 1 and ended {seconds:.1f} s later")


def test_a_restart_of_all_processes_resumes_exactly(tmp_path, tmp_path_factory, caches):
  """Process 1 dies while the checkpoint of step 6 is being written; both restart from step 3."""
  straight = tmp_path_factory.mktemp("straight")
  for process, (code, _, err, _) in enumerate(_run(straight, caches)):
    assert code == 0, f"uninterrupted run, process {process}: rc {code}\n{err[-3000:]}"

  _run_with_fault(tmp_path, caches, ["--kill-in-save", 6], "save")
  results = _run(tmp_path, caches)  # the restart: the same command on every process
  for process, (code, _, err, _) in enumerate(results):
    assert code == 0, f"restart, process {process}: rc {code}\n{err[-3000:]}"

  # The checkpoint of step 6 never committed (process 1 died writing it): both resume from 3.
  for process in (0, 1):
    runs = attempts(read_trace(tmp_path, process))
    assert [run["start"]["step"] for run in runs] == [0, 3], process
    assert [e["step"] for e in runs[-1]["steps"]] == list(range(4, STEPS + 1))
    # Every step, as the process finally trained it, trained what the uninterrupted run trained.
    final = {e["step"]: e for run in runs for e in run["steps"]}
    expected = {e["step"]: e for e in read_trace(straight, process) if e["event"] == "step"}
    assert sorted(final) == sorted(expected) == list(range(1, STEPS + 1))
    for step, event in final.items():
      assert {k: event[k] for k in COMPARED} == {k: expected[step][k] for k in COMPARED}, step
      for key in CLOSE:
        np.testing.assert_allclose(
          event[key], expected[step][key], rtol=1e-5, atol=1e-5, err_msg=f"step {step} {key}"
        )
  # Process 0's metrics file reads like the uninterrupted run's: every step once, same numbers.
  records, expected = step_records(tmp_path), step_records(straight)
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  for key in COMPARED[:-1]:
    assert [r[key] for r in records] == [r[key] for r in expected], key
  for key in CLOSE:
    np.testing.assert_allclose(
      [r[key] for r in records], [r[key] for r in expected], rtol=1e-5, atol=1e-5, err_msg=key
    )
