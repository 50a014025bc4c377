"""The figures the docs quote from the committed results: each is the JSON's in benchmarks/results/.

docs/results.md's tables and docs/own_step.md's table of the SimiGrad steps'
costs are generated from the JSON (``--markdown``) and must equal what the
benchmark prints for it today; results.md's prose and docs/controllers.md,
own_step.md, design.md and nnx.md quote single figures from the same files,
and each such figure is rebuilt here from the JSON and looked up in the page.
docs/trainer.md and docs/training_scripts.md quote the fault suite's counts from
faults.json. A figure that changes in the JSON fails here until the page says it too.
"""

import json
import pathlib
from collections.abc import Callable, Iterable

import pytest

from benchmarks.lm import measure_every_lm
from benchmarks.lm import report as pareto_lm_report
from benchmarks.pareto import report as pareto_report
from benchmarks.step_cost import halves_steps
from benchmarks.step_cost import one_device_steps

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _flat(text: str) -> str:
  """Whitespace collapsed, so that a quoted phrase may wrap across lines."""
  return " ".join(text.split())


def _page(name: str) -> str:
  return (ROOT / "docs" / name).read_text()


def _result(name: str) -> dict:
  return json.loads((RESULTS / f"{name}.json").read_text())


def _pct(accuracy: float) -> str:
  return f"{100 * accuracy:.2f}"


def _group(
  results: dict,
  label: str,
  rule: str | None = None,
  multiplier: float | None = None,
  controller: str | None = None,
) -> dict:
  """The group of ``label``: the learning rate validation selected, or the one given."""
  found = [
    g
    for g in results["groups"]
    if g["label"] == label
    and controller in (None, g["controller"])
    and (
      g["selected"]
      if rule is None
      else (g["settings"]["lr_rule"], g["settings"]["lr_multiplier"]) == (rule, multiplier)
    )
  ]
  assert len(found) == 1, f"{label} ({rule}, {multiplier}): {len(found)} groups"
  return found[0]


def _at(group: dict) -> str:
  """E.g. ``93.52% at 119``: mean test accuracy at the average batch."""
  return f"{_pct(group['test_accuracy_mean'])}% at {group['avg_batch_size_mean']:.0f}"


def _setting(results: dict, label: str) -> dict:
  [found] = [s for s in results["settings"] if s["setting"] == label]
  return found


def _mnist_phrases() -> list[str]:
  results = _result("pareto_mnist")
  summary = results["summary"]
  best = summary["best_fixed"]
  simigrad = summary["simigrad"]
  match = simigrad["matches_best_fixed"]
  gns = summary["gns"]["matches_best_fixed"]
  model = summary["simigrad ema_decay=0.9"]["matches_best_fixed"]
  late = summary["simigrad one_step_late=1"]["matches_best_fixed"]
  model_03 = _group(results, "s=0.3 ema_decay=0.9 [16,1024]")
  slower = _group(results, "s=0.35 ema_decay=0.95 [16,1024]")
  other_rate = _group(results, "s=0.35 ema_decay=0.95 [16,1024]", "linear", 1.0)
  return [
    f"(the best fixed batch: B={best['batch_size']} at {_pct(best['test_accuracy'])}%)",
    f"All {simigrad['settings']} settings of the reference rule lie on or beyond the fixed-batch",
    f"by up to {simigrad['best_gap_points']:.1f} points at large batches",
    f"up to an average batch of {match['avg_batch_size']:.0f} (target 0.2), in "
    f"{match['steps_ratio_to_best_fixed']:.2f}x its optimizer steps",
    f"The gradient-noise-scale controller reaches {gns['avg_batch_size']:.0f} (multiple 1, "
    f"{gns['steps_ratio_to_best_fixed']:.2f}x the steps)",
    f"as good as SimiGrad at a batch of about "
    f"{summary['geometric']['matches_best_fixed']['avg_batch_size']:.0f}",
    f"up to an average batch of {model['avg_batch_size']:.0f} (target 0.35, "
    f"{_pct(model['test_accuracy'])}%, {model['steps_ratio_to_best_fixed']:.2f}x the steps of "
    f"B={best['batch_size']})",
    f"beyond the noise-scale controller's {gns['avg_batch_size']:.0f} "
    f"({_pct(gns['test_accuracy'])}%)",
    f"Target 0.3 gives {_pct(model_03['test_accuracy_mean'])}% at "
    f"{model_03['avg_batch_size_mean']:.0f}, level with the noise-scale controller",
    f"tests 0.3 points worse ({_pct(slower['test_accuracy_mean'])}%) than the other rate "
    f"({_at(other_rate)})",
    f"up to an average batch of {late['avg_batch_size']:.0f} (target 0.2, "
    f"{_pct(late['test_accuracy'])}%), where the reference order reaches "
    f"{match['avg_batch_size']:.0f} ({_pct(match['test_accuracy'])}%)",
    "at the rate picked for one step late (x1 linear) the reference order gives "
    + _at(_group(results, "s=0.5 [16,1024]", "linear", 1.0)),
  ]


