"""benchmarks/lm/pareto_lm.py: steps and tokens to the target loss, the verdict, and a toy run end to end."""

import argparse
import dataclasses
import json
import pathlib
from unittest import mock

import numpy as np
import pytest

import simigrad_jax
from benchmarks.lm import pareto_lm
from benchmarks.lm import report as pareto_lm_report
from benchmarks.lm.experiment import crossing
from benchmarks.lm.run_store import RunStore
from benchmarks.pareto.protocol import RunSpec


def test_crossing_interpolates_between_the_measurements_around_the_target():
  points = [(0, 0, 4.0), (10, 640, 3.0), (30, 1920, 2.0)]
  assert crossing(points, 2.5) == (20.0, 1280.0)
  assert crossing(points, 3.0) == (10.0, 640.0)
  assert crossing(points, 4.5) == (0.0, 0.0)
  assert crossing(points, 1.9) == (None, None)


def _run(controller, setting, seed, losses, steps, lr=1e-3, batch_size=None):
  tokens = [64 * 16 * i for i in range(len(losses))]
  step_counts = np.linspace(0, steps, len(losses)).round().tolist()
  curve = [[s, t, v] for s, t, v in zip(step_counts, tokens, losses, strict=True)]
  return {
    "controller": controller,
    "setting": setting,
    "seed": seed,
    "learning_rate": lr,
    **({} if batch_size is None else {"batch_size": batch_size}),
    "final_val_loss": losses[-1],
    "steps": steps,
    "tokens": tokens[-1],
    "avg_batch_size": tokens[-1] / 64 / steps,
    "wall_seconds": 1.0,
    "curve": curve,
  }


def test_the_target_is_the_best_constant_batchs_mean_and_the_verdict_follows_the_goal():
  runs = [
    _run("fixed", "B=16", 0, [4.0, 3.0, 2.2, 2.0], 100, batch_size=16),
    _run("fixed", "B=16", 1, [4.0, 3.0, 2.3, 2.2], 100, batch_size=16),  # target: mean 2.1
    _run("fixed", "B=64", 0, [4.0, 3.5, 2.8, 2.5], 25, batch_size=64),
    _run("fixed", "B=16", 0, [4.0, 3.9, 3.8, 3.7], 100, lr=1e-4, batch_size=16),  # tuning only
    _run("allowance", "a=1.1", 0, [4.0, 2.5, 2.05, 2.0], 60),
    _run("allowance", "a=1.1", 1, [4.0, 2.5, 2.0, 1.9], 60),
    _run("simigrad", "s=0.1", 0, [4.0, 3.0, 2.5, 2.15], 90),  # never reaches 2.1
    _run("simigrad", "s=0.1", 1, [4.0, 3.0, 2.5, 2.15], 90),
    _run("seesaw", "seesaw", 0, [4.0, 3.0, 2.05, 2.0], 75),
    _run("seesaw", "seesaw", 1, [4.0, 3.0, 2.05, 2.0], 75),
  ]
  results = pareto_lm_report.analyse(
    runs, best={"batch_size": 16, "learning_rate": 1e-3}, seeds=(0, 1)
  )
  assert results["target_val_loss"] == pytest.approx(2.1)
  best = results["best_fixed"]
  assert (best["setting"], best["steps"], best["batch_size"]) == ("B=16", 100, 16)
  by_run = {(r["controller"], r["seed"], r["learning_rate"]): r for r in runs}
  # allowance seed 1: 2.5 at step 20, 2.0 at step 40: 2.1 at 20 + 20 * 0.4 / 0.5 = 36.
  assert by_run[("allowance", 1, 1e-3)]["steps_to_target"] == pytest.approx(36.0)
  assert by_run[("fixed", 1, 1e-3)]["steps_to_target"] is None  # 2.2 > 2.1
  verdicts = {v["controller"]: v for v in results["verdict"]["adaptive"]}
  allowance, simigrad = verdicts["allowance"], verdicts["simigrad"]
  # The mean curve: 2.5 at step 20, 2.025 at 40: the target at 20 + 20 * 0.4 / 0.475.
  assert allowance["steps_ratio"] == pytest.approx((20 + 20 * 0.4 / 0.475) / 100, abs=1e-3)
  assert allowance["every_seed_within_goal"]  # seed 0 at 20 + 20 * 0.4 / 0.45 = 37.8 <= 70
  assert allowance["steps_vs_ramps"]["seesaw"] == pytest.approx(
    (20 + 20 * 0.4 / 0.475) / (25 + 25 * 0.9 / 0.95), abs=1e-3
  )
  assert allowance["meets_goal"] and not simigrad["meets_goal"]
  assert simigrad["steps_ratio"] is None and not simigrad["every_seed_within_goal"]
  # simigrad at 70 steps (between 60: 2.5 and 90: 2.15): 2.383, 0.383 and 0.183 above the
  # seeds' best finals 2.0 and 2.2 (paired): mean 0.283.
  assert simigrad["loss_gap_at_goal_steps"] == pytest.approx(0.2833, abs=1e-3)
  assert results["verdict"]["ramps_run"] == ["seesaw"]
  # A tolerance (the repeat's spread) counts a loss that close to the target as reaching it.
  tolerant = pareto_lm_report.analyse(
    runs, best={"batch_size": 16, "learning_rate": 1e-3}, seeds=(0, 1), tolerance=0.06
  )
  assert {v["controller"]: v["reached"] for v in tolerant["verdict"]["adaptive"]}["simigrad"] == (
    "2/2"
  )
  text = pareto_lm_report.format_table(results)
  assert "meets the goal" in text and "B=16" in text
  assert pareto_lm_report.markdown(results).startswith("| controller | setting |")
  with pytest.raises(ValueError, match="did not run with every seed"):
    pareto_lm_report.analyse(runs, best={"batch_size": 64, "learning_rate": 1e-3}, seeds=(0, 1))
  same = pareto_lm_report.budget_comparison(results, results)
  assert same[0]["steps_ratio_today"] == same[0]["steps_ratio_long"]
  assert same[0]["saving_grows"] is False


