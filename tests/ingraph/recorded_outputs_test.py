"""The transform's outputs recorded by one trace of an optimizer's update and replayed by a
second (``record_outputs=`` / ``replay_outputs=``), and the Trainer's non-finite guard built on
them: its second trace writes the new state in place, reduces nothing again, and holds no
update or new state beside the old one (by the compiler's counts: no timing)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import simigrad_jax
from simigrad_jax import ingraph
from simigrad_jax.ingraph import train_step

AXIS = "batch"
COLLECTIVES = {"psum", "psum_scatter", "reduce_scatter", "all_gather", "all_to_all", "ppermute"}


def _halves(seed=0):
  rng = np.random.default_rng(seed)
  signal = rng.normal(size=(4, 3))
  return [{"w": jnp.asarray(signal + rng.normal(size=(4, 3)), jnp.float32)} for _ in range(2)]


def _sgd_setup(learning_rate):
  """An SGD chain after the transform, its parameters and state, two halves and their mean."""
  optimizer = optax.chain(simigrad_jax.transform(), optax.sgd(learning_rate))
  a, b = _halves()
  params = {"w": jnp.zeros((4, 3))}
  mean = jax.tree.map(lambda x, y: (x + y) / 2, a, b)
  return optimizer, params, optimizer.init(params), simigrad_jax.HalfGrads(a, b), mean


def test_the_second_trace_returns_the_first_s_measurement_whatever_it_is_given():
  optimizer, params, state, first_halves, mean = _sgd_setup(0.1)
  a, b = first_halves.first, first_halves.second

  def both(a2, b2):
    recorded = ingraph.RecordedOutputs()
    first = optimizer.update(mean, state, params, half_grads=first_halves, record_outputs=recorded)
    # The second trace is given other halves: it measures nothing and takes the first's state.
    other = jax.tree.map(lambda x, y: (x + y) / 2, a2, b2)
    second = optimizer.update(
      other, state, params, half_grads=simigrad_jax.HalfGrads(a2, b2), replay_outputs=recorded
    )
    recorded.check_all_replayed()
    return first, second, other

  (first_updates, first_state), (second_updates, second_state), other = jax.jit(both)(
    *_halves(seed=1)
  )
  assert simigrad_jax.similarity(second_state) == simigrad_jax.similarity(first_state)
  assert simigrad_jax.similarity(first_state) == pytest.approx(
    float(jnp.vdot(a["w"], b["w"]) / (jnp.linalg.norm(a["w"]) * jnp.linalg.norm(b["w"]))),
    rel=1e-5,
  )
  # A mean with no reduction behind it is made again from what the second trace is given.
  np.testing.assert_array_equal(second_updates["w"], -0.1 * other["w"])
  np.testing.assert_array_equal(first_updates["w"], -0.1 * mean["w"])


def test_held_means_are_handed_back_as_recorded():
  optimizer, params, state, halves, mean = _sgd_setup(1.0)
  recorded = ingraph.RecordedOutputs(remake_unreduced_means=False)
  first, _ = optimizer.update(mean, state, params, half_grads=halves, record_outputs=recorded)
  zeros = jax.tree.map(jnp.zeros_like, mean)
  second, _ = optimizer.update(zeros, state, params, replay_outputs=recorded)
  np.testing.assert_array_equal(second["w"], first["w"])


def test_a_second_trace_that_reaches_the_transforms_another_number_of_times_is_refused():
  one = optax.chain(simigrad_jax.transform(), optax.sgd(1.0))
  two = optax.chain(simigrad_jax.transform(), simigrad_jax.transform(), optax.sgd(1.0))
  a, b = _halves()
  params = {"w": jnp.zeros((4, 3))}
  halves = simigrad_jax.HalfGrads(a, b)
  recorded = ingraph.RecordedOutputs()
  one.update(a, one.init(params), params, half_grads=halves, record_outputs=recorded)
  with pytest.raises(
    RuntimeError, match=r"reached simigrad_jax.transform 2 time\(s\), its first 1"
  ):
    two.update(a, two.init(params), params, half_grads=halves, replay_outputs=recorded)
  recorded = ingraph.RecordedOutputs()
  two.update(a, two.init(params), params, half_grads=halves, record_outputs=recorded)
  one.update(a, one.init(params), params, half_grads=halves, replay_outputs=recorded)
  with pytest.raises(
    RuntimeError, match=r"reached simigrad_jax.transform 1 time\(s\), its first 2"
  ):
    recorded.check_all_replayed()


def _primitives(jaxpr, inside_cond=False):
  """Every primitive of ``jaxpr`` and the jaxprs in it, with whether it lies in a cond branch."""
  for eqn in jaxpr.eqns:
    yield eqn.primitive.name, inside_cond
    in_cond = inside_cond or eqn.primitive.name == "cond"
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if isinstance(inner, jax.extend.core.Jaxpr):
          yield from _primitives(inner, in_cond)


def _mlp(features=64, hidden=256):
  rng = np.random.default_rng(0)
  params = {
    "w1": jnp.asarray(rng.normal(size=(features, hidden)) / np.sqrt(features), jnp.float32),
    "w2": jnp.asarray(rng.normal(size=(hidden, hidden)) / np.sqrt(hidden), jnp.float32),
    "w3": jnp.asarray(rng.normal(size=(hidden,)) / np.sqrt(hidden), jnp.float32),
  }

  def per_example(params, model_state, rows, weights, rng):
    del weights, rng
    h = jax.nn.relu(rows["x"] @ params["w1"])
    h = jax.nn.relu(h @ params["w2"])
    return (h @ params["w3"] - rows["y"]) ** 2, model_state

  return params, per_example


def _adamw(axis_name):
  return optax.chain(
    simigrad_jax.transform(axis_name), optax.adamw(1e-3), simigrad_jax.scale_by_lr_factor()
  )


def _step_args(params, optimizer, rows):
  x = np.random.default_rng(1).normal(size=(rows, 64)).astype(np.float32)
  batch = {"x": jnp.asarray(x), "y": jnp.asarray(x.sum(1))}
  scalars = train_step.StepScalars(
    total_weight=np.float32(rows), lr_factor=np.float32(1.0), first_half_weight=np.float32(rows / 2)
  )
  return (params, optimizer.init(params), {}, batch, jnp.ones(rows), scalars, np.zeros(2, np.int32))


@pytest.mark.parametrize("measure", [True, False])
def test_on_8_devices_the_guard_s_write_reduces_nothing_again(devices, measure):
  """The update traced inside the guard's cond holds no collective: the transform's mean and
  measurement come from the first trace."""
  params, per_example = _mlp()
  mesh = jax.make_mesh((8,), (AXIS,), (jax.sharding.AxisType.Auto,), devices=devices)
  optimizer = _adamw(AXIS)
  step = train_step.make_fused_step(per_example, optimizer, mesh, AXIS, measure=measure)
  jaxpr = jax.make_jaxpr(step)(*_step_args(params, optimizer, 64)).jaxpr
  found = list(_primitives(jaxpr))
  assert any(name in COLLECTIVES and not in_cond for name, in_cond in found)
  assert any(name == "cond" for name, _ in found)
  assert not [name for name, in_cond in found if in_cond and name in COLLECTIVES]


def _temp_bytes(fn, args):
  compiled = jax.jit(fn, donate_argnums=(0, 1, 2)).lower(*args).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_on_one_device_the_guard_holds_no_update_or_new_state_beside_the_old_one(devices):
  """AdamW's update written in place as a plain loop's is: the Trainer's plain program holds at
  most a tenth of a gradient more temporary memory than the plain ``jax.jit`` step, and its
  measuring program (sequential halves) about one gradient more, the second half's."""
  params, per_example = _mlp()
  gradient_bytes = sum(leaf.size * 4 for leaf in jax.tree.leaves(params))
  mesh = jax.make_mesh((1,), (AXIS,), (jax.sharding.AxisType.Auto,), devices=devices[:1])
  optimizer = _adamw(AXIS)
  args = _step_args(params, optimizer, 64)
  adamw = optax.adamw(1e-3)

  def plain(p, opt_state, model_state, batch):
    def loss(p):
      return jnp.mean(per_example(p, model_state, batch, None, None)[0])

    grads = jax.grad(loss)(p)
    updates, opt_state = adamw.update(grads, opt_state, p)
    return optax.apply_updates(p, updates), opt_state, model_state

  baseline = _temp_bytes(plain, (params, adamw.init(params), {}, args[3]))
  plain_program = train_step.make_plain_step(per_example, optimizer, mesh, AXIS)
  measuring = train_step.make_fused_step(per_example, optimizer, mesh, AXIS, halves="local")
  extra = lambda fn: (_temp_bytes(fn, args) - baseline) / gradient_bytes
  assert extra(plain_program) <= 0.1
  assert extra(measuring) <= 1.1


