"""simigrad_jax.device_halves_step: a plain-jit step whose halves are the data axis's even and
odd devices, on a 4 x 2 mesh with Auto and Explicit axes: the plain step's update, the float64
similarity of the dealt batch's even and odd examples, no collective-permute, no gathered
tensor-parallel kernel, the parameters' sharding kept; deal_to_devices and the errors."""

import collections
import doctest

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import simigrad_jax
from benchmarks.step_cost import hlo_collectives
from benchmarks.step_cost import sharded_models
from simigrad_jax.ingraph import device_halves_step as device_halves_step_module
from simigrad_jax.reductions import data_blocks

WIDTHS = (64, 64, 10)
BATCH = 32


def _placed(layout, axes):
  """The model on ``layout``'s mesh: the mesh, host parameters and batch, the placed
  parameters, the batch and the batch dealt to the data positions, and the parameters' specs."""
  mesh = sharded_models.make_mesh(layout, axes)
  host_params = sharded_models.init_params(WIDTHS)
  host_batch = sharded_models.make_batch(WIDTHS, BATCH)
  params, batch = sharded_models.place(host_params, host_batch, mesh, layout)
  _, dealt = sharded_models.place(
    host_params, simigrad_jax.data.deal_to_devices(host_batch, mesh.shape["data"]), mesh, layout
  )
  specs = jax.tree.map(lambda a: a.sharding.spec, params)
  return mesh, host_params, host_batch, params, batch, dealt, specs


@pytest.fixture(scope="module", params=["auto", "explicit"])
def run(request, devices):
  """One step of the plain and the groups step on the tensor-parallel layout, compiled."""
  del devices  # 8 devices, set up by conftest
  axes = request.param
  explicit = axes == "explicit"
  mesh, host_params, host_batch, params, batch, dealt, specs = _placed("tp", axes)
  num_layers = len(WIDTHS) - 1
  steps, optimizers = sharded_models.make_steps(
    sharded_models.make_loss(num_layers, explicit=explicit),
    sharded_models.make_loss(num_layers, explicit=explicit, rows=None),
    None if explicit else specs,
  )
  shardings = jax.tree.map(lambda a: a.sharding, params)

  def keeping_layout(step):
    def run_step(p, s, b):
      new_params, state, loss = step(p, s, b)
      if not explicit:  # as out_shardings would
        new_params = jax.lax.with_sharding_constraint(new_params, shardings)
      return new_params, state, loss

    return jax.jit(run_step)

  out, hlo = {}, {}
  with jax.set_mesh(mesh):
    for name, data in (("plain", batch), ("groups", dealt)):
      state = optimizers[name].init(params)
      compiled = keeping_layout(steps[name]).lower(params, state, data).compile()
      hlo[name] = compiled.as_text()
      out[name] = compiled(params, state, data)
  reference = sharded_models.reference_similarity(WIDTHS, host_params, host_batch)
  return {"params": params, "out": out, "hlo": hlo, "reference": reference}


def test_the_update_is_the_plain_steps_and_the_similarity_the_even_and_odd_examples(run):
  plain_params, _, plain_loss = run["out"]["plain"]
  groups_params, state, groups_loss = run["out"]["groups"]
  for got, want in zip(jax.tree.leaves(groups_params), jax.tree.leaves(plain_params), strict=True):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-5)
  assert float(groups_loss) == pytest.approx(float(plain_loss), rel=1e-5)
  assert 0.01 < abs(run["reference"]) < 0.99  # the halves differ, and are not unrelated
  assert simigrad_jax.similarity(state) == pytest.approx(run["reference"], abs=1e-5)


def test_no_permute_no_gathered_kernel_and_the_sharding_kept(run):
  found = hlo_collectives.parse_collectives(run["hlo"]["groups"], jax.device_count())
  kinds = collections.Counter(c.kind for c in found)
  assert kinds["collective-permute"] == 0, kinds
  # The tensor-parallel kernel (64 x 64 float32, 16 KiB) is reduced as its 8 KiB shards (in
  # one bucket with the other small leaves' shards): no collective carries it whole.
  assert max(c.payload_bytes for c in found) < 64 * 64 * 4, found
  plain = hlo_collectives.parse_collectives(run["hlo"]["plain"], jax.device_count())
  assert sum(c.bytes for c in found) <= 1.001 * sum(c.bytes for c in plain)
  for before, after in zip(
    jax.tree.leaves(run["params"]), jax.tree.leaves(run["out"]["groups"][0]), strict=True
  ):
    assert after.sharding.is_equivalent_to(before.sharding, after.ndim)


