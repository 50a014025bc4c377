"""simigrad_jax.transform against a float64 NumPy reference, under pmap and shard_map."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import simigrad_jax
from simigrad_jax.reductions import half_statistics
from simigrad_jax.reductions import halves_reduction

AXIS = "batch"


def random_grads(rng, num_devices, mixed_dtypes):
  """Per-device gradients (leading device axis) of a pytree with mixed shapes and dtypes."""
  shapes = {"conv": (3, 3, 2, 4), "dense": {"kernel": (7, 5), "bias": (5,)}, "scale": ()}
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
  dtypes = [jnp.bfloat16 if mixed_dtypes and i % 2 else jnp.float32 for i in range(len(leaves))]
  # A shared signal plus per-device noise, so the halves are similar but not equal.
  arrays = [
    (rng.normal(size=shape) + 0.7 * rng.normal(size=(num_devices,) + shape)).astype(dtype)
    for shape, dtype in zip(leaves, dtypes)
  ]
  return jax.tree.unflatten(treedef, arrays)


def reference(per_device, first_half, second_half):
  """float64 mean over all devices and cos between the means of two device subsets."""
  as64 = lambda t: [np.asarray(x, np.float64) for x in jax.tree.leaves(t)]
  leaves = as64(per_device)
  mean = [x.mean(axis=0) for x in leaves]
  flat = lambda sel: np.concatenate([x[sel].mean(axis=0).ravel() for x in leaves])
  g_a, g_b = flat(first_half), flat(second_half)
  cos = g_a @ g_b / (np.linalg.norm(g_a) * np.linalg.norm(g_b))
  return mean, cos, np.linalg.norm(g_a), np.linalg.norm(g_b), np.linalg.norm((g_a + g_b) / 2)


def tolerance(mixed_dtypes):
  return dict(rtol=3e-2, atol=3e-2) if mixed_dtypes else dict(rtol=2e-5, atol=2e-5)


def map_over_devices(fn, num_devices, mapper):
  """Maps ``fn(*per_device_args)`` over ``num_devices`` devices; inputs carry a leading device axis."""
  devices = jax.devices()[:num_devices]
  if mapper == "pmap":
    return jax.pmap(fn, axis_name=AXIS, devices=devices)
  mesh = Mesh(np.array(devices), (AXIS,))

  def per_block(*args):
    return fn(*jax.tree.map(lambda x: x[0], args))

  mapped = jax.shard_map(per_block, mesh=mesh, in_specs=P(AXIS), out_specs=P())
  # Outputs are replicated: give them the pmap layout (leading device axis) for the checks.
  return jax.jit(
    lambda *args: jax.tree.map(
      lambda x: jnp.broadcast_to(x, (num_devices,) + x.shape), mapped(*args)
    )
  )


@functools.cache
def compiled_device_split(num_devices, mapper, reduction, small_leaf_size=None):
  """The transform's update, mapped; ``small_leaf_size`` overrides the bucketing threshold."""
  tx = simigrad_jax.transform(AXIS, reduction=reduction)

  def step(grads):
    return tx.update(grads, tx.init(grads))

  return bucketing(map_over_devices(step, num_devices, mapper), small_leaf_size)


def bucketing(fn, small_leaf_size):
  """``fn``, traced with leaves of ``small_leaf_size`` entries or more reduced on their own."""
  if small_leaf_size is None:
    return fn

  def traced_with_threshold(*args):
    saved = halves_reduction.SMALL_LEAF_SIZE
    halves_reduction.SMALL_LEAF_SIZE = small_leaf_size
    try:
      return fn(*args)
    finally:
      halves_reduction.SMALL_LEAF_SIZE = saved

  return traced_with_threshold


