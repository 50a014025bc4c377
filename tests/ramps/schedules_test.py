"""Batch-size schedules ("linear", "geometric", "decreasing") and the loss-plateau rule (host side)."""

import json
import math

import numpy as np
import pytest

import simigrad_jax
from simigrad_jax.ramps.schedules import LossPlateauController
from simigrad_jax.ramps.schedules import ScheduleController

# ------------------------------------------------------------------ schedules


def numpy_schedule(epochs, b0, b1, ramp, shape, interval=None):
  """The schedule written with NumPy, vectorised over ``epochs``."""
  e = np.maximum(np.asarray(epochs, np.float64), 0.0)
  if interval is not None:
    e = np.floor(e / interval + 1e-9) * interval
  p = np.minimum(e / ramp, 1.0)
  values = b0 + (b1 - b0) * p if shape == "linear" else b0 * np.power(b1 / b0, p)
  return np.clip(np.round(values), min(b0, b1), max(b0, b1)).astype(int).tolist()


def epochs_of(sizes_per_step, num_examples):
  """The fractional epochs the trainer reports after each step of a run at these sizes."""
  return (np.cumsum(sizes_per_step) / num_examples).tolist()


@pytest.mark.parametrize(
  "name, b0, b1, ramp, interval",
  [
    ("linear", 32, 512, 10.0, None),
    ("linear", 32, 512, 10.0, 2.5),
    ("geometric", 16, 1024, 6.0, None),
    ("geometric", 32, 512, 16.0, 4.0),  # Smith et al.: x2 every 4 epochs
    ("linear", 512, 64, 3.0, None),  # a linear decrease through "linear"
    ("decreasing", 512, 64, 5.0, None),
    ("decreasing", 1000, 10, 5.0, 1.0),
  ],
)
def test_schedule_matches_numpy(name, b0, b1, ramp, interval):
  c = simigrad_jax.make_controller(
    name, initial_batch_size=b0, final_batch_size=b1, ramp_epochs=ramp, interval_epochs=interval
  )
  shape = "geometric" if name == "decreasing" else name
  epochs = np.linspace(0.0, ramp * 1.3, 400)[1:]
  got = [c.update(0.1, stats={"epochs": float(e)}) for e in epochs]
  assert got == numpy_schedule(epochs, b0, b1, ramp, shape, interval)
  assert got[-1] == b1
  assert c.config["batch_size_lower_bound"] == min(b0, b1)
  assert c.config["batch_size_upper_bound"] == max(b0, b1)
  assert c.config["similarity_target"] is None
  assert c.config["controller"] == shape


def test_staircase_doubles_at_the_interval():
  c = simigrad_jax.make_controller(
    "geometric", initial_batch_size=32, final_batch_size=256, ramp_epochs=6, interval_epochs=2
  )
  sizes = [c.update(0.0, stats={"epochs": e}) for e in (0.5, 1.99, 2.0, 3.9, 4.0, 6.0, 9.0)]
  assert sizes == [32, 32, 64, 64, 128, 256, 256]
  assert c.last_decision == "hold"
  c = simigrad_jax.make_controller(
    "geometric", initial_batch_size=32, final_batch_size=256, ramp_epochs=6, interval_epochs=2
  )
  c.update(0.0, stats={"epochs": 2.1})
  assert c.last_decision == "grow"


def test_schedule_in_a_simulated_run_follows_examples_not_steps():
  # The epochs counter comes from examples seen: feed what the trainer would.
  c = simigrad_jax.make_controller(
    "linear", initial_batch_size=20, final_batch_size=100, ramp_epochs=2
  )
  seen, sizes = 0, []
  while seen < 3 * 1000:
    b = c.batch_size
    seen += b
    sizes.append(b)
    c.update(0.1, stats={"epochs": seen / 1000})
  expected_after = numpy_schedule(epochs_of(sizes, 1000), 20, 100, 2.0, "linear")
  assert sizes[1:] == expected_after[:-1]


def test_schedule_nonfinite_holds_then_catches_up():
  c = simigrad_jax.make_controller(
    "linear", initial_batch_size=10, final_batch_size=110, ramp_epochs=1
  )
  assert c.update(math.nan, stats={"epochs": 0.5}) == 10
  assert c.update(0.1, stats={"epochs": 0.6, "grads_finite": False}) == 10
  assert c.nonfinite_count == 2 and c.last_decision == "nonfinite"
  assert c.update(0.1, stats={"epochs": 0.7}) == 80


