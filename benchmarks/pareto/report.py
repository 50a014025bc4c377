"""The Pareto benchmarks' output: the printed table and the plot (shared by every task)."""

from __future__ import annotations

import os
import pathlib
from typing import Any

from benchmarks.pareto.analysis import CONTROLLERS
from benchmarks.pareto.analysis import pareto_front
from benchmarks.pareto.analysis import variant
from benchmarks.pareto.analysis import variant_names


def _profile_table(profile: dict[str, Any]) -> str:
  sizes = profile["sizes"]
  head = f"{'epoch':>6}{'B_simple':>10}  " + "".join(f"{b:>13}" for b in sizes)
  lines = [
    f"similarity against batch size (mean +- sd over {profile['steps_per_size']} steps; "
    f"[predicted 1/(1+2 B_simple/B)]), training at B={profile['batch_size']}:",
    head,
  ]
  for p in profile["points"]:
    cells = []
    for b in sizes:
      c = p["per_size"][str(b)]
      cells.append(f"{c['similarity_mean']:>+6.2f}[{c['predicted']:.2f}]")
    lines.append(
      f"{p['epochs']:>6.2f}{p['noise_scale']:>10.1f}  " + "".join(f"{c:>13}" for c in cells)
    )
  return "\n".join(lines)


def lr_text(settings: dict[str, Any]) -> str:
  """The learning-rate variant: its multiplier, and the scaling rule unless it is sqrt."""
  rule = settings.get("lr_rule", "sqrt")
  return f"x{settings['lr_multiplier']:g}" + ("" if rule == "sqrt" else f" {rule}")


def format_table(
  groups: list[dict[str, Any]], summary: dict[str, Any], profile: dict[str, Any] | None = None
) -> str:
  """The table of the selected settings, the learning-rate tuning, the answers, the profile."""
  notes = (
    "front %: the best tuned fixed batch at least as large (Pareto front); gap: mean "
    "test accuracy minus it, in points; interp: minus the front interpolated in log2(B) "
    "at this average batch size (stricter)"
  )
  header = (
    f"{'controller':<13}{'setting':<20}{'lr':>10}{'test acc % (sd)':>17}{'avg B':>8}"
    f"{'max B':>7}{'steps':>7}{'wall s':>8}{'front %':>9}{'gap':>7}{'interp':>8}"
  )
  lines = [notes, "", header, "-" * len(header)]
  order = {name: i for i, name in enumerate(CONTROLLERS)}
  for g in sorted(groups, key=lambda g: (order.get(g["controller"], 99), g["avg_batch_size_mean"])):
    if not g["selected"]:
      continue
    front = "-" if g["front_accuracy"] is None else f"{100 * g['front_accuracy']:.2f}"
    gap = "-" if g["gap_points"] is None else f"{g['gap_points']:+.2f}"
    interp = "-" if g["gap_interp_points"] is None else f"{g['gap_interp_points']:+.2f}"
    lines.append(
      f"{g['controller']:<13}{g['label']:<20}{lr_text(g['settings']):>10}"
      f"{100 * g['test_accuracy_mean']:>10.2f} ({100 * g['test_accuracy_std']:.2f})"
      f"{g['avg_batch_size_mean']:>8.1f}{g['max_batch_size']:>7d}{g['steps_mean']:>7.0f}"
      f"{g['wall_seconds_mean']:>8.1f}{front:>9}{gap:>7}{interp:>8}"
    )
  tuning: dict[str, list[str]] = {}
  for g in sorted(groups, key=lambda g: order.get(g["controller"], 99)):  # (stable)
    tuning.setdefault(f"{g['controller']} {g['label']}", []).append(
      f"{lr_text(g['settings'])} {100 * g['val_accuracy_mean']:.1f}/"
      f"{100 * g['test_accuracy_mean']:.1f}{'*' if g['selected'] else ''}"
    )
  tuned = {k: v for k, v in tuning.items() if len(v) > 1}
  if tuned:
    lines += [
      "",
      "learning-rate tuning (variant: mean validation / test accuracy %; "
      "* selected by validation):",
    ]
    width = max(len(k) for k in tuned)
    lines += [f"  {k:<{width}}  " + "  ".join(v) for k, v in tuned.items()]
  best = summary["best_fixed"]
  lines += [
    "",
    f"best fixed: B={best['batch_size']} at {100 * best['test_accuracy']:.2f}% "
    f"(sd {100 * best['test_accuracy_std']:.2f}), {best['steps']:.0f} steps",
  ]
  for name in variant_names(summary):
    s = summary[name]
    match = s["matches_best_fixed"]
    text = (
      f"never within {summary['tolerance_points']:.1f} points of it"
      if match is None
      else f"within {summary['tolerance_points']:.1f} points of it up to avg B="
      f"{match['avg_batch_size']:.1f} ({match['label']}, {100 * match['test_accuracy']:.2f}%, "
      f"{match['steps_ratio_to_best_fixed']:.2f}x its steps)"
    )
    best_gap = "-" if s["best_gap_points"] is None else f"{s['best_gap_points']:+.2f}"
    unjudged = s["settings"] - s["judged"]
    extra = f" ({unjudged} beyond the largest fixed batch)" if unjudged else ""
    best_interp = (
      "-" if s["best_gap_interp_points"] is None else f"{s['best_gap_interp_points']:+.2f}"
    )
    lines.append(
      f"{name}: {s['on_or_beyond_front']}/{s['judged']} settings on or beyond the "
      f"fixed front{extra} (best gap {best_gap} points), {s['on_or_above_interpolated']} "
      f"on or above its interpolation (best {best_interp}); {text}"
    )
  if profile is not None:
    lines += ["", _profile_table(profile)]
  return "\n".join(lines)