# The device halves are the even and the odd devices, as the reference splits its ranks.
EVEN, ODD = slice(0, None, 2), slice(1, None, 2)
# (reduction, small_leaf_size). The hierarchical reduction twice: with the small leaves of
# this tree in one bucket per dtype, and (threshold 1) with every leaf its own bucket, padded
# where its size is not a multiple of the device count.
REDUCTIONS = pytest.mark.parametrize(
  "reduction,small_leaf_size",
  [("hierarchical", None), ("hierarchical", 1), ("scatter", None), ("stacked", None)],
  ids=["hierarchical", "hierarchical-per-leaf", "scatter", "stacked"],
)
LOCAL_REDUCTIONS = pytest.mark.parametrize(
  "reduction,small_leaf_size",
  [("hierarchical", None), ("hierarchical", 1), ("scatter", None)],
  ids=["hierarchical", "hierarchical-per-leaf", "scatter"],
)


@REDUCTIONS
@pytest.mark.parametrize("mixed_dtypes", [False, True], ids=["f32", "f32+bf16"])
@pytest.mark.parametrize("mapper", ["pmap", "shard_map"])
@pytest.mark.parametrize("num_devices", [2, 4, 8])
def test_device_halves_match_numpy(num_devices, mapper, reduction, mixed_dtypes, small_leaf_size):
  grads = random_grads(np.random.default_rng(num_devices), num_devices, mixed_dtypes)
  mean, state = compiled_device_split(num_devices, mapper, reduction, small_leaf_size)(grads)
  ref_mean, ref_cos, ref_na, ref_nb, ref_nm = reference(grads, EVEN, ODD)
  tol = tolerance(mixed_dtypes)
  for got, want, leaf in zip(jax.tree.leaves(mean), ref_mean, jax.tree.leaves(grads), strict=True):
    assert got.dtype == leaf.dtype  # the mean keeps each leaf's dtype, like lax.pmean
    for device_copy in np.asarray(got, np.float64):
      np.testing.assert_allclose(device_copy, want, **tol)
  assert state.similarity.dtype == jnp.float32
  np.testing.assert_allclose(state.similarity, ref_cos, **tol)
  np.testing.assert_allclose(state.norm_a, ref_na, **tol)
  np.testing.assert_allclose(state.norm_b, ref_nb, **tol)
  np.testing.assert_allclose(state.norm_mean, ref_nm, **tol)
  assert np.all(state.measured) and np.all(state.grads_finite)
  assert 0.0 < float(state.similarity[0]) < 0.999  # the halves differ; not the gradient trap


@functools.cache
def compiled_local_split(num_devices, mapper, reduction="hierarchical", small_leaf_size=None):
  tx = simigrad_jax.transform(AXIS, reduction=reduction)

  def step(first, second):
    updates = jax.tree.map(lambda a, b: (a + b) / 2, first, second)
    return tx.update(updates, tx.init(updates), half_grads=simigrad_jax.HalfGrads(first, second))

  return bucketing(map_over_devices(step, num_devices, mapper), small_leaf_size)


@LOCAL_REDUCTIONS
@pytest.mark.parametrize("mixed_dtypes", [False, True], ids=["f32", "f32+bf16"])
@pytest.mark.parametrize("mapper", ["pmap", "shard_map"])
@pytest.mark.parametrize("num_devices", [1, 3, 8])
def test_local_halves_match_numpy(num_devices, mapper, reduction, mixed_dtypes, small_leaf_size):
  rng = np.random.default_rng(10 + num_devices)
  first = random_grads(rng, num_devices, mixed_dtypes)
  second = random_grads(rng, num_devices, mixed_dtypes)
  mean, state = compiled_local_split(num_devices, mapper, reduction, small_leaf_size)(first, second)
  # Reference: the halves are "first halves of every device" vs "second halves of every device".
  both = jax.tree.map(lambda a, b: np.concatenate([a, b]), first, second)
  ref_mean, ref_cos, ref_na, ref_nb, _ = reference(
    both, slice(0, num_devices), slice(num_devices, None)
  )
  tol = tolerance(mixed_dtypes)
  for got, want, leaf in zip(jax.tree.leaves(mean), ref_mean, jax.tree.leaves(first), strict=True):
    assert got.dtype == leaf.dtype
    np.testing.assert_allclose(np.asarray(got, np.float64)[0], want, **tol)
  np.testing.assert_allclose(state.similarity, ref_cos, **tol)
  np.testing.assert_allclose(state.norm_a, ref_na, **tol)
  np.testing.assert_allclose(state.norm_b, ref_nb, **tol)


