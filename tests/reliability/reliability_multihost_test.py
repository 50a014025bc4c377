"""Multi-host agreement: 2 local processes (jax.distributed on 127.0.0.1, CPU, 4 devices each).

Each process loads only its own devices' rows, so the processes see different
data by construction. Every process writes its own trace of decisions (process
1 writes no metrics file), and the traces must agree step by step. A forced
disagreement, in the settings or in one step's decision, must end both
processes with a clear error naming the values, not a hang; every run has a
timeout.
"""

from __future__ import annotations

import pytest

import simigrad_jax
from reliability_helpers import read_trace
from reliability_helpers import run_processes
from reliability_helpers import step_records

pytestmark = pytest.mark.reliability

STEPS = 12
TIMEOUT_SECONDS = 150  # per two-process run; a hang fails the test here


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
  """The processes' compilation cache arguments: one directory for both, as on a pod, shared by
  this module's runs. Only process 0 writes it; on CPU process 1's cache keys differ from process
  0's (compile options and device topology), so process 1 compiles anyway."""
  cache = tmp_path_factory.mktemp("compile_cache")
  return [["--compile-cache", cache] for _ in range(2)]


DECISION_KEYS = (
  "batch_size",
  "next_batch_size",
  "lr_factor",
  "next_lr_factor",
  "decision",
  "similarity",
  "loss",
  "examples_seen",
)


def _run_and_check_agreement(workdir, steps, per_process_args):
  """Two processes train ``steps`` steps; returns process 0's trace after checking that both
  took the same decisions at every step from their own rows, which together are the step's."""
  results = run_processes(
    workdir, [["--steps", steps, *extra] for extra in per_process_args], timeout=TIMEOUT_SECONDS
  )
  for process, (code, _, err, _) in enumerate(results):
    assert code == 0, f"process {process}: rc {code}\n{err[-3000:]}"
    assert "Error reading persistent compilation cache" not in err, err[-3000:]
  traces = [[e for e in read_trace(workdir, p) if e["event"] == "step"] for p in (0, 1)]
  assert (
    [e["step"] for e in traces[0]] == [e["step"] for e in traces[1]] == list(range(1, steps + 1))
  )
  sampler = simigrad_jax.data.EpochSampler(600, 1)
  for first, second in zip(*traces):
    for key in DECISION_KEYS:  # identical decisions, bit for bit
      assert first[key] == second[key], (first["step"], key, first[key], second[key])
    # ... from different local data: each process trained on its own rows only.
    assert first["indices"] and second["indices"] and first["indices"] != second["indices"]
    start = first["examples_seen"] - first["batch_size"]
    assert sorted(first["indices"] + second["indices"]) == sorted(
      sampler.indices_at(start, first["batch_size"]).tolist()
    )
  # Process 0's metrics file shows the same decisions.
  assert [r["batch_size"] for r in step_records(workdir)] == [e["batch_size"] for e in traces[0]]
  return traces[0]


