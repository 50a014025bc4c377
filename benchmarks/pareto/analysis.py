"""The Pareto benchmarks' analysis: mean and spread over seeds, selection by validation, the fixed front.

Shared by every task of ``benchmarks/pareto/pareto.py``; plain Python and NumPy (no JAX).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

CONTROLLERS = ("fixed", "simigrad", "gns", "linear", "geometric", "loss_plateau")
# The SimiGrad options the grid sets; --simigrad-options adds others (e.g. smooth_factor), and
# each set of others is a variant of its own in the summary.
SIMIGRAD_GRID_KEYS = (
  "initial_batch_size",
  "similarity_target",
  "batch_size_lower_bound",
  "batch_size_upper_bound",
)
LR_KEYS = ("learning_rate", "lr_multiplier", "lr_rule")


def variant(group: dict[str, Any]) -> str:
  """The name a setting is summarised under: its controller, plus SimiGrad's non-grid options.

  E.g. ``"gns"``, ``"simigrad"`` or ``"simigrad ema_decay=0.9"``.
  """
  if group["controller"] != "simigrad":
    return group["controller"]
  extra = sorted(set(group["settings"]) - set(SIMIGRAD_GRID_KEYS) - set(LR_KEYS))
  return " ".join(["simigrad"] + [f"{k}={group['settings'][k]:g}" for k in extra])


def variant_names(summary: dict[str, Any]) -> list[str]:
  """The adaptive variants a :func:`summarize` result covers, in :data:`CONTROLLERS` order."""
  names = [k for k in summary if k not in ("fixed_front", "best_fixed", "tolerance_points")]
  order = {name: i for i, name in enumerate(CONTROLLERS)}
  return sorted(names, key=lambda n: (order.get(n.split(" ")[0], 99), n))


def mean_std(values: Sequence[float]) -> tuple[float, float]:
  values = list(values)
  return float(np.mean(values)), float(statistics.stdev(values)) if len(values) > 1 else 0.0


def group_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Mean and spread over seeds for each setting (same controller and settings)."""
  groups: dict[str, list[dict[str, Any]]] = {}
  for run in runs:
    key = json.dumps([run["controller"], run["settings"]], sort_keys=True)
    groups.setdefault(key, []).append(run)
  out = []
  for members in groups.values():
    acc, acc_sd = mean_std(r["test_accuracy"] for r in members)
    val, _ = mean_std(r["val_accuracy"] for r in members)
    val_loss, _ = mean_std(r["val_loss"] for r in members)
    test_loss, test_loss_sd = mean_std(r["test_loss"] for r in members)
    avg_b, avg_b_sd = mean_std(r["avg_batch_size"] for r in members)
    out.append(
      {
        "controller": members[0]["controller"],
        "label": members[0]["label"],
        "settings": members[0]["settings"],
        "seeds": [r["seed"] for r in members],
        "test_accuracy_mean": acc,
        "test_accuracy_std": acc_sd,
        "val_accuracy_mean": val,
        "val_loss_mean": val_loss,
        "test_loss_mean": test_loss,
        "test_loss_std": test_loss_sd,
        "avg_batch_size_mean": avg_b,
        "avg_batch_size_std": avg_b_sd,
        "steps_mean": float(np.mean([r["steps"] for r in members])),
        "wall_seconds_mean": float(np.mean([r["wall_seconds"] for r in members])),
        "max_batch_size": max(r["max_batch_size"] for r in members),
      }
    )
  return out


def _setting_key(group: dict[str, Any]) -> str:
  """A group's setting without its learning rate: what the learning rate is tuned for."""
  rest = {k: v for k, v in group["settings"].items() if k not in LR_KEYS}
  return json.dumps([group["controller"], rest], sort_keys=True)


