"""The language-model verdict's analysis: tuning, frontiers, targets, bootstrap ratios, verdicts.

Pure functions of the runs' records (one record per WSD branch: a method, a
learning-rate multiplier, a seed and a budget, with its steps, tokens and
final validation loss), so that they are tested on synthetic records and
recomputed from any partial run store. The rules are those of
``docs/lm_protocol.md``, their settings in :mod:`benchmarks.lm.protocol`:

* Tuning, on the tuning seed: a method's learning rate is the multiplier
  with the least loss at the reference budget, among three, widened by 2x
  past an edge (:func:`lr_grid`); the constant sizes are widened past an
  edge while the best size at any target budget is the smallest or the
  largest (:func:`size_grid`). ``B_0`` is the best size at the shortest
  budget.
* A frontier: a method's (tokens, steps, loss) at every budget, for one seed.
  The steps and tokens to a target loss are interpolated between the two
  budgets around it, linearly in log tokens and log steps
  (:func:`steps_to_target`); a frontier that never reaches it has none.
* Targets: at each target budget, the best constant batch's (the size with
  the least mean loss over the evaluation seeds) mean loss.
* Ratios: a method's mean steps (tokens) to a target over the paired seeds,
  divided by the comparator's; the interval is the bootstrap's over seeds
  (resampled with replacement, the same seeds for both).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks.lm import protocol as P

Point = tuple[float, float, float]  # (tokens, steps, validation loss)


def lr_grid(
  losses: Mapping[float, float],
  start: Sequence[float] = P.LR_MULTIPLIERS,
  max_widen: int = P.MAX_LR_WIDEN,
) -> tuple[list[float], float | None, bool]:
  """The learning-rate multipliers still to run, or the tuned one.

  Starts from ``start``; while the best is at an edge, the next multiplier
  out (half or double) joins, at most ``max_widen`` times a side.

  Args:
    losses: the tuning seed's loss at the reference budget by multiplier.
    start: the first multipliers.
    max_widen: the most multipliers added a side.

  Returns:
    ``(to_run, best, bracketed)``: the multipliers to run next (empty once
    tuned), the best multiplier (None until tuned) and whether it is
    strictly inside the grid.

  Example:
    >>> lr_grid({2.0: 1.7, 4.0: 1.6, 8.0: 1.65})
    ([], 4.0, True)
    >>> lr_grid({2.0: 1.7, 4.0: 1.6, 8.0: 1.5})
    ([16.0], None, False)
  """
  grid = sorted(start)
  widened = {"low": 0, "high": 0}
  while True:
    missing = [m for m in grid if m not in losses]
    if missing:
      return missing, None, False
    best = min(grid, key=lambda m: losses[m])
    if best == grid[0] and widened["low"] < max_widen:
      widened["low"] += 1
      grid.insert(0, grid[0] / 2)
    elif best == grid[-1] and widened["high"] < max_widen:
      widened["high"] += 1
      grid.append(grid[-1] * 2)
    else:
      return [], best, grid[0] < best < grid[-1]


def size_grid(
  best_losses: Mapping[int, Sequence[float] | None],
) -> tuple[list[int], list[int], bool]:
  """The constant sizes still to tune, or the final grid.

  Args:
    best_losses: by size, the tuning seed's losses at every budget at the
      size's tuned learning rate, or None while its tuning is unfinished.

  Returns:
    ``(to_tune, grid, bracketed)``: sizes to tune next (empty once final),
    the sizes so far, and whether every target budget's best size is
    strictly inside.
  """
  grid = sorted(P.CONSTANT_SIZES)
  widened = {"low": 0, "high": 0}
  while True:
    missing = [b for b in grid if best_losses.get(b) is None]
    if missing:
      return missing, grid, False
    bests = {best_size(best_losses, grid, k) for k in P.TARGET_BUDGETS}
    grow_low = min(bests) == grid[0] and widened["low"] < P.MAX_SIZE_WIDEN and grid[0] >= 4
    grow_high = max(bests) == grid[-1] and widened["high"] < P.MAX_SIZE_WIDEN
    if not (grow_low or grow_high):
      return [], grid, min(bests) > grid[0] and max(bests) < grid[-1]
    if grow_low:
      widened["low"] += 1
      grid.insert(0, grid[0] // 2)
    if grow_high:
      widened["high"] += 1
      grid.append(grid[-1] * 2)


def best_size(
  best_losses: Mapping[int, Sequence[float] | None], grid: Iterable[int], k: int
) -> int:
  """The size of ``grid`` with the least loss at budget ``k``."""
  return min(grid, key=lambda b: best_losses[b][k])  # type: ignore[index]


def steps_to_target(points: Sequence[Point], target: float) -> tuple[float, float]:
  """``(steps, tokens)`` where a frontier first reaches ``target``: inf, inf when it never does.

  Between the last budget above the target and the first at or below it,
  linear in log tokens and log steps against the loss; a first budget
  already below gives that budget's steps and tokens (an upper bound).

  Args:
    points: ``(tokens, steps, loss)`` by increasing budget.
    target: the loss.

  Example:
    >>> steps_to_target([(100.0, 10.0, 2.0), (400.0, 40.0, 1.0)], 1.5)
    (20.0, 200.0)
  """
  for i, (tokens, steps, loss) in enumerate(points):
    if loss <= target:
      if i == 0:
        return float(steps), float(tokens)
      t0, s0, l0 = points[i - 1]
      f = (l0 - target) / (l0 - loss)
      log_steps = math.log(s0) + f * (math.log(steps) - math.log(s0))
      log_tokens = math.log(t0) + f * (math.log(tokens) - math.log(t0))
      return round(math.exp(log_steps), 6), round(math.exp(log_tokens), 6)
  return math.inf, math.inf


def ratio_interval(
  values: Sequence[float], reference: Sequence[float]
) -> tuple[float, float, float]:
  """The ratio of means of paired ``values`` to ``reference``, and its bootstrap interval.

  The seeds are resampled with replacement
  (:data:`~benchmarks.lm.protocol.BOOTSTRAP_RESAMPLES` times, from a fixed
  seed); the interval holds the middle
  :data:`~benchmarks.lm.protocol.CONFIDENCE` of the resampled ratios. With
  one seed the interval is unbounded.

  A mean is unbounded where a seed never reaches the target. A finite mean
  over an unbounded one is 0, an unbounded one over a finite one inf; where
  both are unbounded (the comparator too misses the target on some seed)
  there is no ratio, and ratio and interval are NaN (:func:`outcome`:
  ``"neither reaches"``). Only then can a resample hold both unbounded.

  Returns:
    ``(ratio, lo, hi)``.

  Example:
    >>> ratio_interval([1.0, math.inf], [2.0, math.inf])
    (nan, nan, nan)
  """
  a, c = np.asarray(values, np.float64), np.asarray(reference, np.float64)
  if math.isinf(a.mean()) and math.isinf(c.mean()):
    return math.nan, math.nan, math.nan
  ratio = _ratio(a.mean(), c.mean())
  if a.size < 2:
    return ratio, 0.0, math.inf
  rng = np.random.default_rng(P.BOOTSTRAP_SEED)
  picks = rng.integers(0, a.size, (P.BOOTSTRAP_RESAMPLES, a.size))
  with np.errstate(invalid="ignore", divide="ignore"):
    ratios = a[picks].mean(1) / c[picks].mean(1)
  tail = (1.0 - P.CONFIDENCE) / 2
  lo = float(np.quantile(ratios, tail, method="lower"))
  hi = float(np.quantile(ratios, 1.0 - tail, method="higher"))
  return ratio, lo, hi


def _ratio(a: float, c: float) -> float:
  if math.isinf(a):
    return math.inf
  return a / c if c > 0 else math.inf


def _finite(x: float) -> float | None:
  """JSON's number: None for an unbounded or never-reached value."""
  return None if not math.isfinite(x) else round(x, 4)