def _one_step_late_table() -> str:
  results = _result("pareto_mnist")
  rows = ["| target | reference order | one step late |", "|---|---|---|"]
  for target in ("0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7"):
    reference = _group(results, f"s={target} [16,1024]")
    late = _group(results, f"s={target} one_step_late=1 [16,1024]")
    rows.append(f"| {target} | {_at(reference).replace('%', '')} | {_at(late).replace('%', '')} |")
  return "\n".join(rows)


def _variants_phrases() -> list[str]:
  results = _result("pareto_mnist_variants")
  dead_band = _group(results, "s=0.4 dead_band=0.1 [16,1024]")
  smooth = _group(results, "s=0.2 smooth_factor=0.5 [16,1024]")
  return [
    f"target 0.4 gives {_pct(dead_band['test_accuracy_mean'])}% at an average batch of "
    f"{dead_band['avg_batch_size_mean']:.0f}",
    f"target 0.2 gives {_at(smooth)}",
  ]


def _digits_phrases() -> list[str]:
  results = _result("pareto_quick")
  summary = results["summary"]
  spreads = [100 * g["test_accuracy_std"] for g in results["groups"] if g["selected"]]
  return [
    f"fixed front is flat ({_pct(_group(results, 'B=32')['test_accuracy_mean'])}% at B=32, "
    f"{_pct(_group(results, 'B=128')['test_accuracy_mean'])}% at B=128)",
    f"seed spreads are {min(spreads):.1f} to {max(spreads):.1f} points",
    "up to an average batch of "
    f"{summary['simigrad']['matches_best_fixed']['avg_batch_size']:.0f} (target 0.5), the "
    f"noise-scale controller up to {summary['gns']['matches_best_fixed']['avg_batch_size']:.0f}",
    f"the geometric schedule reaches {_at(_group(results, '32->512', controller='geometric'))}",
  ]


def _mlm_phrases() -> list[str]:
  results = _result("pareto_mlm")
  summary = results["summary"]
  best = summary["best_fixed"]
  match = summary["simigrad"]["matches_best_fixed"]
  adaptive = [g for g in results["groups"] if g["selected"] and g["controller"] != "fixed"]
  gaps = [g["gap_points"] for g in adaptive]
  target_08 = _group(results, "s=0.8 [16,512]")
  b16 = _group(results, "B=16")
  minutes = sum(run["wall_seconds"] for run in results["runs"]) / 60
  return [
    f"There are {len(results['seeds'])} seeds and {len(results['runs'])} runs, which took "
    f"{minutes:.0f} minutes",
    f"fixed B=16 ({b16['steps_mean']:.0f} steps), reaches "
    f"{100 * b16['test_accuracy_mean']:.1f}% and a loss of {b16['test_loss_mean']:.2f}",
    f"by {min(gaps):.1f} to {max(gaps):.1f} points at its average batch",
    f"({_pct(match['test_accuracy'])}% against {_pct(best['test_accuracy'])}%) at an average "
    f"batch of {match['avg_batch_size']:.0f}, with {match['steps_ratio_to_best_fixed']:.2f}x",
    f"reaches {100 * target_08['test_accuracy_mean']:.1f}% at an average batch of "
    f"{target_08['avg_batch_size_mean']:.0f}, "
    f"{100 * (best['test_accuracy'] - target_08['test_accuracy_mean']):.1f} points below B=16 "
    f"and {target_08['gap_points']:.1f} above the fixed B=64",
  ]


