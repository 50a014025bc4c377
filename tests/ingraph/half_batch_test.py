"""simigrad_jax.value_and_half_grads: exact against jax.grad and NumPy in float64, BatchNorm
per half, aux, errors, non-finite halves, shard_map, and one half's activations at a time."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import simigrad_jax
from simigrad_jax.ingraph import half_batch

TIGHT = {"rtol": 1e-10, "atol": 1e-12}


@pytest.fixture
def x64():
  """Float64 arrays for the duration of one test."""
  with jax.enable_x64(True):
    yield


def _halves_of(batch):
  """The even-numbered and the odd-numbered examples: the halves value_and_half_grads compares."""
  return jax.tree.map(lambda x: x[0::2], batch), jax.tree.map(lambda x: x[1::2], batch)


def _assert_trees_close(actual, expected, **tolerance):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, a.dtype, e.shape, e.dtype)
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), **tolerance)


class MLP(nn.Module):
  """Two dense layers with a tanh between, all in float64."""

  @nn.compact
  def __call__(self, x):
    dense = lambda n: nn.Dense(n, dtype=jnp.float64, param_dtype=jnp.float64)
    return dense(3)(jnp.tanh(dense(8)(x)))


class BatchNormNet(nn.Module):
  """Conv, BatchNorm in training mode, ReLU, mean pool and dense, all in float64."""

  @nn.compact
  def __call__(self, x):
    kwargs = {"dtype": jnp.float64, "param_dtype": jnp.float64}
    x = nn.Conv(4, (3, 3), **kwargs)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, **kwargs)(x))
    return nn.Dense(3, **kwargs)(jnp.mean(x, axis=(1, 2)))


def _cross_entropy(logits, labels):
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def test_linear_regression_matches_numpy_in_float64(x64):
  del x64
  rng = np.random.default_rng(0)
  x, y, w = rng.normal(size=(10, 4)), rng.normal(size=(10,)), rng.normal(size=(4,))
  loss = lambda w, batch: jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
  batch = {"x": jnp.asarray(x), "y": jnp.asarray(y)}

  value, grads, halves = jax.jit(simigrad_jax.value_and_half_grads(loss))(jnp.asarray(w), batch)

  def numpy_grad(rows):
    xs, ys = x[rows], y[rows]
    return 2 / len(ys) * xs.T @ (xs @ w - ys)

  assert grads.dtype == halves.first.dtype == jnp.float64
  np.testing.assert_allclose(value, np.mean((x @ w - y) ** 2), **TIGHT)
  np.testing.assert_allclose(halves.first, numpy_grad(slice(0, None, 2)), **TIGHT)
  np.testing.assert_allclose(halves.second, numpy_grad(slice(1, None, 2)), **TIGHT)
  np.testing.assert_allclose(grads, numpy_grad(slice(None)), **TIGHT)
  assert not np.allclose(halves.first, halves.second)  # the halves saw different rows


def test_mean_of_halves_is_the_full_batch_gradient_in_float64(x64):
  del x64
  model = MLP()
  rng = np.random.default_rng(1)
  batch = {
    "x": jnp.asarray(rng.normal(size=(12, 5))),
    "y": jnp.asarray(rng.integers(0, 3, size=12), jnp.int32),
  }
  params = model.init(jax.random.key(0), batch["x"])
  loss = lambda p, b: _cross_entropy(model.apply(p, b["x"]), b["y"])

  value, grads, halves = jax.jit(simigrad_jax.value_and_half_grads(loss))(params, batch)

  full_value, full_grads = jax.value_and_grad(loss)(params, batch)
  first, second = _halves_of(batch)
  np.testing.assert_allclose(value, full_value, **TIGHT)
  _assert_trees_close(grads, full_grads, **TIGHT)
  _assert_trees_close(halves.first, jax.grad(loss)(params, first), **TIGHT)
  _assert_trees_close(halves.second, jax.grad(loss)(params, second), **TIGHT)
  mean = jax.tree.map(lambda a, b: (a + b) / 2, halves.first, halves.second)
  _assert_trees_close(mean, full_grads, **TIGHT)


def test_batchnorm_normalises_each_half_with_its_own_statistics(x64):
  del x64
  model = BatchNormNet()
  rng = np.random.default_rng(2)
  # The halves (even and odd rows) have different means, so per-half and full-batch
  # statistics differ.
  images = rng.normal(size=(8, 6, 6, 2)) + np.tile([0.0, 3.0], 4)[:, None, None, None]
  batch = {"image": jnp.asarray(images), "label": jnp.asarray(rng.integers(0, 3, 8), jnp.int32)}
  variables = model.init(jax.random.key(0), batch["image"])
  params, state = variables["params"], {"batch_stats": variables["batch_stats"]}

  def loss(params, batch, state):
    logits, new_state = model.apply(
      {"params": params, **state}, batch["image"], mutable=["batch_stats"]
    )
    return _cross_entropy(logits, batch["label"]), new_state

  (value, new_states), grads, halves = jax.jit(
    simigrad_jax.value_and_half_grads(loss, has_aux=True)
  )(params, batch, state)

  reference = jax.value_and_grad(loss, has_aux=True)
  per_half = [reference(params, half, state) for half in _halves_of(batch)]
  for i, ((_, half_state), half_grads) in enumerate(per_half):
    _assert_trees_close(jax.tree.map(lambda s, i=i: s[i], new_states), half_state, **TIGHT)
    _assert_trees_close(halves[i], half_grads, **TIGHT)
  np.testing.assert_allclose(value, (per_half[0][0][0] + per_half[1][0][0]) / 2, **TIGHT)
  mean = jax.tree.map(lambda a, b: (a + b) / 2, per_half[0][1], per_half[1][1])
  _assert_trees_close(grads, mean, **TIGHT)
  # Not the full-batch gradient: that one normalises over all eight rows.
  (_, _), full_grads = reference(params, batch, state)
  assert not np.allclose(grads["Conv_0"]["kernel"], full_grads["Conv_0"]["kernel"])


def test_aux_leaves_gain_a_leading_axis_of_two_and_args_reach_both_halves():
  def loss(w, batch, scale):
    residual = scale * batch["x"] @ w - batch["y"]
    return jnp.mean(residual**2), {"max": jnp.max(residual), "rows": batch["y"].shape[0]}

  rng = np.random.default_rng(3)
  batch = {
    "x": jnp.asarray(rng.normal(size=(6, 3)), jnp.float32),
    "y": jnp.asarray(rng.normal(size=(6,)), jnp.float32),
  }
  w, scale = jnp.asarray(rng.normal(size=(3,)), jnp.float32), jnp.float32(0.5)

  (value, aux), grads, halves = simigrad_jax.value_and_half_grads(loss, has_aux=True)(
    w, batch, scale
  )

  first, second = _halves_of(batch)
  assert aux["max"].shape == (2,) and aux["rows"].tolist() == [3, 3]
  np.testing.assert_allclose(
    aux["max"], [loss(w, first, scale)[1]["max"], loss(w, second, scale)[1]["max"]], rtol=1e-6
  )
  np.testing.assert_allclose(value, loss(w, batch, scale)[0], rtol=1e-6)
  grad = lambda b: jax.grad(lambda w: loss(w, b, scale)[0])(w)
  np.testing.assert_allclose(halves.first, grad(first), rtol=1e-5)
  np.testing.assert_allclose(halves.second, grad(second), rtol=1e-5)
  np.testing.assert_allclose(grads, grad(batch), rtol=1e-5)


def test_integer_only_batch_orders_through_the_parameters(x64):
  """A batch with no floating-point leaf (token ids) still gets exact halves."""
  del x64
  rng = np.random.default_rng(4)
  params = {"embed": jnp.asarray(rng.normal(size=(7, 3))), "out": jnp.asarray(rng.normal(size=3))}
  tokens = jnp.asarray(rng.integers(0, 7, size=(8, 5)), jnp.int32)

  def loss(p, tokens):
    return jnp.mean(jnp.tanh(p["embed"][tokens] @ p["out"]) ** 2)

  value, grads, halves = jax.jit(simigrad_jax.value_and_half_grads(loss))(params, tokens)

  _assert_trees_close(halves.first, jax.grad(loss)(params, tokens[0::2]), **TIGHT)
  _assert_trees_close(halves.second, jax.grad(loss)(params, tokens[1::2]), **TIGHT)
  _assert_trees_close(grads, jax.grad(loss)(params, tokens), **TIGHT)
  np.testing.assert_allclose(value, loss(params, tokens), **TIGHT)


def test_a_non_finite_first_half_leaves_the_second_half_untouched():
  loss = lambda w, x: jnp.mean(jnp.log(x) * w)
  x = jnp.asarray([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], jnp.float32)  # log(0) = -inf: an even row
  w = jnp.float32(0.5)

  _, grads, halves = jax.jit(simigrad_jax.value_and_half_grads(loss))(w, x)

  assert not np.isfinite(halves.first) and not np.isfinite(grads)
  np.testing.assert_array_equal(halves.second, jax.jit(jax.grad(loss))(w, x[1::2]))
  assert np.isfinite(halves.second)


def test_low_precision_gradients_are_averaged_in_float32():
  loss = lambda w, x: jnp.mean(x * w)
  x = jnp.full((4,), 60000.0, jnp.float16)  # each half's gradient is 60000
  w = jnp.ones((), jnp.float16)

  _, grads, halves = simigrad_jax.value_and_half_grads(loss)(w, x)

  assert grads.dtype == halves.first.dtype == jnp.float16
  assert halves.first == halves.second == 60000
  assert halves.first + halves.second == np.inf  # a float16 sum would overflow
  assert grads == 60000


@pytest.mark.parametrize(
  "size, message",
  [
    (5, "5 examples"),
    (0, None),
  ],
)
def test_odd_or_empty_batches_are_refused(size, message):
  loss = lambda w, x: jnp.mean(x * w)
  if message is None:
    with pytest.raises(ValueError, match="at least one array"):
      simigrad_jax.value_and_half_grads(loss)(jnp.ones(()), {})
    return
  with pytest.raises(ValueError, match=message):
    simigrad_jax.value_and_half_grads(loss)(jnp.ones(()), jnp.ones((size,)))


def test_leaves_with_different_leading_sizes_are_refused():
  loss = lambda w, b: jnp.mean(b["x"] * w) + jnp.mean(b["y"])
  with pytest.raises(ValueError, match="same leading"):
    simigrad_jax.value_and_half_grads(loss)(jnp.ones(()), {"x": jnp.ones(4), "y": jnp.ones(6)})


@pytest.mark.parametrize("integer_batch", [False, True])
def test_under_shard_map_with_varying_types(devices, integer_batch):
  """check_vma=True traces both orderings (through the batch or the parameters)."""
  mesh = Mesh(np.array(devices), ("batch",))
  w = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)
  rows = np.arange(len(devices) * 4 * 3).reshape(-1, 3) % 5
  x = jnp.asarray(rows, jnp.int32 if integer_batch else jnp.float32)
  loss = lambda w, x: jnp.mean((x.astype(jnp.float32) @ w) ** 2)

  def per_device(w, x):
    w = jax.lax.pcast(w, "batch", to="varying")
    _, grads, halves = simigrad_jax.value_and_half_grads(loss)(w, x)
    return grads[None], halves.first[None], halves.second[None]

  grads, first, second = jax.jit(
    jax.shard_map(
      per_device, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P("batch"), check_vma=True
    )
  )(w, x)

  for d in range(len(devices)):
    local = x[4 * d : 4 * d + 4]
    np.testing.assert_allclose(first[d], jax.grad(loss)(w, local[0::2]), rtol=1e-6)
    np.testing.assert_allclose(second[d], jax.grad(loss)(w, local[1::2]), rtol=1e-6)
    np.testing.assert_allclose(grads[d], jax.grad(loss)(w, local), rtol=1e-6)


class ConvNet(nn.Module):
  """Three 3x3 convolutions and a dense layer: activations dominate its memory."""

  @nn.compact
  def __call__(self, x):
    for _ in range(3):
      x = nn.relu(nn.Conv(16, (3, 3))(x))
    return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


@pytest.mark.parametrize("image_dtype", [jnp.float32, jnp.int32])
def test_the_halves_run_one_after_the_other(image_dtype):
  """Temporary memory holds one half's activations, not both (XLA would interleave them)."""
  model = ConvNet()
  batch = {"image": jnp.ones((64, 32, 32, 3), image_dtype), "label": jnp.zeros(64, jnp.int32)}
  params = model.init(jax.random.key(0), jnp.ones((1, 32, 32, 3)))

  def loss(p, b):
    return _cross_entropy(model.apply(p, b["image"].astype(jnp.float32)), b["label"])

  def temp_bytes(fn):
    return jax.jit(fn).lower(params, batch).compile().memory_analysis().temp_size_in_bytes

  plain = temp_bytes(jax.value_and_grad(loss))
  halves = temp_bytes(simigrad_jax.value_and_half_grads(loss))
  assert halves <= 0.75 * plain, (halves, plain)