@pytest.mark.parametrize("mapper", ["pmap"])
def test_local_halves_on_one_device_are_not_reduced(mapper):
  """An axis of one device under pmap: the halves are the step's own, so no collective runs (the buckets of
  the reduction would copy both gradients: benchmarks/step_cost/halves_steps.py's pmap step on one device
  held 2.25x the plain pmap step's temporary memory, 2.05x without them)."""
  rng = np.random.default_rng(3)
  first, second = random_grads(rng, 1, False), random_grads(rng, 1, False)
  compiled = compiled_local_split(1, mapper).lower(first, second).compile().as_text()
  for collective in ("all-reduce", "reduce-scatter", "all-to-all", "all-gather"):
    assert f" {collective}(" not in compiled, collective


@pytest.mark.parametrize("split", ["device", "local"])
@pytest.mark.parametrize("reduction", ["hierarchical", "scatter"])
def test_buckets_are_filled_with_zeros_in_their_concatenation_not_padded_after_it(split, reduction):
  """The zeros that fill a bucket to a multiple of the devices are one more operand of its
  concatenation. XLA:CPU fused a pad of the concatenation with the leaves' producers into one
  loop, which cost more than the step's matrix products when a producer was a bias gradient's
  sum over the rows."""
  grads = random_grads(np.random.default_rng(0), 8, mixed_dtypes=False)
  assert sum(leaf[0].size for leaf in jax.tree.leaves(grads)) % 8  # some zeros to fill
  if split == "device":
    lowered = compiled_device_split(8, "shard_map", reduction).lower(grads)
  else:
    lowered = compiled_local_split(8, "shard_map", reduction).lower(grads, grads)
  text = lowered.as_text()
  assert "stablehlo.concatenate" in text
  assert "stablehlo.pad" not in text


@functools.cache
def compiled_unequal_local_split(num_devices, reduction, small_leaf_size=None):
  """The local split with halves of different sizes: ``share`` is the first half's fraction."""
  tx = simigrad_jax.transform(AXIS, reduction=reduction)

  def step(first, second, share):
    updates = jax.tree.map(lambda a, b: share * a + (1 - share) * b, first, second)
    halves = simigrad_jax.HalfGrads(first, second, share)
    return tx.update(updates, tx.init(updates), half_grads=halves)

  return bucketing(map_over_devices(step, num_devices, "shard_map"), small_leaf_size)


@LOCAL_REDUCTIONS
@pytest.mark.parametrize("share", [0.3, 1.0])
def test_local_halves_of_unequal_size_match_numpy(reduction, small_leaf_size, share):
  """M = share * g_A + (1 - share) * g_B is returned, and g_A, g_B are measured, not their mean."""
  rng = np.random.default_rng(5)
  first, second = random_grads(rng, 3, False), random_grads(rng, 3, False)
  if share == 1.0:  # the second half holds no example: its gradient is zero
    second = jax.tree.map(np.zeros_like, second)
  mean, state = compiled_unequal_local_split(3, reduction, small_leaf_size)(
    first, second, np.full(3, share, np.float32)
  )
  as64 = lambda t: [np.asarray(x, np.float64).mean(axis=0) for x in jax.tree.leaves(t)]
  g_a, g_b = as64(first), as64(second)
  for got, a, b in zip(jax.tree.leaves(mean), g_a, g_b, strict=True):
    np.testing.assert_allclose(
      np.asarray(got)[0], share * a + (1 - share) * b, rtol=2e-5, atol=2e-5
    )
  flat_a = np.concatenate([x.ravel() for x in g_a])
  flat_b = np.concatenate([x.ravel() for x in g_b])
  np.testing.assert_allclose(state.norm_a, np.linalg.norm(flat_a), rtol=2e-5)
  np.testing.assert_allclose(state.norm_b, np.linalg.norm(flat_b), rtol=2e-5, atol=2e-5)
  if share == 1.0:
    assert not np.any(state.measured) and np.all(state.grads_finite)
  else:
    cos = flat_a @ flat_b / np.linalg.norm(flat_a) / np.linalg.norm(flat_b)
    np.testing.assert_allclose(state.similarity, cos, rtol=2e-5, atol=2e-5)