class Runs:
  """The records of one task's store, indexed by method, multiplier, seed and budget.

  Args:
    records: the branch records (``method``, ``lr_multiplier``, ``seed``,
      ``budget_index``, ``tokens``, ``steps``, ``final_val_loss``).
  """

  def __init__(self, records: Iterable[Mapping[str, Any]]):
    self.by_key: dict[tuple[str, float, int], dict[int, Point]] = {}
    for r in records:
      key = (r["method"], float(r["lr_multiplier"]), int(r["seed"]))
      point = (float(r["tokens"]), float(r["steps"]), float(r["final_val_loss"]))
      self.by_key.setdefault(key, {})[int(r["budget_index"])] = point

  def frontier(self, method: str, multiplier: float, seed: int) -> list[Point] | None:
    """The frontier's points by budget, or None while a budget is missing."""
    points = self.by_key.get((method, float(multiplier), seed), {})
    if len(points) < len(P.BUDGET_SHARES):
      return None
    return [points[k] for k in range(len(P.BUDGET_SHARES))]

  def tuning_losses(self, method: str) -> dict[float, float]:
    """The tuning seed's loss at the reference budget, by multiplier (finished frontiers)."""
    out = {}
    for (name, multiplier, seed), _ in self.by_key.items():
      if name == method and seed == P.TUNING_SEED:
        points = self.frontier(name, multiplier, seed)
        if points is not None:
          out[multiplier] = points[P.REFERENCE_BUDGET][2]
    return out

  def tune(self, method: str) -> dict[str, Any]:
    """A method's tuning so far: ``{"to_run", "best", "bracketed", "losses", "frontiers"}``."""
    losses = self.tuning_losses(method)
    to_run, best, bracketed = lr_grid(losses)
    return {
      "to_run": to_run,
      "best": best,
      "bracketed": bracketed,
      "losses": {f"{m:g}": round(v, 6) for m, v in sorted(losses.items())},
      "frontiers": len(losses),
    }

  def constant_tuning(self) -> dict[str, Any]:
    """The constant sizes' tuning: ``{"to_tune", "sizes", "bracketed", "b0", "per_size"}``."""
    per_size = {}
    for size in sorted({int(name[2:]) for name, _, _ in self.by_key if name.startswith("B=")}):
      per_size[size] = self.tune(f"B={size}")
    best_losses: dict[int, list[float] | None] = {}
    for size, tuning in per_size.items():
      frontier = (
        None
        if tuning["best"] is None
        else self.frontier(f"B={size}", tuning["best"], P.TUNING_SEED)
      )
      best_losses[size] = None if frontier is None else [p[2] for p in frontier]
    to_tune, sizes, bracketed = size_grid(best_losses)
    b0 = None if to_tune else best_size(best_losses, sizes, 0)
    return {
      "to_tune": to_tune,
      "sizes": sizes,
      "bracketed": bracketed,
      "b0": b0,
      "per_size": {str(b): per_size[b] for b in sizes if b in per_size},
    }

  def evaluation_seeds(self, method: str, multiplier: float) -> list[int]:
    """The evaluation seeds whose frontier of ``method`` at ``multiplier`` is finished."""
    return [s for s in P.EVALUATION_SEEDS if self.frontier(method, multiplier, s) is not None]


