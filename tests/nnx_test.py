"""SimiGrad in a Flax NNX training loop in the style of flax's MNIST example, on the digits.

A small CNN with BatchNorm and Dropout, ``nnx.Optimizer`` and ``nnx.jit``;
SimiGrad changes the gradient call, the optimizer's update and the metrics'
label order. The tests check what the halves do to the model's other state
(BatchNorm's running statistics, the dropout keys) and that the learning-rate
factor set on the host reaches the update.
"""

from __future__ import annotations

import doctest
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import simigrad_jax
from simigrad_jax import flax_nnx
from train.image_data import load_digits

BATCH = 64


class CNN(nnx.Module):
  """A small CNN for the 8x8 digits (the layers of flax's MNIST example, smaller)."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
    self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(4 * 4 * 8, 32, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.25, rngs=rngs)
    self.linear2 = nnx.Linear(32, 10, rngs=rngs)

  def __call__(self, x):
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.conv1(x))))
    x = x.reshape(x.shape[0], -1)
    x = self.dropout1(nnx.relu(self.linear1(x)))
    return self.linear2(x)


def loss_fn(model: CNN, batch):
  logits = model(batch["image"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return loss, logits


def make_optimizer(model: CNN) -> nnx.Optimizer:
  tx = optax.chain(
    simigrad_jax.transform(),  # SimiGrad: the similarity of the two halves
    optax.adamw(0.005, 0.9),
    simigrad_jax.scale_by_lr_factor(),  # SimiGrad: the learning-rate factor
  )
  return nnx.Optimizer(model, tx, wrt=nnx.Param)


@nnx.jit
def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch):
  grad_fn = simigrad_jax.nnx_value_and_half_grads(loss_fn, has_aux=True)  # SimiGrad
  (loss, logits), grads, halves = grad_fn(model, batch)
  labels = jnp.stack([batch["label"][0::2], batch["label"][1::2]])  # the halves' rows
  metrics.update(loss=loss, logits=logits.reshape(-1, 10), labels=labels.reshape(-1))
  optimizer.update(model, grads, half_grads=halves)  # SimiGrad: half_grads


@nnx.jit
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
  loss, logits = loss_fn(model, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])


@pytest.fixture(scope="module")
def digits():
  return load_digits()


def batch_at(data, step: int, size: int = BATCH):
  return {k: v[step * size : (step + 1) * size] for k, v in data.items()}


def test_the_loop_trains_and_measures_the_similarity(digits):
  train, test = digits
  model = CNN(rngs=nnx.Rngs(0))
  optimizer = make_optimizer(model)
  metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
  model.eval()
  eval_step(model, metrics, test)
  before = metrics.compute()
  metrics.reset()
  similarities = []
  for step in range(6):
    model.train()
    train_step(model, optimizer, metrics, batch_at(train, step))
    similarities.append(simigrad_jax.similarity(optimizer.opt_state))
  assert metrics.compute()["accuracy"] > 0.1
  metrics.reset()
  model.eval()
  eval_step(model, metrics, test)
  after = metrics.compute()
  assert after["loss"] < before["loss"]
  assert all(-1 <= s <= 1 for s in similarities) and len(set(similarities)) > 1
  assert int(optimizer.step[...]) == 6


def test_running_statistics_are_the_average_of_the_halves(digits):
  train, _ = digits
  model = CNN(rngs=nnx.Rngs(1))
  optimizer = make_optimizer(model)
  metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
  batch = batch_at(train, 0)
  # Each half alone, through a copy of the layers before the step: its running statistics.
  expected = []
  for rows in (slice(0, None, 2), slice(1, None, 2)):
    copy = nnx.clone(model)
    copy.train()
    copy.batch_norm1(copy.conv1(jnp.asarray(batch["image"][rows])))
    expected.append(copy.batch_norm1)
  old_mean = np.asarray(model.batch_norm1.mean[...])
  model.train()
  train_step(model, optimizer, metrics, batch)
  for name in ("mean", "var"):
    new = np.asarray(getattr(model.batch_norm1, name)[...])
    halves = [np.asarray(getattr(bn, name)[...]) for bn in expected]
    np.testing.assert_allclose(new, (halves[0] + halves[1]) / 2, rtol=1e-5, atol=1e-6)
    assert not np.allclose(halves[0], halves[1])  # the halves' statistics differ
  assert np.abs(np.asarray(model.batch_norm1.mean[...]) - old_mean).max() > 1e-3


def test_each_half_draws_its_own_dropout_mask():
  model = CNN(rngs=nnx.Rngs(2))

  def masks(model, batch):  # the dropout layer's mask on a batch of ones, one per half
    return jnp.mean(batch["x"]) * model.linear2.bias[...].sum(), model.dropout1(jnp.ones((4, 32)))

  @nnx.jit
  def draw(model, batch):
    (_, kept), _, _ = simigrad_jax.nnx_value_and_half_grads(masks, has_aux=True)(model, batch)
    return kept

  model.train()
  first = np.asarray(draw(model, {"x": jnp.ones((4, 1))}))
  second = np.asarray(draw(model, {"x": jnp.ones((4, 1))}))
  assert first.shape == (2, 4, 32)
  for kept in (first, second):
    assert 0.1 < (kept == 0).mean() < 0.4  # rate 0.25
    assert not np.array_equal(kept[0] == 0, kept[1] == 0)  # the halves' masks differ
  assert not np.array_equal(first, second)  # and the streams move on between steps


def test_the_learning_rate_factor_reaches_the_update(digits):
  train, _ = digits
  batch = batch_at(train, 0)
  moves = []
  for factor in (1.0, 2.5):
    model = CNN(rngs=nnx.Rngs(3))
    optimizer = make_optimizer(model)
    simigrad_jax.set_nnx_lr_factor(optimizer, factor)
    assert simigrad_jax.lr_factor_of(optimizer.opt_state) == factor
    before = np.asarray(model.linear2.kernel[...])
    model.train()
    train_step(model, optimizer, nnx.MultiMetric(loss=nnx.metrics.Average("loss")), batch)
    moves.append(np.asarray(model.linear2.kernel[...]) - before)
  np.testing.assert_allclose(moves[1], 2.5 * moves[0], rtol=1e-4, atol=1e-7)
  assert np.abs(moves[0]).max() > 0
  with pytest.raises(ValueError, match="must be a finite number > 0"):
    simigrad_jax.set_nnx_lr_factor(optimizer, 0.0)
  with pytest.raises(ValueError, match="set_nnx_lr_factor takes an nnx.Optimizer"):
    simigrad_jax.set_nnx_lr_factor(optimizer.opt_state, 2.0)


class TutorialCNN(nnx.Module):
  """The flax MNIST tutorial's model shape, with its ``rngs`` passed to ``__call__``.

  Two convolutions with BatchNorm, Dropout built without a stream (it takes
  the one the call gives), average pooling and two dense layers.
  """

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(8, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.025)
    self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(16, rngs=rngs)
    self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(4 * 4 * 16, 32, rngs=rngs)
    self.dropout2 = nnx.Dropout(rate=0.25)
    self.linear2 = nnx.Linear(32, 10, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    x = self.dropout1(nnx.relu(self.batch_norm1(self.conv1(x))), rngs=rngs)
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = self.dropout2(nnx.relu(self.linear1(x.reshape(x.shape[0], -1))), rngs=rngs)
    return self.linear2(x)


def tutorial_loss(model: TutorialCNN, batch, rngs: nnx.Rngs):
  logits = model(batch["image"], rngs)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return loss, logits


@nnx.jit
def tutorial_step(model, optimizer, rngs, batch):
  """The tutorial's step with SimiGrad: an nnx.Rngs, or a key wrapped into one here."""
  if not isinstance(rngs, nnx.Rngs):
    rngs = nnx.Rngs(dropout=rngs)
  grad_fn = simigrad_jax.nnx_value_and_half_grads(tutorial_loss, has_aux=True)
  (loss, _), grads, halves = grad_fn(model, batch, rngs)
  optimizer.update(model, grads, half_grads=halves)
  return loss


