"""In-graph: reduce per-device gradients to their mean and the two half-mean statistics.

Runs inside a step mapped over a named axis (``jax.pmap`` or ``jax.shard_map``).
A plain ``jax.jit`` step whose gradients are global arrays sharded over a mesh
needs no collective of its own: XLA's partitioner does the reduction there
(:func:`simigrad_jax.reductions.half_statistics.global_halves`).

The two halves are formed in one of two ways:

* the device split (:func:`reduce_device_halves`): as in the reference
  implementation, the devices are split by the parity of their index on the
  axis. ``g_A`` is the mean gradient of the even devices (0, 2, 4, ...), ``g_B``
  that of the odd devices (1, 3, 5, ...).
* the local split (:func:`reduce_local_halves`): every device splits its own
  batch in two and contributes a pair ``(m_i, d_i)``: its share ``m_i`` of the
  mean gradient and ``d_i = (a_i - b_i) / 2`` of the half-difference. Then
  ``M = mean_i m_i = s g_A + (1 - s) g_B`` (``s`` the first half's share of
  the examples, 1/2 for equal halves), ``D = mean_i d_i = (g_A - g_B) / 2``,
  ``g_A = M + 2 (1 - s) D`` and ``g_B = M - 2 s D``.

Both return what ``lax.pmean`` would (the mean gradient, in each leaf's own
dtype) plus float32 :class:`HalfStatistics`, identical on every device. A
step that does not measure (``measure_every``) has no halves:
:func:`reduce_mean` returns the mean and its squared norm, reduced as the
device split's hierarchical reduction reduces (reduce-scatter, the norm on
each device's piece, all-gather).

Reductions, with the bytes each device sends relative to one plain ring
all-reduce of the gradient:

* ``"hierarchical"`` (default, 1.0x for the device split): per bucket of
  leaves, reduce-scatter within each parity group (the even devices; the odd
  devices), so that devices ``2j`` and ``2j + 1`` hold the same two pieces of
  their own group's sum; each keeps one piece and swaps the other with its
  partner (one all-to-all within the pair: no collective-permute), takes the
  dot products and norms on the piece it now holds for both halves, computes
  its piece of the mean, and one tiled all-gather over all devices assembles
  the mean. The sends add up to ``2 (n - 1) / n`` of the
  gradient, exactly what an all-reduce sends. No whole-gradient concatenation,
  stack or copy: large leaves are reduced in place, small leaves share one
  bucket per dtype. With the local split there are two vectors to reduce, so
  it reduce-scatters ``m`` and ``d`` per bucket (1.5x).
* ``"scatter"`` (1.5x): leaves concatenated per dtype; the pair ``(m, d)``
  stacked and reduce-scattered; all-gather of the mean. Kept for comparison.
* ``"stacked"`` (2x): one psum of the stacked pair. Kept for comparison.

Collectives run in the gradient's own dtype (bfloat16 gradients move bfloat16
bytes), while every dot product and norm is accumulated in float32
(:mod:`simigrad_jax.reductions.half_statistics`).
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from simigrad_jax.reductions import group_reduction
from simigrad_jax.reductions.half_statistics import HalfStatistics
from simigrad_jax.reductions.half_statistics import finish_statistics
from simigrad_jax.reductions.half_statistics import flatten_up_to
from simigrad_jax.reductions.half_statistics import halves_of
from simigrad_jax.reductions.half_statistics import pair_statistics
from simigrad_jax.reductions.half_statistics import squared_norm_of_piece
from simigrad_jax.reductions.half_statistics import zeros_unless

Reduction = Literal["hierarchical", "scatter", "stacked"]
REDUCTIONS: tuple[str, ...] = ("hierarchical", "scatter", "stacked")

# Leaves with fewer entries than this are concatenated into one bucket per dtype,
# so that biases and normalisation scales do not each cost three collectives.
SMALL_LEAF_SIZE = 1 << 16


def tracks_varying(axis_name: str) -> bool:
  """Whether the type system records which values vary over ``axis_name``.

  True inside ``jax.shard_map`` with ``check_vma=True``; False under
  ``jax.pmap``, ``check_vma=False`` and ``jax.vmap``.
  """
  index_type = getattr(jax.typeof(lax.axis_index(axis_name)), "manual_axis_type", None)
  return index_type is not None and axis_name in index_type.varying


def device_parity(axis_name: str) -> jax.Array:
  """0 on the devices of the first half (even index on the axis), 1 on the second (odd)."""
  return lax.axis_index(axis_name) % 2


def check_even_axis(axis_name: str) -> int:
  """The size of ``axis_name``; raises unless it is even (the device split needs two halves)."""
  num_devices = lax.axis_size(axis_name)
  if num_devices % 2:
    raise ValueError(
      f"axis {axis_name!r} has {num_devices} device(s); splitting devices into "
      "two halves needs an even count. Split each device's batch instead: "
      "compute the half gradients with simigrad_jax.value_and_half_grads and "
      "pass them as half_grads=..."
    )
  return num_devices


# ------------------------------------------------------------------ buckets of leaves


def _buckets(
  leaves: list[jax.Array],
  weights: list[float] | None = None,
  alone: frozenset[int] = frozenset(),
) -> list[list[int]]:
  """Leaf indices per bucket: every large leaf alone, the small ones of each dtype together.

  With ``weights`` (one per leaf), small leaves share a bucket only with
  leaves of the same weight. The leaves in ``alone`` get a bucket each.
  """
  buckets: list[list[int]] = []
  small: dict[tuple[jnp.dtype, float], list[int]] = {}
  for index, leaf in enumerate(leaves):
    if leaf.size >= SMALL_LEAF_SIZE or index in alone:
      buckets.append([index])
    else:
      weight = 1.0 if weights is None else weights[index]
      small.setdefault((jnp.dtype(leaf.dtype), weight), []).append(index)
  return buckets + [indices for indices in small.values() if indices]


def _flat_bucket(leaves: list[jax.Array], indices: list[int], multiple: int) -> jax.Array:
  """The bucket's leaves as one vector, zero-padded to a multiple of ``multiple``."""
  return _concatenated([leaves[i] for i in indices], multiple)


