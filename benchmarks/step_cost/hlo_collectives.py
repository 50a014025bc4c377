"""Collective operations and the bytes each device sends, read from compiled HLO text (ring model).

Used by benchmarks/step_cost/reduction.py to compare the transform's collectives with one
``lax.pmean`` by bytes on the wire, which rank the variants for accelerators
where CPU wall times do not.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

__all__ = ["Collective", "parse_collectives"]

_COLLECTIVE_OPS = (
  "all-reduce-start",
  "all-reduce",
  "reduce-scatter",
  "all-gather-start",
  "all-gather",
  "ragged-all-to-all",
  "all-to-all",
  "collective-permute-start",
  "collective-permute",
  "collective-broadcast",
)
# One instruction: "[ROOT] %name = SHAPE opcode(operands), attributes". The
# opcode must follow the shape directly (not an operand such as "%all-reduce"),
# and "-done" ops never match (the opcode must be followed by "(").
_COLLECTIVE_RE = re.compile(
  r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<shape>.*?)(?<=[\s)\]}])"
  r"(?P<op>" + "|".join(re.escape(op) for op in _COLLECTIVE_OPS) + r")"
  r"\((?P<operands>[^)]*)\)(?P<attrs>.*)$"
)
_DEFINITION_RE = re.compile(
  r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<shape>.+?)\s+[a-z][\w\-]*\("
)
_ARRAY_RE = re.compile(r"\b(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[0-9,]*)\]")
_EXPLICIT_GROUPS_RE = re.compile(r"replica_groups=\{(?P<groups>(?:\{[0-9,\s]*\},?\s*)*)\}")
_IOTA_GROUPS_RE = re.compile(r"replica_groups=\[(?P<dims>[0-9,]+)\]<=")


class Collective(NamedTuple):
  """One collective op found in compiled HLO, with its ring-model traffic."""

  kind: str  # all-reduce, reduce-scatter, all-gather, all-to-all, collective-permute, ...
  name: str  # the HLO instruction name
  group_size: int  # devices in its replica group
  payload_bytes: int  # S: all-reduce operand, reduce-scatter input, all-gather output, ...
  bytes: float  # ring-model bytes each device sends


def _array_sizes(shape_text: str) -> list[int]:
  """Bytes of every array in an HLO shape string (tuples flattened, in order)."""
  sizes = []
  for match in _ARRAY_RE.finditer(shape_text):
    dtype = match.group("dtype")
    if dtype == "pred":
      bits = 8
    else:
      width = re.match(r"[a-z]+(\d+)", dtype)
      if width is None:  # token and other non-array types
        continue
      bits = int(width.group(1))
    dims = [int(d) for d in match.group("dims").split(",") if d]
    sizes.append(int(np.prod(dims, dtype=np.int64)) * bits // 8)
  return sizes


def _group_size(attrs: str, default: int) -> int:
  """Devices per replica group, from explicit or iota ``replica_groups``."""
  iota = _IOTA_GROUPS_RE.search(attrs)
  if iota:
    dims = [int(d) for d in iota.group("dims").split(",") if d]
    return int(np.prod(dims[1:])) if len(dims) > 1 else dims[0]
  explicit = _EXPLICIT_GROUPS_RE.search(attrs)
  if explicit:
    first = re.search(r"\{([0-9,\s]*)\}", explicit.group("groups"))
    if first and first.group(1).strip():
      return len([d for d in first.group(1).split(",") if d.strip()])
  return default  # replica_groups={} or absent: every device


def parse_collectives(hlo_text: str, num_devices: int) -> list[Collective]:
  """Finds the collectives in compiled HLO text and their ring-model bytes per device.

  Handles tuple-shaped (combined) collectives, the async ``-start`` forms
  (counted once; ``-done`` ignored), collectives wrapped in async computations,
  explicit (``{{0,1},{2,3}}``) and iota (``[2,2]<=[4]``) replica groups, and
  operands printed with or without their shapes.

  Args:
    hlo_text: the text of ``jax.jit(f).lower(...).compile().as_text()``.
    num_devices: the group size when ``replica_groups`` is empty.

  Returns:
    One :class:`Collective` per collective op, in program order.
  """
  lines = hlo_text.splitlines()
  defined: dict[str, str] = {}
  for line in lines:
    match = _DEFINITION_RE.match(line)
    if match:
      defined[match.group("name").lstrip("%")] = match.group("shape")

  def operand_sizes(operands: str) -> list[int] | None:
    if _ARRAY_RE.search(operands):  # old style: shapes printed with the operands
      return _array_sizes(operands)
    sizes = []
    for name in re.findall(r"%?([\w.\-]+)", operands):
      if name not in defined:
        return None
      sizes.extend(_array_sizes(defined[name]))
    return sizes

  found = []
  for line in lines:
    match = _COLLECTIVE_RE.match(line)
    if not match:
      continue
    op = match.group("op")
    kind = op.removesuffix("-start")
    result = _array_sizes(match.group("shape"))
    operands = operand_sizes(match.group("operands"))
    n = _group_size(match.group("attrs"), num_devices)
    if kind == "all-reduce":
      payload = sum(operands) if operands is not None else sum(result)
      moved = 2 * (n - 1) / n * payload
    elif kind == "reduce-scatter":
      payload = sum(operands) if operands is not None else n * sum(result)
      moved = (n - 1) / n * payload
    elif kind == "all-gather":
      if op == "all-gather-start":  # result is (inputs..., outputs...)
        outputs = result[len(result) // 2 :]
        payload = sum(outputs) if outputs else n * sum(operands or [])
      else:
        payload = sum(result)
      moved = (n - 1) / n * payload
    elif kind in ("all-to-all", "ragged-all-to-all"):
      payload = sum(operands) if operands is not None else sum(result)
      moved = (n - 1) / n * payload
    else:  # collective-permute, collective-broadcast: the whole operand once
      payload = sum(operands) if operands is not None else (result[0] if result else 0)
      moved = float(payload)
    found.append(Collective(kind, match.group("name").lstrip("%"), n, int(payload), moved))
  return found


# ----------------------------------------------------------------------------
# The variants.
# ----------------------------------------------------------------------------
