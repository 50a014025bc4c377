"""Tests for simigrad_jax.controllers.simigrad (host side: no JAX needed).

Its saved state and resume: ``controller_state_test.py``.
"""

import json
import logging
import math

import numpy as np
import pytest

from simigrad_jax.controllers.simigrad import Controller

# ------------------------------------------------------------------ references


def reference_next(b, s, target, lower=None, upper=None, smooth=None):
  """The reference rule, written out independently of the module."""
  if s < target:
    new = max(b + 1, int(b * 1.1))
    if smooth is not None:
      new = max(b + 1, int(b * smooth + new * (1 - smooth)))
  elif s > target and b > 1:
    new = max(1, min(b - 1, int(b * 0.9)))
    if smooth is not None:
      new = max(1, min(b - 1, int(b * smooth + new * (1 - smooth))))
  else:
    new = b
  if upper is not None:
    new = min(new, upper)
  if lower is not None:
    new = max(new, lower)
  return new


def reference_sequence(b, sims, target, **kw):
  out = []
  for s in sims:
    b = reference_next(b, s, target, **kw)
    out.append(b)
  return out


def run(controller, sims):
  return [controller.update(s) for s in sims]


def random_sims(seed, n, target):
  rng = np.random.default_rng(seed)
  sims = np.clip(rng.uniform(target - 0.3, target + 0.3, size=n), -1.0, 1.0)  # cosines
  sims[rng.integers(0, n, size=n // 20)] = target  # exact ties: hold
  return [float(s) for s in sims]


# ------------------------------------------------------------ the reference rule


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("target", [0.0, 0.1, 0.8])
@pytest.mark.parametrize("bounds", [(None, None), (32, 1024), (None, 300), (100, None)])
@pytest.mark.parametrize("initial", [1, 128])
def test_sequence_matches_reference(seed, target, bounds, initial):
  lower, upper = bounds
  if lower is not None and initial < lower:
    initial = lower
  sims = random_sims(seed, 400, target)
  c = Controller(initial, target, batch_size_lower_bound=lower, batch_size_upper_bound=upper)
  got = run(c, sims)
  assert got == reference_sequence(initial, sims, target, lower=lower, upper=upper)
  assert len(set(got)) > 5  # the sequence really moved
  assert c.step == 400


def test_long_growth_matches_float_arithmetic():
  # 300 grow steps from 1 reach ~1e12; the float product must stay as Python's.
  c = Controller(1, 0.5)
  got = run(c, [0.0] * 300)
  assert got == reference_sequence(1, [0.0] * 300, 0.5)
  assert got[-1] > 10**12


@pytest.mark.parametrize(
  "b, s, expected, decision",
  [
    (128, 0.0, 140, "grow"),  # int(140.8)
    (10, 0.0, 11, "grow"),  # int(11.000000000000002) = 11 = B + 1
    (5, 0.0, 6, "grow"),  # int(5.5) = 5 < B + 1
    (1, 0.0, 2, "grow"),
    (128, 0.9, 115, "shrink"),  # int(115.2)
    (5, 0.9, 4, "shrink"),  # int(4.5)
    (10, 0.9, 9, "shrink"),
    (2, 0.9, 1, "shrink"),
    (1, 0.9, 1, "hold"),  # B = 1 never shrinks
    (128, 0.5, 128, "hold"),  # equal to the target
    # Python float products, as the reference computes them; exact integer
    # arithmetic (B * 11 // 10, B * 9 // 10) would give ...09 and ...00 here.
    (1000000000000009, 0.0, 1100000000000010, "grow"),
    (3000000000000001, 0.9, 2700000000000001, "shrink"),
  ],
)
def test_hand_checked_steps(b, s, expected, decision):
  c = Controller(b, 0.5)
  assert c.update(s) == expected
  assert c.batch_size == expected
  assert c.last_decision == decision


@pytest.mark.parametrize(
  "b, s, lower, upper, expected, decision",
  [
    (250, 0.0, None, 256, 256, "clamped"),  # 275 -> 256
    (256, 0.0, None, 256, 256, "clamped"),  # stays at the cap
    (33, 0.9, 32, None, 32, "clamped"),  # 29 -> 32
    (32, 0.9, 32, None, 32, "clamped"),
    (200, 0.0, None, 256, 220, "grow"),  # within bounds: not clamped
    (40, 0.9, 32, 256, 36, "shrink"),
  ],
)
def test_clamping(b, s, lower, upper, expected, decision):
  c = Controller(b, 0.5, batch_size_lower_bound=lower, batch_size_upper_bound=upper)
  assert c.update(s) == expected
  assert c.last_decision == decision


def test_accepts_numpy_scalars():
  c = Controller(
    np.int64(128),
    np.float32(0.5),
    batch_size_lower_bound=np.int32(64),
    batch_size_upper_bound=np.uint16(512),
  )
  assert type(c.batch_size) is int
  assert c.update(np.float32(0.1)) == 140
  assert c.update(np.array(0.9)) == 126
  assert c.state_dict()["config"]["batch_size_upper_bound"] == 512


# ------------------------------------------------------- beyond the reference


def test_dead_band():
  c = Controller(100, 0.5, dead_band=0.1)
  assert c.update(0.45) == 100 and c.last_decision == "hold"
  assert c.update(0.55) == 100 and c.last_decision == "hold"
  assert c.update(0.39) == 110 and c.last_decision == "grow"
  assert c.update(0.61) == 99 and c.last_decision == "shrink"


def test_dead_band_zero_is_reference():
  sims = random_sims(7, 200, 0.2)
  c = Controller(64, 0.2, dead_band=0.0)
  assert run(c, sims) == reference_sequence(64, sims, 0.2)


def test_warmup_holds_then_adapts():
  c = Controller(100, 0.5, warmup_steps=3)
  assert run(c, [0.0, 0.0, 0.0]) == [100, 100, 100]
  assert c.last_decision == "warmup"
  assert c.update(0.0) == 110
  assert c.last_decision == "grow"
  assert c.step == 4


def test_nonfinite_warmup_step_still_counts():
  c = Controller(100, 0.5, warmup_steps=2)
  assert run(c, [math.nan, 0.0, 0.0]) == [100, 100, 110]
  assert c.nonfinite_count == 1


def test_enable_adjust_false_keeps_size():
  c = Controller(100, 0.5, enable_adjust=False)
  assert run(c, [0.0, 1.0, -1.0, math.nan]) == [100] * 4
  assert c.last_decision == "nonfinite"
  c.update(0.0)
  assert c.last_decision == "disabled"
  assert c.step == 5
  assert c.nonfinite_count == 1


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, np.float32("nan")])
def test_nonfinite_similarity_holds_and_counts(value):
  c = Controller(100, 0.5)
  assert c.update(value) == 100
  assert c.last_decision == "nonfinite"
  assert c.nonfinite_count == 1
  assert c.step == 1
  assert c.update(0.0) == 110  # adapts normally afterwards