def test_statistics_of_long_leaves_are_summed_in_blocks_and_match_numpy():
  # Pieces of 4 * 1024 entries or more are reduced as blocks side by side; 8 * 5001 + 3
  # entries give pieces of 5002 (padding included): 4 blocks of 1250 and a tail of 2.
  rng = np.random.default_rng(7)
  shape = (8 * 5001 + 3,)
  grads = {
    "long": (rng.normal(size=shape) + 0.7 * rng.normal(size=(8,) + shape)).astype(np.float32),
    "short": rng.normal(size=(8, 5)).astype(np.float32),
  }
  assert (
    5002 >= 1024 * half_statistics.STATISTICS_BLOCKS and 5002 % half_statistics.STATISTICS_BLOCKS
  )
  _, state = compiled_device_split(8, "pmap", "hierarchical")(grads)
  _, ref_cos, ref_na, ref_nb, ref_nm = reference(grads, EVEN, ODD)
  tol = tolerance(False)
  np.testing.assert_allclose(state.similarity, ref_cos, **tol)
  np.testing.assert_allclose(state.norm_a, ref_na, **tol)
  np.testing.assert_allclose(state.norm_b, ref_nb, **tol)
  np.testing.assert_allclose(state.norm_mean, ref_nm, **tol)


def test_norm_of_the_mean_of_opposite_halves_is_zero_not_nan():
  # |M|^2 is derived from <g_A, g_B>, |g_A|^2 and |g_B|^2. For g_B = -g_A (1 + 1e-6 noise)
  # their rounding adds up below zero (with this seed): it is clamped, the norm is not NaN.
  rng = np.random.default_rng(0)
  half = rng.normal(size=(4, 3, 3, 2, 4)).astype(np.float32)
  noise = (1 + 1e-6 * rng.normal(size=half.shape)).astype(np.float32)
  per_device = np.stack(
    [half[i // 2] if i % 2 == 0 else -half[i // 2] * noise[i // 2] for i in range(8)]
  )
  zeros = lambda *shape: np.zeros((8,) + shape, np.float32)
  _, state = compiled_device_split(8, "pmap", "hierarchical")(
    {"conv": per_device, "dense": {"kernel": zeros(7, 5), "bias": zeros(5)}, "scale": zeros()}
  )
  assert np.all(state.grads_finite) and np.all(state.measured)
  np.testing.assert_allclose(state.similarity, -1.0, atol=1e-6)
  assert np.all(np.isfinite(state.norm_mean))
  assert float(state.norm_mean[0]) <= 1e-3 * float(state.norm_a[0])


def test_odd_device_count_without_half_grads_is_refused():
  with pytest.raises(ValueError, match=r"3 device\(s\).*value_and_half_grads"):
    compiled_device_split(3, "pmap", "scatter")(random_grads(np.random.default_rng(0), 3, False))


def test_value_and_half_grads_equals_separate_gradients():
  loss = lambda w, batch: jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
  rng = np.random.default_rng(0)
  batch = {
    "x": jnp.asarray(rng.normal(size=(6, 3)), jnp.float32),
    "y": jnp.asarray(rng.normal(size=(6,)), jnp.float32),
  }
  w = jnp.asarray(rng.normal(size=(3,)), jnp.float32)
  value, grads, halves = jax.jit(simigrad_jax.value_and_half_grads(loss))(w, batch)
  first = jax.tree.map(lambda x: x[0::2], batch)
  second = jax.tree.map(lambda x: x[1::2], batch)
  np.testing.assert_allclose(value, loss(w, batch), rtol=1e-6)
  np.testing.assert_allclose(grads, jax.grad(loss)(w, batch), rtol=1e-5)
  np.testing.assert_allclose(halves.first, jax.grad(loss)(w, first), rtol=1e-5)
  np.testing.assert_allclose(halves.second, jax.grad(loss)(w, second), rtol=1e-5)
  with pytest.raises(ValueError, match="5 examples"):
    simigrad_jax.value_and_half_grads(loss)(w, jax.tree.map(lambda x: x[:5], batch))


def test_shard_map_gradient_trap_is_caught_and_pcast_fixes_it():
  """Under shard_map, grad of P()-replicated params is already summed: refuse it."""
  mesh = Mesh(np.array(jax.devices()), (AXIS,))
  opt = optax.chain(simigrad_jax.transform(AXIS), optax.sgd(0.1))
  loss = lambda w, x: jnp.mean(jnp.sum((x - w) ** 2, axis=-1))

  def make_step(pcast):
    def step(w, opt_state, x):
      w_for_grad = jax.lax.pcast(w, AXIS, to="varying") if pcast else w
      grads = jax.grad(loss)(w_for_grad, x)
      updates, opt_state = opt.update(grads, opt_state, w)
      return optax.apply_updates(w, updates), opt_state

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P(AXIS)), out_specs=P()))

  w = jnp.zeros(4)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 4)), jnp.float32)
  with pytest.raises(ValueError, match="pcast"):
    make_step(pcast=False)(w, opt.init(w), x)
  new_w, state = make_step(pcast=True)(w, opt.init(w), x)
  # Reference: device d sees rows 2d, 2d+1; grad of the mean over a device's rows is 2(w - mean x).
  per_device = 2 * (0 - np.asarray(x).reshape(8, 2, 4).mean(axis=1))
  _, ref_cos, *_ = reference(per_device, EVEN, ODD)
  sim = simigrad_jax.similarity(state)
  assert sim != 1.0
  np.testing.assert_allclose(sim, ref_cos, rtol=1e-5)
  np.testing.assert_allclose(new_w, -0.1 * per_device.mean(axis=0), rtol=1e-5)


