"""OneStepLateController: any controller's decisions, a step later (host side and in the Trainer)."""

import doctest
import json
import math

import numpy as np
import pytest

import simigrad_jax
import tiny_run
from simigrad_jax.controllers import OneStepLateController
from simigrad_jax.controllers import one_step_late

BOUNDS = dict(batch_size_lower_bound=16, batch_size_upper_bound=512)


def similarities(steps, seed=0):
  """Similarities around a target of 0.3, with a NaN (a non-finite step) now and then."""
  values = np.random.default_rng(seed).uniform(0.0, 0.6, size=steps)
  values[7::11] = np.nan
  return values.tolist()


def simigrad(**options):
  return simigrad_jax.Controller(64, 0.3, **{**BOUNDS, **options})


def test_the_docstring_example_runs():
  assert doctest.testmod(one_step_late, raise_on_error=True).attempted > 0


@pytest.mark.parametrize(
  "make",
  [
    simigrad,
    lambda: simigrad(ema_decay=0.9),
    lambda: simigrad(warmup_steps=3, smooth_factor=0.5),
    lambda: simigrad_jax.make_controller("gns", initial_batch_size=64, ema_decay=0.5, **BOUNDS),
  ],
  ids=["simigrad", "model_rule", "warmup_smooth", "gns"],
)
def test_sizes_are_the_wrapped_controllers_one_step_later(make):
  """Each step runs at the size the wrapped controller decided a step before: the unwrapped
  controller's sizes, shifted by one step (the first two steps at B_0)."""
  values = similarities(60)
  norms = np.random.default_rng(2).uniform(0.2, 1.0, size=(60, 2))
  # The same measurements for both (the noise-scale rule reads the norms and the size).
  stats = [{"norm_a": 1.0, "norm_b": 1.0, "norm_mean": m, "batch_size": 64 * f} for m, f in norms]
  plain, late = make(), OneStepLateController(make())
  decided = [plain.update(s, stats=stats[i]) for i, s in enumerate(values)]
  ran = [late.update(s, stats=stats[i]) for i, s in enumerate(values)]
  assert ran == [64] + decided[:-1]
  assert late.batch_size == decided[-2] and late.controller.batch_size == decided[-1]
  assert len(set(decided)) > 5  # the sizes move
  assert late.last_decision == plain.last_decision and late.step == plain.step == 60


def test_it_names_the_next_steps_size_exactly():
  """Asked while a step runs, it names the size the next update returns: the data loader places
  that one plan alone."""
  late = OneStepLateController(simigrad())
  for s in similarities(40):
    (named,) = late.likely_batch_sizes(0, 0.0)
    assert late.update(s) == named
  assert isinstance(late, simigrad_jax.controllers.AnticipatesBatchSizes)


def test_state_round_trip_resumes_exactly():
  values = similarities(50, seed=1)
  straight = OneStepLateController(simigrad())
  sizes = [straight.update(s) for s in values]
  first = OneStepLateController(simigrad())
  for s in values[:23]:
    first.update(s)
  resumed = OneStepLateController(simigrad())
  resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
  assert resumed.batch_size == first.batch_size
  assert [resumed.update(s) for s in values[23:]] == sizes[23:]


def test_config_is_the_wrapped_ones_marked():
  late = OneStepLateController(simigrad())
  assert late.config == {**simigrad().config, "one_step_late": True}
  assert late.initial_batch_size == 64


@pytest.mark.parametrize(
  "change, match",
  [
    (
      lambda s: s.update(controller="simigrad"),
      "'simigrad' controller, this one is 'one_step_late'",
    ),
    (lambda s: s.update(batch_size=1024), "batch_size"),
    (lambda s: s.pop("wrapped"), "malformed controller state"),
    (lambda s: s.update(wrapped=[1]), "wrapped must be a dict"),
    (lambda s: s["wrapped"].update(batch_size=4), "batch_size"),
  ],
)
def test_a_bad_state_is_refused_and_changes_nothing(change, match):
  source = OneStepLateController(simigrad())
  for s in (0.1, 0.1, 0.1):
    source.update(s)
  state = json.loads(json.dumps(source.state_dict()))
  change(state)
  late = OneStepLateController(simigrad())
  before = json.dumps(late.state_dict())
  with pytest.raises(ValueError, match=match):
    late.load_state_dict(state)
  assert json.dumps(late.state_dict()) == before


def test_refuses_what_it_cannot_wrap():
  with pytest.raises(ValueError, match="wraps a batch-size controller"):
    OneStepLateController(object())
  with pytest.raises(ValueError, match=r"profile of \[32, 128\] planned or running"):
    OneStepLateController(simigrad(batch_sizes_to_profile=[32, 128]))
  late = OneStepLateController(simigrad())
  late.update(0.1)
  late.controller.start_profile([32])
  with pytest.raises(RuntimeError, match="paired with the size decided after it ran"):
    late.update(0.1)


def test_set_batch_size_sets_the_next_step_and_the_wrapped_one():
  late = OneStepLateController(simigrad())
  late.update(0.1)  # the wrapped controller decided 70
  late.set_batch_size(100)
  assert late.batch_size == late.controller.batch_size == 100
  with pytest.raises(ValueError, match="batch_size"):
    late.set_batch_size(4)


def _late_run(workdir, cache_dir, num_steps):
  """The tiny Trainer run, SimiGrad one step late: its step records."""
  # Without the compile fallback, every plan placed ahead is the one its step takes.
  _, _, records = tiny_run.train_records(
    workdir,
    cache_dir,
    num_steps,
    controller=OneStepLateController(_tiny_simigrad()),
    compile=simigrad_jax.CompileConfig(fallback=False),
  )
  return records


def _tiny_simigrad():
  return simigrad_jax.Controller(20, 0.5, batch_size_lower_bound=8, batch_size_upper_bound=64)


def test_the_trainer_places_one_plan_a_step_ahead_and_resumes_exactly(tmp_path, devices):
  """In the Trainer: every step's rows were placed ahead of it, one plan a step (SimiGrad's
  guess places two), the sizes are the unwrapped rule's a step late, and a resumed run (the
  size decided for its next step in the checkpoint) retraces the straight one."""
  del devices
  with tiny_run.recording_placements() as placed:
    records = _late_run(tmp_path / "late", tmp_path / "cache", 12)
  sizes = [r["batch_size"] for r in records]
  assert len(set(sizes)) > 2  # it adapted
  # One plan a step, each placed ahead (the step after the run's last one included).
  assert [size for size, _ in placed[:-1]] == sizes
  assert all(ahead for _, ahead in placed)
  # The run's similarities, fed to the unwrapped rule, give its sizes a step earlier (the
  # first two steps run at B_0).
  plain = _tiny_simigrad()
  decided = [plain.update(r["similarity"]) for r in records]
  assert sizes == [20, 20] + decided[:-2]
  assert all(math.isfinite(r["similarity"]) for r in records)
  _late_run(tmp_path / "resumed", tmp_path / "cache", 5)
  resumed = _late_run(tmp_path / "resumed", tmp_path / "cache", 12)
  assert [r["batch_size"] for r in resumed] == sizes
  np.testing.assert_allclose(
    [r["loss"] for r in resumed], [r["loss"] for r in records], rtol=0, atol=1e-6
  )