def test_deal_to_devices_puts_example_e_on_data_position_e_mod_n():
  batch = {"x": np.arange(12) * 10, "y": np.arange(24).reshape(12, 2)}
  dealt = simigrad_jax.data.deal_to_devices(batch, 4)
  blocks = dealt["x"].reshape(4, 3) // 10
  for position, block in enumerate(blocks):
    assert set(block % 4) == {position}
  np.testing.assert_array_equal(dealt["y"][:, 0] // 2, dealt["x"] // 10)
  with pytest.raises(ValueError, match="not a multiple of num_devices=5"):
    simigrad_jax.data.deal_to_devices(batch, 5)
  with pytest.raises(ValueError, match="num_devices=0"):
    simigrad_jax.data.deal_to_devices(batch, 0)
  with pytest.raises(ValueError, match="num_devices=4.0 is not valid"):
    simigrad_jax.data.deal_to_devices(batch, 4.0)
  np.testing.assert_array_equal(  # a NumPy count (was refused) deals as Python's does
    simigrad_jax.data.deal_to_devices(batch, np.int64(4))["x"], dealt["x"]
  )


def test_a_step_without_the_data_axis_or_with_an_unnamed_transform_names_the_fix(devices):
  del devices
  mesh = jax.make_mesh((jax.device_count(),), ("batch",))
  loss_fn = lambda w, b: ((b @ w) ** 2).mean()
  optimizer = optax.chain(simigrad_jax.transform("data"), optax.sgd(0.1))
  w = np.zeros(3, np.float32)
  x = jax.device_put(np.ones((16, 3), np.float32), jax.NamedSharding(mesh, P("batch")))
  step = jax.jit(simigrad_jax.device_halves_step(loss_fn, optimizer))
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="mesh axis 'data'"):
    step(w, optimizer.init(w), x)
  odd = jax.make_mesh((3,), ("data",), devices=jax.devices()[:3])
  x_odd = jax.device_put(np.ones((6, 3), np.float32), jax.NamedSharding(odd, P("data")))
  step = jax.jit(simigrad_jax.device_halves_step(loss_fn, optimizer))
  with (
    jax.set_mesh(odd),
    pytest.raises(ValueError, match="has 3 .an odd number.: on an odd data axis use"),
  ):
    step(w, optimizer.init(w), x_odd)
  unnamed = optax.chain(simigrad_jax.transform(), optax.sgd(0.1))
  step = jax.jit(simigrad_jax.device_halves_step(loss_fn, unnamed, axis_name="batch"))
  with (
    jax.set_mesh(mesh),
    pytest.raises(simigrad_jax.ingraph.AxisNameError, match="axis_name='batch'"),
  ):
    step(w, unnamed.init(w), x)
  # Without the transform the optimizer would see each device's gradient stacked.
  plain = optax.sgd(0.1)
  step = jax.jit(simigrad_jax.device_halves_step(loss_fn, plain, axis_name="batch"))
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="never reached simigrad_jax.transform"):
    step(w, plain.init(w), x)


def test_has_aux_returns_the_aux_averaged_over_the_data_axis(devices):
  del devices
  mesh = jax.make_mesh((jax.device_count(),), ("data",))  # Explicit axes

  def loss_fn(w, batch):
    predictions = batch["x"] @ w
    return ((predictions - batch["y"]) ** 2).mean(), {"mean_prediction": predictions.mean()}

  optimizer = optax.chain(simigrad_jax.transform("data"), optax.sgd(0.1))
  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 3)).astype(np.float32)
  examples = {"x": x, "y": x.sum(1)}
  batch = jax.device_put(examples, jax.NamedSharding(mesh, P("data")))
  w = jax.device_put(np.ones(3, np.float32), jax.NamedSharding(mesh, P()))
  step = jax.jit(simigrad_jax.device_halves_step(loss_fn, optimizer, has_aux=True))
  with jax.set_mesh(mesh):
    new_w, state, loss, aux = step(w, optimizer.init(w), batch)
  assert float(aux["mean_prediction"]) == pytest.approx(float((x @ np.ones(3)).mean()), rel=1e-5)
  assert float(loss) == pytest.approx(0.0, abs=1e-10)
  assert new_w.sharding.is_equivalent_to(w.sharding, 1)
  assert not bool(state[0].measured)  # zero gradients: nothing to compare


