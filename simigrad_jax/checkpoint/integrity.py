"""Host: what a checkpoint carries so that a restore detects damage orbax does not notice.

orbax restores some damaged files without an error: a flipped bit in an
array's data file or in the JSON can give wrong values (14 of 80 random
single-bit flips did with orbax 0.12.8). So the checkpoint's ``host`` item is
a record (:func:`host_record`) of the host's JSON together with the state's
layout (path, shape and dtype of every leaf), two 32-bit checksums of every
array's bytes (computed on the devices) and a CRC-32 of the JSON itself.
:class:`~simigrad_jax.checkpoint.checkpointer.Checkpointer` checks all three on
restore (:func:`verified_payload`, :func:`check_checksums`): a record or an
array that fails is damage.
"""

from __future__ import annotations

import atexit
import json
import threading
import zlib
from concurrent.futures import Future
from concurrent.futures import wait
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils

from simigrad_jax.errors import SimiGradError

FORMAT = "simigrad_jax.checkpoint/1"


class _Unreadable(SimiGradError, ValueError):
  """A checkpoint whose files are damaged or incomplete."""


class OtherFormatError(SimiGradError, ValueError):
  """A checkpoint written by another version of simigrad_jax, in a format this one does not read.

  Not damage: it is neither skipped nor moved aside.
  """


def host_record(state: Any, host: dict[str, Any], step: int) -> dict[str, Any]:
  """The ``host`` item saved with ``state``: ``host``, the state's layout and checksums, a CRC-32.

  Args:
    state: the arrays saved (a pytree; every process calls it in a multi-host run).
    host: the host's JSON data.
    step: the step it is saved as (its folder's name): a folder copied or
      renamed to another step's name is then told apart on restore.

  Returns:
    ``{"format", "crc32", "payload": {"host", "layout", "checksums", "step"}}``.
  """
  payload = {"host": host, "layout": layout(state), "checksums": _checksums(state), "step": step}
  return {"format": FORMAT, "crc32": _crc32(payload), "payload": payload}


def check_checksums(payload: dict[str, Any], restored: Any, step: int) -> None:
  """Raises if the arrays restored for ``step`` differ from the checksums saved with them."""
  got = _checksums(restored)
  if got != payload["checksums"]:
    bad = [
      entry[0]
      for entry, want, have in zip(payload["layout"], payload["checksums"], got, strict=True)
      if want != have
    ]
    raise _Unreadable(
      f"the checkpoint at step {step} holds arrays whose checksums differ from "
      f"those saved with it (damaged data) at {bad[:5]}"
    )


def _crc32(payload: Any) -> int:
  return zlib.crc32(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode())


def verified_payload(record: Any, step: int) -> dict[str, Any] | None:
  """The payload of a host record after checking its format and CRC (None: a legacy record)."""
  if isinstance(record, dict) and not {"format", "crc32", "payload"} & set(record):
    return None  # written before checksums existed: the host dict itself
  if not isinstance(record, dict) or record.get("format") != FORMAT:
    got = record.get("format") if isinstance(record, dict) else type(record).__name__
    family = FORMAT.rsplit("/", 1)[0] + "/"
    if isinstance(got, str) and got.startswith(family) and got != FORMAT:
      raise OtherFormatError(
        f"the checkpoint of step {step} was written by another version of simigrad_jax (format "
        f"{got!r}; this one reads {FORMAT!r}): resume with the version that wrote it, or use a "
        "new workdir"
      )
    raise _Unreadable(f"the host record of step {step} has format {got!r}, expected {FORMAT!r}")
  payload = record.get("payload")
  if not isinstance(payload, dict) or _crc32(payload) != record.get("crc32"):
    raise _Unreadable(f"the host record of step {step} fails its CRC-32 check (damaged JSON)")
  for key in ("host", "layout", "checksums"):
    if key not in payload:
      raise _Unreadable(f"the host record of step {step} has no {key!r}")
  saved_as = payload.get("step", step)  # (records written before the step was recorded lack it)
  if saved_as != step:
    raise _Unreadable(
      f"the checkpoint in the folder of step {step} was saved as step {saved_as!r}: a checkpoint "
      "folder copied or renamed to another step's name"
    )
  return payload


def layout(tree: Any) -> list[list[Any]]:
  """``[path, shape, dtype]`` of every leaf, as JSON data."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [
    [jax.tree_util.keystr(path), [int(d) for d in np.shape(leaf)], _dtype_name(leaf)]
    for path, leaf in leaves
  ]


def _dtype_name(leaf: Any) -> str:
  dtype = getattr(leaf, "dtype", None)
  return str(np.asarray(leaf).dtype if dtype is None else dtype)


def describe_differences(saved: list, wanted: list) -> str:
  """The first differences between two :func:`layout` records, for a message (at most four)."""
  saved_by_path = {path: (shape, dtype) for path, shape, dtype in saved}
  wanted_by_path = {path: (shape, dtype) for path, shape, dtype in wanted}
  notes = []
  for path in wanted_by_path:
    if path not in saved_by_path:
      notes.append(f"{path} is missing there")
    elif saved_by_path[path] != wanted_by_path[path]:
      (s_shape, s_dtype), (w_shape, w_dtype) = saved_by_path[path], wanted_by_path[path]
      notes.append(f"{path} is {s_dtype}{s_shape} there and {w_dtype}{w_shape} here")
  notes += [f"{path} is only there" for path in saved_by_path if path not in wanted_by_path]
  if not notes:
    notes = ["the leaves are in a different order"]
  more = f" (and {len(notes) - 4} more)" if len(notes) > 4 else ""
  return "; ".join(notes[:4]) + more


def _bits(x: jax.Array) -> jax.Array:
  """The bytes of ``x`` as a flat uint32 vector (one entry per 1, 2 or 4 bytes)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
  return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).reshape(-1)