_COLORS = {
  "fixed": "black",
  "simigrad": "tab:red",
  "gns": "tab:blue",
  "linear": "tab:green",
  "geometric": "tab:olive",
  "loss_plateau": "tab:purple",
}
_MARKERS = {
  "fixed": "s",
  "simigrad": "o",
  "gns": "^",
  "linear": "v",
  "geometric": "D",
  "loss_plateau": "P",
}


_VARIANT_COLORS = ("tab:orange", "tab:brown", "tab:pink", "tab:cyan", "tab:gray")


def _style(name: str, names: list[str]) -> tuple[str, str]:
  """A variant's colour and marker on the plot (SimiGrad variants: the next free colours)."""
  if name in _COLORS:
    return _COLORS[name], _MARKERS[name]
  extra = [n for n in names if n not in _COLORS]
  return _VARIANT_COLORS[extra.index(name) % len(_VARIANT_COLORS)], _MARKERS[name.split(" ")[0]]


def _short_label(controller: str, label: str) -> str:
  """A point's name on the plot: a schedule's name, or the label without its bounds and options."""
  if controller in ("linear", "geometric", "loss_plateau"):
    return controller
  return label.split(" ")[0] if controller == "simigrad" else label.split(" [")[0]


def plot(results: dict[str, Any], png_path: str | os.PathLike) -> pathlib.Path:
  """Draws accuracy against average batch size (with the fixed front), batch size over training
  and, when profiled, similarity against batch size. Returns the PNG path."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=import-outside-toplevel
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  groups, runs, profile = results["groups"], results["runs"], results.get("profile")
  panels = 3 if profile else 2
  figure = Figure(figsize=(6.2 * panels + 2.5, 6.0), layout="constrained")
  FigureCanvasAgg(figure)
  axes = figure.subplots(1, panels, width_ratios=[1.6] + [1] * (panels - 1))

  ax = axes[0]
  front = results["summary"]["fixed_front"]
  xs = [p["avg_batch_size"] for p in front]
  ys = [100 * p["test_accuracy"] for p in front]
  if xs:
    # front(B) = the best accuracy of a fixed batch >= B: constant on (x[i-1], x[i]].
    ax.step(
      [xs[0] / 2] + xs,
      [ys[0]] + ys,
      where="pre",
      color="0.4",
      lw=1.2,
      ls="--",
      zorder=1,
      label="fixed-batch Pareto front",
    )
  names = ["fixed"] + variant_names(results["summary"])
  for name in names:
    mine = [g for g in groups if variant(g) == name and g["selected"]]
    if not mine:
      continue
    color, marker = _style(name, names)
    mine.sort(key=lambda g: g["avg_batch_size_mean"])
    ax.errorbar(
      [g["avg_batch_size_mean"] for g in mine],
      [100 * g["test_accuracy_mean"] for g in mine],
      yerr=[100 * g["test_accuracy_std"] for g in mine],
      xerr=[g["avg_batch_size_std"] for g in mine],
      fmt=marker,
      ms=6,
      color=color,
      capsize=2,
      lw=0.8,
      label=name,
      zorder=3,
      ls="-" if name == "fixed" else "none",
    )
    for g in mine:
      ax.annotate(
        _short_label(g["controller"], g["label"]),
        (g["avg_batch_size_mean"], 100 * g["test_accuracy_mean"]),
        textcoords="offset points",
        xytext=(3, 3),
        fontsize=6,
        color=color,
      )
  ax.set_xscale("log", base=2)
  ax.set_xlabel("average batch size (examples / optimizer steps)")
  ax.set_ylabel("final test accuracy (%)  [mean +- sd over seeds]")
  task = "masked LM on " if results.get("task") == "mlm" else ""
  ax.set_title(
    f"{task}{results['dataset']}, {results['epochs']:g} "
    f"epoch{'' if results['epochs'] == 1 else 's'}, "
    f"{len(results['seeds'])} seeds",
    fontsize=10,
  )
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8, loc="lower left")

  ax = axes[1]
  seed0 = min(results["seeds"])
  for run in runs:
    if run["controller"] == "fixed" or run["seed"] != seed0 or not run.get("trace"):
      continue
    if not next(
      (
        g["selected"]
        for g in groups
        if g["controller"] == run["controller"] and g["settings"] == run["settings"]
      ),
      True,
    ):
      continue
    trace = run["trace"]
    color = _style(variant(run), names)[0] if variant(run) in names else "gray"
    ax.plot(trace["epochs"], trace["batch_size"], color=color, lw=1, alpha=0.8)
    ax.annotate(
      _short_label(run["controller"], run["label"]),
      (trace["epochs"][-1], trace["batch_size"][-1]),
      fontsize=6,
      color=color,
    )
  ax.set_yscale("log", base=2)
  ax.set_xlabel("epochs")
  ax.set_ylabel(f"batch size (seed {seed0}; red simigrad, blue gns)")
  ax.set_title("adaptive batch size over training", fontsize=10)
  ax.grid(True, which="both", alpha=0.3)

  if profile:
    ax = axes[2]
    sizes = profile["sizes"]
    for point in profile["points"]:
      line = ax.errorbar(
        sizes,
        [point["per_size"][str(b)]["similarity_mean"] for b in sizes],
        yerr=[point["per_size"][str(b)]["similarity_std"] for b in sizes],
        fmt="o-",
        ms=4,
        capsize=2,
        lw=1,
        label=f"epoch {point['epochs']:g} (B_simple {point['noise_scale']:.0f})",
      )
      ax.plot(
        sizes,
        [point["per_size"][str(b)]["predicted"] for b in sizes],
        ls=":",
        lw=1,
        color=line[0].get_color(),
      )
    for target in sorted(
      {g["settings"].get("similarity_target") for g in groups if g["controller"] == "simigrad"}
    ):
      ax.axhline(target, color="tab:red", lw=0.6, alpha=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("cos(g_A, g_B)  (dotted: 1 / (1 + 2 B_simple / B))")
    ax.set_title(
      f"similarity vs batch size (profiling mode, training at B="
      f"{profile['batch_size']}); red lines: targets",
      fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)

  png_path = pathlib.Path(png_path)
  figure.savefig(png_path, dpi=90, format="png")
  return png_path


# ----------------------------------------------------------------------------
# docs/results.md's tables (markdown), generated from a result JSON.
# ----------------------------------------------------------------------------


def _setting_text(group: dict[str, Any]) -> str:
  """A setting in the words of docs/results.md: ``B=16``, ``target 0.3, [16, 1024]``, ``multiple 1, ...``."""
  s = group["settings"]
  bounds = f"[{s.get('batch_size_lower_bound')}, {s.get('batch_size_upper_bound')}]"
  if group["controller"] == "fixed":
    return f"B={s['initial_batch_size']}"
  if group["controller"] == "simigrad":
    return f"target {s['similarity_target']:g}, {bounds}"
  if group["controller"] == "gns":
    return f"multiple {s['multiple']:g}, {bounds}"
  if group["controller"] in ("linear", "geometric"):
    return f"{s['initial_batch_size']} to {s['final_batch_size']}"
  return group["label"]


def markdown_tables(results: dict[str, Any]) -> str:
  """The two tables of docs/results.md for a result: the headline measure per variant, then the settings.

  The first gives, per controller variant, the largest average batch whose
  mean test accuracy stays within the tolerance of the best fixed batch. The
  second lists every selected fixed batch and, per variant, the selected
  settings on that variant's own front (none more accurate at a larger
  average batch).
  """
  summary, groups = results["summary"], results["groups"]
  best = summary["best_fixed"]
  tolerance = summary["tolerance_points"]
  lines = [
    f"| controller | largest setting within {tolerance:g} points of B={best['batch_size']} "
    f"| test accuracy % | avg batch | steps vs B={best['batch_size']} |",
    "|---|---|---|---|---|",
  ]
  for name in variant_names(summary):
    match = summary[name]["matches_best_fixed"]
    if match is None:
      lines.append(f"| {name} | none | | | |")
      continue
    group = next(
      g for g in groups if g["label"] == match["label"] and variant(g) == name and g["selected"]
    )
    lines.append(
      f"| {name} | {_setting_text(group)} | {100 * match['test_accuracy']:.2f} | "
      f"{match['avg_batch_size']:.0f} | {match['steps_ratio_to_best_fixed']:.2f}x |"
    )
  # Masked-LM results also give the held-out loss (the accuracy of a small model is coarse).
  losses = results.get("task") == "mlm"
  lines += [
    "",
    "| controller | setting | lr | test accuracy % (sd) |"
    + (" test loss (sd) |" if losses else "")
    + " avg batch | steps |",
    "|---|---|---|---|---|---|" + ("---|" if losses else ""),
  ]
  for name in ["fixed"] + variant_names(summary):
    mine = [g for g in groups if variant(g) == name and g["selected"]]
    if name != "fixed":
      front = pareto_front([(g["avg_batch_size_mean"], g["test_accuracy_mean"]) for g in mine])
      mine = [g for g in mine if (g["avg_batch_size_mean"], g["test_accuracy_mean"]) in front]
    for g in sorted(mine, key=lambda g: g["avg_batch_size_mean"]):
      loss = f"{g['test_loss_mean']:.3f} ({g['test_loss_std']:.3f}) | " if losses else ""
      lines.append(
        f"| {name} | {_setting_text(g)} | {lr_text(g['settings'])} | "
        f"{100 * g['test_accuracy_mean']:.2f} ({100 * g['test_accuracy_std']:.2f}) | "
        f"{loss}{g['avg_batch_size_mean']:.0f} | {g['steps_mean']:.0f} |"
      )
  return "\n".join(lines)
