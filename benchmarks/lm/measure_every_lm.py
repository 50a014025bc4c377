"""Benchmark: SimiGrad measuring the similarity every k-th step, on the causal-LM comparison.

``TrainerConfig.measure_every=k`` runs the two-half step (the similarity's
measurement) on the steps ``0, k, 2k, ...`` only and plain steps between; the
controller decides on the measuring steps and holds its size over the
``k - 1`` plain steps that follow. It reads a measurement in one of two
ways (``--readings``, docs/controllers.md): ``per_measurement``, one move of
its rule per measurement (``steps_per_update=1``, the default), or
``per_step``, the ``k`` moves the measurement stands for
(``steps_per_update=k``: the rule's rate per optimizer step). This script
asks what each costs the LM comparison of ``benchmarks/lm/pareto_lm.py`` in
steps and tokens to losses every ``k = 1`` run reaches, and in final loss,
paired by seed, and what it saves per step.

The protocol:

1. The experiment, the target and the setting are those of a finished
   comparison (``--source``, ``benchmarks/results/pareto_lm.json``: today's
   budget): its ``experiment`` block (model, budget, validation), its
   ``target_val_loss`` (the best constant batch's mean final validation loss)
   and its tuned SimiGrad setting (the SimiGrad setting with the least mean
   final validation loss: its options, learning rate, coupling and token
   allowance).
2. That setting with ``measure_every`` of ``--every`` (1, 4), each
   ``k > 1`` read each way of ``--readings`` (both; a variant: ``k`` and its
   reading; ``k = 1`` has one), and every seed of ``--seeds`` (1-10),
   paired: seed s sees the same data order and initial parameters in every
   variant. The runs go seed by seed (every variant of seed 1, then of
   seed 2, ...), so that the seeds finished when the run stops are paired.
3. Per run, from its validation curve: steps and tokens to the target (and
   to the target plus the verdict's margin, :data:`benchmarks.lm.report.LOSS_MARGIN`,
   which a seed that misses the target by a little still reaches), the final
   validation loss, the average batch size, the measurements taken and the
   wall seconds, its compiles' seconds apart. Its seconds per step: the wall
   seconds without the compiles' over its steps (the validation evaluations,
   the same number in every run, included). The runs train one after
   another on a shared machine: their step costs are compared paired by
   seed, not side by side, and a step's cost against the plain step is
   ``benchmarks/trainer_overhead/measure_every.py``'s to measure. Each run
   also records, per compiled shape, the median over its blocks of ``k``
   steps of a block's seconds per step (:func:`seconds_per_step`); those are
   not compared across ``k``, a median of ``k``-step means being no median
   of single steps where step times are skewed.
4. The loss levels (:func:`loss_levels`): the worst final validation loss
   of the ``k = 1`` runs, the hardest loss every one of them reaches, and
   two easier ones above it (:data:`LEVEL_OFFSETS`). The comparison's
   target (and the target plus the margin) is no such level: the seeds'
   final losses spread wider than the margin, so whether a seed reaches it
   is decided by that noise, and a seed that misses it has no steps to pair.
5. Paired by seed, against ``k = 1`` (:func:`compare`): at each level the
   ratio of mean steps (tokens) to it, each seed's ratio, and the
   bootstrap's 95% interval over seeds
   (:func:`benchmarks.lm.frontier.ratio_interval`); the difference of final
   validation losses with its interval (:func:`difference_interval`); the
   seconds per step's ratio.
6. The goal, "steps within ``k = 1``'s seed spread", as two tests at every
   level (:func:`compare_at`): ``k``'s mean steps lies within ``k = 1``'s
   seeds' least to most, and the paired ratio's interval holds 1.0; a
   ``k`` whose interval lies below 1.0 (fewer steps) meets the goal too.

Resume: each finished run is appended to ``--store``
(``benchmarks/results/lm_measure_every_runs.jsonl`` by default) the moment it
ends; started again with the same flags, the script reads the stored runs
back and trains only the rest. The store is kept (it is the record of the
runs); one written for another experiment or setting is refused.

Usage::

  python benchmarks/lm/measure_every_lm.py    # k = 1 and 4, both readings, seeds 1-10: 30 runs
  python benchmarks/lm/measure_every_lm.py --every 1,2 --seeds 1,2,3,4,5,6,7,8,9,10 \
    --out benchmarks/results/lm_measure_every_k2.json   # k = 2's, the k = 1 runs read back
  python benchmarks/lm/measure_every_lm.py --seeds 1,2 --every 1,4 --readings per_step
  python benchmarks/lm/measure_every_lm.py --markdown benchmarks/results/lm_measure_every.json

JSON (machine-read)::

  {"experiment": {...}, "source": str, "target_val_loss": float, "loss_margin": float,
   "setting": {"label", "controller", "options", "learning_rate", "lr_coupling", ...},
   "seeds": [int] (those finished for every variant), "every": [int],
   "variants": [[k, reading]] (reading "per_measurement" or "per_step"),
   "per_k": [{"measure_every", "reading", "seeds", "reached", "steps_to_target", "tokens_to_target",
              "steps_to_margin", "tokens_to_margin", "final_val_loss", "avg_batch_size",
              "measurements", "steps", "wall_seconds", "seconds_per_step",
              "step_cost_vs_k1": [ratio, lo, hi], ...}],
   "levels": [float] (the losses read), "level_offsets": [float],
   "paired": [{"measure_every", "reading",
               "levels": [{"loss", "k1_steps", "k1_range": [least, most], "steps",
                           "steps_by_seed", "reached", "steps_ratio": [ratio, lo, hi],
                           "steps_ratio_by_seed", "tokens_ratio", "outcome" ("fewer steps",
                           "ties" or "more steps"), "mean_within_k1_range",
                           "ratio_interval_holds_1", "within", "met"}],
               "within_at_every_level": bool, "met_at_every_level": bool,
               "final_val_loss_difference": [mean, lo, hi], "final_loss_interval_holds_0"}],
   "runs": [{...as benchmarks/lm/experiment.py records a run, and "measure_every",
             "reading", "measurements", "seconds_per_step": {rows per device: [seconds, blocks]}}],
   "runs_wall_seconds": float, ...}
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
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
from collections.abc import Mapping, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import simigrad_jax  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.lm import protocol as P  # noqa: E402
from benchmarks.lm.experiment import LmExperiment  # noqa: E402
from benchmarks.lm.experiment import crossing  # noqa: E402
from benchmarks.lm.frontier import outcome  # noqa: E402
from benchmarks.lm.frontier import ratio_interval  # noqa: E402
from benchmarks.lm.report import LOSS_MARGIN  # noqa: E402
from benchmarks.lm.run_store import RunStore  # noqa: E402
from benchmarks.lm.run_store import run_key  # noqa: E402
from benchmarks.pareto.analysis import mean_std  # noqa: E402
from benchmarks.pareto.protocol import RunSpec  # noqa: E402
from benchmarks.pareto.protocol import comparison_folder  # noqa: E402

NAME = "lm_measure_every"
SOURCE = os.path.join(common.RESULTS_DIR, "pareto_lm.json")
SEEDS = tuple(range(1, 11))
EVERY = (1, 4)
# How the controller reads a measurement that stands for k steps (docs/controllers.md):
# "per_measurement", one move of the rule per measurement (steps_per_update=1, the default), or
# "per_step", the rule's rate per optimizer step (steps_per_update=k). k = 1 has one reading.
READINGS = ("per_measurement", "per_step")
# The losses the paired comparison reads steps at, above the k = 1 runs' worst final validation
# loss: that loss itself (the hardest one every k = 1 run reaches) and two easier ones.
LEVEL_OFFSETS = (0.0, 0.05, 0.1)


def read_as(spec: RunSpec, every: int, reading: str) -> RunSpec:
  """``spec`` measuring every ``every``-th step, its controller reading ``reading``.

  Example:
    >>> spec = RunSpec("simigrad", (("similarity_target", 0.1),), 3e-3, 1.0, 1)
    >>> read_as(spec, 4, "per_step").options
    (('similarity_target', 0.1), ('steps_per_update', 4))
    >>> read_as(spec, 1, "per_step") == spec == read_as(spec, 4, "per_measurement")
    True
  """
  if reading == "per_step" and every > 1:
    return dataclasses.replace(spec, options=(*spec.options, ("steps_per_update", every)))
  return spec


def reading_of(run: Mapping[str, Any]) -> str:
  """A run's reading, from its controller's options (runs stored before the readings: per
  measurement)."""
  return "per_step" if run.get("options", {}).get("steps_per_update", 1) > 1 else "per_measurement"


def tuned_setting(source: Mapping[str, Any]) -> tuple[RunSpec, float, str]:
  """The comparison's tuned SimiGrad setting: the one with the least mean final validation loss.

  Args:
    source: a finished ``benchmarks/lm/pareto_lm.py`` result.

  Returns:
    ``(spec, share, label)``: the setting as a run of seed 0, the share of the
    budget it trains (the token allowance) and its label in the source.

  Raises:
    ValueError: the source ran no SimiGrad setting.
  """
  settings = [s for s in source.get("settings", ()) if s["controller"] == "simigrad"]
  if not settings:
    raise ValueError("the source comparison ran no SimiGrad setting; give one that did")
  best = min(settings, key=lambda s: s["final_val_loss"])
  run = next(
    r
    for r in source["runs"]
    if r["controller"] == "simigrad"
    and r["setting"] == best["setting"]
    and math.isclose(r["learning_rate"], best["learning_rate"], rel_tol=1e-9)
  )
  spec = RunSpec(
    "simigrad",
    tuple(run["options"].items()),
    run["learning_rate"],
    run["lr_multiplier"],
    0,
    run.get("lr_rule", "sqrt"),
    run["lr_coupling"],
  )
  return spec, float(run["budget_share"]), best["setting"]


def seconds_per_step(records: Sequence[Mapping[str, Any]], every: int) -> dict[str, list[float]]:
  """A run's seconds per step on each compiled shape: the median over its whole blocks of steps.

  A block is a measuring step and the ``every - 1`` plain steps after it,
  which hold its batch size (the controller moves on measuring steps only).
  A step's own seconds are not its cost: the host reads a step's statistics
  once the next step is dispatched, and only a measuring step's reading
  waits for the similarity, so time moves between the steps of a block. A
  whole block's seconds are its cost: from one measuring step's statistics
  to the next one's. Blocks with a step that ran a program for the first
  time or waited for a compile are left out, and so are blocks whose steps
  ran on two shapes (rows per device).

  Args:
    records: a run's step records (``metrics.jsonl``), in step order.
    every: the run's ``measure_every``.

  Returns:
    ``{rows per device: [median seconds per step, blocks]}`` (the keys as
    strings, as JSON holds them).

  Example:
    >>> steps = [(1, 0.3), (2, 0.1), (3, 0.2), (4, 0.2)]  # (step, seconds), one shape
    >>> seconds_per_step([{"step": s, "step_seconds": t, "micro_batch_size": 1,
    ...   "first_run": False, "compile_wait_step_seconds": 0.0} for s, t in steps], 2)
    {'1': [0.2, 2]}
  """
  blocks: dict[int, list[Mapping[str, Any]]] = {}
  for record in records:
    blocks.setdefault((record["step"] - 1) // every, []).append(record)
  by_shape: dict[str, list[float]] = {}
  for block in blocks.values():
    shapes = {r["micro_batch_size"] for r in block}
    if len(block) < every or len(shapes) > 1:
      continue
    if any(r["first_run"] or r["compile_wait_step_seconds"] > 0 for r in block):
      continue
    seconds = sum(r["step_seconds"] for r in block) / every
    by_shape.setdefault(str(shapes.pop()), []).append(seconds)
  return {
    shape: [round(float(np.median(times)), 6), len(times)]
    for shape, times in sorted(by_shape.items(), key=lambda item: int(item[0]))
  }


def difference_interval(values: Sequence[float], reference: Sequence[float]) -> list[float]:
  """The mean of paired differences ``values - reference`` and its bootstrap interval.

  The seeds are resampled with replacement as
  :func:`benchmarks.lm.frontier.ratio_interval` resamples them (the same
  number of resamples, seed and confidence); with one seed the interval is
  unbounded.

  Returns:
    ``[mean, lo, hi]``.

  Example:
    >>> difference_interval([2.0, 2.0], [1.0, 1.0])
    [1.0, 1.0, 1.0]
  """
  d = np.asarray(values, np.float64) - np.asarray(reference, np.float64)
  if d.size < 2:
    return [float(d.mean()), -math.inf, math.inf]
  rng = np.random.default_rng(P.BOOTSTRAP_SEED)
  means = d[rng.integers(0, d.size, (P.BOOTSTRAP_RESAMPLES, d.size))].mean(1)
  tail = (1.0 - P.CONFIDENCE) / 2
  lo = float(np.quantile(means, tail, method="lower"))
  hi = float(np.quantile(means, 1.0 - tail, method="higher"))
  return [round(float(d.mean()), 6), round(lo, 6), round(hi, 6)]


def _json_number(x: float) -> float | None:
  """JSON's number: None for an unbounded or never-reached value."""
  return round(x, 4) if math.isfinite(x) else None