def _verdicts(*settings):
  keys = ("controller", "setting", "steps_ratio", "loss_gap_at_goal_steps")
  return {"verdict": {"adaptive": [dict(zip(keys, s, strict=True)) for s in settings]}}


def test_budgets_are_compared_setting_by_setting_whatever_their_bounds():
  today = _verdicts(
    ("allowance", "a=1.1 [2,32] lr@peak", None, 0.011),  # never reached today
    ("simigrad", "s=0.1 [2,32]", 0.40, -0.002),
    ("simigrad", "s=0.2 [2,32]", 0.30, 0.001),
  )
  long = _verdicts(
    ("allowance", "a=1.1 [8,128] lr@peak", 0.44, -0.006),
    ("allowance", "a=1.1 [8,128]", 0.43, -0.007),  # not run today
    ("simigrad", "s=0.1 [8,128]", 0.50, -0.007),  # reached, but later than today
    ("simigrad", "s=0.2 [8,128]", None, 0.002),
  )
  rows = pareto_lm_report.budget_comparison(today, long)
  assert [r["saving_grows"] for r in rows] == [True, None, False, False]
  assert (rows[0]["steps_ratio_today"], rows[0]["loss_gap_today"]) == (None, 0.011)
  assert rows[1]["steps_ratio_today"] is None and rows[1]["loss_gap_long"] == -0.007
  table = pareto_lm_report.markdown_budgets(today, long).splitlines()
  assert table[2] == "| allowance | a=1.1 lr@peak | never | 0.440x | +0.0110 | -0.0060 | yes |"
  assert table[3] == "| allowance | a=1.1 | not run | 0.430x | not run | -0.0070 | - |"
  assert table[5] == "| simigrad | s=0.2 | 0.300x | never | +0.0010 | +0.0020 | no |"


def test_paired_interval_uses_students_t():
  mean, half = pareto_lm_report.paired_interval([0.01, 0.03, 0.02, 0.02, 0.02])
  assert mean == pytest.approx(0.02) and half == pytest.approx(2.776 * 0.00707107 / 5**0.5, 1e-4)
  assert pareto_lm_report.paired_interval([0.5])[1] == float("inf")


