"""The report of benchmarks/trainer_overhead/switching.py: each mode's numbers, the ratios between modes, the table.

Plain Python and NumPy over the Trainer's step records (``metrics.jsonl``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

# The modes compared in "ratios" (as "<numerator>_over_<denominator>"), with their column labels.
RATIOS = (("recompile", "pad", "recomp/pad"), ("recompile_2proc", "recompile", "2proc/1proc"))

_RATIO_KEYS = (
  "wall_seconds",
  "total_seconds",
  "compile_seconds",
  "data_seconds",
  "rows_computed",
  "examples_per_second",
  "examples_per_second_after_first_step",
  "median_step_seconds",
)


def _share(part: float, whole: float) -> float:
  return part / whole if whole > 0 else math.nan


def summarize_mode(
  mode: str,
  records: list[dict[str, Any]],
  summary: dict[str, Any],
  final_stats: dict[str, Any],
  shapes: Sequence[int],
  timings: dict[str, float],
) -> dict[str, Any]:
  """The per-mode numbers from the step records, the train summary and compile stats."""
  steps = [r for r in records if "batch_size" in r]
  if not steps:
    raise RuntimeError(f"{mode}: no step records were written")
  seconds = np.array([r["step_seconds"] for r in steps])
  waits = np.array([r["compile_wait_step_seconds"] for r in steps])
  data = np.array([r["data_seconds"] for r in steps])
  examples = np.array([r["batch_size"] for r in steps])
  padded = np.array([r["padded_examples"] for r in steps])
  micro = [r["micro_batch_size"] for r in steps]
  visited = sorted(set(micro))
  wall = float(seconds.sum())

  # Warm-up ends when every shape of the grid is compiled (None: never, in this run).
  all_shapes = set(shapes)
  warm_index = next(
    (i for i, r in enumerate(steps) if all_shapes <= set(r["compiled_micro_batch_sizes"])), None
  )
  after = slice(warm_index + 1, None) if warm_index is not None else slice(len(steps), None)
  switches = sum(a != b for a, b in zip(micro, micro[1:]))

  result = {
    "steps": len(steps),
    "buckets_visited": len(visited),
    "visited_micro_batch_sizes": visited,
    "grid_micro_batch_sizes": list(shapes),
    "shape_switches": switches,
    "compiles": int(final_stats["compiles"]),
    "compile_cache_hits": int(final_stats["compile_cache_hits"]),
    "step_compiles": len(final_stats["compiled_step_sizes"]),
    "accumulation_compiles": len(final_stats["compiled_accumulation_sizes"]),
    "update_compiled": bool(final_stats["update_compiled"]),
    "compiled_micro_batch_sizes": list(final_stats["compiled_micro_batch_sizes"]),
    "compile_seconds": float(final_stats["compile_seconds"]),
    "compile_wait_seconds": float(final_stats["compile_wait_seconds"]),
    "steps_that_waited": int(np.sum(waits > 0)),
    "wall_seconds": wall,
    "total_seconds": timings["total"],
    "setup_seconds": timings["setup"],
    "apply_compile_seconds": timings["apply_compile"],
    "train_seconds": timings["train"],
    "close_seconds": timings["close"],
    "between_steps_seconds": timings["train"] - wall,
    "compile_wait_share": _share(float(waits.sum()), wall),
    "compile_wait_share_after_first_step": _share(float(waits[1:].sum()), float(seconds[1:].sum())),
    "compile_wait_share_after_all_compiled": _share(
      float(waits[after].sum()), float(seconds[after].sum())
    ),
    "warmup_end_step": None if warm_index is None else int(steps[warm_index]["step"]),
    "warmup_end_seconds": None if warm_index is None else float(seconds[: warm_index + 1].sum()),
    "data_seconds": float(data.sum()),
    "data_share": _share(float(data.sum()), wall),
    "examples": int(examples.sum()),
    "rows_computed": int(examples.sum() + padded.sum()),
    "padded_examples": int(padded.sum()),
    "padding_fraction": float(padded.sum() / (examples.sum() + padded.sum())),
    "compile_fallback_steps": int(sum(bool(r.get("compile_fallback")) for r in steps)),
    "examples_per_second": _share(float(examples.sum()), wall),
    "examples_per_second_after_first_step": _share(
      float(examples[1:].sum()), float(seconds[1:].sum())
    ),
    "median_step_seconds": float(np.median(seconds)),
    "agreement_seconds_per_step": float(np.median([r["agreement_seconds"] for r in steps])),
    "first_step_seconds": float(seconds[0]),
    "final_loss": summary.get("loss"),
    "batch_sizes": [int(b) for b in examples],
  }
  # The train summary and the records agree on the totals (both from the Trainer).
  result["trainer_wall_seconds"] = float(summary["wall_seconds"])
  result["trainer_data_seconds"] = float(summary["data_seconds"])
  return result


def mode_ratios(results_by_mode: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
  """``{"<numerator>_over_<denominator>": {key: ratio}}`` for the pairs of :data:`RATIOS` that ran."""
  ratios = {}
  for numerator, denominator, _ in RATIOS:
    if {numerator, denominator} <= set(results_by_mode):
      top, bottom = results_by_mode[numerator], results_by_mode[denominator]
      ratios[f"{numerator}_over_{denominator}"] = {
        key: (top[key] / bottom[key] if bottom[key] else None) for key in _RATIO_KEYS
      }
  return ratios


def format_table(results: dict[str, Any]) -> str:
  modes = results["modes"]
  rows = [
    ("steps", "steps", "d"),
    ("buckets visited", "buckets_visited", "d"),
    ("shape switches", "shape_switches", "d"),
    ("compiles (incl. apply)", "compiles", "d"),
    ("compile s", "compile_seconds", ".2f"),
    ("  loaded from the persistent cache", "compile_cache_hits", "d"),
    ("compile wait s", "compile_wait_seconds", ".2f"),
    ("steps that waited", "steps_that_waited", "d"),
    ("wall s (sum of steps)", "wall_seconds", ".2f"),
    ("total s (incl. set-up)", "total_seconds", ".2f"),
    ("  set-up s", "setup_seconds", ".2f"),
    ("    apply-step compile s", "apply_compile_seconds", ".2f"),
    ("  between steps s (ckpt, log)", "between_steps_seconds", ".2f"),
    ("wait share, overall", "compile_wait_share", ".2%"),
    ("wait share, after 1st step", "compile_wait_share_after_first_step", ".2%"),
    ("wait share, after all compiled", "compile_wait_share_after_all_compiled", ".2%"),
    ("warm-up ends at step", "warmup_end_step", "d"),
    ("warm-up s", "warmup_end_seconds", ".2f"),
    ("data s", "data_seconds", ".2f"),
    ("data share", "data_share", ".2%"),
    ("examples", "examples", "d"),
    ("rows computed", "rows_computed", "d"),
    ("padding fraction", "padding_fraction", ".2%"),
    ("steps on a fallback shape", "compile_fallback_steps", "d"),
    ("examples/s", "examples_per_second", ".0f"),
    ("examples/s after 1st step", "examples_per_second_after_first_step", ".0f"),
    ("median step s", "median_step_seconds", ".4f"),
    ("agreement s per step (median)", "agreement_seconds_per_step", ".4f"),
  ]
  names = list(modes)
  ratio_columns = [
    (f"{numerator}_over_{denominator}", label)
    for numerator, denominator, label in RATIOS
    if f"{numerator}_over_{denominator}" in results["ratios"]
  ]
  width = max([12] + [len(name) + 2 for name in names])
  header = f"{'':<32}" + "".join(f"{name:>{width}}" for name in names)
  header += "".join(f"{label:>12}" for _, label in ratio_columns)
  lines = [header, "-" * len(header)]

  def cell(value, fmt):
    if value is None or (isinstance(value, float) and math.isnan(value)):
      return f"{'-':>{width}}"
    return f"{format(value, fmt):>{width}}"

  for label, key, fmt in rows:
    line = f"{label:<32}" + "".join(cell(modes[name].get(key), fmt) for name in names)
    for name, _ in ratio_columns:
      ratio = results["ratios"][name].get(key)
      line += f"{'-':>12}" if ratio is None else f"{ratio:>11.2f}x"
    lines.append(line)
  return "\n".join(lines)


MARKDOWN_HEADER = (
  "| pace | shapes a step | mode | compiled | loaded | compile s | waited s "
  "| wait share after step 1 | steps that waited | fallback steps | padding | median step s "
  "| examples/s | load average |\n"
  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def markdown_table(runs: Sequence[dict[str, Any]]) -> str:
  """A Markdown table of one row per mode of each run's JSON, in the order given.

  The compile schedule's pace (steps per program), the most shapes a step holds (1 for the runs
  before the JSON recorded it: the grid of halvings), the programs compiled and
  those loaded from the persistent cache, the compile seconds, the seconds
  steps waited, the wait share after the first step, the steps that waited
  and those on a fallback shape, the padding, the median step, examples per
  second, and the host's load average (1 minute) before and after the run.
  """
  lines = [MARKDOWN_HEADER]
  for run in runs:
    load = "-".join(f"{value:.0f}" for value in run["load_average"])
    for mode, result in run["modes"].items():
      loaded = result["compile_cache_hits"]
      lines.append(
        f"| {run['steps_per_compile']:g} | {run.get('shapes_per_step', 1)} | `{mode}` "
        f"| {result['compiles'] - loaded} | {loaded} "
        f"| {result['compile_seconds']:.1f} | {result['compile_wait_seconds']:.1f} "
        f"| {result['compile_wait_share_after_first_step']:.1%} "
        f"| {result['steps_that_waited']} | {result['compile_fallback_steps']} "
        f"| {result['padding_fraction']:.1%} | {result['median_step_seconds']:.3f} "
        f"| {result['examples_per_second']:,.0f} | {load} |"
      )
  return "\n".join(lines)