def _lm_phrases() -> list[str]:
  results = _result("pareto_lm_issue23")
  best = results["best_fixed"]
  target = results["target_val_loss"]
  steps = best["steps"]
  simigrad = _setting(results, "s=0.1 [16,256]")
  model = _setting(results, "s=0.1 ema_decay=0.9 [16,256]")
  seesaw = _setting(results, "x2 at the cosine's 4 halvings, 16->256")
  b32 = [s for s in results["settings"] if s["setting"] == "B=32" and s["seeds"] > 1]
  half = _result("pareto_lm_393k")
  half_steps = half["best_fixed"]["steps"]
  half_simigrad = _setting(half, "s=0.1 [16,256]")
  half_seesaw = _setting(half, "x2 at the cosine's 4 halvings, 16->256")
  return [
    f"3 seeds per setting, {len(results['runs'])} runs, "
    f"{results['total_wall_seconds'] / 60:.0f} minutes",
    f"The target is B=16's mean final loss, {target:.3f} nats/char (the unigram entropy of the "
    f"text is {results['unigram_entropy']:.3f})",
    f"ends at {simigrad['final_val_loss']:.3f} ± {simigrad['final_val_loss_std']:.3f} after "
    f"{simigrad['steps']:.0f} steps (B=16: {steps:.0f}, so {simigrad['steps'] / steps:.2f}x), "
    f"at an average batch of {simigrad['avg_batch_size']:.0f}: "
    f"{simigrad['final_val_loss'] - target:.3f} above the target",
    f"ends {model['final_val_loss'] - target:.3f} above it ({model['final_val_loss']:.3f} ± "
    f"{model['final_val_loss_std']:.3f}) in {model['steps']:.0f} steps "
    f"({model['steps'] / steps:.2f}x)",
    f"after {model['steps_to_target']:.0f} steps ({model['steps_to_target'] / steps:.2f}x) and "
    f"{model['tokens_to_target'] / 1000:.0f}k tokens "
    f"({model['tokens_to_target'] / best['tokens']:.2f}x)",
    f"The goal asks for {0.64 * steps:.0f} steps",
    f"Seesaw comes closest: {seesaw['final_val_loss']:.3f} ± {seesaw['final_val_loss_std']:.3f} "
    f"in {seesaw['steps']:.0f} steps ({seesaw['steps'] / steps:.2f}x)",
    f"worse than B=32 ({b32[0]['final_val_loss']:.3f} in {b32[0]['steps']:.0f} steps)",
    f"gives B=16 {half['target_val_loss']:.3f} nats/char in {half_steps:.0f} steps",
    f"SimiGrad 0.1 ends {half_simigrad['final_val_loss'] - half['target_val_loss']:.3f} above "
    f"that in {half_simigrad['steps'] / half_steps:.2f}x the steps "
    f"({half_simigrad['reached']} of {half_simigrad['seeds']} seeds reach it, after "
    f"{half_simigrad['steps_to_target'] / half_steps:.2f}x)",
    f"Seesaw ends {half_seesaw['final_val_loss'] - half['target_val_loss']:.3f} above in "
    f"{half_seesaw['steps'] / half_steps:.2f}x the steps "
    f"({half_seesaw['reached']} of {half_seesaw['seeds']} seeds, after "
    f"{half_seesaw['steps_to_target'] / half_steps:.2f}x)",
    f"moved SimiGrad from {half_simigrad['steps'] / half_steps:.2f}x the steps to "
    f"{simigrad['steps'] / steps:.2f}x (its mean final loss "
    f"{half_simigrad['final_val_loss'] - half['target_val_loss']:.3f} and "
    f"{simigrad['final_val_loss'] - target:.3f} above the target)",
  ]


def _measure_every_lm_phrases() -> list[str]:
  """The LM comparison's two readings of a spaced measurement, in its prose."""
  r = _result("lm_measure_every")
  rows = {(row["measure_every"], row["reading"]): row for row in r["per_k"]}
  paired = {(row["measure_every"], row["reading"]): row for row in r["paired"]}
  k1, held, rate = rows[(1, "per_measurement")], rows[(4, "per_measurement")], rows[(4, "per_step")]
  finals = [run["final_val_loss"] for run in r["runs"] if run["measure_every"] == 1]

  def ratios(reading: str, key: str = "steps_ratio") -> str:
    levels = paired[(4, reading)]["levels"]
    means = ", ".join(f"{level[key][0]:.2f}x" for level in levels[:-1])
    bounds = ", ".join(f"{level[key][1]:.2f}-{level[key][2]:.2f}" for level in levels[:-1])
    last = levels[-1][key]
    return (
      f"{means} and {last[0]:.2f}x k = 1's (intervals {bounds} and {last[1]:.2f}-{last[2]:.2f})"
    )

  def difference(reading: str) -> str:
    diff, lo, hi = paired[(4, reading)]["final_val_loss_difference"]
    return f"{diff:+.4f}, interval {lo:+.4f} to {hi:+.4f}"

  held_diff, held_lo, held_hi = paired[(4, "per_measurement")]["final_val_loss_difference"]
  levels = r["levels"]
  return [
    f"spread wider than the margin ({min(finals):.4f} to {max(finals):.4f} over "
    f"{len(r['seeds'])} seeds)",
    f"k = 1 reaches the target in {k1['reached']} seeds of {len(r['seeds'])}, the target + "
    f"0.01 in {k1['reached_margin']}",
    f"the k = 1 runs' worst final validation loss, {levels[0]:.4f}, and 0.05 and 0.1 above it "
    f"({levels[1]:.4f} and {levels[2]:.4f},",
    f"the three losses are {ratios('per_step')}",
    f"k = 1's within the seeds' noise ({difference('per_step')})",
    f"({rate['avg_batch_size']:.1f} on average against {k1['avg_batch_size']:.1f})",
    f"the mean steps are {ratios('per_measurement')}",
    f"an average batch of {held['avg_batch_size']:.1f} against {k1['avg_batch_size']:.1f}, "
    f"so {held['steps']:,.0f} steps against {k1['steps']:,.0f}",
    f"Its final loss is lower by {-held_diff:.4f}, but the interval "
    f"({held_lo:+.4f} to {held_hi:+.4f}) holds 0",
    f"The main table's JSON has `runs_wall_seconds` {r['runs_wall_seconds']:,.0f}.",
    f"{sum(run['wall_seconds'] for run in r['runs'] if run['seed'] > 5):,.0f} s of training "
    "summed over the 15 runs, their `wall_seconds`",
    *_measure_every_k2_phrases(),
  ]


