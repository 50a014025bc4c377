"""SimiGrad's Controller with ema_decay: the model rule on a moving average of the similarities."""

import json
import logging
import math

import numpy as np
import pytest

import simigrad_jax
from simigrad_jax.controllers.simigrad import Controller
from simigrad_jax.controllers.similarity_model import SimilarityModel

# ------------------------------------------------------------------ references


def numpy_sizes(b, sims, target, decay, lower=None, upper=None, warmup=0):
  """The model rule written out independently: the averages as explicit weighted sums."""
  seen, out = [], []  # (similarity, batch size) of the finite steps so far
  for t, s in enumerate(sims, start=1):
    if math.isfinite(s):
      seen.append((s, b))
    if math.isfinite(s) and t > warmup:
      w = decay ** np.arange(len(seen))[::-1]  # the newest sample weighs most
      sim_avg = float(np.dot(w, [x for x, _ in seen]))
      noise_avg = float(np.dot(w, [size * (1 - x) for x, size in seen]))
      scale = math.inf if sim_avg <= 0 else max(noise_avg, 0.0) / (2 * sim_avg)
      goal = 2 * target / (1 - target) * scale
      goal = goal if math.isinf(goal) else round(goal)
      if goal > b:
        b = min(goal, max(b + 1, int(b * 1.1)))
      elif goal < b and b > 1:
        b = max(goal, 1, min(b - 1, int(b * 0.9)))
      if upper is not None:
        b = min(b, upper)
      if lower is not None:
        b = max(b, lower)
    out.append(b)
  return out


def run(controller, sims):
  return [controller.update(s) for s in sims]


def trace(controller, sims):
  return [(controller.update(s), controller.last_decision) for s in sims]


def simulate(controller, seed, n, noise_scale=60.0, sd=0.15):
  """Feeds ``n`` similarities ``1 / (1 + 2 B_simple / B) + N(0, sd)`` measured at the current size."""
  rng = np.random.default_rng(seed)
  sizes = []
  for _ in range(n):
    b = controller.batch_size
    s = 1.0 / (1.0 + 2.0 * noise_scale / b) + sd * rng.standard_normal()
    sizes.append(controller.update(float(np.clip(s, -1.0, 1.0))))
  return np.array(sizes, np.float64)


# ------------------------------------------------------------------ the model


def test_model_by_hand():
  m = SimilarityModel(0.5)
  assert m.noise_scale is None and m.similarity_at(64) is None and m.batch_size_for(0.5) is None
  m.observe(0.5, 64)  # S = 0.25, X = 0.5 * 64 * 0.5 = 16
  m.observe(0.2, 32)  # S = 0.125 + 0.1 = 0.225, X = 8 + 0.5 * 32 * 0.8 = 20.8
  assert m.count == 2
  assert m.noise_scale == pytest.approx(20.8 / 0.45)
  assert m.similarity_at(128) == pytest.approx(1 / (1 + 2 * (20.8 / 0.45) / 128))
  assert m.batch_size_for(1 / 3) == pytest.approx(20.8 / 0.45)  # target 1/3: B* = B_simple
  # Samples the model generates give its noise scale back, whatever sizes they come from.
  exact = SimilarityModel(0.9)
  for b in (16, 40, 300, 90):
    exact.observe(1 / (1 + 2 * 75.0 / b), b)
  assert exact.noise_scale == pytest.approx(75.0)


def test_model_noise_dominates():
  m = SimilarityModel(0.0)
  m.observe(-0.1, 64)
  assert m.noise_scale == math.inf and m.similarity_at(64) == 0.0
  assert m.batch_size_for(0.3) == math.inf
  m.observe(1.0, 64)  # a perfectly clean gradient: no noise
  assert m.noise_scale == 0.0 and m.similarity_at(64) == 1.0 and m.batch_size_for(0.3) == 0.0


# ------------------------------------------------------------------ the rule


