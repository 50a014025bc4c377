"""The controller interface: the protocol the Trainer checks, the base class, older saved states."""

import json
import logging
import math

import pytest

import simigrad_jax
from simigrad_jax.controllers import BaseController
from simigrad_jax.controllers import BatchSizeController
from simigrad_jax.controllers import base
from simigrad_jax.controllers import interface
from simigrad_jax.controllers import registry
from simigrad_jax.trainer import checks

# ------------------------------------------------------------------ the protocol


class Minimal:
  """Only the protocol's members: a batch size that never moves."""

  batch_size = 32
  initial_batch_size = 32
  config = {"batch_size_lower_bound": 32, "batch_size_upper_bound": 32, "similarity_target": None}
  last_decision = None

  def update(self, similarity, stats=None):
    del similarity, stats
    return self.batch_size

  def set_batch_size(self, batch_size):
    self.batch_size = batch_size

  def state_dict(self):
    return {}

  def load_state_dict(self, state):
    del state


def test_the_protocol_is_what_the_trainer_reads():
  assert interface.CONTROLLER_MEMBERS == (
    "batch_size",
    "initial_batch_size",
    "config",
    "last_decision",
    "update",
    "set_batch_size",
    "state_dict",
    "load_state_dict",
  )
  assert interface.CONTROLLER_METHODS == (
    "update",
    "set_batch_size",
    "state_dict",
    "load_state_dict",
  )
  assert checks._CONTROLLER_ATTRIBUTES == interface.CONTROLLER_MEMBERS
  for name in interface.CONTROLLER_MEMBERS:  # each member is documented
    assert vars(BatchSizeController)[name].__doc__, name


def test_a_class_with_only_the_protocols_members_passes_the_trainers_check():
  controller = Minimal()
  assert isinstance(controller, BatchSizeController)
  checks.check_controller(controller)
  assert checks._profile_sizes(controller) == []
  assert checks.check_bounds(controller, 100, "local") == (32, 32)


@pytest.mark.parametrize("member", interface.CONTROLLER_MEMBERS)
def test_a_missing_member_is_named(member):
  lacking = type("Lacking", (), {k: v for k, v in vars(Minimal).items() if k != member})()
  assert not isinstance(lacking, BatchSizeController)
  with pytest.raises(
    ValueError, match=rf"lacks \['{member}'\]; a controller needs \['batch_size', "
  ):
    checks.check_controller(lacking)


def test_a_method_that_is_not_callable_is_named():
  controller = Minimal()
  controller.update = 3
  with pytest.raises(ValueError, match=r"lacks \['update'\].*the methods callable"):
    checks.check_controller(controller)


@pytest.mark.parametrize(
  "bad, match",
  [
    ("simigrad", "controller must be a controller object, got 'simigrad'"),
    ({"initial_batch_size": 8}, "controller must be a controller object"),
    (object(), r"lacks \['batch_size', 'initial_batch_size', 'config'"),
  ],
)
def test_what_is_not_a_controller_is_refused(bad, match):
  with pytest.raises(ValueError, match=match):
    checks.check_controller(bad)


def test_a_config_without_the_required_keys_is_refused():
  controller = Minimal()
  controller.config = {"batch_size_lower_bound": 32}
  with pytest.raises(
    ValueError,
    match=r"controller.config must be a dict with the keys "
    r"\['batch_size_lower_bound', 'batch_size_upper_bound', 'similarity_target'\]",
  ):
    checks.check_controller(controller)


@pytest.mark.parametrize("name", sorted(registry.controller_names()))
def test_every_registered_controller_derives_from_the_base(name):
  options = {"similarity_target": 0.1} if name == "simigrad" else {}
  options |= {"final_batch_size": 64, "ramp_epochs": 1.0} if name in ("linear", "geometric") else {}
  options |= {"final_batch_size": 8, "ramp_epochs": 1.0} if name == "decreasing" else {}
  options |= {
    "step_schedule": {"thresholds": "0:16,1k:32"},
    "linear_ramp": {"final_batch_size": 64, "increment": 16, "ramp": "1k"},
    "doubling_warmup": {"doubling_points": "1k"},
    "seesaw": {"halving_points": "1k"},
  }.get(name, {})
  c = simigrad_jax.make_controller(name, initial_batch_size=16, **options)
  assert isinstance(c, BaseController) and isinstance(c, BatchSizeController)
  checks.check_controller(c)
  assert c.state_dict()["version"] == base.STATE_VERSION == 1
  assert c.state_dict()["controller"] == c.config["controller"]


