"""The causal-LM comparison's analysis: the target, steps and tokens to it, the verdict, table and plot.

Used by ``benchmarks/lm/pareto_lm.py``. :func:`analyse` turns its runs into the
target (the best constant batch's final validation loss, mean over seeds),
each run's steps and tokens to it, a summary per setting and the verdict on
the goal: an adaptive setting reaches the target in at most
:data:`STEPS_GOAL` x the best constant batch's optimizer steps, with at most
:data:`TOKENS_GOAL` x its tokens, in every seed's curve or on the seeds'
mean with a paired 95% interval within :data:`LOSS_MARGIN` of the target;
and in fewer steps than every ramp.
"""

from __future__ import annotations

import math
import os
import pathlib
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.lm.experiment import crossing
from benchmarks.pareto.analysis import mean_std

STEPS_GOAL = 0.70
TOKENS_GOAL = 1.10
LOSS_MARGIN = 0.01
RAMPS = ("step_schedule", "linear_ramp", "doubling_warmup", "seesaw")
ADAPTIVE = ("allowance", "simigrad", "gns")
# Student's t at 97.5% by degrees of freedom (a paired 95% interval); 1.96 beyond.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def _setting_key(run: dict[str, Any]) -> tuple[str, str, float]:
  return run["controller"], run["setting"], run["learning_rate"]


def _groups(runs: list[dict[str, Any]]) -> dict[tuple[str, str, float], list[dict[str, Any]]]:
  """The runs by setting (:func:`_setting_key`), in the order each setting first ran."""
  groups: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
  for run in runs:
    groups.setdefault(_setting_key(run), []).append(run)
  return groups


def analyse(
  runs: list[dict[str, Any]],
  *,
  best: dict[str, Any],
  seeds: Sequence[int],
  tolerance: float = 0.0,
) -> dict[str, Any]:
  """The target, every run's steps and tokens to it, the per-setting summary and the verdict.

  Args:
    runs: the runs' records (``curve``, ``final_val_loss``, ``steps``, ...);
      their ``steps_to_target`` and ``tokens_to_target`` are filled in.
    best: the best constant batch, ``{"batch_size", "learning_rate"}``; its
      runs with every seed of ``seeds`` set the target.
    seeds: the seeds every setting ran with (paired).
    tolerance: how far apart the same run's final losses were when repeated:
      a loss within it of the target counts as reaching it.

  Returns:
    ``{"target_val_loss", "best_fixed", "runs", "settings", "verdict"}``.
  """
  groups = _groups(runs)
  best_key = next(
    (
      key
      for key, group in groups.items()
      if key[0] == "fixed"
      and group[0].get("batch_size") == best["batch_size"]
      and math.isclose(key[2], best["learning_rate"], rel_tol=1e-9)
    ),
    None,
  )
  if best_key is None or sorted(r["seed"] for r in groups[best_key]) != sorted(seeds):
    raise ValueError(f"the best constant batch {best} did not run with every seed {list(seeds)}")
  target = float(np.mean([r["final_val_loss"] for r in groups[best_key]]))
  reach = target + tolerance
  for run in runs:
    steps, tokens = crossing([(s, t, v) for s, t, v in run["curve"]], reach)
    run["steps_to_target"] = None if steps is None else round(steps, 1)
    run["tokens_to_target"] = None if tokens is None else round(tokens)
  settings = [_summarize(key, group, reach) for key, group in groups.items()]
  reference = settings[list(groups).index(best_key)]
  reference.update(batch_size=best["batch_size"])
  return {
    "target_val_loss": round(target, 6),
    "reach_tolerance": round(tolerance, 6),
    "best_fixed": reference,
    "runs": runs,
    "settings": settings,
    "verdict": verdict(settings, reference, groups, best_key),
  }


def mean_curve(group: list[dict[str, Any]]) -> list[tuple[float, float, float]]:
  """The seeds' mean ``(steps, tokens, loss)`` at the first seed's token counts.

  Each run's loss and steps are interpolated linearly in tokens, so that
  seeds whose measurements fall at other steps average at the same tokens.
  """
  grid = np.array([t for _, t, _ in group[0]["curve"]], np.float64)
  steps, losses = [], []
  for run in group:
    curve = np.array(run["curve"], np.float64)
    steps.append(np.interp(grid, curve[:, 1], curve[:, 0]))
    losses.append(np.interp(grid, curve[:, 1], curve[:, 2]))
  mean_steps, mean_losses = np.mean(steps, 0), np.mean(losses, 0)
  return [
    (float(s), float(t), float(v)) for s, t, v in zip(mean_steps, grid, mean_losses, strict=True)
  ]