def analyse(records: Sequence[Mapping[str, Any]], task: str) -> dict[str, Any]:
  """The task's tuning, targets, per-target comparisons and verdicts, from its runs.

  Args:
    records: every branch record of the task (tuning and evaluation seeds).
    task: the task's name (in each verdict).

  Returns:
    ``{"tuning", "b0", "methods", "targets", "verdicts", "decisions",
    "runs_needed"}`` (``docs/lm_protocol.md`` describes each); targets and
    verdicts are empty until the constant sizes have paired evaluation seeds.
  """
  runs = Runs(records)
  constants = runs.constant_tuning()
  tuned: dict[str, float] = {}
  tuning: dict[str, Any] = {"constants": constants, "methods": {}}
  for size in constants["sizes"]:
    best = constants["per_size"].get(str(size), {}).get("best")
    if best is not None:
      tuned[f"B={size}"] = best
  for method in P.ramp_and_adaptive_methods():
    t = runs.tune(method.name)
    tuning["methods"][method.name] = t
    if t["best"] is not None:
      tuned[method.name] = t["best"]
  frontiers = {
    name: {s: runs.frontier(name, m, s) for s in runs.evaluation_seeds(name, m)}
    for name, m in tuned.items()
  }
  constant_names = [f"B={b}" for b in constants["sizes"]] if not constants["to_tune"] else []
  targets = _targets(frontiers, constant_names)
  verdicts, decisions = [], []
  for target in targets:
    rows, decision = _compare_at(frontiers, target, task)
    verdicts += rows
    decisions.append(decision)
  return {
    "tuning": tuning,
    "b0": constants["b0"],
    "tuned_multipliers": dict(tuned),
    "evaluation_seeds": {k: sorted(v) for k, v in frontiers.items()},
    "targets": [{k: v for k, v in t.items() if k not in ("seeds", "mean_loss")} for t in targets],
    "verdicts": verdicts,
    "decisions": decisions,
    "runs_needed": runs_needed(tuning, frontiers, verdicts),
  }


