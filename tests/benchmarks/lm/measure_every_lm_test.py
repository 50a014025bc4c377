"""benchmarks/lm/measure_every_lm.py: the step-cost reading, the paired analysis, a toy run resumed."""

import dataclasses
import json
import math
from unittest import mock

import numpy as np
import pytest

from benchmarks.lm import measure_every_lm as me
from benchmarks.lm.experiment import LmExperiment
from benchmarks.pareto.protocol import comparison_folder


def _record(step, seconds, rows=1, first_run=False, wait=0.0):
  return {
    "step": step,
    "step_seconds": seconds,
    "micro_batch_size": rows,
    "first_run": first_run,
    "compile_wait_step_seconds": wait,
  }


def test_a_block_of_steps_is_timed_whole_from_one_measurement_to_the_next():
  # k = 3: blocks (1, 2, 3), (4, 5, 6), (7, 8, 9), (10, 11, 12), (13).
  records = [
    _record(1, 0.9, first_run=True),  # a program's first run: its block left out
    _record(2, 0.1),
    _record(3, 0.1),
    _record(4, 0.1),  # the time moves between a block's steps; the block costs 0.6
    _record(5, 0.4),
    _record(6, 0.1),
    _record(7, 0.3, rows=2),
    _record(8, 0.3, rows=2),
    _record(9, 0.3, rows=2, wait=0.5),  # waited for a compile: left out
    _record(10, 0.2),
    _record(11, 0.2),
    _record(12, 0.2, rows=2),  # two shapes in one block: left out
    _record(13, 0.2),  # not a whole block (the run's end)
  ]
  assert me.seconds_per_step(records, 3) == {"1": [pytest.approx(0.2), 1]}
  assert me.seconds_per_step(records, 1)["2"] == [pytest.approx(0.3), 3]  # steps 7, 8 and 12


def test_the_loss_difference_interval_resamples_the_seeds():
  mean, lo, hi = me.difference_interval([2.0, 2.1, 2.3], [2.0, 2.0, 2.0])
  assert mean == pytest.approx(0.4 / 3, abs=1e-6) and 0.0 <= lo < mean < hi <= 0.3
  assert me.difference_interval([1.0], [2.0]) == [-1.0, -math.inf, math.inf]


def _run(k, seed, losses, steps, measurements, wall):
  curve = [[s, 100 * s, v] for s, v in zip(np.linspace(0, steps, len(losses)), losses)]
  return {
    "measure_every": k,
    "seed": seed,
    "curve": curve,
    "final_val_loss": losses[-1],
    "avg_batch_size": 8.0,
    "measurements": measurements,
    "steps": steps,
    "tokens": 100 * steps,
    "wall_seconds": wall,
    "compile_seconds": 2.0,
    "seconds_per_step": {"1": [0.1, 10]},
  }


def test_the_analysis_pairs_the_seeds_finished_for_every_k():
  runs = [
    _run(1, 1, [4.0, 3.0, 2.0], 100, 100, 12.0),  # 0.1 s a step
    _run(4, 1, [4.0, 3.0, 2.0], 120, 30, 14.0),  # 0.1 s a step
    _run(1, 2, [4.0, 3.0, 2.4], 100, 100, 22.0),  # k = 1's worst final loss; 0.2 s a step
    _run(4, 2, [4.0, 3.0, 2.6], 120, 30, 14.0),  # never reaches 2.4, 2.45 or 2.5; 0.1 s
    _run(1, 3, [4.0, 2.0, 1.0], 100, 100, 12.0),  # seed 3 never ran k = 4: left out
  ]
  results = me.analyse(runs, (1, 4), 2.5, margin=0.1)
  assert results["seeds"] == [1, 2]
  # Read off the k = 1 runs of the paired seeds (seed 3's 1.0 is not one of them).
  assert results["levels"] == [2.4, 2.45, 2.5]
  k1, k4 = results["per_k"]
  assert (k1["reached"], k1["steps_to_target"]) == (2, pytest.approx(83.3, abs=0.1))
  assert (k4["reached"], k4["steps_to_target_by_seed"]) == (1, [90.0, None])
  assert k4["steps_to_margin_by_seed"] == [pytest.approx(84.0), pytest.approx(120.0)]
  assert k4["step_cost_vs_k1_by_seed"] == [pytest.approx(1.0), pytest.approx(0.5)]
  assert k4["seconds_per_step"] == pytest.approx(0.1) and k1["seconds_per_step"] == 0.15
  assert k4["step_cost_vs_k1"][0] == pytest.approx(0.2 / 0.3, abs=1e-4)  # the means' ratio
  assert k4["step_cost_vs_k1"][1:] == [pytest.approx(0.5), pytest.approx(1.0)]
  assert k1["step_cost_vs_k1"] == [1.0, 1.0, 1.0]
  [paired] = results["paired"]
  hardest = paired["levels"][0]
  # 2.4: k = 1 at 50 + 50 * 0.6 / 1.0 = 80 and at its last evaluation, 100; k = 4 at 96, never.
  assert hardest["k1_range"] == [80.0, 100.0] and hardest["steps_by_seed"] == [96.0, None]
  assert (hardest["reached"], hardest["steps"]) == (1, None)
  assert hardest["steps_ratio_by_seed"] == [1.2, None]
  assert hardest["steps_ratio"][0] is None and hardest["steps_ratio"][2] is None  # unbounded
  assert hardest["outcome"] == "more steps" and not hardest["met"] and not hardest["within"]
  assert not paired["within_at_every_level"] and not paired["met_at_every_level"]
  assert paired["final_val_loss_difference"][0] == pytest.approx(0.1)
  # Differences 0.0 and +0.2: seed 1 resampled alone gives 0.0, the interval's lower end.
  assert paired["final_val_loss_difference"][1:] == [0.0, pytest.approx(0.2)]
  assert paired["final_loss_interval_holds_0"]
  with pytest.raises(ValueError, match="no seed finished every"):
    me.analyse(runs[:1], (1, 4), 2.5)


