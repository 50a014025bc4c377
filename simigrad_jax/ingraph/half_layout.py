"""In-graph: where a plain ``jax.jit`` step lays out its two half gradients on a data-parallel mesh.

Left to XLA's partitioner, each half's gradient of a batch sharded over a
mesh's data axis is all-reduced whole and every device then holds both
halves, reads both for the statistics and averages both: twice the plain
step's collective bytes and gradient memory, and (with simulated devices on
one host) every device repeats the same work. Asked to keep each half's
gradient in blocks over the data axis instead, the partitioner reduces a
block per device (or gathers the small batch's activations and computes its
own block), the statistics are sums over blocks with a scalar all-reduce,
and only the mean is gathered, once, where the parameters need it.

What decides the layout, read at trace time (never changes a value, only
where it lies):

* ``Auto`` mesh axes on a mesh of one axis (set with ``jax.set_mesh``): that
  axis is the data axis; each half's gradient goes into blocks over it on
  its first dimension that the axis's size divides (vectors and matrices
  only: a convolution's kernel in blocks over its channels would shard the
  activations' channels), and the mean is left to the partitioner, which
  lays it out as the update needs: replicated for replicated parameters, in
  the same blocks for parameters sharded over the data axis (FSDP), where a
  replicated mean would be gathered only to be cut into blocks again.
* ``Explicit`` mesh axes whose only axes are the data axis (the axis the
  batch's leaves are sharded over on their leading dimension): JAX reduces
  a replicated parameter's gradient whole, inside the backward pass, before
  any layout applies, so the two passes run with the data axis ``Auto``
  (:func:`jax.sharding.auto_axes`), their gradients laid out as above, and
  come back typed: each half in blocks over the data axis where a dimension
  fits (a leaf already sharded over the data axis, FSDP, as its parameter
  is), the mean as its parameter is, the values replicated.
* ``Explicit`` mesh axes with other axes too (tensor parallelism): each
  parameter's type gives its layout; each half's gradient goes into blocks
  over the data axis on the first dimension that no other axis shards (none
  for a leaf already sharded over the data axis), and the mean back into
  the parameter's layout.
* Otherwise (no mesh, one device, ``Auto`` axes on a mesh of several axes,
  a batch not sharded on its leading dimension): nothing is asked, and the
  partitioner lays the gradients out as it would.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from simigrad_jax.reductions import group_reduction


class DataLayout(NamedTuple):
  """The data axis of a plain ``jax.jit`` step's mesh, and how the mesh's axes are typed."""

  axis: str | tuple[str, ...]  # the mesh axis (or axes) the batch's leading dimension lies on.
  size: int  # the number of devices along it.
  explicit: bool  # Explicit axes (reshard by type) or Auto ones (sharding constraints).
  whole_mesh: bool  # the data axis is every axis of the mesh (data parallelism alone).


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
    names = _names(axis)
    size = math.prod(mesh.shape[name] for name in names)
    whole = set(names) == set(mesh.axis_names)
    return DataLayout(axis, size, True, whole) if size > 1 else None
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or len(mesh.axis_names) != 1 or AxisType.Auto not in mesh.axis_types:
    return None
  (axis,) = mesh.axis_names
  size = mesh.shape[axis]
  return DataLayout(axis, size, False, True) if size > 1 else None


def _param_spec(param: Any, layout: DataLayout, given: P | None = None) -> tuple[Any, ...]:
  """The parameter's spec as a tuple of one entry per dimension.

  Under Explicit axes its type's; under Auto ones ``given`` (the caller's
  ``param_specs``), or replicated when none is given.
  """
  ndim = getattr(param, "ndim", 0)
  if layout.explicit:
    spec = tuple(jax.typeof(param).sharding.spec)
  else:
    spec = tuple(given) if given is not None else ()
  return spec + (None,) * (ndim - len(spec))


def _names(entry: Any) -> tuple[str, ...]:
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _block_spec(grad: Any, spec: tuple[Any, ...], layout: DataLayout) -> P | None:
  """The spec that keeps ``grad`` in blocks over the data axis, or None where none fits."""
  if grad.ndim > 2:
    # A convolution's kernel in blocks over its channels makes the partitioner shard the
    # activations' channels too, resharding the batch: such leaves are reduced as they are.
    return None
  data_names = set(_names(layout.axis))
  if any(data_names & set(_names(entry)) for entry in spec):
    return None  # already in blocks over the data axis (FSDP): the partitioner keeps them.
  for dim, (entry, size) in enumerate(zip(spec, grad.shape, strict=True)):
    if entry is None and size % layout.size == 0:
      return P(*spec[:dim], layout.axis, *spec[dim + 1 :])
  return None


def _place(x: Any, spec: P | None, explicit: bool) -> Any:
  if spec is None:
    return x
  if explicit:
    return jax.sharding.reshard(x, spec)
  return jax.lax.with_sharding_constraint(x, spec)


def _same_structure(tree: Any, treedef: Any, what: str) -> list[Any]:
  leaves, structure = jax.tree.flatten(tree)
  if structure != treedef:
    raise ValueError(f"{what} has the structure {structure}, expected the parameters' {treedef}")
  return leaves


class HalvesLayout:
  """Where one step's two half gradients and their mean lie, read from its batch and parameters.

  Built at trace time from the step's :class:`DataLayout` and its
  parameters (see the module docstring); it then places each half's
  gradient as soon as its pass returns it (:meth:`halves`), the mean
  (:meth:`mean`), and runs the passes themselves (:meth:`run`), under
  ``Auto`` axes where the mesh's ``Explicit`` axes are the data axis alone.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> layout = HalvesLayout(None, {"w": jnp.zeros((4, 2))})  # no mesh: nothing is asked
    >>> layout.run(lambda p: p["w"].sum(), {"w": jnp.ones((4, 2))}).item()
    8.0
  """

  def __init__(
    self, layout: DataLayout | None, params: Any, *, blocks: bool = True, param_specs: Any = None
  ) -> None:
    """Reads where the gradients go.

    Args:
      layout: the step's :class:`DataLayout` (:func:`data_layout`), or None:
        the gradients then lie where XLA puts them.
      params: the parameters (their types give their layout under
        ``Explicit`` axes).
      blocks: whether each half's gradient may go into blocks over the data
        axis (False: a convolutional model, whose dense kernel in blocks
        would shard the pooled activations' channels and reshard the batch).
      param_specs: under ``Auto`` axes, the parameters' ``PartitionSpec``s (a
        pytree like ``params``), or None for replicated parameters; ignored
        under ``Explicit`` axes, whose types say it.

    Raises:
      ValueError: when ``param_specs`` does not have a spec for each parameter.
    """
    leaves, self._treedef = jax.tree.flatten(params)
    self._layout = layout
    self._auto_inside = layout is not None and layout.explicit and layout.whole_mesh
    checked = group_reduction.given_specs(params, param_specs, "param_specs")
    self._half: list[P | None] = [None] * len(leaves)
    self._mean: list[P | None] = [None] * len(leaves)
    if layout is None:
      return
    given: list[P | None] = list(checked) if checked is not None else [None] * len(leaves)
    specs = [_param_spec(leaf, layout, spec) for leaf, spec in zip(leaves, given, strict=True)]
    self._half = [
      _block_spec(leaf, spec, layout) if blocks else None
      for leaf, spec in zip(leaves, specs, strict=True)
    ]
    self._mean = [P(*spec) for spec in specs]

  @property
  def explicit_inside(self) -> bool:
    """Whether the passes see ``Explicit`` data axes (reshard) rather than ``Auto`` ones."""
    return self._layout is not None and self._layout.explicit and not self._auto_inside

  def halves(self, grads: Any) -> Any:
    """One half's gradient, each leaf asked to lie in blocks over the data axis where one fits.

    Args:
      grads: one half's gradient (a pytree like the parameters).

    Returns:
      The same values; a leaf without a dimension that the data axis's size
      divides (and that no other axis shards), or already in blocks over the
      data axis, as it was.
    """
    leaves = _same_structure(grads, self._treedef, "the gradient")
    placed = [_place(g, s, self.explicit_inside) for g, s in zip(leaves, self._half, strict=True)]
    return jax.tree.unflatten(self._treedef, placed)

  def mean(self, mean: Any) -> Any:
    """The mean gradient in the parameters' layout (under ``Auto`` axes, where XLA puts it).

    Args:
      mean: the mean gradient, computed from the halves' blocks.

    Returns:
      The same values.
    """
    leaves = _same_structure(mean, self._treedef, "the mean gradient")
    placed = [_place(m, s, self.explicit_inside) for m, s in zip(leaves, self._mean, strict=True)]
    return jax.tree.unflatten(self._treedef, placed)

  def run(self, passes: Callable[..., Any], params: Any, *args: Any) -> Any:
    """``passes(params, *args)``, under ``Auto`` axes where the mesh's Explicit axes are the data axis.

    Args:
      passes: ``passes(params, *args) -> ((value_a, grads_a), (value_b,
        grads_b), mean)``, placing its gradients with :meth:`halves` and
        :meth:`mean`.
      params: the parameters.
      *args: the passes' other arguments (pytrees of arrays).

    Returns:
      What ``passes`` returns. Where it ran under ``Auto`` axes, typed again
      for the ``Explicit`` mesh: each half in blocks over the data axis where
      a dimension fits (else as its parameter lies), the mean as its
      parameter lies, every leaf of the values replicated.
    """
    if not self._auto_inside:
      return passes(params, *args)
    assert self._layout is not None
    halves = [h if h is not None else m for h, m in zip(self._half, self._mean, strict=True)]
    half_specs = jax.tree.unflatten(self._treedef, halves)
    mean_specs = jax.tree.unflatten(self._treedef, self._mean)
    # A spec is a prefix of the tree it lays out: P() for every leaf of a half's values.
    out_sharding = ((P(), half_specs), (P(), half_specs), mean_specs)
    # Only arrays cross into Auto axes; any other leaf (a graph definition, a Python number)
    # is passed to the passes as it is.
    leaves, treedef = jax.tree.flatten((params, args))
    crossing = [isinstance(leaf, jax.Array) for leaf in leaves]

    def with_arrays(*arrays: Any) -> Any:
      given = iter(arrays)
      inputs = [next(given) if c else leaf for leaf, c in zip(leaves, crossing, strict=True)]
      params, args = jax.tree.unflatten(treedef, inputs)
      return passes(params, *args)

    arrays = [leaf for leaf, c in zip(leaves, crossing, strict=True) if c]
    axes = _names(self._layout.axis)
    auto = jax.sharding.auto_axes(with_arrays, axes=axes, out_sharding=out_sharding)
    try:
      return auto(*arrays)
    except Exception as error:  # pylint: disable=broad-exception-caught
      # A loss written for Explicit axes may name the data axis (out_sharding=P("data"),
      # reshard), which JAX refuses where it is Auto: trace it as written instead. An
      # error of the loss itself is raised again there.
      self._auto_inside = False
      result = passes(params, *args)
      warnings.warn(
        "simigrad_jax.value_and_half_grads: the loss does not trace with the data axis "
        f"{self._layout.axis!r} Auto ({type(error).__name__}: {str(error).splitlines()[0]}), "
        "so it runs on the Explicit axes as written, where JAX all-reduces each half's "
        "gradient of a replicated parameter whole (about twice the plain step's gradient "
        "memory). Leave out the loss's sharding annotations that name the data axis (on a "
        "mesh of the data axis alone JAX infers a product's output sharding from its "
        "operands), or take simigrad_jax.device_halves_step (docs/own_step.md)",
        stacklevel=2,
      )
      return result


def in_blocks(grads: Any, params: Any, layout: DataLayout) -> Any:
  """``grads`` with each leaf asked to lie in blocks over the data axis, where one fits (see
  :meth:`HalvesLayout.halves`)."""
  return HalvesLayout(layout, params).halves(grads)


def like_params(mean: Any, params: Any, layout: DataLayout) -> Any:
  """The mean gradient laid out as the parameters are (see :meth:`HalvesLayout.mean`)."""
  return HalvesLayout(layout, params).mean(mean)