@pytest.mark.parametrize(
  "name, kwargs, match",
  [
    ("linear", {"final_batch_size": 0}, "final_batch_size must be an integer >= 1, got 0"),
    ("linear", {"initial_batch_size": 2.5}, r"initial_batch_size must be an integer >= 1, got 2.5"),
    ("linear", {"ramp_epochs": 0}, r"ramp_epochs must be a number in \(0, inf\), got 0"),
    ("geometric", {"ramp_epochs": math.inf}, "ramp_epochs .* got inf"),
    (
      "linear",
      {"interval_epochs": -1.0},
      r"interval_epochs must be a number in \(0, inf\), got -1.0",
    ),
    (
      "decreasing",
      {"final_batch_size": 512},
      r"a decreasing schedule needs final_batch_size < initial_batch_size \(32\), got 512",
    ),
    (
      "decreasing",
      {"final_batch_size": 8, "shape": "cubic"},
      r"shape must be one of \('linear', 'geometric'\), got 'cubic'",
    ),
    ("linear", {"verbose": "no"}, "verbose must be True or False, got 'no'"),
  ],
)
def test_schedule_bad_settings_raise(name, kwargs, match):
  options = {"initial_batch_size": 32, "final_batch_size": 512, "ramp_epochs": 4.0} | kwargs
  with pytest.raises(ValueError, match=match):
    simigrad_jax.make_controller(name, **options)


def test_schedule_needs_epochs():
  c = ScheduleController(32, 64, 1.0)
  with pytest.raises(ValueError, match=r"'linear' controller needs .* keys \['epochs'\]"):
    c.update(0.1)


@pytest.mark.parametrize("k", [0, 3, 40])
def test_schedule_round_trip(k):
  epochs = np.linspace(0.01, 5, 60).tolist()

  def run(c, es):
    return [(c.update(0.1, stats={"epochs": e}), c.last_decision) for e in es]

  whole = ScheduleController(32, 512, 4.0, shape="geometric", interval_epochs=1.0)
  expected = run(whole, epochs)
  first = ScheduleController(32, 512, 4.0, shape="geometric", interval_epochs=1.0)
  run(first, epochs[:k])
  resumed = ScheduleController(32, 512, 4.0, shape="geometric", interval_epochs=1.0)
  resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
  assert run(resumed, epochs[k:]) == expected[k:]
  assert resumed.state_dict() == whole.state_dict()
  linear = ScheduleController(32, 512, 4.0, shape="linear", interval_epochs=1.0)
  with pytest.raises(
    ValueError, match="state is of a 'geometric' controller, this one is 'linear'"
  ):
    linear.load_state_dict(first.state_dict())


# ---------------------------------------------------------------- loss plateau


def reference_plateau(epoch_losses, b0, factor, patience, threshold, cooldown, upper):
  """The size after each epoch, written out independently (ReduceLROnPlateau's rule, 'rel' mode)."""
  best, bad, cool, b, out = None, 0, 0, b0, []
  for loss in epoch_losses:  # (positive losses)
    if best is None or loss < best * (1 - threshold):
      best, bad = loss, 0
    elif cool > 0:
      bad = 0
    else:
      bad += 1
    if cool > 0:
      cool -= 1
    if bad >= patience:
      b = max(b + 1, int(round(b * factor)))
      if upper is not None:
        b = min(b, upper)
      bad, cool = 0, cooldown
    out.append(b)
  return out


def run_epochs(c, epoch_losses, steps_per_epoch=4, seed=0):
  """Feeds per-step losses whose size-weighted mean per epoch is the given epoch loss."""
  rng = np.random.default_rng(seed)
  after_epoch = []
  for target in epoch_losses:
    sizes, losses = [], []
    for i in range(steps_per_epoch):
      sizes.append(c.batch_size)
      noise = rng.normal() * 0.1 if i < steps_per_epoch - 1 else 0.0
      losses.append(target + noise)
    # Fix the last loss so that the weighted mean is exactly `target`.
    weights = np.array(sizes, np.float64)
    losses[-1] = (target * weights.sum() - np.dot(weights[:-1], losses[:-1])) / weights[-1]
    for i, (size, loss) in enumerate(zip(sizes, losses)):
      c.update(0.2, stats={"loss": loss, "batch_size": size, "epoch_end": i == steps_per_epoch - 1})
    after_epoch.append(c.batch_size)
  return after_epoch


