"""In-graph: the float32 statistics of two half gradients, of pieces or of global arrays.

:class:`HalfStatistics` holds ``<g_A, g_B>``, ``|g_A|^2``, ``|g_B|^2`` and
``|M|^2``. Every one of them is linear in sums over the gradient's entries,
so the statistics of pieces add up to the whole gradient's:

* :func:`pair_statistics` sums matching pieces of the two halves, as a
  device holds them inside a collective reduction
  (:mod:`simigrad_jax.reductions.halves_reduction`), whose partial sums one small
  ``psum`` then adds;
* :func:`global_halves` sums each leaf of two half gradients that are global
  arrays, in a plain ``jax.jit`` step: on a leaf sharded over a mesh XLA's
  partitioner sums each shard on its device and adds the partial sums in a
  small collective.

Every dot product and norm is accumulated in float32, whatever the
gradient's dtype.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class HalfStatistics(NamedTuple):
  """Global float32 statistics of the two half-mean gradients (same on every device)."""

  dot_ab: jax.Array  # <g_A, g_B>
  sq_norm_a: jax.Array  # |g_A|^2
  sq_norm_b: jax.Array  # |g_B|^2
  # |M|^2, M = s g_A + (1 - s) g_B in float32 (the returned mean before rounding to a bf16
  # gradient's dtype)
  sq_norm_mean: jax.Array
  finite: jax.Array  # bool: every statistic is finite (no NaN or infinity in the gradients)


def finish_statistics(
  dot_ab: jax.Array, sq_a: jax.Array, sq_b: jax.Array, sq_mean: jax.Array
) -> HalfStatistics:
  """Packs summed float32 statistics; a NaN or infinite entry anywhere makes a norm non-finite.

  ``sq_mean`` was derived from the other three (see :func:`pair_statistics`);
  it carries their absolute rounding, so it is clamped at 0 for halves that
  nearly cancel (``jnp.maximum`` keeps a NaN).
  """
  sq_mean = jnp.maximum(sq_mean, 0.0)
  finite = jnp.isfinite(sq_a) & jnp.isfinite(sq_b) & jnp.isfinite(dot_ab) & jnp.isfinite(sq_mean)
  return HalfStatistics(dot_ab, sq_a, sq_b, sq_mean, finite)


# Independent blocks per vector in the statistics' reduction (see pair_statistics).
STATISTICS_BLOCKS = 4


def pair_statistics(
  half_a: jax.Array, half_b: jax.Array, share: float | jax.Array = 0.5
) -> jax.Array:
  """Float32 ``[<a, b>, |a|^2, |b|^2, |s a + (1 - s) b|^2]`` of matching pieces of the halves.

  The last is derived, ``s^2 |a|^2 + (1 - s)^2 |b|^2 + 2 s (1 - s) <a, b>``,
  at no pass over the gradient. All four are linear in the sums, so pieces'
  statistics add up to the whole gradient's.

  One variadic reduction of float32 products: XLA reads each piece once and
  makes no float32 copy of a bfloat16 piece. The vectors are cut into
  :data:`STATISTICS_BLOCKS` contiguous blocks whose products are reduced side
  by side: XLA:CPU emits a reduction to a scalar as one sequential loop, paced
  by the latency of its float additions, and independent accumulators let that
  loop overlap them (8 devices of 233k elements: 2.0 ms -> 1.2 ms a step).
  Blocked sums also round less than one running sum. Pieces of
  :data:`LONG_PIECE` entries or more are summed by rows instead
  (:func:`_long_pair_statistics`), where a block's running sum would lose
  accuracy.
  """
  half_a = half_a.astype(jnp.float32)
  half_b = half_b.astype(jnp.float32)
  length = half_a.shape[0]
  if length >= LONG_PIECE:
    return _long_pair_statistics(half_a, half_b, share)
  blocks = STATISTICS_BLOCKS if length >= 1024 * STATISTICS_BLOCKS else 1
  width = length // blocks
  products = []
  for block in range(blocks):
    a = half_a[block * width : (block + 1) * width]
    b = half_b[block * width : (block + 1) * width]
    products += [a * b, a * a, b * b]
  zero = jnp.zeros((), jnp.float32)
  sums = lax.reduce(tuple(products), (zero,) * len(products), _add_each, (0,))
  totals = jnp.stack(sums).reshape(blocks, 3).sum(axis=0)
  if blocks * width < length:  # the last length % blocks elements
    a, b = half_a[blocks * width :], half_b[blocks * width :]
    totals = totals + jnp.stack([jnp.sum(a * b), jnp.sum(a * a), jnp.sum(b * b)])
  dot, sq_a, sq_b = totals
  return jnp.stack([dot, sq_a, sq_b, sq_norm_of_mean(dot, sq_a, sq_b, share)])


def squared_norm_of_piece(piece: jax.Array) -> jax.Array:
  """Float32 ``|piece|^2`` of a 1-D piece of a gradient, summed as :func:`pair_statistics` sums.

  The piece is both halves of :func:`pair_statistics`, whose three products
  are then one (XLA reads the piece once).
  """
  return pair_statistics(piece, piece)[1]


# Pieces of at least LONG_PIECE entries are summed as rows of STATISTICS_ROW entries.
LONG_PIECE = 1 << 19
STATISTICS_ROW = 2048


def _long_pair_statistics(
  half_a: jax.Array, half_b: jax.Array, share: float | jax.Array
) -> jax.Array:
  """:func:`pair_statistics` of long float32 pieces: per-row sums, then a sum of the rows.

  A sequential float32 sum over millions of entries rounds off a norm's
  leading digits, and the similarity with them; rows of
  :data:`STATISTICS_ROW` entries, then a sum of the rows' partial sums, keep
  each running sum short, at about twice the time of the blocked sums on
  XLA:CPU (the errors measured: docs/design.md, "Long pieces").
  """
  length = half_a.shape[0]
  rows = length // STATISTICS_ROW
  head = rows * STATISTICS_ROW
  a = half_a[:head].reshape(rows, STATISTICS_ROW)
  b = half_b[:head].reshape(rows, STATISTICS_ROW)
  zero = jnp.zeros((), jnp.float32)
  sums = lax.reduce((a * b, a * a, b * b), (zero,) * 3, _add_each, (1,))
  totals = jnp.stack([jnp.sum(row_sums) for row_sums in sums])
  if head < length:
    a, b = half_a[head:], half_b[head:]
    totals = totals + jnp.stack([jnp.sum(a * b), jnp.sum(a * a), jnp.sum(b * b)])
  dot, sq_a, sq_b = totals
  return jnp.stack([dot, sq_a, sq_b, sq_norm_of_mean(dot, sq_a, sq_b, share)])


def sq_norm_of_mean(
  dot: jax.Array, sq_a: jax.Array, sq_b: jax.Array, share: float | jax.Array
) -> jax.Array:
  """``|s a + (1 - s) b|^2 = s^2 |a|^2 + (1 - s)^2 |b|^2 + 2 s (1 - s) <a, b>``, in float32."""
  share = jnp.asarray(share, jnp.float32)
  return share * share * sq_a + (1 - share) * (1 - share) * sq_b + 2 * share * (1 - share) * dot


def halves_of(
  mean: jax.Array, diff: jax.Array, share: float | jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Float32 ``(g_A, g_B) = (M + 2 (1 - s) D, M - 2 s D)``; ``(M + D, M - D)`` for ``s = 1/2``.

  A half with no example (``s`` 0 or 1) is exactly zero, not the rounding
  left over from ``M - 2 D``, so that its similarity reads as not measured.
  """
  mean32, diff32 = mean.astype(jnp.float32), diff.astype(jnp.float32)
  if isinstance(share, float) and share == 0.5:
    return mean32 + diff32, mean32 - diff32
  share = jnp.asarray(share, jnp.float32)
  first = jnp.where(share > 0, mean32 + (2 * (1 - share)) * diff32, 0.0)
  return first, jnp.where(share < 1, mean32 - (2 * share) * diff32, 0.0)


