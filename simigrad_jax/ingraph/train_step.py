"""In-graph: the data-parallel micro-step and apply step that the training engine compiles.

Both run inside ``jax.shard_map`` over a one-axis mesh with ``check_vma=False``
(the semantics of ``jax.pmap``: each device computes its own gradient).

* :func:`make_micro_step` adds one micro-batch's gradient to each device's
  accumulator. The loss is the weighted SUM over the device's rows times
  ``num_devices / total_weight``, so that averaging the accumulators over
  devices gives exactly the mean gradient over the step's real examples
  (padding rows have weight 0 and contribute nothing).
* :func:`make_apply_step` hands the accumulated per-device gradient to the
  optimizer, whose :func:`simigrad_jax.transform` averages it over devices and
  measures the half-batch similarity, applies the update, clears the
  accumulator, and returns every number the host needs in one small vector.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from simigrad_jax.ingraph.transform import SimilarityState

# loss_fn(params, model_state, batch, weights, rng) -> (per_example_losses, new_model_state)
PerExampleLossFn = Callable[[Any, Any, Any, jax.Array, jax.Array], tuple[jax.Array, Any]]

STEP_STATS: tuple[str, ...] = (
    "loss", "similarity", "norm_a", "norm_b", "norm_mean", "measured", "grads_finite",
    "nonfinite_count")


class Accumulator(NamedTuple):
  """Per-device running sums of one optimizer step (leading device axis, sharded)."""

  grads: Any  # pytree like params, each leaf with a leading device axis.
  loss: jax.Array  # float32[num_devices]: each device's share of the step's mean loss.


def zero_accumulator(params: Any, mesh: Mesh, axis_name: str) -> Accumulator:
  """Returns a zero :class:`Accumulator` laid out one row per device of ``mesh``."""
  num_devices = mesh.shape[axis_name]
  sharding = jax.sharding.NamedSharding(mesh, P(axis_name))

  def zeros(shape, dtype):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()

  grads = jax.tree.map(lambda p: zeros((num_devices,) + p.shape, p.dtype), params)
  return Accumulator(grads=grads, loss=zeros((num_devices,), jnp.float32))


def make_micro_step(
    loss_fn: PerExampleLossFn, mesh: Mesh, axis_name: str, seed: int = 0
) -> Callable[..., tuple[Accumulator, Any]]:
  """Returns ``micro_step(params, model_state, acc, batch, weights, total_weight, counters)``.

  Args:
    loss_fn: ``loss_fn(params, model_state, batch, weights, rng) ->
      (per_example_losses, new_model_state)`` on one device's rows; models with
      BatchNorm should use ``weights`` as the normalisation mask.
    mesh: a one-axis mesh over the data-parallel devices.
    axis_name: the mesh axis name.
    seed: the run's seed; the key handed to ``loss_fn`` is derived from it,
      the optimizer step, the micro-step and the device, so a resumed run draws
      the same numbers.

  Returns:
    A function (to be jitted) from replicated ``params`` and ``model_state``,
    the device-sharded :class:`Accumulator`, a batch and weights sharded on
    their leading axis, the step's total real example count (float32) and
    ``counters`` (int32 ``[optimizer_step, micro_step]``), to the new
    accumulator and the new model state (averaged over devices).
  """
  num_devices = mesh.shape[axis_name]

  def per_device(params, model_state, acc, batch, weights, total_weight, counters):
    rng = jax.random.key(seed)
    for value in (counters[0], counters[1], lax.axis_index(axis_name)):
      rng = jax.random.fold_in(rng, value)

    def weighted_loss(p):
      losses, new_state = loss_fn(p, model_state, batch, weights, rng)
      scale = num_devices / total_weight
      return jnp.sum(losses.astype(jnp.float32) * weights) * scale, new_state

    (loss, new_state), grads = jax.value_and_grad(weighted_loss, has_aux=True)(params)
    new_state = lax.pmean(new_state, axis_name)
    grads = jax.tree.map(lambda a, g: a + g[None].astype(a.dtype), acc.grads, grads)
    return Accumulator(grads=grads, loss=acc.loss + loss[None]), new_state

  return jax.shard_map(
      per_device, mesh=mesh,
      in_specs=(P(), P(), P(axis_name), P(axis_name), P(axis_name), P(), P()),
      out_specs=(P(axis_name), P()), check_vma=False)


def make_apply_step(
    optimizer: optax.GradientTransformation, mesh: Mesh, axis_name: str
) -> Callable[..., tuple[Any, Any, Accumulator, jax.Array]]:
  """Returns ``apply_step(params, opt_state, acc) -> (params, opt_state, zero_acc, stats)``.

  Args:
    optimizer: an optax optimizer whose chain contains
      :func:`simigrad_jax.transform` over ``axis_name`` (it does the averaging).
    mesh: a one-axis mesh over the data-parallel devices.
    axis_name: the mesh axis name.

  Returns:
    A function (to be jitted) returning the new replicated params and
    optimizer state, the cleared accumulator and a float32 vector of the
    :data:`STEP_STATS` (identical on every device).
  """

  def per_device(params, opt_state, acc):
    grads = jax.tree.map(lambda g: g[0], acc.grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    similarity_state = optax.tree_utils.tree_get(opt_state, SimilarityState.__name__)
    stats = jnp.stack([
        lax.pmean(acc.loss[0], axis_name),
        similarity_state.similarity,
        similarity_state.norm_a,
        similarity_state.norm_b,
        similarity_state.norm_mean,
        similarity_state.measured.astype(jnp.float32),
        similarity_state.grads_finite.astype(jnp.float32),
        similarity_state.nonfinite_count.astype(jnp.float32),
    ])
    cleared = jax.tree.map(jnp.zeros_like, acc)
    return params, opt_state, cleared, stats

  return jax.shard_map(
      per_device, mesh=mesh, in_specs=(P(), P(), P(axis_name)),
      out_specs=(P(), P(), P(axis_name), P()), check_vma=False)
