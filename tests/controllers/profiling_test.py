"""ProfilingController: a similarity profile around any controller (host side)."""

import json
import math

import numpy as np
import pytest

import simigrad_jax
from simigrad_jax.controllers import ProfilingController
from simigrad_jax.trainer import checks

GNS = dict(
  initial_batch_size=64,
  multiple=0.5,
  ema_decay=0.5,
  batch_size_lower_bound=16,
  batch_size_upper_bound=512,
)


def gns():
  return simigrad_jax.make_controller("gns", **GNS)


def stats_for(step, batch_size, rng):
  na, nb = rng.uniform(0.5, 1.5, size=2)
  return {
    "loss": float(2.0 / (1 + step)),
    "norm_a": float(na),
    "norm_b": float(nb),
    "norm_mean": float(rng.uniform(0.3, 1.0) * min(na, nb)),
    "batch_size": batch_size,
    "epochs": step * batch_size / 1000,
    "epoch_end": step % 4 == 3,
    "grads_finite": True,
  }


def drive(controller, steps, seed=0, start=0):
  """(size, decision) after each update from ``start`` on, with the same inputs whatever ``start``."""
  rng = np.random.default_rng(seed)
  out = []
  for step in range(steps):
    stats = stats_for(step, controller.batch_size if step >= start else 64, rng)
    similarity = float(rng.uniform(-0.1, 0.5))
    if step >= start:
      out.append((controller.update(similarity, stats=stats), controller.last_decision))
  return out


def test_visits_the_sizes_then_returns_and_the_wrapped_controller_sees_every_step():
  inner = gns()
  c = ProfilingController(inner, [32, 256], steps_per_size=2)
  assert c.profiling and c.batch_size == 32 and c.profile_batch_sizes == (32, 256)
  assert c.controller is inner and c.initial_batch_size == 64 and c.config == inner.config
  rng = np.random.default_rng(0)
  sizes = []
  for step, s in enumerate([0.1, math.nan, 0.2, 0.3, 0.4, 0.0]):
    stats = {**stats_for(step, c.batch_size, rng), "grads_finite": not math.isnan(s)}
    sizes.append((c.update(s, stats=stats), c.last_decision))
  assert sizes == [
    (32, "profile"),
    (32, "nonfinite"),
    (256, "profile"),
    (256, "profile"),
    (64, "profile"),
    (sizes[-1][0], inner.last_decision),
  ]
  assert not c.profiling and c.profile_batch_sizes == ()
  assert c.profile == [
    {"batch_size": 32, "similarity": 0.1, "step": 1},
    {"batch_size": 32, "similarity": 0.2, "step": 3},
    {"batch_size": 256, "similarity": 0.3, "step": 4},
    {"batch_size": 256, "similarity": 0.4, "step": 5},
  ]
  # Every step reached the wrapped controller; its attributes read through the wrapper.
  assert c.step == inner.step == 6 and c.nonfinite_count == inner.nonfinite_count == 1
  assert c.noise_scale == inner.noise_scale is not None
  # After the profile it adapts from the size it had before, as the unwrapped one would.
  assert sizes[-1][0] != 64 and sizes[-1][1] in ("grow", "shrink")


def test_outside_a_profile_it_passes_everything_through():
  assert drive(ProfilingController(gns()), 30) == drive(gns(), 30)


def test_the_loss_plateau_rule_still_closes_its_epochs_during_a_profile():
  inner = simigrad_jax.make_controller(
    "loss_plateau", initial_batch_size=32, patience=1, batch_size_upper_bound=256
  )
  c = ProfilingController(inner, [64, 128, 256], steps_per_size=2)
  drive(c, 6)
  assert not c.profiling and c.batch_size == 32 and len(inner.epoch_losses) == 1


def test_summary_and_saved_json(tmp_path):
  c = ProfilingController(gns(), [128, 32], steps_per_size=3)
  drive(c, 6)
  summary = c.profile_summary()
  assert list(summary) == [32, 128] and all(v["count"] == 3 for v in summary.values())
  samples = c.profile
  assert summary[128]["mean"] == pytest.approx(np.mean([s["similarity"] for s in samples[:3]]))
  c.save_profile(tmp_path / "profile.json")
  data = json.loads((tmp_path / "profile.json").read_text())
  assert data["version"] == 1 and data["similarity_target"] is None
  assert data["samples"] == samples
  assert {int(k): v for k, v in data["summary"].items()} == summary