def _measure_every_k2_phrases() -> list[str]:
  """k = 2's paired final losses, in the LM comparison's prose."""
  paired = {row["reading"]: row for row in _result("lm_measure_every_k2")["paired"]}
  held, held_lo, held_hi = paired["per_measurement"]["final_val_loss_difference"]
  rate, rate_lo, rate_hi = paired["per_step"]["final_val_loss_difference"]
  hardest = paired["per_measurement"]["levels"][0]["tokens_ratio"]
  return [
    f"({rate:+.4f}, interval {rate_lo:+.4f} to {rate_hi:+.4f})",
    f"lower, by {-held:.4f} (interval {-held_hi:.4f} to {-held_lo:.4f})",
    f"({hardest[0]:.2f}x, interval {hardest[1]:.2f}-{hardest[2]:.2f})",
  ]


def _controllers_phrases() -> list[str]:
  summary = _result("pareto_mnist")["summary"]
  late = summary["simigrad one_step_late=1"]["matches_best_fixed"]
  reference = summary["simigrad"]["matches_best_fixed"]
  return [f"{late['avg_batch_size']:.0f} against {reference['avg_batch_size']:.0f} ([results]"]


def _halves(devices: str, model: str, step: str) -> dict:
  return _result("halves")["devices"][devices]["rows"][model][step]


def _times(row: dict) -> str:
  """A row's paired time ratio as the docs write it, e.g. ``0.90x``."""
  return f"{row['paired_time_ratio']:.2f}x"


def _memory(row: dict) -> str:
  """A row's temporary-memory ratio as the docs write it, e.g. ``0.38x``."""
  return f"{row['temp_ratio']:.2f}x"


def _own_step_phrases() -> list[str]:
  mlp, cnn = _halves("1", "mlp", "two_pass"), _halves("1", "cnn", "two_pass")
  pmap_one, pmap_eight = _halves("1", "mlp", "pmap"), _halves("8", "mlp", "pmap")
  return [
    f"Every step measured the same similarity ({mlp['similarity']:.6f} for the MLP, "
    f"{cnn['similarity']:.6f} for the CNN)",
    f"{_times(pmap_eight)} in this one",
    f"**One device, MLP, memory ({_memory(mlp)}; pmap {_memory(pmap_one)}).**",
    f"against {mlp['plain_temp_bytes'] / 1e6:.1f} MB of the plain step's temporaries",
    f"**One device, MLP, time ({_times(mlp)} two-pass, {_times(pmap_one)} pmap; NNX "
    f"{_times(_halves('1', 'mlp', 'nnx'))}).**",
    f"**Eight devices, pmap ({_times(pmap_eight)} in this run).**",
    f"its memory is the plain step's ({_memory(pmap_eight)})",
  ]


def _gpu_phrases() -> list[str]:
  """The first GPU numbers (one H200), in own_step.md and results.md."""
  halves = _result("halves_h200")["devices"]["1"]["rows"]
  mlp, cnn, pmap = halves["mlp"]["two_pass"], halves["cnn"]["two_pass"], halves["mlp"]["pmap"]
  resnet = _result("halves_resnet_h200")["variants"]
  return [
    f"the plain MLP step takes {mlp['plain_step_seconds'] * 1e3:.2f} ms and the CNN's "
    f"{cnn['plain_step_seconds'] * 1e3:.1f} ms",
    f"{resnet['halves']['128']['paired_time_ratio']:.2f}x at a batch of 128 "
    f"({resnet['plain']['128']['step_seconds'] * 1e3:.1f} ms a plain step) and "
    f"{resnet['halves']['512']['paired_time_ratio']:.2f}x at 512 "
    f"({resnet['plain']['512']['step_seconds'] * 1e3:.1f} ms)",
    f"**Memory, MLP: {mlp['temp_ratio']:.0f}x ({mlp['temp_bytes'] / 1e6:.1f} MB against "
    f"{mlp['plain_temp_bytes'] / 1e6:.1f} MB; the pmap step {pmap['temp_ratio']:.1f}x).**",
    f"the MLP {mlp['similarity']:.6f}, its pmap step {pmap['similarity']:.6f}; the CNN "
    f"{cnn['similarity']:.6f}",
  ]


def _gpu_overhead_phrases() -> list[str]:
  overhead = _result("overhead_adaptive_h200")
  variants, warm = overhead["variants"], overhead["warm_start"]
  return [
    f"| `adaptive` (33 shapes) | {variants['adaptive']['ratio_to_fixed_run']:.3f} |",
    f"| `adaptive_late` | {variants['adaptive_late']['ratio_to_fixed_run']:.3f} |",
    f"waiting {warm['compile_wait_seconds']:.2f} s for its programs, at "
    f"{warm['ratio_to_fixed_paired']:.2f}x the fixed Trainer's examples/s",
  ]


def _design_halves_phrases() -> list[str]:
  mlp, cnn = _halves("8", "mlp", "two_pass"), _halves("8", "cnn", "two_pass")
  return [
    f"MLP's two-pass step then took {_times(mlp)} the plain step's time and {_memory(mlp)} its "
    f"temporary memory, the CNN's {_times(cnn)} and {_memory(cnn)}"
  ]


