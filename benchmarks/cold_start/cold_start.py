"""Benchmark: a recipe's cold start, adaptive against its batch held fixed, before and now.

Runs the README's demo (``train/configs/digits_demo.py``) and the LM recipe
(``train/configs/shakespeare_lm.py``) as a user runs them, ``python -m train``,
each run a new process in a new workdir, in three variants:

* ``adaptive``: the recipe as written, on the training scripts' compile
  defaults (steps of up to three shapes on the grid chosen for them, 64 steps
  per compile in the schedule; the LM recipe's own pace, 256);
* ``before``: the same with the compile settings before them spelled out
  (every micro-step of a step on one shape, ``shapes_per_step=1``, on the
  grid chosen for that; 4 steps per compile);
* ``fixed``: the same Trainer with the batch held at the recipe's initial
  size (``controller="fixed"``: one or two programs);

each with a cold compilation cache (a new, explicit ``compilation_cache_dir``)
and then warm: a second run in a NEW workdir on the same cache, which should
compile nothing. Paired seeds (``--seeds``); within a seed the variants run
one after the other, their order rotating with the seed, so that a loaded
machine's load falls on them alike, or with ``--parallel`` side by side.

Measured per run, from the run's ``summary.json``: the programs compiled
(compiles less those loaded from the cache) and loaded, the seconds spent
compiling, the seconds steps waited for a compile (their share of the
runtime, and split: the first step's wait for its own program, read from its
record in ``metrics.jsonl``, and the later steps'), the seconds before the
first step (the summary's ``setup_seconds``: the data, the model, the
Trainer's set-up), the runtime (the summary's ``seconds``: start to end of
the run, evaluation included), the padding (padded rows over the rows
computed), the steps that ran on a fallback shape, the final evaluation's
accuracy and loss, and the machine's load average (1 minute) before and
after the run's group. The JSON
(``benchmarks/results/cold_start.json``, or ``--out``) is rewritten after
every run, so a run cut short keeps what finished. ``--markdown JSON``
prints docs/results.md's table of a result.

The same script runs on a GPU host (``--device gpu``, or ``auto``: the
accelerators when there are any); ``--steps`` and ``--seeds 1`` make a
reduced run. ``--set NAME=VALUE`` (repeatable) gives every run one more
training-script setting after its variant's, e.g. ``--set
steps_per_compile=256`` to weigh the compile schedule's pace.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

if __name__ == "__main__":  # (as a script: the repository on the import path)
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import common

RECIPES = {
  "demo": "train/configs/digits_demo.py",
  "lm": "train/configs/shakespeare_lm.py",
}
# Each variant's options on top of the recipe's (``--config.NAME=VALUE``).
VARIANTS: dict[str, dict[str, Any]] = {
  "adaptive": {},
  "before": {"shapes_per_step": 1, "steps_per_compile": 4.0},
  "fixed": {"controller": "fixed"},
}
CACHES = ("cold", "warm")
# What a run records, read from its summary.json.
SUMMARY_FIELDS = (
  "compiles",
  "compile_cache_hits",
  "compile_seconds",
  "compile_wait_seconds",
  "compile_fallback_steps",
  "padding_fraction",
  "seconds",
  "setup_seconds",
  "steps",
  "average_batch_size",
  "eval_accuracy",
  "eval_loss",
)

# What a run's record adds to its summary's (:func:`_read_run`).
DERIVED_FIELDS = (
  "programs_compiled",
  "waited_fraction",
  "first_step_wait_seconds",
  "later_wait_seconds",
)


def run_command(
  recipe: str, variant: str, seed: int, workdir: str, cache_dir: str, args: argparse.Namespace
) -> list[str]:
  """The ``python -m train`` command of one run."""
  options: dict[str, Any] = {
    "seed": seed,
    "platform": args.device,
    "progress": False,
    "plot": False,
    "tensorboard": False,
    "compilation_cache_dir": cache_dir,
    **VARIANTS[variant],
    **args.set,
  }
  if args.steps is not None:
    options["num_steps"] = args.steps
  flags = [f"--config.{name}={value}" for name, value in options.items()]
  return [sys.executable, "-m", "train", "--config", RECIPES[recipe], "--workdir", workdir, *flags]


def run_group(
  recipe: str, variants: list[str], seed: int, cache: str, root: str, args: argparse.Namespace
) -> list[dict[str, Any]]:
  """The runs of ``variants`` for one seed and cache, each in a new process and a new workdir:
  one after the other, or with ``--parallel`` side by side (a machine loaded by others then
  loads them alike); their records (``failed`` when a run did not finish), each with the
  machine's load average (1 minute) before and after the group."""
  running = []
  load_before = os.getloadavg()[0]
  for variant in variants:
    workdir = os.path.join(root, f"{recipe}-{variant}-{seed}-{cache}")
    cache_dir = os.path.join(root, f"cache-{recipe}-{variant}-{seed}")  # shared by cold and warm
    process = subprocess.Popen(
      run_command(recipe, variant, seed, workdir, cache_dir, args),
      cwd=common.REPOSITORY_ROOT,
      env=common.child_environment(),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    record = {"recipe": recipe, "variant": variant, "seed": seed, "cache": cache}
    running.append((record, workdir, process, _Output(process, args.timeout)))
    if not args.parallel:
      running[-1][3].wait()
  records = [
    _read_run(record, workdir, process, output.wait())
    for record, workdir, process, output in running
  ]
  load = [round(load_before, 1), round(os.getloadavg()[0], 1)]
  return [{**record, "load_average": load} for record in records]


class _Output:
  """A run's output, read while it runs (so that a full pipe never blocks it) and once waited for."""

  def __init__(self, process: subprocess.Popen, timeout: float):
    self._process, self._timeout, self._text = process, timeout, None

  def wait(self) -> str:
    """The run's output, once it has finished (killed after the timeout)."""
    if self._text is None:
      try:
        self._text, _ = self._process.communicate(timeout=self._timeout)
      except subprocess.TimeoutExpired:
        self._process.kill()
        self._text, _ = self._process.communicate()
    return self._text or ""


def _read_run(
  record: dict[str, Any], workdir: str, process: subprocess.Popen, output: str
) -> dict[str, Any]:
  """``record`` with the run's summary, or ``failed`` and the end of its output."""
  summary_path = os.path.join(workdir, "summary.json")
  if process.returncode != 0 or not os.path.exists(summary_path):
    record["failed"] = output[-2000:]
    return record
  with open(summary_path) as f:
    summary = json.load(f)
  record.update({field: summary.get(field) for field in SUMMARY_FIELDS})
  record["programs_compiled"] = summary["compiles"] - summary.get("compile_cache_hits", 0)
  record.update(_waits(workdir, summary))
  return record


def _waits(workdir: str, summary: dict[str, Any]) -> dict[str, float]:
  """The seconds waited as a share of the runtime, and split: the first step's wait (for its own
  program, as every jit loop's first call waits for its program) and the later steps' (read from
  the first step's record in ``metrics.jsonl``)."""
  waited, seconds = summary["compile_wait_seconds"], summary["seconds"]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    first = json.loads(f.readline())
  first_wait = first["compile_wait_step_seconds"]
  return {
    "waited_fraction": waited / seconds,
    "first_step_wait_seconds": first_wait,
    "later_wait_seconds": max(0.0, waited - first_wait),
  }


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Per recipe, variant and cache: each measure's mean, min and max over the seeds, and the
  seconds waited against the fixed batch's (the mean of the seeds' paired ratios)."""
  rows = []
  done = [run for run in runs if "failed" not in run]
  keys = sorted({(r["recipe"], r["variant"], r["cache"]) for r in done}, key=_order)
  for recipe, variant, cache in keys:
    group = [r for r in done if (r["recipe"], r["variant"], r["cache"]) == (recipe, variant, cache)]
    row: dict[str, Any] = {"recipe": recipe, "variant": variant, "cache": cache, "runs": len(group)}
    for field in (*SUMMARY_FIELDS, *DERIVED_FIELDS):
      values = [r[field] for r in group if r.get(field) is not None]
      if values:
        row[field] = {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
    row["waited_over_fixed"] = _paired_wait_ratio(group, done)
    rows.append(row)
  return rows


def _order(key: tuple[str, str, str]) -> tuple[int, int, int]:
  recipe, variant, cache = key
  return (list(RECIPES).index(recipe), CACHES.index(cache), list(VARIANTS).index(variant))


def _paired_wait_ratio(group: list[dict[str, Any]], runs: list[dict[str, Any]]) -> float | None:
  """The group's seconds waited over the fixed batch's in the same seed and cache, averaged."""
  ratios = []
  for run in group:
    fixed = [
      r
      for r in runs
      if r["variant"] == "fixed"
      and (r["recipe"], r["seed"], r["cache"]) == (run["recipe"], run["seed"], run["cache"])
    ]
    if fixed and fixed[0]["compile_wait_seconds"] > 0:
      ratios.append(run["compile_wait_seconds"] / fixed[0]["compile_wait_seconds"])
  return statistics.fmean(ratios) if ratios else None


def _spread(row: dict[str, Any], field: str, fmt: str, scale: float = 1.0) -> str:
  """``mean (min-max)`` of a summarized field, or ``-``."""
  value = row.get(field)
  if value is None:
    return "-"
  mean, low, high = (scale * value[k] for k in ("mean", "min", "max"))
  if row["runs"] == 1 or low == high:
    return format(mean, fmt)
  return f"{mean:{fmt}} ({low:{fmt}}-{high:{fmt}})"


def _percent(row: dict[str, Any], field: str) -> str:
  """A summarized fraction's ``mean (min-max)`` in percent, or ``-``."""
  return "-" if row.get(field) is None else _spread(row, field, ".1f", 100.0) + "%"