def test_start_profile_mid_run_and_not_twice():
  c = ProfilingController(gns())
  drive(c, 5)
  before = c.batch_size
  c.start_profile([16, 512])
  assert c.batch_size == 16
  with pytest.raises(RuntimeError, match="already in progress"):
    c.start_profile([32])
  c.update(0.2, stats={"norm_a": 1.0, "norm_b": 1.0, "norm_mean": 0.8, "batch_size": 16})
  c.update(0.1, stats={"norm_a": 1.0, "norm_b": 1.0, "norm_mean": 0.8, "batch_size": 512})
  assert c.batch_size == before and [p["step"] for p in c.profile] == [6, 7]


@pytest.mark.parametrize(
  "sizes, match",
  [
    ([], "non-empty"),
    ([8], r"batch_sizes_to_profile\[0\] must lie within .*\[16, 512\], got 8"),
    ([32, 1024], r"batch_sizes_to_profile\[1\] must lie within .*got 1024"),
    ([32, 2.5], r"batch_sizes_to_profile\[1\] must be an integer >= 1, got 2.5"),
  ],
)
def test_sizes_outside_the_wrapped_controllers_bounds_are_refused(sizes, match):
  with pytest.raises(ValueError, match=match):
    ProfilingController(gns(), sizes)


def test_only_a_controller_can_be_wrapped():
  with pytest.raises(ValueError, match="ProfilingController wraps a batch-size controller"):
    ProfilingController({"initial_batch_size": 8}, [8])
  with pytest.raises(ValueError, match="profile_steps_per_size must be an integer >= 1, got 0"):
    ProfilingController(gns(), steps_per_size=0)


@pytest.mark.parametrize("k", [0, 1, 3, 5, 9])
def test_state_round_trip_resumes_exactly_mid_profile(k):
  def make():
    return ProfilingController(gns(), [32, 256, 128], steps_per_size=2)

  whole = make()
  expected = drive(whole, 20)
  first = make()
  drive(first, k)
  resumed = ProfilingController(gns())  # built without a profile: the state brings it
  resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
  assert resumed.batch_size == first.batch_size and resumed.profiling == first.profiling
  assert drive(resumed, 20, start=k) == expected[k:]
  assert resumed.state_dict() == whole.state_dict()


@pytest.mark.parametrize(
  "mutate, match",
  [
    (lambda s: s.update(version=2), "version must be 1, got 2"),
    (lambda s: s.update(controller="gns"), "the state is of a 'gns' controller"),
    (lambda s: s["profile_plan"].update(sizes=[32, 4096]), "profile size must lie within"),
    (lambda s: s.update(profile_batch_size=None), "profile_batch_size None does not fit"),
    (lambda s: s.pop("wrapped"), "malformed controller state"),
    (lambda s: s["wrapped"].update(batch_size=4096), "batch_size must lie within"),
  ],
)
def test_a_refused_state_changes_nothing(mutate, match):
  c = ProfilingController(gns(), [32, 256])
  drive(c, 1)
  state = json.loads(json.dumps(c.state_dict()))
  mutate(state)
  fresh = ProfilingController(gns())
  with pytest.raises(ValueError, match=match):
    fresh.load_state_dict(state)
  assert not fresh.profiling and fresh.step == 0 and fresh.batch_size == 64


def test_the_trainers_checks_read_the_profiled_sizes():
  c = ProfilingController(gns(), [32, 400])
  checks.check_controller(c)
  assert checks._profile_sizes(c) == [32, 400]
  with pytest.raises(ValueError, match="fewer than the largest batch size 512"):
    checks.check_bounds(c, 300, "local")
  fixed = simigrad_jax.make_controller(
    "fixed", initial_batch_size=24, batch_size_lower_bound=1, batch_size_upper_bound=64
  )
  assert checks.check_bounds(fixed, 300, "local") == (1, 64)
  with pytest.raises(ValueError, match="batch_sizes_to_profile holds 1, but a batch below 2"):
    checks.check_bounds(ProfilingController(fixed, [1, 32]), 300, "local")
  # A wrapped Controller's own profile counts too.
  inner = simigrad_jax.Controller(32, 0.1, batch_size_upper_bound=64, batch_sizes_to_profile=[48])
  assert checks._profile_sizes(ProfilingController(inner)) == [48]