def select_by_validation(groups: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
  """Per setting, the learning-rate variant with the best mean validation accuracy.

  Ties go to the lower validation loss. Marks every group's ``selected``;
  returns ``{setting key: selected group}``. The test split plays no part.
  """
  best: dict[str, dict[str, Any]] = {}
  for g in groups:
    key = _setting_key(g)
    score = (g["val_accuracy_mean"], -g.get("val_loss_mean", 0.0))
    if key not in best or score > (
      best[key]["val_accuracy_mean"],
      -best[key].get("val_loss_mean", 0.0),
    ):
      best[key] = g
  for g in groups:
    g["selected"] = best[_setting_key(g)] is g
  return best


def select_fixed(groups: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
  """:func:`select_by_validation`; returns the selected fixed groups by batch size."""
  best = select_by_validation(groups)
  return {
    g["settings"]["initial_batch_size"]: g for g in best.values() if g["controller"] == "fixed"
  }


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
  """The non-dominated (batch size, accuracy) points: no other point is larger in both (ties kept out).

  Returned in increasing batch size; accuracy decreases along it.
  """
  front = []
  for b, acc in sorted(points, key=lambda p: (-p[0], -p[1])):
    if not front or acc > front[-1][1]:
      front.append((b, acc))
  return front[::-1]


def front_accuracy(front: Sequence[tuple[float, float]], batch_size: float) -> float | None:
  """The best accuracy of a front point at a batch size >= ``batch_size`` (None beyond the front)."""
  at_least = [acc for b, acc in front if b >= batch_size]
  return max(at_least) if at_least else None


def interpolated_front(front: Sequence[tuple[float, float]], batch_size: float) -> float | None:
  """The front's accuracy at ``batch_size``, linear in log2(B) between its points.

  A stricter yardstick than :func:`front_accuracy`, which compares a point
  with the next larger fixed batch: this one assumes a fixed batch of exactly
  ``batch_size`` would land between its neighbours. Left of the front: its
  first accuracy; right of it: None.
  """
  if not front or batch_size > front[-1][0]:
    return None
  if batch_size <= front[0][0]:
    return front[0][1]
  for (b0, a0), (b1, a1) in zip(front, front[1:]):
    if b0 <= batch_size <= b1:
      t = math.log2(batch_size / b0) / math.log2(b1 / b0)
      return a0 + t * (a1 - a0)
  return None


def summarize(groups: list[dict[str, Any]], tolerance: float = 0.005) -> dict[str, Any]:
  """Where the adaptive settings stand against the fixed-batch front; the issue's questions."""
  fixed = [g for g in groups if g["controller"] == "fixed" and g["selected"]]
  front = pareto_front([(g["avg_batch_size_mean"], g["test_accuracy_mean"]) for g in fixed])
  best_fixed = max(fixed, key=lambda g: g["test_accuracy_mean"])
  for g in groups:
    f = front_accuracy(front, g["avg_batch_size_mean"])
    g["front_accuracy"] = f
    g["gap_points"] = None if f is None else 100.0 * (g["test_accuracy_mean"] - f)
    # None: larger than every fixed batch, so the front cannot judge it.
    g["beyond_front"] = None if f is None else bool(g["test_accuracy_mean"] >= f)
    i = interpolated_front(front, g["avg_batch_size_mean"])
    g["interp_accuracy"] = i
    g["gap_interp_points"] = None if i is None else 100.0 * (g["test_accuracy_mean"] - i)
  summary: dict[str, Any] = {
    "fixed_front": [{"avg_batch_size": b, "test_accuracy": a} for b, a in front],
    "best_fixed": {
      "batch_size": best_fixed["settings"]["initial_batch_size"],
      "test_accuracy": best_fixed["test_accuracy_mean"],
      "test_accuracy_std": best_fixed["test_accuracy_std"],
      "steps": best_fixed["steps_mean"],
    },
    "tolerance_points": 100 * tolerance,
  }
  for name in sorted({variant(g) for g in groups} - {"fixed"}):
    mine = [g for g in groups if variant(g) == name and g.get("selected", True)]
    matching = [
      g for g in mine if g["test_accuracy_mean"] >= best_fixed["test_accuracy_mean"] - tolerance
    ]
    largest = max(matching, key=lambda g: g["avg_batch_size_mean"]) if matching else None
    summary[name] = {
      "settings": len(mine),
      "judged": sum(g["beyond_front"] is not None for g in mine),
      "on_or_beyond_front": sum(g["beyond_front"] is True for g in mine),
      "best_gap_points": max(g["gap_points"] for g in mine if g["gap_points"] is not None)
      if any(g["gap_points"] is not None for g in mine)
      else None,
      "on_or_above_interpolated": sum(
        g["gap_interp_points"] is not None and g["gap_interp_points"] >= 0 for g in mine
      ),
      "best_gap_interp_points": max(
        g["gap_interp_points"] for g in mine if g["gap_interp_points"] is not None
      )
      if any(g["gap_interp_points"] is not None for g in mine)
      else None,
      "matches_best_fixed": None
      if largest is None
      else {
        "label": largest["label"],
        "avg_batch_size": largest["avg_batch_size_mean"],
        "test_accuracy": largest["test_accuracy_mean"],
        "steps": largest["steps_mean"],
        "steps_ratio_to_best_fixed": largest["steps_mean"] / best_fixed["steps_mean"],
      },
    }
  return summary
