"""value_and_half_grads on a data-parallel mesh: halves kept in blocks, the same values."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import simigrad_jax
from simigrad_jax.ingraph import half_layout


def _loss(params, batch):
  hidden = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"])
  logits = hidden @ params["w2"]
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))


def _problem(devices, axis_type):
  mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(axis_type,), devices=devices)
  rng = np.random.default_rng(0)
  params = {
    "w1": rng.normal(size=(12, 16)).astype(np.float32) / 4,
    "b1": rng.normal(size=(16,)).astype(np.float32),
    "w2": rng.normal(size=(16, 5)).astype(np.float32) / 4,
  }
  batch = {
    "x": rng.normal(size=(8 * len(devices), 12)).astype(np.float32),
    "y": rng.integers(0, 5, size=8 * len(devices)).astype(np.int32),
  }
  return mesh, params, batch


def _cosine(a, b):
  a = np.concatenate([np.ravel(x) for x in jax.tree.leaves(a)]).astype(np.float64)
  b = np.concatenate([np.ravel(x) for x in jax.tree.leaves(b)]).astype(np.float64)
  return a @ b / np.sqrt((a @ a) * (b @ b))


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_values_and_similarity_are_those_of_the_even_and_odd_examples(devices, axis_type):
  mesh, host_params, host_batch = _problem(devices, axis_type)
  params = jax.device_put(host_params, NamedSharding(mesh, P()))
  batch = jax.device_put(host_batch, NamedSharding(mesh, P("data")))
  optimizer = optax.chain(simigrad_jax.transform(), optax.sgd(0.1))

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads, halves = simigrad_jax.value_and_half_grads(_loss)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params, half_grads=halves)
    return optax.apply_updates(params, updates), opt_state, loss, grads, halves

  with jax.set_mesh(mesh):
    new_params, opt_state, loss, grads, halves = step(params, optimizer.init(params), batch)

  even = jax.tree.map(lambda x: x[0::2], host_batch)
  odd = jax.tree.map(lambda x: x[1::2], host_batch)
  first, second = jax.grad(_loss)(host_params, even), jax.grad(_loss)(host_params, odd)
  for got, want in ((halves.first, first), (halves.second, second)):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=1e-6)
  plain = jax.grad(_loss)(host_params, host_batch)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(plain)):
    np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(float(loss), _loss(host_params, host_batch), rtol=1e-5)
  assert simigrad_jax.similarity(opt_state) == pytest.approx(_cosine(first, second), abs=1e-5)
  for name, leaf in new_params.items():  # the parameters keep their (replicated) layout
    assert leaf.sharding.is_fully_replicated, (name, leaf.sharding)
  # The halves lie in blocks over the data axis where a dimension divides by its size.
  assert not halves.first["w1"].sharding.is_fully_replicated
  assert halves.first["w2"].sharding.is_fully_replicated is False


def test_no_layout_is_asked_without_a_data_axis(devices):
  batch = {"x": jnp.ones((8, 3))}
  seen = []
  jax.jit(lambda b: seen.append(half_layout.data_layout(b)))(batch)
  assert seen == [None]
  mesh = jax.make_mesh((2, len(devices) // 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):  # Auto axes on a mesh of several axes: which is the data axis is unknown
    jax.jit(lambda b: seen.append(half_layout.data_layout(b)))(batch)
  assert seen == [None, None]
