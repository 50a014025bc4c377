"""In-graph: reduce per-device gradients to their mean and the two half-mean statistics.

Runs inside a step mapped over a named axis (``jax.pmap`` or ``jax.shard_map``).

Every device ``i`` contributes a pair of pytrees ``(m_i, d_i)``: ``m_i`` is its
share of the mean gradient and ``d_i`` its share of the half-difference, so that
over ``n`` devices

  M = mean_i m_i = (g_A + g_B) / 2      (the full mean gradient)
  D = mean_i d_i = (g_A - g_B) / 2      (half the difference of the half means)

and the two half-mean gradients are ``g_A = M + D`` and ``g_B = M - D``. When the
halves are sets of devices, ``d_i = +m_i`` on the first half and ``-m_i`` on the
second; when each device splits its own batch, ``d_i = (a_i - b_i) / 2``. One
reduction of the stacked pair ``(m, d)`` gives both the mean gradient and the
similarity statistics, whichever way the halves were formed.

Two variants move different numbers of bytes (ring model, relative to one plain
all-reduce of the gradient):

* ``"scatter"`` (default, 1.5x): reduce-scatter the stacked pair (each device
  receives a ``1/n`` shard of ``M`` and ``D``), take the dot products on the
  shards, psum five scalars, all-gather the mean shard.
* ``"stacked"`` (2x): one psum of the stacked pair; every device then holds the
  whole ``M`` and ``D`` and takes the dot products itself. Simpler; kept for
  comparison.

Leaves are grouped by dtype and each group is flattened into one vector, so the
collectives run in the gradient's own dtype (bfloat16 gradients move bfloat16
bytes), while every dot product and norm is accumulated in float32.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

Reduction = Literal["scatter", "stacked"]
REDUCTIONS: tuple[str, ...] = ("scatter", "stacked")


class HalfStatistics(NamedTuple):
  """Global float32 statistics of the two half-mean gradients (same on every device)."""

  dot_ab: jax.Array  # <g_A, g_B>
  sq_norm_a: jax.Array  # |g_A|^2
  sq_norm_b: jax.Array  # |g_B|^2
  sq_norm_mean: jax.Array  # |(g_A + g_B) / 2|^2
  nonfinite: jax.Array  # number of non-finite entries in the reduced M or D


def tracks_varying(axis_name: str) -> bool:
  """Whether the type system records which values vary over ``axis_name``.

  True inside ``jax.shard_map`` with ``check_vma=True``; False under
  ``jax.pmap``, ``check_vma=False`` and ``jax.vmap``.
  """
  index_type = getattr(jax.typeof(lax.axis_index(axis_name)), "manual_axis_type", None)
  return index_type is not None and axis_name in index_type.varying


def _partial_statistics(mean_part: jax.Array, diff_part: jax.Array) -> jax.Array:
  """Float32 [dot_ab, |a|^2, |b|^2, |m|^2, nonfinite] of one slice of M and D."""
  mean_part = mean_part.astype(jnp.float32)
  diff_part = diff_part.astype(jnp.float32)
  half_a = mean_part + diff_part
  half_b = mean_part - diff_part
  nonfinite = jnp.sum(~jnp.isfinite(mean_part)) + jnp.sum(~jnp.isfinite(diff_part))
  return jnp.stack([
      jnp.vdot(half_a, half_b),
      jnp.vdot(half_a, half_a),
      jnp.vdot(half_b, half_b),
      jnp.vdot(mean_part, mean_part),
      nonfinite.astype(jnp.float32),
  ])


def _dtype_groups(leaves: list[jax.Array]) -> dict[jnp.dtype, list[int]]:
  groups: dict[jnp.dtype, list[int]] = {}
  for index, leaf in enumerate(leaves):
    groups.setdefault(jnp.dtype(leaf.dtype), []).append(index)
  return groups


def _flatten(leaves: list[jax.Array], indices: list[int]) -> jax.Array:
  return jnp.concatenate([jnp.ravel(leaves[i]) for i in indices])


def _unflatten_into(
    flat: jax.Array, leaves: list[jax.Array], indices: list[int], out: list
) -> None:
  offset = 0
  for i in indices:
    size = leaves[i].size
    out[i] = flat[offset:offset + size].reshape(leaves[i].shape)
    offset += size


def reduce_halves(
    mean_shares,
    axis_name: str,
    reduction: Reduction = "scatter",
    *,
    diff_shares=None,
    diff_sign: jax.Array | None = None,
) -> tuple[object, HalfStatistics]:
  """Reduces per-device ``(m_i, d_i)`` shares to ``M`` and the half statistics.

  Args:
    mean_shares: this device's share ``m_i`` of the mean gradient (a pytree).
    axis_name: the mapped axis to reduce over.
    reduction: ``"scatter"`` (1.5x the bytes of an all-reduce) or
      ``"stacked"`` (2x).
    diff_shares: this device's share ``d_i`` of the half-difference, same
      structure and dtypes as ``mean_shares`` (the local-halves split).
    diff_sign: instead of ``diff_shares``, a scalar ``s_i`` with
      ``d_i = s_i * m_i`` (the device split: +1 on the first half of the
      devices, -1 on the second), applied to the flattened vector in one pass.

  Returns:
    ``(mean, stats)``: ``mean`` is ``M = mean_i m_i`` with the structure and
    dtypes of ``mean_shares`` (what ``lax.pmean`` would return), and ``stats``
    the global :class:`HalfStatistics`, identical on every device.
  """
  if reduction not in REDUCTIONS:
    raise ValueError(f"reduction={reduction!r} is not one of {REDUCTIONS}")
  if (diff_shares is None) == (diff_sign is None):
    raise ValueError("give exactly one of diff_shares and diff_sign")
  num_devices = lax.axis_size(axis_name)
  mean_leaves, treedef = jax.tree.flatten(mean_shares)
  diff_leaves = None if diff_shares is None else treedef.flatten_up_to(diff_shares)
  out_leaves: list = [None] * len(mean_leaves)
  local_stats = jnp.zeros((5,), jnp.float32)
  # Like lax.pmean, the gathered mean is the same on every device; say so to
  # shard_map's type system so that it can leave the step replicated (P()).
  gather_kwargs = {"to": "invarying"} if tracks_varying(axis_name) else {}

  for dtype, indices in _dtype_groups(mean_leaves).items():
    flat_mean = _flatten(mean_leaves, indices)
    if diff_leaves is None:
      flat_diff = flat_mean * diff_sign.astype(dtype)
    else:
      flat_diff = _flatten(diff_leaves, indices).astype(dtype)
    length = flat_mean.shape[0]
    stacked = jnp.stack([flat_mean, flat_diff])
    if reduction == "stacked":
      summed = lax.psum(stacked, axis_name) / jnp.asarray(num_devices, dtype)
      local_stats = local_stats + _partial_statistics(summed[0], summed[1])
      flat_out = summed[0]
    else:
      padded_length = -(-length // num_devices) * num_devices
      stacked = jnp.pad(stacked, ((0, 0), (0, padded_length - length)))
      shard = lax.psum_scatter(stacked, axis_name, scatter_dimension=1, tiled=True)
      shard = shard / jnp.asarray(num_devices, dtype)
      local_stats = local_stats + _partial_statistics(shard[0], shard[1])
      flat_out = lax.all_gather(shard[0], axis_name, tiled=True, **gather_kwargs)[:length]
    _unflatten_into(flat_out, mean_leaves, indices, out_leaves)

  if reduction == "scatter":
    local_stats = lax.psum(local_stats, axis_name)
  return jax.tree.unflatten(treedef, out_leaves), HalfStatistics(*local_stats)