def _reaching(k, seed, steps_to_two):
  """A run whose curve falls linearly from 3.0 to 1.0, crossing 2.0 at ``steps_to_two``."""
  return {"measure_every": k, "seed": seed, "final_val_loss": 1.0,
          "curve": [[0, 0, 3.0], [2 * steps_to_two, 200 * steps_to_two, 1.0]]}  # fmt: skip


@pytest.mark.parametrize(
  "steps, outcome, within, met",
  [
    ((105.0, 115.0, 112.0), "ties", True, True),  # seed ratios 1.05, 0.96, 1.02
    ((90.0, 108.0, 99.0), "fewer steps", False, True),  # 0.9 in every seed: below the range
    ((108.0, 124.0, 116.0), "more steps", False, False),  # within the range, more in every seed
    ((125.0, 150.0, 137.5), "more steps", False, False),
  ],
)
def test_the_goal_reads_the_mean_against_the_range_and_the_paired_interval(
  steps, outcome, within, met
):
  reference = [_reaching(1, s, b) for s, b in zip((1, 2, 3), (100.0, 120.0, 110.0))]
  runs = [_reaching(4, s, v) for s, v in zip((1, 2, 3), steps)]
  row = me.compare_at(runs, reference, 2.0)
  assert row["k1_range"] == [100.0, 120.0] and row["k1_steps"] == pytest.approx(110.0)
  assert row["steps"] == pytest.approx(np.mean(steps), abs=1e-4)
  assert row["tokens_ratio"][0] == pytest.approx(row["steps_ratio"][0], abs=1e-4)
  assert row["outcome"] == outcome and row["ratio_interval_holds_1"] == (outcome == "ties")
  assert row["mean_within_k1_range"] == (100.0 <= np.mean(steps) <= 120.0)
  assert (row["within"], row["met"]) == (within, met)


def test_a_level_a_k1_run_misses_is_refused():
  reference = [_reaching(1, 1, 100.0), {**_reaching(1, 2, 100.0), "curve": [[0, 0, 3.0]]}]
  with pytest.raises(ValueError, match="a k = 1 run never reaches the loss 2.0"):
    me.compare_at(reference, reference, 2.0)
  assert me.loss_levels(reference) == [1.0, 1.05, 1.1]


def _toy_source(tmp_path, target=2.5):
  """A finished comparison's JSON on a generated text: a tiny model, one SimiGrad setting."""
  rng = np.random.default_rng(0)
  words = ("the", "king", "and", "queen", "of", "rome", "shall", "speak")
  text = tmp_path / "generated.txt"
  text.write_text(" ".join(words[i] for i in rng.integers(0, len(words), 1500)))
  # One size (8 rows, one per device): the two programs of a shape, measuring and plain.
  options = {
    "initial_batch_size": 8,
    "similarity_target": 0.3,
    "batch_size_lower_bound": 8,
    "batch_size_upper_bound": 8,
  }
  simigrad = {"controller": "simigrad", "learning_rate": 1e-2, "lr_multiplier": 1.0,
              "lr_coupling": "full", "budget_share": 1.1, "options": options}  # fmt: skip
  experiment = {"seq_length": 8, "hidden": 16, "budget_windows": 96, "eval_windows": 8,
                "evals": 3, "text_file": str(text)}  # fmt: skip
  source = tmp_path / f"source_{target}.json"
  source.write_text(
    json.dumps(
      {
        "experiment": experiment,
        "target_val_loss": target,
        "settings": [
          {"controller": c, "setting": label, "learning_rate": 1e-2, "final_val_loss": loss}
          for c, label, loss in (
            ("fixed", "B=8", 2.0),
            ("simigrad", "s=0.3 [8,8]", 2.4),
            ("simigrad", "s=0.5 [8,8]", 2.6),
          )
        ],
        "runs": [
          {**simigrad, "setting": "s=0.5 [8,8]", "options": {**options, "similarity_target": 0.5}},
          {**simigrad, "setting": "s=0.3 [8,8]"},
        ],
      }
    )
  )
  return source


