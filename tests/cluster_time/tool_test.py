"""python -m simigrad_jax.cluster_time: times to target and the crossover, on small JSON files."""

import json
import math

import numpy as np
import pytest

from simigrad_jax.cluster_time import DeviceCurve
from simigrad_jax.cluster_time import Link
from simigrad_jax.cluster_time import Setting
from simigrad_jax.cluster_time import StepTimeModel
from simigrad_jax.cluster_time import answer
from simigrad_jax.cluster_time import load_settings
from simigrad_jax.cluster_time import time_to_target
from simigrad_jax.cluster_time.__main__ import main
from simigrad_jax.trainer import MetricsWriter

CALIBRATION = {
  "models": {
    "lm": {
      "gradient_bytes": 1e6,
      "flops_per_example": 4e7,
      "host_s": 0.0,
      "device_curve": {"overhead_s": 1e-3, "seconds_per_example": 1e-5},
    }
  }
}


def _lm_run(controller, setting, steps_to_target, sizes, seed=0):
  return {
    "controller": controller,
    "setting": setting,
    "seed": seed,
    "learning_rate": 0.01,
    "steps_to_target": steps_to_target,
    "steps": 400,
    "batch_sizes": sizes,
  }


# A constant batch of 16 that reaches its target at step 300; SimiGrad from 16, at 64 from
# step 101, reaching it at step 150 (in one of two seeds); a ramp that never reaches it.
PARETO_LM = {
  "task": "causal_lm",
  "runs": [
    _lm_run("fixed", "B=16", 300, [[1, 16], [200, 16]]),
    _lm_run("simigrad", "s=0.1", 150, [[1, 16], [101, 64]]),
    _lm_run("simigrad", "s=0.1", None, [[1, 16], [101, 64]], seed=1),
    _lm_run("linear_ramp", "16->64", None, [[1, 16], [50, 64]]),
  ],
}


@pytest.fixture
def files(tmp_path):
  pareto = tmp_path / "pareto_lm.json"
  pareto.write_text(json.dumps(PARETO_LM))
  calibration = tmp_path / "calibration.json"
  calibration.write_text(json.dumps(CALIBRATION))
  return pareto, calibration


def test_the_settings_of_an_lm_comparison_are_their_steps_up_to_the_target(files):
  settings = {s.label: s for s in load_settings([files[0]])}
  assert settings["B=16 lr=0.01"].trajectories == [[(199.0, 16.0), (101.0, 16.0)]]
  assert settings["s=0.1 lr=0.01"].trajectories == [[(100.0, 16.0), (50.0, 64.0)]]
  assert settings["s=0.1 lr=0.01"].reached == "1/2"
  assert settings["16->64 lr=0.01"].kind == "ramp" and settings["16->64 lr=0.01"].reached == "0/1"


def test_time_to_target_sums_each_segments_steps_times_its_step_time():
  model = StepTimeModel(DeviceCurve(1e-3, 1e-5), 1e6)
  link = Link(1e9, 0.0)
  setting = Setting("s", "simigrad", [[(100, 16), (50, 64)], [(10, 16)]], 2)
  # 8 devices: a step of 16 is 2 rows (1.02 ms), of 64 is 8 rows (1.08 ms); the ring 1.75 ms.
  first = 100 * (1.02e-3 + 1.75e-3) + 50 * (1.08e-3 + 1.75e-3)
  second = 10 * (1.02e-3 + 1.75e-3)
  assert time_to_target(setting, model, 8, link) == pytest.approx((first + second) / 2)
  assert math.isnan(time_to_target(Setting("x", "ramp", [], 1), model, 8, link))


@pytest.mark.parametrize("devices", [True, 16.5, math.inf, 0])
def test_a_device_count_that_is_no_whole_count_is_refused(devices):
  model = StepTimeModel(DeviceCurve(1e-3, 1e-5), 1e6)
  setting = Setting("s", "constant", [[(100, 16)]], 1)
  with pytest.raises(ValueError, match=r"^devices must be an integer >= 1, got "):
    time_to_target(setting, model, devices, Link(1e9, 0.0))
  with pytest.raises(ValueError, match=r"^devices\[1\] must be an integer >= 1, got "):
    answer([setting], model, {"l": Link(1e9, 0.0)}, devices=[8, devices])


def test_numpy_device_counts_are_taken_as_pythons():
  model = StepTimeModel(DeviceCurve(1e-3, 1e-5), 1e6)
  setting = Setting("s", "constant", [[(np.int64(100), np.int64(16))]], 1)
  seconds = time_to_target(setting, model, np.int64(8), Link(1e9, 0.0))
  assert type(seconds) is float and seconds == time_to_target(setting, model, 8, Link(1e9, 0.0))
  result = answer([setting], model, {"l": Link(1e9, 0.0)}, devices=np.array([1, 8]))
  assert result["devices"] == [1, 8] and all(type(n) is int for n in result["devices"])
  with pytest.raises(ValueError, match=r"devices must be a non-empty sequence of integers >= 1"):
    answer([setting], model, {"l": Link(1e9, 0.0)}, devices=[])