def _summarize(
  key: tuple[str, str, float], group: list[dict[str, Any]], target: float
) -> dict[str, Any]:
  reached = [r for r in group if r["steps_to_target"] is not None]
  loss, loss_std = mean_std([r["final_val_loss"] for r in group])
  steps_of_mean, tokens_of_mean = crossing(mean_curve(group), target)
  return {
    "controller": key[0],
    "setting": key[1],
    "learning_rate": key[2],
    "seeds": len(group),
    "reached": len(reached),
    "final_val_loss": round(loss, 5),
    "final_val_loss_std": round(loss_std, 5),
    "steps_to_target": _mean_or_none([r["steps_to_target"] for r in reached]),
    "tokens_to_target": _mean_or_none([r["tokens_to_target"] for r in reached]),
    "mean_curve_steps_to_target": None if steps_of_mean is None else round(steps_of_mean, 1),
    "mean_curve_tokens_to_target": None if tokens_of_mean is None else round(tokens_of_mean),
    "steps": round(float(np.mean([r["steps"] for r in group])), 1),
    "tokens": round(float(np.mean([r["tokens"] for r in group]))),
    "avg_batch_size": round(float(np.mean([r["avg_batch_size"] for r in group])), 1),
    "wall_seconds": round(float(np.mean([r["wall_seconds"] for r in group])), 1),
  }


def _mean_or_none(values: list[float]) -> float | None:
  return round(float(np.mean(values)), 1) if values else None


def loss_at_steps(run: dict[str, Any], steps: float) -> float:
  """The run's validation loss after ``steps`` optimizer steps, interpolated on its curve."""
  curve = np.array(run["curve"], np.float64)
  return float(np.interp(steps, curve[:, 0], curve[:, 2]))


def paired_interval(differences: Sequence[float]) -> tuple[float, float]:
  """The mean of paired differences and the half-width of its 95% interval (Student's t)."""
  d = np.asarray(differences, np.float64)
  if d.size < 2:
    return float(d.mean()), math.inf
  t = _T975.get(d.size - 1, 1.96)
  return float(d.mean()), float(t * d.std(ddof=1) / math.sqrt(d.size))


def verdict(
  settings: list[dict[str, Any]],
  best: dict[str, Any],
  groups: dict[tuple[str, str, float], list[dict[str, Any]]],
  best_key: tuple[str, str, float],
) -> dict[str, Any]:
  """Each adaptive setting against the goal.

  A setting meets it when (a) every seed's curve reaches the target within
  :data:`STEPS_GOAL` x the best constant batch's steps and
  :data:`TOKENS_GOAL` x its tokens, or (b) at :data:`STEPS_GOAL` x its steps,
  the paired differences (seed by seed) between the setting's loss and the
  best constant batch's final loss have a 95% interval whose upper end is
  within :data:`LOSS_MARGIN`; and (c) the seeds' mean curve reaches the
  target in fewer steps than every ramp's (a ramp whose mean curve never
  reaches it counts as beaten).
  """
  ramps = [s for s in settings if s["controller"] in RAMPS]
  finals = {r["seed"]: r["final_val_loss"] for r in groups[best_key]}
  budget_steps = STEPS_GOAL * best["steps"]
  out = []
  for s in settings:
    if s["controller"] not in ADAPTIVE:
      continue
    group = groups[(s["controller"], s["setting"], s["learning_rate"])]
    steps, tokens = s["mean_curve_steps_to_target"], s["mean_curve_tokens_to_target"]
    every_seed = all(
      r["steps_to_target"] is not None
      and r["steps_to_target"] <= budget_steps
      and r["tokens_to_target"] <= TOKENS_GOAL * best["tokens"]
      for r in group
    )
    mean, half = paired_interval(
      [loss_at_steps(r, budget_steps) - finals[r["seed"]] for r in group if r["seed"] in finals]
    )
    against_ramps = {
      r["controller"]: (
        None
        if r["mean_curve_steps_to_target"] is None or steps is None
        else round(steps / r["mean_curve_steps_to_target"], 3)
      )
      for r in ramps
    }
    beats_ramps = steps is not None and all(v is None or v < 1.0 for v in against_ramps.values())
    within = mean + half <= LOSS_MARGIN
    out.append(
      {
        "controller": s["controller"],
        "setting": s["setting"],
        "reached": f"{s['reached']}/{s['seeds']}",
        "steps_ratio": None if steps is None else round(steps / best["steps"], 3),
        "tokens_ratio": None if tokens is None else round(tokens / best["tokens"], 3),
        "every_seed_within_goal": every_seed,
        "loss_gap_at_goal_steps": round(mean, 4),
        "loss_gap_95": round(half, 4) if math.isfinite(half) else None,
        "steps_vs_ramps": against_ramps,
        "meets_goal": bool((every_seed or within) and beats_ramps),
      }
    )
  return {
    "reference": f"{best['setting']}: {best['steps']:g} steps, {best['tokens']:,} tokens",
    "goal": f"steps <= {STEPS_GOAL}x, tokens <= {TOKENS_GOAL}x in every seed (or the mean with "
    f"a paired 95% interval within {LOSS_MARGIN} of the target), fewer steps than each ramp",
    "measure": "steps and tokens where each seed's and the seeds' mean validation curve reach "
    "the target",
    "ramps_run": sorted({r["controller"] for r in ramps}),
    "adaptive": out,
  }


