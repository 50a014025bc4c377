"""simigrad_jax.device_halves_step: a plain-jit step whose halves are the data axis's even and
odd devices, on a 4 x 2 mesh with Auto and Explicit axes: the plain step's update, the float64
similarity of the dealt batch's even and odd examples, no collective-permute, no gathered
tensor-parallel kernel, the parameters' sharding kept; deal_to_devices and the errors."""

import collections

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import simigrad_jax
from benchmarks import hlo_collectives
from benchmarks import sharded_models

WIDTHS = (64, 64, 10)
BATCH = 32


@pytest.fixture(scope="module", params=["auto", "explicit"])
def run(request, devices):
  """One step of the plain and the groups step on the tensor-parallel layout, compiled."""
  del devices  # 8 devices, set up by conftest
  axes = request.param
  explicit = axes == "explicit"
  mesh = sharded_models.make_mesh("tp", axes)
  host_params = sharded_models.init_params(WIDTHS)
  host_batch = sharded_models.make_batch(WIDTHS, BATCH)
  params, batch = sharded_models.place(host_params, host_batch, mesh, "tp")
  _, dealt = sharded_models.place(
    host_params, simigrad_jax.deal_to_devices(host_batch, mesh.shape["data"]), mesh, "tp"
  )
  specs = jax.tree.map(lambda a: a.sharding.spec, params)
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
  dealt = simigrad_jax.deal_to_devices(batch, 4)
  blocks = dealt["x"].reshape(4, 3) // 10
  for position, block in enumerate(blocks):
    assert set(block % 4) == {position}
  np.testing.assert_array_equal(dealt["y"][:, 0] // 2, dealt["x"] // 10)
  with pytest.raises(ValueError, match="not a multiple of num_devices=5"):
    simigrad_jax.deal_to_devices(batch, 5)
  with pytest.raises(ValueError, match="num_devices=0"):
    simigrad_jax.deal_to_devices(batch, 0)


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
  with jax.set_mesh(mesh), pytest.raises(simigrad_jax.AxisNameError, match="axis_name='batch'"):
    step(w, unnamed.init(w), x)


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
