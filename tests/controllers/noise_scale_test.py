"""The gradient-noise-scale controller ("gns"): estimates, smoothing, rule, resume (host side)."""

import json
import logging
import math

import numpy as np
import pytest

import simigrad_jax
from simigrad_jax.controllers.noise_scale import GnsController
from simigrad_jax.controllers.noise_scale import noise_scale_estimates

# ------------------------------------------------------------------ references


def numpy_estimates(per_example, half_a, half_b):
  """McCandlish et al.'s two-batch estimator in its general form, from raw per-example gradients.

  b_small and b_big are counted from the rows; |g_small|^2 is the mean over
  the two halves of their own means' squared norms.
  """
  g_a = per_example[half_a].mean(axis=0)
  g_b = per_example[half_b].mean(axis=0)
  g_full = per_example[np.concatenate([half_a, half_b])].mean(axis=0)
  b_small = len(half_a)
  b_big = len(half_a) + len(half_b)
  small = np.mean([g_a @ g_a, g_b @ g_b])
  big = g_full @ g_full
  g2 = (b_big * big - b_small * small) / (b_big - b_small)
  trace = (small - big) / (1 / b_small - 1 / b_big)
  return g2, trace, np.linalg.norm(g_a), np.linalg.norm(g_b), np.linalg.norm(g_full)


def numpy_controller(steps, b0, multiple, decay, max_change, lower, upper, warmup=0):
  """The controller's sizes, written independently: EMAs as explicit weighted sums."""
  sizes, b = [], b0
  estimates = []  # (g2, trace) of the finite steps so far
  for t, (na, nb, nm, realised, finite) in enumerate(steps, start=1):
    if finite and realised >= 2:
      small = (na**2 + nb**2) / 2
      big = nm**2
      estimates.append((2 * big - small, realised * (small - big)))
      if t > warmup:
        n = len(estimates)
        weights = (1 - decay) * decay ** np.arange(n - 1, -1, -1)
        g2 = float(weights @ np.array([e[0] for e in estimates]))
        trace = float(weights @ np.array([e[1] for e in estimates]))
        scale = math.inf if g2 <= 0 else max(trace, 0.0) / g2
        target = multiple * scale
        if math.isinf(target) and max_change is None:
          new = b if upper is None else upper
        else:
          new = math.inf if math.isinf(target) else max(int(round(target)), 1)
        if max_change is not None:
          if new > b:
            new = min(new, max(b + 1, int(b * max_change)))
          elif new < b:
            new = max(new, min(b - 1, math.ceil(b / max_change)), 1)
        if upper is not None:
          new = min(new, upper)
        if lower is not None:
          new = max(new, lower)
        b = int(new)
    sizes.append(b)
  return sizes


class Gaussian:
  """Per-example gradients G + noise, noise ~ N(0, diag(variances)): known |G|^2 and tr(Sigma)."""

  def __init__(self, dim=50, signal=1.0, noise_scale=200.0, seed=0):
    rng = np.random.default_rng(seed)
    direction = rng.normal(size=dim)
    self.mean = signal * direction / np.linalg.norm(direction)
    variances = rng.uniform(0.5, 1.5, size=dim)
    self.variances = variances * noise_scale * signal**2 / variances.sum()
    self.rng = rng

  @property
  def true_g2(self):
    return float(self.mean @ self.mean)

  @property
  def true_trace(self):
    return float(self.variances.sum())

  def stats(self, batch_size):
    """The trainer's stats for one step at ``batch_size``: the halves split by parity like devices."""
    per_example = self.mean + self.rng.normal(size=(batch_size, self.mean.size)) * np.sqrt(
      self.variances
    )
    half = batch_size // 2
    g_a, g_b = (
      per_example[:half].sum(0) / (batch_size / 2),
      per_example[half:].sum(0) / (batch_size / 2),
    )
    mean = per_example.mean(0)
    return {
      "norm_a": float(np.linalg.norm(g_a)),
      "norm_b": float(np.linalg.norm(g_b)),
      "norm_mean": float(np.linalg.norm(mean)),
      "batch_size": batch_size,
      "loss": 1.0,
      "grads_finite": True,
    }


