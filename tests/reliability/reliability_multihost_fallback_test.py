"""The timed compile fallback with 2 local processes (jax.distributed on 127.0.0.1, 4 CPU devices
each): ``timed_fallback=True``, the fallback that follows the compiles' timing.

Each process holds back its compiles for a different number of steps, so at
some steps a shape is compiled on one process and not on the other. Both must
still run every step on the same shape (else the step's collectives would not
match), fall back while either is compiling, and end where a run without any
fallback ends.
"""

from __future__ import annotations

import numpy as np
import pytest

from reliability_helpers import read_trace
from reliability_helpers import run_driver
from reliability_helpers import run_processes
from reliability_helpers import step_records

pytestmark = pytest.mark.reliability

STEPS = 10
TIMEOUT_SECONDS = 200
HELD_STEPS = (
  2,
  6,
)  # process i compiles only the first step's shape until it finished step HELD_STEPS[i]
# The batch grows from 48 (8 rows per device) past 64 at step 5 (16 rows per device).
GROWING = ("--similarity-target", 0.9, "--max-micro-batch-size", 16)
SAME_ON_EVERY_PROCESS = (
  "batch_size",
  "next_batch_size",
  "decision",
  "micro_batch_size",
  "compile_fallback",
  "loss",
  "similarity",
)


def test_processes_fall_back_to_a_shape_compiled_on_all_of_them(tmp_path):
  caches = [["--compile-cache", tmp_path / f"cache{i}"] for i in range(2)]
  results = run_processes(
    tmp_path / "fallback",
    [
      ["--steps", STEPS, *GROWING, "--timed-fallback", "--hold-compiles", held, *cache]
      for held, cache in zip(HELD_STEPS, caches)
    ],
    timeout=TIMEOUT_SECONDS,
  )
  for process, (code, _, err, _) in enumerate(results):
    assert code == 0, f"process {process}: rc {code}\n{err[-3000:]}"
  exact = run_driver(
    tmp_path / "exact",
    "--steps",
    STEPS,
    *GROWING,
    "--no-compile-fallback",
    "--compile-cache",
    tmp_path / "cache0",
    timeout=TIMEOUT_SECONDS,
  )
  assert exact.returncode == 0, exact.stderr[-3000:]

  traces = [read_trace(tmp_path / "fallback", p) for p in (0, 1)]
  steps = [[e for e in trace if e["event"] == "step"] for trace in traces]
  exact_trace = read_trace(tmp_path / "exact")
  exact_steps = [e for e in exact_trace if e["event"] == "step"]
  assert [e["step"] for e in steps[0]] == [e["step"] for e in steps[1]] == list(range(1, STEPS + 1))
  for first, second in zip(*steps):  # the same shape at every step, bit-identical numbers
    for key in SAME_ON_EVERY_PROCESS:
      assert first[key] == second[key], (first["step"], key, first[key], second[key])

  # Process 0 compiled its shapes from step 3 and process 1 from step 7: until both had one, the
  # steps that needed another shape ran on one both had (the first step's).
  first_shape = steps[0][0]["micro_batch_size"]
  assert not steps[0][0]["compile_fallback"]
  held = [e for e in steps[0] if e["step"] <= HELD_STEPS[1] + 1]
  assert all(e["micro_batch_size"] == first_shape for e in held)
  assert sum(e["compile_fallback"] for e in steps[0]) >= 2
  assert len({e["micro_batch_size"] for e in exact_steps}) >= 2  # the exact run used other shapes

  # The same trajectory as the run that waited for every shape.
  for key in ("batch_size", "next_batch_size", "decision"):
    assert [e[key] for e in steps[0]] == [e[key] for e in exact_steps], key
  np.testing.assert_allclose(
    [e["loss"] for e in steps[0]], [e["loss"] for e in exact_steps], rtol=1e-5, atol=1e-6
  )
  np.testing.assert_allclose(
    [e["similarity"] for e in steps[0]],
    [e["similarity"] for e in exact_steps],
    rtol=1e-4,
    atol=1e-5,
  )
  ends = [
    [e for e in trace if e["event"] == "end"][-1]["params"] for trace in (traces[0], exact_trace)
  ]
  for have, want in zip(*ends):
    np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)
  # No step but the first waited for a compile.
  records = step_records(tmp_path / "fallback")
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  assert all(r["compile_wait_step_seconds"] == 0 for r in records[1:]), [
    (r["step"], r["compile_wait_step_seconds"]) for r in records
  ]