@pytest.mark.parametrize("given", ["rngs", "key"])
def test_the_tutorial_model_with_rngs_passed_to_call_trains(digits, given):
  train, _ = digits
  model = TutorialCNN(rngs=nnx.Rngs(0))
  optimizer = make_optimizer(model)
  rngs = nnx.Rngs(dropout=7) if given == "rngs" else jax.random.key(7)
  model.train()
  losses = [float(tutorial_step(model, optimizer, rngs, batch_at(train, i % 4))) for i in range(12)]
  assert np.mean(losses[-4:]) < np.mean(losses[:4])
  assert -1 <= simigrad_jax.similarity(optimizer.opt_state) <= 1
  if given == "rngs":  # the stream moved on, once a dropout layer a step: new masks each step
    assert int(rngs.dropout.count[...]) == 2 * 12
  assert not hasattr(model, flax_nnx._LENT)  # the stream was lent for the call only


def test_an_rngs_argument_gives_each_half_its_own_mask():
  model = TutorialCNN(rngs=nnx.Rngs(0))

  def masks(model, batch, rngs):
    return jnp.mean(batch["x"]) * model.linear2.bias[...].sum(), model.dropout2(
      jnp.ones((4, 32)), rngs=rngs
    )

  @nnx.jit
  def draw(model, batch, rngs):
    grad_fn = simigrad_jax.nnx_value_and_half_grads(masks, has_aux=True)
    (_, kept), _, _ = grad_fn(model, batch, rngs)
    return kept

  rngs = nnx.Rngs(dropout=3)
  first = np.asarray(draw(model, {"x": jnp.ones((4, 1))}, rngs))
  second = np.asarray(draw(model, {"x": jnp.ones((4, 1))}, rngs))
  assert 0.1 < (first == 0).mean() < 0.4  # rate 0.25
  assert not np.array_equal(first[0] == 0, first[1] == 0)  # the halves' masks differ
  assert not np.array_equal(first, second)  # and the stream moves on between steps