def _nnx_phrases() -> list[str]:
  row = lambda devices, model: _halves(devices, model, "nnx")
  mlp8, cnn8, cnn1, mlp1 = row("8", "mlp"), row("8", "cnn"), row("1", "cnn"), row("1", "mlp")
  return [
    f"on 8 simulated devices {_times(mlp8)} the time and {_memory(mlp8)} the temporary memory "
    f"for an MLP, {_times(cnn8)} and {_memory(cnn8)} for a small CNN; on one device the CNN "
    f"takes {_times(cnn1)} and {_memory(cnn1)}, and the MLP {_times(mlp1)} the time but "
    f"{_memory(mlp1)} the memory"
  ]


def _fault_phrases() -> list[str]:
  """The fault suite's counts (tests/reliability/reliability_operator_faults_test.py's table)."""
  faults = _result("faults")
  table = faults["table"]
  kills = [row for row in table if row["kind"] == "kill"]
  seconds = [row["sigterm_exit_seconds"] for row in table if "sigterm_exit_seconds" in row]
  assert faults["faults"] == len(table) and faults["ok"] == sum(row["ok"] for row in table)
  assert faults["sigterm_exit_seconds_max"] == round(max(seconds), 1)
  return [
    f"{faults['faults']} faults were tried and {faults['ok']} of them ended as expected",
    f"{len(kills)} kills and preemptions (SIGKILL and SIGTERM)",
    f"of {len(seconds)} SIGTERMs, {sum(s <= 10 for s in seconds)} exited within 10 s, the "
    f"longest in {max(seconds):.1f} s",
  ]


def _fault_kinds_phrases() -> list[str]:
  """docs/trainer.md's count of each kind of fault too."""
  kinds = _result("faults")["by_kind"]
  return _fault_phrases() + [
    f"({kinds['refused start']} refused starts, {kinds['disk']} disk faults, "
    f"{kinds['damaged metrics']} damaged metrics files, umask 000 and the kills)"
  ]


def _lm_budget_phrases() -> list[str]:
  """The verdicts on the causal LM's two budgets, which the tables do not carry."""
  today, long = _result("pareto_lm"), _result("pareto_lm_long")
  best = long["best_fixed"]
  rule = _setting(long, "a=1.1 [8,128]")
  ramp = _setting(long, "x2 from 8 at 58825 and 657455 tokens lr@peak")
  rule_today = _setting(today, "a=1.1 [2,32]")
  gaps = {
    v["setting"]: v
    for budget in (today, long)
    for v in budget["verdict"]["adaptive"]
    if v["controller"] == "allowance"
  }
  reached = [
    r for r in long["runs"] if r["controller"] == "allowance" and r["setting"] == "a=1.1 [8,128]"
  ]
  steps = sorted(r["steps_to_target"] / best["steps"] for r in reached if r["steps_to_target"])
  return [
    f"The target is B=8's mean final loss over 5 seeds, {long['target_val_loss']:.4f} nats/char "
    f"(std {best['final_val_loss_std']:.4f} across the seeds), after {best['steps']:,.0f} steps",
    f"gave {long['reproducibility']['first']:.6f} twice",
    f"{rule['final_val_loss']:.4f} ± {rule['final_val_loss_std']:.4f}. Its seeds' mean curve "
    f"reaches the target at {rule['mean_curve_steps_to_target']:,.0f} steps "
    f"({rule['mean_curve_steps_to_target'] / best['steps']:.3f}x) with "
    f"{rule['mean_curve_tokens_to_target'] / best['tokens']:.2f}x the tokens",
    f"at {steps[0]:.2f}x-{steps[-1]:.2f}x the steps",
    f"its paired loss is {gaps['a=1.1 [8,128]']['loss_gap_at_goal_steps']:+.4f} ± "
    f"{gaps['a=1.1 [8,128]']['loss_gap_95']:.4f}",
    f"reaches the target on its mean curve at {ramp['mean_curve_steps_to_target']:,.0f} steps",
    f"the allowance rule takes "
    f"{gaps['a=1.1 [8,128]']['steps_vs_ramps']['doubling_warmup']:.2f}x its steps",
    f"{rule['avg_batch_size']:.1f} for the rule against {ramp['avg_batch_size']:.1f} for the ramp",
    f"moves from {gaps['a=1.1 [2,32]']['loss_gap_at_goal_steps']:+.4f} to "
    f"{gaps['a=1.1 [8,128]']['loss_gap_at_goal_steps']:+.4f} for the rule",
    f"coupling: {rule_today['final_val_loss']:.4f} ± {rule_today['final_val_loss_std']:.4f} in "
    f"{rule_today['steps']:,.0f} steps",
  ]


