"""Benchmark: SimiGrad in a plain ``jax.jit`` step over sharded parameters (FSDP, tensor parallel).

On 8 devices (by default simulated CPU devices), for each model, layout and
kind of mesh axes, compiles and times four training steps of the same
model on the same batch (``benchmarks/step_cost/sharded_models.py``):

* ``plain``: ``jax.value_and_grad`` and ``optax.sgd``, the step without SimiGrad;
* ``halves``: :func:`simigrad_jax.value_and_half_grads` (the even- and the
  odd-numbered examples, one pass after the other) and ``optax.sgd`` on their
  mean: the halves alone, the similarity not measured;
* ``simigrad``: the same with ``simigrad_jax.transform()`` given the halves;
* ``groups``: :func:`simigrad_jax.device_halves_step` with
  ``simigrad_jax.transform("data")``, the even data positions against the odd
  ones, on the batch ordered by :func:`simigrad_jax.data.deal_to_devices` (so that
  its halves are the same even- and odd-numbered examples).

Models (``--models``): ``kernel``, one ``W x W`` kernel (``--kernel-width``,
default 8192: 256 MiB of float32) and a 10-way head on ``W``-dimensional
inputs; ``mlp``, a perceptron 784-1024-1024-10. Layouts (``--layouts``):
``data`` (parameters replicated on a ``data`` mesh of 8), ``fsdp`` (every
kernel's rows sharded over ``data``, 8), ``tp`` (Megatron's column- then
row-parallel pairs over ``model`` on a 4 x 2 ``data`` x ``model`` mesh) and
``fsdp_tp`` (``tp`` with each kernel's other axis over ``data``), each with
``Auto`` and ``Explicit`` mesh axes (``--axes``); the batch is sharded over
``data``.

For each it records the per-device temporary memory of each compiled step
(``compiled.memory_analysis().temp_size_in_bytes``) and its median step
time (the steps' timed runs interleaved), their ratios to ``plain``, the
collectives of each compiled step (``benchmarks/step_cost/hlo_collectives.py``: count by
kind and ring-model bytes per device) and how many the SimiGrad step adds to
the plain one's, its collective-permutes (rows or gradients moving between
devices: there should be none), whether the updated parameters keep their
sharding, and the similarity the step measured against a float64 reference
of the even- and odd-numbered examples' gradients. CPU times mostly measure
local memory work and the emulation of collectives; judge the collectives by
their bytes (SPEC.md).

Goals, printed as PASS/FAIL for every run: no collective-permute in the
SimiGrad step, the similarity within 1e-4 of the reference, the parameters'
sharding kept, the transform's temporary memory at most 1.05x the halves
step's; and, reported the same way, the SimiGrad step's at most 1.05x the
plain step's. For ``groups``, against the plain step: no collective-permute,
the similarity within 1e-4 of the same reference, temporary memory at most
1.05x, collective bytes at most 1.001x (1.0x plus the statistics' scalars),
the parameters' sharding kept. And for every run, the lighter of the two
SimiGrad steps (``simigrad`` or ``groups``, by temporary memory) at most
1.05x the plain step's: the one to use for that layout
(``benchmarks/step_cost/sharded_memory.py`` follows it over batch sizes).

Usage::

  python benchmarks/step_cost/sharded.py                         # full size: benchmarks/results/sharded.json
  python benchmarks/step_cost/sharded.py --out /tmp/sharded.json
  python benchmarks/step_cost/sharded.py --models kernel --layouts tp --axes explicit
  python benchmarks/step_cost/sharded.py --quick                 # tiny, for tests: sharded_quick.json

JSON written to ``--out`` (by default ``benchmarks/results/sharded.json``)::

  {"runs": {"MODEL/LAYOUT/AXES": {"model", "layout", "axes", "mesh",
            "variants": {"plain" | "halves" | "simigrad": {"step_seconds",
                         "temp_bytes", "time_ratio_to_plain", "temp_ratio_to_plain",
                         "collectives": {kind: count}, "collective_bytes", ...}},
            "transform_temp_ratio", "collectives_beyond_plain": {kind: count},
            "collective_permutes", "transform_collective_bytes", "sharding_kept",
            "similarity", "reference_similarity", "similarity_error",
            "lighter_step", "lighter_temp_ratio_to_plain",
            "groups": {"temp_ratio_to_plain", "collective_bytes_ratio_to_plain",
                       "collectives_beyond_plain", "collective_permutes",
                       "sharding_kept", "similarity", "similarity_error",
                       "update_error"}}},
   "goals": {GOAL: {"limit", "worst", "met"}}, "models", "device", ...}
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
import collections  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import simigrad_jax  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.step_cost import halves as halves_benchmark  # noqa: E402
from benchmarks.step_cost import hlo_collectives  # noqa: E402
from benchmarks.step_cost import sharded_models  # noqa: E402
from simigrad_jax.data import deal_to_devices  # noqa: E402

FULL = {"kernel_width": 8192, "mlp_widths": (784, 1024, 1024, 10), "batch_size": 64, "repeats": 3}
QUICK = {"kernel_width": 512, "mlp_widths": (32, 64, 64, 10), "batch_size": 32, "repeats": 1}
NUM_CLASSES = 10
SIMILARITY_TOLERANCE = 1e-4
MEMORY_LIMIT = 1.05
# The groups step's collective bytes against the plain step's: 1.0x, plus the statistics'
# scalars and a padded leaf's few rows.
BYTES_LIMIT = 1.001


def model_widths(args: argparse.Namespace) -> dict[str, tuple[int, ...]]:
  """The widths of every model the run asks for, by name."""
  widths = {
    "kernel": (args.kernel_width, args.kernel_width, NUM_CLASSES),
    "mlp": tuple(args.mlp_widths),
  }
  return {name: widths[name] for name in args.models}


def _collective_counts(compiled: Any) -> tuple[dict[str, int], float]:
  """The compiled step's collectives: the count of each kind, and their ring-model bytes."""
  found = hlo_collectives.parse_collectives(compiled.as_text(), jax.device_count())
  return dict(collections.Counter(c.kind for c in found)), float(sum(c.bytes for c in found))


