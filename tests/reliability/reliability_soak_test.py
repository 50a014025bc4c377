"""Long run: thousands of small steps with the batch size moving at every step; memory stays flat.

tests/soak_driver.py runs 3000 steps in its own process (so that its memory is
its own) with SimiGrad's controller random-walking the batch between 8 and 128
(several micro-batch shapes, one to four accumulation steps), metrics to JSONL
and TensorBoard and a checkpoint every 500 steps. After a 300-step warm-up the
resident set size must not grow by more than 50 MiB or 10%, the compile count
must not move (no recompilation, no cache growth), and the number of live
Python objects must stay flat (no per-step buffers).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from reliability_helpers import ROOT
from reliability_helpers import driver_env

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

STEPS, WARMUP = 3000, 300


def test_memory_stays_flat_over_a_long_run_with_a_moving_batch_size(tmp_path):
  result = subprocess.run(
    [
      sys.executable,
      str(ROOT / "tests" / "soak_driver.py"),
      "--workdir",
      str(tmp_path / "run"),
      "--steps",
      str(STEPS),
      "--warmup",
      str(WARMUP),
      "--sample-every",
      "300",
    ],
    env=driver_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.strip().splitlines()[-1])
  samples = report["samples"]
  first, last = samples[0], samples[-1]
  assert report["steps"] == STEPS and last["step"] == STEPS and first["step"] == WARMUP
  # The batch size moved at nearly every step, over many sizes and shapes.
  assert report["batch_size_changes"] >= 0.8 * (STEPS - 1)
  assert report["distinct_batch_sizes"] >= 30
  assert len(report["compiled_micro_batch_sizes"]) >= 2
  # Nothing grows: memory, compiled programs, Python objects, the metrics file is flushed.
  growth = last["rss_mb"] - first["rss_mb"]
  assert growth < min(50.0, 0.10 * first["rss_mb"]), samples
  assert last["hwm_mb"] - first["hwm_mb"] < 50.0, samples
  assert {s["compiles"] for s in samples} == {report["compiles"]}  # no compile after the warm-up
  assert last["objects"] - first["objects"] < 5000, samples
  assert report["metrics_lines"] == STEPS
  print(
    f"\nsoak: {STEPS} steps in {report['seconds']:.1f} s, {report['batch_size_changes']} batch-size "
    f"changes over {report['distinct_batch_sizes']} sizes; RSS {first['rss_mb']:.1f} -> "
    f"{last['rss_mb']:.1f} MiB, peak (VmHWM) {first['hwm_mb']:.1f} -> {last['hwm_mb']:.1f} MiB, "
    f"live objects {first['objects']} -> {last['objects']}"
  )
