"""benchmarks/pareto_lm.py: steps and tokens to the target loss, the verdict, and a toy run end to end."""

import json

import numpy as np
import pytest

import simigrad_jax
from benchmarks import pareto_lm
from benchmarks import pareto_lm_report
from benchmarks.lm_experiment import crossing


def test_crossing_interpolates_between_the_measurements_around_the_target():
  points = [(0, 0, 4.0), (10, 640, 3.0), (30, 1920, 2.0)]
  assert crossing(points, 2.5) == (20.0, 1280.0)
  assert crossing(points, 3.0) == (10.0, 640.0)
  assert crossing(points, 4.5) == (0.0, 0.0)
  assert crossing(points, 1.9) == (None, None)


def _run(controller, setting, seed, losses, steps, lr=1e-3):
  tokens = [64 * 16 * i for i in range(len(losses))]
  step_counts = np.linspace(0, steps, len(losses)).round().tolist()
  curve = [[s, t, v] for s, t, v in zip(step_counts, tokens, losses, strict=True)]
  return {
    "controller": controller,
    "setting": setting,
    "seed": seed,
    "learning_rate": lr,
    "final_val_loss": losses[-1],
    "steps": steps,
    "tokens": tokens[-1],
    "avg_batch_size": tokens[-1] / 64 / steps,
    "wall_seconds": 1.0,
    "curve": curve,
  }


def test_the_target_is_the_best_constant_batchs_mean_and_the_verdict_follows_the_goal():
  runs = [
    _run("fixed", "B=16", 0, [4.0, 3.0, 2.2, 2.0], 96),
    _run("fixed", "B=16", 1, [4.0, 3.0, 2.3, 2.2], 96),  # target: mean 2.1
    _run("fixed", "B=64", 0, [4.0, 3.5, 2.8, 2.5], 24),
    _run("fixed", "B=64", 1, [4.0, 3.5, 2.8, 2.5], 24),
    _run("fixed", "B=16", 0, [4.0, 3.9, 3.8, 3.7], 96, lr=1e-4),  # the lr sweep: one seed only
    _run("simigrad", "s=0.1", 0, [4.0, 2.5, 2.1, 2.0], 40),
    _run("simigrad", "s=0.1", 1, [4.0, 2.5, 2.0, 1.9], 40),
    _run("seesaw", "seesaw", 0, [4.0, 3.0, 2.05, 2.0], 60),
    _run("seesaw", "seesaw", 1, [4.0, 3.0, 2.05, 2.0], 60),
  ]
  results = pareto_lm_report.analyse(runs, fixed_sizes=(16, 64), seeds=(0, 1))
  assert results["target_val_loss"] == pytest.approx(2.1)
  best = results["best_fixed"]
  assert (best["setting"], best["steps"], best["reached"]) == ("B=16", 96, 1)
  by_run = {(r["controller"], r["seed"], r["learning_rate"]): r for r in runs}
  # simigrad seed 0: 2.5 at step 13, 2.1 at step 27: the target exactly at its third measurement.
  assert by_run[("simigrad", 0, 1e-3)]["steps_to_target"] == pytest.approx(27.0)
  assert by_run[("fixed", 1, 1e-3)]["steps_to_target"] is None  # 2.2 > 2.1
  # The verdict reads the seeds' mean curves: simigrad's mean loss 2.5 at step 13, 2.05 at 27.
  [simigrad] = results["verdict"]["simigrad"]
  assert simigrad["reached"] == "2/2" and simigrad["steps_ratio"] == pytest.approx(
    (13 + 14 * 0.4 / 0.45) / 96, abs=1e-3
  )
  seesaw_steps = 20 + 20 * 0.9 / 0.95
  assert simigrad["steps_vs_ramps"]["seesaw"] == pytest.approx(
    (13 + 14 * 0.4 / 0.45) / seesaw_steps, abs=1e-3
  )
  assert simigrad["meets_goal"]
  assert best["mean_curve_steps_to_target"] == 96  # the target is its mean final loss
  assert results["verdict"]["ramps_run"] == ["seesaw"]
  text = pareto_lm_report.format_table(results)
  assert "meets the goal" in text and "B=16" in text
  assert pareto_lm_report.markdown(results).startswith("| controller | setting |")


def test_ramps_scale_to_the_budget():
  specs, missing = pareto_lm.ramp_specs(
    pareto_lm.RAMPS, (0, 1), initial=16, upper=128, num_tokens=64_000, seq_length=64, lr=1e-3
  )
  assert not missing and [s.controller for s in specs[::2]] == list(pareto_lm.RAMPS)
  sizes = {}
  for spec in specs[::2]:
    controller = simigrad_jax.make_controller(spec.controller, **dict(spec.options))
    sizes[spec.controller] = [controller.size_at(e) for e in (0, 20, 130, 260, 520, 999)]
  assert sizes["step_schedule"] == [16, 16, 32, 64, 128, 128]
  assert sizes["linear_ramp"] == [16, 16, 32, 64, 128, 128]  # +16 every 500 / 7 examples
  assert sizes["doubling_warmup"] == [16, 32, 32, 64, 64, 64]  # at 1.7% and 19% of 1,000
  assert sizes["seesaw"] == [16, 16, 16, 16, 16, 128]  # the cosine halves at 55%, 70%, 80%
  assert specs[-1].label() != pareto_lm.setting_label(specs[-1])
  assert pareto_lm.setting_label(specs[0]) == "0:16,8000:32,16000:64,32000:128 tokens"
  with pytest.raises(ValueError, match="unknown ramp 'cubic'"):
    pareto_lm.ramp_options("cubic", initial=16, upper=128, num_tokens=64_000, seq_length=64)


def test_toy_comparison_end_to_end(tmp_path):
  rng = np.random.default_rng(0)
  words = ("the", "king", "and", "queen", "of", "rome", "shall", "speak")
  text = tmp_path / "generated.txt"
  text.write_text(" ".join(words[i] for i in rng.integers(0, len(words), 1500)))
  out = tmp_path / "lm.json"
  # SimiGrad within [16, 16]: the fixed run's one compiled shape, loaded from the shared cache.
  # fmt: off
  results = pareto_lm.main([
    "--text-file", str(text), "--seeds", "0", "--seq-length", "8", "--hidden", "16",
    "--train-windows", "96", "--eval-windows", "8", "--evals", "3", "--fixed", "16",
    "--lr-multipliers", "1", "--lr-batch-size", "16", "--base-lr", "1e-2",
    "--initial-batch-size", "16", "--upper-bound", "16", "--targets", "0.3",
    "--model-targets", "", "--gns", "", "--ramps", "", "--out", str(out),
  ])
  # fmt: on
  written = json.loads(out.read_text())
  assert written["target_val_loss"] == results["target_val_loss"]
  fixed, simigrad = written["runs"]
  assert (fixed["controller"], simigrad["controller"]) == ("fixed", "simigrad")
  # The best constant batch's single seed reaches its own final loss at its last step.
  assert written["target_val_loss"] == fixed["final_val_loss"]
  assert fixed["steps_to_target"] == fixed["steps"] == 6 and fixed["tokens"] == 96 * 8
  assert fixed["tokens_to_target"] == 96 * 8
  for run in written["runs"]:
    assert {"setting", "seed", "steps_to_target", "tokens_to_target", "final_val_loss"} <= set(run)
    assert run["curve"][0][:2] == [0, 0] and run["curve"][-1][1] == run["tokens"] == 768
    assert run["final_val_loss"] < run["curve"][0][2]  # trained
  assert written["unigram_entropy"] > 0 and (tmp_path / "lm.png").stat().st_size > 0