def _targets(
  frontiers: Mapping[str, Mapping[int, list[Point] | None]], constants: Sequence[str]
) -> list[dict[str, Any]]:
  """At each target budget, the best constant batch (least mean loss over the seeds that every
  constant size finished) and its mean loss."""
  if not constants or any(name not in frontiers for name in constants):
    return []
  seeds = sorted(set.intersection(*(set(frontiers[name]) for name in constants)))
  if not seeds:
    return []
  out = []
  for k in P.TARGET_BUDGETS:
    means = {
      name: float(np.mean([frontiers[name][s][k][2] for s in seeds]))  # type: ignore[index]
      for name in constants
    }
    best = min(constants, key=lambda name: means[name])
    out.append(
      {
        "budget_index": k,
        "budget_share": P.BUDGET_SHARES[k],
        "loss": round(means[best], 6),
        "mean_loss": means[best],  # the target itself, unrounded: what the steps are read at
        "best_constant": best,
        "constant_losses": {n: round(v, 6) for n, v in means.items()},
        "seeds": seeds,
      }
    )
  return out


def _to_target(
  frontiers: Mapping[str, Mapping[int, list[Point] | None]], name: str, loss: float
) -> dict[int, tuple[float, float]]:
  return {s: steps_to_target(f, loss) for s, f in frontiers[name].items() if f is not None}


def _row(
  task: str, name: str, against: str, comparator: str, target: Mapping[str, Any], reached: Any
) -> dict[str, Any] | None:
  mine, theirs = reached[name], reached[comparator]
  seeds = sorted(set(mine) & set(theirs))
  if not seeds:
    return None
  steps = ratio_interval([mine[s][0] for s in seeds], [theirs[s][0] for s in seeds])
  tokens = ratio_interval([mine[s][1] for s in seeds], [theirs[s][1] for s in seeds])
  return {
    "task": task,
    "method": name,
    "against": against,
    "comparator": comparator,
    "target_budget_share": target["budget_share"],
    "target_loss": target["loss"],
    "steps_ratio": _finite(steps[0]),
    "steps_ratio_ci": [_finite(steps[1]), _finite(steps[2])],
    "tokens_ratio": _finite(tokens[0]),
    "tokens_ratio_ci": [_finite(tokens[1]), _finite(tokens[2])],
    "seeds": len(seeds),
    "reached": sum(math.isfinite(mine[s][0]) for s in seeds),
    "comparator_reached": sum(math.isfinite(theirs[s][0]) for s in seeds),
    "outcome": outcome(steps[1], steps[2]),
  }


NEITHER_REACHES = "neither reaches"


def outcome(lo: float, hi: float) -> str:
  """``"fewer steps"`` when the interval lies below 1, ``"more steps"`` above, else ``"ties"``;
  :data:`NEITHER_REACHES` for the NaN interval of two unbounded means (:func:`ratio_interval`)."""
  if math.isnan(lo) or math.isnan(hi):
    return NEITHER_REACHES
  if hi < 1.0:
    return "fewer steps"
  if lo > 1.0:
    return "more steps"
  return "ties"