def _reached(runs: Sequence[Mapping[str, Any]], key: str) -> list[float]:
  """Each run's ``key`` (steps or tokens to a loss), inf where it never reached the loss."""
  return [math.inf if r[key] is None else float(r[key]) for r in runs]


def steps_to_level(run: Mapping[str, Any], loss: float) -> tuple[float, float]:
  """``(steps, tokens)`` where a run's validation curve first reaches ``loss``; inf, inf if never."""
  steps, tokens = crossing([(s, t, v) for s, t, v in run["curve"]], loss)
  return (math.inf, math.inf) if steps is None or tokens is None else (steps, tokens)


def fill_targets(run: dict[str, Any], target: float, margin: float) -> None:
  """Sets a run's steps and tokens to ``target`` and to ``target + margin``, read on its curve."""
  for suffix, loss in (("target", target), ("margin", target + margin)):
    steps, tokens = steps_to_level(run, loss)
    run[f"steps_to_{suffix}"] = round(steps, 1) if math.isfinite(steps) else None
    run[f"tokens_to_{suffix}"] = round(tokens) if math.isfinite(tokens) else None


def _mean_reached(values: Sequence[float]) -> float | None:
  finite = [v for v in values if math.isfinite(v)]
  return round(float(np.mean(finite)), 1) if finite else None