def test_the_run_store_resumes_and_refuses_another_experiment(tmp_path):
  path = tmp_path / "lm.json.runs.jsonl"
  spec = RunSpec("fixed", (("initial_batch_size", 16),), 1e-3, 1.0, 0)
  trained = []

  def train():
    trained.append(1)
    return {"final_val_loss": 2.0 + len(trained)}

  store = RunStore(path, {"budget_windows": 96})
  assert store.get_or_run(spec, 1.0, train) == ({"final_val_loss": 3.0}, True)
  assert store.get_or_run(spec, 1.1, train)[1]  # another share of the budget: another run
  with open(path, "a", encoding="utf-8") as f:
    f.write('{"key": "cut short by a ki')  # a kill in the middle of a line
  again = RunStore(path, {"budget_windows": 96})
  assert again.resumed == 2 and again.get_or_run(spec, 1.0, train) == (
    {"final_val_loss": 3.0},
    False,
  )
  assert len(trained) == 2
  with pytest.raises(ValueError, match=r"another experiment \(differs in \['budget_windows'\]\)"):
    RunStore(path, {"budget_windows": 384})
  again.close(keep=False)
  assert not path.exists()


def test_the_run_store_reads_back_a_finished_result_of_its_experiment(tmp_path):
  spec = RunSpec(
    "allowance", (("initial_batch_size", 8), ("token_allowance", 1.1)), 6e-3, 2.0, 3, "sqrt", "peak"
  )
  record = {
    "controller": "allowance", "seed": 3, "learning_rate": 6e-3, "lr_multiplier": 2.0,
    "lr_coupling": "peak", "budget_share": 1.1, "final_val_loss": 1.65,
    "options": {"initial_batch_size": 8, "token_allowance": 1.1},
  }  # fmt: skip
  result = {"experiment": {"budget_windows": 96}, "runs": [record]}
  path = tmp_path / "lm.json.runs.jsonl"
  store = RunStore(path, {"budget_windows": 96})
  assert store.read_back(result, "lm.json") == 1
  assert store.read_back(result, "lm.json") == 0  # already there
  assert store.get_or_run(spec, 1.1, pytest.fail) == (record, False)
  trained = store.get_or_run(dataclasses.replace(spec, lr_coupling="full"), 1.1, lambda: {"x": 1})
  assert trained == ({"x": 1}, True)  # the other coupling is another run
  assert RunStore(path, {"budget_windows": 96}).resumed == 2  # kept on disk
  with pytest.raises(ValueError, match=r"old.json holds the runs of another experiment"):
    RunStore(None, {"budget_windows": 384}).read_back(result, "old.json")
  with pytest.raises(ValueError, match=r"differs in \['budget_windows'\]"):
    RunStore(None, {"budget_windows": 96}).read_back({"runs": []}, "legacy.json")
  missing = tmp_path / "none.json"
  with pytest.raises(SystemExit):
    pareto_lm._parse_args(["--extend", "--out", str(missing)])
  assert not missing.exists() and not (tmp_path / "none.json.runs.jsonl").exists()


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


def fake_training(best_size, multiplier):
  """``train(spec, label, share)`` of a run whose final loss is a bowl around the best size and,
  at each size, ``multiplier`` x the square-root rule's learning rate."""
  trained = []

  def train(spec, label, share):
    trained.append((spec.controller, dict(spec.options).get("initial_batch_size"), spec.lr))
    size = dict(spec.options)["initial_batch_size"]
    best_lr = multiplier * 3e-3 * (size / 32) ** 0.5
    loss = 2.0 + np.log2(size / best_size) ** 2 + np.log2(spec.lr / best_lr) ** 2 + spec.seed / 100
    steps = int(96 * share * 16 / size)
    return {
      "controller": spec.controller, "setting": label, "seed": spec.seed, "learning_rate": spec.lr,
      "final_val_loss": float(loss), "steps": steps, "tokens": int(96 * share) * 8,
      "wall_seconds": 0.0, "curve": [[0, 0, 4.0], [steps, int(96 * share) * 8, float(loss)]],
    }  # fmt: skip

  return train, trained


def protocol_args(**flags):
  args = pareto_lm._parse_args(["--out", "", "--seeds", "0,1", "--ramps", "", "--gns", "1"])
  return argparse.Namespace(**{**vars(args), **flags})


