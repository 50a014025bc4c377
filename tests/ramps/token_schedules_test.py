"""Batch-size ramps in tokens: Megatron's thresholds, MaxText's linear ramp, doubling warmup, Seesaw."""

import doctest
import json
import math

import numpy as np
import optax
import pytest

import simigrad_jax
import tiny_run
from simigrad_jax.controllers import learning_rate
from simigrad_jax.ramps import seesaw
from simigrad_jax.ramps import token_schedules
from simigrad_jax.ramps.seesaw import SeesawController
from simigrad_jax.ramps.seesaw import cosine_halving_points
from simigrad_jax.ramps.token_schedules import StepScheduleController
from simigrad_jax.ramps.token_schedules import parse_count
from simigrad_jax.ramps.token_schedules import parse_thresholds


def test_doctests():
  for module in (token_schedules, seesaw):
    assert doctest.testmod(module).failed == 0


def run_sizes(controller, num_examples, step_cap=10_000):
  """Drives ``controller`` as the Trainer would: the sizes of every step and the examples before each."""
  seen, sizes, starts = 0, [], []
  while seen < num_examples and len(sizes) < step_cap:
    size = controller.batch_size
    starts.append(seen)
    sizes.append(size)
    seen += size
    controller.update(0.1, stats={"examples_seen": seen})
  return sizes, starts


def reference_step_schedule(pairs, tokens_per_example, examples_seen, initial):
  """The size after ``examples_seen`` examples, read off the pairs by a linear scan."""
  size = initial
  for count, b in pairs:
    if examples_seen * tokens_per_example >= count:
      size = b
  return size


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
  "text, expected",
  [
    ("0", 0),
    ("200k", 200_000),
    ("200K", 200_000),
    ("1.5M", 1_500_000),
    ("250B", 250_000_000_000),
    ("2G", 2_000_000_000),
    ("3T", 3 * 10**12),
    (" 64 ", 64),
    (12, 12),
    (3.0, 3),
  ],
)
def test_counts_with_suffixes(text, expected):
  assert parse_count("count", text) == expected


@pytest.mark.parametrize(
  "value, match",
  [
    (
      "200x",
      r"count '200x' has an unknown suffix 'x'; use one of \['k', 'K', 'M', 'B', 'G', 'T'\]",
    ),
    ("200kb", r"unknown suffix 'kb'"),
    ("-5", r"count must be a count .* got '-5'"),
    (-5, r"count must be a whole count >= 0, got -5"),
    ("1.5", r"count must be a whole count >= 0, got '1.5'"),
    ("abc", r"count must be a count .* got 'abc'"),
    (None, r"count must be a count .* got None"),
    (True, r"got True"),
  ],
)
def test_bad_counts_are_named(value, match):
  with pytest.raises(ValueError, match=match):
    parse_count("count", value)


def test_thresholds_in_every_form_agree():
  expected = [(0, 16), (200_000, 32), (600_000, 64)]
  assert parse_thresholds("0:16,200k:32,600k:64") == expected
  assert parse_thresholds("0:16 200k:32  600k:64") == expected  # Megatron writes spaces
  assert parse_thresholds({0: 16, "200k": 32, 600_000: 64}) == expected
  assert parse_thresholds([(0, 16), ("200k", 32), (600_000, 64)]) == expected
  assert token_schedules.format_thresholds(expected) == "0:16,200000:32,600000:64"
  assert parse_thresholds(token_schedules.format_thresholds(expected)) == expected


@pytest.mark.parametrize(
  "thresholds, match",
  [
    ("0:16,600k:64,200k:32", r"must increase strictly, got 200000 after 600000"),
    ("0:16,200k:32,200k:64", r"must increase strictly, got 200000 after 200000"),
    ("0:16,200q:32", r"threshold \['200q', '32'\]: the count '200q' has an unknown suffix 'q'"),
    ("0:0", r"threshold \['0', '0'\]: the batch size must be an integer >= 1, got 0"),
    ("0:16,5k:-2", r"the batch size must be an integer >= 1, got '-2'"),
    ("0:16,5k", r"each threshold must be a 'count:size' pair, got \['5k'\]"),
    ("", r"at least one 'count:size' pair"),
    (42, r"thresholds must be a string such as '0:16,200k:32'"),
  ],
)
def test_bad_thresholds_are_named(thresholds, match):
  with pytest.raises(ValueError, match=match):
    StepScheduleController(thresholds)