def test_a_step_whose_stats_say_its_gradients_were_not_finite_holds_and_counts():
  """As update() documents, whatever the similarity (a kept, finite one too)."""
  c = Controller(100, 0.5, ema_decay=0.9)
  assert c.update(0.3, {"grads_finite": False}) == 100
  assert (c.last_decision, c.nonfinite_count, c.noise_scale) == ("nonfinite", 1, None)
  assert c.update(0.3, {"grads_finite": True}) == 110  # a finite step decides: 0.3 < 0.5 grows
  assert c.nonfinite_count == 1 and c.last_decision != "nonfinite"


def test_verbose_logs_each_decision(caplog):
  with caplog.at_level(logging.INFO, logger="simigrad_jax"):
    Controller(100, 0.5).update(0.0)
    assert not caplog.records
    c = Controller(100, 0.5, verbose=True)
    c.update(0.0)
    c.update(math.nan)
  assert len(caplog.records) == 2
  assert all(r.name == "simigrad_jax" for r in caplog.records)
  assert "grow" in caplog.records[0].getMessage()
  assert "100 -> 110" in caplog.records[0].getMessage()
  assert "nonfinite" in caplog.records[1].getMessage()


# -------------------------------------------------------------------- smoothing


@pytest.mark.parametrize(
  "b, s, smooth, expected",
  [
    (100, 0.0, 0.5, 105),  # rule 110, blend 105.0
    (100, 0.9, 0.5, 95),  # rule 90, blend 95.0
    (128, 0.0, 0.9, 129),  # rule 140, blend 129.2
    (10, 0.0, 0.5, 11),  # blend 10.5 would truncate back to 10: kept growing
    (2, 0.9, 0.9, 1),  # rule 1, blend 1.9 -> 1
    (3, 0.9, 0.9, 2),  # rule 2, blend 2.9 -> 2 (at most B - 1)
    (100, 0.0, 0.0, 110),  # f = 0: the plain rule
  ],
)
def test_smoothing_hand_checked(b, s, smooth, expected):
  c = Controller(b, 0.5, smooth_factor=smooth)
  assert c.update(s) == expected


@pytest.mark.parametrize("smooth", [0.0, 0.3, 0.9])
@pytest.mark.parametrize("bounds", [(None, None), (16, 2000)])
def test_smoothing_sequence(smooth, bounds):
  lower, upper = bounds
  sims = random_sims(3, 300, 0.1)
  c = Controller(
    128, 0.1, smooth_factor=smooth, batch_size_lower_bound=lower, batch_size_upper_bound=upper
  )
  got = run(c, sims)
  assert got == reference_sequence(128, sims, 0.1, lower=lower, upper=upper, smooth=smooth)
  if smooth == 0.0:
    assert got == reference_sequence(128, sims, 0.1, lower=lower, upper=upper)


