"""The plain-``jax.jit`` recipes of docs/own_step.md with a convolution, on Auto and on Explicit axes.

``jax.make_mesh`` makes Explicit axes by default, where a convolution fails in
JAX (``ShardingTypeError ... conv_general_dilated``) in any gradient step. Each
recipe runs here as the docs write it for both: on Auto axes as it is, on
Explicit axes with the model's forward pass under ``jax.sharding.auto_axes``
(``device_halves_step`` needs no change: its data axis is manual). Where the
Explicit axes are the data axis alone, ``value_and_half_grads`` runs its
passes with that axis Auto, so a convolution needs no change either; beside
a model axis the SimiGrad step's error names both fixes.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import simigrad_jax

ROWS = 32


class ConvNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(4, (3, 3))(x))
    return nn.Dense(1)(x.reshape(x.shape[0], -1))[:, 0]


class NnxConvNet(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.conv = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
    self.linear = nnx.Linear(8 * 8 * 4, 1, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.conv(x))
    return self.linear(x.reshape(x.shape[0], -1))[:, 0]


def make_mesh(axes: str) -> jax.sharding.Mesh:
  if axes == "auto":
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  return jax.make_mesh((8,), ("data",))  # Explicit: make_mesh's default


def examples(mesh):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(ROWS, 8, 8, 1)).astype(np.float32)
  y = x.mean((1, 2, 3)).astype(np.float32)
  return jax.device_put({"x": x, "y": y}, NamedSharding(mesh, P("data")))


def predict_fn(axes: str, apply):
  """The model's forward pass as the docs write it: under Auto axes on an Explicit mesh."""
  if axes == "explicit":
    return jax.sharding.auto_axes(apply, out_sharding=P("data"))
  return apply


def linen_step(axes: str, recipe: str):
  predict = predict_fn(axes, lambda params, x: ConvNet().apply({"params": params}, x))

  def loss_fn(params, batch):
    return jnp.mean((predict(params, batch["x"]) - batch["y"]) ** 2)

  if recipe == "device_halves_step":  # one device's rows, the data axis manual: no change
    optimizer = optax.chain(simigrad_jax.transform("data"), optax.adam(0.01))

    def local_loss(params, batch):
      return jnp.mean((ConvNet().apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

    return optimizer, jax.jit(simigrad_jax.device_halves_step(local_loss, optimizer))
  optimizer = optax.chain(simigrad_jax.transform(), optax.adam(0.01))

  @jax.jit
  def train_step(params, opt_state, batch):
    loss, grads, halves = simigrad_jax.value_and_half_grads(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params, half_grads=halves)
    return optax.apply_updates(params, updates), opt_state, loss

  return optimizer, train_step


@pytest.mark.parametrize("axes", ["auto", "explicit"])
@pytest.mark.parametrize("recipe", ["value_and_half_grads", "device_halves_step"])
def test_the_linen_recipes_train_a_conv_net_on_both_kinds_of_axes(axes, recipe):
  mesh = make_mesh(axes)
  batch = examples(mesh)
  params = ConvNet().init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32))["params"]
  optimizer, train_step = linen_step(axes, recipe)
  opt_state = optimizer.init(params)
  losses = []
  with jax.set_mesh(mesh):
    for _ in range(4):
      params, opt_state, loss = train_step(params, opt_state, batch)
      losses.append(float(loss))
  assert losses[-1] < losses[0]
  assert -1 <= simigrad_jax.similarity(opt_state) <= 1