def test_a_stream_the_loss_reaches_from_outside_is_refused_with_the_fix(digits):
  train, _ = digits
  model = TutorialCNN(rngs=nnx.Rngs(0))
  outside = nnx.Rngs(dropout=1)

  @nnx.jit
  def step(model, batch):
    grad_fn = simigrad_jax.nnx_value_and_half_grads(
      lambda model, batch: tutorial_loss(model, batch, outside), has_aux=True
    )
    return grad_fn(model, batch)[0][0]

  model.train()
  with pytest.raises(flax_nnx.NNXStateError) as refused:
    step(model, batch_at(train, 0))
  message = str(refused.value)
  assert "grad_fn(model, batch, rngs), works" in message
  assert "nnx.Dropout(0.25, rngs=rngs)" in message and "x = self.dropout(x)" in message
  assert isinstance(refused.value, simigrad_jax.SimiGradError)


def test_set_lr_factor_on_an_nnx_optimizers_state_names_set_nnx_lr_factor():
  model = CNN(rngs=nnx.Rngs(0))
  optimizer = make_optimizer(model)
  with pytest.raises(ValueError, match=r"NNX variables .*set_nnx_lr_factor\(optimizer, factor\)"):
    simigrad_jax.set_lr_factor(optimizer.opt_state, 2.0)
  assert simigrad_jax.lr_factor_of(optimizer.opt_state) == 1.0  # nothing changed
  simigrad_jax.set_nnx_lr_factor(optimizer, 2.0)  # the named fix works
  assert simigrad_jax.lr_factor_of(optimizer.opt_state) == 2.0