def _sharding_kept(before: Any, after: Any) -> bool:
  return all(
    b.sharding.is_equivalent_to(a.sharding, a.ndim)
    for b, a in zip(jax.tree.leaves(before), jax.tree.leaves(after))
  )


def run_one(
  widths: Sequence[int], layout: str, axes: str, host_params: Any, host_batch: Any, repeats: int
) -> dict[str, Any]:
  """Compiles, times and checks the four steps of one model, layout and kind of axes."""
  placed = sharded_models.place_model(widths, layout, axes, host_params, host_batch)
  mesh, params, batch = placed.mesh, placed.params, placed.batch
  # The groups step's batch, dealt so that its halves are the even and odd examples too.
  _, dealt = sharded_models.place(
    host_params, deal_to_devices(host_batch, mesh.shape["data"]), mesh, layout
  )
  states = {name: optimizer.init(params) for name, optimizer in placed.optimizers.items()}

  def reading_its_own(name):
    # One argument list for every step, timed interleaved: each step reads its own state
    # (and the groups step its dealt batch).
    step = sharded_models.keeping_layout(placed.steps[name], placed.shardings, axes)
    return lambda p, s, b: step(p, s[name], b[name == "groups"])

  picking = {name: reading_its_own(name) for name in placed.steps}
  compiled: dict[str, Any] = {}
  with jax.set_mesh(mesh):
    entries = halves_benchmark.measure(
      picking, (params, states, (batch, dealt)), repeats, compiled=compiled
    )
    updated = {
      name: compiled[name](params, states, (batch, dealt))
      for name in ("plain", "simigrad", "groups")
    }
  halves_benchmark.add_ratios(entries)
  for name, entry in entries.items():
    entry["collectives"], entry["collective_bytes"] = _collective_counts(compiled[name])
  kinds = {name: collections.Counter(entry["collectives"]) for name, entry in entries.items()}
  plain_bytes = entries["plain"]["collective_bytes"]
  lighter = min(("simigrad", "groups"), key=lambda name: entries[name]["temp_bytes"])
  return {
    "model": None,
    "layout": layout,
    "axes": axes,
    "mesh": dict(mesh.shape),
    "variants": entries,
    "transform_temp_ratio": entries["simigrad"]["temp_bytes"] / entries["halves"]["temp_bytes"],
    "collectives_beyond_plain": dict(kinds["simigrad"] - kinds["plain"]),
    "collective_permutes": kinds["simigrad"]["collective-permute"],
    "transform_collective_bytes": (
      entries["simigrad"]["collective_bytes"] - entries["halves"]["collective_bytes"]
    ),
    "sharding_kept": _sharding_kept(params, updated["simigrad"][0]),
    "similarity": simigrad_jax.similarity(updated["simigrad"][1]),
    "lighter_step": lighter,
    "lighter_temp_ratio_to_plain": entries[lighter]["temp_ratio_to_plain"],
    "groups": {
      "temp_ratio_to_plain": entries["groups"]["temp_ratio_to_plain"],
      "collective_bytes_ratio_to_plain": (
        entries["groups"]["collective_bytes"] / plain_bytes if plain_bytes else float("nan")
      ),
      "collectives_beyond_plain": dict(kinds["groups"] - kinds["plain"]),
      "collective_permutes": kinds["groups"]["collective-permute"],
      "sharding_kept": _sharding_kept(params, updated["groups"][0]),
      "similarity": simigrad_jax.similarity(updated["groups"][1]),
      "update_error": max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(
          jax.tree.leaves(updated["groups"][0]), jax.tree.leaves(updated["plain"][0]), strict=True
        )
      ),
    },
  }