def markdown(result: dict[str, Any]) -> str:
  """docs/results.md's table of a result: one row per recipe, cache and variant."""
  lines = [
    "| recipe | cache | variant | programs compiled (loaded) | compile s | waited s | waited x fixed"
    " | waited, share of runtime | of it step 1 s | after step 1 s | set-up s | runtime s | padding"
    " | accuracy | loss |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for row in result["summary"]:
    ratio = row.get("waited_over_fixed")
    loaded = _spread(row, "compile_cache_hits", ".0f") if row.get("compile_cache_hits") else "0"
    lines.append(
      "| "
      + " | ".join(
        [
          row["recipe"],
          row["cache"],
          row["variant"],
          f"{_spread(row, 'programs_compiled', '.0f')} ({loaded})",
          _spread(row, "compile_seconds", ".1f"),
          _spread(row, "compile_wait_seconds", ".1f"),
          "-" if ratio is None else f"{ratio:.2f}",
          _percent(row, "waited_fraction"),
          _spread(row, "first_step_wait_seconds", ".1f"),
          _spread(row, "later_wait_seconds", ".1f"),
          _spread(row, "setup_seconds", ".1f"),
          _spread(row, "seconds", ".1f"),
          _percent(row, "padding_fraction"),
          _spread(row, "eval_accuracy", ".4f"),
          _spread(row, "eval_loss", ".4f"),
        ]
      )
      + " |"
    )
  return "\n".join(lines)


def _status(record: dict[str, Any]) -> str:
  """A run's line in the progress printed."""
  if "failed" in record:
    return "FAILED"
  return (
    f"{record['programs_compiled']} compiled, {record['compile_seconds']:.1f} s compiling, "
    f"{record['compile_wait_seconds']:.1f} s waited ({record['first_step_wait_seconds']:.1f} s "
    f"at step 1), {record['seconds']:.1f} s"
  )


def _write(path: str, result: dict[str, Any]) -> None:
  if path:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
      json.dump(result, f, indent=2)
      f.write("\n")
    os.replace(path + ".tmp", path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--recipes", default=",".join(RECIPES), help=f"comma-separated, of {sorted(RECIPES)}"
  )
  parser.add_argument(
    "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {sorted(VARIANTS)}"
  )
  parser.add_argument("--caches", default=",".join(CACHES), help="cold, warm or both")
  parser.add_argument("--seeds", type=int, default=2, help="paired seeds 0, 1, ...")
  parser.add_argument(
    "--steps", type=int, default=None, help="stop each run after this step (a reduced run)"
  )
  parser.add_argument(
    "--device",
    choices=("auto", "cpu", "gpu"),
    default="auto",
    help="auto: the accelerators when there are any, else 8 simulated CPU devices",
  )
  parser.add_argument("--timeout", type=float, default=3600.0, help="seconds a run may take")
  parser.add_argument(
    "--parallel",
    action="store_true",
    help="run the variants of a seed and cache side by side (a machine loaded by others loads "
    "them alike), not one after the other",
  )
  parser.add_argument(
    "--workdir", default=None, help="where the runs go (default: a temporary dir)"
  )
  parser.add_argument(
    "--set",
    metavar="NAME=VALUE",
    action="append",
    default=[],
    help="one more training-script setting for every run, after its variant's (repeatable), "
    "e.g. steps_per_compile=256",
  )
  parser.add_argument(
    "--markdown", metavar="JSON", default=None, help="print the docs table of a result and exit"
  )
  common.add_out_flag(parser, "cold_start", quick=False)
  args = parser.parse_args(argv)
  settings = {}
  for text in args.set:
    name, equals, value = text.partition("=")
    if not (name and equals and value):
      parser.error(f"--set {text!r}: give NAME=VALUE, a training-script setting and its value")
    settings[name] = value
  args.set = settings
  args.recipes = _names(args.recipes, RECIPES, "--recipes")
  args.variants = _names(args.variants, VARIANTS, "--variants")
  args.caches = _names(args.caches, CACHES, "--caches")
  if args.device == "gpu":
    args.device = "auto"  # the config's platform: the accelerators
  return args


def _names(text: str, valid: Any, flag: str) -> list[str]:
  names = [name for name in text.split(",") if name]
  unknown = [name for name in names if name not in valid]
  if unknown or not names:
    raise SystemExit(f"{flag}={text!r}: choose from {sorted(valid)}")
  return names


def main(argv: list[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark; returns (and writes) the result."""
  args = parse_args(argv)
  if args.markdown:
    with open(args.markdown) as f:
      print(markdown(json.load(f)))
    return {}
  out = common.out_path(args.out, "cold_start")
  result: dict[str, Any] = {
    "settings": {
      "recipes": {name: RECIPES[name] for name in args.recipes},
      "variants": {name: VARIANTS[name] for name in args.variants},
      "set": args.set,
      "seeds": args.seeds,
      "steps": args.steps,
      "device": args.device,
      "host_cpus": os.cpu_count(),
    },
    "runs": [],
    "summary": [],
  }
  root = args.workdir or tempfile.mkdtemp(prefix="cold_start-")
  for recipe in args.recipes:
    for seed in range(args.seeds):
      shift = seed % len(args.variants)
      order = args.variants[shift:] + args.variants[:shift]  # the load falls on each alike
      for cache in args.caches:
        for record in run_group(recipe, order, seed, cache, root, args):
          result["runs"].append(record)
          result["summary"] = summarize(result["runs"])
          _write(out, result)
          print(f"{recipe} {record['variant']} seed {seed} {cache}: {_status(record)}", flush=True)
  print(markdown(result))
  return result


if __name__ == "__main__":
  main()
