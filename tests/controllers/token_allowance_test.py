"""The token-allowance controller ("allowance"): its formula, smoothing, pacing, resume (host side)."""

import json
import math

import numpy as np
import pytest

import simigrad_jax
from simigrad_jax.controllers import likely_batch_sizes
from simigrad_jax.controllers.token_allowance import AllowanceController
from simigrad_jax.controllers.token_allowance import allowance_batch_size


def similarity_at(batch_size, noise_scale):
  """The noise model's expected similarity of two halves of a batch (SPEC.md)."""
  return 1.0 / (1.0 + 2.0 * noise_scale / batch_size)


def tokens_ratio(batch_size, reference, noise_scale):
  """McCandlish et al.: examples per unit of progress at B over those at the reference batch."""
  return (1.0 + batch_size / noise_scale) / (1.0 + reference / noise_scale)


def steps_ratio(batch_size, reference, noise_scale):
  """Steps per unit of progress at B over those at the reference batch."""
  return (1.0 + noise_scale / batch_size) / (1.0 + noise_scale / reference) * reference / batch_size


@pytest.mark.parametrize("allowance", [1.0, 1.05, 1.1, 1.5])
@pytest.mark.parametrize("noise_scale", [4.0, 36.0, 400.0])
def test_the_size_spends_exactly_the_allowance_and_fewest_steps_within_it(allowance, noise_scale):
  b = allowance_batch_size(noise_scale, allowance, 16)
  assert tokens_ratio(b, 16, noise_scale) == pytest.approx(allowance)
  # Any larger batch spends more than the allowance; a smaller one takes more steps.
  assert tokens_ratio(b * 1.01, 16, noise_scale) > allowance
  assert steps_ratio(b * 0.99, 16, noise_scale) > steps_ratio(b, 16, noise_scale)
  assert allowance_batch_size(noise_scale, allowance, 0) == pytest.approx(
    (allowance - 1) * noise_scale
  )


def test_noiseless_similarities_give_the_formulas_size_each_step():
  c = AllowanceController(16, 1.1, ema_decay=0.0, max_change=None, batch_size_upper_bound=4096)
  for noise_scale in (10.0, 36.0, 120.0, 400.0, 2000.0):
    size = c.batch_size
    decided = c.update(similarity_at(size, noise_scale))
    assert c.noise_scale == pytest.approx(noise_scale)
    assert decided == round(1.1 * 16 + 0.1 * noise_scale)


def numpy_controller(similarities, b0, allowance, decay, max_change, lower, upper):
  """The controller's sizes, written independently: the averages as explicit weighted sums."""
  sizes, b, samples = [], b0, []
  for s in similarities:
    if math.isfinite(s):
      samples.append((s, b * (1 - s)))
      weights = (1 - decay) * decay ** np.arange(len(samples) - 1, -1, -1)
      mean_s = float(weights @ np.array([x[0] for x in samples]))
      mean_x = float(weights @ np.array([x[1] for x in samples]))
      scale = math.inf if mean_s <= 0 else max(mean_x, 0.0) / (2 * mean_s)
      target = allowance * b0 + (allowance - 1) * scale
      new = math.inf if math.isinf(target) else max(round(target), 1)
      if max_change is not None:
        if new > b:
          new = min(new, max(b + 1, int(b * max_change)))
        elif new < b:
          new = max(new, min(b - 1, math.ceil(b / max_change)), 1)
      elif math.isinf(new):
        new = upper
      b = int(min(max(new, lower), upper))
    sizes.append(b)
  return sizes


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("decay,max_change", [(0.9, 2.0), (0.5, 1.2), (0.0, None)])
def test_noisy_sequence_matches_numpy_reference(seed, decay, max_change):
  rng = np.random.default_rng(seed)
  similarities = rng.normal(0.3, 0.25, 120).tolist()
  similarities[7] = math.nan
  c = AllowanceController(
    16, 1.2, ema_decay=decay, max_change=max_change, batch_size_lower_bound=8,
    batch_size_upper_bound=512,
  )  # fmt: skip
  sizes = [c.update(s) for s in similarities]
  assert sizes == numpy_controller(similarities, 16, 1.2, decay, max_change, 8, 512)
  assert c.nonfinite_count == 1