def test_vmap_with_named_axis():
  tx = simigrad_jax.transform(AXIS)
  grads = random_grads(np.random.default_rng(3), 4, mixed_dtypes=False)
  mean, state = jax.vmap(lambda g: tx.update(g, tx.init(g)), axis_name=AXIS)(grads)
  ref_mean, ref_cos, *_ = reference(grads, EVEN, ODD)
  np.testing.assert_allclose(state.similarity, ref_cos, rtol=2e-5)
  np.testing.assert_allclose(jax.tree.leaves(mean)[0][0], ref_mean[0], rtol=2e-5, atol=1e-6)


@functools.cache
def compiled_chain_step(nonfinite):
  inner = optax.sgd(0.5, momentum=0.9)
  if nonfinite == "propagate":
    inner = optax.apply_if_finite(inner, max_consecutive_errors=100)
  opt = optax.chain(simigrad_jax.transform(AXIS, nonfinite=nonfinite), inner)

  def step(params, opt_state, grads):
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return opt, jax.pmap(step, axis_name=AXIS)


def replicate(tree, n=8):
  return jax.tree.map(lambda x: jnp.stack([jnp.asarray(x)] * n), tree)


@pytest.mark.parametrize("nonfinite", ["zero", "propagate"])
@pytest.mark.parametrize("bad_value", [np.nan, np.inf])
def test_nonfinite_gradient_never_leaks(nonfinite, bad_value):
  opt, step = compiled_chain_step(nonfinite)
  params = {"w": jnp.ones(5)}
  opt_state = replicate(opt.init(params))
  params = replicate(params)
  good = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(8, 5)), jnp.float32)}
  params, opt_state = step(params, opt_state, good)  # momentum is now non-zero
  before = jax.tree.map(np.asarray, (params, opt_state))
  bad = {"w": good["w"].at[3, 2].set(bad_value)}  # one entry on one device
  params, opt_state = step(params, opt_state, bad)
  for leaf in jax.tree.leaves((params, opt_state)):
    assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
  stats = simigrad_jax.similarity_stats(opt_state)
  assert stats["grads_finite"] is False and stats["measured"] is False
  assert stats["nonfinite_count"] == 1
  assert np.isnan(stats["similarity"])  # the host sees "no measurement"
  # Every device took the same decision.
  assert np.all(np.asarray(params["w"]) == np.asarray(params["w"])[0])
  if nonfinite == "propagate":  # apply_if_finite skipped the whole step: nothing moved.
    np.testing.assert_array_equal(params["w"], before[0]["w"])
  else:  # zero update: only momentum moves the parameters.
    assert not np.array_equal(np.asarray(params["w"]), before[0]["w"])
  params, opt_state = step(params, opt_state, good)  # recovers on the next finite step
  assert simigrad_jax.similarity_stats(opt_state)["measured"] is True


