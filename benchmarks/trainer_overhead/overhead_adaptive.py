"""Benchmark: the adaptive Trainer against the same Trainer fixed at the adaptive run's average batch.

What adapting the batch costs per example, on all local devices (by default
8 simulated CPU devices), side by side in one process:

* ``adaptive``: :class:`simigrad_jax.Trainer` with SimiGrad's
  :class:`simigrad_jax.Controller` from ``--batch-size`` (default 256) within
  [batch / 4, 4 x batch] at ``--similarity-target``, on the Trainer's default
  shape grid (``--shapes-per-octave`` to set one);
* ``fixed``: the same Trainer, model, data and settings, its batch held at
  the adaptive run's average batch size, rounded to a multiple of the
  devices, its ``max_micro_batch_size`` that size / devices: one shape and no
  padding, as a user holding the batch would set it. The average is that
  of the timed steps in an untimed adaptive run first (the adaptive run's
  sizes are the same in every run of its settings);
* ``adaptive_late``: the adaptive Trainer with its controller in
  :class:`simigrad_jax.controllers.OneStepLateController` (each size
  decided a step ahead, so one plan is placed a step); its sizes are its
  own, a step late, so its average batch differs a little;
* ``replay`` and ``replay_late``: the same Trainer replaying the batch sizes
  of ``adaptive`` and of ``adaptive_late`` (:func:`simigrad_jax.
  replay_controller` of an untimed run's records): the same steps, shapes
  and padding, but each size known before the step ahead of it ends, as a
  schedule's is. An online variant against its replay is what deciding the
  size online costs; a replay against ``fixed`` is what its sizes cost;
* ``adaptive_s<S>`` (``--also-shapes-per-octave S ...``): the adaptive
  Trainer on a grid of ``S`` shapes per octave; 1 is the grid of halvings,
  the grid before finer ones;
* ``curve_<B>`` (``--step-curve B ...``): the Trainer fixed at batch ``B``
  (one shape, no padding). Their mean step times (the mean, as the
  measured side is a sum: a step slowed by an epoch-end save counts on
  both), interpolated in the rows a step computes, predict what the
  adaptive run's steps would take if adapting cost nothing beyond the
  rows: ``breakdown`` (of every variant but the curve's; the top level's
  is ``adaptive``'s) splits the run's step seconds against the fixed
  one's into ``padding`` (its padded rows), ``trajectory`` (its batch sizes
  against their average: a step's time is not proportional to its rows),
  ``first_runs`` (what the steps that ran a program for the first time in
  their Trainer took beyond the curve: a one-off per shape, which the
  persistent compilation cache does not keep) and ``adapting`` (measured
  against predicted, first runs set aside: what moving the batch costs
  beyond all three). The fixed run's own ``adapting`` is the control: how
  far a run that holds its batch strays from the curve.

The adaptive Trainers' memory bound, ``max_micro_batch_size``, is the
upper bound / devices (``--max-micro-batch-size`` to set it), so a step runs
one micro-batch unless that is set lower. Compiles are not timed: every
variant is built and warmed up (``--warmup-steps``), and waits until every
shape its bounds can reach is compiled; ``--compilation-cache`` (default: a
fresh folder) is JAX's persistent cache, so a second run loads them.

Timing: ``--rounds`` rounds time each variant over ``--steps`` optimizer
steps, the order rotating each round, as in ``benchmarks/trainer_overhead/overhead.py``
(:func:`benchmarks.trainer_overhead.overhead.time_rounds`); a window is one
``trainer.train(num_steps=...)`` call up to its end-of-run checkpoint save.
Reported per variant: ``ratio_to_fixed_run``, the examples/s of all its
timed windows together (their examples over their seconds) against the
fixed run's; the median examples/s, ``ratio_to_fixed`` (the medians'
ratio), ``ratio_to_fixed_paired`` (the median of the rounds' ratios) and its
range (lowest and highest round); ``ratio_to_fixed_without_first_runs``,
the examples/s of the step records without the steps that ran a program
for the first time (the fixed run's one shape ran in its warm-up) against
the fixed run's. The adaptive run's rounds are successive
stretches of its trajectory, each at other batch sizes, so a round's ratio
mixes where the run is with what adapting costs; the whole run's ratio is
the one the goal takes. From the timed steps' records the average batch size, the share of the rows computed that were
padding (``padding_fraction``), the median host critical path
(``host_seconds``), the average micro-steps, and the compiles and shapes;
from the process's thread clocks (Linux), the CPU seconds a timed step used
(``cpu_seconds_per_step``) in Python threads (the host's work: the main,
data and compile threads) and in the rest (XLA's: on CPU, the simulated
devices' compute), which share this machine's cores.
Goals, printed as PASS/FAIL: ``adaptive`` at least 0.95x ``fixed`` over the
whole run (``ratio_to_fixed_run``) and without its first runs
(``ratio_to_fixed_without_first_runs``), padding at most 5% and a host
critical path at most 1 ms; and ``warm_start``: new Trainers on the cache
the untimed runs left warm, timed from their first step
(``--warm-start-steps``, 120, in ``--warm-start-rounds`` rounds, adaptive and
fixed in turns): the adaptive one's steps on a fallback shape (at most 5),
its compile wait, and its examples/s against the fixed one's.

NOTE: CPU timings are noisy (other processes; the simulated devices share
the host's cores, so host work costs the devices time). Compare ratios
within one run, and runs with each other.

Usage::

  python benchmarks/trainer_overhead/overhead_adaptive.py --also-shapes-per-octave 8 1 --out /tmp/adaptive.json
  python benchmarks/trainer_overhead/overhead_adaptive.py --quick    # tiny, for tests

The JSON goes to ``benchmarks/results/overhead_adaptive.json``
(``overhead_adaptive_quick.json`` with ``--quick``) unless ``--out`` says
otherwise (``--out ''``: none).
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
import pathlib  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import simigrad_jax  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.trainer_overhead.overhead import time_rounds  # noqa: E402
from benchmarks.trainer_overhead.overhead_loops import FULL_MODELS  # noqa: E402
from benchmarks.trainer_overhead.overhead_loops import QUICK_MODELS  # noqa: E402
from benchmarks.trainer_overhead.overhead_loops import WAIT_FOR_SHAPES  # noqa: E402
from benchmarks.trainer_overhead.overhead_loops import TrainerLoop  # noqa: E402
from benchmarks.trainer_overhead.overhead_loops import make_data  # noqa: E402
from benchmarks.trainer_overhead.overhead_loops import trainer_controller  # noqa: E402
from simigrad_jax.compile import persistent_cache_settings  # noqa: E402
from simigrad_jax.controllers import OneStepLateController  # noqa: E402
from simigrad_jax.ramps import replay_controller  # noqa: E402

FULL = {
  "batch_size": 256,
  "steps": 30,
  "rounds": 5,
  "warmup_steps": 5,
  "warm_start_steps": 120,
  "warm_start_rounds": 3,
}
QUICK = {
  "batch_size": 32,
  "steps": 3,
  "rounds": 2,
  "warmup_steps": 2,
  "warm_start_steps": 6,
  "warm_start_rounds": 1,
}
GOALS = {
  "ratio_to_fixed_run": 0.95,
  "ratio_to_fixed_without_first_runs": 0.95,
  "padding_fraction": 0.05,
  "host_seconds": 0.001,
  "warm_start_fallback_steps": 5,
}


def _trainer_report(loop: TrainerLoop) -> dict[str, Any]:
  """The timed steps' numbers, the compiles and the shapes of one Trainer."""
  stats = loop.trainer.compile_stats()
  return {
    **loop.details(),
    "compiles": stats["compiles"],
    "shapes": len(loop.trainer.shapes),
    "shapes_per_octave": loop.trainer.layout.policy.shapes_per_octave,
  }