def _lm_verdict_ratios(task: str) -> tuple[dict, Callable[..., str], Callable[..., str]]:
  """A task's LM verdict JSON, and its steps ratio (with the interval) and tokens ratio as the
  prose writes them, by (method, against, target budget)."""
  results = _result(f"lm_{task}")
  verdicts = {(v["method"], v["against"], v["target_budget_share"]): v for v in results["verdicts"]}

  def ratio(method: str, against: str, budget: float, interval: bool = True) -> str:
    v = verdicts[(method, against, budget)]
    lo, hi = v["steps_ratio_ci"]
    return f"{v['steps_ratio']:.2f}x" + (f" [{lo:.2f}, {hi:.2f}]" if interval else "")

  def tokens(method: str, against: str, budget: float) -> str:
    return f"{verdicts[(method, against, budget)]['tokens_ratio']:.2f}x"

  return results, ratio, tokens


def _span(values: Iterable[float]) -> str:
  """The least and the greatest of some ratios, as ``0.59x-0.73x``."""
  ordered = sorted(values)
  return f"{ordered[0]:.2f}x-{ordered[-1]:.2f}x"


def _lm_verdict_phrases() -> list[str]:
  """The shakespeare task's decision, as the prose above the generated blocks states it."""
  results, ratio, tokens = _lm_verdict_ratios("shakespeare")
  verdicts = {(v["method"], v["against"], v["target_budget_share"]): v for v in results["verdicts"]}
  c, r = "best_constant", "best_ramp"
  gns_vs_ramp = [verdicts[("gns@full", r, b)] for b in (0.125, 0.25, 0.5)]
  reached_at_full = [v["reached"] for v in results["verdicts"] if v["target_budget_share"] == 1.0]
  [comparator_at_full] = {
    v["comparator_reached"] for v in results["verdicts"] if v["target_budget_share"] == 1.0
  }
  assert {v["outcome"] for v in results["verdicts"] if v["target_budget_share"] == 1.0} == {
    "neither reaches"
  }
  needed = results["runs_needed"]
  adaptive_runs = sorted(
    {needed[m]["total_runs"] for m in needed if m.split("@")[0] in ("allowance", "simigrad", "gns")}
  )
  return [
    f"{results['frontiers_finished']} frontiers, 10 paired evaluation seeds for every method, "
    f"{results['train_seconds'] / 3600:.1f} h of training",
    f"in {ratio('simigrad@full', c, 0.125, False)} its steps "
    f"{ratio('simigrad@full', c, 0.125).split(' ', 1)[1]} with {tokens('simigrad@full', c, 0.125)} "
    "its tokens",
    f"`simigrad@peak` in {ratio('simigrad@peak', c, 0.125)} with "
    f"{tokens('simigrad@peak', c, 0.125)}",
    f"in {ratio('allowance@peak', c, 0.125)} with {tokens('allowance@peak', c, 0.125)}",
    f"at {ratio('gns@full', c, 0.125, False)} the steps but {tokens('gns@full', c, 0.125)} the "
    "tokens",
    f"{ratio('simigrad@full', c, 0.25)} with {tokens('simigrad@full', c, 0.25)}, then "
    f"{ratio('simigrad@full', c, 0.5)} with {tokens('simigrad@full', c, 0.5)}",
    f"takes {ratio('doubling_warmup@peak', c, 0.25, False)} with "
    f"{tokens('doubling_warmup@peak', c, 0.25)}, then {ratio('doubling_warmup@peak', c, 0.5, False)}"
    f" with {tokens('doubling_warmup@peak', c, 0.5)}",
    f"at most {max(reached_at_full)} of the 10 seeds do",
    f"B=4 itself reaches it on {comparator_at_full}",
    f"ties at 0.5 ({ratio('allowance@peak', c, 0.5)}, with {tokens('allowance@peak', c, 0.5)})",
    f"takes {ratio('simigrad@full', r, 0.125)} the doubling warmup's steps at 0.125 and "
    f"{ratio('simigrad@full', r, 0.25)} at 0.25, and {ratio('simigrad@full', r, 0.5)} at 0.5 "
    f"({verdicts[('simigrad@full', r, 0.5)]['outcome']})",
    f"({min(v['steps_ratio'] for v in gns_vs_ramp):.2f}x-{max(v['steps_ratio'] for v in gns_vs_ramp):.2f}x)"
    f" at {min(v['tokens_ratio'] for v in gns_vs_ramp):.2f}x-"
    f"{max(v['tokens_ratio'] for v in gns_vs_ramp):.2f}x its tokens",
    f"`allowance@full` {ratio('allowance@full', r, 0.125)} at 0.125",
    f"{adaptive_runs[0]} or {adaptive_runs[-1]} for an adaptive rule, "
    f"{needed['doubling_warmup@peak']['with_the_choice_of_ramp']} for the best ramp",
    f"the constant sizes took {needed['constant sizes']['total_runs']}",
  ]


