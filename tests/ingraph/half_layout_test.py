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
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=1e-6)
  plain = jax.grad(_loss)(host_params, host_batch)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(plain), strict=True):
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


def _step(param_specs=None, loss=_loss):
  optimizer = optax.chain(simigrad_jax.transform(), optax.sgd(0.1))

  def step(params, opt_state, batch):
    value, grads, halves = simigrad_jax.value_and_half_grads(loss, param_specs=param_specs)(
      params, batch
    )
    updates, opt_state = optimizer.update(grads, opt_state, params, half_grads=halves)
    return optax.apply_updates(params, updates), opt_state, grads, halves

  return optimizer, step


def _run(mesh, host_params, host_batch, specs=None, param_specs=None, loss=_loss):
  """One step on ``mesh``: (new params, state, grads, halves, compiled temporary bytes)."""
  specs = specs or jax.tree.map(lambda _: P(), host_params)
  params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), host_params, specs)
  batch = jax.device_put(host_batch, NamedSharding(mesh, P("data")))
  optimizer, step = _step(param_specs, loss)
  with jax.set_mesh(mesh):
    compiled = jax.jit(step).lower(params, optimizer.init(params), batch).compile()
    outputs = compiled(params, optimizer.init(params), batch)
  return (*outputs, compiled.memory_analysis().temp_size_in_bytes)


def test_on_explicit_data_axes_alone_the_step_is_the_auto_one(devices):
  """The same halves, similarity to 1e-5 and at most the temporary memory of Auto axes."""
  mesh, host_params, host_batch = _problem(devices, AxisType.Auto)
  explicit = jax.make_mesh((len(devices),), ("data",), axis_types=(AxisType.Explicit,))
  _, auto_state, _, auto_halves, auto_temp = _run(mesh, host_params, host_batch)
  new_params, state, grads, halves, temp = _run(explicit, host_params, host_batch)
  even = jax.tree.map(lambda x: x[0::2], host_batch)
  odd = jax.tree.map(lambda x: x[1::2], host_batch)
  want = jax.grad(_loss)(host_params, even), jax.grad(_loss)(host_params, odd)
  for got, expected in zip((halves.first, halves.second), want, strict=True):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
      np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=1e-6)
  assert simigrad_jax.similarity(state) == pytest.approx(
    simigrad_jax.similarity(auto_state), abs=1e-5
  )
  assert simigrad_jax.similarity(state) == pytest.approx(_cosine(*want), abs=1e-5)
  assert temp <= auto_temp
  # Typed again for the Explicit mesh: the halves in blocks, the mean and parameters replicated.
  assert jax.typeof(halves.first["w1"]).sharding.spec == P(None, "data")  # 12 rows, 16 columns
  assert jax.typeof(halves.second["b1"]).sharding.spec == P("data")
  assert all(g.sharding.is_fully_replicated for g in jax.tree.leaves(grads))
  assert all(p.sharding.is_fully_replicated for p in jax.tree.leaves(new_params))


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_fsdp_parameters_keep_their_blocks(devices, axis_type):
  """A leaf sharded over the data axis (its type, or param_specs under Auto axes): its half
  gradients, its mean and the updated parameter stay in its blocks."""
  mesh, host_params, host_batch = _problem(devices, axis_type)
  specs = {"w1": P(None, "data"), "b1": P(), "w2": P("data", None)}
  given = specs if axis_type == AxisType.Auto else None
  new_params, state, grads, halves, _ = _run(mesh, host_params, host_batch, specs, given)
  even = jax.tree.map(lambda x: x[0::2], host_batch)
  odd = jax.tree.map(lambda x: x[1::2], host_batch)
  want = _cosine(jax.grad(_loss)(host_params, even), jax.grad(_loss)(host_params, odd))
  assert simigrad_jax.similarity(state) == pytest.approx(want, abs=1e-5)
  for name in ("w1", "w2"):
    blocks = NamedSharding(mesh, specs[name])
    for leaf in (grads[name], halves.first[name], halves.second[name], new_params[name]):
      assert leaf.sharding.is_equivalent_to(blocks, 2), (name, leaf.sharding)


def test_param_specs_of_another_structure_are_refused(devices):
  mesh, host_params, host_batch = _problem(devices, AxisType.Auto)
  with pytest.raises(ValueError, match="param_specs must be a PartitionSpec for each leaf"):
    _run(mesh, host_params, host_batch, param_specs={"w1": P()})


def test_a_loss_naming_the_explicit_data_axis_runs_as_written_with_a_warning(devices):
  mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(AxisType.Explicit,))
  _, host_params, host_batch = _problem(devices, AxisType.Explicit)

  def naming_rows(params, batch):
    hidden = jnp.matmul(batch["x"], params["w1"], out_sharding=P("data", None))
    logits = jax.nn.relu(hidden + params["b1"]) @ params["w2"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))

  with pytest.warns(UserWarning, match="does not trace with the data axis 'data' Auto"):
    _, state, *_ = _run(mesh, host_params, host_batch, loss=naming_rows)
  even = jax.tree.map(lambda x: x[0::2], host_batch)
  odd = jax.tree.map(lambda x: x[1::2], host_batch)
  want = _cosine(jax.grad(_loss)(host_params, even), jax.grad(_loss)(host_params, odd))
  assert simigrad_jax.similarity(state) == pytest.approx(want, abs=1e-5)
