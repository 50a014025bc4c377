"""Benchmark: the SimiGrad steps' temporary memory against the plain step's, over batch sizes.

``benchmarks/step_cost/sharded.py`` compiles, times and checks the steps at one batch.
Which of the two SimiGrad steps needs less memory depends on the rows a
step has, because XLA's partitioner plans the plain step by them: with FSDP
and tensor parallelism under ``Auto`` axes and few rows it moves the rows'
activations to the kernel's blocks instead of gathering the kernel, which
the device halves (``groups``, each device the gradient of its own rows)
cannot do, and the ``value_and_half_grads`` step (``simigrad``) can. This
script only compiles (nothing runs, so it takes large batches on the CPU):
for each model, layout, kind of mesh axes and batch size (``--batch-sizes``),
the per-device temporary memory of the ``plain``, ``simigrad`` and
``groups`` steps of ``benchmarks/step_cost/sharded_models.py``
(``compiled.memory_analysis().temp_size_in_bytes``), their ratios to the
plain step's, and the lighter SimiGrad step.

Goal, printed as PASS/FAIL: at every batch size of every layout, the lighter
SimiGrad step needs at most 1.05x the plain step's temporary memory.

Usage::

  python benchmarks/step_cost/sharded_memory.py --layouts fsdp_tp --axes auto --out /tmp/memory.json
  python benchmarks/step_cost/sharded_memory.py --quick    # tiny, for tests: sharded_memory_quick.json

JSON written to ``--out`` (by default ``benchmarks/results/sharded_memory.json``)::

  {"runs": {"MODEL/LAYOUT/AXES/BATCH": {"model", "layout", "axes", "batch_size",
            "temp_bytes": {"plain" | "simigrad" | "groups": bytes},
            "temp_ratio_to_plain": {"simigrad" | "groups": ratio},
            "lighter_step", "lighter_temp_ratio_to_plain"}},
   "goal": {"limit", "worst", "worst_run", "met"}, "models", "batch_sizes", "device", ...}
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
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.step_cost import sharded as sharded_benchmark  # noqa: E402
from benchmarks.step_cost import sharded_models  # noqa: E402

FULL = {
  "kernel_width": 8192,
  "mlp_widths": (784, 1024, 1024, 10),
  "batch_sizes": (64, 512, 4096, 16384),
}
QUICK = {"kernel_width": 512, "mlp_widths": (32, 64, 64, 10), "batch_sizes": (32, 256)}
STEPS = ("plain", "simigrad", "groups")
SIMIGRAD_STEPS = ("simigrad", "groups")


def memory_one(
  widths: Sequence[int], layout: str, axes: str, host_params: Any, host_batch: Any
) -> dict[str, Any]:
  """Compiles the plain and the two SimiGrad steps of one configuration; their temporary memory."""
  placed = sharded_models.place_model(widths, layout, axes, host_params, host_batch)
  temp = {}
  with jax.set_mesh(placed.mesh):
    for name in STEPS:
      step = sharded_models.keeping_layout(placed.steps[name], placed.shardings, axes)
      # The groups step's batch is dealt in the benchmark: the same shape and sharding.
      state = placed.optimizers[name].init(placed.params)
      compiled = jax.jit(step).lower(placed.params, state, placed.batch).compile()
      temp[name] = int(compiled.memory_analysis().temp_size_in_bytes)
  ratios = {name: temp[name] / temp["plain"] for name in SIMIGRAD_STEPS}
  lighter = min(SIMIGRAD_STEPS, key=ratios.get)
  return {
    "layout": layout,
    "axes": axes,
    "temp_bytes": temp,
    "temp_ratio_to_plain": ratios,
    "lighter_step": lighter,
    "lighter_temp_ratio_to_plain": ratios[lighter],
  }


def _format_table(results: dict[str, Any]) -> str:
  header = (
    f"{'model':<7}{'layout':<8}{'axes':<9}{'batch':>7}{'plain MB':>10}"
    f"{'simigrad':>10}{'groups':>9}  lighter"
  )
  rows = [header, "-" * len(header)]
  for run in results["runs"].values():
    ratios = run["temp_ratio_to_plain"]
    rows.append(
      f"{run['model']:<7}{run['layout']:<8}{run['axes']:<9}{run['batch_size']:>7}"
      f"{run['temp_bytes']['plain'] / 2**20:>10.1f}{ratios['simigrad']:>9.3f}x"
      f"{ratios['groups']:>8.3f}x  {run['lighter_step']}"
    )
  goal = results["goal"]
  rows += [
    "",
    "plain MB: per-device temporary memory of the plain step; simigrad (value_and_half_grads "
    "with transform()), groups (device_halves_step): theirs against it; lighter: the one "
    "with less.",
    f"goal lighter SimiGrad step temp / plain temp <= {goal['limit']}: worst "
    f"{goal['worst']:.4g} ({goal['worst_run']}) {'PASS' if goal['met'] else 'FAIL'}",
  ]
  return "\n".join(rows)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sharded_benchmark.add_model_arguments(parser, QUICK, FULL)
  parser.add_argument(
    "--batch-sizes",
    type=common.integers,
    default=None,
    help=f"comma-separated examples per step (default {FULL['batch_sizes']}); each of the "
    "data axis's devices needs an even number",
  )
  common.add_out_flag(parser, "sharded_memory")
  args = parser.parse_args(argv)
  args.out = common.out_path(args.out, "sharded_memory", args.quick)
  common.apply_preset(args, QUICK if args.quick else FULL)
  for batch_size in args.batch_sizes:
    error = sharded_benchmark.batch_size_error(batch_size)
    if error:
      parser.error(f"--batch-sizes: {error}")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the sweep; prints a table, writes JSON to ``--out``, returns the results.

  Args:
    argv: command-line arguments (``sys.argv[1:]`` when None).

  Returns:
    ``{"runs": {"MODEL/LAYOUT/AXES/BATCH": {...}}, "goal": {...}, ...}`` (see
    the module docstring).
  """
  args = _parse_args(argv)
  sharded_benchmark.check_device_count(args.layouts)
  runs, models = {}, {}
  for model, widths in sharded_benchmark.model_widths(args).items():
    host_params = sharded_models.init_params(widths)
    models[model] = {"widths": list(widths)}
    for batch_size in args.batch_sizes:
      host_batch = sharded_models.make_batch(widths, batch_size)
      for layout in args.layouts:
        for axes in args.axes:
          run = {"model": model, "batch_size": batch_size}
          run.update(memory_one(widths, layout, axes, host_params, host_batch))
          runs[f"{model}/{layout}/{axes}/{batch_size}"] = run
          print(
            f"{model} {layout}/{axes} batch {batch_size}: simigrad "
            f"{run['temp_ratio_to_plain']['simigrad']:.3f}x, groups "
            f"{run['temp_ratio_to_plain']['groups']:.3f}x",
            flush=True,
          )
  ratios = {key: run["lighter_temp_ratio_to_plain"] for key, run in runs.items()}
  worst = max(ratios, key=ratios.get)
  limit = sharded_benchmark.MEMORY_LIMIT
  results = {
    "runs": runs,
    "goal": {
      "limit": limit,
      "worst": ratios[worst],
      "worst_run": worst,
      "met": all(ratio <= limit for ratio in ratios.values()),
    },
    "models": models,
    "batch_sizes": list(args.batch_sizes),
    "device": common.device_record(),
    "jax_version": jax.__version__,
  }
  return common.report(results, _format_table(results), args.out)


if __name__ == "__main__":
  main(sys.argv[1:])