def test_hand_checked_sequence():
  c = Controller(32, 0.5, ema_decay=0.0, batch_size_upper_bound=1024)
  # 0.2 at 32: B_simple 64, B* 128: the reference's full step, to 35.
  # 0.5 at 35: B* 35: hold.  0.6 at 35: B* 23.3: the full step down, to 31.
  # 0.52 at 31: B* 28.6 -> 29, nearer than the reference's 27: a smaller step.
  assert trace(c, [0.2, 0.5, 0.6, 0.52]) == [
    (35, "grow"),
    (35, "hold"),
    (31, "shrink"),
    (29, "shrink"),
  ]
  assert c.noise_scale == pytest.approx(31 * 0.48 / 1.04)
  assert c.model_similarity == pytest.approx(1 / (1 + 2 * (31 * 0.48 / 1.04) / 29))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("decay", [0.0, 0.5, 0.9])
@pytest.mark.parametrize("bounds", [(None, None), (16, 256)])
def test_sequence_matches_numpy(seed, decay, bounds):
  lower, upper = bounds
  rng = np.random.default_rng(seed)
  sims = [float(s) for s in rng.uniform(-0.1, 0.8, size=120)]
  sims[7] = math.nan
  c = Controller(
    32,
    0.3,
    ema_decay=decay,
    batch_size_lower_bound=lower,
    batch_size_upper_bound=upper,
    warmup_steps=3,
  )
  assert run(c, sims) == numpy_sizes(32, sims, 0.3, decay, lower, upper, warmup=3)


def test_steadier_than_the_reference_under_noise():
  """Similarities drawn from the noise model (B_simple 60, sd 0.15); target 1/3 asks for B = 60."""

  def sizes(**kwargs):  # 3 seeds; the first 100 steps (the climb from 32) left out
    return [
      simulate(Controller(32, 1 / 3, batch_size_upper_bound=4096, **kwargs), seed, 600)[100:]
      for seed in range(3)
    ]

  spread = lambda runs: float(np.mean([np.std(np.log(r)) for r in runs]))  # noqa: E731
  level = lambda runs: float(np.mean(np.concatenate(runs)))  # noqa: E731
  reference, model, slow = sizes(), sizes(ema_decay=0.9), sizes(ema_decay=0.95)
  assert spread(model) < 0.8 * spread(reference) and spread(slow) < 0.6 * spread(reference)
  assert 57 <= level(model) <= 63 and 57 <= level(slow) <= 63
  # The reference settles where the noisy similarity is below the target half the time.
  assert abs(level(model) - 60) < abs(level(reference) - 60)


def test_nonfinite_holds_counts_and_teaches_nothing():
  c = Controller(64, 0.3, ema_decay=0.9)
  c.update(0.1)
  state = c.state_dict()["similarity_model"]
  for value in (math.nan, math.inf, -math.inf):
    assert c.update(value) == c.batch_size == 70 and c.last_decision == "nonfinite"
  assert c.nonfinite_count == 3 and c.state_dict()["similarity_model"] == state


def test_bounds_clamp():
  c = Controller(250, 0.5, ema_decay=0.0, batch_size_lower_bound=200, batch_size_upper_bound=260)
  assert trace(c, [0.1, 0.1, 0.9, 0.9]) == [
    (260, "clamped"),
    (260, "clamped"),
    (234, "shrink"),
    (210, "shrink"),
  ]
  assert trace(c, [0.9]) == [(200, "clamped")]


def test_dead_band_compares_the_model_similarity():
  c = Controller(64, 0.5, ema_decay=0.0, dead_band=0.1)
  assert trace(c, [0.45, 0.35]) == [(64, "hold"), (70, "grow")]


def test_model_learns_during_warmup_profile_and_disabled():
  c = Controller(
    64, 0.3, ema_decay=0.5, warmup_steps=2, batch_sizes_to_profile=[128], batch_size_upper_bound=512
  )
  trace(c, [0.2, 0.2, 0.5])  # warm-up, warm-up, then the profile starts (at 128)
  c.update(0.5)  # measured at 128; back to 64
  assert c.state_dict()["similarity_model"]["count"] == 4
  fixed = simigrad_jax.make_controller(
    "fixed", initial_batch_size=64, similarity_target=0.3, ema_decay=0.9
  )
  fixed.update(0.1)
  assert fixed.batch_size == 64 and fixed.noise_scale == pytest.approx(64 * 0.9 / 0.2)


