"""The learning-rate factor: the rule, and setting it in a compiled step without recompiling."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import simigrad_jax
from simigrad_jax.controllers import learning_rate


@pytest.mark.parametrize(
  "batch_size, base, rule, adjust, expected",
  [
    (512, 128, "sqrt", None, 2.0),
    (32, 128, "sqrt", None, 0.5),
    (200, 128, "sqrt", None, math.sqrt(200 / 128)),
    (512, 128, "linear", None, 4.0),
    (512, 128, "none", None, 1.0),
    (512, 128, "sqrt", 0.5, 1.5),  # (2 - 1) * 0.5 + 1
    (512, 128, "linear", 0.0, 1.0),
    (32, 128, "linear", 0.5, 0.625),  # (0.25 - 1) * 0.5 + 1
    (np.int64(512), np.int32(128), "sqrt", None, 2.0),
  ],
)
def test_lr_factor_rules(batch_size, base, rule, adjust, expected):
  assert simigrad_jax.lr_factor(batch_size, base, rule, adjust) == pytest.approx(
    expected, rel=1e-12
  )


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(batch_size=0, base_batch_size=128), "batch_size must be an integer >= 1, got 0"),
    (dict(batch_size=12.5, base_batch_size=128), "batch_size .* got 12.5"),
    (dict(batch_size=True, base_batch_size=128), "batch_size .* got True"),
    (dict(batch_size=64, base_batch_size=-1), "base_batch_size .* got -1"),
    (dict(batch_size=64, base_batch_size=128, rule="cubic"), "rule='cubic'"),
    (dict(batch_size=64, base_batch_size=128, lr_adjust_factor=-0.5), "lr_adjust_factor .* -0.5"),
    (dict(batch_size=64, base_batch_size=128, lr_adjust_factor=float("nan")), "lr_adjust_factor"),
    (dict(batch_size=1, base_batch_size=128, rule="linear", lr_adjust_factor=2.0), "<= 0"),
  ],
)
def test_lr_factor_refuses_bad_input(kwargs, message):
  with pytest.raises(ValueError, match=message):
    simigrad_jax.lr_factor(**kwargs)


def make_optimizer():
  return optax.chain(optax.sgd(0.1, momentum=0.9), simigrad_jax.scale_by_lr_factor())


def test_set_lr_factor_under_jit_scales_updates_without_retracing():
  opt = make_optimizer()
  traces = []

  @jax.jit
  def update(grads, state):
    traces.append(1)
    return opt.update(grads, state)

  state = opt.init(jnp.zeros(3))
  for factor in (1.0, 2.0, 0.25):
    state = simigrad_jax.set_lr_factor(state, factor)
    assert simigrad_jax.lr_factor_of(state) == factor
    fresh = opt.init(jnp.zeros(3))  # same momentum history: compare one step from zero
    fresh = simigrad_jax.set_lr_factor(fresh, factor)
    updates, _ = update(jnp.ones(3), fresh)
    np.testing.assert_allclose(updates, -0.1 * factor * np.ones(3), rtol=1e-6)
  assert len(traces) == 1


def test_set_lr_factor_keeps_pmap_and_shard_map_layouts():
  opt = make_optimizer()
  params = jnp.zeros(2)
  n = jax.device_count()
  traces = []

  def step(grads, state):
    traces.append(1)
    return opt.update(grads, state)

  pmapped = jax.pmap(step, axis_name="batch")
  state = jax.tree.map(lambda x: jnp.stack([x] * n), opt.init(params))
  grads = jnp.ones((n, 2))
  _, state = pmapped(grads, state)  # now laid out across the 8 devices
  _, state = pmapped(grads, state)  # traced for that layout
  traces_before = len(traces)
  sharding = state[1].lr_factor.sharding
  state = simigrad_jax.set_lr_factor(state, 3.0)
  assert state[1].lr_factor.shape == (n,) and state[1].lr_factor.sharding == sharding
  updates, _ = pmapped(grads, state)  # momentum trace after three steps: 1 + 0.9 + 0.81
  np.testing.assert_allclose(updates, -0.1 * 3.0 * 2.71 * np.ones((n, 2)), rtol=1e-6)
  assert len(traces) == traces_before

  mesh = Mesh(np.array(jax.devices()), ("batch",))
  shard_mapped = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=P()))
  replicated = NamedSharding(mesh, P())
  state = jax.device_put(opt.init(params), replicated)
  shard_mapped(jnp.ones(2), state)
  traces_before = len(traces)
  state = simigrad_jax.set_lr_factor(state, 0.5)
  assert state[1].lr_factor.sharding == replicated
  updates, _ = shard_mapped(jnp.ones(2), state)
  np.testing.assert_allclose(updates, [-0.05, -0.05], rtol=1e-6)
  assert len(traces) == traces_before  # the new factor needed no new trace


@pytest.mark.parametrize(
  "bad", [0.0, -1.0, float("inf"), float("nan"), 1e39, True, "2", None, [2.0], np.ones(1)]
)
def test_set_lr_factor_refuses_bad_values(bad):
  state = make_optimizer().init(jnp.zeros(2))
  with pytest.raises(ValueError, match="learning-rate factor must be a finite number > 0"):
    simigrad_jax.set_lr_factor(state, bad)


@pytest.mark.parametrize("good", [2, np.float32(0.5), jnp.asarray(3.0)])
def test_set_lr_factor_takes_any_real_scalar(good):
  state = simigrad_jax.set_lr_factor(make_optimizer().init(jnp.zeros(2)), good)
  assert float(simigrad_jax.lr_factor_of(state)) == float(good)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), True, "2", None])
def test_scale_by_lr_factor_refuses_a_bad_initial_factor(bad):
  with pytest.raises(ValueError, match=r"initial_lr_factor must be a finite number > 0.*got"):
    simigrad_jax.scale_by_lr_factor(bad)


def test_set_lr_factor_needs_the_transformation():
  with pytest.raises(ValueError, match="no LrFactorState.*scale_by_lr_factor"):
    simigrad_jax.set_lr_factor(optax.sgd(0.1).init(jnp.zeros(2)), 2.0)


# ------------------------------------------------------------------ coupling with a schedule


def cosine(e):
  return 0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * min(e, 1.0)))


def test_full_coupling_multiplies_the_batch_factor_and_the_schedule_at_every_step():
  for e in (0.0, 0.5, 0.99):
    factor, schedule = learning_rate.scheduled_lr_factor(256, 16, "sqrt", None, cosine, e)
    assert schedule == cosine(e) and factor == pytest.approx(4.0 * cosine(e))


def test_peak_coupling_is_full_at_the_peak_and_fades_with_the_decay():
  def peak(batch_size, e):
    return learning_rate.scheduled_lr_factor(batch_size, 16, "sqrt", None, cosine, e, "peak")

  assert peak(256, 0.0) == (pytest.approx(4.0), 1.0)  # at the peak: the square-root rule
  assert peak(16, 0.7)[0] == pytest.approx(cosine(0.7))  # at B_0: the schedule alone
  # A batch that grows 16x during the decay. The full coupling raises the rate r(B) = up to 4x
  # over the schedule's; the peak coupling by (r - 1) s at most, which vanishes as the schedule
  # does: the rate falls with the schedule over its last 70% and ends within 6% of its end.
  epochs = np.linspace(0.05, 1.0, 40)
  sizes = np.round(16 * 16 ** np.linspace(0, 1, 40)).astype(int).tolist()
  rates = [peak(b, e)[0] for b, e in zip(sizes, epochs, strict=True)]
  for b, e, rate in zip(sizes, epochs, rates, strict=True):
    r = math.sqrt(b / 16)
    assert rate == pytest.approx(cosine(e) * (1 + (r - 1) * cosine(e)))
  late = [rate for rate, e in zip(rates, epochs, strict=True) if e >= 0.3]
  assert all(a > b for a, b in zip(late, late[1:], strict=False))
  assert rates[-1] <= 1.06 * cosine(1.0)
  full = learning_rate.scheduled_lr_factor(256, 16, "sqrt", None, cosine, 1.0)[0]
  assert full == pytest.approx(4 * cosine(1.0))
  # Without a schedule the two couplings agree.
  for coupling in learning_rate.LR_COUPLINGS:
    assert learning_rate.scheduled_lr_factor(64, 16, "sqrt", None, None, 0.3, coupling)[0] == 2.0


def test_a_bad_coupling_names_the_valid_ones():
  with pytest.raises(ValueError, match=r"lr_coupling='cap' is not valid; choose one of \('full'"):
    learning_rate.scheduled_lr_factor(64, 16, "sqrt", None, None, 0.3, "cap")  # type: ignore[arg-type]
  with pytest.raises(ValueError, match=r"lr\.coupling='cap' is not valid"):
    simigrad_jax.LearningRateConfig(coupling="cap")  # type: ignore[arg-type]


@pytest.mark.parametrize("schedule", [0.0, math.nan, 1e39])
def test_a_scheduled_factor_the_steps_float32_cannot_hold_is_refused(schedule):
  """1e39 is finite in Python but inf in the step's float32 scalar."""
  with pytest.raises(ValueError, match=r"it must be finite and > 0, within float32's range"):
    learning_rate.scheduled_lr_factor(16, 16, "sqrt", None, lambda epochs: schedule, 0.0)


@pytest.mark.parametrize("answer", [True, np.bool_(False), np.array(True)])
def test_a_schedule_that_answers_a_bool_is_refused_at_any_epoch(answer):
  """float(True) is 1.0: a schedule answering a bool after the run's start trained at full rate."""
  with pytest.raises(ValueError, match=r"lr_schedule\(2\.500\) must return a number, not a bool"):
    learning_rate.scheduled_lr_factor(64, 16, "sqrt", None, lambda e: answer, 2.5)