def test_closed_loop_converges_to_the_allowance_size_on_noisy_similarities():
  rng = np.random.default_rng(3)
  c = AllowanceController(16, 1.1, ema_decay=0.95, batch_size_upper_bound=1024)
  for _ in range(600):
    c.update(similarity_at(c.batch_size, 300.0) + rng.normal(0, 0.1))
  assert c.noise_scale == pytest.approx(300.0, rel=0.25)
  assert abs(c.batch_size - (17.6 + 30.0)) <= 8


def test_noise_dominated_grows_by_max_change_and_nonfinite_steps_hold():
  c = AllowanceController(16, 1.1, ema_decay=0.0, batch_size_upper_bound=100)
  assert [c.update(-0.1) for _ in range(4)] == [32, 64, 100, 100]
  assert math.isinf(c.noise_scale)
  before = c.state_dict()
  assert c.update(math.nan) == 100 and c.last_decision == "nonfinite"
  assert c.update(0.5, stats={"grads_finite": False}) == 100
  assert c.state_dict()["similarity_model"] == before["similarity_model"]
  unbounded = AllowanceController(16, 1.1, ema_decay=0.0, max_change=None)
  assert unbounded.update(-0.1) == 16  # nowhere to go: holds
  assert AllowanceController(16, 1.0).update(0.01) == 16  # no allowance: the constant batch


def test_warmup_learns_but_holds_and_likely_sizes_name_the_decision():
  c = AllowanceController(16, 1.1, ema_decay=0.5, warmup_steps=2, batch_size_upper_bound=256)
  assert likely_batch_sizes(c, 0, 0.0) == (16,)
  assert [c.update(0.1), c.update(0.1)] == [16, 16] and c.noise_scale == pytest.approx(72.0)
  for _ in range(3):  # a step that measures what the averages expect decides the likeliest size
    expected = likely_batch_sizes(c, 0, 0.0)
    assert c.update(similarity_at(c.batch_size, c.noise_scale)) == expected[0] == 25  # 17.6 + 7.2
  fresh = AllowanceController(16, 1.1)
  assert likely_batch_sizes(fresh, 0, 0.0) == (32, 8, 16)  # the first estimate moves it anywhere


@pytest.mark.parametrize(
  "kwargs,match",
  [
    ({"token_allowance": 0.9}, r"token_allowance must be .*\[1, inf\).*0.9"),
    ({"token_allowance": math.inf}, "token_allowance"),
    ({"ema_decay": 1.0}, r"ema_decay must be .*\[0, 1\)"),
    ({"max_change": 1.0}, r"max_change must be .*\(1, inf\)"),
    ({"batch_size_lower_bound": 1}, "batch_size_lower_bound"),
  ],
)
def test_bad_settings_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    AllowanceController(16, **kwargs)


@pytest.mark.parametrize("k", [0, 1, 9, 60])
def test_state_dict_round_trip_resumes_exactly(k):
  rng = np.random.default_rng(5)
  similarities = rng.normal(0.25, 0.2, 100).tolist()
  kwargs = dict(ema_decay=0.9, max_change=1.5, batch_size_lower_bound=4, batch_size_upper_bound=900)
  whole = AllowanceController(16, 1.15, warmup_steps=3, **kwargs)
  expected = [whole.update(s) for s in similarities]
  first = AllowanceController(16, 1.15, warmup_steps=3, **kwargs)
  for s in similarities[:k]:
    first.update(s)
  resumed = AllowanceController(16, 1.15, warmup_steps=3, **kwargs)
  resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
  assert [resumed.update(s) for s in similarities[k:]] == expected[k:]
  assert resumed.state_dict() == whole.state_dict()


def test_load_refuses_other_settings_and_bad_state():
  c = AllowanceController(16, 1.1)
  c.update(0.3)
  state = json.loads(json.dumps(c.state_dict()))
  with pytest.raises(ValueError, match=r"token_allowance \(saved 1.1, here 1.2\)"):
    AllowanceController(16, 1.2).load_state_dict(state)
  bad = json.loads(json.dumps(state))
  bad["similarity_model"]["ema_noise"] = math.nan
  same = AllowanceController(16, 1.1)
  with pytest.raises(ValueError, match="ema_noise must be a finite number"):
    same.load_state_dict(bad)
  assert same.step == 0 and same.noise_scale is None


def test_registered_by_name_with_its_options():
  assert "allowance" in simigrad_jax.controller_names()
  c = simigrad_jax.make_controller("allowance", initial_batch_size=16, token_allowance=1.2)
  assert isinstance(c, AllowanceController) and c.config["token_allowance"] == 1.2
  assert "similarity_target" not in simigrad_jax.registry.controller_options("allowance")
