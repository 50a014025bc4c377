"""Host: the Trainer on a mesh: the mesh checked, the parameters' specs, the state's shardings.

A Trainer given a ``jax.sharding.Mesh`` runs its steps data-parallel over
the mesh's data axis (``TrainerConfig.axis_name``) and leaves every other
axis (the model axes) to XLA's partitioner: the step is a ``jax.shard_map``
that is manual over the data axis only. A parameter is placed with its
``PartitionSpec`` (for example ``P(None, "model")``, a column-parallel
kernel); the optimizer state's leaves shaped like the parameters get the
parameters' specs, its other leaves and the model state are replicated.
The examples are sharded over the data axis, as on a one-axis mesh: a slot
is a position on the data axis, and the devices of one position (its model
axes) see the same rows.

A spec that names the data axis (FSDP: ``P("data", None)``) stores the
leaf sharded over the data axis between steps (parameters and the optimizer
state's copies of them); the step gathers it over the data axis, so the
step's memory is that of the leaf replicated over the data axis; the saving
is at rest, between steps and in checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# param_sharding: None (replicated), one PartitionSpec for every leaf, a pytree of them that
# matches params (or a prefix of it), or a callable (path, leaf) -> PartitionSpec or None.
ParamSharding = Any


def check_mesh(mesh: Any, axis_name: str, devices: Any) -> Mesh:
  """Checks a mesh given to the Trainer: a ``Mesh`` with the data axis, and no ``devices`` beside it.

  Args:
    mesh: the mesh to train on.
    axis_name: the data axis (``TrainerConfig.axis_name``).
    devices: the Trainer's ``devices`` argument (must be None with a mesh).

  Returns:
    ``mesh``.

  Raises:
    ValueError: naming the value and what is valid.

  Example:
    >>> mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("batch", "model"))
    >>> check_mesh(mesh, "batch", None).shape["model"]
    2
  """
  if not isinstance(mesh, Mesh):
    raise ValueError(
      f"mesh must be a jax.sharding.Mesh (e.g. Mesh(devices.reshape(4, 2), "
      f"({axis_name!r}, 'model'))), got {mesh!r:.200} ({type(mesh).__name__})"
    )
  if devices is not None:
    raise ValueError(
      "give either mesh or devices, not both: with a mesh the Trainer trains on the "
      f"mesh's devices ({mesh.devices.size})"
    )
  if axis_name not in mesh.axis_names:
    raise ValueError(
      f"the mesh's axes {tuple(mesh.axis_names)} lack the data axis {axis_name!r} "
      "(TrainerConfig.axis_name, which the optimizer's simigrad_jax.transform names): "
      f"name one of the mesh's axes {axis_name!r}"
    )
  explicit = [
    name
    for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
    if kind != jax.sharding.AxisType.Auto
  ]
  if explicit:
    raise ValueError(
      f"the mesh's axes {explicit} are not Auto axes (jax.make_mesh makes Explicit ones); "
      "make the mesh with jax.sharding.Mesh(devices, names), or jax.make_mesh(..., "
      "axis_types=(jax.sharding.AxisType.Auto,) * len(names))"
    )
  return mesh


def param_specs(param_sharding: ParamSharding, params: Any, mesh: Mesh) -> Any:
  """The ``PartitionSpec`` of every parameter leaf, checked against the mesh and the leaf's shape.

  Args:
    param_sharding: None (every leaf replicated), one ``PartitionSpec`` for
      every leaf, a pytree of ``PartitionSpec`` (or None: replicated) that
      matches ``params`` or a prefix of it (``flax.linen.get_partition_spec``
      of ``nn.with_partitioning`` parameters is one), or a callable
      ``(path, leaf) -> PartitionSpec or None``.
    params: the parameters.
    mesh: the mesh the specs name axes of.

  Returns:
    A pytree like ``params`` of ``PartitionSpec``.

  Raises:
    ValueError: a tree that does not match ``params``, a spec that is not a
      ``PartitionSpec``, names an axis the mesh lacks, has more entries than
      its leaf has dimensions, or shards a dimension its axes do not divide.

  Example:
    >>> mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("batch", "model"))
    >>> params = {"kernel": np.zeros((3, 4)), "bias": np.zeros(4)}
    >>> param_specs({"kernel": P(None, "model"), "bias": None}, params, mesh)
    {'bias': P(), 'kernel': P(None, 'model')}
  """
  is_spec = lambda x: x is None or isinstance(x, P)
  if param_sharding is None or isinstance(param_sharding, P):
    specs = jax.tree.map(lambda _: param_sharding, params)
  elif callable(param_sharding):
    specs = jax.tree_util.tree_map_with_path(param_sharding, params)
  else:
    try:
      specs = jax.tree.broadcast(param_sharding, params, is_leaf=is_spec)
    except (ValueError, TypeError) as error:
      raise ValueError(
        "param_sharding does not match params: give a pytree of PartitionSpec with the "
        f"structure of params (or a prefix of it), one PartitionSpec, or a callable "
        f"(path, leaf) -> PartitionSpec: {error}"
      ) from error
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  spec_leaves = jax.tree.leaves(specs, is_leaf=is_spec)
  checked = [
    _check_spec(jax.tree_util.keystr(path), spec, np.shape(leaf), mesh)
    for (path, leaf), spec in zip(leaves, spec_leaves, strict=True)
  ]
  return jax.tree.unflatten(treedef, checked)


def _check_spec(where: str, spec: Any, shape: tuple[int, ...], mesh: Mesh) -> P:
  """``spec`` (None: replicated) checked for the leaf ``params{where}`` of ``shape``."""
  if spec is None:
    return P()
  if not isinstance(spec, P):
    raise ValueError(
      f"param_sharding gives params{where} {spec!r:.200} ({type(spec).__name__}); "
      "give a jax.sharding.PartitionSpec or None (replicated)"
    )
  if len(spec) > len(shape):
    raise ValueError(
      f"param_sharding gives params{where} of shape {shape} the spec {spec}, with "
      f"{len(spec)} entries: give at most {len(shape)} (one per dimension)"
    )
  for dim, entry in enumerate(spec):
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    for name in names:
      if name not in mesh.axis_names:
        raise ValueError(
          f"param_sharding gives params{where} the spec {spec}, whose axis {name!r} "
          f"is not one of the mesh's axes {tuple(mesh.axis_names)}"
        )
    size = math.prod(mesh.shape[name] for name in names)
    if shape[dim] % size:
      raise ValueError(
        f"param_sharding gives params{where} of shape {shape} the spec {spec}: its "
        f"dimension {dim} ({shape[dim]}) is not divisible by the {size} devices of "
        f"{names}; shard a dimension those axes divide, or replicate it (None)"
      )
  return spec


def state_shardings(
  optimizer: optax.GradientTransformation, state: Any, specs: Any, mesh: Mesh
) -> dict[str, Any]:
  """The ``NamedSharding`` of every leaf of the train state.

  The optimizer state's leaves that are copies of the parameters (momentum,
  Adam's moments: ``optax.tree_map_params`` finds them) get the parameters'
  specs; its other leaves and the model state are replicated.

  Args:
    optimizer: the optax optimizer whose ``init`` made ``state["opt_state"]``.
    state: ``{"params", "opt_state", "model_state"}``.
    specs: the parameters' specs (:func:`param_specs`).
    mesh: the mesh.

  Returns:
    A dict like ``state`` of ``NamedSharding``.
  """
  named = lambda spec: NamedSharding(mesh, spec)
  is_spec = lambda x: isinstance(x, P)
  replicated = lambda tree: jax.tree.map(lambda _: named(P()), tree)
  try:
    opt_specs = optax.tree_utils.tree_map_params(
      optimizer,
      lambda _, spec: spec,
      state["opt_state"],
      specs,
      transform_non_params=lambda _: P(),
      is_leaf=is_spec,
    )
  except (ValueError, TypeError):
    # An optimizer state optax cannot map: a leaf shaped like exactly one parameter takes its spec.
    opt_specs = jax.tree.map(_by_shape(state["params"], specs), state["opt_state"])
  return {
    "params": jax.tree.map(named, specs, is_leaf=is_spec),
    "opt_state": jax.tree.map(named, opt_specs, is_leaf=is_spec),
    "model_state": replicated(state["model_state"]),
  }


def _by_shape(params: Any, specs: Any) -> Callable[[Any], P]:
  """A leaf's spec from its shape: that of the parameters of that shape, if they agree."""
  by_shape: dict[tuple[int, ...], set[P]] = {}
  for leaf, spec in zip(
    jax.tree.leaves(params), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)), strict=True
  ):
    by_shape.setdefault(tuple(np.shape(leaf)), set()).add(spec)

  def spec_of(leaf: Any) -> P:
    found = by_shape.get(tuple(np.shape(leaf)), set())
    return next(iter(found)) if len(found) == 1 and np.ndim(leaf) else P()

  return spec_of


def data_positions(mesh: Mesh, axis_name: str) -> np.ndarray:
  """This process's positions on the data axis (its devices' rows), checked contiguous.

  Args:
    mesh: the training mesh.
    axis_name: its data axis.

  Returns:
    The sorted positions on ``axis_name`` of this process's devices.

  Raises:
    ValueError: none, or positions that are not contiguous.

  Example:
    >>> mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("batch", "model"))
    >>> data_positions(mesh, "batch").tolist()
    [0, 1, 2, 3]
  """
  axis = mesh.axis_names.index(axis_name)
  mine = np.vectorize(lambda d: d.process_index == jax.process_index())(mesh.devices)
  positions = np.flatnonzero(np.moveaxis(mine, axis, 0).reshape(mine.shape[axis], -1).any(1))
  if positions.size == 0:
    raise ValueError("none of the mesh's devices belongs to this process")
  if np.any(np.diff(positions) != 1):
    raise ValueError(
      f"this process's devices sit at positions {positions.tolist()} of the mesh's data axis "
      f"{axis_name!r}; they must be contiguous (order the mesh's devices by process)"
    )
  return positions
