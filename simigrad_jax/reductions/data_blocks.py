"""In-graph: parameters kept in blocks over the data axis (FSDP) in a step mapped over that axis.

A parameter whose partition spec names the data axis alone on one dimension
(``P("data", None)``, ``P("data", "model")``, ``P("model", "data")``) is
stored in blocks: device ``i`` of the ``n`` on the data axis holds block ``i``
of ``n`` along that dimension. A step that takes each device's gradient in a
``jax.shard_map`` manual over the data axis (the model axes left to XLA's
partitioner) gathers the blocks there for the loss (:meth:`DataBlocks.gather`),
hands the devices' gradients out stacked along a leading data dimension, and
runs the optimizer on global arrays, saying so in the call:
``optimizer.update(stacked, state, params, stacked_grads=StackedGrads(axis_name,
mesh), param_specs=specs)``. :func:`simigrad_jax.transform` then reduces the
stacked gradients with :meth:`DataBlocks.reduce_devices`, which leaves each
such leaf's mean in the same blocks (reduce-scattered, never gathered), so
the update and the optimizer state stay in blocks.

A spec that names the data axis together with another axis on one dimension
(``P(("model", "data"))``) is not kept in blocks: the leaf is gathered whole
over the data axis for the step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from simigrad_jax.reductions import group_reduction
from simigrad_jax.reductions import halves_reduction
from simigrad_jax.reductions.group_reduction import is_spec
from simigrad_jax.reductions.half_statistics import HalfStatistics


def without_axis(spec: P, axis_name: str) -> P:
  """``spec`` with ``axis_name`` taken out of every entry."""

  def kept(entry: Any) -> Any:
    names = (entry,) if isinstance(entry, str) else tuple(entry or ())
    left = tuple(name for name in names if name != axis_name)
    return left[0] if len(left) == 1 else (left or None)

  return P(*(kept(entry) for entry in spec))


def data_dim(spec: P, axis_name: str) -> int | None:
  """The dimension that ``spec`` shards over ``axis_name`` alone, else None.

  Example:
    >>> from jax.sharding import PartitionSpec as P
    >>> data_dim(P("model", "data"), "data"), data_dim(P(("model", "data")), "data")
    (1, None)
  """
  for dim, entry in enumerate(spec):
    if entry == axis_name or entry == (axis_name,):
      return dim
  return None


def _is_dim(x: Any) -> bool:
  return x is None or isinstance(x, int)


class DataBlocks:
  """Where each parameter lies with respect to the data axis, and the specs a step needs.

  Args:
    params: the parameters (a pytree; only its structure is read).
    specs: their whole ``PartitionSpec``s (a pytree like ``params``), or None
      when unknown (every leaf then counts as replicated over the data axis,
      and model axes are left to what the leaves' types say).
    axis_name: the data axis.

  Attributes:
    dims: per leaf, the dimension in blocks over the data axis, or None.
    entry: per leaf, its spec over the data axis alone: how the step's
      ``shard_map`` takes it (and gives its mean back).
    inner: per leaf, its spec without the data axis: its layout over the
      model axes inside that ``shard_map``.
    mean: per leaf, the spec of its mean gradient: its own for a leaf in
      blocks, else ``inner`` (replicated over the data axis).

  Example:
    >>> from jax.sharding import PartitionSpec as P
    >>> blocks = DataBlocks({"w": 0, "b": 0}, {"w": P("data", "model"), "b": P()}, "data")
    >>> blocks.dims, blocks.entry["w"], blocks.inner["w"]
    ({'b': None, 'w': 0}, P('data',), P(None, 'model'))
  """

  def __init__(self, params: Any, specs: Any, axis_name: str) -> None:
    self.axis_name = axis_name
    self.known = specs is not None
    if specs is None:
      specs = jax.tree.map(lambda leaf: P(), params)
    self.specs = specs
    self.dims = jax.tree.map(lambda spec: data_dim(spec, axis_name), specs, is_leaf=is_spec)
    self.entry = jax.tree.map(
      lambda d: P() if d is None else P(*([None] * d), axis_name), self.dims, is_leaf=_is_dim
    )
    self.inner = jax.tree.map(lambda spec: without_axis(spec, axis_name), specs, is_leaf=is_spec)
    self.mean = jax.tree.map(
      lambda spec, d: spec if d is not None else without_axis(spec, axis_name),
      specs,
      self.dims,
      is_leaf=is_spec,
    )

  @property
  def any(self) -> bool:
    """Whether any leaf is kept in blocks."""
    return any(d is not None for d in jax.tree.leaves(self.dims, is_leaf=_is_dim))

  @property
  def model_specs(self) -> Any:
    """The leaves' layout over the model axes (``inner``), or None when the specs are unknown.

    What the reductions are given where the leaves' types do not carry it
    (``Auto`` mesh axes): :func:`simigrad_jax.reductions.group_reduction.on_local_shards`.
    """
    return self.inner if self.known else None

  def gather(self, params: Any) -> Any:
    """Inside a ``shard_map`` manual over the data axis: the parameters whole over it.

    Each block is all-gathered along its dimension, on each device's own
    shards over the model axes (a tensor-parallel kernel stays so).
    """
    if not self.any:
      return params

    def gather_local(local: Any) -> Any:
      return jax.tree.map(
        lambda x, d: x if d is None else lax.all_gather(x, self.axis_name, axis=d, tiled=True),
        local,
        self.dims,
        is_leaf=lambda x: x is None,
      )

    return group_reduction.each_local_shard(gather_local, params, self.axis_name, self.model_specs)

  def reduce_devices(
    self,
    stacked: Any,
    reduction: halves_reduction.Reduction = "hierarchical",
    zero_nonfinite: bool = False,
    *,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    explicit_axes: tuple[str, ...] = (),
  ) -> tuple[Any, HalfStatistics]:
    """The mean and the statistics of the even and odd devices, from their stacked gradients.

    Runs on global arrays, outside the gradient's ``shard_map``, in one of its
    own (manual over the data axis).

    Args:
      stacked: each device's gradient, stacked along a leading dimension
        sharded over the data axis (a pytree like the parameters).
      reduction: as for :func:`simigrad_jax.transform`; a leaf in blocks
        needs ``"hierarchical"``.
      zero_nonfinite: return a zero mean when the statistics are not finite.
      mesh: the mesh, or None for the one set with ``jax.set_mesh``.
      explicit_axes: the mesh's ``Explicit`` axes other than the data axis
        (run here as ``Auto``; the mean comes back laid out as the parameters).

    Returns:
      ``(mean, stats)``: the mean laid out as the parameters are (a leaf in
      blocks, in its blocks) and the :class:`HalfStatistics`.
    """

    def reduce_local(local: Any) -> tuple[Any, HalfStatistics]:
      grads = jax.tree.map(lambda g: g[0], local)
      return halves_reduction.reduce_device_halves(
        grads,
        self.axis_name,
        reduction,
        zero_nonfinite=zero_nonfinite,
        scatter_dims=self.dims,
        specs=self.model_specs,
      )

    over_data = jax.shard_map(
      reduce_local,
      mesh=mesh,
      in_specs=(P(self.axis_name),),
      out_specs=(self.entry, P()),
      axis_names={self.axis_name},
      check_vma=False,
    )
    if not explicit_axes:
      return over_data(stacked)
    mean, stats = jax.sharding.auto_axes(
      over_data, axes=explicit_axes, out_sharding=(self.mean, P())
    )(stacked)
    # A leaf sharded over the data axis together with another axis: its part of the mean.
    return jax.tree.map(jax.sharding.reshard, mean, self.specs), stats


def check_reduced(updates: Any, params: Any, axis_name: str, who: str) -> None:
  """Raises unless every update has its parameter's shape, after an update on stacked gradients.

  A step that hands the optimizer the devices' gradients stacked along a
  leading ``axis_name`` dimension relies on :func:`simigrad_jax.transform`
  to reduce them; an optimizer that never reached it (none in the chain, or
  a wrapper that takes no extra arguments) returns updates with that
  leading dimension, which ``optax.apply_updates`` would broadcast.

  Args:
    updates: the optimizer's updates.
    params: the parameters.
    axis_name: the data axis, for the error.
    who: the step, for the error (``"device_halves_step"``).
  """
  for (path, update), param in zip(
    jax.tree_util.tree_flatten_with_path(updates)[0], jax.tree.leaves(params), strict=True
  ):
    if jnp.shape(update) != jnp.shape(param):
      raise ValueError(
        f"{who}'s optimizer never reached simigrad_jax.transform({axis_name!r}): the update "
        f"{jax.tree_util.keystr(path)} has shape {jnp.shape(update)}, its parameter "
        f"{jnp.shape(param)} (one gradient per device, stacked). Chain it first, "
        f"optax.chain(simigrad_jax.transform({axis_name!r}), ...); a wrapper around the "
        "optimizer must pass the extra keyword arguments of its update on (optax.chain does)"
      )
