"""Benchmark: the step reduction of ``simigrad_jax.transform`` against ``lax.pmean``.

Times, on all local devices (by default 8 simulated CPU devices), the reduction
of per-device gradients shaped like ResNet-18 for CIFAR-10 (about 11.2M
float32 parameters), and counts the bytes that each variant's compiled
collectives move per device:

* ``pmean``: ``jax.lax.pmean(grads, "batch")`` in a ``jax.pmap`` (the baseline).
* ``transform``: the default ``simigrad_jax.transform("batch")`` update
  (``reduction="hierarchical"``) in a ``jax.pmap``.
* ``scatter``: ``simigrad_jax.transform("batch", reduction="scatter")`` (the
  earlier default: every leaf concatenated, the pair stacked) in a ``jax.pmap``.
* ``stacked``: ``simigrad_jax.transform("batch", reduction="stacked")`` in a
  ``jax.pmap``.
* ``transform_shard_map``: the default transform under ``jax.shard_map``
  (``check_vma=True``, gradients passed with ``P("batch")``), the twin of
  ``transform``.

Bytes are read from the compiled HLO text (``fn.lower(...).compile().as_text()``)
with the ring model, per device, for a replica group of ``n`` devices: an
all-reduce of ``S`` bytes moves ``2 (n - 1) / n * S``; a reduce-scatter of an
``S``-byte input and an all-gather of an ``S``-byte output move
``(n - 1) / n * S`` each; an all-to-all of ``S`` input bytes moves
``(n - 1) / n * S`` and a collective-permute moves its whole operand. Expected:
``pmean`` 1.0x, ``transform`` 1.0x, ``scatter`` 1.5x, ``stacked`` 2.0x.

Memory traffic, the device-independent cost of the local work around the
collectives (copies, padding, casts, the statistics), is read from the
compiled program: ``compiled.cost_analysis()["bytes accessed"]``, with the
temporary memory from ``compiled.memory_analysis()``. Goals for the default
``transform``: collective bytes 1.0x ``pmean``'s, bytes accessed <= 1.3x.

NOTE: CPU timings mostly measure local memory work (masking, concatenating,
padding) and the in-process emulation of collectives; they do NOT rank the
variants for GPUs, where the bytes on the wire dominate. Judge the variants by
their collective bytes (see SPEC.md) and time them on GPUs.

Usage::

  python benchmarks/step_cost/reduction.py                       # full size: benchmarks/results/reduction.json
  python benchmarks/step_cost/reduction.py --out /tmp/red.json   # the JSON elsewhere (--out '': none)
  python benchmarks/step_cost/reduction.py --params 20000 --repeats 2

JSON written to ``--out`` (by default ``benchmarks/results/reduction.json``)::

  {"devices": 8, "params": N,
   "variants": {NAME: {"seconds": median, "collective_bytes": bytes,
                       "bytes_accessed": bytes, "temp_bytes": bytes, ...}},
   "goals": {GOAL: {"value": ratio, "limit": ratio, "met": bool}}}
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
  from benchmarks import common  # noqa: E402  (imports no JAX)

  common.prepare_script()

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import simigrad_jax  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.step_cost.hlo_collectives import parse_collectives  # noqa: E402

AXIS = "batch"
RESNET18_CIFAR_PARAMS = 11_173_962  # with base width 64 (channels 64..512)
VARIANTS = ("pmean", "transform", "scatter", "stacked", "transform_shard_map")
# (variant, measure, limit): the default transform against pmean. Collective bytes are
# one all-reduce's up to the padding of each bucket to a multiple of the device count.
GOALS = (
  ("transform", "bytes_ratio_to_pmean", 1.01),
  ("transform", "bytes_accessed_ratio_to_pmean", 1.3),
)
NUM_CLASSES = 10

# ----------------------------------------------------------------------------
# The gradient pytree: ResNet-18 for CIFAR (3x3 stem, 4 stages of 2 blocks).
# ----------------------------------------------------------------------------


def resnet18_shapes(base_width: int = 64) -> dict[str, Any]:
  """Parameter shapes of ResNet-18 for CIFAR-10 (Flax layout, HWIO kernels).

  Args:
    base_width: channels of the first stage; the stages have ``base_width``
      times 1, 2, 4 and 8 channels. 64 gives the standard 11,173,962 params.

  Returns:
    A nested dict of shape tuples: conv kernels, batch-norm scales and biases,
    and the final dense layer.
  """

  def batch_norm(channels):
    return {"scale": (channels,), "bias": (channels,)}

  shapes: dict[str, Any] = {
    "stem_conv": {"kernel": (3, 3, 3, base_width)},
    "stem_bn": batch_norm(base_width),
  }
  in_channels = base_width
  for stage in range(4):
    channels = base_width * 2**stage
    for block in range(2):
      block_shapes = {
        "conv1": {"kernel": (3, 3, in_channels, channels)},
        "bn1": batch_norm(channels),
        "conv2": {"kernel": (3, 3, channels, channels)},
        "bn2": batch_norm(channels),
      }
      if in_channels != channels:  # first block of stages 2-4: projection shortcut
        block_shapes["shortcut_conv"] = {"kernel": (1, 1, in_channels, channels)}
        block_shapes["shortcut_bn"] = batch_norm(channels)
      shapes[f"stage{stage + 1}_block{block}"] = block_shapes
      in_channels = channels
  shapes["dense"] = {"kernel": (in_channels, NUM_CLASSES), "bias": (NUM_CLASSES,)}
  return shapes


def _is_shape(node: Any) -> bool:
  return isinstance(node, tuple) and all(isinstance(d, int) for d in node)


def count_params(shapes: Any) -> int:
  """Number of parameters in a pytree of shape tuples."""
  return sum(int(np.prod(s)) for s in jax.tree.leaves(shapes, is_leaf=_is_shape))


def width_for_params(target: int) -> int:
  """The base width whose ResNet-18 parameter count is closest to ``target``."""
  best_width, best_error = 1, None
  for width in range(1, 4097):
    error = abs(count_params(resnet18_shapes(width)) - target)
    if best_error is None or error < best_error:
      best_width, best_error = width, error
    elif count_params(resnet18_shapes(width)) > target:
      break  # the count grows with the width: no closer one follows
  return best_width


# ----------------------------------------------------------------------------
# Collective bytes from compiled HLO text (ring model).
# ----------------------------------------------------------------------------


class Variant(NamedTuple):
  """A reduction to benchmark: its jittable function and its arguments."""

  fn: Any  # a jax.pmap / jax.jit function with .lower
  args: tuple[Any, ...]
  per_device_output: bool  # outputs carry a leading device axis (pmap)


def _transform_state(tx, mesh: Mesh, stacked: bool):
  state = tx.init(None)
  if stacked:  # pmap: one copy per device along a leading axis
    num_devices = mesh.devices.size
    state = jax.tree.map(lambda x: jnp.broadcast_to(x, (num_devices,) + x.shape), state)
    return jax.device_put(state, NamedSharding(mesh, P(AXIS)))
  return jax.device_put(state, NamedSharding(mesh, P()))


def build_variants(grads, mesh: Mesh) -> dict[str, Variant]:
  """The four variants over ``mesh``, all taking ``grads`` (leading device axis)."""
  devices = list(mesh.devices.flat)
  variants = {
    "pmean": Variant(
      jax.pmap(lambda g: lax.pmean(g, AXIS), axis_name=AXIS, devices=devices), (grads,), True
    )
  }
  for name, reduction in (
    ("transform", "hierarchical"),
    ("scatter", "scatter"),
    ("stacked", "stacked"),
  ):
    tx = simigrad_jax.transform(AXIS, reduction=reduction)
    variants[name] = Variant(
      jax.pmap(lambda g, s, tx=tx: tx.update(g, s), axis_name=AXIS, devices=devices),
      (grads, _transform_state(tx, mesh, stacked=True)),
      True,
    )

  tx = simigrad_jax.transform(AXIS)

  def per_block(g, s):
    return tx.update(jax.tree.map(lambda x: x[0], g), s)

  mapped = jax.shard_map(
    per_block, mesh=mesh, in_specs=(P(AXIS), P()), out_specs=(P(), P()), check_vma=True
  )
  variants["transform_shard_map"] = Variant(
    jax.jit(mapped), (grads, _transform_state(tx, mesh, stacked=False)), False
  )
  return variants


def make_grads(shapes: Any, mesh: Mesh, seed: int = 0):
  """Random float32 per-device gradients (leading device axis), sharded over ``mesh``."""
  num_devices = mesh.devices.size
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=_is_shape)
  sharding = NamedSharding(mesh, P(AXIS))

  def generate(key):
    keys = jax.random.split(key, len(leaves))
    return [jax.random.normal(k, (num_devices,) + s, jnp.float32) for k, s in zip(keys, leaves)]

  out = jax.jit(generate, out_shardings=[sharding] * len(leaves))(jax.random.key(seed))
  return jax.tree.unflatten(treedef, out)


def _time(call: Callable[[], Any], repeats: int, warmup: int = 2) -> list[float]:
  for _ in range(warmup):
    jax.block_until_ready(call())
  seconds = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(call())
    seconds.append(time.perf_counter() - start)
  return seconds


def _device0(tree, per_device_output: bool):
  return jax.tree.map(lambda x: np.asarray(x[0] if per_device_output else x), tree)


def run_variant(variant: Variant, num_devices: int, repeats: int) -> dict[str, Any]:
  """Compiles, times and measures the collective bytes of one variant."""
  start = time.perf_counter()
  compiled = variant.fn.lower(*variant.args).compile()
  compile_seconds = time.perf_counter() - start
  hlo = compiled.as_text()
  collectives = parse_collectives(hlo, num_devices)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # one entry per device program
  seconds = _time(lambda: compiled(*variant.args), repeats)
  output = compiled(*variant.args)
  return {
    "seconds": statistics.median(seconds),
    "min_seconds": min(seconds),
    "compile_seconds": compile_seconds,
    "collective_bytes": sum(c.bytes for c in collectives),
    "bytes_accessed": float(cost.get("bytes accessed", math.nan)),
    "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
    "collectives": [c._asdict() for c in collectives],
    "_hlo": hlo,
    "_output": output,
  }


# ----------------------------------------------------------------------------
# Main.
# ----------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--params",
    type=int,
    default=RESNET18_CIFAR_PARAMS,
    help="target parameter count; channel widths are scaled to approach it "
    f"(default {RESNET18_CIFAR_PARAMS}, ResNet-18 for CIFAR)",
  )
  parser.add_argument("--repeats", type=int, default=20, help="timed runs per variant")
  common.add_out_flag(parser, "reduction", quick=False)
  parser.add_argument("--hlo-dir", default=None, help="write each variant's compiled HLO here")
  parser.add_argument(
    "--variants",
    default=",".join(VARIANTS),
    help="comma-separated subset of " + ",".join(VARIANTS),
  )
  args = parser.parse_args(argv)
  args.out = common.out_path(args.out, "reduction")
  return args


def _format_table(results: dict[str, Any]) -> str:
  variants = results["variants"]
  base = variants.get("pmean")
  header = (
    f"{'variant':<22}{'median s':>10}{'time/pmean':>12}{'collective MB':>15}"
    f"{'/pmean':>8}{'accessed MB':>13}{'/pmean':>8}{'temp MB':>9}{'compile s':>11}"
  )
  rows = [header, "-" * len(header)]
  for name, v in variants.items():

    def ratio(key, v=v):
      return f"{v[key] / base[key]:.3f}x" if base and base[key] else "-"

    rows.append(
      f"{name:<22}{v['seconds']:>10.4f}{ratio('seconds'):>12}"
      f"{v['collective_bytes'] / 1e6:>15.2f}{ratio('collective_bytes'):>8}"
      f"{v['bytes_accessed'] / 1e6:>13.1f}{ratio('bytes_accessed'):>8}"
      f"{v['temp_bytes'] / 1e6:>9.1f}{v['compile_seconds']:>11.2f}"
    )
  rows.append("")
  for goal, result in results.get("goals", {}).items():
    rows.append(
      f"goal {goal} <= {result['limit']:.2f}: {result['value']:.3f} "
      f"{'PASS' if result['met'] else 'FAIL'}"
    )
  rows.append("")
  rows.append("collectives per device (ring model):")
  for name, v in variants.items():
    parts = [
      f"{c['kind']}[n={c['group_size']}] {c['payload_bytes']:,}B -> {c['bytes']:,.0f}B"
      for c in v["collectives"]
    ]
    rows.append(f"  {name}: " + ("; ".join(parts) if parts else "(none)"))
  return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark; prints a table, writes JSON to ``--out``, returns the results.

  Args:
    argv: command-line arguments (``sys.argv[1:]`` when None).

  Returns:
    ``{"devices": n, "params": N, "variants": {name: {"seconds": ...,
    "collective_bytes": ..., ...}}}`` plus descriptive extra keys.
  """
  args = _parse_args(argv)
  names = [name.strip() for name in args.variants.split(",") if name.strip()]
  unknown = sorted(set(names) - set(VARIANTS))
  if unknown:
    raise ValueError(f"unknown variants {unknown}; choose from {VARIANTS}")
  devices = jax.devices()
  num_devices = len(devices)
  if num_devices < 2 or num_devices % 2:
    raise RuntimeError(f"need an even number (>= 2) of devices, found {num_devices}")
  mesh = Mesh(np.array(devices), (AXIS,))

  width = width_for_params(args.params)
  shapes = resnet18_shapes(width)
  num_params = count_params(shapes)
  grads = make_grads(shapes, mesh)
  all_variants = build_variants(grads, mesh)
  print(
    f"{num_devices} x {devices[0].platform} devices; ResNet-18 (base width {width}), "
    f"{num_params:,} float32 params ({4 * num_params / 1e6:.1f} MB) per device; "
    f"{args.repeats} timed runs each",
    flush=True,
  )

  variants: dict[str, Any] = {}
  reference, reference_name = None, None
  for name in names:
    variant = all_variants[name]
    result = run_variant(variant, num_devices, args.repeats)
    hlo, output = result.pop("_hlo"), result.pop("_output")
    if args.hlo_dir:
      os.makedirs(args.hlo_dir, exist_ok=True)
      with open(os.path.join(args.hlo_dir, f"{name}.hlo.txt"), "w") as f:
        f.write(hlo)
    mean = output if name == "pmean" else output[0]
    mean = _device0(mean, variant.per_device_output)
    if reference is None:
      reference, reference_name = mean, name
    result[f"max_abs_diff_vs_{reference_name}"] = float(
      max(np.max(np.abs(a - b)) for a, b in zip(jax.tree.leaves(mean), jax.tree.leaves(reference)))
    )
    if name != "pmean":
      state = _device0(output[1], variant.per_device_output)
      result["similarity"] = float(state.similarity)
    variants[name] = result
    print(
      f"  {name}: median {result['seconds']:.4f} s, "
      f"{result['collective_bytes'] / 1e6:.2f} MB collectives",
      flush=True,
    )
    del output, mean

  base = variants.get("pmean")
  if base:
    for v in variants.values():
      v["time_ratio_to_pmean"] = v["seconds"] / base["seconds"]
      v["bytes_ratio_to_pmean"] = (
        v["collective_bytes"] / base["collective_bytes"] if base["collective_bytes"] else None
      )
      v["bytes_accessed_ratio_to_pmean"] = v["bytes_accessed"] / base["bytes_accessed"]
  goals = {}
  for name, measure, limit in GOALS:
    value = variants.get(name, {}).get(measure)
    if value is not None:
      goals[f"{name}.{measure}"] = {"value": value, "limit": limit, "met": value <= limit}
  results = {
    "devices": num_devices,
    "params": num_params,
    "variants": variants,
    "goals": goals,
    "target_params": args.params,
    "base_width": width,
    "platform": devices[0].platform,
    "repeats": args.repeats,
    "jax_version": jax.__version__,
    "note": "CPU timings mostly measure local memory work and do not rank the "
    "variants for GPUs; judge by collective bytes (SPEC.md).",
  }
  return common.report(results, _format_table(results), args.out)


if __name__ == "__main__":
  main(sys.argv[1:])