def _without_bounds(setting: str) -> str:
  """A setting's label with its bounds (``[B_0,upper]``) taken out: they scale with each budget's B_0."""
  return re.sub(r" \[\d+,\d+\]", "", setting)


def budget_comparison(today: dict[str, Any], long: dict[str, Any]) -> list[dict[str, Any]]:
  """Each adaptive setting of ``long`` against the same setting on ``today``'s budget.

  Settings are matched by controller and label, less the bounds (each budget
  starts at its own best constant batch). The saving is the steps ratio on
  the seeds' mean curve; a setting that never reaches the target has none, so
  its saving grows when the longer budget reaches it at all. ``loss_gap_*``
  (the paired loss at the goal's steps, less the best constant batch's final
  loss) measures settings that reach the target on neither.

  Returns:
    One dict a setting: ``controller``, ``setting`` (``long``'s label),
    ``steps_ratio_today`` / ``_long``, ``loss_gap_today`` / ``_long`` (None
    where the setting did not run on today's budget) and ``saving_grows``
    (None where it did not run today).
  """
  earlier = {
    (v["controller"], _without_bounds(v["setting"])): v for v in today["verdict"]["adaptive"]
  }
  out = []
  for v in long["verdict"]["adaptive"]:
    before = earlier.get((v["controller"], _without_bounds(v["setting"])))
    after = v["steps_ratio"]
    if before is None:
      grows = None
    else:
      grows = after is not None and (before["steps_ratio"] is None or after < before["steps_ratio"])
    out.append(
      {
        "controller": v["controller"],
        "setting": v["setting"],
        "steps_ratio_today": None if before is None else before["steps_ratio"],
        "steps_ratio_long": after,
        "loss_gap_today": None if before is None else before["loss_gap_at_goal_steps"],
        "loss_gap_long": v["loss_gap_at_goal_steps"],
        "saving_grows": grows,
      }
    )
  return out


def markdown_budgets(today: dict[str, Any], long: dict[str, Any]) -> str:
  """docs/results.md's table of :func:`budget_comparison`."""
  lines = [
    "| controller | setting | steps to target (mean curve), today | long | loss at 0.7x steps "
    "vs best, today | long | saving grows |",
    "|---|---|---|---|---|---|---|",
  ]
  for c in budget_comparison(today, long):
    run_today = c["saving_grows"] is not None
    lines.append(
      f"| {c['controller']} | {_without_bounds(c['setting'])} | "
      + (_fmt(c["steps_ratio_today"], "{:.3f}x") if run_today else "not run")
      + f" | {_fmt(c['steps_ratio_long'], '{:.3f}x')} | "
      + (f"{c['loss_gap_today']:+.4f}" if run_today else "not run")
      + f" | {c['loss_gap_long']:+.4f} | "
      + ("-" if not run_today else "yes" if c["saving_grows"] else "no")
      + " |"
    )
  return "\n".join(lines)


def _fmt(value: float | None, pattern: str = "{:,.0f}") -> str:
  return "never" if value is None else pattern.format(value)