def test_zero_norm_half_gives_no_measurement_and_no_nan():
  tx = simigrad_jax.transform(AXIS)
  step = jax.pmap(lambda g: tx.update(g, tx.init(g)), axis_name=AXIS)
  grads = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
  for zeroed in (EVEN, slice(None)):  # first half (the even devices) zero; everything zero
    g = grads.copy()
    g[zeroed] = 0
    mean, state = step(jnp.asarray(g))
    assert not np.any(state.measured)
    assert np.all(np.isfinite(state.similarity)) and np.all(state.similarity == 0)
    np.testing.assert_allclose(mean[0], g.mean(axis=0), rtol=1e-6, atol=1e-7)
    # The gradients were finite: unmeasured, not counted as non-finite.
    assert np.all(state.grads_finite) and not np.any(state.nonfinite_count)


def test_a_zero_norm_half_is_unmeasured_for_the_controller_not_nonfinite():
  tx = simigrad_jax.transform()
  grads = {"w": jnp.ones(3)}
  zero = {"w": jnp.zeros(3)}
  halves = simigrad_jax.HalfGrads(zero, {"w": 2 * jnp.ones(3)})
  _, state = tx.update(grads, tx.init(grads), grads, half_grads=halves)
  stats = simigrad_jax.similarity_stats(state)
  assert not stats["measured"] and stats["grads_finite"] and stats["nonfinite_count"] == 0
  controller = simigrad_jax.Controller(64, 0.1)
  assert controller.update(simigrad_jax.similarity(state), stats=stats) == 64
  assert controller.last_decision == "unmeasured" and controller.nonfinite_count == 0


def test_bad_arguments_are_refused():
  with pytest.raises(ValueError, match="reduction='ring'"):
    simigrad_jax.transform(AXIS, reduction="ring")
  with pytest.raises(ValueError, match="nonfinite='skip'"):
    simigrad_jax.transform(AXIS, nonfinite="skip")
  for bad in ("", 0, ("batch",)):
    with pytest.raises(ValueError, match=r"axis_name=.* is not valid: give the name of the mapped"):
      simigrad_jax.transform(bad)


def test_half_grads_that_do_not_match_the_gradient_are_refused():
  tx = simigrad_jax.transform()
  grads = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
  state = tx.init(grads)
  with pytest.raises(ValueError, match="without an axis name .* pass half_grads"):
    tx.update(grads, state)
  with pytest.raises(ValueError, match=r"half_grads.second has the tree structure"):
    tx.update(grads, state, half_grads=simigrad_jax.HalfGrads(grads, {"w": grads["w"]}))
  with pytest.raises(
    ValueError,
    match=r"half_grads.first\['w'\] has shape \(2, 3\), the "
    r"gradient \(3, 2\)",
  ):
    tx.update(
      grads,
      state,
      half_grads=simigrad_jax.HalfGrads({"w": jnp.ones((2, 3)), "b": jnp.ones(2)}, grads),
    )
  with pytest.raises(ValueError, match="must be a simigrad_jax.HalfGrads"):
    tx.update(grads, state, half_grads=(grads, grads))
  # A share known before the step runs is checked whatever its type (NumPy's and JAX's scalars
  # were taken, and the halves rebuilt from a share of 1.5 or NaN).
  for share in (1.5, -0.5, np.float32(1.5), np.float64(np.nan), jnp.float32(1.5)):
    with pytest.raises(ValueError, match=r"half_grads.share must lie in \[0, 1\].*got"):
      tx.update(grads, state, half_grads=simigrad_jax.HalfGrads(grads, grads, share))
  tx.update(grads, state, half_grads=simigrad_jax.HalfGrads(grads, grads, np.float32(0.25)))
  with pytest.raises(ValueError, match=r"half_grads.share must be a scalar.*shape \(2,\)"):
    tx.update(grads, state, half_grads=simigrad_jax.HalfGrads(grads, grads, jnp.ones(2)))