def test_the_grid_widens_the_learning_rate_and_the_sizes_until_each_best_is_inside():
  # The best is B=128 at 16x the sqrt rule's learning rate: both past the grid's edges at first.
  args = protocol_args(fixed=(16, 32), lr_multipliers=(2.0, 4.0, 8.0), max_widen=3)
  train, trained = fake_training(128, 16.0)
  protocol = pareto_lm.Protocol(args, train, RunStore(None, {}))
  grid = protocol.tune_grid(num_train=10_000)
  assert [g["batch_size"] for g in grid] == [16, 32, 64, 128]  # 2 sizes added (--max-size-widen)
  for g in grid:  # widened twice: 16 was at the edge, then inside
    assert g["learning_rates"] == pytest.approx(
      [m * 3e-3 * (g["batch_size"] / 32) ** 0.5 for m in (2, 4, 8, 16, 32)]
    )
    assert g["best_multiplier"] == 16.0 and g["bracketed"]
  assert len(trained) == 4 * 5
  assert not pareto_lm.sizes_bracketed(grid)  # 128 is still the best and the largest
  args = protocol_args(fixed=(16, 32, 64), lr_multipliers=(2.0, 4.0, 8.0), max_widen=2)
  train, trained = fake_training(32, 4.0)
  protocol = pareto_lm.Protocol(args, train, RunStore(None, {}))
  grid = protocol.tune_grid(num_train=10_000)
  assert [g["batch_size"] for g in grid] == [16, 32, 64]  # bracketed from the start
  assert [g["bracketed"] for g in grid] == [True, True, True] and pareto_lm.sizes_bracketed(grid)
  best = protocol.best_fixed(grid)
  assert dict(best.options)["initial_batch_size"] == 32 and best.lr == pytest.approx(1.2e-2)
  adaptive = protocol.adaptive_specs(best, num_train=10_000)
  names = [(s.controller, s.lr_coupling) for s in adaptive if s.seed == 0]
  assert names == [
    ("allowance", "peak"),
    ("allowance", "full"),
    ("simigrad", "full"),
    ("simigrad", "full"),
    ("simigrad", "peak"),
    ("simigrad", "peak"),
    ("gns", "peak"),
  ]
  assert {s.lr for s in adaptive} == {best.lr} and {s.seed for s in adaptive} == {0, 1}
  allowance = dict(adaptive[0].options)
  assert (allowance["initial_batch_size"], allowance["token_allowance"]) == (32, 1.1)
  assert allowance["batch_size_upper_bound"] == 16 * 32
  protocol.args.ramps = ("doubling_warmup", "seesaw")
  ramps = [s for s in protocol.adaptive_specs(best, 10_000) if s.controller in pareto_lm.RAMPS]
  assert {(s.controller, s.lr_coupling) for s in ramps} == {
    ("doubling_warmup", "peak"),
    ("seesaw", "full"),  # its schedule is built for the full coupling
  }