def test_a_pytree_of_parameters_is_refused_naming_the_other_function():
  grad_fn = simigrad_jax.nnx_value_and_half_grads(lambda p, x: jnp.mean(x @ p["w"]))
  with pytest.raises(
    ValueError, match="takes an nnx.Module first, got dict; .*value_and_half_grads"
  ):
    grad_fn({"w": jnp.ones(2)}, jnp.ones((4, 2)))


def _squared_error(model, x, y, *unused):
  return jnp.mean((model(x) - y) ** 2)


def test_batch_argnums_splits_the_labels_with_the_inputs_or_one_line_refuses():
  """``loss(model, x, y)``: by default ``y`` would go whole to both halves, so it is refused with
  the setting that splits it; with it, each half's gradient is that of its own rows of both."""
  from simigrad_jax.ingraph import HalfBatchArgumentError

  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  x = jnp.arange(24.0).reshape(8, 3) / 10
  y = jnp.arange(8.0).reshape(8, 1)
  with pytest.raises(
    HalfBatchArgumentError,
    match=r"argument 2 .* nnx_value_and_half_grads\(loss_fn, batch_argnums=\(1, 2\)\)",
  ):
    simigrad_jax.nnx_value_and_half_grads(_squared_error)(model, x, y)
  with pytest.raises(HalfBatchArgumentError, match=r"batch_argnums=0 is not valid.*0 is the model"):
    simigrad_jax.nnx_value_and_half_grads(_squared_error, batch_argnums=0)
  for bad in (True, 2.0):
    with pytest.raises(HalfBatchArgumentError, match=rf"batch_argnums={bad} is not valid"):
      simigrad_jax.nnx_value_and_half_grads(_squared_error, batch_argnums=bad)
  simigrad_jax.nnx_value_and_half_grads(_squared_error, batch_argnums=(np.int64(1), np.int64(2)))
  grad_fn = simigrad_jax.nnx_value_and_half_grads(_squared_error, batch_argnums=(1, 2))
  # An nnx.Rngs after the split arguments goes whole to both halves, lent to the model.
  loss, grads, halves = nnx.jit(grad_fn)(model, x, y, nnx.Rngs(1))
  for got, rows in ((halves.first, slice(0, None, 2)), (halves.second, slice(1, None, 2))):
    want = nnx.grad(_squared_error)(model, x[rows], y[rows])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5)
  np.testing.assert_allclose(loss, _squared_error(model, x, y), rtol=1e-5)
  assert np.abs(np.asarray(grads["kernel"][...])).max() > 0


def test_docstring_examples():
  result = doctest.testmod(flax_nnx, optionflags=doctest.ELLIPSIS)
  assert result.attempted >= 10 and result.failed == 0


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit])
def test_on_a_data_parallel_mesh_the_halves_are_the_even_and_odd_examples(devices, axis_type):
  mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(axis_type,))
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 16)).astype(np.float32)
  y = rng.normal(size=(64, 8)).astype(np.float32)
  loss_fn = lambda model, b: jnp.mean((model(b["x"]) - b["y"]) ** 2)
  with jax.set_mesh(mesh):
    model = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
    batch = jax.device_put({"x": x, "y": y}, NamedSharding(mesh, P("data")))
    _, grads, halves = nnx.jit(simigrad_jax.nnx_value_and_half_grads(loss_fn))(model, batch)
  plain = lambda rows: nnx.grad(loss_fn)(nnx.Linear(16, 8, rngs=nnx.Rngs(0)), rows)
  host = {"x": x, "y": y}
  for got, rows in (
    (grads, host),
    (halves.first, jax.tree.map(lambda a: a[0::2], host)),
    (halves.second, jax.tree.map(lambda a: a[1::2], host)),
  ):
    want = plain(rows)
    np.testing.assert_allclose(
      np.asarray(got["kernel"][...]), want["kernel"][...], rtol=2e-5, atol=1e-6
    )
    np.testing.assert_allclose(
      np.asarray(got["bias"][...]), want["bias"][...], rtol=2e-5, atol=1e-6
    )