def _concatenated(parts: list[jax.Array], multiple: int = 1) -> jax.Array:
  """The parts, raveled, one after another, then zeros up to a multiple of ``multiple``.

  The zeros are one more operand of the concatenation, not a ``jnp.pad`` of
  it: XLA:CPU fuses a pad of a concatenation and the producers of its
  operands into one loop, and when a producer is a reduction (a bias
  gradient summed over the batch's rows) that loop cost more than the
  step's matrix products. One part and no zeros: a view, no copy.
  """
  flat = [jnp.ravel(part) for part in parts]
  padding = -sum(part.shape[0] for part in flat) % multiple
  if padding:
    flat.append(jnp.zeros((padding,), flat[0].dtype))
  return flat[0] if len(flat) == 1 else jnp.concatenate(flat)


def _unflatten_bucket(
  flat: jax.Array, leaves: list[jax.Array], indices: list[int], out: list
) -> None:
  offset = 0
  for i in indices:
    size = leaves[i].size
    piece = flat if (len(indices) == 1 and flat.shape[0] == size) else flat[offset : offset + size]
    out[i] = piece.reshape(leaves[i].shape)
    offset += size


def _gather_kwargs(axis_name: str) -> dict[str, str]:
  # Like lax.pmean, the gathered mean is the same on every device; say so to
  # shard_map's type system so that a step can keep its outputs replicated (P()).
  return {"to": "invarying"} if tracks_varying(axis_name) else {}


# ------------------------------------------------------------------ the device split


class _GroupsUnsupported(Exception):
  """This trace cannot reduce within device groups (``jax.vmap`` cannot)."""


def _scatter_within(
  x: jax.Array, axis_name: str, groups: list[list[int]], dimension: int = 0
) -> jax.Array:
  try:
    return lax.psum_scatter(
      x, axis_name, scatter_dimension=dimension, tiled=True, axis_index_groups=groups
    )
  except NotImplementedError as error:
    raise _GroupsUnsupported() from error