@pytest.fixture(scope="module", params=["auto", "explicit"])
def fsdp_run(request, devices):
  """Two steps of a plain step and the groups step, both AdamW after a global-norm clip, with
  every kernel in FSDP blocks over ``data`` (and tensor parallel over ``model``) on 4 x 2."""
  del devices
  axes = request.param
  explicit = axes == "explicit"
  mesh, host_params, host_batch, params, batch, dealt, specs = _placed("fsdp_tp", axes)
  num_layers = len(WIDTHS) - 1
  loss = sharded_models.make_loss(num_layers, explicit=explicit)
  device_loss = sharded_models.make_loss(num_layers, explicit=explicit, rows=None)
  adamw = lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2))
  plain_optimizer = adamw()
  groups_optimizer = optax.chain(simigrad_jax.transform("data"), adamw())

  def plain(p, s, b):
    value, grads = jax.value_and_grad(loss)(p, b)
    updates, s = plain_optimizer.update(grads, s, p)
    return optax.apply_updates(p, updates), s, value

  groups = simigrad_jax.device_halves_step(
    device_loss, groups_optimizer, param_specs=None if explicit else specs
  )
  shardings = jax.tree.map(lambda a: a.sharding, params)

  def keeping_layout(step):
    def run_step(p, s, b):
      new_params, state, value = step(p, s, b)
      if not explicit:
        new_params = jax.lax.with_sharding_constraint(new_params, shardings)
      return new_params, state, value

    return jax.jit(run_step)

  out, compiled = {}, {}
  with jax.set_mesh(mesh):
    for name, step, optimizer, data in (
      ("plain", plain, plain_optimizer, batch),
      ("groups", groups, groups_optimizer, dealt),
    ):
      state = optimizer.init(params)
      jitted = keeping_layout(step)
      compiled[name] = jitted.lower(params, state, data).compile()
      # Under Auto axes XLA picks the new state's layout: the second step compiles for it.
      p, s, _ = jitted(params, state, data)
      first_state = s
      p, s, _ = jitted(p, s, data)
      out[name] = (p, s, first_state)
    gradient_norm = float(
      jax.jit(lambda p, b: optax.tree.norm(jax.grad(loss)(p, b)))(params, batch)
    )
  reference = sharded_models.reference_similarity(WIDTHS, host_params, host_batch)
  return {
    "gradient_norm": gradient_norm,
    "params": params,
    "out": out,
    "compiled": compiled,
    "explicit": explicit,
    "reference": reference,
  }


def test_fsdp_blocks_stay_blocks_and_adamw_after_a_clip_matches_the_plain_step(fsdp_run):
  plain_params, _, _ = fsdp_run["out"]["plain"]
  groups_params, groups_state, first_state = fsdp_run["out"]["groups"]
  # The clip binds, and saw the whole mean gradient: each block's norm would clip less.
  assert fsdp_run["gradient_norm"] > 2 * 0.05
  for got, want in zip(jax.tree.leaves(groups_params), jax.tree.leaves(plain_params), strict=True):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)
  for before, after in zip(
    jax.tree.leaves(fsdp_run["params"]), jax.tree.leaves(groups_params), strict=True
  ):
    assert after.sharding.is_equivalent_to(before.sharding, after.ndim)
  # AdamW's moments of every kernel stay in blocks: an eighth of it per device (4 x 2 mesh).
  adam_state = groups_state[1][1][0]
  for name, layer in adam_state.mu.items():
    kernel = layer["kernel"]
    assert kernel.addressable_shards[0].data.size * 8 == kernel.size, name
  assert simigrad_jax.similarity(first_state) == pytest.approx(fsdp_run["reference"], abs=1e-5)


def test_fsdp_mean_is_reduce_scattered_not_gathered(fsdp_run):
  groups = fsdp_run["compiled"]["groups"]
  plain = fsdp_run["compiled"]["plain"]
  found = hlo_collectives.parse_collectives(groups.as_text(), jax.device_count())
  kinds = collections.Counter(c.kind for c in found)
  assert kinds["collective-permute"] == 0, kinds
  # No kernel travels whole (64 x 64 float32: 16 KiB); the largest piece is a gathered block of
  # a tensor-parallel kernel (64 x 32) or the head.
  assert max(c.payload_bytes for c in found) < 64 * 64 * 4, found
  if fsdp_run["explicit"]:  # under Auto, XLA may lay the plain step out around the blocks
    groups_temp = groups.memory_analysis().temp_size_in_bytes
    assert groups_temp <= 1.05 * plain.memory_analysis().temp_size_in_bytes


def test_the_examples_in_the_docstrings_run(devices):
  del devices
  for module in (data_blocks, device_halves_step_module):
    assert doctest.testmod(module).failed == 0, module.__name__