def _check_goals(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
  """Each goal's worst value over the runs and whether every run meets it."""
  measures = {
    "no collective-permute in the SimiGrad step": (lambda r: r["collective_permutes"], 0),
    "|similarity - float64 reference|": (lambda r: r["similarity_error"], SIMILARITY_TOLERANCE),
    "transform temp / halves temp": (lambda r: r["transform_temp_ratio"], MEMORY_LIMIT),
    "SimiGrad temp / plain temp": (
      lambda r: r["variants"]["simigrad"]["temp_ratio_to_plain"],
      MEMORY_LIMIT,
    ),
    "parameters' sharding lost": (lambda r: int(not r["sharding_kept"]), 0),
    "lighter SimiGrad step temp / plain temp": (
      lambda r: r["lighter_temp_ratio_to_plain"],
      MEMORY_LIMIT,
    ),
    "groups: collective-permutes": (lambda r: r["groups"]["collective_permutes"], 0),
    "groups: |similarity - float64 reference|": (
      lambda r: r["groups"]["similarity_error"],
      SIMILARITY_TOLERANCE,
    ),
    "groups: temp / plain temp": (lambda r: r["groups"]["temp_ratio_to_plain"], MEMORY_LIMIT),
    "groups: collective bytes / plain (+ scalars)": (
      lambda r: r["groups"]["collective_bytes_ratio_to_plain"],
      BYTES_LIMIT,
    ),
    "groups: parameters' sharding lost": (lambda r: int(not r["groups"]["sharding_kept"]), 0),
  }
  goals = {}
  for goal, (value, limit) in measures.items():
    values = {key: value(run) for key, run in runs.items()}
    worst = max(values, key=values.get)
    goals[goal] = {
      "limit": limit,
      "worst": values[worst],
      "worst_run": worst,
      "met": all(v <= limit for v in values.values()),
    }
  return goals


def _extra(kinds: dict[str, int]) -> str:
  return ", ".join(f"+{n} {kind}" for kind, n in sorted(kinds.items())) or "none"


def _format_table(results: dict[str, Any]) -> str:
  header = (
    f"{'model':<7}{'layout':<8}{'axes':<9}{'mesh':<5}{'temp MB':>8}{'halves':>7}"
    f"{'SimiGrad':>9}{'/halves':>8}{'coll MB':>8}{'SimiGrad':>9}{'transform':>10}"
    f"{'plain s':>8}{'time':>6}{'perm':>5}{'|s - ref|':>10}  collectives beyond plain"
  )
  rows = [header, "-" * len(header)]
  for run in results["runs"].values():
    v = run["variants"]
    mesh = "x".join(str(n) for n in run["mesh"].values())
    coll_ratio = (
      v["simigrad"]["collective_bytes"] / v["plain"]["collective_bytes"]
      if v["plain"]["collective_bytes"]
      else float("nan")
    )
    rows.append(
      f"{run['model']:<7}{run['layout']:<8}{run['axes']:<9}{mesh:<5}"
      f"{v['plain']['temp_bytes'] / 2**20:>8.1f}{v['halves']['temp_ratio_to_plain']:>6.2f}x"
      f"{v['simigrad']['temp_ratio_to_plain']:>8.2f}x{run['transform_temp_ratio']:>7.3f}x"
      f"{v['plain']['collective_bytes'] / 2**20:>8.1f}{coll_ratio:>8.2f}x"
      f"{run['transform_collective_bytes']:>9.0f}B"
      f"{v['plain']['step_seconds']:>8.3f}{v['simigrad']['time_ratio_to_plain']:>5.2f}x"
      f"{run['collective_permutes']:>5}{run['similarity_error']:>10.1e}  "
      f"{_extra(run['collectives_beyond_plain'])}"
    )
  rows += [
    "",
    f"{'groups':<24}{'temp':>8}{'coll bytes':>11}{'time':>7}{'perm':>5}{'|s - ref|':>10}"
    f"{'|update - plain|':>17}{'lighter':>10}  collectives beyond plain",
  ]
  for run in results["runs"].values():
    groups = run["groups"]
    rows.append(
      f"{run['model']:<7}{run['layout']:<8}{run['axes']:<9}"
      f"{groups['temp_ratio_to_plain']:>7.3f}x{groups['collective_bytes_ratio_to_plain']:>10.4f}x"
      f"{run['variants']['groups']['time_ratio_to_plain']:>6.2f}x{groups['collective_permutes']:>5}"
      f"{groups['similarity_error']:>10.1e}{groups['update_error']:>17.1e}"
      f"{run['lighter_step']:>9}{run['lighter_temp_ratio_to_plain']:>5.2f}x  "
      f"{_extra(groups['collectives_beyond_plain'])}"
    )
  rows += [
    "",
    "temp MB: per-device temporary memory of the plain step; halves, SimiGrad: the halves "
    "and SimiGrad steps' against it; /halves: the SimiGrad step's against the halves "
    "step's (what the transform adds). coll MB: the plain step's collective bytes per "
    "device (ring model); SimiGrad: the SimiGrad step's against it; transform: the bytes "
    "the transform adds to the halves step. time: the SimiGrad step's median against "
    "plain's (CPU). perm: collective-permutes in the SimiGrad step. groups: the "
    "device_halves_step (even against odd data positions, on a dealt batch) against plain: "
    "temp, collective bytes, time, permutes, similarity error, largest parameter difference; "
    "lighter: the SimiGrad step (simigrad or groups) with less temporary memory, and its temp "
    "against plain.",
  ]
  for goal, result in results["goals"].items():
    rows.append(
      f"goal {goal} <= {result['limit']}: worst {result['worst']:.4g} "
      f"({result['worst_run']}) {'PASS' if result['met'] else 'FAIL'}"
    )
  return "\n".join(rows)


def names_among(choices: Sequence[str]):
  """An ``argparse`` type: a comma-separated list of names among ``choices``."""

  def parse(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = sorted(set(names) - set(choices))
    if unknown or not names:
      raise argparse.ArgumentTypeError(f"{text!r}: choose among {', '.join(choices)}")
    return names

  return parse


def add_model_arguments(parser: argparse.ArgumentParser, quick: dict, full: dict) -> None:
  """The flags every sharded benchmark takes: --quick, --models, --layouts, --axes and the widths."""
  parser.add_argument(
    "--quick", action="store_true", help=f"tiny sizes for tests: {quick} (flags given still win)"
  )
  parser.add_argument(
    "--models",
    type=names_among(("kernel", "mlp")),
    default=("kernel", "mlp"),
    help="comma-separated models: kernel, mlp (default both)",
  )
  parser.add_argument(
    "--layouts",
    type=names_among(tuple(sharded_models.LAYOUTS)),
    default=tuple(sharded_models.LAYOUTS),
    help="comma-separated layouts (default all): " + ", ".join(sharded_models.LAYOUTS),
  )
  parser.add_argument(
    "--axes",
    type=names_among(tuple(sharded_models.AXIS_TYPES)),
    default=tuple(sharded_models.AXIS_TYPES),
    help="comma-separated kinds of mesh axes: auto, explicit (default both)",
  )
  parser.add_argument(
    "--kernel-width",
    type=int,
    default=None,
    help=f"W of the kernel model's W x W kernel (default {full['kernel_width']})",
  )
  parser.add_argument(
    "--mlp-widths",
    type=common.integers,
    default=None,
    help=f"the MLP's widths (default {full['mlp_widths']})",
  )


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  add_model_arguments(parser, QUICK, FULL)
  parser.add_argument(
    "--batch-size",
    type=int,
    default=None,
    help=f"examples per step (default {FULL['batch_size']}); each of the "
    "data axis's devices needs an even number",
  )
  parser.add_argument(
    "--repeats", type=int, default=None, help=f"timed runs per step (default {FULL['repeats']})"
  )
  common.add_out_flag(parser, "sharded")
  args = parser.parse_args(argv)
  args.out = common.out_path(args.out, "sharded", args.quick)
  common.apply_preset(args, QUICK if args.quick else FULL)
  error = batch_size_error(args.batch_size)
  if error:
    parser.error(f"--batch-size {error}")
  return args


def batch_size_error(batch_size: int) -> str | None:
  """What is wrong with ``batch_size`` for every layout's data axis, or None."""
  data_size = max(shape[0] for shape in sharded_models.LAYOUTS.values())
  if batch_size <= 0 or batch_size % (2 * data_size):
    return (
      f"{batch_size}: give a positive multiple of {2 * data_size} "
      f"(an even number of rows on each of up to {data_size} data devices)"
    )
  return None


def check_device_count(layouts: Sequence[str]) -> None:
  """Raises if fewer devices are visible than the largest of ``layouts`` needs."""
  needed = max(int(np.prod(sharded_models.LAYOUTS[layout])) for layout in layouts)
  if jax.device_count() < needed:
    raise RuntimeError(f"the layouts {layouts} need {needed} devices, found {jax.device_count()}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark; prints a table, writes JSON to ``--out``, returns the results.

  Args:
    argv: command-line arguments (``sys.argv[1:]`` when None).

  Returns:
    ``{"runs": {"MODEL/LAYOUT/AXES": {...}}, "goals": {...}, ...}`` (see the
    module docstring).
  """
  args = _parse_args(argv)
  check_device_count(args.layouts)
  runs, models = {}, {}
  for model, widths in model_widths(args).items():
    host_params = sharded_models.init_params(widths)
    host_batch = sharded_models.make_batch(widths, args.batch_size)
    reference = sharded_models.reference_similarity(widths, host_params, host_batch)
    models[model] = {
      "widths": list(widths),
      "params": int(sum(a.size for a in jax.tree.leaves(host_params))),
      "reference_similarity": reference,
    }
    print(
      f"{model}: widths {widths}, {models[model]['params']:,} parameters; batch "
      f"{args.batch_size}; float64 similarity of the even and odd examples {reference:+.6f}",
      flush=True,
    )
    for layout in args.layouts:
      for axes in args.axes:
        run = run_one(widths, layout, axes, host_params, host_batch, args.repeats)
        run["model"] = model
        run["reference_similarity"] = reference
        run["similarity_error"] = abs(run["similarity"] - reference)
        run["groups"]["similarity_error"] = abs(run["groups"]["similarity"] - reference)
        runs[f"{model}/{layout}/{axes}"] = run
        v = run["variants"]
        print(
          f"  {layout}/{axes}: temp SimiGrad/plain {v['simigrad']['temp_ratio_to_plain']:.2f}x"
          f", SimiGrad/halves {run['transform_temp_ratio']:.3f}x, permutes "
          f"{run['collective_permutes']}, |s - ref| {run['similarity_error']:.1e}; groups: temp "
          f"{run['groups']['temp_ratio_to_plain']:.3f}x, bytes "
          f"{run['groups']['collective_bytes_ratio_to_plain']:.4f}x, permutes "
          f"{run['groups']['collective_permutes']}, |s - ref| "
          f"{run['groups']['similarity_error']:.1e}",
          flush=True,
        )
  results = {
    "runs": runs,
    "goals": _check_goals(runs),
    "models": models,
    "batch_size": args.batch_size,
    "repeats": args.repeats,
    "device": common.device_record(),
    "jax_version": jax.__version__,
  }
  return common.report(results, _format_table(results), args.out)


if __name__ == "__main__":
  main(sys.argv[1:])
