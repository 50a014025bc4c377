"""Controller(steps_per_update=k): each update decides what k updates with its similarity would.

The reading of a measurement that stands for k optimizer steps
(``measure_every=k``): the rule keeps its rate per optimizer step. With k = 1
the controller is the one it always was (the rule's tests pin its sizes).
"""

import json
import math

import numpy as np
import pytest

import simigrad_jax
from simigrad_jax.controllers import interface
from simigrad_jax.controllers.simigrad import Controller
from simigrad_jax.controllers.simigrad import compounded
from simigrad_jax.controllers.simigrad import grow_move


def test_the_reference_rule_compounded_by_hand():
  # k = 4 from 2 in [2, 32]: 2 3 4 5 6 | 7 8 9 10 | ... | 24 26 28 30 33 -> 32 (clamped);
  # then a shrink: 32 -> 28 (int 28.8) -> 25 (int 25.2) -> 22 (int 22.5) -> 19 (int 19.8).
  c = Controller(2, 0.1, batch_size_lower_bound=2, batch_size_upper_bound=32, steps_per_update=4)
  sizes, decisions = [], []
  for s in [0.05] * 6 + [0.5]:
    sizes.append(c.update(s))
    decisions.append(c.last_decision)
  assert sizes == [6, 10, 14, 18, 24, 32, 19]
  assert decisions == ["grow"] * 5 + ["clamped", "shrink"]
  assert c.step == 7  # the counters count updates (measurements), not optimizer steps
  # A shrink that reaches the lower bound on the way: 3 -> 2 -> 2 -> 2 -> 1 -> 2.
  c = Controller(3, 0.1, batch_size_lower_bound=2, steps_per_update=4)
  assert (c.update(0.5), c.last_decision) == (2, "clamped")


@pytest.mark.parametrize(
  "b, smooth, expected",
  [
    # 10 -> max(11, int(10.5)) = 11 -> max(12, int(11.5)) = 12
    (10, 0.5, 12),
    # 100 -> 110 blended int(105) = 105 -> 115 blended int(110) = 110
    (100, 0.5, 110),
    (100, None, 121),
  ],
)
def test_smoothing_applies_to_each_of_the_k_decisions(b, smooth, expected):
  c = Controller(b, 0.3, smooth_factor=smooth, steps_per_update=2)
  assert c.update(0.1) == expected


def test_the_model_rule_moves_towards_its_goal_by_at_most_k_reference_moves():
  # ema_decay 0: the model is the one sample, B_simple = 100 * 0.6 / (2 * 0.4) = 75 and
  # B* = 2 * 0.5 / 0.5 * 75 = 150; each decision moves at most one reference move towards it.
  reached = {}
  for k in (1, 3, 6, 8):
    c = Controller(100, 0.5, ema_decay=0.0, steps_per_update=k)
    reached[k] = c.update(0.4)
    assert c.noise_scale == pytest.approx(75.0)
  assert reached == {1: 110, 3: 133, 6: 150, 8: 150}  # 110 121 133 146 150, then B* holds


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
  "options",
  [
    {},
    {"smooth_factor": 0.4},
    {"dead_band": 0.05},
    {"batch_size_lower_bound": 8, "batch_size_upper_bound": 90},
    {"warmup_steps": 2},
  ],
)
@pytest.mark.parametrize("k", [2, 4])
def test_an_update_of_k_steps_is_k_updates_with_its_similarity(seed, options, k):
  """The reference rule: every size of k = 4 is where k updates with the same similarity lead."""
  similarities = np.random.default_rng(seed).uniform(0.0, 0.6, 40)
  spaced = Controller(24, 0.3, steps_per_update=k, **options)
  single = Controller(24, 0.3, **{**options, "warmup_steps": k * options.get("warmup_steps", 0)})
  for s in similarities:
    for _ in range(k):
      single.update(float(s))
    assert spaced.update(float(s)) == single.batch_size


def test_with_one_step_per_update_the_controller_is_unchanged():
  options = dict(batch_size_lower_bound=8, batch_size_upper_bound=512, smooth_factor=0.3)
  similarities = np.random.default_rng(3).uniform(0.0, 0.6, 60)
  default, explicit = (
    Controller(64, 0.3, **options),
    Controller(64, 0.3, steps_per_update=1, **options),
  )
  for s in similarities:
    assert default.update(float(s)) == explicit.update(float(s))
    assert default.likely_batch_sizes(0, 0.0) == explicit.likely_batch_sizes(0, 0.0)
  assert default.config == explicit.config and "steps_per_update" not in default.config
  assert default.state_dict() == explicit.state_dict()


def test_the_likely_sizes_are_the_compounded_grow_and_shrink():
  assert Controller(100, 0.3, steps_per_update=2).likely_batch_sizes(0, 0.0) == [121, 81]
  banded = Controller(100, 0.3, dead_band=0.1, steps_per_update=3, batch_size_upper_bound=125)
  assert banded.likely_batch_sizes(0, 0.0) == [125, 72, 100]  # 133 clamped; 90 81 72; hold
  model = Controller(100, 0.5, ema_decay=0.0, steps_per_update=6)
  model.update(0.4)  # 150 (above); the averages as they stand lead first
  # 150 (B* holds); 165 181 199 218 239 262; 135 121 108 97 87 78.
  assert model.likely_batch_sizes(0, 0.0) == [150, 262, 78]


def test_compounded_clamps_between_decisions_and_leaves_the_last():
  clamp = lambda b: min(b, 115)  # noqa: E731
  assert compounded(100, grow_move, 1, None, clamp) == 110
  assert compounded(100, grow_move, 3, None, clamp) == 126  # 110, 121 -> 115, then 126


def test_the_setting_is_saved_and_a_state_with_another_is_refused():
  c = Controller(16, 0.3, steps_per_update=4)
  c.update(0.1)
  state = json.loads(json.dumps(c.state_dict()))
  assert state["config"]["steps_per_update"] == 4
  resumed = Controller(16, 0.3, steps_per_update=4)
  resumed.load_state_dict(state)
  assert resumed.batch_size == c.batch_size and resumed.update(0.1) == c.update(0.1)
  for other in (1, 2):
    with pytest.raises(ValueError, match=rf"steps_per_update \(saved 4, here {other}\)"):
      Controller(16, 0.3, steps_per_update=other).load_state_dict(state)
  plain = Controller(16, 0.3)
  with pytest.raises(ValueError, match=r"steps_per_update \(saved 1, here 4\)"):
    Controller(16, 0.3, steps_per_update=4).load_state_dict(plain.state_dict())


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "4", None, math.inf])
def test_a_bad_steps_per_update_is_refused(value):
  with pytest.raises(ValueError, match="steps_per_update must be an integer >= 1, got"):
    Controller(16, 0.3, steps_per_update=value)


def test_a_run_reads_the_setting_against_its_measure_every():
  spaced = Controller(16, 0.3, steps_per_update=4)
  assert interface.steps_per_update(spaced, measure_every=4) == 4
  assert interface.steps_per_update(Controller(16, 0.3), measure_every=4) == 1
  fixed = simigrad_jax.make_controller("fixed", initial_batch_size=8)
  assert interface.steps_per_update(fixed, measure_every=3) == 1  # no such setting: 1
  for every in (1, 2):
    with pytest.raises(ValueError, match=rf"must be 1 .* or the run's measure_every \({every}"):
      interface.steps_per_update(spaced, measure_every=every)
  assert simigrad_jax.make_controller("simigrad", initial_batch_size=8, similarity_target=0.2,
                                      steps_per_update=2).config["steps_per_update"] == 2  # fmt: skip