def test_toy_comparison_end_to_end_and_resumed(tmp_path):
  rng = np.random.default_rng(0)
  words = ("the", "king", "and", "queen", "of", "rome", "shall", "speak")
  text = tmp_path / "generated.txt"
  text.write_text(" ".join(words[i] for i in rng.integers(0, len(words), 1500)))
  out = tmp_path / "lm.json"
  # One constant size at three learning rates, nothing widened; the adaptive runs within [16, 16]
  # (the fixed runs' compiled shape, from the shared cache), the ramps left out.
  # fmt: off
  argv = [
    "--text-file", str(text), "--seeds", "0", "--seq-length", "8", "--hidden", "16",
    "--budget-windows", "96", "--eval-windows", "8", "--evals", "3", "--fixed", "16",
    "--lr-multipliers", "1,2,4", "--max-widen", "0", "--max-size-widen", "0",
    "--lr-batch-size", "16",
    "--base-lr", "1e-2", "--upper-factor", "1", "--targets", "0.3", "--gns", "",
    "--ramps", "", "--out", str(out),
  ]
  # fmt: on
  store = pathlib.Path(str(out) + ".runs.jsonl")
  with mock.patch.object(pareto_lm.Protocol, "repeat", side_effect=KeyboardInterrupt):
    with pytest.raises(KeyboardInterrupt):  # killed after every run but the repeat
      pareto_lm.main(argv)
  finished = len(store.read_text().splitlines()) - 1
  results = pareto_lm.main(argv)
  assert results["runs_read_back"] == finished and not store.exists()
  written = json.loads(out.read_text())
  assert written["token_allowance"] == 1.1
  [grid] = written["fixed_grid"]
  assert grid["batch_size"] == 16 and len(grid["learning_rates"]) == 3
  best = written["best_fixed"]
  assert (best["batch_size"], best["learning_rate"]) == (16, grid["best_learning_rate"])
  controllers = {r["controller"] for r in written["runs"]}
  assert controllers == {"fixed", "allowance", "simigrad"}
  for run in written["runs"]:
    assert {"setting", "seed", "learning_rate", "steps_to_target", "final_val_loss"} <= set(run)
    assert (run["controller"] == "fixed") == ("batch_size" in run)
    share = 1.0 if run["controller"] == "fixed" else 1.1
    assert run["budget_share"] == share and run["tokens"] == round(96 * share) * 8
    assert run["curve"][0][:2] == [0, 0] and run["curve"][-1][1] == run["tokens"]
  couplings = {r["lr_coupling"] for r in written["runs"] if r["controller"] == "simigrad"}
  assert couplings == {"full", "peak"}
  repeat = written["reproducibility"]
  assert repeat["abs_diff"] == pytest.approx(abs(repeat["first"] - repeat["second"]), abs=1e-6)
  assert written["unigram_entropy"] > 0 and (tmp_path / "lm.png").stat().st_size > 0
  # A setting the protocol gained after the budget finished: --extend trains only its runs.
  extended = pareto_lm.main([*argv, "--extend", "--targets", "0.3,0.5"])
  assert extended["runs_read_back"] == len(written["runs"])
  assert extended["experiment"] == written["experiment"]
  added = [r for r in extended["runs"] if r["options"].get("similarity_target") == 0.5]
  assert len(extended["runs"]) == len(written["runs"]) + len(added) and len(added) == 2
  assert pareto_lm.main(["--replot", str(out), "--png", str(tmp_path / "again.png")]) == {}
  assert (tmp_path / "again.png").stat().st_size > 0


def test_the_launcher_runs_each_budget_at_low_priority_and_resumes_after_a_failure(tmp_path):
  import subprocess  # pylint: disable=import-outside-toplevel

  fake = tmp_path / "python"  # fails its first call, as a killed comparison would
  fake.write_text(
    f'#!/bin/sh\necho "$@ nice=$(nice)" >> {tmp_path}/calls\n'
    f"[ -e {tmp_path}/once ] || {{ touch {tmp_path}/once; exit 9; }}\n"
  )
  fake.chmod(0o755)
  script = pathlib.Path(pareto_lm.__file__).with_name("run_lm_budgets.sh")
  env = {"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "LM_LOGS": str(tmp_path / "logs")}
  done = subprocess.run([str(script), "--foreground", "long", "today"], env=env, check=False)
  assert done.returncode == 0
  calls = (tmp_path / "calls").read_text().splitlines()
  assert calls == [
    "benchmarks/lm/pareto_lm.py --budget long nice=19",
    "benchmarks/lm/pareto_lm.py --budget long nice=19",
    "benchmarks/lm/pareto_lm.py --budget today nice=19",
  ]
  assert (
    "budget long stopped (exit 9); resuming" in (tmp_path / "logs/pareto_lm_long.log").read_text()
  )
  bad = subprocess.run(
    [str(script), "weekly"], env=env, capture_output=True, text=True, check=False
  )
  assert bad.returncode == 2 and "unknown argument 'weekly'" in bad.stderr


def test_extend_reads_a_result_written_before_results_recorded_their_experiment(tmp_path):
  root = pathlib.Path(pareto_lm.__file__).resolve().parents[1] / "results"
  long = json.loads((root / "pareto_lm_long.json").read_text())
  assert "experiment" not in long  # the long budget's JSON, as it was committed
  key = pareto_lm._experiment_key(pareto_lm._parse_args(["--budget", "long"]))
  assert pareto_lm.legacy_experiment(long) == key
  today = json.loads((root / "pareto_lm.json").read_text())  # one that records it agrees
  assert pareto_lm.legacy_experiment(today) == today["experiment"]
  store = RunStore(tmp_path / "long.runs.jsonl", key)
  assert store.read_back({**long, "experiment": key}, "pareto_lm_long.json") == len(long["runs"])
  with pytest.raises(ValueError, match=r"lacks \['budget_windows'\]"):
    pareto_lm.legacy_experiment({k: v for k, v in long.items() if k != "budget_windows"})