# ------------------------------------------------------ a controller on the base


class Halving(BaseController):
  """Only decide(): double below a similarity of 0.2, halve above 0.6, else keep."""

  def decide(self):
    s, b = self.last_similarity, self.batch_size
    return 2 * b if s < 0.2 else b // 2 if s > 0.6 else b


class MeanSimilarity(BaseController):
  """The documented methods with state: grow while the running mean similarity is below a target."""

  KIND = "mean_similarity"
  REQUIRED_STATS = ("loss",)

  def __init__(self, initial_batch_size, target=0.3, **options):
    super().__init__(initial_batch_size, **options)
    self.target = target
    self.total, self.count = 0.0, 0

  def observe(self, similarity, stats, finite):
    if not (finite and math.isfinite(stats["loss"])):
      return False
    self.total += similarity
    self.count += 1
    return True

  def decide(self):
    return self.batch_size + 8 if self.total / self.count < self.target else self.batch_size - 8

  def settings(self):
    return {"target": self.target}

  def extra_state(self):
    return {"total": self.total, "count": self.count}

  def parse_extra_state(self, state):
    return {
      "total": base.check_finite_float("total", state["total"]),
      "count": simigrad_jax.validation.check_int("count", state["count"], 0),
    }


def test_a_controller_with_only_decide_gets_bounds_counters_and_decisions():
  c = Halving(16, batch_size_lower_bound=4, batch_size_upper_bound=48, warmup_steps=1)
  sims = [0.0, 0.1, 0.1, 0.1, 0.4, 0.9, math.nan, 0.9, 0.9, 0.9]
  got = [(c.update(s), c.last_decision) for s in sims]
  assert got == [
    (16, "warmup"),
    (32, "grow"),
    (48, "clamped"),
    (48, "clamped"),
    (48, "hold"),
    (24, "shrink"),
    (24, "nonfinite"),
    (12, "shrink"),
    (6, "shrink"),
    (4, "clamped"),
  ]
  assert c.step == 10 and c.nonfinite_count == 1 and c.last_similarity == 0.9
  assert c.update(0.0, stats={"grads_finite": False}) == 4 and c.last_decision == "nonfinite"
  assert c.config == {
    "controller": "Halving",
    "initial_batch_size": 16,
    "similarity_target": None,
    "batch_size_lower_bound": 4,
    "batch_size_upper_bound": 48,
  }
  with pytest.raises(ValueError, match=r"initial_batch_size must lie within .*\[4, 48\], got 64"):
    Halving(64, batch_size_lower_bound=4, batch_size_upper_bound=48)


def test_a_controller_on_the_base_logs_its_decisions(caplog):
  c = Halving(16, verbose=True)
  with caplog.at_level(logging.INFO, logger="simigrad_jax"):
    c.update(0.1)
  assert (
    caplog.records[0].getMessage() == "Halving step 1: grow, batch size 16 -> 32 (similarity 0.1)"
  )


def test_a_decide_that_returns_no_integer_is_refused():
  class Fractional(BaseController):
    def decide(self):
      return self.batch_size * 1.5

  with pytest.raises(
    TypeError,
    match=r"Fractional.decide\(\) must return an integer batch size, "
    "got 24.0",
  ):
    Fractional(16).update(0.1)


def test_the_base_without_decide_says_what_to_write():
  with pytest.raises(NotImplementedError, match=r"BaseController must implement decide\(\)"):
    BaseController(16).update(0.1)


def drive(c, sims):
  return [(c.update(s, stats={"loss": 1.0}), c.last_decision) for s in sims]


SIMS = [0.1, 0.2, math.nan, 0.5, 0.9, 0.6, 0.1, 0.2, 0.0, 0.7, 0.8, 0.9]


@pytest.mark.parametrize("k", [0, 3, 7, 12])
def test_a_controller_with_state_resumes_exactly(k):
  options = dict(target=0.3, batch_size_lower_bound=8, batch_size_upper_bound=64)
  whole = MeanSimilarity(32, **options)
  expected = drive(whole, SIMS)
  assert {d for _, d in expected} >= {"grow", "shrink", "nonfinite"}
  first = MeanSimilarity(32, **options)
  drive(first, SIMS[:k])
  resumed = MeanSimilarity(32, **options)
  resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
  assert drive(resumed, SIMS[k:]) == expected[k:]
  assert resumed.state_dict() == whole.state_dict()