def step_stats(seed, n, sizes=(16, 300)):
  """Random but plausible norms: |g_mean| below both halves mostly, sometimes not."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    na, nb = rng.uniform(0.5, 2.0, size=2)
    nm = rng.uniform(0.2, 1.1) * min(na, nb)
    out.append(
      (float(na), float(nb), float(nm), int(rng.integers(*sizes)), bool(rng.random() > 0.05))
    )
  return out


def feed(controller, steps):
  sizes = []
  for na, nb, nm, realised, finite in steps:
    stats = {
      "norm_a": na,
      "norm_b": nb,
      "norm_mean": nm,
      "batch_size": realised,
      "grads_finite": finite,
    }
    sizes.append(controller.update(0.1 if finite else math.nan, stats=stats))
  return sizes


# ------------------------------------------------------------------ estimates


@pytest.mark.parametrize("batch_size", [2, 8, 64, 1000])
def test_estimates_match_the_general_two_batch_formula(batch_size):
  rng = np.random.default_rng(batch_size)
  per_example = rng.normal(size=(batch_size, 30)) + rng.normal(size=30)
  half = np.arange(batch_size // 2)
  g2, trace, na, nb, nm = numpy_estimates(per_example, half, half + batch_size // 2)
  got = noise_scale_estimates(na, nb, nm, batch_size)
  np.testing.assert_allclose(got, (g2, trace), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("batch_size", [True, 1, -8, math.nan, 0, math.inf, "64", None])
def test_estimates_refuse_a_batch_size_that_is_not_a_finite_number_above_1(batch_size):
  with pytest.raises(ValueError, match=r"batch_size must be a finite number > 1 .*, got "):
    noise_scale_estimates(1.0, 1.5, 1.0, batch_size)


@pytest.mark.parametrize("name", ["norm_a", "norm_b", "norm_mean"])
@pytest.mark.parametrize("norm", [-1.0, True, "1.0", None])
def test_estimates_refuse_a_norm_that_no_measurement_gives(name, norm):
  norms = {"norm_a": 1.0, "norm_b": 1.5, "norm_mean": 1.0, name: norm}
  with pytest.raises(ValueError, match=rf"{name} must be a norm, a number >= 0 .*, got "):
    noise_scale_estimates(**norms, batch_size=64)


def test_estimates_take_numpy_numbers_and_an_unmeasured_steps_norms():
  want = noise_scale_estimates(1.0, 1.5, 1.0, 64)
  assert noise_scale_estimates(np.float32(1.0), 1.5, np.float64(1.0), np.int64(64)) == want
  assert all(math.isnan(x) for x in noise_scale_estimates(math.nan, 1.5, 1.0, 64))


def test_estimates_are_unbiased_on_gaussian_gradients():
  """Averaged over many steps, the per-step estimates converge to |G|^2 and tr(Sigma)."""
  source = Gaussian(dim=40, signal=1.0, noise_scale=100.0, seed=1)
  draws = np.array(
    [
      noise_scale_estimates(
        **{k: v for k, v in source.stats(64).items() if k.startswith("norm") or k == "batch_size"}
      )
      for _ in range(4000)
    ]
  )
  g2, trace = draws.mean(axis=0)
  g2_se, trace_se = draws.std(axis=0) / np.sqrt(len(draws))
  assert abs(g2 - source.true_g2) < 4 * g2_se
  assert abs(trace - source.true_trace) < 4 * trace_se
  # And they are noisy: single-step |G|^2 estimates go negative here.
  assert (draws[:, 0] < 0).any()


@pytest.mark.parametrize("true_scale, batch_size", [(50.0, 32), (400.0, 64), (2000.0, 512)])
def test_smoothed_noise_scale_converges_to_the_true_one(true_scale, batch_size):
  source = Gaussian(dim=64, signal=0.5, noise_scale=true_scale, seed=int(true_scale))
  assert source.true_trace / source.true_g2 == pytest.approx(true_scale)
  c = GnsController(
    batch_size,
    1.0,
    ema_decay=0.995,
    batch_size_lower_bound=batch_size,
    batch_size_upper_bound=batch_size,
  )  # size pinned: measure only
  for _ in range(3000):
    c.update(0.1, stats=source.stats(batch_size))
  assert c.noise_scale == pytest.approx(true_scale, rel=0.15)
  assert c.trace_estimate == pytest.approx(source.true_trace, rel=0.1)
  assert c.g2_estimate == pytest.approx(source.true_g2, rel=0.15)


@pytest.mark.parametrize("multiple", [0.25, 1.0])
def test_closed_loop_holds_the_batch_near_multiple_times_noise_scale(multiple):
  source = Gaussian(dim=64, signal=1.0, noise_scale=400.0, seed=3)
  c = simigrad_jax.make_controller(
    "gns",
    initial_batch_size=16,
    multiple=multiple,
    ema_decay=0.98,
    batch_size_lower_bound=4,
    batch_size_upper_bound=4096,
  )
  sizes = [c.update(0.1, stats=source.stats(c.batch_size)) for _ in range(1500)]
  settled = np.mean(sizes[-500:])
  assert settled == pytest.approx(multiple * 400.0, rel=0.2)
  steps = np.array([16] + sizes)
  ratios = steps[1:] / steps[:-1]
  assert ratios.max() <= 2.0 and ratios.min() >= 0.5  # max_change=2 by default
  assert ratios.max() == 2.0  # and the pace limit was reached on the way up


def test_simigrad_and_gns_agree_on_the_operating_point():
  """E[cos] ~ 1 / (1 + 2 B_simple / B): a similarity target s matches the multiple 2 s / (1 - s)."""
  source = Gaussian(dim=64, signal=1.0, noise_scale=300.0, seed=4)
  target = 0.2
  multiple = 2 * target / (1 - target)
  sim = simigrad_jax.make_controller(
    "simigrad",
    initial_batch_size=32,
    similarity_target=target,
    batch_size_lower_bound=4,
    batch_size_upper_bound=4096,
  )
  sim_sizes = []
  for _ in range(1500):
    stats = source.stats(sim.batch_size)
    # cos(g_A, g_B) from the norms: |g_A + g_B|^2 = 4 |mean|^2.
    cos = (4 * stats["norm_mean"] ** 2 - stats["norm_a"] ** 2 - stats["norm_b"] ** 2) / (
      2 * stats["norm_a"] * stats["norm_b"]
    )
    sim_sizes.append(sim.update(cos, stats=stats))
  assert np.mean(sim_sizes[-500:]) == pytest.approx(multiple * 300.0, rel=0.25)


# ------------------------------------------------------------------ the rule


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
  "multiple, decay, max_change, lower, upper, warmup",
  [
    (1.0, 0.9, 2.0, None, 1024, 0),
    (0.5, 0.0, None, 4, 512, 0),
    (2.0, 0.99, 1.1, 8, None, 3),
    (0.1, 0.5, None, None, None, 0),
  ],
)
def test_sequence_matches_numpy_reference(seed, multiple, decay, max_change, lower, upper, warmup):
  steps = step_stats(seed, 300)
  c = GnsController(
    64,
    multiple,
    ema_decay=decay,
    max_change=max_change,
    batch_size_lower_bound=lower,
    batch_size_upper_bound=upper,
    warmup_steps=warmup,
  )
  assert feed(c, steps) == numpy_controller(
    steps, 64, multiple, decay, max_change, lower, upper, warmup
  )


def test_hand_checked_step():
  # |g_A| = 1, |g_B| = 1.1, |mean| = 0.8, B = 64: |g_b|^2 = 1.105, |g_B|^2 = 0.64,
  # |G|^2 = 2 * 0.64 - 1.105 = 0.175, tr = 64 * 0.465 = 29.76, B_simple = 170.06.
  c = GnsController(64, 0.5, ema_decay=0.0, max_change=None, batch_size_upper_bound=1024)
  stats = {"norm_a": 1.0, "norm_b": 1.1, "norm_mean": 0.8, "batch_size": 64}
  assert c.update(0.2, stats=stats) == 85  # round(0.5 * 170.06)
  assert c.noise_scale == pytest.approx(29.76 / 0.175)
  assert c.last_decision == "grow"
  c = GnsController(64, 0.5, ema_decay=0.0, max_change=1.2)
  assert c.update(0.2, stats=stats) == 76  # int(64 * 1.2)
  c = GnsController(100, 0.5, ema_decay=0.0, max_change=1.2, batch_size_lower_bound=90)
  assert c.update(0.2, stats=stats) == 90 and c.last_decision == "clamped"


def test_noise_dominated_and_noiseless_steps():
  noisy = {"norm_a": 1.0, "norm_b": 1.0, "norm_mean": 0.1, "batch_size": 64}  # |G|^2 < 0
  c = GnsController(64, 1.0, ema_decay=0.0, max_change=2.0, batch_size_upper_bound=100)
  assert c.update(0.0, stats=noisy) == 100 and c.noise_scale == math.inf
  assert c.last_decision == "clamped"
  c = GnsController(64, 1.0, ema_decay=0.0, max_change=None, batch_size_upper_bound=1000)
  assert c.update(0.0, stats=noisy) == 1000
  c = GnsController(64, 1.0, ema_decay=0.0, max_change=None)  # nowhere to go: holds
  assert c.update(0.0, stats=noisy) == 64 and c.last_decision == "hold"
  c = GnsController(64, 1.0, ema_decay=0.0, max_change=2.0)
  assert c.update(0.0, stats=noisy) == 128
  clean = {"norm_a": 1.0, "norm_b": 1.0, "norm_mean": 1.0, "batch_size": 64}  # tr = 0
  c = GnsController(64, 1.0, ema_decay=0.0, max_change=None, batch_size_lower_bound=8)
  assert c.update(1.0, stats=clean) == 8 and c.noise_scale == 0.0


@pytest.mark.parametrize(
  "similarity, stats",
  [
    (math.nan, {}),
    (0.1, {"grads_finite": False}),
    (0.1, {"norm_a": math.nan}),
    (0.1, {"norm_mean": math.inf}),
    (0.1, {"batch_size": 1}),
  ],
  ids=["nan-similarity", "nonfinite-step", "nan-norm", "inf-norm", "batch-of-one"],
)
def test_nonfinite_steps_hold_count_and_leave_the_averages(similarity, stats):
  good = {"norm_a": 1.0, "norm_b": 1.1, "norm_mean": 0.8, "batch_size": 64}
  c = GnsController(64, 0.5, ema_decay=0.5)
  c.update(0.2, stats=good)
  before = c.state_dict()
  assert c.update(similarity, stats={**good, **stats}) == before["batch_size"]
  assert c.last_decision == "nonfinite" and c.nonfinite_count == 1
  after = c.state_dict()
  for key in ("ema_trace", "ema_g2", "ema_count"):
    assert after[key] == before[key]


@pytest.mark.parametrize("key", ["norm_a", "norm_b", "norm_mean"])
def test_a_negative_norm_is_refused_and_changes_nothing(key):
  good = {"norm_a": 1.0, "norm_b": 1.1, "norm_mean": 0.8, "batch_size": 64}
  c = GnsController(64, 0.5, ema_decay=0.5)
  c.update(0.2, stats=good)
  before = c.state_dict()
  with pytest.raises(ValueError, match=rf"stats\['{key}'\] must be a norm \(>= 0\), got -0.5"):
    c.update(0.2, stats={**good, key: -0.5})
  assert c.state_dict() == before


def test_warmup_learns_but_holds():
  stats = {"norm_a": 1.0, "norm_b": 1.1, "norm_mean": 0.8, "batch_size": 64}
  c = GnsController(64, 0.5, ema_decay=0.0, max_change=None, warmup_steps=2)
  assert [c.update(0.2, stats=stats) for _ in range(3)] == [64, 64, 85]
  assert c.noise_scale == pytest.approx(170.057, rel=1e-4)


def test_needs_stats():
  c = GnsController(64)
  with pytest.raises(
    ValueError,
    match=r"'gns' controller needs update\(similarity, stats=...\) "
    r"with the keys \['norm_a', 'norm_b', 'norm_mean', 'batch_size'\].*got None",
  ):
    c.update(0.1)
  with pytest.raises(ValueError, match=r"got \['norm_a'\]"):
    c.update(0.1, stats={"norm_a": 1.0})


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"multiple": 0.0}, r"multiple must be a number in \(0, inf\), got 0.0"),
    ({"multiple": math.inf}, "multiple .* got inf"),
    ({"multiple": "1"}, "multiple .* got '1'"),
    ({"ema_decay": 1.0}, r"ema_decay must be a number in \[0, 1\), got 1.0"),
    ({"ema_decay": -0.1}, "ema_decay .* got -0.1"),
    ({"max_change": 1.0}, r"max_change must be a number in \(1, inf\), got 1.0"),
    ({"max_change": math.nan}, "max_change .* got nan"),
    ({"batch_size_lower_bound": 1}, "batch_size_lower_bound must be an integer >= 2, got 1"),
    ({"batch_size_upper_bound": 32}, r"initial_batch_size must lie within .*\[1, 32\], got 64"),
    (
      {"batch_size_lower_bound": 128, "batch_size_upper_bound": 100},
      r"batch_size_lower_bound \(128\) must not exceed batch_size_upper_bound \(100\)",
    ),
    ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0, got -1"),
    ({"verbose": 1}, "verbose must be True or False, got 1"),
  ],
)
def test_bad_settings_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    GnsController(64, **kwargs)


@pytest.mark.parametrize("k", [0, 1, 7, 50, 150])
def test_state_dict_round_trip_resumes_exactly(k):
  steps = step_stats(5, 200)
  kwargs = dict(
    ema_decay=0.9,
    max_change=1.5,
    batch_size_lower_bound=4,
    batch_size_upper_bound=2000,
    warmup_steps=3,
  )
  whole = GnsController(64, 0.7, **kwargs)
  expected = feed(whole, steps)
  first = GnsController(64, 0.7, **kwargs)
  feed(first, steps[:k])
  saved = json.loads(json.dumps(first.state_dict()))
  resumed = GnsController(64, 0.7, **kwargs)
  resumed.load_state_dict(saved)
  assert feed(resumed, steps[k:]) == expected[k:]
  assert resumed.state_dict() == whole.state_dict()
  assert resumed.noise_scale == whole.noise_scale


def test_load_refuses_other_settings_kinds_and_bad_state():
  c = GnsController(64, 0.7, batch_size_upper_bound=512)
  feed(c, step_stats(1, 5))
  state = json.loads(json.dumps(c.state_dict()))
  other = GnsController(64, 0.5, batch_size_upper_bound=512)
  with pytest.raises(ValueError, match=r"multiple \(saved 0.7, here 0.5\)"):
    other.load_state_dict(state)
  with pytest.raises(
    ValueError, match="state is of a 'gns' controller, this one is 'loss_plateau'"
  ):
    simigrad_jax.make_controller("loss_plateau", initial_batch_size=64).load_state_dict(state)
  same = GnsController(64, 0.7, batch_size_upper_bound=512)
  for mutate, match in (
    (lambda s: s.update(ema_g2=math.nan), "ema_g2 must be a finite number"),
    (lambda s: s.pop("ema_count"), "malformed"),
    (lambda s: s.update(batch_size=4096), "batch_size must lie within"),
  ):
    bad = json.loads(json.dumps(state))
    mutate(bad)
    with pytest.raises(ValueError, match=match):
      same.load_state_dict(bad)
    assert same.step == 0 and same.noise_scale is None  # untouched


def test_verbose_logs_the_noise_scale(caplog):
  c = GnsController(64, 0.5, ema_decay=0.0, verbose=True)
  with caplog.at_level(logging.INFO, logger="simigrad_jax"):
    c.update(0.2, stats={"norm_a": 1.0, "norm_b": 1.1, "norm_mean": 0.8, "batch_size": 64})
  message = caplog.records[0].getMessage()
  assert "gns step 1: grow, batch size 64 -> 85" in message and "noise scale 170.05" in message