def reduce_device_halves(
  grads: Any,
  axis_name: str,
  reduction: Reduction = "hierarchical",
  *,
  zero_nonfinite: bool = False,
  scatter_dims: Any = None,
  specs: Any = None,
) -> tuple[object, HalfStatistics]:
  """Reduces each device's own gradient to the mean and the statistics of the parity halves.

  Inside a ``jax.shard_map`` that is manual over ``axis_name`` only, with
  other mesh axes left to XLA's partitioner (tensor-parallel leaves), the
  hierarchical reduction runs on each device's own shard of every leaf
  (:func:`simigrad_jax.reductions.group_reduction.on_local_shards`), laid out
  as ``specs`` or, without them, as the leaves' types say.

  Args:
    grads: this device's gradient (a pytree).
    axis_name: the mapped axis to reduce over; its size must be even.
    reduction: ``"hierarchical"`` (one all-reduce's bytes), ``"scatter"`` or
      ``"stacked"`` (see the module docstring).
    zero_nonfinite: return a zero mean when ``stats.finite`` is False.
    scatter_dims: None, or a pytree like ``grads`` of an int or None per
      leaf: a leaf with a dimension ``d`` comes back as this device's block
      of the mean along ``d`` (device ``i`` of ``n`` holds the ``i``-th of
      ``n`` equal blocks, the layout of a leaf sharded over ``axis_name`` on
      ``d``: FSDP), never gathered; ``d`` must divide by ``n``. Needs the
      ``"hierarchical"`` reduction.
    specs: None, or a ``PartitionSpec`` per leaf (a pytree like ``grads``;
      the parameters' specs, ``axis_name`` ignored in them): the leaves'
      layout over the other mesh axes, where their types do not carry it
      (``Auto`` axes): with them each device reduces its own shard of a
      tensor-parallel leaf instead of the leaf gathered whole.

  Returns:
    ``(mean, stats)``: ``mean`` as ``lax.pmean(grads, axis_name)`` returns it
    (but for ``scatter_dims``' blocks), and the :class:`HalfStatistics` of
    ``g_A`` (even devices) and ``g_B`` (odd devices).
  """
  _check_reduction(reduction)
  num_devices = check_even_axis(axis_name)
  dims = None
  if scatter_dims is not None:
    dims = flatten_up_to(jax.tree.structure(grads), scatter_dims)
    if reduction != "hierarchical" and any(d is not None for d in dims):
      raise ValueError(
        f"reduction={reduction!r} gathers every leaf's mean; a mean kept in blocks "
        "(scatter_dims) needs reduction='hierarchical'"
      )
  sign = 1 - 2 * device_parity(
    axis_name
  )  # +1 on the first half, -1 on the second: d_i = sign * m_i
  if reduction != "hierarchical":
    return _reduce_concatenated(grads, None, axis_name, reduction, zero_nonfinite, diff_sign=sign)
  try:
    return group_reduction.on_local_shards(
      lambda local, weights, other_axes: reduce_hierarchical(
        local,
        axis_name,
        num_devices,
        zero_nonfinite,
        weights=weights,
        other_axes=other_axes,
        scatter_dims=dims,
      ),
      grads,
      axis_name,
      specs,
    )
  except _GroupsUnsupported:
    # Under jax.vmap with a named axis there is no network to save bytes on.
    return _reduce_concatenated(grads, None, axis_name, "scatter", zero_nonfinite, diff_sign=sign)


def _both_halves(
  own: jax.Array, axis_name: str, num_devices: int, dim: int = 0
) -> tuple[jax.Array, jax.Array]:
  """The first and second half's sums of one piece, from partners' group pieces.

  Devices ``2j`` (first half) and ``2j + 1`` (second half) each hold their
  own half's sums of pieces ``2j`` and ``2j + 1``, side by side along
  ``dim`` (of size 2). One all-to-all within the pair sends each device's
  piece ``k`` to the pair's device ``k``: device ``2j + k`` receives both
  halves' sums of piece ``2j + k``, first half first. Each device sends one
  piece, what a swap with the partner would send, and no collective-permute
  is needed.
  """
  pairs = [[i, i + 1] for i in range(0, num_devices, 2)]
  try:
    both = lax.all_to_all(own, axis_name, dim, dim, tiled=True, axis_index_groups=pairs)
  except NotImplementedError as error:
    raise _GroupsUnsupported() from error
  return jnp.take(both, 0, axis=dim), jnp.take(both, 1, axis=dim)