def zeros_unless(finite: jax.Array, tree: Any) -> Any:
  """``tree`` where ``finite`` (a bool scalar) is True, else zeros of its leaves' shapes and dtypes.

  How a mean whose statistics are not finite is zeroed (``nonfinite="zero"``),
  by every reduction and by the transform: a ``where`` per leaf, which XLA
  fuses into whatever reads the mean.

  Args:
    finite: whether to keep ``tree`` (a bool scalar, may be traced).
    tree: arrays, or a single array.

  Returns:
    ``tree``, or its zeros.

  Example::

    >>> zeros_unless(jnp.array(False), {"w": jnp.ones(2)})["w"].tolist()
    [0.0, 0.0]
  """
  return jax.tree.map(lambda x: jnp.where(finite, x, jnp.zeros_like(x)), tree)


def flatten_up_to(treedef: jax.tree_util.PyTreeDef, tree: Any) -> list[Any]:
  """The subtrees of ``tree`` at the leaves of ``treedef``, a prefix of its structure."""
  return treedef.flatten_up_to(tree)


def global_halves(
  mean: Any,
  first: Any,
  second: Any,
  *,
  zero_nonfinite: bool = False,
  share: float | jax.Array = 0.5,
) -> tuple[object, HalfStatistics]:
  """The statistics of two half gradients that are global arrays (a plain ``jax.jit`` step).

  Each leaf's three sums, ``<a, b>``, ``|a|^2`` and ``|b|^2``, are reductions
  of the leaf as it lies, in float32: on a leaf sharded over a mesh (data,
  model axes or both, ``Auto`` or ``Explicit``) XLA's partitioner sums each
  shard on its device and adds the partial sums in a small collective, so no
  leaf is gathered, flattened or copied, and the mean keeps its sharding.

  Args:
    mean: ``M = share * g_A + (1 - share) * g_B``, returned as given (zeroed
      with ``zero_nonfinite`` when a statistic is not finite).
    first: ``g_A``, the first half's mean gradient, same structure as ``mean``.
    second: ``g_B``, the second half's.
    zero_nonfinite: return a zero mean when ``stats.finite`` is False.
    share: the first half's fraction of the examples (a scalar, may be
      traced); a half with no example (``share`` 0 or 1) counts as exactly zero.

  Returns:
    ``(mean, stats)``: the mean, and the :class:`HalfStatistics` of ``g_A``
    and ``g_B``.
  """
  treedef = jax.tree.structure(mean)
  totals = jnp.zeros((3,), jnp.float32)
  for a, b in zip(flatten_up_to(treedef, first), flatten_up_to(treedef, second), strict=True):
    totals = totals + _leaf_statistics(*_present_halves(a, b, share))
  dot, sq_a, sq_b = totals[0], totals[1], totals[2]
  stats = finish_statistics(dot, sq_a, sq_b, sq_norm_of_mean(dot, sq_a, sq_b, share))
  if zero_nonfinite:
    mean = zeros_unless(stats.finite, mean)
  return mean, stats