def summarize(
  runs: Sequence[Mapping[str, Any]], reference: Sequence[Mapping[str, Any]], every: int
) -> dict[str, Any]:
  """One ``measure_every``'s runs: reached, steps and tokens to the target, losses, batches, cost.

  Args:
    runs: its runs, one per seed.
    reference: the ``k = 1`` runs of the same seeds, in the same order.
    every: its ``measure_every``.
  """
  loss, loss_std = mean_std([r["final_val_loss"] for r in runs])
  steps = _reached(runs, "steps_to_target")
  return {
    "measure_every": every,
    "seeds": [r["seed"] for r in runs],
    "reached": sum(math.isfinite(s) for s in steps),
    "steps_to_target": _mean_reached(steps),
    "tokens_to_target": _mean_reached(_reached(runs, "tokens_to_target")),
    "steps_to_target_by_seed": [_json_number(s) for s in steps],
    "reached_margin": sum(r["steps_to_margin"] is not None for r in runs),
    "steps_to_margin": _mean_reached(_reached(runs, "steps_to_margin")),
    "tokens_to_margin": _mean_reached(_reached(runs, "tokens_to_margin")),
    "steps_to_margin_by_seed": [_json_number(s) for s in _reached(runs, "steps_to_margin")],
    "final_val_loss": round(loss, 5),
    "final_val_loss_std": round(loss_std, 5),
    "avg_batch_size": round(float(np.mean([r["avg_batch_size"] for r in runs])), 2),
    "measurements": round(float(np.mean([r["measurements"] for r in runs])), 1),
    "steps": round(float(np.mean([r["steps"] for r in runs])), 1),
    "tokens": round(float(np.mean([r["tokens"] for r in runs]))),
    "wall_seconds": round(float(np.mean([r["wall_seconds"] for r in runs])), 1),
    "compile_seconds": round(float(np.mean([r["compile_seconds"] for r in runs])), 1),
    "wall_seconds_without_compiles": round(
      float(np.mean([r["wall_seconds"] - r["compile_seconds"] for r in runs])), 1
    ),
    **_step_costs(runs, reference),
  }