@pytest.mark.parametrize(
  "factor, patience, threshold, cooldown, upper",
  [
    (2.0, 1, 0.01, 0, None),
    (2.0, 2, 0.0, 0, 512),
    (1.5, 1, 0.05, 2, 1000),
    (1.01, 3, 0.02, 1, None),  # B + 1 at least
  ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_plateau_matches_reference(factor, patience, threshold, cooldown, upper, seed):
  rng = np.random.default_rng(seed)
  # A loss that falls, then wanders: plateaus at random.
  epoch_losses = (2.0 * np.exp(-np.arange(30) / 5) + 0.3 + rng.uniform(0, 0.05, 30)).tolist()
  c = LossPlateauController(
    16,
    factor=factor,
    patience=patience,
    threshold=threshold,
    cooldown=cooldown,
    batch_size_upper_bound=upper,
  )
  got = run_epochs(c, epoch_losses, seed=seed)
  assert got == reference_plateau(epoch_losses, 16, factor, patience, threshold, cooldown, upper)
  np.testing.assert_allclose(c.epoch_losses, epoch_losses, rtol=1e-12)
  assert got[-1] > 16  # it did grow


def test_plateau_hand_checked():
  c = simigrad_jax.make_controller(
    "loss_plateau", initial_batch_size=32, batch_size_upper_bound=100
  )
  sizes = [
    c.update(0.1, stats={"loss": loss, "batch_size": 32, "epoch_end": True})
    for loss in (1.0, 0.5, 0.499, 0.3, 0.3, 0.3)
  ]
  assert sizes == [32, 32, 64, 64, 100, 100]  # 0.499 is within 1% of 0.5: a plateau
  assert c.last_decision == "clamped" and c.best_loss == 0.3  # a growth held at the cap
  assert c.config["batch_size_lower_bound"] == 32 and c.config["similarity_target"] is None


def test_plateau_nonfinite_loss_is_left_out_and_a_due_growth_waits():
  c = LossPlateauController(10, factor=2.0)
  stats = lambda loss, end: {"loss": loss, "batch_size": 10, "epoch_end": end}
  assert c.update(0.1, stats=stats(1.0, True)) == 10
  c.update(0.1, stats=stats(1.0, False))
  # The epoch ends on a non-finite step: judged on its finite step (1.0: no
  # improvement), growth due but held on this step.
  assert c.update(0.1, stats=stats(math.nan, True)) == 10
  assert c.last_decision == "nonfinite" and c.nonfinite_count == 1
  assert c.epoch_losses == [1.0, 1.0]
  assert c.state_dict()["grow_pending"] is True
  assert c.update(0.1, stats=stats(0.5, False)) == 20 and c.last_decision == "grow"
  assert c.update(math.nan, stats=stats(0.5, False)) == 20  # NaN similarity: held, counted
  assert c.nonfinite_count == 2


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"factor": 1.0}, r"factor must be a number in \(1, inf\), got 1.0"),
    ({"patience": 0}, "patience must be an integer >= 1, got 0"),
    ({"threshold": -0.1}, r"threshold must be a number in \[0, inf\), got -0.1"),
    ({"cooldown": 1.5}, "cooldown must be an integer >= 0, got 1.5"),
    ({"batch_size_upper_bound": 8}, r"initial_batch_size must lie within .*\[1, 8\], got 16"),
  ],
)
def test_plateau_bad_settings_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    LossPlateauController(16, **kwargs)


def test_plateau_needs_stats():
  with pytest.raises(
    ValueError,
    match=r"'loss_plateau' controller needs .*"
    r"\['loss', 'batch_size', 'epoch_end'\]",
  ):
    LossPlateauController(16).update(0.1, stats={"loss": 1.0})


@pytest.mark.parametrize("k", [0, 1, 5, 13, 30])
def test_plateau_round_trip_mid_epoch(k):
  rng = np.random.default_rng(3)
  steps = [
    {"loss": float(loss), "batch_size": int(b), "epoch_end": bool(e)}
    for loss, b, e in zip(
      0.5 + rng.uniform(0, 0.1, 40), rng.integers(10, 20, 40), rng.random(40) < 0.3
    )
  ]
  steps[7]["loss"] = math.nan

  def run(c, ss):
    return [(c.update(0.3, stats=s), c.last_decision) for s in ss]

  kwargs = dict(factor=1.5, patience=2, cooldown=1, batch_size_upper_bound=500)
  whole = LossPlateauController(16, **kwargs)
  expected = run(whole, steps)
  first = LossPlateauController(16, **kwargs)
  run(first, steps[:k])
  resumed = LossPlateauController(16, **kwargs)
  resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
  assert run(resumed, steps[k:]) == expected[k:]
  assert resumed.state_dict() == whole.state_dict()
  assert any(d == "grow" for _, d in expected)


def test_schedule_bounds_narrow_and_clamp():
  c = ScheduleController(32, 512, 4.0, batch_size_lower_bound=8, batch_size_upper_bound=256)
  assert (c.config["batch_size_lower_bound"], c.config["batch_size_upper_bound"]) == (32, 256)
  assert [c.update(0.1, stats={"epochs": e}) for e in (1.0, 2.0, 3.0, 4.0)] == [152, 256, 256, 256]
  assert c.last_decision == "clamped"
  with pytest.raises(ValueError, match=r"initial_batch_size must lie within .*\[1, 16\], got 32"):
    ScheduleController(32, 512, 4.0, batch_size_upper_bound=16)
  with pytest.raises(ValueError, match=r"batch_size_lower_bound must be an integer >= 1, got 0"):
    ScheduleController(32, 512, 4.0, batch_size_lower_bound=0)


def test_plateau_lower_bound_is_the_initial_size():
  c = LossPlateauController(32, batch_size_lower_bound=8, batch_size_upper_bound=256)
  assert (c.config["batch_size_lower_bound"], c.config["batch_size_upper_bound"]) == (32, 256)
  with pytest.raises(ValueError, match=r"initial_batch_size must lie within .*\[64, 256\], got 32"):
    LossPlateauController(32, batch_size_lower_bound=64, batch_size_upper_bound=256)