def test_a_skipped_step_keeps_the_state_and_records_the_measurement(devices):
  """A non-finite update (a learning-rate factor of infinity) skips the step: the parameters and
  the optimizer's moments bit for bit, Adam's count unmoved, the similarity recorded."""
  params, per_example = _mlp()
  mesh = jax.make_mesh((1,), (AXIS,), (jax.sharding.AxisType.Auto,), devices=devices[:1])
  optimizer = _adamw(AXIS)
  args = list(_step_args(params, optimizer, 64))
  step = jax.jit(train_step.make_fused_step(per_example, optimizer, mesh, AXIS, halves="local"))
  written_params, written_state, _, measured = step(*args)
  assert int(measured.nonfinite_cause) == 0
  args[5] = args[5]._replace(lr_factor=np.float32(np.inf))
  kept_params, kept_state, _, skipped = step(*args)
  assert train_step.NONFINITE_CAUSES[int(skipped.nonfinite_cause) - 1] == "update"
  for got, want in zip(jax.tree.leaves(kept_params), jax.tree.leaves(params), strict=True):
    np.testing.assert_array_equal(np.asarray(got).view(np.int32), np.asarray(want).view(np.int32))
  adam_before = optax.tree_utils.tree_get(args[1], "ScaleByAdamState")
  adam_kept = optax.tree_utils.tree_get(kept_state, "ScaleByAdamState")
  for got, want in zip(jax.tree.leaves(adam_kept), jax.tree.leaves(adam_before), strict=True):
    np.testing.assert_array_equal(got, want)
  assert int(optax.tree_utils.tree_get(written_state, "ScaleByAdamState").count) == 1
  assert simigrad_jax.similarity(kept_state) == pytest.approx(
    simigrad_jax.similarity(written_state), abs=1e-6
  )
  assert not np.array_equal(written_params["w1"], params["w1"])