def _halves_in_blocks(
  leaf: jax.Array, axis_name: str, num_devices: int, groups: list[list[int]], dim: int
) -> tuple[jax.Array, jax.Array]:
  """Both halves' sums of this device's block of ``leaf`` along ``dim`` (FSDP's layout).

  The reduce-scatter within each parity group leaves devices ``2j`` and
  ``2j + 1`` blocks ``2j`` and ``2j + 1`` of their group's sum, side by side;
  the swap within the pair then gives device ``i`` both halves' block ``i``:
  the block that a leaf sharded over the axis on ``dim`` keeps there.
  """
  size = leaf.shape[dim]
  if size % num_devices:
    raise ValueError(
      f"a gradient kept in blocks along dimension {dim} (size {size}) over the "
      f"{num_devices} devices of axis {axis_name!r} needs a size that divides by {num_devices}"
    )
  own = _scatter_within(leaf, axis_name, groups, dim)
  split = own.shape[:dim] + (2, size // num_devices) + own.shape[dim + 1 :]
  return _both_halves(own.reshape(split), axis_name, num_devices, dim)


def reduce_hierarchical(
  grads: Any,
  axis_name: str,
  num_devices: int,
  zero_nonfinite: bool,
  *,
  weights: list[float] | None = None,
  other_axes: tuple[str, ...] = (),
  scatter_dims: list[int | None] | None = None,
) -> tuple[object, HalfStatistics]:
  """The device split's ``"hierarchical"`` reduction (see the module docstring).

  ``weights`` (one per leaf) scale each leaf's statistics, and the partial
  sums are added over ``axis_name`` and ``other_axes``: a leaf whose shard
  repeats on ``k`` devices of the other axes counts ``1 / k`` on each. A
  leaf with a dimension in ``scatter_dims`` keeps this device's block of the
  mean along it (:func:`reduce_device_halves`).
  """
  groups = [list(range(0, num_devices, 2)), list(range(1, num_devices, 2))]
  half = num_devices // 2
  leaves, treedef = jax.tree.flatten(grads)
  dims = scatter_dims or [None] * len(leaves)
  buckets = _buckets(leaves, weights, frozenset(i for i, d in enumerate(dims) if d is not None))
  pieces = []
  partial = jnp.zeros((4,), jnp.float32)
  for indices in buckets:
    dim = dims[indices[0]]
    if dim is None:
      flat = _flat_bucket(leaves, indices, num_devices)
      # Device 2j and 2j + 1 receive pieces (2j, 2j + 1) of their own group's sum.
      own = _scatter_within(flat, axis_name, groups).reshape(2, -1)
      first, second = _both_halves(own, axis_name, num_devices)
    else:
      first, second = _halves_in_blocks(leaves[indices[0]], axis_name, num_devices, groups, dim)
    pieces.append((first + second) / jnp.asarray(num_devices, first.dtype))
    weight = 1.0 if weights is None else weights[indices[0]]
    partial = partial + weight * pair_statistics(jnp.ravel(first), jnp.ravel(second))
  # The groups' sums are half times their means.
  sums = lax.psum(partial, (axis_name, *other_axes)) / float(half * half)
  stats = finish_statistics(*sums)
  mean = _gather_mean(
    pieces, buckets, dims, leaves, treedef, axis_name, stats.finite, zero_nonfinite
  )
  return mean, stats


def _gather_mean(
  pieces: list[jax.Array],
  buckets: list[list[int]],
  dims: list[int | None],
  leaves: list[jax.Array],
  treedef: jax.tree_util.PyTreeDef,
  axis_name: str,
  finite: jax.Array,
  zero_nonfinite: bool,
) -> Any:
  """All-gathers each bucket's piece of the mean into the gradient's structure.

  A leaf with a dimension in ``dims`` keeps its block, ungathered. With
  ``zero_nonfinite``, the pieces are zeroed first where ``finite`` (a bool
  scalar: the statistics are finite) is False: a ``1 / n`` piece is cheaper
  to mask than the gathered gradient.
  """
  out: list = [None] * len(leaves)
  for piece, indices in zip(pieces, buckets, strict=True):
    if zero_nonfinite:
      piece = zeros_unless(finite, piece)
    if dims[indices[0]] is not None:
      out[indices[0]] = piece
      continue
    flat_mean = lax.all_gather(piece, axis_name, tiled=True, **_gather_kwargs(axis_name))
    _unflatten_bucket(flat_mean, leaves, indices, out)
  return jax.tree.unflatten(treedef, out)


# ------------------------------------------------------------------ the local split


def reduce_local_halves(
  mean_shares: Any,
  diff_shares: Any,
  axis_name: str,
  reduction: Reduction = "hierarchical",
  *,
  zero_nonfinite: bool = False,
  share: float | jax.Array = 0.5,
) -> tuple[object, HalfStatistics]:
  """Reduces per-device ``(m_i, d_i)`` shares to ``M`` and the statistics of the two halves.

  Args:
    mean_shares: this device's share ``m_i`` of the mean gradient (a pytree).
    diff_shares: its share ``d_i`` of the half-difference, same structure and
      dtypes as ``mean_shares``.
    axis_name: the mapped axis to reduce over (any size, 1 included).
    reduction: ``"hierarchical"`` (per bucket: reduce-scatter ``m`` and ``d``,
      statistics on the shards, all-gather the mean; 1.5x an all-reduce),
      ``"scatter"`` or ``"stacked"`` (see the module docstring).
    zero_nonfinite: return a zero mean when ``stats.finite`` is False.
    share: the first half's fraction of the examples, ``M = share * g_A +
      (1 - share) * g_B`` (a scalar, may be traced).

  Returns:
    ``(mean, stats)``: ``mean = M`` with the structure and dtypes of
    ``mean_shares``, and the :class:`HalfStatistics` of ``g_A = M + 2 (1 -
    share) D`` and ``g_B = M - 2 share D``.
  """
  _check_reduction(reduction)
  if reduction != "hierarchical":
    return _reduce_concatenated(
      mean_shares, diff_shares, axis_name, reduction, zero_nonfinite, share=share
    )
  num_devices = lax.axis_size(axis_name)
  leaves, treedef = jax.tree.flatten(mean_shares)
  diff_leaves = flatten_up_to(treedef, diff_shares)
  buckets = _buckets(leaves)
  pieces = []
  partial = jnp.zeros((4,), jnp.float32)
  for indices in buckets:
    flat_mean = _flat_bucket(leaves, indices, num_devices)
    flat_diff = _flat_bucket(diff_leaves, indices, num_devices).astype(flat_mean.dtype)
    count = jnp.asarray(num_devices, flat_mean.dtype)
    mean_shard = lax.psum_scatter(flat_mean, axis_name, tiled=True) / count
    diff_shard = lax.psum_scatter(flat_diff, axis_name, tiled=True) / count
    partial = partial + pair_statistics(*halves_of(mean_shard, diff_shard, share), share)
    pieces.append(mean_shard)
  stats = finish_statistics(*lax.psum(partial, axis_name))
  dims: list[int | None] = [None] * len(leaves)
  return _gather_mean(
    pieces, buckets, dims, leaves, treedef, axis_name, stats.finite, zero_nonfinite
  ), stats


# ------------------------------------------------------------------ a step that does not measure


def reduce_mean(
  grads: Any, axis_name: str, *, zero_nonfinite: bool = False, specs: Any = None
) -> tuple[Any, jax.Array]:
  """Reduces each device's own gradient to the mean and the mean's squared norm (no halves).

  The reduction of a step that does not measure (``measure_every``): what
  ``lax.pmean(grads, axis_name)`` returns, and ``|mean|^2`` in float32, at
  the bytes of one all-reduce. Per bucket of leaves (as the hierarchical
  reduction's), one reduce-scatter, then the piece's mean and its squared
  norm on the ``1 / n`` piece each device holds, and one all-gather of the
  mean; one scalar ``psum`` adds the partial norms. An all-reduce followed by
  the norm would have every device write the whole mean (the sum divided by
  ``n``) and read it back for the norm. The mean's numbers are the
  all-reduce's; the norm's partial sums are added in another order than a
  norm of the gathered mean.

  Inside a ``jax.shard_map`` that is manual over ``axis_name`` only, each
  device reduces its own shard of a leaf that other mesh axes shard
  (:func:`simigrad_jax.reductions.group_reduction.on_local_shards`; ``specs``
  as for :func:`reduce_device_halves`).

  Args:
    grads: this device's gradient (a pytree).
    axis_name: the mapped axis to reduce over (any size).
    zero_nonfinite: return a zero mean when the squared norm is not finite.
    specs: None, or a ``PartitionSpec`` per leaf (see :func:`reduce_device_halves`).

  Returns:
    ``(mean, sq_norm)``: ``mean`` as ``lax.pmean(grads, axis_name)`` returns
    it, and its float32 squared norm (identical on every device; not finite
    when the gradient is not).
  """
  num_devices = lax.axis_size(axis_name)

  def reduce(
    local: Any, weights: list[float] | None, other_axes: tuple[str, ...]
  ) -> tuple[Any, jax.Array]:
    leaves, treedef = jax.tree.flatten(local)
    buckets = _buckets(leaves, weights)
    pieces = []
    partial = jnp.zeros([], jnp.float32)
    for indices in buckets:
      flat = _flat_bucket(leaves, indices, num_devices)
      piece = lax.psum_scatter(flat, axis_name, tiled=True) / jnp.asarray(num_devices, flat.dtype)
      weight = 1.0 if weights is None else weights[indices[0]]
      partial = partial + weight * squared_norm_of_piece(piece)
      pieces.append(piece)
    sq_norm = lax.psum(partial, (axis_name, *other_axes))
    dims: list[int | None] = [None] * len(leaves)
    mean = _gather_mean(
      pieces, buckets, dims, leaves, treedef, axis_name, jnp.isfinite(sq_norm), zero_nonfinite
    )
    return mean, sq_norm

  return group_reduction.on_local_shards(reduce, grads, axis_name, specs)


# ------------------------------------------------------------------ concatenated variants


def _check_reduction(reduction: str) -> None:
  if reduction not in REDUCTIONS:
    raise ValueError(f"reduction={reduction!r} is not valid; choose one of {REDUCTIONS}")


def _dtype_groups(leaves: list[jax.Array]) -> dict[jnp.dtype, list[int]]:
  groups: dict[jnp.dtype, list[int]] = {}
  for index, leaf in enumerate(leaves):
    groups.setdefault(jnp.dtype(leaf.dtype), []).append(index)
  return groups


def _reduce_concatenated(
  mean_shares: Any,
  diff_shares: Any,
  axis_name: str,
  reduction: Reduction,
  zero_nonfinite: bool,
  *,
  diff_sign: jax.Array | None = None,
  share: float | jax.Array = 0.5,
) -> tuple[object, HalfStatistics]:
  """``"scatter"`` and ``"stacked"``: every leaf of a dtype in one vector, ``(m, d)`` stacked.

  ``d_i`` is ``diff_shares`` or, for the device split, ``diff_sign * m_i``.
  """
  num_devices = lax.axis_size(axis_name)
  mean_leaves, treedef = jax.tree.flatten(mean_shares)
  diff_leaves = None if diff_shares is None else flatten_up_to(treedef, diff_shares)
  out_leaves: list = [None] * len(mean_leaves)
  partial = jnp.zeros((4,), jnp.float32)
  for dtype, indices in _dtype_groups(mean_leaves).items():
    # The scatter's padding is part of the concatenation (see _concatenated).
    multiple = num_devices if reduction == "scatter" else 1
    length = sum(mean_leaves[i].size for i in indices)
    flat_mean = _concatenated([mean_leaves[i] for i in indices], multiple)
    if diff_leaves is None:
      assert diff_sign is not None  # the device split's d_i = diff_sign * m_i
      flat_diff = flat_mean * diff_sign.astype(dtype)
    else:
      flat_diff = _concatenated([diff_leaves[i] for i in indices], multiple).astype(dtype)
    # One concatenation, not a stack: XLA:CPU fused a stack of the gradient like a pad.
    stacked = jnp.concatenate([flat_mean, flat_diff]).reshape(2, -1)
    count = jnp.asarray(num_devices, dtype)
    if reduction == "stacked":
      summed = lax.psum(stacked, axis_name) / count
      partial = partial + pair_statistics(*halves_of(summed[0], summed[1], share), share)
      flat_out = summed[0]
    else:
      shard = lax.psum_scatter(stacked, axis_name, scatter_dimension=1, tiled=True) / count
      partial = partial + pair_statistics(*halves_of(shard[0], shard[1], share), share)
      flat_out = lax.all_gather(shard[0], axis_name, tiled=True, **_gather_kwargs(axis_name))[
        :length
      ]
    _unflatten_bucket(flat_out, mean_leaves, indices, out_leaves)
  if reduction == "scatter":
    partial = lax.psum(partial, axis_name)
  stats = finish_statistics(*partial)
  if zero_nonfinite:
    out_leaves = zeros_unless(stats.finite, out_leaves)
  return jax.tree.unflatten(treedef, out_leaves), stats
