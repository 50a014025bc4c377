"""value_and_half_grads' passes (sequential, stacked, signed) agree in float32, in the plain
step and the Trainer's (in float64 with BatchNorm: half_batch_test.py); batch_argnums splits
every per-row argument, and a per-row one left whole is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import simigrad_jax
from simigrad_jax.ingraph import HalfBatchArgumentError
from simigrad_jax.ingraph import half_batch
from simigrad_jax.ingraph import train_step

PASSES = tuple(half_batch.PASSES)


def _assert_trees_close(actual, expected, **tolerance):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    assert a.shape == e.shape and a.dtype == e.dtype
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), **tolerance)


@pytest.mark.parametrize("passes", PASSES)
def test_the_mean_is_the_plain_gradient_and_the_similarity_is_todays_in_float32(passes):
  rng = np.random.default_rng(1)
  x = rng.normal(size=(16, 5)).astype(np.float32)
  y = rng.normal(size=(16,)).astype(np.float32)
  params = {"w": jnp.asarray(rng.normal(size=(5, 4)), jnp.float32), "v": jnp.ones(4)}
  loss = lambda p, x, y: jnp.mean((jnp.tanh(x @ p["w"]) @ p["v"] - y) ** 2)
  optimizer = optax.chain(simigrad_jax.transform(), optax.sgd(0.1))

  def similarity(passes):
    _, grads, halves = simigrad_jax.value_and_half_grads(loss, batch_argnums=(1, 2), passes=passes)(
      params, x, y
    )
    _, state = optimizer.update(grads, optimizer.init(params), params, half_grads=halves)
    return grads, state[0].similarity

  grads, measured = jax.jit(similarity, static_argnums=0)(passes)
  _, today = jax.jit(similarity, static_argnums=0)("sequential")
  _assert_trees_close(grads, jax.grad(loss)(params, x, y), rtol=1e-5, atol=1e-6)
  assert abs(float(measured) - float(today)) <= 1e-5
  assert abs(float(today)) < 0.99  # the halves saw different rows


@pytest.mark.parametrize("passes", PASSES)
def test_a_program_traces_the_loss_once_whatever_the_passes(passes):
  """The sequential passes call one traced function twice: the loss's Python runs once in a
  program's trace (as in the stacked and signed passes), with its other arguments as given."""
  calls = []

  def loss(p, x, power):
    calls.append(power)
    return jnp.mean(jnp.tanh(x @ p) ** power)

  grad_fn = simigrad_jax.value_and_half_grads(loss, passes=passes)
  jaxpr = jax.make_jaxpr(lambda p, x: grad_fn(p, x, 2))(jnp.ones(3), jnp.ones((8, 3)))

  assert calls == [2]  # once, and the Python int reached it as it is
  if passes == "sequential":
    calls_of_one_pass = [e for e in jaxpr.eqns if e.params.get("name") == "half_pass"]
    assert len(calls_of_one_pass) == 2
    assert calls_of_one_pass[0].params["jaxpr"] is calls_of_one_pass[1].params["jaxpr"]


def test_traced_once_shares_a_trace_only_between_calls_of_the_same_types_and_objects():
  seen = []

  def scaled(x, factor):
    seen.append(factor)
    return x * factor

  once = half_batch.traced_once(scaled, "scaled")
  three, another_three = float("3"), float("3")  # equal, but two objects
  jax.make_jaxpr(lambda x, y: (once(x, three), once(y, three)))(jnp.ones(2), jnp.ones(2))
  assert seen == [3.0] and seen[0] is three
  jax.make_jaxpr(lambda x: (once(x, another_three), once(x.astype(jnp.int32), another_three)))(
    jnp.ones(2)
  )
  assert seen == [3.0] * 3 and seen[1] is another_three  # another object, another type
  np.testing.assert_array_equal(jax.jit(lambda x: once(x, 2))(jnp.arange(3.0)), [0.0, 2.0, 4.0])


def test_the_examples_in_the_docstrings_run():
  import doctest

  assert doctest.testmod(half_batch).failed == 0


def test_labels_left_whole_are_refused_naming_the_argument_and_the_setting():
  loss = lambda w, x, y: jnp.mean((x @ w - y) ** 2)
  w, x, y = jnp.zeros(3), jnp.ones((6, 3)), jnp.arange(6.0)
  with pytest.raises(HalfBatchArgumentError, match=r"argument 2 .* batch_argnums=\(1, 2\)"):
    simigrad_jax.value_and_half_grads(loss)(w, x, y)
  split = simigrad_jax.value_and_half_grads(loss, batch_argnums=(1, 2))(w, x, y)
  as_dict = simigrad_jax.value_and_half_grads(lambda w, b: loss(w, b["x"], b["y"]))(
    w, {"x": x, "y": y}
  )
  _assert_trees_close(split, as_dict, rtol=1e-6)