def test_a_gradient_with_a_leaf_the_parameters_lack_is_refused_naming_it():
  tx = optax.chain(simigrad_jax.transform(), optax.sgd(0.1))
  params = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
  grads = {**params, "extra": jnp.ones(4)}
  halves = simigrad_jax.HalfGrads(grads, grads)
  with pytest.raises(
    ValueError, match=r"gradient of 3 leaves for 2 parameters \(leaves the parameters lack: "
  ) as refused:
    tx.update(grads, tx.init(params), params, half_grads=halves)
  assert "['extra']" in str(refused.value)
  fewer = {"w": params["w"]}
  with pytest.raises(ValueError, match=r"parameters it lacks: \[\"\['b'\]\"\]"):
    tx.update(fewer, tx.init(params), params, half_grads=simigrad_jax.HalfGrads(fewer, fewer))
  tx.update(params, tx.init(params), params, half_grads=simigrad_jax.HalfGrads(params, params))


def test_a_wrong_axis_name_inside_pmap_names_the_bound_axis():
  tx = simigrad_jax.transform("data")
  step = jax.pmap(lambda g: tx.update(g, tx.init(g)), axis_name=AXIS)
  with pytest.raises(simigrad_jax.ingraph.AxisNameError) as refused:
    step(jnp.ones((8, 3)))
  message = str(refused.value)
  assert f"mapped over the axis {AXIS!r}" in message and "none named 'data'" in message
  assert f"simigrad_jax.transform(axis_name={AXIS!r})" in message
  assert refused.value.step_axis == AXIS and refused.value.axis_name == "data"


@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
def test_plain_jit_step_over_a_sharded_batch(mesh_kind):
  """No pmap, no shard_map: the halves are the batch's even- and odd-numbered examples, exactly."""
  devices = jax.devices()
  if mesh_kind == "auto":
    mesh = Mesh(np.array(devices), ("data",))
  else:  # jax.make_mesh gives explicit axes
    mesh = jax.make_mesh((len(devices),), ("data",))
  rng = np.random.default_rng(7)
  x = rng.normal(size=(32, 4)).astype(np.float32)
  y = rng.normal(size=(32,)).astype(np.float32)
  batch = jax.device_put({"x": x, "y": y}, jax.sharding.NamedSharding(mesh, P("data")))
  loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
  opt = optax.chain(simigrad_jax.transform(), optax.sgd(0.1))

  @jax.jit
  def step(w, state, b):
    _, grads, halves = simigrad_jax.value_and_half_grads(loss)(w, b)
    updates, state = opt.update(grads, state, w, half_grads=halves)
    return optax.apply_updates(w, updates), state

  w = jnp.zeros(4)
  with jax.set_mesh(mesh):
    new_w, state = step(w, opt.init(w), batch)
  as64 = lambda g: np.asarray(g, np.float64)
  g_a = as64(jax.grad(loss)(w, {"x": x[0::2], "y": y[0::2]}))
  g_b = as64(jax.grad(loss)(w, {"x": x[1::2], "y": y[1::2]}))
  np.testing.assert_allclose(
    simigrad_jax.similarity(state), g_a @ g_b / np.linalg.norm(g_a) / np.linalg.norm(g_b), rtol=1e-5
  )
  np.testing.assert_allclose(new_w, -0.1 * (g_a + g_b) / 2, rtol=1e-5, atol=1e-7)