def test_the_tuned_setting_is_the_simigrad_setting_of_least_loss(tmp_path):
  source = json.loads(_toy_source(tmp_path).read_text())
  spec, share, label = me.tuned_setting(source)
  assert (label, share, spec.lr, spec.lr_coupling) == ("s=0.3 [8,8]", 1.1, 1e-2, "full")
  assert dict(spec.options)["similarity_target"] == 0.3
  with pytest.raises(ValueError, match="no SimiGrad setting"):
    me.tuned_setting({"settings": source["settings"][:1], "runs": []})


def test_a_toy_run_measures_every_kth_step(tmp_path):
  source = json.loads(_toy_source(tmp_path).read_text())
  spec, share, label = me.tuned_setting(source)
  e = source["experiment"]
  with comparison_folder(None, prefix="measure-every-test-") as root:
    exp = LmExperiment(
      hidden=e["hidden"], seq_length=e["seq_length"], budget_windows=e["budget_windows"],
      max_share=share, eval_windows=e["eval_windows"], evals=e["evals"], root=root,
      keep_workdirs=True, text_file=e["text_file"],
    )  # fmt: skip
    run = me.train(exp, dataclasses.replace(spec, seed=1), label, share, 2, keep=False)
    assert not [p for p in root.iterdir() if p.name.startswith("simigrad-")]  # workdir removed
  assert run["measure_every"] == 2 and "workdir" not in run
  assert run["measurements"] == -(-run["steps"] // 2)  # the steps numbered 0, 2, 4, ...
  assert run["tokens"] == round(96 * 1.1) * 8  # the allowance: 1.1x the budget
  for seconds, blocks in run["seconds_per_step"].values():
    assert seconds > 0 and 1 <= blocks <= run["steps"] // 2


def test_the_runs_go_seed_by_seed_into_the_store_and_resume(tmp_path, capsys):
  source = _toy_source(tmp_path)
  trained = []

  def fake_train(exp, spec, label, share, every, keep):
    trained.append((spec.seed, every))
    losses = [3.0, 2.6, 2.4 + 0.01 * every + 0.001 * spec.seed]
    return {
      "seed": spec.seed,
      "measure_every": every,
      "curve": [[0, 0, 3.0], [50, 3200, losses[1]], [100, 6400, losses[2]]],
      "final_val_loss": losses[2],
      "avg_batch_size": 8.0,
      "measurements": -(-100 // every),
      "steps": 100,
      "tokens": 6400,
      "wall_seconds": 10.0 * (1 + 1 / every),
      "compile_seconds": 0.0,
      "seconds_per_step": {"1": [0.1, 40]},
    }

  out, store = tmp_path / "out.json", tmp_path / "runs.jsonl"
  argv = ["--source", str(source), "--seeds", "2,1", "--every", "1,4", "--out", str(out)]
  argv += ["--readings", "per_measurement", "--store", str(store)]
  put = me.RunStore.put

  def put_then_kill(self, key, run):  # killed once the third run is stored
    put(self, key, run)
    if len(trained) == 3:
      raise KeyboardInterrupt

  with mock.patch.object(me, "train", fake_train):
    with mock.patch.object(me.RunStore, "put", put_then_kill):
      with pytest.raises(KeyboardInterrupt):
        me.main(argv)
    assert trained == [(2, 1), (2, 4), (1, 1)]  # seed by seed, in the order given
    trained.clear()
    first = me.main(argv)
    assert trained == [(1, 4)] and first["runs_read_back"] == 3  # only the run not stored
    assert len(store.read_text().splitlines()) == 1 + 4  # the experiment, then each run
    trained.clear()
    again = me.main(argv)  # every run read back, none trained
  assert trained == [] and again["runs_read_back"] == 4 and again["runs"] == first["runs"]
  written = json.loads(out.read_text())
  assert written["seeds"] == [1, 2] and written["setting"]["label"] == "s=0.3 [8,8]"
  k1, k4 = written["per_k"]
  assert (k1["reached"], k4["reached"]) == (2, 2)  # 2.5 on every curve
  assert k4["step_cost_vs_k1"][0] == pytest.approx(1.25 / 2)
  assert written["paired"][0]["final_val_loss_difference"][0] == pytest.approx(0.03)
  capsys.readouterr()
  assert me.main(["--markdown", str(out)]) == {}
  rows = capsys.readouterr().out.splitlines()
  assert rows[2].startswith("| 1 | 1 | 2/2 |") and rows[3].startswith("| 4 | 1 | 2/2 |")
  other = _toy_source(tmp_path, target=2.4)  # another target: the stored runs are refused
  with pytest.raises(ValueError, match="another experiment"):
    me.main([*argv[:-2], "--store", str(store), "--source", str(other)])


def test_the_readings_are_run_side_by_side_and_k1_once(tmp_path, capsys):
  source = _toy_source(tmp_path)
  trained = []

  def fake_train(exp, spec, label, share, every, keep):
    per_step = dict(spec.options).get("steps_per_update", 1)
    trained.append((spec.seed, every, per_step))
    final = 2.4 + 0.01 * every - 0.02 * (per_step > 1)
    return {
      "seed": spec.seed,
      "measure_every": every,
      "reading": me.reading_of({"options": dict(spec.options)}),
      "options": dict(spec.options),
      "curve": [[0, 0, 3.0], [50, 3200, 2.6], [100 + 10 * every, 6400, final]],
      "final_val_loss": final,
      "avg_batch_size": 8.0,
      "measurements": -(-100 // every),
      "steps": 100,
      "tokens": 6400,
      "wall_seconds": 10.0,
      "compile_seconds": 0.0,
      "seconds_per_step": {"1": [0.1, 40]},
    }

  out, store = tmp_path / "out.json", tmp_path / "runs.jsonl"
  argv = ["--source", str(source), "--seeds", "1,2", "--every", "1,4", "--out", str(out)]
  argv += ["--store", str(store), "--readings", "per_measurement,per_step"]
  with mock.patch.object(me, "train", fake_train):
    results = me.main(argv)
  assert trained == [(1, 1, 1), (1, 4, 1), (1, 4, 4), (2, 1, 1), (2, 4, 1), (2, 4, 4)]
  assert results["variants"] == [[1, "per_measurement"], [4, "per_measurement"], [4, "per_step"]]
  k1, held, rate = results["per_k"]
  assert (held["reading"], rate["reading"]) == ("per_measurement", "per_step")
  assert rate["final_val_loss"] == pytest.approx(2.42) and held["final_val_loss"] == 2.44
  assert [row["reading"] for row in results["paired"]] == ["per_measurement", "per_step"]
  # k = 1 ends at 2.41 (its last evaluation at step 110): the levels 2.41, 2.46, 2.51. One move
  # per measurement crosses 2.46 at 50 + 90 * 0.14 / 0.16 = 128.75, k = 1 at 50 + 60 * 0.14 / 0.19.
  assert results["levels"] == [2.41, 2.46, 2.51]
  held_levels = results["paired"][0]["levels"]
  assert held_levels[1]["steps_by_seed"] == [pytest.approx(128.75)] * 2
  assert held_levels[1]["k1_range"] == [pytest.approx(50 + 60 * 0.14 / 0.19, abs=0.1)] * 2
  assert held_levels[1]["outcome"] == "more steps" and not held_levels[1]["met"]
  assert held_levels[0]["reached"] == 0  # k = 4 ends at 2.44, above k = 1's 2.41
  capsys.readouterr()
  me.main(["--markdown", str(out)])
  rows = capsys.readouterr().out.splitlines()
  assert [row[:13] for row in rows[2:5]] == ["| 1 | 1 | 2/2", "| 4 | 1 | 2/2", "| 4 | 4 | 2/2"]
  with pytest.raises(SystemExit):
    me.main([*argv[:-1], "per_rate"])
  assert "--readings must name some of per_measurement, per_step" in capsys.readouterr().err


def test_a_reading_adds_the_controller_setting_for_k_over_1_only():
  spec = me.RunSpec("simigrad", (("similarity_target", 0.1),), 3e-3, 1.0, 1)
  assert dict(me.read_as(spec, 4, "per_step").options)["steps_per_update"] == 4
  assert me.read_as(spec, 1, "per_step") == spec == me.read_as(spec, 2, "per_measurement")
  assert me.reading_of({"options": {"steps_per_update": 2}}) == "per_step"
  assert me.reading_of({"options": {}}) == me.reading_of({}) == "per_measurement"
