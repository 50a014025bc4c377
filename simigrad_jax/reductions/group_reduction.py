"""In-graph: the device split's reduction on each device's own shards, model axes left to XLA.

A ``jax.shard_map`` that is manual over the data axis only (``axis_names=
{"data"}``) leaves the mesh's other axes (tensor-parallel ``model`` axes) to
XLA's partitioner: inside it, a gradient leaf is still a global array over
those axes. XLA partitions an all-reduce over the data axis on each shard, but
it gathers a leaf whole across the other axes before a reduce-scatter, an
all-to-all or an all-gather over the data axis, the collectives of the
hierarchical reduction (:mod:`simigrad_jax.reductions.halves_reduction`).

:func:`on_local_shards` therefore runs the reduction in a nested
``jax.shard_map`` over the other axes, with each leaf's own partition spec:
every device reduces the shard it holds, so nothing is gathered and the mean
keeps each leaf's sharding. A leaf's spec is read from its type, which
carries it under ``Explicit`` mesh axes; under ``Auto`` axes only XLA knows
it, so a caller that knows the layout passes it (``specs``: the parameters'
``PartitionSpec``s, entries of the manual axis ignored), and without it the
leaf is taken whole (gathered over the other axes), which costs memory and
bytes over those axes (``docs/design.md``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

# reduce(local_grads, weights, other_axes) -> (mean, stats): the reduction run on local shards.
LocalReduction = Callable[[Any, "list[float] | None", tuple[str, ...]], tuple[Any, Any]]


def is_spec(x: Any) -> bool:
  """Whether ``x`` is a ``PartitionSpec`` (a leaf of a tree of specs)."""
  return isinstance(x, P)


def given_specs(tree: Any, specs: Any, what: str = "specs") -> list[P] | None:
  """``specs``' leaves, one ``PartitionSpec`` per leaf of ``tree``; None for None.

  Raises ``ValueError``, naming ``what``, when ``specs`` does not have ``tree``'s
  structure (a spec for each leaf).
  """
  if specs is None:
    return None
  leaves, given = jax.tree.flatten(specs, is_leaf=is_spec)
  expected = jax.tree.structure(tree)
  # PyTreeDef: no stub for its comparison.
  if given != expected or not all(is_spec(leaf) for leaf in leaves):  # type: ignore[operator]
    raise ValueError(
      f"{what} must be a PartitionSpec for each leaf of the gradient, with its tree structure "
      f"{expected}; got {given}"
    )
  return leaves


def axes_left_to_partitioner() -> tuple[str, ...]:
  """The axes of the current mesh, of more than one device, that are not manual here."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  return tuple(
    name
    for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
    if kind != AxisType.Manual and mesh.shape[name] > 1
  )


def _spec_over(leaf: jax.Array, axes: tuple[str, ...], given: P | None = None) -> P:
  """``leaf``'s partition spec restricted to ``axes``: ``given``, else its type's (or P())."""
  sharding = getattr(jax.typeof(leaf), "sharding", None)
  entries = tuple(given if given is not None else getattr(sharding, "spec", ()))

  def kept(entry: Any) -> Any:
    names = (entry,) if isinstance(entry, str) else tuple(entry or ())
    inside = tuple(name for name in names if name in axes)
    return inside[0] if len(inside) == 1 else (inside or None)

  return P(*(kept(entry) for entry in entries))


def _named_axes(spec: P) -> set[str]:
  names: set[str] = set()
  for entry in spec:
    names.update((entry,) if isinstance(entry, str) else tuple(entry or ()))
  return names


def _local_specs(tree: Any, axis_name: str, specs: Any) -> tuple[tuple[str, ...], Any]:
  """The axes left to the partitioner but ``axis_name``, and ``tree``'s leaves' specs over them.

  A leaf's spec is its entry in ``specs`` (a tree like ``tree``), else its type's.
  """
  other_axes = tuple(name for name in axes_left_to_partitioner() if name != axis_name)
  leaves, treedef = jax.tree.flatten(tree)
  given = given_specs(tree, specs)
  specs = [
    _spec_over(leaf, other_axes, given[index] if given else None)
    for index, leaf in enumerate(leaves)
  ]
  return other_axes, jax.tree.unflatten(treedef, specs)


def each_local_shard(fn: Callable[[Any], Any], tree: Any, axis_name: str, specs: Any = None) -> Any:
  """Runs ``fn`` on each device's own shard of every leaf of ``tree``; its output laid out alike.

  For a collective over the manual ``axis_name`` on leaves that the other
  axes shard (an all-gather of FSDP blocks of a tensor-parallel kernel):
  XLA would gather them whole over those axes first. ``fn`` may change a
  leaf's size along a dimension that the other axes do not shard. ``specs``:
  as for :func:`on_local_shards`.
  """
  other_axes, spec_tree = _local_specs(tree, axis_name, specs)
  if not other_axes:
    return fn(tree)
  return jax.shard_map(
    fn, in_specs=(spec_tree,), out_specs=spec_tree, axis_names=set(other_axes), check_vma=False
  )(tree)


def on_local_shards(
  reduce: LocalReduction, grads: Any, axis_name: str, specs: Any = None
) -> tuple[Any, Any]:
  """Runs ``reduce`` on each device's own shard of every leaf of ``grads``.

  Args:
    reduce: ``reduce(local_grads, weights, other_axes) -> (mean, stats)``: the
      reduction over ``axis_name`` of plain per-device arrays. ``weights``
      (one per leaf, or None) is the share of a leaf's statistics that each
      device adds: ``1 / k`` for a leaf whose shard repeats on ``k`` devices
      of ``other_axes``; the statistics' partial sums are to be added over
      ``axis_name`` and ``other_axes``.
    grads: this data position's gradient (a pytree), global over the axes
      left to the partitioner.
    axis_name: the manual data axis.
    specs: None, or a ``PartitionSpec`` per leaf of ``grads`` (a tree like
      it; the parameters' specs will do, ``axis_name`` is ignored in them):
      each leaf's layout over the other axes, where its type does not carry
      it (``Auto`` mesh axes). None: each leaf's type says (``P()`` when it
      does not: the leaf is taken whole).

  Returns:
    ``reduce``'s ``(mean, stats)``, the mean laid out as ``grads`` is.
  """
  other_axes, spec_tree = _local_specs(grads, axis_name, specs)
  if not other_axes:
    return reduce(grads, None, ())
  mesh = jax.sharding.get_abstract_mesh()
  weights = [
    1.0 / math.prod(mesh.shape[name] for name in other_axes if name not in _named_axes(spec))
    for spec in jax.tree.leaves(spec_tree, is_leaf=is_spec)
  ]
  return jax.shard_map(
    lambda local: reduce(local, weights, other_axes),
    in_specs=(spec_tree,),
    out_specs=(spec_tree, P()),
    axis_names=set(other_axes),
    check_vma=False,
  )(grads)
