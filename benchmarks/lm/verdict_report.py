"""The language-model verdict's tables: docs/results.md's section, written from a task's JSON.

Used by ``benchmarks/lm/verdict_lm.py --markdown``. Every number comes from
``benchmarks/results/lm_<task>.json`` (``benchmarks/lm/frontier.py``'s
analysis of the task's runs); a partial store says how far it got.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.lm import frontier
from benchmarks.lm import protocol as P


def _ratio(value: float | None, ci: Sequence[float | None] | None = None) -> str:
  if value is None:
    return "never"
  if value == 0:  # a finite mean over an unbounded one: the comparator misses the target
    return "its comparator never reaches it in a paired seed"
  text = f"{value:.2f}x"
  if ci is not None:
    lo, hi = ci
    text += f" [{_bound(lo)}, {_bound(hi)}]"
  return text


def _bound(x: float | None) -> str:
  return "inf" if x is None else f"{x:.2f}"


def status(results: Mapping[str, Any]) -> str:
  """How far the task's runs got: frontiers finished and pending, evaluation seeds so far."""
  seeds = [len(v) for v in results["evaluation_seeds"].values()]
  seen = (
    str(max(seeds, default=0))
    if min(seeds, default=0) == max(seeds, default=0)
    else (f"{min(seeds)} to {max(seeds)}")
  )
  return (
    f"{results['task']}: {results['frontiers_finished']} frontiers finished, "
    f"{results['frontiers_pending']} pending at least (tuning still widens the list); "
    f"evaluation seeds per method so far: {seen} of {len(results['evaluation_seeds_planned'])}; "
    f"{results['train_seconds'] / 3600:.1f} h of training (each run's seconds, summed: runs "
    "side by side count each)."
  )


def tuning_table(results: Mapping[str, Any]) -> str:
  """Each method's learning-rate multipliers on the tuning seed, their loss at budget 1.0."""
  lines = [
    "| method | multiplier: loss at budget 1.0 (tuning seed) | tuned | inside the grid |",
    "|---|---|---|---|",
  ]
  tuning = results["tuning"]
  rows = {f"B={b}": t for b, t in tuning["constants"]["per_size"].items()}
  rows |= tuning["methods"]
  for name, t in rows.items():
    if not t["losses"]:
      continue
    tried = ", ".join(f"{m}: {v:.4f}" for m, v in t["losses"].items())
    best = "pending" if t["best"] is None else f"{t['best']:g}"
    inside = "-" if t["best"] is None else "yes" if t["bracketed"] else "AT AN EDGE"
    lines.append(f"| {name} | {tried} | {best} | {inside} |")
  return "\n".join(lines)


