"""The controller interface: the protocol the Trainer checks, the base class, older saved states."""

import json
import logging
import math

import jax.numpy as jnp
import numpy as np
import pytest

import simigrad_jax
from simigrad_jax import registry
from simigrad_jax.controllers import BaseController
from simigrad_jax.controllers import BatchSizeController
from simigrad_jax.controllers import base
from simigrad_jax.controllers import interface
from simigrad_jax.controllers import simigrad
from simigrad_jax.controllers import state as controller_state
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


def _options(name):
  """Options that make each registered controller (besides initial_batch_size=16)."""
  options = {"similarity_target": 0.1} if name == "simigrad" else {}
  options |= {"final_batch_size": 64, "ramp_epochs": 1.0} if name in ("linear", "geometric") else {}
  options |= {"final_batch_size": 8, "ramp_epochs": 1.0} if name == "decreasing" else {}
  options |= {
    "step_schedule": {"thresholds": "0:16,500:32"},
    "linear_ramp": {"final_batch_size": 64, "increment": 16, "ramp": "500"},
    "doubling_warmup": {"doubling_points": "500"},
    "seesaw": {"halving_points": "500"},
  }.get(name, {})
  if name in ("simigrad", "gns", "loss_plateau", "allowance"):
    options |= {"batch_size_lower_bound": 2, "batch_size_upper_bound": 256}
  return options


@pytest.mark.parametrize("name", sorted(registry.controller_names()))
def test_every_registered_controller_derives_from_the_base(name):
  c = simigrad_jax.make_controller(name, initial_batch_size=16, **_options(name))
  assert isinstance(c, BaseController) and isinstance(c, BatchSizeController)
  checks.check_controller(c)
  assert c.state_dict()["version"] == controller_state.STATE_VERSION == 1
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
      "total": controller_state.check_finite_float("total", state["total"]),
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


STATS = {
  "norm_a": 1.0,
  "norm_b": 1.1,
  "norm_mean": 0.8,
  "batch_size": 16,
  "examples_seen": 100,
  "epochs": 0.1,
  "loss": 2.0,
  "epoch_end": True,
  "grads_finite": True,
}


def _step_stats(step: int) -> dict:
  """A run's stats at ``step``: the position moves, the loss and norms vary, one step is bad (the
  numbers exact in float32, which JAX's arrays hold)."""
  return {
    **STATS,
    "examples_seen": 100 * step,
    "epochs": 0.125 * step,
    "loss": 2.0 - 0.0625 * step,
    "norm_b": 1.125,
    "norm_mean": 0.75 + 0.03125 * (step % 3),
    "epoch_end": step % 4 == 3,
    "grads_finite": step != 5,
  }


def _as_numpy_and_jax(stats: dict) -> dict:
  """The same stats as NumPy scalars, 0-d NumPy arrays and 0-d JAX arrays, by turns."""
  kinds = (np.asarray, jnp.asarray, lambda v: np.asarray(v)[()])
  return {k: kinds[i % 3](v) for i, (k, v) in enumerate(sorted(stats.items()))}


@pytest.mark.parametrize("name", sorted(registry.controller_names()))
def test_stats_of_numpy_and_jax_values_decide_as_pythons_do(name):
  # A jnp.bool_(False) "grads_finite" moved the batch on a non-finite step, and a 0-d "epochs"
  # counted a good step as non-finite: every rule now reads them as Python's values.
  python, arrays = (
    simigrad_jax.make_controller(name, initial_batch_size=16, **_options(name)) for _ in range(2)
  )
  for step in range(8):
    stats = _step_stats(step)
    similarity = 0.05 if step % 2 else 0.4
    assert python.update(similarity, stats) == arrays.update(similarity, _as_numpy_and_jax(stats))
    assert python.last_decision == arrays.last_decision
  assert python.state_dict() == arrays.state_dict()
  assert python.nonfinite_count == arrays.nonfinite_count >= 1  # step 5's


