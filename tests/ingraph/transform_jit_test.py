"""simigrad_jax.transform() in a plain jax.jit step: exact against NumPy in float64 on any leaf
shape and dtype, on leaves sharded every way over Auto and Explicit mesh axes (shard-local
sums, no gather, the mean's sharding kept), and the errors that name the fix."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import simigrad_jax
from benchmarks.step_cost import hlo_collectives

# Leaf shapes of every rank, and for the sharded test the spec of each on a 4 x 2 mesh.
SHARDED_LEAVES = {
  "replicated": ((128, 96), P()),
  "fsdp": ((256, 64), P("data", None)),
  "tensor_parallel": ((96, 256), P(None, "model")),
  "fsdp_and_tp": ((256, 128), P("data", "model")),
  "rows_over_both": ((128, 40), P(("data", "model"), None)),
  "conv": ((3, 3, 16, 64), P(None, None, None, "model")),
  "bias": ((64,), P("model")),
  "scale": ((), P()),
}


def _halves(shapes, dtypes, seed):
  """Two half gradients with a shared signal (similar, not equal)."""
  rng = np.random.default_rng(seed)
  signal = {name: rng.normal(size=shape) for name, shape in shapes.items()}
  return [
    {
      name: (signal[name] + 0.8 * rng.normal(size=shape)).astype(dtypes.get(name, np.float32))
      for name, shape in shapes.items()
    }
    for _ in range(2)
  ]


def _reference(first, second, share):
  """float64 ``(M, cos, |g_A|, |g_B|)``, a half with no example counted as zero."""
  flat = lambda t: np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(t)])
  g_a, g_b = flat(first) * (share > 0), flat(second) * (share < 1)
  mean = {
    k: share * np.asarray(first[k], np.float64) + (1 - share) * np.asarray(second[k], np.float64)
    for k in first
  }
  norm_a, norm_b = np.linalg.norm(g_a), np.linalg.norm(g_b)
  cos = g_a @ g_b / (norm_a * norm_b) if norm_a and norm_b else None
  return mean, cos, norm_a, norm_b


def _update(first, second, share):
  tx = simigrad_jax.transform()
  mean = jax.tree.map(
    lambda a, b: (share * a.astype(jnp.float32) + (1 - share) * b.astype(jnp.float32)).astype(
      a.dtype
    ),
    first,
    second,
  )
  halves = simigrad_jax.HalfGrads(first, second, None if share == 0.5 else share)
  return tx.update(mean, tx.init(mean), half_grads=halves)


@pytest.mark.parametrize("share", [0.5, 0.3, 1.0])
@pytest.mark.parametrize("mixed_dtypes", [False, True], ids=["f32", "f32+bf16"])
def test_plain_jit_statistics_match_numpy_on_leaves_of_every_rank(share, mixed_dtypes):
  shapes = {name: shape for name, (shape, _) in SHARDED_LEAVES.items()}
  dtypes = {"conv": jnp.bfloat16, "tensor_parallel": jnp.bfloat16} if mixed_dtypes else {}
  first, second = _halves(shapes, dtypes, seed=3)
  mean, state = jax.jit(_update, static_argnums=2)(first, second, share)

  ref_mean, ref_cos, ref_a, ref_b = _reference(first, second, share)
  tolerance = {"rtol": 2e-2, "atol": 2e-2} if mixed_dtypes else {"rtol": 2e-5, "atol": 2e-5}
  for name, got in mean.items():
    assert got.dtype == first[name].dtype, name
    np.testing.assert_allclose(np.asarray(got, np.float64), ref_mean[name], **tolerance)
  np.testing.assert_allclose(state.norm_a, ref_a, rtol=1e-5)
  np.testing.assert_allclose(state.norm_b, ref_b, rtol=1e-5, atol=1e-6)
  if ref_cos is None:  # a half without examples: not measured, and no NaN
    assert not state.measured and state.similarity == 0 and state.grads_finite
  else:
    assert state.measured
    np.testing.assert_allclose(state.similarity, ref_cos, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axes", ["auto", "explicit"])
def test_sharded_leaves_are_summed_where_they_lie(devices, axes):
  """Shard-local sums, small collectives: nothing gathered, no copy of a leaf, the layout kept."""
  axis_type = AxisType.Auto if axes == "auto" else AxisType.Explicit
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2, devices=devices)
  shapes = {name: shape for name, (shape, _) in SHARDED_LEAVES.items()}
  shardings = {name: NamedSharding(mesh, spec) for name, (_, spec) in SHARDED_LEAVES.items()}
  first, second = [jax.device_put(half, shardings) for half in _halves(shapes, {}, seed=4)]
  step = jax.jit(_update, static_argnums=2)

  with jax.set_mesh(mesh):
    compiled = step.lower(first, second, 0.5).compile()
    mean, state = compiled(first, second)

  ref_mean, ref_cos, ref_a, ref_b = _reference(first, second, 0.5)
  np.testing.assert_allclose(state.similarity, ref_cos, rtol=1e-5)
  np.testing.assert_allclose([state.norm_a, state.norm_b], [ref_a, ref_b], rtol=1e-5)
  for name, got in mean.items():
    np.testing.assert_allclose(got, ref_mean[name], rtol=1e-5, atol=1e-6)
    assert got.sharding.is_equivalent_to(shardings[name], got.ndim), (name, got.sharding)
  collectives = hlo_collectives.parse_collectives(compiled.as_text(), len(devices))
  assert {c.kind for c in collectives} <= {"all-reduce", "all-gather"}, collectives
  # Scalars, and where a leaf's reduced (last) axis is sharded, each row's three partial
  # sums: at most 3 float32 per row of a leaf, never a leaf.
  rows = sum(np.prod(shape[:-1], dtype=int) for shape in shapes.values() if len(shape) > 1)
  assert sum(c.payload_bytes for c in collectives) <= 3 * 4 * rows + 64, collectives
  if axes == "explicit":  # the spec names an axis no mesh axis shards; only both-sharded gather
    assert [c.kind for c in collectives].count("all-gather") <= 3, collectives
  leaf_bytes = sum(4 * np.prod(shape, dtype=int) for shape in shapes.values())
  assert compiled.memory_analysis().temp_size_in_bytes <= 0.05 * leaf_bytes


def test_an_axis_name_in_a_plain_jit_step_names_the_fix():
  opt = optax.chain(simigrad_jax.transform("batch"), optax.sgd(0.1))
  w = jnp.zeros(3)

  @jax.jit
  def step(w, state, x):
    grads = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
    return opt.update(grads, state, w)

  with pytest.raises(
    ValueError,
    match=r"transform\('batch'\) runs outside a step mapped .*"
    r"unbound axis name: batch.*simigrad_jax.transform\(\) without an axis name",
  ):
    step(w, opt.init(w), jnp.ones((4, 3)))


def test_a_loss_with_aux_needs_has_aux_and_the_error_says_so():
  x = jnp.ones((4, 3))
  with_aux = lambda w, x: (jnp.mean((x @ w) ** 2), {"rows": x.shape[0]})
  with pytest.raises(
    ValueError,
    match=r"tuple of 2 values.*value_and_half_grads\(loss_fn, "
    r"has_aux=True\)",
  ):
    simigrad_jax.value_and_half_grads(with_aux)(jnp.zeros(3), x)
  without_aux = lambda w, x: jnp.mean((x @ w) ** 2)
  with pytest.raises(
    ValueError,
    match=r"has_aux=True\) expects loss_fn to return \(loss, aux\), "
    r"got an array of shape \(\)",
  ):
    simigrad_jax.value_and_half_grads(without_aux, has_aux=True)(jnp.zeros(3), x)
  (value, aux), _, _ = simigrad_jax.value_and_half_grads(with_aux, has_aux=True)(jnp.zeros(3), x)
  assert aux["rows"].tolist() == [2, 2] and value == 0