def _lm_stdlib_phrases() -> list[str]:
  """The python_stdlib task's decision, as the prose above the generated blocks states it."""
  results, ratio, tokens = _lm_verdict_ratios("python_stdlib")
  verdicts = {(v["method"], v["against"], v["target_budget_share"]): v for v in results["verdicts"]}
  c, r, short = "best_constant", "best_ramp", (0.125, 0.25, 0.5)
  [constant] = {d["best_constant"] for d in results["decisions"]}
  at_full = [v for v in results["verdicts"] if v["target_budget_share"] == 1.0]
  [comparator_at_full] = {v["comparator_reached"] for v in at_full}
  needed = results["runs_needed"]
  adaptive_runs = sorted(
    {needed[m]["total_runs"] for m in needed if m.split("@")[0] in ("allowance", "simigrad", "gns")}
  )
  ramp_runs = sorted({n["with_the_choice_of_ramp"] for n in needed.values()} - {None})

  def three(method: str) -> str:
    return (
      f"{ratio(method, c, 0.125)} with {tokens(method, c, 0.125)}, {ratio(method, c, 0.25)} with "
      f"{tokens(method, c, 0.25)}, then {ratio(method, c, 0.5)} with {tokens(method, c, 0.5)}"
    )

  def against_ramp(method: str, what: str) -> str:
    return _span(verdicts[(method, r, b)][what] for b in short)

  return [
    f"{results['frontiers_finished']} frontiers, 10 paired evaluation seeds for every method, "
    f"{results['train_seconds'] / 3600:.1f} h of training",
    f"the grid's smallest, {constant}, at every target",
    f"(`gns@full`): {ratio('gns@full', c, 0.125)} {constant}'s steps at 0.125, "
    f"{ratio('gns@full', c, 0.25)} at 0.25 and {ratio('gns@full', c, 0.5)} at 0.5, at "
    f"{tokens('gns@full', c, 0.125)}, {tokens('gns@full', c, 0.25)} and "
    f"{tokens('gns@full', c, 0.5)} the tokens",
    f"(`simigrad@full`) takes {three('simigrad@full')}",
    f"(`allowance@full`) {three('allowance@full')}",
    f"`simigrad@full` takes {ratio('simigrad@full', r, 0.125)} the best ramp's steps at 0.125, "
    f"{ratio('simigrad@full', r, 0.25)} at 0.25 and {ratio('simigrad@full', r, 0.5)} at 0.5, at "
    f"{against_ramp('simigrad@full', 'tokens_ratio')} its tokens",
    f"`allowance@full` {against_ramp('allowance@full', 'steps_ratio')}",
    f"`gns@full` {against_ramp('gns@full', 'steps_ratio')} at "
    f"{against_ramp('gns@full', 'tokens_ratio')} its tokens",
    f"at most {max(v['reached'] for v in at_full)} of the 10 seeds",
    f"`simigrad@peak` {against_ramp('simigrad@peak', 'steps_ratio')}",
    f"{constant} itself reaches it on {comparator_at_full} of 10",
    (
      f"{adaptive_runs[0]} for every adaptive rule"
      if len(adaptive_runs) == 1
      else f"{adaptive_runs[0]} or {adaptive_runs[-1]} for an adaptive rule"
    )
    + f", {ramp_runs[-1]} for the best ramp",
    f"the constant sizes took {needed['constant sizes']['total_runs']}",
  ]


def _cold_start_phrases() -> list[str]:
  """The cold start's prose in results.md: the goals' ratios, the paired seeds, the padding."""
  table, seeds = _result("cold_start"), _result("cold_start_lm_seeds")

  def summary(result: dict, recipe: str, variant: str) -> dict:
    [row] = [
      r
      for r in result["summary"]
      if (r["recipe"], r["variant"], r["cache"]) == (recipe, variant, "cold")
    ]
    return row

  def waited(result: dict, recipe: str, variant: str, seed: int) -> float:
    [run] = [
      r
      for r in result["runs"]
      if (r["recipe"], r["variant"], r["cache"], r["seed"]) == (recipe, variant, "cold", seed)
    ]
    return run["compile_wait_seconds"]

  def ratio(result: dict, recipe: str, seed: int) -> float:
    return waited(result, recipe, "adaptive", seed) / waited(result, recipe, "fixed", seed)

  def paired(result: dict, recipe: str, seed: int) -> str:
    return f"{ratio(result, recipe, seed):.2f}x"

  demo, lm = summary(table, "demo", "adaptive"), summary(table, "lm", "adaptive")
  pace64 = _result("cold_start_lm_pace64")  # the same four seeds at the scripts' pace of 64

  def by_seed(result: dict) -> str:
    ratios = [ratio(result, "lm", s) for s in range(4)]
    by_seed = ", ".join(f"{r:.2f}x" for r in ratios)
    return f"{min(ratios):.2f}x to {max(ratios):.2f}x paired ({by_seed} by seed)"

  def average(result: dict) -> str:
    return f"{summary(result, 'lm', 'adaptive')['waited_over_fixed']:.2f}x on average"

  return [
    f"waited {demo['waited_over_fixed']:.2f}x (the demo) and {lm['waited_over_fixed']:.2f}x (the LM)",
    f"the LM ({paired(table, 'lm', 0)} and {paired(table, 'lm', 1)} paired)",
    f"Four paired seeds of the LM, cold: {summary(seeds, 'lm', 'adaptive')['waited_over_fixed']:.2f}x",
    f"{average(seeds)}, {by_seed(seeds)}",
    f"{average(pace64)}, {by_seed(pace64)}",
    f"Padding: {demo['padding_fraction']['mean']:.1%} of the rows the demo computed",
    f"and {lm['padding_fraction']['mean']:.1%} of the LM's (missed)",
    f"(an average of {lm['average_batch_size']['mean']:.1f})",
    f"averages about {demo['average_batch_size']['mean']:.0f}, where the floor is small",
  ]