@pytest.mark.parametrize(
  "key, bad, match",
  [
    ("grads_finite", 0, r"stats\['grads_finite'\] must be a bool .*got 0"),
    ("grads_finite", np.float32(1.0), r"stats\['grads_finite'\] must be a bool"),
    ("epoch_end", "yes", r"stats\['epoch_end'\] must be a bool"),
    ("epochs", True, r"stats\['epochs'\] must be a real number .*got True"),
    ("loss", jnp.ones(2), r"stats\['loss'\] must be a real number"),
    ("examples_seen", "100", r"stats\['examples_seen'\] must be a real number"),
    ("batch_size", -8, r"stats\['batch_size'\] must be a count \(>= 0\), got -8"),
    ("epochs", np.float32(-1.0), r"stats\['epochs'\] must be a count \(>= 0\)"),
  ],
)
def test_stats_no_step_gives_are_refused_and_change_nothing(key, bad, match):
  for name in sorted(registry.controller_names()):
    c = simigrad_jax.make_controller(name, initial_batch_size=16, **_options(name))
    c.update(0.2, _step_stats(1))
    before = c.state_dict()
    with pytest.raises(ValueError, match=match):
      c.update(0.2, {**_step_stats(2), key: bad})
    assert c.state_dict() == before, name


@pytest.mark.parametrize(
  "name, options, section",
  [
    ("simigrad", {"similarity_target": 0.3}, "config"),
    ("simigrad", {"similarity_target": 0.3, "batch_sizes_to_profile": (16, 32)}, "profile_plan"),
    ("fixed", {"batch_sizes_to_profile": (16, 32)}, "profile"),
    ("loss_plateau", {}, "epoch_losses"),
    ("allowance", {}, "similarity_model"),
    ("gns", {}, "config"),
  ],
)
@pytest.mark.parametrize("bad", ["x", 3, [1]])
def test_a_malformed_section_of_a_saved_state_is_named_and_changes_nothing(
  name, options, section, bad
):
  # These once raised an AttributeError ('config') or a TypeError that named no key.
  controller = simigrad_jax.make_controller(name, initial_batch_size=16, **options)
  for similarity in (0.2, 0.4, 0.3):
    controller.update(similarity, stats=STATS)
  state = json.loads(json.dumps(controller.state_dict()))
  if bad == [1] and section in ("profile", "epoch_losses"):  # a list, of the wrong entries
    bad = ["x"]
  fresh = simigrad_jax.make_controller(name, initial_batch_size=16, **options)
  before = fresh.state_dict()
  with pytest.raises(ValueError, match=rf"{section}(\[\d*\])? must be "):
    fresh.load_state_dict({**state, section: bad})
  assert fresh.state_dict() == before