def test_a_refused_state_changes_nothing():
  c = MeanSimilarity(32, target=0.3)
  drive(c, SIMS[:4])
  state = json.loads(json.dumps(c.state_dict()))
  other = MeanSimilarity(32, target=0.5)
  with pytest.raises(ValueError, match=r"target \(saved 0.3, here 0.5\)"):
    other.load_state_dict(state)
  state["total"] = math.nan
  same = MeanSimilarity(32, target=0.3)
  with pytest.raises(ValueError, match="total must be a finite number"):
    same.load_state_dict(state)
  state["total"] = 0.5
  del state["count"]
  with pytest.raises(ValueError, match="malformed controller state: KeyError"):
    same.load_state_dict(state)
  assert same.step == 0 and same.count == 0 and same.total == 0.0
  with pytest.raises(
    ValueError, match="the state is of a 'mean_similarity' controller, this one is 'Halving'"
  ):
    Halving(32).load_state_dict(c.state_dict())
  with pytest.raises(
    ValueError,
    match=r"controller needs update\(similarity, stats=...\) with the "
    r"keys \['loss'\]",
  ):
    c.update(0.1)


def test_a_new_controller_registers_by_name(monkeypatch):
  monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
  simigrad_jax.register_controller("halving", Halving)
  assert simigrad_jax.controllers.controller_options("halving") == (
    "batch_size_lower_bound",
    "batch_size_upper_bound",
    "initial_batch_size",
    "verbose",
    "warmup_steps",
  )
  c = simigrad_jax.make_controller("halving", initial_batch_size=8, batch_size_upper_bound=64)
  assert [c.update(s) for s in (0.0, 0.0, 0.9)] == [16, 32, 16]


# -------------------------------------------- states saved before the shared base

# Controller(64, 0.3, batch_size_upper_bound=512, ema_decay=0.9, warmup_steps=1,
# batch_sizes_to_profile=[32, 128], profile_steps_per_size=2) after 5 updates, mid-profile, as
# the code before the shared base saved it (no "controller" key); it then went 128, 64, 70.
SIMIGRAD_STATE_V1 = json.loads(
  '{"version": 1, "config": {"initial_batch_size": 64, "similarity_target": 0.3, '
  '"batch_size_lower_bound": null, "batch_size_upper_bound": 512, "enable_adjust": true, '
  '"smooth_factor": null, "dead_band": 0.0, "warmup_steps": 1, "ema_decay": 0.9}, '
  '"batch_size": 128, "step": 5, "nonfinite_count": 1, "last_decision": "profile", '
  '"profile_plan": {"sizes": [32, 128], "steps_per_size": 2, "position": 1, "count": 0, '
  '"return_to": 64}, "profile": [{"batch_size": 32, "similarity": 0.25, "step": 3}, '
  '{"batch_size": 32, "similarity": 0.4, "step": 5}], "similarity_model": '
  '{"ema_similarity": 0.08598999999999998, "ema_noise": 12.426239999999998, "count": 4}}'
)
# make_controller("gns", initial_batch_size=16, multiple=0.5, ema_decay=0.5,
# batch_size_upper_bound=64) after 3 updates with GNS_STATS; it then went 8, 8, 8.
GNS_STATE_V1 = json.loads(
  '{"version": 1, "controller": "gns", "config": {"controller": "gns", "initial_batch_size": 16, '
  '"similarity_target": null, "batch_size_lower_bound": null, "batch_size_upper_bound": 64, '
  '"multiple": 0.5, "ema_decay": 0.5, "max_change": 2.0, "warmup_steps": 0}, "batch_size": 8, '
  '"step": 3, "nonfinite_count": 0, "last_decision": "hold", "ema_trace": 5.739999999999998, '
  '"ema_g2": 0.3500000000000001, "ema_count": 3}'
)
GNS_STATS = {"norm_a": 1.0, "norm_b": 1.2, "norm_mean": 0.9, "batch_size": 16}


