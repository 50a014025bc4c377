"""simigrad_jax.Controller's saved state: a resume continues exactly, a bad state is refused."""

import json
import math

import numpy as np
import pytest
from simigrad_test import random_sims
from simigrad_test import run

from simigrad_jax.controllers.simigrad import Controller

CONFIGS = {
  "plain": dict(),
  "bounded_smooth": dict(
    batch_size_lower_bound=32, batch_size_upper_bound=700, smooth_factor=0.6, dead_band=0.02
  ),
  "profile": dict(batch_sizes_to_profile=[64, 256, 32], profile_steps_per_size=3, warmup_steps=2),
}


def trace(c, sims):
  out = []
  for s in sims:
    out.append((c.update(s), c.last_decision))
  return out


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("k", [0, 1, 3, 5, 8, 12, 40])
def test_state_dict_round_trip(name, k):
  kwargs = CONFIGS[name]
  sims = random_sims(11, 80, 0.1)
  sims[6] = math.nan
  whole = Controller(128, 0.1, **kwargs)
  expected = trace(whole, sims)

  first = Controller(128, 0.1, **kwargs)
  trace(first, sims[:k])
  saved = json.loads(json.dumps(first.state_dict()))
  resumed = Controller(128, 0.1, **kwargs)
  resumed.load_state_dict(saved)
  assert resumed.batch_size == first.batch_size
  assert trace(resumed, sims[k:]) == expected[k:]
  assert resumed.state_dict() == whole.state_dict()
  assert resumed.profile == whole.profile


def test_round_trip_mid_profile_is_really_mid_profile():
  c = Controller(128, 0.1, batch_sizes_to_profile=[64, 256], profile_steps_per_size=3)
  run(c, [0.5, 0.5, 0.5, 0.5])
  state = c.state_dict()
  assert state["profile_plan"]["position"] == 1
  assert state["profile_plan"]["count"] == 1
  fresh = Controller(128, 0.1)  # built without a profile: the state brings it
  fresh.load_state_dict(json.loads(json.dumps(state)))
  assert fresh.profiling
  assert run(fresh, [0.5, 0.5, 0.0]) == [256, 128, 140]


@pytest.mark.parametrize(
  "field, value, match",
  [
    ("position", 2, "profile position 2 is past the end"),
    ("sizes", [64, 4096], "profile size must lie within"),
    ("steps_per_size", 0, "steps_per_size must be an integer >= 1"),
  ],
)
def test_load_refuses_bad_profile_plan(field, value, match):
  c = Controller(128, 0.1, batch_size_upper_bound=512, batch_sizes_to_profile=[64, 256])
  state = c.state_dict()
  state["profile_plan"][field] = value
  fresh = Controller(128, 0.1, batch_size_upper_bound=512)
  with pytest.raises(ValueError, match=match):
    fresh.load_state_dict(state)
  assert not fresh.profiling


def test_state_dict_is_plain_json():
  c = Controller(
    np.int64(64),
    np.float64(0.25),
    batch_size_upper_bound=np.int32(900),
    smooth_factor=0.5,
    batch_sizes_to_profile=[32],
  )
  run(c, [np.float32(0.1), 0.2, 0.3])
  state = c.state_dict()
  assert json.loads(json.dumps(state)) == state
  assert state["version"] == 1


def test_load_refuses_different_config():
  c = Controller(128, 0.1, batch_size_upper_bound=512)
  c.update(0.0)
  state = json.loads(json.dumps(c.state_dict()))
  other = Controller(128, 0.2, batch_size_upper_bound=1024)
  with pytest.raises(
    ValueError,
    match=r"similarity_target \(saved 0.1, here 0.2\).*"
    r"batch_size_upper_bound \(saved 512, here 1024\)",
  ):
    other.load_state_dict(state)
  assert other.batch_size == 128 and other.step == 0  # untouched
  del state["config"]
  other.load_state_dict(state)  # no config section: loads
  assert other.batch_size == 140 and other.step == 1


@pytest.mark.parametrize(
  "mutate, match",
  [
    (lambda s: s.update(version=2), "version must be 1, got 2"),
    (lambda s: s.pop("version"), "version must be 1, got None"),
    (lambda s: s.update(batch_size=4096), "batch_size must lie within"),
    (lambda s: s.pop("step"), "malformed"),
    (lambda s: s.update(last_decision="jump"), "last_decision must be one of"),
  ],
)
def test_load_refuses_bad_state(mutate, match):
  c = Controller(128, 0.1, batch_size_upper_bound=512)
  c.update(0.0)
  state = c.state_dict()
  mutate(state)
  fresh = Controller(128, 0.1, batch_size_upper_bound=512)
  with pytest.raises(ValueError, match=match):
    fresh.load_state_dict(state)
  assert fresh.batch_size == 128 and fresh.step == 0