def _rows(results: dict[str, Any]) -> list[list[str]]:
  best = results["best_fixed"]
  rows = []
  for s in results["settings"]:
    steps, tokens = s["mean_curve_steps_to_target"], s["mean_curve_tokens_to_target"]
    ratio = (
      "never"
      if steps is None
      else f"{steps:,.0f} / {tokens / 1000:,.0f}k ({steps / best['steps']:.2f}x / "
      f"{tokens / best['tokens']:.2f}x)"
    )
    rows.append(
      [
        s["controller"],
        s["setting"],
        f"{s['learning_rate']:.2e}",
        f"{s['final_val_loss']:.4f} ± {s['final_val_loss_std']:.4f}",
        f"{s['reached']}/{s['seeds']}",
        _fmt(s["steps_to_target"]),
        _fmt(None if s["tokens_to_target"] is None else s["tokens_to_target"] / 1000, "{:,.0f}k"),
        ratio,
        f"{s['steps']:,.0f}",
        f"{s['avg_batch_size']:.1f}",
        f"{s['wall_seconds']:.0f}",
      ]
    )
  return rows


HEADER = [
  "controller",
  "setting",
  "peak lr (at B_0)",
  "final val loss",
  "seeds reaching",
  "steps to target (those seeds)",
  "tokens to target (those seeds)",
  "seeds' mean curve: steps / tokens to target (vs best fixed)",
  "steps",
  "avg B",
  "s/run",
]


def _grid_lines(results: dict[str, Any]) -> list[str]:
  """The constant-batch grid: each size's learning rates and losses (the tuning seed)."""
  lines = []
  for g in results.get("fixed_grid", []):
    tried = ", ".join(
      f"{lr:.2e}: {loss:.4f}"
      for lr, loss in zip(g["learning_rates"], g["final_val_losses"], strict=True)
    )
    inside = "inside" if g["bracketed"] else "AT AN EDGE"
    lines.append(f"B={g['batch_size']}: {tried} (best {g['best_learning_rate']:.2e}, {inside})")
  return lines


def _legacy_verdict_lines(results: dict[str, Any]) -> list[str]:
  """The verdict of a result from before the honest protocol (issue 23's, SimiGrad alone)."""
  v = results["verdict"]
  lines = [
    f"target: {results['target_val_loss']:.4f} nats/token (best constant batch "
    f"{v['reference']}; unigram entropy {results.get('unigram_entropy', math.nan):.4f})",
    f"goal: {v['goal']}; ramps run: {', '.join(v['ramps_run']) or 'none'}",
  ]
  for s in v["simigrad"]:
    ramps = ", ".join(f"{k} {_fmt(r, '{:.2f}x')}" for k, r in s["steps_vs_ramps"].items())
    lines.append(
      f"simigrad {s['setting']}: reached {s['reached']}, steps {_fmt(s['steps_ratio'], '{:.2f}x')}"
      f", tokens {_fmt(s['tokens_ratio'], '{:.2f}x')}"
      + (f", steps vs ramps: {ramps}" if ramps else "")
      + f" -> {'meets the goal' if s['meets_goal'] else 'misses the goal'}"
    )
  return lines


def _verdict_lines(results: dict[str, Any]) -> list[str]:
  v = results["verdict"]
  if "adaptive" not in v:
    return _legacy_verdict_lines(results)
  repeat = results.get("reproducibility")
  lines = [
    f"target: {results['target_val_loss']:.4f} nats/token (best constant batch "
    f"{v['reference']}; unigram entropy {results.get('unigram_entropy', math.nan):.4f})",
    f"goal: {v['goal']}; ramps run: {', '.join(v['ramps_run']) or 'none'}",
  ]
  if repeat:
    lines.append(
      f"repeat of {repeat['run']}: final losses {repeat['first']:.6f} and {repeat['second']:.6f}"
      f" ({'the same to 1e-4' if repeat['deterministic'] else 'apart by ' + str(repeat['abs_diff'])})"
    )
  for s in v["adaptive"]:
    ramps = ", ".join(f"{k} {_fmt(r, '{:.2f}x')}" for k, r in s["steps_vs_ramps"].items())
    gap = s["loss_gap_at_goal_steps"]
    half = "inf" if s["loss_gap_95"] is None else f"{s['loss_gap_95']:.4f}"
    lines.append(
      f"{s['controller']} {s['setting']}: reached {s['reached']}, steps "
      f"{_fmt(s['steps_ratio'], '{:.2f}x')}, tokens {_fmt(s['tokens_ratio'], '{:.2f}x')}, "
      f"loss at {STEPS_GOAL}x steps {gap:+.4f} ± {half} of the best's"
      + (f", steps vs ramps: {ramps}" if ramps else "")
      + f" -> {'meets the goal' if s['meets_goal'] else 'misses the goal'}"
    )
  return lines