def _seconds_per_step(run: Mapping[str, Any]) -> float:
  """A run's wall seconds per step, its compiles' seconds left out."""
  return (run["wall_seconds"] - run["compile_seconds"]) / run["steps"]


def _step_costs(
  runs: Sequence[Mapping[str, Any]], reference: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
  """Seconds per step (compiles left out), and their ratio to ``k = 1``'s paired by seed."""
  mine = [_seconds_per_step(r) for r in runs]
  theirs = [_seconds_per_step(r) for r in reference]
  return {
    "seconds_per_step": round(float(np.mean(mine)), 5),
    "step_cost_vs_k1": _interval(ratio_interval(mine, theirs)),
    "step_cost_vs_k1_by_seed": [round(m / t, 4) for m, t in zip(mine, theirs, strict=True)],
  }


def _interval(values: tuple[float, float, float]) -> list[float | None]:
  return [_json_number(v) for v in values]


def loss_levels(reference: Sequence[Mapping[str, Any]]) -> list[float]:
  """The losses the comparison reads steps at: ``k = 1``'s worst final loss, and easier ones.

  Every ``k = 1`` run reaches each of them (its final evaluation is at or
  below the worst), so each has a mean over every seed and a paired ratio;
  the easier ones sit :data:`LEVEL_OFFSETS` above it, where the curves fall
  faster and a loss's noise moves its crossing by fewer steps.

  Args:
    reference: the ``k = 1`` runs.

  Example:
    >>> loss_levels([{"final_val_loss": 1.93}, {"final_val_loss": 1.95}])
    [1.95, 2.0, 2.05]
  """
  worst = max(float(r["final_val_loss"]) for r in reference)
  return [round(worst + offset, 6) for offset in LEVEL_OFFSETS]


def compare_at(
  runs: Sequence[Mapping[str, Any]], reference: Sequence[Mapping[str, Any]], loss: float
) -> dict[str, Any]:
  """One ``k``'s steps to ``loss`` against ``k = 1``'s, paired by seed, and the goal's tests.

  "Within ``k = 1``'s seed spread" is read as two tests, each of which can
  fail: ``k``'s mean steps over the seeds lies within ``k = 1``'s least to
  most (``mean_within_k1_range``), and the bootstrap interval of the paired
  ratio of mean steps holds 1.0 (``ratio_interval_holds_1``: the seeds show
  no difference; how large a one they could miss is the interval's width).
  ``within`` is both. The goal bounds a cost, so a ``k`` that takes fewer
  steps than ``k = 1`` (the interval below 1.0) meets it too: ``met`` is
  the mean at most ``k = 1``'s most and the interval not above 1.0. A seed
  where ``k`` never reaches the loss counts as unbounded steps: no mean,
  and a ratio without an upper end.

  Args:
    runs: the ``k``'s runs, in seed order.
    reference: the ``k = 1`` runs of the same seeds, every one reaching ``loss``.
    loss: the validation loss.

  Raises:
    ValueError: a ``k = 1`` run never reaches ``loss``.
  """
  mine = [steps_to_level(r, loss) for r in runs]
  theirs = [steps_to_level(r, loss) for r in reference]
  steps, base = [m[0] for m in mine], [t[0] for t in theirs]
  if not all(math.isfinite(b) for b in base):
    raise ValueError(f"a k = 1 run never reaches the loss {loss}; read levels every one reaches")
  ratio = ratio_interval(steps, base)
  tokens_ratio = ratio_interval([m[1] for m in mine], [t[1] for t in theirs])
  mean = float(np.mean(steps))
  least, most = min(base), max(base)
  paired = outcome(ratio[1], ratio[2])
  within_range = bool(least <= mean <= most)
  return {
    "loss": loss,
    "k1_steps": round(float(np.mean(base)), 1),
    "k1_range": [round(least, 1), round(most, 1)],
    "steps": _json_number(mean),
    "steps_by_seed": [_json_number(s) for s in steps],
    "reached": sum(math.isfinite(s) for s in steps),
    "steps_ratio": _interval(ratio),
    "steps_ratio_by_seed": [_json_number(s / b) for s, b in zip(steps, base, strict=True)],
    "tokens_ratio": _interval(tokens_ratio),
    "outcome": paired,
    "mean_within_k1_range": within_range,
    "ratio_interval_holds_1": paired == "ties",
    "within": within_range and paired == "ties",
    "met": bool(mean <= most) and paired != "more steps",
  }


def compare(
  runs: Sequence[Mapping[str, Any]], reference: Sequence[Mapping[str, Any]], levels: Sequence[float]
) -> dict[str, Any]:
  """One ``k``'s runs against ``k = 1``'s, paired by seed (both in seed order).

  Returns:
    ``levels``: :func:`compare_at` at each loss; ``within_at_every_level``
    and ``met_at_every_level``: its ``within`` and ``met`` at every level;
    ``final_val_loss_difference``:
    the paired difference of final losses ``[mean, lo, hi]`` and
    ``final_loss_interval_holds_0``.
  """
  rows = [compare_at(runs, reference, loss) for loss in levels]
  diff = difference_interval(
    [r["final_val_loss"] for r in runs], [r["final_val_loss"] for r in reference]
  )
  return {
    "levels": rows,
    "within_at_every_level": all(row["within"] for row in rows),
    "met_at_every_level": all(row["met"] for row in rows),
    "final_val_loss_difference": diff,
    "final_loss_interval_holds_0": bool(diff[1] <= 0.0 <= diff[2]),
  }


Variant = tuple[int, str]  # (measure_every, reading)


def variant(value: int | Sequence[Any]) -> Variant:
  """``(measure_every, reading)``; a bare ``k`` reads one move per measurement."""
  if isinstance(value, int):
    return value, READINGS[0]
  every, reading = value
  return int(every), str(reading)


def variant_of(run: Mapping[str, Any]) -> Variant:
  """A run's ``(measure_every, reading)``."""
  return run["measure_every"], run.get("reading") or reading_of(run)


def analyse(
  runs: Sequence[dict[str, Any]],
  variants: Sequence[int | Variant],
  target: float,
  margin: float = LOSS_MARGIN,
) -> dict[str, Any]:
  """The summary per variant and the paired comparisons with ``k = 1`` at the loss levels.

  Only seeds that finished every variant count, so every comparison is
  paired; the levels (:func:`loss_levels`) are read off those seeds' ``k = 1``
  runs.

  Args:
    runs: the run records (with ``measure_every``, ``seed``, ``options``,
      ``curve``, ``measurements`` and ``seconds_per_step``); their steps and
      tokens to the target and to ``target + margin`` are filled in.
    variants: ``(measure_every, reading)`` pairs (a bare ``k``: one move per
      measurement), the first the reference (``k = 1``).
    target: the target validation loss.
    margin: how far above the target a run still counts for the margin's columns.
  """
  order = [variant(v) for v in variants]
  by_variant: dict[Variant, dict[int, dict[str, Any]]] = {v: {} for v in order}
  for run in runs:
    fill_targets(run, target, margin)
    by_variant.setdefault(variant_of(run), {})[run["seed"]] = run
  seeds = sorted(set.intersection(*(set(by_variant[v]) for v in order)))
  if not seeds:
    raise ValueError(f"no seed finished every variant (measure_every, reading) of {order}")
  groups = {v: [by_variant[v][s] for s in seeds] for v in order}
  base = groups[order[0]]
  levels = loss_levels(base)
  per_k = [
    {"measure_every": k, "reading": r, **summarize(groups[(k, r)], base, k)} for k, r in order
  ]
  paired = [
    {"measure_every": k, "reading": r, **compare(groups[(k, r)], base, levels)}
    for k, r in order[1:]
  ]
  return {
    "target_val_loss": target,
    "loss_margin": margin,
    "levels": levels,
    "level_offsets": list(LEVEL_OFFSETS),
    "seeds": seeds,
    "every": list(dict.fromkeys(k for k, _ in order)),
    "variants": [list(v) for v in order],
    "per_k": per_k,
    "paired": paired,
  }


def _steps_per_update(row: Mapping[str, Any]) -> int:
  """The controller's ``steps_per_update`` of a table's row (results before the readings: 1)."""
  return row["measure_every"] if row.get("reading") == "per_step" else 1


def _fmt(value: Any, pattern: str = "{:,.0f}") -> str:
  return "-" if value is None else pattern.format(value)


def _ci(values: Sequence[float | None], pattern: str = "{:.2f}") -> str:
  """``ratio x (lo-hi)``; an unbounded end is "inf", a ratio without k = 1's reach "-"."""
  value, lo, hi = values
  if value is None and lo is None:
    return "-"
  bounds = f"{_fmt(lo, pattern)}-{'inf' if hi is None else _fmt(hi, pattern)}"
  return f"{'inf' if value is None else _fmt(value, pattern)}x ({bounds})"


def _yes(value: bool) -> str:
  return "yes" if value else "no"


def markdown(results: Mapping[str, Any]) -> str:
  """The docs' tables: per variant, and each variant's steps to the levels paired with ``k = 1``."""
  n = len(results["seeds"])
  paired = {(row["measure_every"], row["reading"]): row for row in results["paired"]}
  lines = [
    f"| `measure_every` | `steps_per_update` | reached the target | reached target + "
    f"{results['loss_margin']:g} | final val loss | vs k = 1, paired | avg batch | "
    "measurements | steps | wall s (compiles excluded) | ms a step | step cost vs k = 1 |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for row in results["per_k"]:
    pair = paired.get((row["measure_every"], row["reading"]))
    difference = "-"
    if pair is not None:
      diff, lo, hi = pair["final_val_loss_difference"]
      difference = f"{diff:+.4f} ({lo:+.4f} to {hi:+.4f})"
    lines.append(
      f"| {row['measure_every']} | {_steps_per_update(row)} | {row['reached']}/{n} | "
      f"{row['reached_margin']}/{n} | {row['final_val_loss']:.4f} "
      f"± {row['final_val_loss_std']:.4f} | {difference} | {row['avg_batch_size']:.1f} | "
      f"{row['measurements']:,.0f} | {row['steps']:,.0f} | "
      f"{row['wall_seconds']:.0f} ({row['wall_seconds_without_compiles']:.0f}) | "
      f"{1e3 * row['seconds_per_step']:.1f} | {_ci(row['step_cost_vs_k1'])} |"
    )
  lines += [
    "",
    "| `measure_every` vs 1, paired | `steps_per_update` | val loss | k = 1's steps (least-most) "
    "| steps (reached) | steps ratio | tokens ratio | mean within k = 1's range | "
    "steps, paired | within | goal met |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for row in results["paired"]:
    for level in row["levels"]:
      least, most = level["k1_range"]
      lines.append(
        f"| {row['measure_every']} | {_steps_per_update(row)} | {level['loss']:.4f} | "
        f"{level['k1_steps']:,.0f} ({least:,.0f}-{most:,.0f}) | "
        f"{_fmt(level['steps'])} ({level['reached']}/{n}) | {_ci(level['steps_ratio'])} | "
        f"{_ci(level['tokens_ratio'])} | {_yes(level['mean_within_k1_range'])} | "
        f"{level['outcome']} | {_yes(level['within'])} | {_yes(level['met'])} |"
      )
  return "\n".join(lines)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  p.add_argument("--source", default=SOURCE, help="the finished LM comparison's JSON")
  p.add_argument(
    "--seeds", type=common.integers, default=SEEDS, help="paired seeds, run in this order"
  )
  p.add_argument(
    "--every", type=common.integers, default=EVERY, help="measure_every values, 1 first"
  )
  common.add_out_flag(p, NAME, quick=False)
  p.add_argument(
    "--store",
    default=None,
    help="the finished runs (default: --out's folder, NAME_runs.jsonl; '' keeps none)",
  )
  p.add_argument(
    "--readings",
    type=lambda text: tuple(text.split(",")),
    default=READINGS,
    help=f"how the controller reads a measurement when k > 1, some of {','.join(READINGS)}",
  )
  p.add_argument("--markdown", default=None, help="print the docs tables of this JSON, and stop")
  p.add_argument("--workdir", default=None, help="keep every run's workdir under this folder")
  args = p.parse_args(argv)
  if not args.every or args.every[0] != 1 or any(k < 1 for k in args.every):
    p.error(f"--every must start with 1 (the reference) and hold integers >= 1, got {args.every}")
  if not args.readings or not set(args.readings) <= set(READINGS):
    p.error(f"--readings must name some of {', '.join(READINGS)}, got {','.join(args.readings)}")
  if len(set(args.every)) != len(args.every) or len(set(args.seeds)) != len(args.seeds):
    p.error(f"--every and --seeds must not repeat a value, got {args.every} and {args.seeds}")
  args.out = common.out_path(args.out, NAME)
  if args.store is None:
    args.store = (
      os.path.join(os.path.dirname(os.path.abspath(args.out)), f"{NAME}_runs.jsonl")
      if args.out
      else ""
    )
  return args


def train(
  exp: LmExperiment, spec: RunSpec, label: str, share: float, every: int, keep: bool
) -> dict[str, Any]:
  """One run of ``spec`` measuring every ``every``-th step, with its measurements and step cost."""
  run = exp.run(spec, label, share, measure_every=every)
  workdir = pathlib.Path(run["workdir"])
  records = simigrad_jax.read_metrics(workdir / "metrics.jsonl")
  steps = [r for r in records if "batch_size" in r]
  run["measure_every"] = every
  run["reading"] = reading_of(run)
  run["measurements"] = sum(r["similarity"] is not None for r in steps)
  run["seconds_per_step"] = seconds_per_step(steps, every)
  if not keep:
    shutil.rmtree(workdir, ignore_errors=True)
    del run["workdir"]
  return run


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Trains (or reads back) every run, prints the tables, writes the JSON.

  Args:
    argv: command-line arguments (``sys.argv[1:]`` when None).

  Returns:
    The results (see the module docstring), or ``{}`` with ``--markdown``.
  """
  args = _parse_args(argv)
  if args.markdown:
    print(markdown(json.loads(pathlib.Path(args.markdown).read_text("utf-8"))))
    return {}
  source = json.loads(pathlib.Path(args.source).read_text("utf-8"))
  spec, share, label = tuned_setting(source)
  experiment = source["experiment"]
  target = float(source["target_val_loss"]) + float(source.get("reach_tolerance", 0.0))
  setting = {"label": label, "budget_share": share, **dataclasses.asdict(spec)}
  del setting["seed"]
  store = RunStore(
    args.store or None, {"experiment": experiment, "target": target, "setting": setting}
  )
  if store.resumed:
    print(f"resuming: {store.resumed} runs read back from {store.path}", flush=True)
  started = time.perf_counter()
  runs = []
  with comparison_folder(args.workdir, prefix="simigrad-measure-every-lm-") as root:
    exp = LmExperiment(
      hidden=experiment["hidden"],
      seq_length=experiment["seq_length"],
      budget_windows=experiment["budget_windows"],
      max_share=share,
      eval_windows=experiment["eval_windows"],
      evals=experiment["evals"],
      root=root,
      keep_workdirs=True,
      text_file=experiment["text_file"],
    )
    print(f"{jax.device_count()} devices; {exp.description}; {label}", flush=True)
    variants = [(k, r) for k in args.every for r in (args.readings if k > 1 else READINGS[:1])]
    for seed in args.seeds:
      for every, reading in variants:
        seeded = read_as(dataclasses.replace(spec, seed=seed), every, reading)
        key = json.dumps([every, run_key(seeded, share)])
        run = store.runs.get(key)
        trained = run is None
        if run is None:
          run = train(exp, seeded, label, share, every, args.workdir is not None)
          store.put(key, run)
        runs.append(run)
        print(
          f"  {'' if trained else '(stored) '}k={every} {reading} seed {seed}: val loss "
          f"{run['final_val_loss']:.4f}  steps {run['steps']}  avg batch "
          f"{run['avg_batch_size']:.1f}  measurements {run['measurements']}  "
          f"{run['wall_seconds']:.1f} s",
          flush=True,
        )
  results = {
    **analyse(runs, variants, target),
    "source": common.repository_path(args.source),
    "experiment": experiment,
    "setting": setting,
    "task": exp.info(),
    "runs": runs,
    "runs_read_back": store.resumed,
    "runs_wall_seconds": round(sum(r["wall_seconds"] for r in runs), 1),
    "devices": jax.device_count(),
    "platform": jax.devices()[0].platform,
    "jax_version": jax.__version__,
    "total_wall_seconds": round(time.perf_counter() - started, 1),
  }
  common.report(results, markdown(results), args.out)
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