def test_a_new_controller_registers_by_name(monkeypatch):
  monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
  simigrad_jax.register_controller("halving", Halving)
  assert simigrad_jax.registry.controller_options("halving") == (
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
  fresh = g.state_dict()
  g.load_state_dict(GNS_STATE_V1)
  assert g.state_dict() == GNS_STATE_V1 != fresh  # its averages and size, not a fresh start's
  assert [g.update(0.1, stats=GNS_STATS) for _ in range(3)] == [8, 8, 8]
  with pytest.raises(ValueError, match=r"smooth_factor \(saved None, here 0.5\)"):
    simigrad_jax.Controller(
      64, 0.3, batch_size_upper_bound=512, ema_decay=0.9, warmup_steps=1, smooth_factor=0.5
    ).load_state_dict(SIMIGRAD_STATE_V1)


def test_docstring_examples():
  import doctest  # pylint: disable=import-outside-toplevel

  from simigrad_jax.controllers import profiling  # pylint: disable=import-outside-toplevel

  for module in (base, interface, profiling, registry, simigrad, controller_state):
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


def _stats(controller, seen, num_examples, similarity):
  """One step's measurements as the Trainer passes them (the norms noisier at low similarity)."""
  b = controller.batch_size
  return {
    "loss": 1.0 + 0.5 * math.cos(seen / 97),  # plateaus now and then
    "norm_a": 1.0,
    "norm_b": 1.0 + (1.0 - similarity),
    "norm_mean": 0.5 + similarity,
    "batch_size": b,
    "examples_seen": seen,
    "epochs": seen / num_examples,
    "epoch_end": (seen - b) // num_examples < seen // num_examples,
    "grads_finite": True,
  }


@pytest.mark.parametrize("name", sorted(registry.controller_names()))
def test_the_accessors_read_every_registered_controller(name):
  c = simigrad_jax.make_controller(name, initial_batch_size=16, **_options(name))
  config = c.config
  assert interface.batch_size_bounds(c) == (
    config["batch_size_lower_bound"],
    config["batch_size_upper_bound"],
  )
  assert interface.adapts(c) is (name != "fixed")
  assert interface.similarity_target(c) == {"simigrad": 0.1, "fixed": 0.0}.get(name)
  # The sizes named before each step hold the size then decided (the noise scale's names the
  # size its averages decide as they stand: the likeliest, not sure).
  num_examples, seen, sizes = 300, 0, set()
  for step in range(60):
    similarity = (0.02, 0.4, 0.08, 0.3)[step % 4]
    seen += c.batch_size
    lower, upper = interface.batch_size_bounds(c)
    likely = interface.likely_batch_sizes(c, seen, seen / num_examples)
    assert likely and len(set(likely)) == len(likely)
    assert all(type(b) is int and (lower or 1) <= b <= (upper or math.inf) for b in likely)
    decided = c.update(similarity, stats=_stats(c, seen, num_examples, similarity))
    if name not in ("gns", "allowance"):  # both name the likeliest size, not every one
      assert decided in likely, (name, step, likely, decided)
    sizes.add(decided)
  assert len(sizes) > 1 or name == "fixed"  # the size moved


def test_the_accessors_read_a_controller_with_only_the_protocols_members():
  controller = Minimal()
  assert interface.likely_batch_sizes(controller, 100, 0.5) == (32,)
  assert interface.batch_size_bounds(controller) == (32, 32)
  assert interface.adapts(controller) is False  # equal bounds: the size never moves
  assert interface.similarity_target(controller) is None
  controller.config = {**Minimal.config, "batch_size_upper_bound": None, "similarity_target": 0.2}
  assert interface.batch_size_bounds(controller) == (32, None)
  assert interface.adapts(controller) is True
  assert interface.similarity_target(controller) == 0.2
  controller.config = {**controller.config, "enable_adjust": False}
  assert interface.adapts(controller) is False
  controller.likely_batch_sizes = lambda seen, epochs: (40, 32, 40)  # its own, deduplicated
  assert interface.likely_batch_sizes(controller, 100, 0.5) == (40, 32)
  controller.likely_batch_sizes = lambda seen, epochs: None  # no guess: the size it has
  assert interface.likely_batch_sizes(controller, 100, 0.5) == (32,)


def test_the_accessors_read_a_controller_on_the_base():
  c = Halving(16, batch_size_lower_bound=4, batch_size_upper_bound=48)
  assert interface.likely_batch_sizes(c, 16, 0.1) == (16,)  # the base's default: the size it has
  assert interface.batch_size_bounds(c) == (4, 48)
  assert interface.adapts(c) is True
  assert interface.similarity_target(c) is None
  assert interface.batch_size_bounds(Halving(16)) == (None, None)
  assert (
    interface.adapts(Halving(16, batch_size_lower_bound=16, batch_size_upper_bound=16)) is False
  )


@pytest.mark.parametrize(
  "said, match",
  [
    ([16, 200], r"returned \[16, 200\]: .* within the controller's bounds \[8, 64\]"),
    ([4], r"returned \[4\]"),
    ([32.0], r"returned \[32.0\]"),
    (["32"], r"returned \['32'\]"),
    ([True], r"returned \[True\]"),
    ([], r"returned \[\]: it must return None or a non-empty sequence"),
    ("32", r"returned '32'"),
    (32, r"returned 32"),
  ],
)
def test_a_bad_likely_batch_sizes_is_refused_naming_the_class_and_value(said, match):
  class Naming(BaseController):
    def decide(self):
      return self.batch_size

    def likely_batch_sizes(self, examples_seen, epochs):
      return said

  with pytest.raises(ValueError, match=r"Naming.likely_batch_sizes\(100, 0.5\) " + match):
    interface.likely_batch_sizes(
      Naming(16, batch_size_lower_bound=8, batch_size_upper_bound=64), 100, 0.5
    )


@pytest.mark.parametrize("bounds", [(8, True), (8, -3), (8, math.nan), (64, 8), (8,), 8])
def test_bad_bounds_are_refused_before_the_controller_is_asked(bounds):
  controller = simigrad_jax.Controller(16, 0.3)
  with pytest.raises(ValueError, match=r"^bounds must be a pair \(lower, upper\) of None"):
    interface.likely_batch_sizes(controller, 100, 0.5, bounds=bounds)


def test_numpy_integer_bounds_are_taken_as_pythons():
  controller = simigrad_jax.Controller(16, 0.3)
  got = interface.likely_batch_sizes(controller, 6400, 0.1, bounds=(np.int64(8), np.int64(17)))
  assert got == interface.likely_batch_sizes(controller, 6400, 0.1, bounds=(8, 17))


@pytest.mark.parametrize(
  "config, accessor, match",
  [
    ({"similarity_target": None}, interface.batch_size_bounds, r"config lacks 'batch_size_lower"),
    (
      {"batch_size_lower_bound": 0, "batch_size_upper_bound": None},
      interface.batch_size_bounds,
      r"config\['batch_size_lower_bound'\] must be None \(unbounded\) or an int >= 1, got 0",
    ),
    ({"similarity_target": "0.1"}, interface.similarity_target, r"finite number, got '0.1'"),
    ({}, interface.similarity_target, r"Minimal.config lacks 'similarity_target'"),
    ([1, 2], interface.adapts, r"Minimal.config must be a dict .* got \[1, 2\]"),
  ],
)
def test_a_config_the_accessors_cannot_read_is_refused(config, accessor, match):
  controller = Minimal()
  controller.config = config
  with pytest.raises(ValueError, match=match):
    accessor(controller)


# The reference rule's likely sizes are what it then decides for a similarity below and above.
@pytest.mark.parametrize(
  "b, options, expected",
  [
    (100, {}, (110, 90)),
    (5, {}, (6, 4)),
    (1, {}, (2, 1)),  # no shrink below 1
    (100, {"batch_size_upper_bound": 105}, (105, 90)),
    (100, {"batch_size_lower_bound": 95}, (110, 95)),
    (64, {"batch_size_upper_bound": 64}, (64, 57)),
    (100, {"smooth_factor": 0.5}, (105, 95)),
    (10, {"smooth_factor": 0.5}, (11, 9)),
    (100, {"dead_band": 0.05}, (110, 90, 100)),
  ],
)
def test_simigrads_likely_sizes_are_what_it_decides_below_and_above_its_target(
  b, options, expected
):
  likely = interface.likely_batch_sizes(simigrad_jax.Controller(b, 0.3, **options), 6400, 1.0)
  assert likely == expected
  below = simigrad_jax.Controller(b, 0.3, **options).update(0.1)
  above = simigrad_jax.Controller(b, 0.3, **options).update(0.5)
  assert likely[:2] == (below, above)
  if options.get("dead_band"):  # a similarity within the dead band holds
    assert simigrad_jax.Controller(b, 0.3, **options).update(0.32) == likely[2]


def test_simigrad_names_its_size_while_it_holds_it():
  held = simigrad_jax.Controller(32, 0.5, enable_adjust=False, batch_size_upper_bound=64)
  assert held.likely_batch_sizes(100, 0.5) == [32]
  warming = simigrad_jax.Controller(32, 0.5, batch_size_upper_bound=64, warmup_steps=2)
  assert warming.likely_batch_sizes(100, 0.5) == [32]
  warming.update(0.1)
  assert warming.likely_batch_sizes(100, 0.5) == [32]
  warming.update(0.1)  # the warm-up is over: the next update moves
  assert warming.likely_batch_sizes(100, 0.5) == [35, 28]


def test_simigrad_names_the_profiles_next_size():
  c = simigrad_jax.Controller(
    32, 0.5, batch_size_upper_bound=64, warmup_steps=1, batch_sizes_to_profile=[16, 48]
  )
  decided = []
  for s in (0.2, 0.2, math.nan, 0.2, 0.2, 0.2):
    likely = c.likely_batch_sizes(0, 0.0)
    decided.append(c.update(s))
    assert decided[-1] == likely[0 if math.isfinite(s) else -1], (likely, decided)
  assert decided == [32, 16, 16, 48, 32, 35]  # warm-up, profile (a NaN stays), back, the rule


def test_the_model_rules_likely_sizes_lead_with_the_similarity_it_expects():
  def controller():
    c = simigrad_jax.Controller(64, 0.3, batch_size_upper_bound=4096, ema_decay=0.9)
    for _ in range(20):  # near B* = 150: the similarity of a noise scale of 75
      c.update(c.batch_size / (c.batch_size + 150))
    return c

  c = controller()
  likely = interface.likely_batch_sizes(c, 0, 0.0)
  b = c.batch_size
  assert likely[1:] == (
    simigrad.reference_move(b, True),
    simigrad.reference_move(b, False),
  )
  # A step that measures what the model expects keeps B*: the likeliest size.
  assert controller().update(c.model_similarity) == likely[0]
  # Whatever it measures, the size stays within the reference's grow and shrink.
  for s in (-0.5, 0.0, 0.05, 0.2, 0.35, 0.6, 0.99):
    assert likely[2] <= controller().update(s) <= likely[1], s
  # Before any sample, the reference's grow and shrink.
  fresh = simigrad_jax.Controller(64, 0.3, batch_size_upper_bound=4096, ema_decay=0.9)
  assert interface.likely_batch_sizes(fresh, 0, 0.0) == (70, 57)


def test_the_noise_scale_controllers_likely_sizes_lead_with_what_its_averages_expect():
  def controller():
    c = simigrad_jax.make_controller(
      "gns", initial_batch_size=64, multiple=2.0, batch_size_upper_bound=1024
    )
    for norm_b in (1.2, 1.5, 1.3):
      stats = {"norm_a": 1.0, "norm_b": norm_b, "norm_mean": 0.9, "batch_size": c.batch_size}
      c.update(0.2, stats=stats)
    return c

  c = controller()
  likely = interface.likely_batch_sizes(c, 0, 0.0)
  b = c.batch_size
  # A step whose estimates are the averages keeps the noise scale: the likeliest size.
  g2, trace = c.g2_estimate, c.trace_estimate
  small, big = g2 + 2 * trace / b, g2 + trace / b
  expected = {"norm_a": small**0.5, "norm_b": small**0.5, "norm_mean": big**0.5, "batch_size": b}
  assert likely == (controller().update(0.2, stats=expected),)
  assert b == 512 and likely == (848,)  # it moves, less than a step of max_change=2
  # Before the first estimate, the farthest one step goes (max_change=2); none in the warm-up.
  fresh = simigrad_jax.make_controller("gns", initial_batch_size=64, batch_size_upper_bound=1024)
  assert interface.likely_batch_sizes(fresh, 0, 0.0) == (128, 32)
  warming = simigrad_jax.make_controller("gns", initial_batch_size=64, warmup_steps=1)
  assert interface.likely_batch_sizes(warming, 0, 0.0) == (64,)


def test_the_loss_plateau_names_its_growth_where_an_epoch_may_end_a_plateau():
  c = simigrad_jax.make_controller(
    "loss_plateau", initial_batch_size=16, patience=2, batch_size_upper_bound=128
  )

  def step(loss, epoch_end, finite=True):
    stats = {"loss": loss, "batch_size": c.batch_size, "epoch_end": epoch_end}
    return c.update(0.1 if finite else math.nan, stats=stats)

  assert c.likely_batch_sizes(0, 0.0) == [16]  # two bad epochs needed: none yet
  step(1.0, True)  # the first epoch: the best so far
  assert c.likely_batch_sizes(0, 0.0) == [16]
  step(1.0, True)  # one bad epoch: the next may make two
  assert c.likely_batch_sizes(0, 0.0) == [16, 32]
  assert step(1.0, False) == 16  # within the epoch: no judgement yet
  assert step(1.0, True, finite=False) == 16  # two, on a non-finite step: the growth waits
  assert c.likely_batch_sizes(0, 0.0) == [32, 16]
  assert step(1.0, False) == 32


def test_a_controller_on_the_base_names_the_size_it_has():
  class Doubling(BaseController):
    def decide(self):
      return 2 * self.batch_size

  assert Doubling(8, batch_size_upper_bound=64).likely_batch_sizes(8, 0.1) == [8]
  assert isinstance(Doubling(8, batch_size_upper_bound=64), interface.AnticipatesBatchSizes)
  assert not isinstance(Minimal(), interface.AnticipatesBatchSizes)


def test_the_profiling_wrapper_passes_the_wrapped_controllers_sizes_on_outside_a_profile():
  wrapped = simigrad_jax.ramps.StepScheduleController("0:8,100:16")
  profiling = simigrad_jax.controllers.ProfilingController(wrapped, [12, 10], steps_per_size=2)
  seen, named = 0, []
  while profiling.profile_batch_sizes:
    named.append(profiling.likely_batch_sizes(0, 0.0))
    seen += profiling.batch_size
    profiling.update(0.3, stats={"examples_seen": seen, "epochs": 0.0})
  # The profile's next size first, then the size it is at (a non-finite step stays there).
  assert named == [[12], [10, 12], [10], [8, 10]]
  assert profiling.likely_batch_sizes(120, 0.0) == [16]