def format_table(results: dict[str, Any]) -> str:
  """The printed table: one row per setting (means over seeds), then the verdict."""
  rows = [HEADER, *_rows(results)]
  widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
  text = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)
  return text + "\n\n" + "\n".join(_grid_lines(results) + _verdict_lines(results))


def markdown(results: dict[str, Any]) -> str:
  """docs/results.md's table and verdict lines for a result (also one of the earlier protocol)."""
  header = (
    HEADER
    if "token_allowance" in results
    else ["lr at B_0" if h == HEADER[2] else h for h in HEADER]
  )
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(r) + " |" for r in _rows(results)]
  notes = _grid_lines(results) + _verdict_lines(results)
  return "\n".join(lines) + "\n\n" + "\n".join(f"- {x}" for x in notes)


def plot(results: dict[str, Any], png_path: str | os.PathLike) -> pathlib.Path:
  """Validation loss against optimizer steps and tokens (the seeds' mean curves), and batch sizes.

  One line a setting that ran with every seed, and one a size of the
  constant-batch grid (its tuned learning rate, the tuning seed); the batch
  sizes are the first seed's. The loss axes are cut to the range where the
  runs approach the target.

  Args:
    results: :func:`analyse`'s results with the comparison's fields.
    png_path: where the PNG goes.

  Returns:
    ``png_path``.
  """
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  import matplotlib.ticker  # pylint: disable=import-outside-toplevel

  seed = min(r["seed"] for r in results["runs"])
  groups = _groups(results["runs"])
  fixed = [  # each size at its tuned learning rate
    ("fixed", f"B={g['batch_size']}", g["best_learning_rate"]) for g in results["fixed_grid"]
  ]
  complete = [
    (s["controller"], s["setting"], s["learning_rate"])
    for s in results["settings"]
    if s["controller"] != "fixed" and s["seeds"] == len(results["seeds"])
  ]
  shown = fixed + complete
  fig, (by_steps, by_tokens, sizes) = plt.subplots(1, 3, figsize=(17, 6.5))
  target = results["target_val_loss"]
  best = (results["best_fixed"]["controller"], results["best_fixed"]["setting"])
  for i, key in enumerate(shown):
    group = groups[key]
    is_fixed = key[0] == "fixed"
    j = i - len(fixed)  # tab20's dark shades first, then its light ones
    color = (
      ("black" if key[:2] == best else plt.cm.Greys(0.3 + 0.4 * i / max(len(fixed), 1)))
      if is_fixed
      else plt.cm.tab20((2 * j) % 20 + (2 * j // 20) % 2)
    )
    style = "--" if is_fixed else "-"
    seeds = f" ({len(group)} seeds)" if len(group) > 1 else ""
    label = f"{key[0]} {key[1]}{seeds}"
    curve = np.array(mean_curve(group), np.float64)[1:]
    by_steps.plot(curve[:, 0], curve[:, 2], style, color=color, label=label, lw=1.3)
    by_tokens.plot(curve[:, 1], curve[:, 2], style, color=color, lw=1.3)
    first = min(group, key=lambda r: r["seed"])
    trace = np.array(first["batch_sizes"], np.float64)[:-1]  # not the last step, cut to the budget
    sizes.plot(trace[:, 0], trace[:, 1], style, color=color, lw=1.2)
  for ax, xlabel in ((by_steps, "optimizer steps"), (by_tokens, "tokens")):
    ax.axhline(target, color="black", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_ylim(target - 0.04, target + 0.4)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation loss (nats/token)")
  by_steps.set_title(f"seeds' mean curves; target {target:.4f} (dotted)")
  by_tokens.set_title("the same against tokens")
  sizes.set_xscale("log")
  sizes.set_yscale("log", base=2)
  sizes.set_xlabel("optimizer steps")
  sizes.set_ylabel("batch size (sequences)")
  sizes.set_title(f"batch size over training (seed {seed})")
  fig.legend(loc="lower center", ncol=3, fontsize=8, frameon=False)
  fig.tight_layout(rect=(0, 0.2, 1, 1))
  path = pathlib.Path(png_path)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