@pytest.mark.parametrize(
  "page, phrases",
  [
    ("trainer.md", _fault_kinds_phrases),
    ("training_scripts.md", _fault_phrases),
    ("results.md", _mnist_phrases),
    ("results.md", _variants_phrases),
    ("results.md", _digits_phrases),
    ("results.md", _mlm_phrases),
    ("results.md", _lm_phrases),
    ("results.md", _lm_budget_phrases),
    ("results.md", _measure_every_lm_phrases),
    ("results.md", _lm_verdict_phrases),
    ("results.md", _lm_stdlib_phrases),
    ("results.md", _cold_start_phrases),
    ("controllers.md", _controllers_phrases),
    ("own_step.md", _own_step_phrases),
    ("own_step.md", _gpu_phrases),
    ("results.md", _gpu_overhead_phrases),
    ("design.md", _design_halves_phrases),
    ("nnx.md", _nnx_phrases),
  ],
  ids=[
    "faults",
    "faults_scripts",
    "mnist",
    "mnist_variants",
    "digits",
    "mlm",
    "causal_lm",
    "causal_lm_budgets",
    "lm_measure_every",
    "lm_verdict",
    "lm_stdlib",
    "cold_start",
    "controllers",
    "own_step_halves",
    "gpu_h200",
    "gpu_h200_overhead",
    "design_halves",
    "nnx_halves",
  ],
)
def test_the_page_quotes_the_json(page, phrases):
  text = _flat(_page(page))
  missing = [phrase for phrase in phrases() if _flat(phrase) not in text]
  assert not missing, (
    f"docs/{page} does not say what the JSON in benchmarks/results/ does: {missing}"
  )


def test_the_one_step_late_table_is_the_json():
  page = "\n".join(line.strip() for line in _page("results.md").splitlines())  # in a list item
  assert _one_step_late_table() in page


@pytest.mark.parametrize(
  "page, name, render, script, what",
  [
    ("results.md", "pareto_mnist", pareto_report.markdown_tables, "pareto/pareto.py", "tables"),
    ("results.md", "pareto_mlm", pareto_report.markdown_tables, "pareto/pareto.py", "tables"),
    ("results.md", "pareto_lm_issue23", pareto_lm_report.markdown, "lm/pareto_lm.py", "table"),
    ("results.md", "pareto_lm", pareto_lm_report.markdown, "lm/pareto_lm.py", "table"),
    ("results.md", "pareto_lm_long", pareto_lm_report.markdown, "lm/pareto_lm.py", "table"),
    (
      "results.md",
      "lm_measure_every",
      measure_every_lm.markdown,
      "lm/measure_every_lm.py",
      "table",
    ),
    (
      "results.md",
      "lm_measure_every_k2",
      measure_every_lm.markdown,
      "lm/measure_every_lm.py",
      "table",
    ),
    ("own_step.md", "halves", halves_steps.markdown_table, "step_cost/halves_steps.py", "table"),
    (
      "results.md",
      "one_device_steps_cpu",
      one_device_steps.markdown_table,
      "step_cost/one_device_steps.py",
      "table",
    ),
    (
      "results.md",
      "one_device_every_cpu",
      one_device_steps.markdown_table,
      "step_cost/one_device_steps.py",
      "table",
    ),
    (
      "own_step.md",
      "halves_h200",
      halves_steps.markdown_table,
      "step_cost/halves_steps.py",
      "table",
    ),
  ],
)
def test_the_generated_tables_are_the_json(page, name, render, script, what):
  text = _page(page)
  command = f"python benchmarks/{script} --markdown benchmarks/results/{name}.json"
  start, end = f"<!-- {name} {what}: {command} -->\n", f"\n<!-- end {name} {what} -->"
  assert start in text and end in text, f"docs/{page} lost the markers of {name}'s {what}"
  block = text[text.index(start) + len(start) : text.index(end)]
  assert block == render(_result(name)), (
    f"docs/{page}'s {name} {what} differ from benchmarks/results/{name}.json; "
    f"regenerate them with {command}"
  )


def test_the_budgets_table_is_the_json():
  text = _page("results.md")
  paths = "benchmarks/results/pareto_lm.json benchmarks/results/pareto_lm_long.json"
  start = f"<!-- pareto_lm budgets table: python benchmarks/lm/pareto_lm.py --compare-budgets {paths} -->\n"
  end = "\n<!-- end pareto_lm budgets table -->"
  assert start in text and end in text, "docs/results.md lost the markers of the budgets table"
  block = text[text.index(start) + len(start) : text.index(end)]
  assert block == pareto_lm_report.markdown_budgets(_result("pareto_lm"), _result("pareto_lm_long"))