def _compare_at(
  frontiers: Mapping[str, Mapping[int, list[Point] | None]], target: Mapping[str, Any], task: str
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
  """Every ramp and adaptive rule against the best constant batch, and the adaptive rules against
  the best ramp, at one target; and the decision there."""
  loss = target["mean_loss"]
  reached = {name: _to_target(frontiers, name, loss) for name in frontiers}
  others = [m for m in P.ramp_and_adaptive_methods() if m.name in frontiers and reached[m.name]]
  found = [
    _row(task, m.name, "best_constant", target["best_constant"], target, reached) for m in others
  ]
  vs_constant = {r["method"]: r for r in found if r is not None}
  # The best ramp and the best adaptive rule have the fewest mean steps to the target; one that
  # misses it on some seed has an unbounded mean, and when every one does there is no best.
  ramps = [
    m.name
    for m in others
    if m.kind == "ramp" and m.name in vs_constant and math.isfinite(_mean_steps(reached[m.name]))
  ]
  best_ramp = min(ramps, key=lambda n: _mean_steps(reached[n]), default=None)
  if best_ramp is not None:
    found += [
      _row(task, m.name, "best_ramp", best_ramp, target, reached)
      for m in others
      if m.kind == "adaptive"
    ]
  rows = [r for r in found if r is not None]
  adaptive = [
    r
    for r in rows
    if r["against"] == "best_constant"
    and r["method"] in _adaptive()
    and r["steps_ratio"] is not None
  ]
  best = min(adaptive, key=lambda r: r["steps_ratio"], default=None)
  versus_ramp = next(
    (r for r in rows if best and r["method"] == best["method"] and r["against"] == "best_ramp"),
    None,
  )
  decision = {
    "target_budget_share": target["budget_share"],
    "target_loss": target["loss"],
    "best_constant": target["best_constant"],
    "best_ramp": best_ramp,
    "best_adaptive": None if best is None else best["method"],
    "seeds": len(target["seeds"]),
    "adaptive_vs_constant": None if best is None else _brief(best),
    "adaptive_vs_ramp": None if versus_ramp is None else _brief(versus_ramp),
    "goal_vs_constant": None if best is None else meets_goal(best),
  }
  return rows, decision


def _adaptive() -> set[str]:
  return {m.name for m in P.ramp_and_adaptive_methods() if m.kind == "adaptive"}


def _mean_steps(reached: Mapping[int, tuple[float, float]]) -> float:
  return float(np.mean([v[0] for v in reached.values()]))


def _brief(row: Mapping[str, Any]) -> dict[str, Any]:
  keys = ("steps_ratio", "steps_ratio_ci", "tokens_ratio", "tokens_ratio_ci", "seeds", "outcome")
  return {k: row[k] for k in keys}


def meets_goal(row: Mapping[str, Any]) -> bool:
  """Steps at most STEPS_GOAL x, the interval's upper end below STEPS_GOAL_UPPER, tokens at most
  TOKENS_GOAL x the comparator's."""
  steps, hi, tokens = row["steps_ratio"], row["steps_ratio_ci"][1], row["tokens_ratio"]
  return bool(  # a Python bool: the ratios may be NumPy floats, whose comparisons JSON refuses
    steps is not None
    and hi is not None
    and tokens is not None
    and steps <= P.STEPS_GOAL
    and hi < P.STEPS_GOAL_UPPER
    and tokens <= P.TOKENS_GOAL
  )


def runs_needed(
  tuning: Mapping[str, Any],
  frontiers: Mapping[str, Mapping[int, Any]],
  verdicts: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
  """The training runs (stable runs with their decays) each method took: its learning-rate
  tuning, its evaluation seeds, and for a ramp the tuning of every ramp (choosing the ramp's
  shape is tuning it for the task); and the constant sizes' together (``"constant sizes"``)."""
  methods = tuning["methods"]
  ramp_tuning = sum(t["frontiers"] for n, t in methods.items() if n.split("@")[0] in P.RAMPS)
  sizes = tuning["constants"]["per_size"]
  constant_tuning = sum(t["frontiers"] for t in sizes.values())
  constant_evaluation = sum(len(frontiers.get(f"B={b}", {})) for b in sizes)
  out: dict[str, Any] = {
    "constant sizes": {
      "tuning_runs": constant_tuning,
      "evaluation_runs": constant_evaluation,
      "total_runs": constant_tuning + constant_evaluation,
      "with_the_choice_of_ramp": None,
      "settled_targets": None,
    }
  }
  for name, t in methods.items():
    own = t["frontiers"]
    evaluation = len(frontiers.get(name, {}))
    is_ramp = name.split("@")[0] in P.RAMPS
    out[name] = {
      "tuning_runs": own,
      "evaluation_runs": evaluation,
      "total_runs": own + evaluation,
      "with_the_choice_of_ramp": ramp_tuning + evaluation if is_ramp else None,
      "settled_targets": sum(
        v["method"] == name
        and v["against"] == "best_constant"
        and v["outcome"] in ("fewer steps", "more steps")
        for v in verdicts
      ),
    }
  return out