# --------------------------------------------------------------------------- step schedule


@pytest.mark.parametrize("tokens_per_example", [None, 64])
def test_step_schedule_follows_its_thresholds_in_a_run(tokens_per_example):
  tpe = tokens_per_example or 1
  pairs = [(0, 8), (300 * tpe, 16), (1000 * tpe, 40), (2500 * tpe, 24)]
  c = simigrad_jax.make_controller(
    "step_schedule", thresholds=pairs, tokens_per_example=tokens_per_example
  )
  sizes, starts = run_sizes(c, 4000)
  assert sizes == [reference_step_schedule(pairs, tpe, s, 8) for s in starts]
  assert set(sizes) == {8, 16, 40, 24}
  # The first step at or past a threshold takes its size, whatever came before.
  first_16 = sizes.index(16)
  assert starts[first_16] >= 300 > starts[first_16 - 1]
  assert c.config["batch_size_lower_bound"] == 8 and c.config["batch_size_upper_bound"] == 40
  assert c.config["similarity_target"] is None
  assert c.config["controller"] == "step_schedule"
  assert c.config["thresholds"] == [list(p) for p in pairs]


def test_step_schedule_initial_size_before_the_first_threshold():
  c = StepScheduleController("100:32", initial_batch_size=8)
  assert c.batch_size == 8 and c.size_at(99) == 8 and c.size_at(100) == 32
  with pytest.raises(
    ValueError, match=r"first threshold is at 100, not 0: give initial_batch_size"
  ):
    StepScheduleController("100:32")
  with pytest.raises(
    ValueError, match=r"initial_batch_size=128 differs from the schedule's size at 0, 16"
  ):
    simigrad_jax.make_controller("step_schedule", thresholds="0:16,1k:32", initial_batch_size=128)
  with pytest.raises(ValueError, match=r"tokens_per_example must be an integer >= 1, got 0"):
    StepScheduleController("0:16", tokens_per_example=0)


def test_step_schedule_is_clamped_to_the_bounds():
  c = StepScheduleController(
    "0:16,100:64,200:256", batch_size_lower_bound=8, batch_size_upper_bound=128
  )
  assert c.config["batch_size_lower_bound"] == 16 and c.config["batch_size_upper_bound"] == 128
  sizes, _ = run_sizes(c, 1000)
  assert max(sizes) == 128 and c.last_decision == "clamped"


def test_step_schedule_nonfinite_holds_then_catches_up():
  c = StepScheduleController("0:10,50:20,100:40")
  assert c.update(math.nan, stats={"examples_seen": 60}) == 10
  assert c.update(0.1, stats={"examples_seen": 110, "grads_finite": False}) == 10
  assert c.nonfinite_count == 2 and c.last_decision == "nonfinite"
  assert c.update(0.1, stats={"examples_seen": 120}) == 40
  with pytest.raises(ValueError, match=r"'step_schedule' controller needs .*\['examples_seen'\]"):
    c.update(0.1, stats={"epochs": 1.0})


# --------------------------------------------------------------------------- linear ramp