def _present_halves(
  a: jax.Array, b: jax.Array, share: float | jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Float32 ``a`` and ``b``, a half with no example (``share`` 0 or 1) exactly zero."""
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  if isinstance(share, float) and 0 < share < 1:
    return a, b
  share = jnp.asarray(share, jnp.float32)
  return jnp.where(share > 0, a, 0.0), jnp.where(share < 1, b, 0.0)


# The lanes a last axis is cut into for the statistics' reduction (see _leaf_statistics).
STATISTICS_LANES = 32


def _leaf_statistics(a: jax.Array, b: jax.Array) -> jax.Array:
  """Float32 ``[<a, b>, |a|^2, |b|^2]`` of one leaf, each a sum over all its entries.

  One variadic reduction over one axis gives each row's three partial sums,
  and a sum of those rows gives the totals. Reading both operands in one
  reduction fuses the products into it whatever the gradient's memory layout:
  a sum of one product alone may go to a library kernel that wants the default
  layout (XLA:CPU's YNNPACK reductions), which copies a transposed gradient (a
  dense kernel's, reduced over the data axis) into a temporary first. Each
  sequential float32 run is one row long, and the rows are summed pairwise.
  On a sharded leaf every device reduces its own shard and the partial sums
  meet in a small all-reduce (or, when the reduced axis is sharded, an
  all-gather of the rows' partial sums).

  Where no mesh axis can shard the leaf (:func:`_unsharded_here`: one
  device, or the step's own device inside a ``shard_map``), the reduced last
  axis is cut into lanes of :data:`STATISTICS_LANES` entries and the
  reduction runs over the lanes' blocks, each lane's partial sums kept
  apart: XLA:CPU then adds a whole lane of a row at once in vector
  registers, where a sum along the row is one sequential loop paced by the
  latency of its float additions. The totals are the same sums, added in
  another order (docs/results.md, "Measuring every k-th step", says what it
  saves). A leaf that may be sharded is reduced as it lies: a reshape of a
  sharded axis can gather it.
  """
  products: tuple[jax.Array, ...] = (a * b, a * a, b * b)
  if a.ndim < 2:
    return jnp.stack([jnp.sum(product) for product in products])
  zero = jnp.zeros((), jnp.float32)
  axis = _reduced_axis(a)
  length = a.shape[axis]
  if (
    axis == a.ndim - 1
    and length > STATISTICS_LANES
    and length % STATISTICS_LANES == 0
    and _unsharded_here()
  ):
    lanes = a.shape[:-1] + (length // STATISTICS_LANES, STATISTICS_LANES)
    products = tuple(product.reshape(lanes) for product in products)
  rows = lax.reduce(products, (zero,) * 3, _add_each, (axis,))
  return jnp.stack([jnp.sum(row) for row in rows])


def _add_each(x: tuple, y: tuple) -> tuple:
  return tuple(p + q for p, q in zip(x, y, strict=True))


def _reduced_axis(leaf: jax.Array) -> int:
  """The axis the statistics reduce first: one no mesh axis shards, when the spec says.

  A reduced axis that is not sharded leaves each device's partial sums whole,
  for one scalar all-reduce. Under Explicit axes that is the first axis no mesh
  axis shards: the one a dense kernel's gradient holds contiguously when XLA
  keeps it transposed (reduced over the data axis), which XLA:CPU reads fastest.
  Under Auto axes only XLA knows the sharding: the last axis, since FSDP
  shards the first.
  """
  if not _explicit(leaf):
    return leaf.ndim - 1
  spec = tuple(jax.typeof(leaf).sharding.spec) + (None,) * leaf.ndim
  free = [axis for axis in range(leaf.ndim) if spec[axis] is None]
  return free[0] if free else leaf.ndim - 1


def _unsharded_here() -> bool:
  """Whether no mesh axis can shard an array here: the context's mesh is known and each of its
  axes is manual (a ``shard_map``'s) or of size 1."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return False
  return all(
    size == 1 or kind == jax.sharding.AxisType.Manual
    for size, kind in zip(mesh.axis_sizes, mesh.axis_types, strict=True)
  )


def _explicit(leaf: jax.Array) -> bool:
  """Whether ``leaf`` lies on a mesh with ``Explicit`` axes (its type then says its sharding)."""
  mesh = jax.typeof(leaf).sharding.mesh
  return jax.sharding.AxisType.Explicit in getattr(mesh, "axis_types", ())