def test_similarity_is_found_inside_wrapped_states():
  params = jnp.zeros(3)
  chained = optax.chain(simigrad_jax.transform(AXIS), optax.adam(1e-3))
  for opt in (
    chained,
    optax.MultiSteps(chained, every_k_schedule=2),
    optax.inject_hyperparams(
      lambda learning_rate: optax.chain(simigrad_jax.transform(AXIS), optax.sgd(learning_rate))
    )(learning_rate=0.1),
  ):
    stats = simigrad_jax.similarity_stats(opt.init(params))
    assert stats["measured"] is False and np.isnan(stats["similarity"])
    assert np.isnan(simigrad_jax.similarity(opt.init(params)))
  with pytest.raises(ValueError, match="no SimilarityState"):
    simigrad_jax.similarity(optax.sgd(0.1).init(params))
  twice = optax.chain(simigrad_jax.transform(AXIS), simigrad_jax.transform(AXIS))
  with pytest.raises(ValueError, match="2 SimilarityStates"):
    simigrad_jax.similarity(twice.init(params))


def test_pair_statistics_of_long_pieces_keep_float32_accuracy():
  """8.4M entries (a 67M-parameter gradient's piece on 8 devices): each sum within 1e-6."""
  rng = np.random.default_rng(0)
  length = 8_400_001  # not a multiple of the row
  signal = rng.normal(size=length)
  a = (signal + 2 * rng.normal(size=length)).astype(np.float32)
  b = (signal + 2 * rng.normal(size=length)).astype(np.float32)
  got = np.asarray(jax.jit(half_statistics.pair_statistics)(a, b))
  a64, b64 = a.astype(np.float64), b.astype(np.float64)
  want = np.array([a64 @ b64, a64 @ a64, b64 @ b64, (a64 + b64) @ (a64 + b64) / 4])
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_scatter_dims_keep_each_devices_block_of_the_mean_and_the_same_statistics(devices):
  """FSDP's layout: device i of n keeps block i of the mean along the leaf's dimension."""
  n = len(devices)
  rng = np.random.default_rng(3)
  grads = {
    "rows": rng.normal(size=(n, 2 * n, 3)).astype(np.float32),  # blocks along dimension 0
    "columns": rng.normal(size=(n, 5, n)).astype(np.float32),  # blocks along dimension 1
    "bias": rng.normal(size=(n, 5)).astype(np.float32),  # replicated: gathered whole
  }
  dims = {"rows": 0, "columns": 1, "bias": None}

  def reduce(g, scatter_dims):
    return halves_reduction.reduce_device_halves(g, AXIS, scatter_dims=scatter_dims)

  blocks, stats = jax.pmap(lambda g: reduce(g, dims), axis_name=AXIS)(grads)
  whole, whole_stats = jax.pmap(lambda g: reduce(g, None), axis_name=AXIS)(grads)
  mean = jax.tree.map(lambda x: x.mean(0), grads)
  for i in range(n):
    np.testing.assert_allclose(blocks["rows"][i], mean["rows"][2 * i : 2 * i + 2], rtol=1e-5)
    np.testing.assert_allclose(blocks["columns"][i], mean["columns"][:, i : i + 1], rtol=1e-5)
    np.testing.assert_allclose(blocks["bias"][i], mean["bias"], rtol=1e-5)
  for got, want in zip(stats, whole_stats, strict=True):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)
  np.testing.assert_allclose(whole["rows"][0], mean["rows"], rtol=1e-5)

  with pytest.raises(ValueError, match="size 5.*divides by 8"):
    jax.pmap(lambda g: reduce(g, {"rows": 0, "columns": 0, "bias": None}), axis_name=AXIS)(grads)
  with pytest.raises(ValueError, match="needs reduction='hierarchical'"):
    jax.pmap(
      lambda g: halves_reduction.reduce_device_halves(g, AXIS, "scatter", scatter_dims=dims),
      axis_name=AXIS,
    )(grads)