@pytest.mark.parametrize(
  "b0, b1, increment, ramp, tpe",
  [(16, 64, 16, 3000, None), (8, 40, 4, "10k", 8), (32, 33, 1, 7, None), (10, 100, 30, 1000, 3)],
)
def test_linear_ramp_is_megatrons_formula(b0, b1, increment, ramp, tpe):
  c = simigrad_jax.make_controller(
    "linear_ramp",
    initial_batch_size=b0,
    final_batch_size=b1,
    increment=increment,
    ramp=ramp,
    tokens_per_example=tpe,
  )
  total = parse_count("ramp", ramp)
  per_increment = total / ((b1 - b0) / increment)
  # Megatron-LM's RampupBatchsizeNumMicroBatches: start + floor(consumed / per) * increment.
  for examples in range(0, 2 * total // (tpe or 1) + 5):
    consumed = examples * (tpe or 1)
    expected = min(b0 + math.floor(consumed / per_increment) * increment, b1)
    assert c.size_at(examples) == expected, examples
  assert c.size_at(math.ceil(total / (tpe or 1))) == b1
  assert c.config["final_batch_size"] == b1 and c.config["ramp"] == total


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"increment": 5}, r"increment=5 must divide final_batch_size - initial_batch_size = 48"),
    ({"final_batch_size": 16}, r"final_batch_size must be an integer >= 17, got 16"),
    ({"ramp": 2}, r"ramp=2 is shorter than its 3 increments: give a ramp >= 3"),
    ({"ramp": "3z"}, r"ramp '3z' has an unknown suffix 'z'"),
    ({"initial_batch_size": 0}, r"initial_batch_size must be an integer >= 1, got 0"),
  ],
)
def test_linear_ramp_bad_settings(kwargs, match):
  options = dict(initial_batch_size=16, final_batch_size=64, increment=16, ramp=300) | kwargs
  with pytest.raises(ValueError, match=match):
    simigrad_jax.make_controller("linear_ramp", **options)


# --------------------------------------------------------------------------- doubling warmup


def test_doubling_warmup_doubles_at_its_points():
  c = simigrad_jax.make_controller(
    "doubling_warmup",
    initial_batch_size=8,
    doubling_points="1k,3k,6k",
    tokens_per_example=10,
    batch_size_upper_bound=32,
  )
  assert c.thresholds == [(0, 8), (1000, 16), (3000, 32), (6000, 64)]
  assert [c.size_at(n) for n in (0, 99, 100, 299, 300, 700)] == [8, 8, 16, 16, 32, 32]
  assert c.config["batch_size_upper_bound"] == 32  # 64 is past the bound
  with pytest.raises(ValueError, match=r"doubling_points\[1\] must be a whole count"):
    simigrad_jax.make_controller("doubling_warmup", initial_batch_size=8, doubling_points=[5, -1])
  with pytest.raises(ValueError, match=r"doubling_points must be > 0"):
    simigrad_jax.make_controller("doubling_warmup", initial_batch_size=8, doubling_points="0,5")
  with pytest.raises(ValueError, match=r"must increase strictly, got 5 after 9"):
    simigrad_jax.make_controller("doubling_warmup", initial_batch_size=8, doubling_points="9,5")
  with pytest.raises(ValueError, match=r"non-empty list of counts"):
    simigrad_jax.make_controller("doubling_warmup", initial_batch_size=8, doubling_points=[])


# --------------------------------------------------------------------------- Seesaw


def test_cosine_halving_points_halve_the_cosine():
  for final in (0.0, 0.1):
    points = cosine_halving_points(100, 1100, 3, final_lr_fraction=final)

    def cosine(t, final=final):
      return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * (t - 100) / 1000))

    for k, point in enumerate(points, start=1):
      assert cosine(point) <= 0.5**k < cosine(point - 1)
  with pytest.raises(ValueError, match=r"final_lr_fraction=0.2 halves the rate fewer than"):
    cosine_halving_points(0, 100, 3, final_lr_fraction=0.2)
  with pytest.raises(ValueError, match=r"decay_end \(10\) must lie after decay_start \(10\)"):
    cosine_halving_points(10, 10, 1)


@pytest.mark.parametrize("lr_rule", ["sqrt", "linear", "none"])
def test_seesaw_learning_rate_is_its_formula(lr_rule):
  c = simigrad_jax.make_controller(
    "seesaw",
    initial_batch_size=16,
    halving_points="1k,2k,3k",
    tokens_per_example=10,
    batch_size_upper_bound=64,
  )
  schedule = c.lr_schedule(num_examples=1000, lr_rule=lr_rule)
  for examples, k, size in [(0, 0, 16), (99, 0, 16), (100, 1, 32), (200, 2, 64), (300, 3, 64)]:
    assert c.size_at(examples) == size and c.halvings_at(examples) == k
    # What the Trainer runs with: its batch-size factor at that size times the schedule.
    lr = learning_rate.lr_factor(size, 16, lr_rule) * schedule(examples / 1000)
    # Seesaw: lr / sqrt(2) per doubling; a plain halving once the batch is at its bound.
    expected = {0: 1.0, 1: 2**-0.5, 2: 0.5, 3: 0.25}[k]
    assert lr == pytest.approx(expected, rel=1e-12)
  assert schedule(0.2) == pytest.approx(
    0.25 if lr_rule == "sqrt" else (0.125 if lr_rule == "linear" else 0.5)
  )