def test_a_batch_of_no_examples_is_refused_naming_its_size():
  loss = lambda w, x: jnp.mean(x * w)
  with pytest.raises(ValueError, match="0 examples.*even number of examples, at least 2"):
    simigrad_jax.value_and_half_grads(loss)(jnp.ones(()), jnp.ones((0, 3)))


@pytest.mark.parametrize("has_aux", [False, True])
def test_a_per_example_loss_is_refused_naming_the_mean(has_aux):
  losses = lambda w, x: (x @ w) ** 2  # one loss per example, not their mean
  loss = (lambda w, x: (losses(w, x), None)) if has_aux else losses
  with pytest.raises(ValueError, match=r"shape \(2,\).*scalar.*MEAN.*jnp\.mean\(losses\)"):
    simigrad_jax.value_and_half_grads(loss, has_aux=has_aux)(jnp.ones(3), jnp.ones((4, 3)))


def test_every_passes_gives_the_sequential_numbers_with_batchnorm_aux_and_split_labels(x64):
  del x64
  net = BatchNormNet()
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(8, 6, 6, 2)), np.arange(8) % 3
  variables = net.init(jax.random.key(0), x)

  def loss(params, images, labels, stats):
    logits, new_stats = net.apply(
      {"params": params, "batch_stats": stats}, images, mutable=["batch_stats"]
    )
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels)), new_stats

  results = {
    passes: jax.jit(
      simigrad_jax.value_and_half_grads(loss, has_aux=True, batch_argnums=(1, 2), passes=passes)
    )(variables["params"], x, y, variables["batch_stats"])
    for passes in half_batch.PASSES
  }
  for passes in ("stacked", "signed"):
    _assert_trees_close(results[passes], results["sequential"], rtol=1e-9, atol=1e-12)
  # Each half is normalised with its own statistics: the halves' aux differ.
  stats = jax.tree.leaves(results["stacked"][0][1])[0]
  assert stats.shape[0] == 2 and not np.allclose(stats[0], stats[1])
