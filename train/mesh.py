"""Host: the training mesh and the parameters' shardings of a config (``mesh_shape``, ``param_sharding``).

``mesh_shape="4x2"`` lays the devices out as a mesh of 4 positions on the
data axis (``"batch"``, which the batch is sharded over) by 2 on the model
axis (``"model"``, which parameters may be sharded over); ``""`` trains
data-parallel on every device. ``param_sharding`` says which parameters
shard over the model axis:

* ``""``: none (replicated);
* ``"megatron"``: the 2-D ``kernel`` leaves, in their order in the tree,
  alternately column-parallel (``P(None, "model")``, with the bias
  ``P("model")``) and row-parallel (``P("model", None)``), as Megatron-LM
  pairs an MLP's two layers (a kernel whose dimension to shard the model
  axis does not divide, such as a head over 65 characters, replicated);
  other leaves replicated;
* ``"fsdp"``: every leaf of two or more dimensions in blocks over the data
  axis (``"batch"``) on its first dimension that the data axis divides
  (kept in blocks through the step: FSDP); the others replicated;
* ``"megatron+fsdp"``: ``"megatron"``, each kernel's other dimension in
  blocks over the data axis where it divides;
* rules ``"REGEX=SPEC;REGEX=SPEC"``: a leaf whose path (``Dense_0/kernel``)
  the first regex matches (``re.search``) takes its spec, a comma-separated
  list of axis names or ``None`` per dimension (``"kernel$=None,model"``);
  a leaf no rule matches is replicated.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

DATA_AXIS = "batch"  # the Trainer's axis_name, which the optimizer's transform names
PRESETS = ("megatron", "fsdp", "megatron+fsdp")
MODEL_AXIS = "model"


def training_mesh(config: ml_collections.ConfigDict, devices: list[jax.Device]) -> Mesh:
  """The mesh ``config.mesh_shape`` lays ``devices`` out on (``""``: a data axis over all of them).

  Args:
    config: the experiment config.
    devices: the training devices, in process order.

  Returns:
    A ``Mesh`` of axes ``("batch", "model")``, or of ``("batch",)`` alone
    when ``mesh_shape`` is ``""``.

  Raises:
    ValueError: a shape that is not ``DATAxMODEL`` or does not hold exactly
      the devices.

  Example:
    >>> config = ml_collections.ConfigDict({"mesh_shape": "4x2"})
    >>> dict(training_mesh(config, jax.devices()[:8]).shape)
    {'batch': 4, 'model': 2}
  """
  shape = config.mesh_shape
  if not shape:
    return Mesh(np.array(devices), (DATA_AXIS,))
  data, model = _mesh_dims(shape)
  if data * model != len(devices):
    raise ValueError(
      f"config.mesh_shape={shape!r} holds {data * model} devices, but there are "
      f"{len(devices)}; give two numbers whose product is {len(devices)}"
    )
  return Mesh(np.array(devices).reshape(data, model), (DATA_AXIS, MODEL_AXIS))


def param_sharding(config: ml_collections.ConfigDict, params: Any) -> Any:
  """The parameters' ``PartitionSpec`` tree that ``config.param_sharding`` asks for (None: replicated).

  Args:
    config: the experiment config (``param_sharding``, ``mesh_shape``).
    params: the model's parameters.

  Returns:
    A pytree like ``params`` of ``PartitionSpec``, or None.

  Raises:
    ValueError: a rule that cannot be read, or sharding without a mesh.

  Example:
    >>> config = ml_collections.ConfigDict({"param_sharding": "megatron", "mesh_shape": "4x2"})
    >>> params = {"Dense_0": {"kernel": np.zeros((4, 8)), "bias": np.zeros(8)},
    ...           "Dense_1": {"kernel": np.zeros((8, 3)), "bias": np.zeros(3)}}
    >>> param_sharding(config, params)["Dense_1"]
    {'bias': P(), 'kernel': P('model', None)}
  """
  rule = config.param_sharding
  if not rule:
    return None
  if not config.mesh_shape:
    raise ValueError(
      f"config.param_sharding={rule!r} shards parameters over the model axis of a mesh; "
      "set config.mesh_shape too (e.g. '4x2')"
    )
  if rule in PRESETS:
    data_size, model_size = _mesh_dims(config.mesh_shape)
    specs = _megatron(params, model_size) if rule.startswith("megatron") else None
    return _in_blocks(params, specs, data_size) if "fsdp" in rule else specs
  rules = [_parse_rule(part) for part in rule.split(";") if part.strip()]

  def spec_of(path: Any, leaf: Any) -> P:
    name = _path_name(path)
    return next((spec for regex, spec in rules if regex.search(name)), P())

  return jax.tree_util.tree_map_with_path(spec_of, params)


def _mesh_dims(shape: str) -> tuple[int, int]:
  """``(data, model)`` of a ``DATAxMODEL`` mesh shape."""
  match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", shape)
  if match is None or min(int(match[1]), int(match[2])) < 1:
    raise ValueError(
      f"config.mesh_shape={shape!r} is not valid; give DATAxMODEL, e.g. '4x2' (4 data "
      "positions by 2 model shards), or '' (data-parallel on every device)"
    )
  return int(match[1]), int(match[2])


def _in_blocks(params: Any, specs: Any, data_size: int) -> Any:
  """``specs`` (None: replicated) with each leaf of 2+ dimensions in blocks over the data axis
  on its first free dimension that ``data_size`` divides."""
  if specs is None:
    specs = jax.tree.map(lambda leaf: P(), params)

  def blocked(leaf: Any, spec: P) -> P:
    entries = list(spec) + [None] * (np.ndim(leaf) - len(spec))
    if np.ndim(leaf) < 2:
      return spec
    for dim, size in enumerate(np.shape(leaf)):
      if entries[dim] is None and size % data_size == 0:
        entries[dim] = DATA_AXIS
        return P(*entries)
    return spec

  return jax.tree.map(blocked, params, specs)


def _path_name(path: Any) -> str:
  """``Dense_0/kernel`` for the path of ``params["Dense_0"]["kernel"]``."""
  return "/".join(str(getattr(key, "key", getattr(key, "idx", key))) for key in path)


def _parse_rule(part: str) -> tuple[re.Pattern, P]:
  """``(regex, spec)`` of one ``REGEX=SPEC`` rule."""
  regex, sep, spec = part.rpartition("=")
  try:
    if not sep or not regex.strip():
      raise ValueError("no REGEX=SPEC")
    entries = [entry.strip() for entry in spec.split(",")]
    return re.compile(regex.strip()), P(*(None if e in ("None", "") else e for e in entries))
  except (ValueError, re.error) as error:
    raise ValueError(
      f"config.param_sharding rule {part!r} is not valid ({error}); give one of {PRESETS}, or "
      "rules REGEX=SPEC separated by ';', e.g. 'Dense_0/kernel=None,model;Dense_1/kernel=model,None'"
    ) from error


def _megatron(params: Any, model_size: int) -> Any:
  """Column- then row-parallel, alternately, over the 2-D kernels in their natural order (a
  kernel whose dimension to shard ``model_size`` does not divide stays replicated)."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  natural = lambda name: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
  kernels = sorted(
    (
      _path_name(path)
      for path, leaf in leaves
      if _path_name(path).endswith("kernel") and np.ndim(leaf) == 2
    ),
    key=natural,
  )
  specs = {}
  shapes = {_path_name(path): np.shape(leaf) for path, leaf in leaves}
  for i, kernel in enumerate(kernels):
    layer = kernel[: -len("kernel")]
    column = i % 2 == 0
    if shapes[kernel][1 if column else 0] % model_size:
      continue  # a dimension the model axis does not divide (a vocabulary of 65): replicated
    specs[kernel] = P(None, MODEL_AXIS) if column else P(MODEL_AXIS, None)
    specs[layer + "bias"] = P(MODEL_AXIS) if column else P()
  return jax.tree_util.tree_map_with_path(lambda path, _: specs.get(_path_name(path), P()), params)