def test_smoothing_damps_steps():
  plain = run(Controller(1000, 0.5), [0.0] * 5)
  smooth = run(Controller(1000, 0.5, smooth_factor=0.8), [0.0] * 5)
  assert all(1000 < s < p for s, p in zip(smooth, plain))


# -------------------------------------------------------------------- profiling


def test_profile_visits_sizes_and_returns():
  c = Controller(128, 0.5, batch_sizes_to_profile=[32, 64, 16], profile_steps_per_size=2)
  assert c.profiling
  assert c.batch_size == 32  # the first step already runs at the first size
  sims = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
  assert run(c, sims) == [32, 64, 64, 16, 16, 128]
  assert c.last_decision == "profile"
  assert not c.profiling
  assert c.profile == [
    {"batch_size": 32, "similarity": 0.1, "step": 1},
    {"batch_size": 32, "similarity": 0.2, "step": 2},
    {"batch_size": 64, "similarity": 0.3, "step": 3},
    {"batch_size": 64, "similarity": 0.4, "step": 4},
    {"batch_size": 16, "similarity": 0.5, "step": 5},
    {"batch_size": 16, "similarity": 0.6, "step": 6},
  ]
  assert c.update(0.0) == 140  # adapting again from the pre-profile size
  assert c.last_decision == "grow"


def test_profile_ignores_the_rule_and_enable_adjust():
  c = Controller(128, 0.5, enable_adjust=False, batch_sizes_to_profile=[256])
  assert c.update(0.0) == 128
  assert [p["batch_size"] for p in c.profile] == [256]
  assert c.update(0.0) == 128 and c.last_decision == "disabled"


def test_profile_summary_and_saved_json(tmp_path):
  c = Controller(100, 0.5, batch_sizes_to_profile=[64, 8], profile_steps_per_size=3)
  run(c, [0.2, 0.4, 0.6, 0.9, 0.9, 0.9])
  summary = c.profile_summary()
  assert list(summary) == [8, 64]
  assert summary[64]["count"] == 3
  assert summary[64]["mean"] == pytest.approx(0.4)
  assert summary[64]["std"] == pytest.approx(np.std([0.2, 0.4, 0.6]))
  assert summary[8] == {"mean": pytest.approx(0.9), "std": pytest.approx(0.0), "count": 3}
  path = tmp_path / "profile.json"
  c.save_profile(path)
  data = json.loads(path.read_text())
  assert data["samples"] == c.profile
  assert data["similarity_target"] == 0.5
  assert {int(k): v for k, v in data["summary"].items()} == summary


def test_start_profile_mid_run():
  c = Controller(100, 0.5)
  run(c, [0.0, 0.0])  # 110, 121
  c.start_profile([50, 200], steps_per_size=1)
  assert c.batch_size == 50
  assert run(c, [0.3, 0.7]) == [200, 121]
  assert [(p["batch_size"], p["step"]) for p in c.profile] == [(50, 3), (200, 4)]
  c.start_profile([60])  # a second profile appends to the samples
  c.update(0.1)
  assert len(c.profile) == 3 and c.batch_size == 121


def test_start_profile_while_profiling_raises():
  c = Controller(100, 0.5, batch_sizes_to_profile=[50, 60])
  with pytest.raises(RuntimeError, match="already in progress"):
    c.start_profile([70])


def test_profile_waits_for_warmup():
  c = Controller(100, 0.5, warmup_steps=2, batch_sizes_to_profile=[40])
  assert c.batch_size == 100 and c.profiling
  assert run(c, [0.0, 0.0]) == [100, 100]
  # First update after warm-up starts the profile; its similarity is unused.
  assert c.update(0.0) == 40 and c.last_decision == "profile"
  assert c.profile == []
  assert c.update(0.3) == 100
  assert c.profile == [{"batch_size": 40, "similarity": 0.3, "step": 4}]


def test_nonfinite_is_not_a_profile_sample():
  c = Controller(100, 0.5, batch_sizes_to_profile=[40, 80])
  assert run(c, [math.nan, 0.2, math.inf, 0.3]) == [40, 80, 80, 100]
  assert [p["similarity"] for p in c.profile] == [0.2, 0.3]
  assert c.nonfinite_count == 2


