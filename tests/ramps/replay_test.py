"""Replay: a run's realised batch sizes exported as a step schedule and run again, to the same losses."""

import doctest
import subprocess
import sys

import numpy as np
import pytest

import simigrad_jax
import tiny_run
from simigrad_jax.ramps import replay
from simigrad_jax.ramps.token_schedules import parse_thresholds


def test_doctests():
  assert doctest.testmod(replay).failed == 0


def records(*steps):
  out, seen = [], 0
  for step, size in enumerate(steps, start=1):
    seen += size
    out.append({"step": step, "batch_size": size, "examples_seen": seen, "loss": 1.0})
  return out


def test_thresholds_are_where_the_size_changed():
  run = records(20, 20, 22, 22, 22, 20, 30)
  run.insert(3, {"step": 3, "eval_accuracy": 0.5})  # an evaluation's record is skipped
  assert replay.replay_thresholds(run) == [(0, 20), (40, 22), (106, 20), (126, 30)]
  assert (
    simigrad_jax.ramps.replay_schedule(run, tokens_per_example=4) == "0:20,160:22,424:20,504:30"
  )  # sizes in sequences
  c = simigrad_jax.ramps.replay_controller(run)
  seen, sizes = 0, []
  for _ in range(7):
    sizes.append(c.batch_size)
    seen += c.batch_size
    c.update(0.0, stats={"examples_seen": seen})
  assert sizes == [20, 20, 22, 22, 22, 20, 30]


def test_records_of_no_run_are_refused():
  with pytest.raises(ValueError, match=r"no step records"):
    replay.replay_thresholds([{"step": 1, "eval_loss": 2.0}])
  broken = records(8, 8, 16)
  del broken[1]
  with pytest.raises(ValueError, match=r"step 3 starts at 16 examples .* steps before it end at 8"):
    replay.replay_thresholds(broken)
  with pytest.raises(ValueError, match=r"step 1's batch_size must be an integer >= 1, got 0"):
    replay.replay_thresholds([{"step": 1, "batch_size": 0, "examples_seen": 0}])


def test_a_simigrad_run_replayed_as_a_step_schedule_reproduces_its_losses(tmp_path, devices):
  del devices
  cache = tmp_path / "cache"
  # SimiGrad's controller (tiny_run's: 20 to start, within [8, 64], target 0.5) chooses the sizes.
  _, _, original = tiny_run.train_records(tmp_path / "simigrad", cache, 16)
  sizes = [r["batch_size"] for r in original]
  assert len(set(sizes)) > 2, sizes  # the size moved
  metrics = tmp_path / "simigrad" / "metrics.jsonl"
  printed = subprocess.run(
    [sys.executable, "-m", "simigrad_jax.replay", str(metrics)],
    capture_output=True,
    text=True,
    check=True,
  ).stdout.strip()
  assert parse_thresholds(printed) == replay.replay_thresholds(original)
  controller = simigrad_jax.make_controller(
    "step_schedule", thresholds=printed, batch_size_lower_bound=8, batch_size_upper_bound=64
  )
  _, _, replayed = tiny_run.train_records(tmp_path / "replay", cache, 16, controller=controller)
  assert [r["batch_size"] for r in replayed] == sizes
  assert [r["examples_seen"] for r in replayed] == [r["examples_seen"] for r in original]
  assert [r["lr_factor"] for r in replayed] == pytest.approx([r["lr_factor"] for r in original])
  np.testing.assert_allclose(
    [r["loss"] for r in replayed], [r["loss"] for r in original], rtol=0, atol=1e-5
  )
