"""simigrad_jax.transform's steps that do not measure (``update(..., measure=False)``).

A step between two measuring ones hands the transform the plain gradient of
its whole batch: the update is its mean over the devices (``lax.pmean``), the
state keeps the last measurement with ``measured`` False, and a non-finite
gradient is zeroed and counted as in a measuring step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import simigrad_jax
from benchmarks.step_cost import hlo_collectives

AXIS = "batch"


def per_device_grads(num_devices: int, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {
    "w": (rng.normal(size=(3, 2)) + rng.normal(size=(num_devices, 3, 2))).astype(np.float32),
    "b": rng.normal(size=(num_devices, 2)).astype(np.float32),
  }


def pmapped(measure: bool):
  transform = simigrad_jax.transform(AXIS)

  def step(grads, state):
    return transform.update(grads, state, measure=measure)

  return jax.pmap(step, axis_name=AXIS)


def replicated(tree, n):
  return jax.tree.map(lambda x: jnp.stack([x] * n), tree)


def test_a_plain_step_averages_and_keeps_the_last_measurement(devices):
  n = len(devices)
  transform = simigrad_jax.transform(AXIS)
  state = replicated(transform.init(None), n)
  _, measured = pmapped(True)(per_device_grads(n, 0), state)
  plain_grads = per_device_grads(n, 1)
  mean, after = pmapped(False)(plain_grads, measured)
  for got, grads in zip(jax.tree.leaves(mean), jax.tree.leaves(plain_grads), strict=True):
    np.testing.assert_allclose(got[0], grads.mean(0), rtol=1e-6, atol=1e-6)
  first = lambda tree: jax.tree.map(lambda x: np.asarray(x[0]), tree)
  measured, after = first(measured), first(after)
  assert measured.measured and not after.measured
  for field in ("similarity", "norm_a", "norm_b"):  # the last measurement, kept
    assert getattr(after, field) == getattr(measured, field)
  norm = np.sqrt(sum(np.sum(g.mean(0).astype(np.float64) ** 2) for g in plain_grads.values()))
  assert after.norm_mean == pytest.approx(norm, rel=1e-5)
  assert after.grads_finite and after.nonfinite_count == 0
  assert np.isnan(simigrad_jax.similarity(after))  # the host reads: this step did not measure


def test_a_non_finite_plain_gradient_is_zeroed_and_counted(devices):
  n = len(devices)
  grads = per_device_grads(n)
  grads["b"][3, 0] = np.nan
  state = replicated(simigrad_jax.transform(AXIS).init(None), n)
  mean, after = pmapped(False)(grads, state)
  assert all(np.all(np.asarray(leaf) == 0) for leaf in jax.tree.leaves(mean))
  assert not bool(after.grads_finite[0]) and int(after.nonfinite_count[0]) == 1


def test_in_a_plain_jit_step_the_gradient_is_the_mean_as_it_is():
  optimizer = optax.chain(simigrad_jax.transform(), optax.sgd(1.0))
  params = {"w": jnp.ones(3)}
  grads = {"w": jnp.array([1.0, -2.0, 0.5])}
  updates, state = jax.jit(lambda g, s: optimizer.update(g, s, params, measure=False))(
    grads, optimizer.init(params)
  )
  np.testing.assert_array_equal(updates["w"], -grads["w"])
  assert not simigrad_jax.similarity_stats(state)["measured"]


def test_half_grads_or_a_non_bool_are_refused_on_a_plain_step():
  transform = simigrad_jax.transform()
  grads = {"w": jnp.ones(2)}
  halves = simigrad_jax.HalfGrads(grads, grads)
  with pytest.raises(ValueError, match="leave half_grads out"):
    transform.update(grads, transform.init(grads), half_grads=halves, measure=False)
  with pytest.raises(ValueError, match="measure must be True"):
    transform.update(grads, transform.init(grads), half_grads=halves, measure="no")


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_a_plain_step_reduces_a_tensor_parallel_gradient_to_the_pmean(devices, kind):
  """In the step mapped over the data axis, the model axis left to XLA (given by the specs
  under Auto axes, by the leaves' types under Explicit ones): the mean is lax.pmean's, bit for
  bit, the norm is the mean's, and each device reduces its own shard of the kernel."""
  mesh = jax.make_mesh((4, 2), (AXIS, "model"), axis_types=(kind, kind), devices=devices)
  rng = np.random.default_rng(7)
  host = {
    "kernel": rng.normal(size=(4, 64, 64)).astype(np.float32),
    "bias": rng.normal(size=(4, 64)).astype(np.float32),
  }
  specs = {"kernel": P(None, "model"), "bias": P("model")}
  stacked = {
    name: jax.device_put(value, NamedSharding(mesh, P(AXIS, *specs[name])))
    for name, value in host.items()
  }
  tx = simigrad_jax.transform(AXIS)
  given = specs if kind == AxisType.Auto else None

  def per_device(local):
    grads = jax.tree.map(lambda g: g[0], local)
    mean, state = tx.update(grads, tx.init(grads), param_specs=given, measure=False)
    return mean, state.norm_mean, lax.pmean(grads, AXIS)

  compiled = (
    jax.jit(
      jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=P(AXIS),
        out_specs=(P(), P(), P()),
        axis_names={AXIS},
        check_vma=False,
      )
    )
    .lower(stacked)
    .compile()
  )
  mean, norm, pmean = compiled(stacked)
  # Each device reduce-scatters its own half of the kernel, not the kernel gathered whole.
  found = hlo_collectives.parse_collectives(compiled.as_text(), jax.device_count())
  scattered = [c.payload_bytes for c in found if c.kind == "reduce-scatter"]
  assert scattered and max(scattered) < 64 * 64 * 4, found
  for name in host:
    np.testing.assert_array_equal(np.asarray(mean[name]), np.asarray(pmean[name]))
  expected = np.sqrt(sum(np.sum(g.astype(np.float64).mean(0) ** 2) for g in host.values()))
  assert float(norm) == pytest.approx(expected, rel=1e-6)