@pytest.mark.parametrize("axes", ["auto", "explicit"])
def test_the_nnx_recipe_trains_a_conv_net_on_both_kinds_of_axes(axes):
  mesh = make_mesh(axes)
  batch = examples(mesh)
  model = NnxConvNet(rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(
    model, optax.chain(simigrad_jax.transform(), optax.adam(0.01)), wrt=nnx.Param
  )

  @nnx.jit
  def train_step(model, optimizer, batch):
    graphdef, params = nnx.split(model, nnx.Param)
    predict = predict_fn(axes, lambda params, x: nnx.merge(graphdef, params, copy=True)(x))

    def loss_fn(params, batch):
      return jnp.mean((predict(params, batch["x"]) - batch["y"]) ** 2)

    loss, grads, halves = simigrad_jax.value_and_half_grads(loss_fn)(params, batch)
    optimizer.update(model, grads, half_grads=halves)
    return loss

  with jax.set_mesh(mesh):
    losses = [float(train_step(model, optimizer, batch)) for _ in range(4)]
  assert losses[-1] < losses[0]
  assert -1 <= simigrad_jax.similarity(optimizer.opt_state) <= 1


def test_a_conv_on_explicit_data_axes_alone_trains_without_auto_axes():
  """On a mesh whose Explicit axes are the data axis alone the passes run with it Auto."""
  mesh = make_mesh("explicit")
  batch = examples(mesh)
  params = ConvNet().init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32))["params"]

  def loss_fn(params, batch):
    return jnp.mean((ConvNet().apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

  step = jax.jit(simigrad_jax.value_and_half_grads(loss_fn))
  with jax.set_mesh(mesh):
    explicit_loss, explicit_grads, _ = step(params, batch)
  auto = make_mesh("auto")
  with jax.set_mesh(auto):
    auto_loss, auto_grads, _ = step(params, examples(auto))
  np.testing.assert_allclose(float(explicit_loss), float(auto_loss), rtol=1e-6)
  for got, want in zip(jax.tree.leaves(explicit_grads), jax.tree.leaves(auto_grads), strict=True):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_a_conv_on_explicit_axes_beside_a_model_axis_names_both_fixes(devices):
  mesh = jax.make_mesh((len(devices) // 2, 2), ("data", "model"))  # Explicit
  batch = examples(mesh)
  params = ConvNet().init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32))["params"]

  def loss_fn(params, batch):
    return jnp.mean((ConvNet().apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

  with jax.set_mesh(mesh), pytest.raises(ValueError) as refused:
    jax.jit(simigrad_jax.value_and_half_grads(loss_fn))(params, batch)
  message = str(refused.value)
  assert "Explicit axes ['data', 'model']" in message and "conv_general_dilated" in message
  assert "axis_types=(AxisType.Auto,)" in message
  assert "jax.sharding.auto_axes(apply, out_sharding=P('data'))" in message


class NnxBatchNormNet(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.conv = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm = nnx.BatchNorm(4, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)
    self.linear = nnx.Linear(8 * 8 * 4, 1, rngs=rngs)

  def __call__(self, x):
    x = self.dropout(nnx.relu(self.batch_norm(self.conv(x))))
    return self.linear(x.reshape(x.shape[0], -1))[:, 0]


@pytest.mark.parametrize("axes", ["auto", "explicit", "explicit_with_model"])
def test_nnx_value_and_half_grads_on_a_mesh_runs_and_names_auto_axes_beside_a_model_axis(axes):
  if axes == "explicit_with_model":
    mesh = jax.make_mesh((4, 2), ("data", "model"))
  else:
    mesh = make_mesh(axes)
  batch = examples(mesh)
  model = NnxBatchNormNet(rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(
    model, optax.chain(simigrad_jax.transform(), optax.adam(0.01)), wrt=nnx.Param
  )

  def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

  @nnx.jit
  def train_step(model, optimizer, batch):
    loss, grads, halves = simigrad_jax.nnx_value_and_half_grads(loss_fn)(model, batch)
    optimizer.update(model, grads, half_grads=halves)
    return loss

  model.train()
  with jax.set_mesh(mesh):
    if axes == "explicit_with_model":
      with pytest.raises(ValueError, match=r"axis_types=\(AxisType.Auto,\)"):
        train_step(model, optimizer, batch)
      return
    losses = [float(train_step(model, optimizer, batch)) for _ in range(4)]
  assert losses[-1] < losses[0]