def test_states_saved_before_the_shared_base_still_load():
  c = simigrad_jax.Controller(64, 0.3, batch_size_upper_bound=512, ema_decay=0.9, warmup_steps=1)
  c.load_state_dict(SIMIGRAD_STATE_V1)
  assert c.profiling and c.batch_size == 128 and c.nonfinite_count == 1
  assert [c.update(s) for s in (0.5, 0.1, 0.1)] == [128, 64, 70]
  assert c.state_dict()["controller"] == "simigrad"
  g = simigrad_jax.make_controller(
    "gns", initial_batch_size=16, multiple=0.5, ema_decay=0.5, batch_size_upper_bound=64
  )
  g.load_state_dict(GNS_STATE_V1)
  assert [g.update(0.1, stats=GNS_STATS) for _ in range(3)] == [8, 8, 8]
  with pytest.raises(ValueError, match=r"smooth_factor \(saved None, here 0.5\)"):
    simigrad_jax.Controller(
      64, 0.3, batch_size_upper_bound=512, ema_decay=0.9, warmup_steps=1, smooth_factor=0.5
    ).load_state_dict(SIMIGRAD_STATE_V1)


def test_docstring_examples():
  import doctest  # pylint: disable=import-outside-toplevel

  from simigrad_jax.controllers import profiling  # pylint: disable=import-outside-toplevel
  from simigrad_jax.controllers import simigrad  # pylint: disable=import-outside-toplevel

  for module in (base, profiling, registry, simigrad):
    result = doctest.testmod(module)
    assert result.attempted and not result.failed, module.__name__


# ------------------------------------------------------------ the sizes decided next


def _schedules():
  return [
    simigrad_jax.ramps.StepScheduleController("0:8,100:16,250:32"),
    simigrad_jax.ramps.LinearRampController(8, 40, 8, ramp=400),
    simigrad_jax.ramps.DoublingWarmupController(8, "120,300"),
    simigrad_jax.ramps.SeesawController(8, halving_points="160,480"),
    simigrad_jax.ramps.ScheduleController(8, 64, 2.0, shape="geometric"),
  ]


@pytest.mark.parametrize("index", range(5))
def test_a_schedule_names_the_size_it_then_decides(index):
  """Asked before a step with the examples served after it, a schedule says its next size."""
  controller = _schedules()[index]
  num_examples = 200
  seen = 0
  for _ in range(40):
    seen += controller.batch_size
    epochs = seen / num_examples
    (said,) = controller.likely_batch_sizes(seen, epochs)
    decided = controller.update(0.3, stats={"examples_seen": seen, "epochs": epochs})
    assert said == decided, (type(controller).__name__, seen)
  assert controller.batch_size > 8  # the schedule moved in those steps


def test_simigrad_names_its_size_only_while_it_holds_it():
  held = simigrad_jax.Controller(32, 0.5, enable_adjust=False, batch_size_upper_bound=64)
  assert held.likely_batch_sizes(100, 0.5) == [32]
  adapting = simigrad_jax.Controller(32, 0.5, batch_size_upper_bound=64)
  assert adapting.likely_batch_sizes(100, 0.5) is None  # the Trainer's guess: grow or shrink
  profiling = simigrad_jax.Controller(
    32, 0.5, enable_adjust=False, batch_size_upper_bound=64, batch_sizes_to_profile=[16]
  )
  assert profiling.likely_batch_sizes(100, 0.5) is None


def test_a_controller_on_the_base_leaves_the_guess_to_the_trainer():
  class Doubling(BaseController):
    def decide(self):
      return 2 * self.batch_size

  assert Doubling(8, batch_size_upper_bound=64).likely_batch_sizes(8, 0.1) is None
  assert isinstance(Doubling(8, batch_size_upper_bound=64), interface.AnticipatesBatchSizes)
  assert not isinstance(Minimal(), interface.AnticipatesBatchSizes)


def test_the_profiling_wrapper_passes_the_wrapped_controllers_sizes_on_outside_a_profile():
  wrapped = simigrad_jax.ramps.StepScheduleController("0:8,100:16")
  profiling = simigrad_jax.controllers.ProfilingController(wrapped, [12])
  assert profiling.likely_batch_sizes(0, 0.0) is None  # the profile chooses the sizes
  seen = 0
  while profiling.profile_batch_sizes:
    seen += profiling.batch_size
    profiling.update(0.3, stats={"examples_seen": seen, "epochs": 0.0})
  assert profiling.likely_batch_sizes(120, 0.0) == [16]
