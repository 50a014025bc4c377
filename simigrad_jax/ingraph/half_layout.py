"""In-graph: where a plain ``jax.jit`` step lays out its two half gradients on a data-parallel mesh.

Left to XLA's partitioner, each half's gradient of a batch sharded over a
mesh's data axis is all-reduced whole and every device then holds both
halves, reads both for the statistics and averages both: twice the plain
step's collective bytes and gradient memory, and (with simulated devices on
one host) every device repeats the same work. Asked to keep each half's
gradient in blocks over the data axis instead, the partitioner reduces a
block per device (or gathers the small batch's activations and computes its
own block), the statistics are sums over blocks with a scalar all-reduce,
and only the mean is gathered, once, into the parameters' layout.

What decides the layout, read at trace time (never changes a value, only
where it lies):

* ``Explicit`` mesh axes: the batch's type names its data axis (the axis its
  leaves are sharded over on their leading dimension) and each parameter's
  type its layout; each half's gradient goes into blocks over the data axis
  on the first dimension that no other axis shards and the data axis's size
  divides (vectors and matrices only: a convolution's kernel in blocks over
  its channels would shard the activations' channels), and the mean back
  into the parameter's layout.
* ``Auto`` mesh axes on a mesh of one axis (set with ``jax.set_mesh``): the
  same, with that axis as the data axis, and the mean replicated (the
  parameters are taken to be replicated, as in data parallelism).
* Otherwise (no mesh, one device, ``Auto`` axes on a mesh of several axes,
  a batch not sharded on its leading dimension): nothing is asked, and the
  partitioner lays the gradients out as it would.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P


class DataLayout(NamedTuple):
  """The data axis of a plain ``jax.jit`` step's mesh, and how the mesh's axes are typed."""

  axis: str | tuple[str, ...]  # the mesh axis (or axes) the batch's leading dimension lies on.
  size: int  # the number of devices along it.
  explicit: bool  # Explicit axes (reshard by type) or Auto ones (sharding constraints).


def _leading_axis(leaf: Any) -> Any:
  spec = jax.typeof(leaf).sharding.spec
  return spec[0] if len(spec) else None


def data_layout(batch: Any) -> DataLayout | None:
  """The data axis a batch is sharded over in a plain ``jax.jit`` step, or None.

  Args:
    batch: the step's batch, a pytree of arrays (tracers inside ``jit``).

  Returns:
    A :class:`DataLayout` when the halves' gradients can be kept in blocks
    over a data axis of more than one device (see the module docstring),
    else None.
  """
  leaves = [leaf for leaf in jax.tree.leaves(batch) if hasattr(leaf, "shape") and leaf.ndim]
  if not leaves:
    return None
  mesh = jax.typeof(leaves[0]).sharding.mesh
  if not mesh.empty and AxisType.Explicit in mesh.axis_types:
    axes = {_leading_axis(leaf) for leaf in leaves}
    if len(axes) != 1:
      return None
    axis = next(iter(axes))
    if axis is None:
      return None
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    size = math.prod(mesh.shape[name] for name in names)
    return DataLayout(axis, size, True) if size > 1 else None
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or len(mesh.axis_names) != 1 or AxisType.Auto not in mesh.axis_types:
    return None
  (axis,) = mesh.axis_names
  size = mesh.shape[axis]
  return DataLayout(axis, size, False) if size > 1 else None


def _param_spec(param: Any, layout: DataLayout) -> tuple[Any, ...]:
  """The parameter's spec as a tuple of one entry per dimension (Auto: replicated)."""
  ndim = getattr(param, "ndim", 0)
  if not layout.explicit:
    return (None,) * ndim
  spec = tuple(jax.typeof(param).sharding.spec)
  return spec + (None,) * (ndim - len(spec))


def _names(entry: Any) -> tuple[str, ...]:
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _block_spec(grad: Any, param: Any, layout: DataLayout) -> P | None:
  """The spec that keeps ``grad`` in blocks over the data axis, or None where none fits."""
  if grad.ndim > 2:
    # A convolution's kernel in blocks over its channels makes the partitioner shard the
    # activations' channels too, resharding the batch: such leaves are reduced as they are.
    return None
  spec = _param_spec(param, layout)
  data_names = set(_names(layout.axis))
  if any(data_names & set(_names(entry)) for entry in spec):
    return None  # already in blocks over the data axis (FSDP): the partitioner keeps them.
  for dim, (entry, size) in enumerate(zip(spec, grad.shape, strict=True)):
    if entry is None and size % layout.size == 0:
      return P(*spec[:dim], layout.axis, *spec[dim + 1 :])
  return None


def _place(x: Any, spec: P, layout: DataLayout) -> Any:
  if layout.explicit:
    return jax.sharding.reshard(x, spec)
  return jax.lax.with_sharding_constraint(x, spec)


def in_blocks(grads: Any, params: Any, layout: DataLayout) -> Any:
  """``grads`` with each leaf asked to lie in blocks over the data axis, where one fits.

  Args:
    grads: one half's gradient (a pytree like ``params``).
    params: the parameters (their types give their layout under Explicit axes).
    layout: the step's :class:`DataLayout`.

  Returns:
    The same values; a leaf without a dimension that the data axis's size
    divides (and that no other axis shards), or already in blocks over the
    data axis, as it was.
  """

  def place(grad: Any, param: Any) -> Any:
    spec = _block_spec(grad, param, layout)
    return grad if spec is None else _place(grad, spec, layout)

  return jax.tree.map(place, grads, params)


def like_params(mean: Any, params: Any, layout: DataLayout) -> Any:
  """The mean gradient laid out as the parameters are (Auto axes: replicated).

  Args:
    mean: the mean gradient, computed from the halves' blocks.
    params: the parameters.
    layout: the step's :class:`DataLayout`.

  Returns:
    The same values, in each parameter's layout.
  """
  return jax.tree.map(lambda m, p: _place(m, P(*_param_spec(p, layout)), layout), mean, params)