def run(args: argparse.Namespace, root: pathlib.Path, cache: str) -> dict[str, Any]:
  """Builds, warms up and times the variants; returns their results."""
  spec = (QUICK_MODELS if args.quick else FULL_MODELS)[args.model]
  n = jax.device_count()
  upper = 4 * args.batch_size
  for size in args.step_curve:
    if size < n or size % n:
      raise ValueError(f"--step-curve sizes must be multiples of the {n} devices, got {size}")
  max_micro = args.max_micro_batch_size or upper // n
  # Enough examples that an epoch holds many steps of the largest batch.
  data = make_data(spec, 50 * upper)
  # Every variant's steps wait for their shapes (the loops' compile settings), compiled into
  # the one cache; the adaptive variants' grid has --shapes-per-octave shapes an octave.
  shared = WAIT_FOR_SHAPES.replace(cache_dir=cache)
  grid = (
    shared
    if args.shapes_per_octave is None
    else shared.replace(shapes_per_octave=args.shapes_per_octave)
  )
  loops: dict[str, TrainerLoop] = {}

  def build(name: str, batch_size: int, adaptive: bool, **more: Any) -> TrainerLoop:
    workdir = pathlib.Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
    settings = {"max_micro_batch_size": max_micro, "compile": shared, **more}
    loop = TrainerLoop(
      spec, data, batch_size, adaptive, args.similarity_target, workdir, **settings
    )
    loops[name] = loop
    loop.warm_up(args.warmup_steps)
    return loop

  def online(late: bool) -> Any:
    """SimiGrad's controller of the adaptive variants, one step late or not."""
    controller = trainer_controller(args.batch_size, True, args.similarity_target)
    return OneStepLateController(controller) if late else controller

  def probe(late: bool) -> list[dict[str, Any]]:
    """The step records of an untimed run of as many steps as the timed windows (an online
    variant's sizes are the same in every run of its settings)."""
    loop = build("probe", args.batch_size, True, controller=online(late), compile=grid)
    loop.run(args.rounds * args.steps)
    loop.close()
    del loops["probe"]
    return [
      r for r in simigrad_jax.read_metrics(loop.workdir / "metrics.jsonl") if "batch_size" in r
    ]

  try:
    probed = {late: probe(late) for late in (False, True)}
    # The adaptive run's average batch over the timed windows (those after the warm-up), the
    # one to hold.
    timed = probed[False][args.warmup_steps :]
    average = sum(r["batch_size"] for r in timed) / len(timed)
    fixed_batch = max(n, round(average / n) * n)  # as a user fixing it would: no padding
    print(f"  the adaptive run's average batch: {average:.1f}; fixed at {fixed_batch}", flush=True)
    bounds = {
      key: online(False).config[key] for key in ("batch_size_lower_bound", "batch_size_upper_bound")
    }
    warm_start = _warm_start(args, spec, data, root, max_micro, shared, grid, fixed_batch)
    build("adaptive", args.batch_size, True, controller=online(False), compile=grid)
    build("fixed", fixed_batch, False, max_micro_batch_size=fixed_batch // n)
    build("adaptive_late", args.batch_size, True, controller=online(True), compile=grid)
    for name, late in (("replay", False), ("replay_late", True)):
      replay = replay_controller(probed[late], **bounds)
      build(name, args.batch_size, True, controller=replay, compile=grid)
    for per_octave in args.also_shapes_per_octave:
      per_octave_grid = shared.replace(shapes_per_octave=per_octave)
      build(f"adaptive_s{per_octave}", args.batch_size, True, compile=per_octave_grid)
    for size in args.step_curve:
      build(f"curve_{size}", size, False, max_micro_batch_size=size // n)
    windows = {name: _Windows(loop) for name, loop in loops.items()}
    rates = time_rounds(windows, args.steps, args.rounds)
    reports = {name: _trainer_report(loop) for name, loop in loops.items()}
    curve = {size: loops[f"curve_{size}"].timed_records() for size in args.step_curve}
    # Every variant whose batch moves, split against the same curve, and the fixed run as
    # the control.
    split = [name for name in loops if not name.startswith("curve_")]
    breakdowns = (
      {name: _breakdown(loops[name].timed_records(), curve) for name in split}
      if len(curve) >= 2
      else {}
    )
  finally:
    for loop in loops.values():
      loop.close()
  fixed = statistics.median(rates["fixed"])
  fixed_run = windows["fixed"].examples_per_second()
  fixed_steady = reports["fixed"]["examples_per_second_without_first_runs"]
  variants = {}
  for name, report in reports.items():
    paired = [a / b for a, b in zip(rates[name], rates["fixed"])]
    variants[name] = {
      "examples_per_second_run": windows[name].examples_per_second(),
      "ratio_to_fixed_run": windows[name].examples_per_second() / fixed_run,
      "ratio_to_fixed_without_first_runs": (
        None
        if report["examples_per_second_without_first_runs"] is None or fixed_steady is None
        else report["examples_per_second_without_first_runs"] / fixed_steady
      ),
      "examples_per_second": statistics.median(rates[name]),
      "ratio_to_fixed": statistics.median(rates[name]) / fixed,
      "ratio_to_fixed_paired": statistics.median(paired),
      "ratio_to_fixed_paired_range": [min(paired), max(paired)],
      "examples_per_second_rounds": rates[name],
      "breakdown": breakdowns.get(name),
      **report,
    }
  return {
    "model": spec.description,
    "devices": n,
    "initial_batch_size": args.batch_size,
    "adaptive_average_batch_size": average,
    "fixed_batch_size": fixed_batch,
    "max_micro_batch_size": max_micro,
    "steps": args.steps,
    "rounds": args.rounds,
    "variants": variants,
    "breakdown": breakdowns.get("adaptive"),
    # What deciding each size online costs: the same sizes, each known ahead.
    "adaptive_to_replay_run": variants["adaptive"]["examples_per_second_run"]
    / variants["replay"]["examples_per_second_run"],
    "adaptive_late_to_replay_late_run": variants["adaptive_late"]["examples_per_second_run"]
    / variants["replay_late"]["examples_per_second_run"],
    "warm_start": warm_start,
    "goals": _goals(variants["adaptive"], warm_start),
  }


def _warm_start(
  args: argparse.Namespace,
  spec: Any,
  data: dict[str, np.ndarray],
  root: pathlib.Path,
  max_micro: int,
  shared: simigrad_jax.CompileConfig,
  grid: simigrad_jax.CompileConfig,
  fixed_batch: int,
) -> dict[str, Any]:
  """New Trainers on the cache the probes left warm, timed from their first step.

  Each round builds a new adaptive Trainer and a new one fixed at
  ``fixed_batch`` (in turns, the first alternating) and trains each
  ``--warm-start-steps`` steps, the first step and its compile wait
  included, with the Trainer's default compile schedule (the other sections'
  loops wait for every shape instead): the adaptive one's steps on a
  fallback shape (the summary's
  ``compile_fallback_steps``), its seconds waiting for compiles, and its
  examples/s against the fixed one's (the median of the rounds' ratios).

  The adaptive Trainer has ``max_micro`` rows per device and the ``grid``'s
  shapes, the fixed one ``fixed_batch`` and ``shared``'s; both compile into
  the ``shared`` cache.
  """
  n = jax.device_count()
  rounds: list[dict[str, Any]] = []
  for index in range(args.warm_start_rounds):
    order = [("adaptive", True), ("fixed", False)]
    measured: dict[str, Any] = {}
    for name, adaptive in order if index % 2 == 0 else order[::-1]:
      workdir = pathlib.Path(tempfile.mkdtemp(prefix=f"warm-{name}-", dir=root))
      batch, max_micro_batch_size, compile_settings = (
        (args.batch_size, max_micro, grid) if adaptive else (fixed_batch, fixed_batch // n, shared)
      )
      loop = TrainerLoop(
        spec,
        data,
        batch,
        adaptive,
        args.similarity_target,
        workdir,
        max_micro_batch_size=max_micro_batch_size,
        # The Trainer's default: its compile schedule.
        compile=compile_settings.replace(fallback=True),
      )
      try:
        examples, seconds = loop.run(args.warm_start_steps)
        summary = loop.trainer.compile_stats()
        records = [
          r for r in simigrad_jax.read_metrics(workdir / "metrics.jsonl") if "batch_size" in r
        ]
      finally:
        loop.close()
      measured[name] = {
        "examples_per_second": examples / seconds,
        "fallback_steps": sum(bool(r["compile_fallback"]) for r in records),
        "compile_wait_seconds": summary["compile_wait_seconds"],
        "compile_cache_hits": summary["compile_cache_hits"],
        "compiles": summary["compiles"],
      }
    rounds.append(measured)
  ratios = [
    r["adaptive"]["examples_per_second"] / r["fixed"]["examples_per_second"] for r in rounds
  ]
  return {
    "steps": args.warm_start_steps,
    "fixed_batch_size": fixed_batch,
    "fallback_steps": max(r["adaptive"]["fallback_steps"] for r in rounds),
    "compile_wait_seconds": statistics.median(
      r["adaptive"]["compile_wait_seconds"] for r in rounds
    ),
    "ratio_to_fixed_paired": statistics.median(ratios),
    "ratio_to_fixed_paired_range": [min(ratios), max(ratios)],
    "rounds": rounds,
  }


class _Windows:
  """A variant's loop that keeps each timed window's examples and seconds."""

  def __init__(self, loop: TrainerLoop) -> None:
    self.loop = loop
    self.examples = 0
    self.seconds = 0.0

  def run(self, steps: int) -> tuple[int, float]:
    examples, seconds = self.loop.run(steps)
    self.examples += examples
    self.seconds += seconds
    return examples, seconds

  def examples_per_second(self) -> float:
    """All the windows' examples over their seconds."""
    return self.examples / self.seconds


def _breakdown(
  steps: list[dict[str, Any]], curve: dict[int, list[dict[str, Any]]]
) -> dict[str, Any]:
  """A run's step seconds against those the curve's step times predict for them."""
  sizes = sorted(curve)
  seconds = [statistics.fmean(r["step_seconds"] for r in curve[size]) for size in sizes]
  predict = lambda rows: float(np.interp(rows, sizes, seconds))
  rows = [r["batch_size"] + r["padded_examples"] for r in steps]
  predicted = [predict(n) for n in rows]  # each step's, for the rows it computed
  measured = sum(r["step_seconds"] for r in steps)
  computed = sum(predicted)
  # What the steps that ran a program for the first time took beyond the curve's prediction.
  first_runs = [(r, p) for r, p in zip(steps, predicted, strict=True) if r["first_run"]]
  first_run_excess = sum(r["step_seconds"] - p for r, p in first_runs)
  unpadded = sum(predict(r["batch_size"]) for r in steps)
  average = sum(r["batch_size"] for r in steps) / len(steps)
  held = len(steps) * predict(average)
  return {
    "curve_step_seconds": dict(zip(map(str, sizes), seconds)),
    "measured_seconds": measured,
    "predicted_seconds": computed,
    "held_at_average_predicted_seconds": held,
    "first_run_steps": len(first_runs),
    "first_run_excess_seconds": first_run_excess,
    # Each a factor on the step seconds; their product is measured / held.
    "padding": computed / unpadded,
    "trajectory": unpadded / held,
    "first_runs": measured / (measured - first_run_excess),
    "adapting": (measured - first_run_excess) / computed,
    "outside_curve_steps": sum(not sizes[0] <= n <= sizes[-1] for n in rows),
  }


def _goals(adaptive: dict[str, Any], warm_start: dict[str, Any]) -> dict[str, dict[str, Any]]:
  goals = {}
  for key, bound in GOALS.items():
    value = warm_start["fallback_steps"] if key == "warm_start_fallback_steps" else adaptive[key]
    passed = value is not None and (value >= bound if key.startswith("ratio") else value <= bound)
    goals[key] = {"bound": bound, "value": value, "pass": passed}
  return goals


def _format_table(results: dict[str, Any]) -> str:
  lines = [
    f"{results['model']} on {results['devices']} devices: adaptive from "
    f"{results['initial_batch_size']} against fixed at {results['fixed_batch_size']} "
    f"(max_micro_batch_size {results['max_micro_batch_size']}), {results['rounds']} rounds "
    f"of {results['steps']} steps",
    f"  {'variant':17s} {'run x fixed':>11s} {'examples/s':>10s} {'x fixed':>7s} "
    f"{'paired (range)':>20s} "
    f"{'avg batch':>9s} {'padding':>7s} {'host ms':>7s} {'micro':>5s} {'shapes':>6s}",
  ]
  for name, v in results["variants"].items():
    low, high = v["ratio_to_fixed_paired_range"]
    host = "-" if v["host_seconds"] is None else f"{v['host_seconds'] * 1e3:.2f}"
    lines.append(
      f"  {name:17s} {v['ratio_to_fixed_run']:11.3f} {v['examples_per_second']:10,.0f} "
      f"{v['ratio_to_fixed']:7.3f} "
      f"{v['ratio_to_fixed_paired']:7.3f} ({low:.3f}-{high:.3f}) "
      f"{v['average_batch_size']:9.1f} {v['padding_fraction']:7.1%} {host:>7s} "
      f"{v['average_accumulation_steps']:5.2f} {v['shapes']:6d}"
    )
  steady = ", ".join(
    f"{name} {v['ratio_to_fixed_without_first_runs']:.3f}"
    for name, v in results["variants"].items()
    if not name.startswith("curve_") and v["ratio_to_fixed_without_first_runs"] is not None
  )
  lines.append(
    f"  x fixed without the steps that ran a program for the first time (step records): {steady}"
  )
  cpu = ", ".join(
    f"{name} {v['cpu_seconds_per_step']['python_threads'] * 1e3:.1f} + "
    f"{v['cpu_seconds_per_step']['other_threads'] * 1e3:.1f} "
    f"({v['cpu_seconds_per_step']['other_threads'] * v['timed_steps'] / v['rows_computed'] * 1e6:.0f})"
    for name, v in results["variants"].items()
  )
  lines.append(f"  CPU ms a step, Python threads + XLA's (XLA's per 1,000 rows computed): {cpu}")
  lines.append(
    f"  online / replay of its sizes (each known a step ahead), whole runs: adaptive "
    f"{results['adaptive_to_replay_run']:.3f}, adaptive_late "
    f"{results['adaptive_late_to_replay_late_run']:.3f}"
  )
  breakdown = results["breakdown"]
  if breakdown is not None:
    curve = ", ".join(
      f"{size}: {seconds * 1e3:.1f} ms" for size, seconds in breakdown["curve_step_seconds"].items()
    )
    lines.append(f"  fixed mean step time by batch: {curve}")
    lines.append(
      "  step seconds / held at the average batch = padding x trajectory x first runs x adapting:"
    )
  for name, v in results["variants"].items():
    split = v["breakdown"]
    if split is not None:
      lines.append(
        f"    {name:15s} "
        f"{split['measured_seconds'] / split['held_at_average_predicted_seconds']:.3f}"
        f" = {split['padding']:.3f} x {split['trajectory']:.3f} x {split['first_runs']:.3f}"
        f" x {split['adapting']:.3f} ({split['first_run_steps']} first runs,"
        f" {split['first_run_excess_seconds'] * 1e3:.0f} ms above the curve;"
        f" {split['outside_curve_steps']} steps outside the curve's sizes)"
      )
  warm = results["warm_start"]
  lines.append(
    f"  warm start, a new Trainer timed from step 1 over {warm['steps']} steps:"
    f" {warm['fallback_steps']} fallback steps, {warm['compile_wait_seconds']:.2f} s compile wait,"
    f" {warm['ratio_to_fixed_paired']:.3f}x the fixed Trainer's examples/s"
  )
  for key, goal in results["goals"].items():
    value = "-" if goal["value"] is None else f"{goal['value']:.4g}"
    lines.append(
      f"  goal {key} {'>=' if key.startswith('ratio') else '<='} {goal['bound']}: "
      f"{value} {'PASS' if goal['pass'] else 'FAIL'}"
    )
  return "\n".join(lines)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", choices=tuple(FULL_MODELS), default="mlp")
  parser.add_argument("--quick", action="store_true", help=f"tiny, for tests: {QUICK}")
  parser.add_argument("--batch-size", type=int, default=None, help="the initial batch size")
  parser.add_argument("--steps", type=int, default=None, help="optimizer steps per window")
  parser.add_argument("--rounds", type=int, default=None, help="timed rounds")
  parser.add_argument("--warmup-steps", type=int, default=None, help="untimed steps first")
  parser.add_argument("--similarity-target", type=float, default=0.3)
  parser.add_argument("--max-micro-batch-size", type=int, default=None)
  parser.add_argument("--shapes-per-octave", type=int, default=None)
  parser.add_argument(
    "--also-shapes-per-octave",
    type=int,
    nargs="*",
    default=[],
    help="also time the adaptive Trainer on these grids (1: the halvings)",
  )
  parser.add_argument(
    "--step-curve",
    type=int,
    nargs="*",
    default=[],
    help="also time the Trainer fixed at these batch sizes (multiples of the devices; two or "
    "more) and split the adaptive run's cost with their step times",
  )
  parser.add_argument(
    "--warm-start-steps",
    type=int,
    default=None,
    help="steps of each new Trainer on the warm cache, timed from step 1",
  )
  parser.add_argument("--warm-start-rounds", type=int, default=None)
  parser.add_argument("--compilation-cache", default=None, help="JAX's persistent cache folder")
  common.add_out_flag(parser, "overhead_adaptive")
  args = parser.parse_args(argv)
  args.out = common.out_path(args.out, "overhead_adaptive", args.quick)
  common.apply_preset(args, QUICK if args.quick else FULL)
  for key in (
    "batch_size",
    "steps",
    "rounds",
    "warmup_steps",
    "warm_start_steps",
    "warm_start_rounds",
  ):
    if getattr(args, key) < 1:
      raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark; prints the table and returns (and writes) the results."""
  args = _parse_args(argv)
  root = pathlib.Path(tempfile.mkdtemp(prefix="simigrad-overhead-adaptive-"))
  cache = args.compilation_cache or str(root / "compilation_cache")
  try:
    with persistent_cache_settings():
      results = run(args, root, cache)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return common.report(results, _format_table(results), args.out)


if __name__ == "__main__":
  main()