@pytest.mark.parametrize(
  "sizes, match",
  [
    ([], "non-empty"),
    ("64", "non-empty"),
    ([0], r"batch_sizes_to_profile\[0\] must be an integer >= 1, got 0"),
    ([64, 12.5], r"batch_sizes_to_profile\[1\] must be an integer >= 1, got 12.5"),
    ([64, True], r"batch_sizes_to_profile\[1\].*got True"),
    ([64, 2048], r"batch_sizes_to_profile\[1\] must lie within .*\[16, 1024\], got 2048"),
    ([8], r"batch_sizes_to_profile\[0\] must lie within .*got 8"),
  ],
)
def test_bad_profile_sizes(sizes, match):
  with pytest.raises(ValueError, match=match):
    Controller(
      100, 0.5, batch_size_lower_bound=16, batch_size_upper_bound=1024, batch_sizes_to_profile=sizes
    )
  c = Controller(100, 0.5, batch_size_lower_bound=16, batch_size_upper_bound=1024)
  with pytest.raises(ValueError, match=match):
    c.start_profile(sizes)
  assert not c.profiling


# --------------------------------------------------------------- set_batch_size


def test_set_batch_size_adopts_size():
  c = Controller(100, 0.5, batch_size_upper_bound=500)
  c.set_batch_size(np.int64(96))
  assert c.batch_size == 96 and type(c.batch_size) is int
  assert c.update(0.0) == 105  # the rule continues from the adopted size


@pytest.mark.parametrize(
  "value, match",
  [
    (0, "batch_size must be an integer >= 1, got 0"),
    (-3, "got -3"),
    (12.5, "got 12.5"),
    (12.0, r"got 12.0 \(float\)"),
    (True, r"got True \(bool\)"),
    ("12", "got '12'"),
    (None, "got None"),
    (501, r"must lie within .*\[1, 500\], got 501"),
  ],
)
def test_set_batch_size_rejects(value, match):
  c = Controller(100, 0.5, batch_size_upper_bound=500)
  with pytest.raises(ValueError, match=match):
    c.set_batch_size(value)
  assert c.batch_size == 100


# ------------------------------------------------------------------ bad settings


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"similarity_target": 1.5}, r"similarity_target must be a number in \[-1, 1\], got 1.5"),
    ({"similarity_target": -1.01}, "similarity_target .* got -1.01"),
    ({"similarity_target": math.nan}, "similarity_target .* got nan"),
    ({"similarity_target": True}, "similarity_target .* got True"),
    ({"similarity_target": "0.1"}, "similarity_target .* got '0.1'"),
    ({"initial_batch_size": 0}, "initial_batch_size must be an integer >= 1, got 0"),
    ({"initial_batch_size": 12.5}, "initial_batch_size .* got 12.5"),
    ({"initial_batch_size": True}, "initial_batch_size .* got True"),
    (
      {"initial_batch_size": 8, "batch_size_lower_bound": 16},
      r"initial_batch_size must lie within .*\[16, inf\], got 8",
    ),
    (
      {"initial_batch_size": 600, "batch_size_upper_bound": 512},
      r"initial_batch_size must lie within .*\[1, 512\], got 600",
    ),
    ({"batch_size_lower_bound": 0}, "batch_size_lower_bound must be an integer >= 1, got 0"),
    ({"batch_size_upper_bound": -5}, "batch_size_upper_bound .* got -5"),
    ({"batch_size_upper_bound": 256.0}, "batch_size_upper_bound .* got 256.0"),
    ({"batch_size_lower_bound": False}, "batch_size_lower_bound .* got False"),
    (
      {"batch_size_lower_bound": 64, "batch_size_upper_bound": 32},
      r"batch_size_lower_bound \(64\) must not exceed batch_size_upper_bound \(32\)",
    ),
    ({"enable_adjust": 1}, "enable_adjust must be True or False, got 1"),
    ({"enable_adjust": 0.1}, "enable_adjust .* got 0.1"),
    ({"verbose": "yes"}, "verbose .* got 'yes'"),
    ({"smooth_factor": 1.0}, r"smooth_factor must be a number in \[0, 1\), got 1.0"),
    ({"smooth_factor": -0.1}, "smooth_factor .* got -0.1"),
    ({"smooth_factor": math.nan}, "smooth_factor .* got nan"),
    ({"dead_band": -0.01}, "dead_band .* got -0.01"),
    ({"dead_band": math.nan}, "dead_band .* got nan"),
    ({"dead_band": math.inf}, "dead_band .* got inf"),
    ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0, got -1"),
    ({"warmup_steps": 2.5}, "warmup_steps .* got 2.5"),
    ({"profile_steps_per_size": 0}, "profile_steps_per_size must be an integer >= 1, got 0"),
    (
      {"profile_steps_per_size": 0, "batch_sizes_to_profile": [64]},
      "profile_steps_per_size .* got 0",
    ),
  ],
)
def test_bad_settings_raise(kwargs, match):
  args = {"initial_batch_size": 128, "similarity_target": 0.1} | kwargs
  with pytest.raises(ValueError, match=match):
    Controller(args.pop("initial_batch_size"), args.pop("similarity_target"), **args)