def test_seesaw_takes_a_cosines_points_and_a_warmup():
  c = simigrad_jax.make_controller(
    "seesaw", initial_batch_size=8, decay_start=0, decay_end=1200, num_halvings=2
  )
  assert c.halving_points == [600, 800] and c.config["halving_points"] == [600, 800]
  schedule = c.lr_schedule(num_examples=100, base_schedule=lambda e: min(1.0, e / 2))
  assert schedule(1.0) == 0.5 and schedule(6.0) == 0.5 and schedule(8.0) == 0.25
  with pytest.raises(ValueError, match=r"seesaw needs halving_points, or decay_start"):
    simigrad_jax.make_controller("seesaw", initial_batch_size=8, decay_start=0)
  with pytest.raises(ValueError, match=r"not both"):
    simigrad_jax.make_controller(
      "seesaw", initial_batch_size=8, halving_points=[5], decay_start=0, decay_end=9, num_halvings=1
    )
  with pytest.raises(ValueError, match=r"rule='cubic' is not valid"):
    c.lr_schedule(num_examples=100, lr_rule="cubic")


# --------------------------------------------------------------------------- resume


TOKEN_RAMPS = {
  "step_schedule": dict(thresholds="0:8,100:16,300:24,500:40"),
  "linear_ramp": dict(initial_batch_size=8, final_batch_size=40, increment=8, ramp="500"),
  "doubling_warmup": dict(initial_batch_size=8, doubling_points="400,1.2k", tokens_per_example=4),
  "seesaw": dict(initial_batch_size=8, halving_points=[100, 300]),
}


@pytest.mark.parametrize("name", sorted(TOKEN_RAMPS))
@pytest.mark.parametrize("k", [0, 9, 25])
def test_state_round_trip_resumes_mid_ramp(name, k):
  def run(c, n):
    out = []
    for _ in range(n):
      seen = c.examples_seen + c.batch_size
      out.append((c.update(0.2, stats={"examples_seen": seen}), c.last_decision))
    return out

  whole = simigrad_jax.make_controller(name, **TOKEN_RAMPS[name])
  expected = run(whole, 40)
  assert len({b for b, _ in expected}) > 2, expected  # the ramp moves
  first = simigrad_jax.make_controller(name, **TOKEN_RAMPS[name])
  run(first, k)
  resumed = simigrad_jax.make_controller(name, **TOKEN_RAMPS[name])
  resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
  assert resumed.examples_seen == first.examples_seen
  assert run(resumed, 40 - k) == expected[k:]
  assert resumed.state_dict() == whole.state_dict()
  other = dict(TOKEN_RAMPS[name])
  other["tokens_per_example"] = 3
  with pytest.raises(ValueError, match=r"state config differs .* in: tokens_per_example"):
    simigrad_jax.make_controller(name, **other).load_state_dict(first.state_dict())
  bad = first.state_dict() | {"examples_seen": 2.5}
  with pytest.raises(ValueError, match=r"examples_seen must be an integer >= 0, got 2.5"):
    resumed.load_state_dict(bad)


def test_schedules_take_the_train_scripts_options():
  # train/train.py gives every registered controller the initial size and both bounds.
  for name, options in TOKEN_RAMPS.items():
    c = simigrad_jax.make_controller(
      name,
      **({"initial_batch_size": 8} | options),
      batch_size_lower_bound=8,
      batch_size_upper_bound=32,
    )
    sizes, _ = run_sizes(c, 3000)
    assert min(sizes) == 8 and max(sizes) == 32, (name, sizes)
  assert np.all(np.diff(sizes) >= 0)


# --------------------------------------------------------------------------- in the Trainer