def decision_table(results: Mapping[str, Any]) -> str:
  """At each target: the best constant, ramp and adaptive rule, and the adaptive rule's ratios."""
  lines = [
    "| target (budget, loss) | best constant | best ramp | best adaptive | its steps vs "
    "constant [95%] | tokens vs constant | goal met | steps vs ramp [95%] | seeds |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for d in results["decisions"]:
    vc, vr = d["adaptive_vs_constant"], d["adaptive_vs_ramp"]
    lines.append(
      f"| {d['target_budget_share']:g}: {d['target_loss']:.4f} | {d['best_constant']} | "
      f"{_best(results, d, 'best_ramp')} | {_best(results, d, 'best_adaptive')} | "
      + ("-" if vc is None else f"{_ratio(vc['steps_ratio'], vc['steps_ratio_ci'])} "
         f"({vc['outcome']})")
      + f" | {'-' if vc is None else _ratio(vc['tokens_ratio'])} | "
      + ("-" if d["goal_vs_constant"] is None else "yes" if d["goal_vs_constant"] else "no")
      + " | "
      + ("-" if vr is None else f"{_ratio(vr['steps_ratio'], vr['steps_ratio_ci'])} "
         f"({vr['outcome']})")
      + f" | {d['seeds']} |"
    )  # fmt: skip
  return "\n".join(lines)


def _best(results: Mapping[str, Any], decision: Mapping[str, Any], key: str) -> str:
  """The decision's best ramp or best adaptive rule (``key``); when there is none, why: every one
  misses the target on some seed ("none on every seed"), or none has paired seeds yet ("-")."""
  if decision[key] is not None:
    return decision[key]
  kind = "ramp" if key == "best_ramp" else "adaptive"
  names = {m.name for m in P.ramp_and_adaptive_methods() if m.kind == kind}
  compared = [
    v
    for v in results["verdicts"]
    if v["against"] == "best_constant"
    and v["target_budget_share"] == decision["target_budget_share"]
    and v["method"] in names
  ]
  return "none on every seed" if compared else "-"


def methods_table(results: Mapping[str, Any], against: str) -> str:
  """Every method's verdicts against one comparator, a row per method and a column per target.

  A cell gives the steps ratio with its 95% interval and the tokens ratio; against the best
  constant batch, "goal" marks a cell that meets the goal (``frontier.meets_goal``). A method
  that misses the target on some paired seed reads "never" with the seeds that reached it, or
  "neither on every seed" where its comparator misses it on some seed too (no ratio).
  """
  budgets = [t["budget_share"] for t in results["targets"]]
  cells: dict[str, dict[float, str]] = {}
  for v in results["verdicts"]:
    if v["against"] != against:
      continue
    if v["outcome"] == frontier.NEITHER_REACHES:
      cell = (
        f"neither on every seed ({v['reached']} of {v['seeds']} seeds reached it, "
        f"{v['comparator']} {v['comparator_reached']})"
      )
    elif v["steps_ratio"] is None:
      cell = f"never ({v['reached']} of {v['seeds']} seeds reached it)"
    else:
      cell = f"{_ratio(v['steps_ratio'], v['steps_ratio_ci'])}, tokens {_ratio(v['tokens_ratio'])}"
      if against == "best_constant" and frontier.meets_goal(v):
        cell += " (goal)"
    cells.setdefault(v["method"], {})[v["target_budget_share"]] = cell
  comparators = {t["budget_share"]: t["best_constant"] for t in results["targets"]}
  if against == "best_ramp":
    comparators = {d["target_budget_share"]: d["best_ramp"] for d in results["decisions"]}
  header = " | ".join(f"{b:g}: vs {comparators.get(b) or '-'}" for b in budgets)
  lines = [f"| method | {header} |", "|---|" + "---|" * len(budgets)]
  for method, row in cells.items():
    lines.append(f"| {method} | " + " | ".join(row.get(b, "-") for b in budgets) + " |")
  return "\n".join(lines)


def runs_table(results: Mapping[str, Any]) -> str:
  """The runs each method took: tuning, evaluation, and for a ramp the choice among ramps."""
  lines = [
    "| method | tuning runs | evaluation runs | total | with the choice of ramp |",
    "|---|---|---|---|---|",
  ]
  for name, r in results["runs_needed"].items():
    choice = "-" if r["with_the_choice_of_ramp"] is None else str(r["with_the_choice_of_ramp"])
    lines.append(
      f"| {name} | {r['tuning_runs']} | {r['evaluation_runs']} | {r['total_runs']} | {choice} |"
    )
  return "\n".join(lines)


def markdown(results: Mapping[str, Any]) -> str:
  """The task's part of docs/results.md: status, decisions, tuning and runs needed."""
  parts = [f"#### Task `{results['task']}`", "", status(results), ""]
  if results["decisions"]:
    parts += [decision_table(results), ""]
    parts += [
      "Every ramp and adaptive rule against the best constant batch at each target: steps "
      "[95%], tokens:",
      "",
      methods_table(results, "best_constant"),
      "",
      "Every adaptive rule against the best ramp at each target:",
      "",
      methods_table(results, "best_ramp"),
      "",
    ]
  else:
    parts += ["No targets yet: the constant sizes have no paired evaluation seeds.", ""]
  parts += [tuning_table(results), "", runs_table(results)]
  return "\n".join(parts)
