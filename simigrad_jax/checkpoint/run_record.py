"""Host: what a run is, recorded in every checkpoint and compared when the run resumes.

Plain Python between steps; nothing here is traced. A run's record is JSON
data in parts. The parts that decide the run's trajectory are *checked*: a
resume whose record differs in one of them is refused unless the caller
allows it (:data:`CHECKED_PARTS`):

* ``optimizer``: the optimizer's hyperparameters, read from the optax
  transformation itself (the numbers, strings and function names its
  closures hold: ``optax.sgd(0.1)`` and ``optax.sgd(2.0)`` differ, although
  their states have the same structure) and the initial values of the
  hyperparameters ``optax.inject_hyperparams`` keeps in the state;
* ``settings``: what the caller says decides the run and the library cannot
  see (e.g. an experiment's config), as given;
* ``trainer``: the Trainer's settings that change the learning rate;
* ``controller``: the controller's settings;
* ``data``: the number of examples and the features (shape, dtype);
* ``model``: the parameters' and model state's paths, shapes and dtypes.

The other parts are *recorded*: a change is allowed (the run stays exact)
and written down (:data:`RECORDED_PARTS`): the devices, the layout of the
steps on them (split, shapes) and the versions of simigrad_jax, JAX, jaxlib,
optax and NumPy.

Example:
  >>> saved = {"optimizer": {"hyperparameters": {"step_size": -0.1}},
  ...          "devices": {"num_devices": 8}}
  >>> current = {"optimizer": {"hyperparameters": {"step_size": -2.0}},
  ...            "devices": {"num_devices": 4}}
  >>> changes = compare(saved, current)
  >>> changes.checked
  ['optimizer.hyperparameters.step_size: -0.1 there, -2.0 here']
  >>> changes.recorded
  ['devices.num_devices: 8 there, 4 here']
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import numbers
import sys
import types
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

RECORD_VERSION = 1
CHECKED_PARTS: tuple[str, ...] = ("optimizer", "settings", "trainer", "controller", "data", "model")
RECORDED_PARTS: tuple[str, ...] = ("devices", "layout", "versions")
# How deep the optimizer's closures are read, and how many values are kept at most.
_MAX_DEPTH = 16
_MAX_VALUES = 1000
# How many differences a message lists before it counts the rest.
_MAX_LISTED = 12


class RecordChanges(NamedTuple):
  """The differences between a saved record and the current one, one line each.

  Attributes:
    checked: differences in the parts that decide the trajectory (refused
      unless allowed).
    recorded: differences in the devices, layout and versions (allowed).
  """

  checked: list[str]
  recorded: list[str]


def make_record(
  *,
  optimizer: Any,
  state: Mapping[str, Any],
  num_examples: int,
  element_spec: Mapping[str, tuple[Any, Any]],
  controller: Mapping[str, Any],
  trainer: Mapping[str, Any],
  layout: Mapping[str, Any],
  devices: Mapping[str, Any],
  settings: Mapping[str, Any] | None,
) -> dict[str, Any]:
  """A run's record, as the JSON data a checkpoint holds.

  Args:
    optimizer: the optax transformation.
    state: the initial ``{"params", "opt_state", "model_state"}``.
    num_examples: the examples in the data.
    element_spec: ``{feature: (shape, dtype)}`` of one example.
    controller: the controller's settings (its ``config``).
    trainer: the Trainer's settings that decide the trajectory.
    layout: the settings that lay the steps out on the devices.
    devices: the device count, process count and platform.
    settings: the caller's own settings (JSON data), or None.

  Returns:
    The record (JSON data: a checkpoint's copy compares equal to it).

  Raises:
    ValueError: ``settings`` is neither None nor a mapping.

  Example:
    >>> import optax
    >>> record = make_record(
    ...     optimizer=optax.sgd(0.1), state={"params": {"w": np.zeros(3)}}, num_examples=10,
    ...     element_spec={"x": ((3,), "float32")}, controller={}, trainer={}, layout={},
    ...     devices={"num_devices": 1}, settings=None)
    >>> record["model"]["params"]
    {"['w']": 'float64[3]'}
    >>> record["optimizer"]["hyperparameters"]["update.update_fns[1].tx.update.step_size"]
    -0.1
  """
  if settings is not None and not isinstance(settings, Mapping):
    raise ValueError(
      f"run_settings must be None or a mapping of JSON data (e.g. a config's "
      f"dict), got {settings!r:.200} ({type(settings).__name__})"
    )
  record = {
    "version": RECORD_VERSION,
    "optimizer": {
      "hyperparameters": describe_optimizer(optimizer),
      "injected": injected_hyperparameters(state),
    },
    "settings": None if settings is None else dict(settings),
    "trainer": dict(trainer),
    "controller": dict(controller),
    "data": {
      "num_examples": int(num_examples),
      "element_spec": describe_element_spec(element_spec),
    },
    "model": {
      "params": describe_tree(state.get("params")),
      "model_state": describe_tree(state.get("model_state")),
    },
    "devices": dict(devices),
    "layout": dict(layout),
    "versions": versions(),
  }
  return json.loads(json.dumps(record, default=_json_value))  # as a checkpoint gives it back


def compare(saved: Mapping[str, Any], current: Mapping[str, Any]) -> RecordChanges:
  """The differences between a checkpoint's record and this run's, part by part.

  Args:
    saved: the record a checkpoint holds.
    current: this run's record.

  Returns:
    A :class:`RecordChanges`: lines such as ``"data.num_examples: 200 there,
    180 here"``.
  """
  checked: list[str] = []
  recorded: list[str] = []
  for part in dict.fromkeys([*saved, *current]):
    if part == "version":
      continue
    lines = _differences(part, saved.get(part), current.get(part))
    (recorded if part in RECORDED_PARTS else checked).extend(lines)
  return RecordChanges(checked, recorded)


def listed(lines: list[str]) -> str:
  """``lines`` as one indented list for a message (the first few, then a count of the rest)."""
  shown = [f"  - {line}" for line in lines[:_MAX_LISTED]]
  if len(lines) > _MAX_LISTED:
    shown.append(f"  - and {len(lines) - _MAX_LISTED} more")
  return "\n".join(shown)


def changed_injected(saved: Mapping[str, Any], current: Mapping[str, Any]) -> set[str]:
  """The paths of the ``inject_hyperparams`` values whose initial values differ in the records."""
  before = (saved.get("optimizer") or {}).get("injected") or {}
  now = (current.get("optimizer") or {}).get("injected") or {}
  return {path for path, value in now.items() if path in before and before[path] != value}


def describe_optimizer(optimizer: Any) -> dict[str, Any]:
  """The hyperparameters an optax transformation holds, by where they sit in its closures.

  The numbers, strings, booleans and None that the transformation's
  functions close over (through ``optax.chain``, ``inject_hyperparams``,
  schedules and ``functools.partial``), and the names of the functions that
  hold none. Arrays of more than one element are left out.

  Args:
    optimizer: an ``optax.GradientTransformation`` (or any function or tuple).

  Returns:
    ``{path: value}``, e.g. ``{"update.update_fns[1].tx.update.step_size": -0.1}``.

  Example:
    >>> import optax
    >>> describe_optimizer(optax.sgd(0.5))["update.update_fns[1].tx.update.step_size"]
    -0.5
  """
  found: dict[str, Any] = {}
  _walk(optimizer, "", found, set(), 0)
  return found


def injected_hyperparameters(state: Any) -> dict[str, Any]:
  """The values ``optax.inject_hyperparams`` keeps in a state, by their path in it.

  A checkpoint restores these with the rest of the state, so a changed
  initial value would otherwise be overwritten by the saved one.

  Example:
    >>> import optax
    >>> opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    >>> injected_hyperparameters({"opt_state": opt.init(np.zeros(2))})
    {"['opt_state'].hyperparams['learning_rate']": 0.1}
  """
  found = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    if any(getattr(key, "name", None) == "hyperparams" for key in path):
      found[jax.tree_util.keystr(path)] = _scalar(leaf)
  return found


def with_injected(restored: Any, fresh: Any, paths: set[str]) -> Any:
  """``restored`` with the leaves at ``paths`` (keystr paths) taken from ``fresh``."""
  return jax.tree_util.tree_map_with_path(
    lambda path, old, new: new if jax.tree_util.keystr(path) in paths else old, restored, fresh
  )


def describe_tree(tree: Any) -> dict[str, str]:
  """``{path: "dtype[shape]"}`` of every leaf of ``tree`` (a model's parameters)."""
  return {
    jax.tree_util.keystr(path): _array_type(np.shape(leaf), _dtype(leaf))
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def describe_element_spec(element_spec: Mapping[str, tuple[Any, Any]]) -> dict[str, str]:
  """``{feature: "dtype[shape]"}`` of one example."""
  return {
    str(k): _array_type(shape, np.dtype(dtype))
    for k, (shape, dtype) in sorted(element_spec.items())
  }


def versions() -> dict[str, str]:
  """The versions of simigrad_jax, JAX, jaxlib, optax and NumPy in this process."""
  found = {"simigrad_jax": getattr(sys.modules.get("simigrad_jax"), "__version__", "unknown")}
  for name in ("jax", "jaxlib", "optax", "numpy"):
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      found[name] = "unknown"
  return found


def _differences(name: str, saved: Any, current: Any) -> list[str]:
  if isinstance(saved, Mapping) and isinstance(current, Mapping):
    lines = []
    for key in dict.fromkeys([*saved, *current]):
      sub = f"{name}{'' if str(key).startswith('[') else '.'}{key}"
      if key not in saved:
        lines.append(f"{sub}: not there, {_shown(current[key])} here")
      elif key not in current:
        lines.append(f"{sub}: {_shown(saved[key])} there, not here")
      else:
        lines += _differences(sub, saved[key], current[key])
    return lines
  if saved == current and type(saved) is type(current):
    return []
  return [f"{name}: {_shown(saved)} there, {_shown(current)} here"]


def _shown(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 120 else text[:117] + "..."


def _walk(obj: Any, path: str, found: dict[str, Any], seen: set[int], depth: int) -> None:
  """Adds the hyperparameters under ``obj`` to ``found`` (see :func:`describe_optimizer`)."""
  if depth > _MAX_DEPTH or len(found) >= _MAX_VALUES:
    return
  if obj is None or isinstance(obj, (bool, str, numbers.Number, np.ndarray, np.generic, jax.Array)):
    value = _scalar(obj)
    if value is not _NOT_SCALAR:
      found[path or "value"] = value
    return
  if id(obj) in seen:
    return
  seen.add(id(obj))

  def child(name: str) -> str:
    return f"{path}{'' if name.startswith('[') or not path else '.'}{name}"

  if isinstance(obj, functools.partial):
    _walk(obj.func, child("func"), found, seen, depth + 1)
    items = [(f"[{i}]", a) for i, a in enumerate(obj.args)] + list(obj.keywords.items())
  elif isinstance(obj, types.FunctionType):
    cells = [
      (name, cell)
      for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=True)
      if _has_contents(cell)
    ]
    if not cells:
      found[path or "value"] = f"<function {obj.__module__}.{obj.__qualname__}>"
    items = [(name, cell.cell_contents) for name, cell in cells]
  elif isinstance(obj, Mapping):
    items = [(f"[{k!r}]", v) for k, v in obj.items()]
  elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
    items = [(name, getattr(obj, name)) for name in obj._fields]
  elif isinstance(obj, (tuple, list)):
    items = [(f"[{i}]", v) for i, v in enumerate(obj)]
  else:
    found[path or "value"] = f"<{type(obj).__module__}.{type(obj).__qualname__}>"
    return
  for name, value in items:
    _walk(value, child(name), found, seen, depth + 1)


def _has_contents(cell: Any) -> bool:
  try:
    _ = cell.cell_contents
  except ValueError:  # a cell not filled yet
    return False
  return True


_NOT_SCALAR = object()


def _scalar(value: Any) -> Any:
  """A JSON scalar for a Python or one-element array value (non-finite floats as strings)."""
  if value is None or isinstance(value, (bool, str)):
    return value
  if isinstance(value, (np.ndarray, np.generic, jax.Array)):
    if np.size(value) != 1 or not getattr(value, "is_fully_addressable", True):
      return _NOT_SCALAR
    try:
      array = np.asarray(value).reshape(())
      # float32 0.1 as 0.1: the shortest decimal that reads back as the same value.
      value = float(str(array)) if array.dtype.kind == "f" else array.item()
    except Exception:  # pylint: disable=broad-except  (a deleted or foreign array: not described)
      return _NOT_SCALAR
  if isinstance(value, bool):
    return value
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    value = float(value)
    return value if math.isfinite(value) else repr(value)
  if isinstance(value, numbers.Complex):
    return repr(complex(value))
  return _NOT_SCALAR


def _json_value(value: Any) -> Any:
  """What ``json.dumps`` cannot write itself, as JSON data (NumPy numbers, arrays, paths)."""
  scalar = _scalar(value)
  return str(value) if scalar is _NOT_SCALAR else scalar


def _dtype(leaf: Any) -> np.dtype | str:
  dtype = getattr(leaf, "dtype", None)
  return np.asarray(leaf).dtype if dtype is None else dtype


def _array_type(shape: Any, dtype: Any) -> str:
  return f"{dtype}{[int(d) for d in shape]}"