def _seesaw_run(workdir, num_steps, cache_dir):
  """The tiny Trainer run under Seesaw (batch and learning rate), with Adam; its step records."""
  controller = SeesawController(8, halving_points="160,480", tokens_per_example=4)
  _, _, records = tiny_run.train_records(
    workdir,
    cache_dir,
    num_steps,
    optimizer=optax.chain(
      simigrad_jax.transform("batch"), optax.adam(0.01), simigrad_jax.scale_by_lr_factor()
    ),
    controller=controller,
    lr_schedule=controller.lr_schedule(num_examples=120),
  )
  return [(r["step"], r["batch_size"], r["lr_factor"], r["loss"]) for r in records]


def test_trainer_resumes_mid_seesaw_on_the_same_trajectory(tmp_path, devices):
  del devices
  cache = tmp_path / "cache"
  straight = _seesaw_run(tmp_path / "straight", 14, cache)
  # 40 examples at 8, 80 at 16, then 32; the learning rate by 1/sqrt(2) at each doubling.
  assert [b for _, b, _, _ in straight] == [8] * 5 + [16] * 5 + [32] * 4
  for _, b, lr, _ in straight:
    assert lr == pytest.approx({8: 1.0, 16: 2**-0.5, 32: 0.5}[b], rel=1e-6)
  _seesaw_run(tmp_path / "resumed", 7, cache)  # stops mid-ramp, between the two points
  resumed = _seesaw_run(tmp_path / "resumed", 14, cache)
  assert [r[:3] for r in resumed] == [r[:3] for r in straight]
  np.testing.assert_allclose([r[3] for r in resumed], [r[3] for r in straight], rtol=0, atol=1e-6)


def test_the_train_scripts_give_seesaw_its_learning_rate():
  from train import optimizers
  from train.configs import default

  config = default.get_config()
  config.update(lr_schedule="constant", warmup_epochs=1.0, lr_rule="sqrt")
  c = SeesawController(16, halving_points=[300, 500])
  schedule = optimizers.create_lr_schedule(config, c, num_examples=100)
  # The config's warm-up times Seesaw's 2^-k (the sqrt rule gives the rest).
  assert [schedule(e) for e in (0.5, 1.0, 2.99, 3.0, 5.0)] == pytest.approx(
    [0.5, 1.0, 1.0, 0.5, 0.25]
  )
  config.lr_schedule = "cosine"
  with pytest.raises(ValueError, match=r"config.lr_schedule='cosine' would decay it twice"):
    optimizers.create_lr_schedule(config, c, num_examples=100)
  plain = optimizers.create_lr_schedule(config, StepScheduleController("0:8"), num_examples=100)
  assert plain(config.num_epochs / 2 + config.warmup_epochs / 2) == pytest.approx(0.5)


def _ramp_run(workdir, cache_dir):
  """The tiny run on a ramp; (batch size, loss) per step and the plans placed: (size, ahead)."""
  with tiny_run.recording_placements() as placed:
    # Without the compile fallback, whose plan for a shape still compiling changes when it is
    # ready, every plan placed ahead is the one its step takes.
    _, _, records = tiny_run.train_records(
      workdir,
      cache_dir,
      12,
      controller=StepScheduleController("0:8,40:16,120:24"),
      compile=simigrad_jax.CompileConfig(fallback=False),
    )
  return [(r["batch_size"], r["loss"]) for r in records], placed


def test_a_ramp_finds_every_steps_rows_placed_ahead(tmp_path, devices, monkeypatch):
  """The schedule names its next size, so the data thread places exactly that one, ahead of each
  step; a size the controller did not name is laid out when it is taken."""
  del devices
  steps, placed = _ramp_run(tmp_path / "named", tmp_path / "cache")
  assert [b for b, _ in steps] == [8] * 5 + [16] * 5 + [24] * 2
  # One plan a step, each ahead of it (and the next one, for a step not taken).
  assert placed == [(b, True) for b, _ in steps] + [(24, True)]
  # A controller that names the wrong size (here always the first): the ramp's later sizes
  # are laid out when taken.
  monkeypatch.setattr(StepScheduleController, "likely_batch_sizes", lambda *args: [8])
  wrong_steps, wrong = _ramp_run(tmp_path / "wrong", tmp_path / "cache")
  assert wrong_steps == steps
  assert [b for b, ahead in wrong if not ahead] == [16] * 5 + [24] * 2
  assert [b for b, ahead in wrong if ahead] == [8] * 13