def test_an_argument_named_whole_goes_whole_to_both_halves():
  # A per-feature scale with the batch's length by chance: batch_argnums=1 keeps it whole.
  loss = lambda w, x, scale: jnp.mean((x * scale) @ w)
  w, x, scale = jnp.ones(4), jnp.arange(16.0).reshape(4, 4), jnp.arange(1.0, 5.0)
  _, grads, halves = simigrad_jax.value_and_half_grads(loss, batch_argnums=1)(w, x, scale)
  np.testing.assert_allclose(halves.first, jnp.mean(x[0::2] * scale, axis=0), rtol=1e-6)
  np.testing.assert_allclose(grads, jnp.mean(x * scale, axis=0), rtol=1e-6)


@pytest.mark.parametrize(
  ("settings", "message"),
  [
    ({"passes": "parallel"}, "passes='parallel' is not valid; choose one of"),
    ({"batch_argnums": 0}, "batch_argnums=0 is not valid"),
    ({"batch_argnums": (1, 1)}, r"batch_argnums=\(1, 1\) is not valid"),
    ({"batch_argnums": ()}, r"batch_argnums=\(\) is not valid"),
    # A bool is not position 1; a float or a JAX scalar is no position.
    ({"batch_argnums": True}, r"batch_argnums=True is not valid: give an integer"),
    ({"batch_argnums": (True, 2)}, r"batch_argnums=\(True, 2\) is not valid"),
    ({"batch_argnums": 1.0}, r"batch_argnums=1.0 is not valid"),
    ({"batch_argnums": jnp.int32(1)}, r"batch_argnums=Array\(1.* is not valid"),
  ],
)
def test_bad_settings_are_refused_where_the_step_is_written(settings, message):
  with pytest.raises(HalfBatchArgumentError, match=message):
    simigrad_jax.value_and_half_grads(lambda w, x: jnp.sum(x @ w), **settings)


@pytest.mark.parametrize(
  ("given", "python"), [(np.int64(1), 1), ((np.int64(1), np.int64(2)), (1, 2))]
)
def test_numpy_integer_positions_are_taken_as_pythons(given, python):
  loss = lambda w, x, y: jnp.mean((x @ w) ** 2) * jnp.mean(y)  # y whole or split
  w, x, y = jnp.ones(4), jnp.arange(16.0).reshape(4, 4), jnp.arange(1.0, 5.0)
  got = simigrad_jax.value_and_half_grads(loss, batch_argnums=given)(w, x, y)
  want = simigrad_jax.value_and_half_grads(loss, batch_argnums=python)(w, x, y)
  _assert_trees_close(got, want, rtol=0)


def test_a_position_past_the_arguments_is_refused():
  loss = lambda w, x: jnp.mean(x @ w)
  with pytest.raises(HalfBatchArgumentError, match=r"names argument 3, but loss_fn was called"):
    simigrad_jax.value_and_half_grads(loss, batch_argnums=(1, 3))(jnp.ones(2), jnp.ones((4, 2)))


def test_the_trainers_local_halves_agree_over_passes():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  optimizer = optax.chain(
    simigrad_jax.transform("data"), optax.adamw(1e-2), simigrad_jax.scale_by_lr_factor()
  )
  rng = np.random.default_rng(2)
  params = {"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)}
  batch = {"x": rng.normal(size=(32, 3)).astype(np.float32)}
  weights = np.ones(32, np.float32)
  weights[-3:] = 0.0  # padding rows count nowhere

  def per_example(p, state, rows, row_weights, key):
    del row_weights
    noise = jax.random.normal(key, (rows["x"].shape[0],))  # each half its own key
    return jnp.sum(jnp.tanh(rows["x"] @ p["w"]), axis=1) ** 2 + 0.1 * noise, state

  scalars = train_step.StepScalars(np.float32(29), np.float32(1), np.float32(16))
  outputs = {}
  for passes in PASSES:
    step = train_step.make_fused_step(
      per_example, optimizer, mesh, "data", halves="local", passes=passes
    )
    outputs[passes] = jax.jit(step)(
      params, optimizer.init(params), {}, batch, weights, scalars, np.zeros(2, np.int32)
    )
  reference = outputs["sequential"]
  for passes in PASSES[1:]:
    new_params, _, _, measured = outputs[passes]
    _assert_trees_close(new_params, reference[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(measured.loss, reference[3].loss, rtol=1e-6)
    assert (
      abs(
        simigrad_jax.similarity(measured.similarity_state)
        - simigrad_jax.similarity(reference[3].similarity_state)
      )
      <= 1e-5
    )