@jax.jit
def _leaf_checksums(leaves: list[jax.Array]) -> jax.Array:
  """Two position-weighted 32-bit sums per leaf: any single flipped bit changes the first."""
  sums = []
  for leaf in leaves:
    bits = _bits(jnp.asarray(leaf))
    index = lax.iota(jnp.uint32, bits.size)
    first = jnp.sum(bits * (2 * index + 1), dtype=jnp.uint32)
    mixed = (bits ^ (bits >> 15)) * jnp.uint32(0x2C1B3C6D) + index * jnp.uint32(0x297A2D39)
    second = jnp.sum(mixed ^ (mixed >> 12), dtype=jnp.uint32)
    sums.append(jnp.stack([first, second]))
  return jnp.stack(sums) if sums else jnp.zeros((0, 2), jnp.uint32)


def prepare_checksums(tree: Any) -> None:
  """Starts compiling, in a background thread, the checksum program of arrays like ``tree``'s.

  A save or a restore of such arrays then waits at most for the rest of that
  compile instead of compiling in the calling thread: a run's first save,
  often a stop on a signal, is prompt. The program is compiled once per
  layout (shapes, dtypes, shardings) in a process. An interpreter's normal
  exit waits for a compile still in progress (XLA would abort the process).

  Args:
    tree: a pytree of ``jax.Array`` (or ``jax.ShapeDtypeStruct`` with
      shardings); anything else is compiled when first used, as before.
  """
  leaves = jax.tree.leaves(tree)
  key = _layout_key(leaves)
  if key is None:
    return
  with _PROGRAMS_LOCK:
    if key in _PROGRAMS:
      return
    program = _PROGRAMS[key] = Future()
  thread = threading.Thread(
    target=_compile_into, args=(program, leaves), name="simigrad-checksums", daemon=True
  )
  thread.start()


# The checksum programs compiled, by layout (see _layout_key); each a Future of a jax.stages.Compiled.
_PROGRAMS: dict[tuple[Any, ...], Future] = {}
_PROGRAMS_LOCK = threading.Lock()


def _layout_key(leaves: list[Any]) -> tuple[Any, ...] | None:
  """What a compiled checksum program is specific to; None when a leaf has no sharding."""
  key = []
  for leaf in leaves:
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(leaf, jax.Array | jax.ShapeDtypeStruct) or sharding is None:
      return None
    key.append((tuple(leaf.shape), str(leaf.dtype), _weak_type(leaf), sharding))
  return tuple(key)


def _weak_type(leaf: Any) -> bool:
  """Whether ``leaf`` is weakly typed (a key array, which has no such attribute, is not)."""
  return bool(getattr(leaf, "weak_type", False))


def _compile_into(program: Future, leaves: list[Any]) -> None:
  """Compiles :func:`_leaf_checksums` for ``leaves``' layout into ``program``."""
  abstract = [
    jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=_weak_type(x))
    for x in leaves
  ]
  try:
    program.set_result(_leaf_checksums.lower(abstract).compile())
  except BaseException as error:  # (the caller falls back to compiling it as it is called)
    program.set_exception(error)


def _program(leaves: list[Any]) -> Any:
  """The checksum program for ``leaves``: the one compiled ahead (waiting for it while it
  compiles), else one compiled here (kept for the next call), else the jitted function."""
  key = _layout_key(leaves)
  if key is None:
    return _leaf_checksums
  with _PROGRAMS_LOCK:
    program = _PROGRAMS.get(key)
    compile_here = program is None
    if program is None:
      program = _PROGRAMS[key] = Future()
  if compile_here:
    _compile_into(program, leaves)
  try:
    return program.result()
  except Exception:
    return _leaf_checksums


def _await_programs() -> None:
  """Waits for the checksum compiles in progress (at the interpreter's exit)."""
  with _PROGRAMS_LOCK:
    programs = list(_PROGRAMS.values())
  wait(programs)


atexit.register(_await_programs)  # (registered after JAX's own hooks: it runs before them)


def _checksums(tree: Any) -> list[list[int]]:
  """Checksums of every leaf of ``tree`` (computed on its devices), as JSON data."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return []
  try:
    sums = _program(leaves)(leaves)
  except (TypeError, ValueError):  # (arrays the compiled program does not take: laid out anew)
    sums = _leaf_checksums(leaves)
  if not sums.is_fully_addressable:
    sums = multihost_utils.process_allgather(sums, tiled=True)
  return np.asarray(sums).astype(np.int64).tolist()


def check_matches(abstract: Any, restored: Any, step: int) -> None:
  """Raises ValueError if ``restored`` has another structure, shapes or dtypes than ``abstract``."""
  want = jax.tree.structure(abstract)
  got = jax.tree.structure(restored)
  if want != got:  # type: ignore[operator]  # PyTreeDef: no stub
    raise ValueError(f"the checkpoint at step {step} has a different structure: {got} != {want}")
  for a, r in zip(jax.tree.leaves(abstract), jax.tree.leaves(restored), strict=True):
    if tuple(a.shape) != tuple(r.shape) or a.dtype != r.dtype:
      raise ValueError(
        f"the checkpoint at step {step} holds {r.dtype}{list(r.shape)} where the model "
        f"has {a.dtype}{list(a.shape)}"
      )
