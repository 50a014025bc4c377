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

import simigrad_jax

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