def test_off_by_default_and_registered():
  plain = Controller(64, 0.3)
  assert plain.config["ema_decay"] is None and plain.noise_scale is None
  assert plain.state_dict()["similarity_model"] is None
  c = simigrad_jax.make_controller(
    "simigrad", initial_batch_size=64, similarity_target=0.3, ema_decay=0.9
  )
  assert c.config["ema_decay"] == 0.9 and c.model_similarity is None


def test_verbose_logs_the_model(caplog):
  c = Controller(64, 0.3, ema_decay=0.0, verbose=True)
  with caplog.at_level(logging.INFO, logger="simigrad_jax"):
    c.update(0.5)
  assert "noise scale 32.0, similarity at 64 0.5" in caplog.text


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"ema_decay": 1.0}, r"ema_decay must be a number in \[0, 1\), got 1.0"),
    ({"ema_decay": -0.1}, r"ema_decay must be a number in \[0, 1\), got -0.1"),
    ({"ema_decay": math.nan}, "ema_decay .* got nan"),
    ({"ema_decay": "0.9"}, "ema_decay .* got '0.9'"),
    ({"ema_decay": True}, "ema_decay .* got True"),
    (
      {"ema_decay": 0.9, "similarity_target": 0.0},
      r"ema_decay \(the model rule\) needs a similarity_target in \(0, 1\), got 0.0",
    ),
    ({"ema_decay": 0.9, "similarity_target": 1.0}, r"similarity_target in \(0, 1\), got 1.0"),
  ],
)
def test_bad_settings_raise(kwargs, match):
  args = {"similarity_target": 0.3} | kwargs
  with pytest.raises(ValueError, match=match):
    Controller(64, **args)


# ---------------------------------------------------------------- save / resume


@pytest.mark.parametrize("k", [0, 1, 5, 9, 30])
def test_state_dict_round_trip_mid_window(k):
  sims = [float(s) for s in np.random.default_rng(3).uniform(0.0, 0.7, size=60)]
  sims[4] = math.nan
  kwargs = dict(ema_decay=0.9, batch_size_upper_bound=512, smooth_factor=0.3, warmup_steps=2)
  whole = Controller(32, 0.3, **kwargs)
  expected = trace(whole, sims)
  first = Controller(32, 0.3, **kwargs)
  trace(first, sims[:k])
  resumed = Controller(32, 0.3, **kwargs)
  resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
  assert trace(resumed, sims[k:]) == expected[k:]
  assert resumed.state_dict() == whole.state_dict()


def test_load_refuses_mismatched_or_bad_model_state():
  c = Controller(32, 0.3, ema_decay=0.9)
  c.update(0.1)
  state = json.loads(json.dumps(c.state_dict()))
  with pytest.raises(ValueError, match=r"ema_decay \(saved 0.9, here None\)"):
    Controller(32, 0.3).load_state_dict(state)
  del state["config"]
  with pytest.raises(
    ValueError, match="the state has a similarity model; this controller does not"
  ):
    Controller(32, 0.3).load_state_dict(state)
  state["similarity_model"]["ema_noise"] = math.nan
  fresh = Controller(32, 0.3, ema_decay=0.9)
  with pytest.raises(ValueError, match="similarity model ema_noise must be a finite number"):
    fresh.load_state_dict(state)
  assert fresh.step == 0 and fresh.noise_scale is None  # untouched


def test_a_state_saved_before_the_option_loads():
  c = Controller(32, 0.3, batch_size_upper_bound=512)
  c.update(0.1)
  state = c.state_dict()
  del state["config"]["ema_decay"], state["similarity_model"]
  resumed = Controller(32, 0.3, batch_size_upper_bound=512)
  resumed.load_state_dict(state)
  assert resumed.batch_size == 35 and resumed.step == 1


def test_docstring_examples():
  import doctest  # pylint: disable=import-outside-toplevel

  from simigrad_jax.controllers import similarity_model  # pylint: disable=import-outside-toplevel

  assert doctest.testmod(similarity_model).failed == 0