def test_every_process_takes_the_same_decision_at_every_step(tmp_path, caches):
  """... and after a resume from a damaged checkpoint, both fall back to the same one."""
  trace = _run_and_check_agreement(tmp_path, STEPS, caches)
  assert len({e["batch_size"] for e in trace}) >= 4  # the decisions really moved

  # Resume both processes after damaging the newest checkpoint: both fall back to the same one.
  # A two-process checkpoint holds data files under state/d/ and state/ocdbt.process_0/d/, some
  # of them copies, and a restore reads some of them only: damage every one.
  for data in (tmp_path / "checkpoints" / str(STEPS) / "state").rglob("d/*"):
    damaged = bytearray(data.read_bytes())
    damaged[len(damaged) // 2] ^= 0x10
    data.write_bytes(bytes(damaged))
  results = run_processes(
    tmp_path, [["--steps", STEPS + 4, *caches[i]] for i in range(2)], timeout=TIMEOUT_SECONDS
  )
  for process, (code, _, err, _) in enumerate(results):
    assert code == 0, f"process {process}: rc {code}\n{err[-3000:]}"
    assert "Error reading persistent compilation cache" not in err, err[-3000:]
    assert f"checkpoint at step {STEPS}" in err and "unreadable" in err
  starts = [[e for e in read_trace(tmp_path, p) if e["event"] == "start"][-1] for p in (0, 1)]
  assert starts[0]["step"] == starts[1]["step"] == STEPS - 3  # the previous checkpoint
  assert starts[0]["skipped_checkpoints"] == starts[1]["skipped_checkpoints"] == [STEPS]
  resumed = [
    [e for e in read_trace(tmp_path, p) if e["event"] == "step"][len(trace) :] for p in (0, 1)
  ]
  assert [e["step"] for e in resumed[0]] == list(range(STEPS - 2, STEPS + 5))
  for first, second in zip(*resumed):
    for key in DECISION_KEYS:
      assert first[key] == second[key], (first["step"], key, first[key], second[key])
  for before, after in zip(trace[STEPS - 3 :], resumed[0]):  # the redone steps, again
    # The same decisions; the numbers up to rounding, since a step may run on a compile-fallback
    # shape in one run and not in the other.
    for key in DECISION_KEYS:
      if key in ("loss", "similarity"):
        assert after[key] == pytest.approx(before[key], rel=1e-5, abs=1e-5), (after["step"], key)
      else:
        assert after[key] == before[key], (after["step"], key)


def test_the_local_split_over_two_processes_of_three_devices(tmp_path, caches):
  """6 devices in all, each splitting its rows into the two halves: the same agreement."""
  trace = _run_and_check_agreement(tmp_path, 6, [[*cache, "--devices", 6] for cache in caches])
  assert len({e["batch_size"] for e in trace}) >= 3  # the decisions really moved


def test_different_settings_are_refused_before_any_step(tmp_path, caches):
  results = run_processes(
    tmp_path,
    [["--steps", STEPS, *caches[0]], ["--steps", STEPS, "--similarity-target", 0.5, *caches[1]]],
    timeout=TIMEOUT_SECONDS,
  )
  for process, (code, _, err, _) in enumerate(results):
    assert code not in (0, None), f"process {process} was not stopped (rc {code})"
    assert "ProcessDisagreementError: the 2 processes disagree on the settings" in err, err[-3000:]
    assert '"similarity_target": 0.3' in err and '"similarity_target": 0.5' in err
    assert not [e for e in read_trace(tmp_path, process) if e["event"] == "step"]  # no step ran


def test_a_diverging_decision_is_reported_not_hung(tmp_path, caches):
  """Process 1's controller picks another size at step 5: both stop there with the values."""
  results = run_processes(
    tmp_path,
    [["--steps", STEPS, *caches[0]], ["--steps", STEPS, "--disagree-at", 5, *caches[1]]],
    timeout=TIMEOUT_SECONDS,
  )
  for process, (code, _, err, _) in enumerate(results):
    assert code not in (0, None), f"process {process} was not stopped (rc {code})"
    assert "ProcessDisagreementError: the 2 processes disagree on the decision of step 5" in err, (
      err[-3000:]
    )
    assert "next_batch_size: process 0 has" in err
    steps = [e["step"] for e in read_trace(tmp_path, process) if e["event"] == "step"]
    assert steps == [1, 2, 3, 4]  # step 5 was stopped before its trace line; step 6 never ran


def test_a_process_that_fails_its_set_up_does_not_leave_the_other_waiting(tmp_path, caches):
  """Process 1 refuses its own setting; process 0 reports that after the agreement timeout."""
  results = run_processes(
    tmp_path,
    [
      ["--steps", STEPS, "--agreement-timeout", 10, *caches[0]],
      ["--steps", STEPS, "--max-micro-batch-size", 0, *caches[1]],
    ],
    timeout=TIMEOUT_SECONDS,
  )
  (code0, _, err0, _), (code1, _, err1, _) = results
  assert code1 not in (0, None) and "max_micro_batch_size must be an integer >= 1, got 0" in err1
  assert code0 not in (0, None), f"process 0 was not stopped (rc {code0})"
  assert "process 1 did not reach the Trainer's check of the settings within 10 s" in err0, err0[
    -3000:
  ]