def test_fewer_steps_pay_more_where_the_all_reduce_dominates(files):
  settings = load_settings([files[0]])
  model = StepTimeModel(DeviceCurve(1e-3, 1e-5), 1e6)
  # A slow link: SimiGrad's 150 steps beat the constant batch's 300 at every count; at a
  # fast link and one device's compute far costlier per example, its larger batches lose.
  slow = answer(settings, model, {"slow": Link(1e8, 1e-4)}, devices=[1, 8, 64])
  assert slow["crossover"]["slow"]["devices"] == 1
  fast_model = StepTimeModel(DeviceCurve(0.0, 1e-3), 1e3)
  fast = answer(settings, fast_model, {"fast": Link(1e12, 0.0)}, devices=[1, 8, 64])
  best = fast["best"]["fast"]
  # On one device: 300 x 16 ms = 4.8 s against 100 x 16 + 50 x 64 ms = 4.8 s: a tie, no pay.
  assert best["constant"][0]["seconds"] == pytest.approx(4.8)
  assert best["simigrad"][0]["seconds"] == pytest.approx(4.8)
  # On 64 devices every step is one row: steps alone count, and SimiGrad pays.
  assert best["simigrad"][2]["seconds"] < best["constant"][2]["seconds"]
  assert fast["crossover"]["fast"]["devices"] == 8
  # Where it does not pay at this link, a slower one makes it pay: below some bandwidth.
  by_devices = slow["crossover"]["slow"]["bandwidth_by_devices"]
  assert set(by_devices) == {"1", "8", "64"}


def test_the_tool_prints_the_fastest_of_each_family_and_writes_its_answer(files, tmp_path, capsys):
  pareto, calibration = files
  out = tmp_path / "answer.json"
  png = tmp_path / "plot.png"
  args = [str(pareto), "--calibration", str(calibration), "--devices", "8", "64"]
  assert main([*args, "--json", str(out), "--png", str(png)]) == 0
  printed = capsys.readouterr().out
  assert "nvlink: 450 GB/s" in printed and "ethernet: 3.125 GB/s" in printed
  assert "fastest simigrad: s=0.1 lr=0.01" in printed
  result = json.loads(out.read_text())
  assert result["devices"] == [8, 64]
  assert {row["label"] for row in result["settings"]} == {"B=16 lr=0.01", "s=0.1 lr=0.01"}
  assert png.stat().st_size > 0


def test_a_given_link_and_a_device_preset(files, capsys):
  pareto, calibration = files
  args = [str(pareto), "--calibration", str(calibration), "--device", "h100"]
  assert main([*args, "--link", "--bandwidth", "12.5", "--latency-us", "10", "--devices", "8"]) == 0
  assert "given: 12.5 GB/s, 10 us a ring step" in capsys.readouterr().out


def test_a_runs_metrics_against_the_same_examples_at_its_average_batch(tmp_path, files, capsys):
  run = tmp_path / "my_run"
  with MetricsWriter(run) as writer:
    for step, size in enumerate([16, 16, 32, 64], start=1):
      writer.write({"step": step, "batch_size": size})
  settings = {s.label: s for s in load_settings([run / "metrics.jsonl"])}
  assert settings["my_run"].trajectories == [[(1.0, 16.0), (1.0, 16.0), (1.0, 32.0), (1.0, 64.0)]]
  assert settings["my_run held at its average B=32.0"].trajectories == [[(4, 32.0)]]
  args = [str(run / "metrics.jsonl"), "--calibration", str(files[1]), "--model", "lm"]
  assert main([*args, "--devices", "8"]) == 0
  assert "fastest adaptive: my_run" in capsys.readouterr().out


@pytest.mark.parametrize(
  "extra, message",
  [
    (["--link", "infiniband", "token-ring"], "unknown --link preset 'token-ring': use one of"),
    (["--device", "tpu9"], "unknown --device 'tpu9': use measured or one of h100"),
    (["--model", "resnet"], "the calibration has no model 'resnet': use --model with one of"),
    (["--devices", "0"], "--devices must all be >= 1"),
    (["--link", "--bandwidth", "-1"], "--bandwidth must be > 0 GB/s"),
  ],
)
def test_bad_input_is_one_line_that_names_the_fix(files, capsys, extra, message):
  pareto, calibration = files
  with pytest.raises(SystemExit) as exit_info:
    main([str(pareto), "--calibration", str(calibration), *extra])
  assert exit_info.value.code == 2
  error = capsys.readouterr().err
  assert error.count("\n") == 1 and message in error, error


def test_a_file_without_trajectories_is_one_line_that_names_the_fix(files, tmp_path, capsys):
  other = tmp_path / "other.json"
  other.write_text(json.dumps({"runs": [{"controller": "fixed"}]}))
  with pytest.raises(SystemExit):
    main([str(other), "--calibration", str(files[1])])
  error = capsys.readouterr().err
  assert error.count("\n") == 1
  assert "holds no runs with batch-size trajectories: give a Pareto comparison's JSON" in error
  with pytest.raises(SystemExit):
    main([str(files[0]), "--calibration", str(tmp_path / "missing.json")])
  assert "run benchmarks/cluster/cluster_time.py or give --calibration" in capsys.readouterr().err
