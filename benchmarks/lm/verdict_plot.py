"""The language-model verdict's plot: each method's mean frontier, loss against steps and tokens.

Used by ``benchmarks/lm/verdict_lm.py --update-docs``, which writes
``docs/lm_<task>.png`` beside docs/results.md's tables. A frontier is a
method's evaluation runs at its tuned learning rate: at each token budget,
the mean over the evaluation seeds of the steps, the tokens and the final
validation loss (docs/lm_protocol.md). The targets are drawn as horizontal
lines, so a frontier's crossing of one is where the verdicts' ratios are
read.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

# One colour a method family; the coupling is the line style.
FAMILY_COLOURS = {
  "step_schedule": "tab:blue",
  "linear_ramp": "tab:cyan",
  "doubling_warmup": "tab:green",
  "allowance": "tab:purple",
  "simigrad": "tab:red",
  "gns": "tab:orange",
}


def mean_frontiers(results: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """Each method's mean frontier over its evaluation seeds.

  Args:
    results: a task's JSON (``frontier.analyse``'s results, with ``runs``).

  Returns:
    ``{method: array}``, one row ``(steps, tokens, loss)`` a budget, in the
    budgets' order, each the mean over the method's evaluation seeds at its
    tuned multiplier; a budget that some of those seeds have not finished
    is left out, and a method with no evaluation seed is absent.

  Example:
    >>> mean_frontiers(json.load(open("benchmarks/results/lm_shakespeare.json")))["B=4"]
    ... # doctest: +SKIP
  """
  seeds = results["evaluation_seeds"]
  tuned = results["tuned_multipliers"]
  by_point: dict[str, dict[int, list[tuple[float, float, float]]]] = {}
  for run in results["runs"]:
    method = run["method"]
    if (
      run["role"] != "evaluation"
      or run["seed"] not in seeds.get(method, ())
      or run["lr_multiplier"] != tuned.get(method)
    ):
      continue
    point = (float(run["steps"]), float(run["tokens"]), float(run["final_val_loss"]))
    by_point.setdefault(method, {}).setdefault(run["budget_index"], []).append(point)
  frontiers = {}
  for method, budgets in by_point.items():
    rows = [
      np.mean(points, axis=0)
      for _, points in sorted(budgets.items())
      if len(points) == len(seeds[method])
    ]
    if rows:
      frontiers[method] = np.array(rows)
  return frontiers


def plot(results: Mapping[str, Any], png_path: str | os.PathLike) -> pathlib.Path:
  """Validation loss against optimizer steps and against tokens: every method's mean frontier.

  The constant batch sizes are grey (the darker, the larger), the ramps and
  adaptive rules one colour a family, solid under ``"full"`` coupling and
  dashed under ``"peak"``; each target is a dotted line at its loss.

  Args:
    results: a task's JSON (``frontier.analyse``'s results).
    png_path: where the PNG goes.

  Returns:
    ``png_path``.

  Example:
    >>> plot(json.load(open("benchmarks/results/lm_shakespeare.json")), "docs/lm_shakespeare.png")
    ... # doctest: +SKIP
  """
  # Matplotlib's Agg canvas directly: no pyplot state, no display.
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=import-outside-toplevel
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  frontiers = mean_frontiers(results)
  constants = sorted((m for m in frontiers if m.startswith("B=")), key=lambda m: int(m[2:]))
  figure = Figure(figsize=(14, 6.5))
  FigureCanvasAgg(figure)
  by_steps, by_tokens = figure.subplots(1, 2)
  for method in constants + [m for m in frontiers if m not in constants]:
    frontier = frontiers[method]
    if method in constants:
      shade = 0.35 + 0.55 * constants.index(method) / max(len(constants) - 1, 1)
      colour, style = (1 - shade,) * 3, "-"
    else:
      family, _, coupling = method.partition("@")
      colour, style = FAMILY_COLOURS.get(family, "black"), "-" if coupling == "full" else "--"
    for ax, column in ((by_steps, 0), (by_tokens, 1)):
      ax.plot(
        frontier[:, column],
        frontier[:, 2],
        style,
        marker="o",
        markersize=3,
        color=colour,
        lw=1.3,
        label=method if ax is by_steps else None,
      )
  targets = results["targets"]
  for ax, xlabel in ((by_steps, "optimizer steps"), (by_tokens, "tokens")):
    for target in targets:
      ax.axhline(target["loss"], color="black", lw=0.7, ls=":")
      ax.annotate(
        f"target {target['budget_share']:g} ({target['best_constant']})",
        (1.0, target["loss"]),
        xycoords=("axes fraction", "data"),
        ha="right",
        va="bottom",
        fontsize=7,
      )
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation loss (nats/character)")
  seeds = max((len(s) for s in results["evaluation_seeds"].values()), default=0)
  by_steps.set_title(f"{results['task']}: mean frontiers over {seeds} evaluation seeds")
  by_tokens.set_title("the same against tokens")
  figure.legend(loc="lower center", ncol=6, fontsize=8, frameon=False)
  figure.tight_layout(rect=(0, 0.12, 1, 1))
  path = pathlib.Path(png_path)
  figure.savefig(path, dpi=90, format="png")
  return path
