"""benchmarks/cluster/cluster_time.py: the fit and the out-of-sample table, and the committed results."""

import json
import pathlib

import pytest

from benchmarks.cluster import cluster_time as benchmark
from simigrad_jax.cluster_time.model import CpuStepModel

ROOT = pathlib.Path(__file__).resolve().parents[3]
INFO = {
  "lm": {
    "description": "a model",
    "parameters": 1000,
    "gradient_bytes": 4000,
    "tokens_per_example": 64,
    "flops_per_example": 1e6,
  }
}


def _points(model: CpuStepModel, scale: dict[tuple[int, int], float]) -> list[dict]:
  return [
    {
      "model": "lm",
      "devices": n,
      "batch_size": b,
      "measured_s": model.seconds(b, n, 1e-3) * scale.get((n, b), 1.0),
      "host_s": 1e-3,
      "role": "validation" if b == 64 else "calibration",
    }
    for n in (1, 2, 4, 8)
    for b in (16, 64, 128)
  ]


def test_points_the_model_makes_are_predicted_out_of_sample_and_pass():
  truth = CpuStepModel(2e-3, 1e-4, 5e-4, cores=2)
  results = benchmark.summarize(INFO, _points(truth, {}), cores=2)
  assert results["goal"]["pass"] and results["max_abs_error"] < 1e-9
  assert [v["batch_size"] for v in results["validation"]] == [64] * 4
  assert len(results["calibration"]) == 8
  assert {"devices", "batch_size", "measured_s", "predicted_s"} <= set(results["validation"][0])
  model = results["models"]["lm"]
  assert model["device_curve"] == pytest.approx(
    {"overhead_s": 2e-3, "seconds_per_example": 1e-4, "seconds_per_example_squared": 0.0}
  )
  assert model["cpu_fit"]["cores"] == 2 and model["cpu_fit"]["device_parallelism"] == 1.0
  assert model["host_s"] == 1e-3 and model["gradient_bytes"] == 4000


def test_a_point_the_model_cannot_explain_fails_the_goal():
  truth = CpuStepModel(2e-3, 1e-4, 5e-4, cores=2)
  results = benchmark.summarize(INFO, _points(truth, {(4, 64): 1.5}), cores=2)
  assert results["max_abs_error"] == pytest.approx(1 - 1 / 1.5)  # the fit never saw it
  worst = max(results["validation"], key=lambda v: abs(v["error"]))
  assert (worst["devices"], worst["batch_size"]) == (4, 64) and worst["error"] < -0.15
  assert not results["goal"]["pass"]


def test_the_printed_table_names_the_calibration_and_the_fit():
  truth = CpuStepModel(2e-3, 1e-4, 5e-4, cores=2, launch_s=1e-3, device_parallelism=1.5)
  points = _points(truth, {(1, 16): 1.1})  # a calibration point 10% slower than the model
  table = benchmark._format_table(benchmark.summarize(INFO, points, cores=2))  # pylint: disable=protected-access
  assert "the model fitted to the calibration points, batches lm 16, 128, within" in table
  assert "over 1.5 of the 2 cores" in table
  assert "goal: every point within 15%" in table


def test_a_worker_gets_its_own_device_count():
  env = benchmark._worker_env(2)  # pylint: disable=protected-access
  assert "--xla_force_host_platform_device_count=2" in env["XLA_FLAGS"]
  assert env["XLA_FLAGS"].count("device_count") == 1


def test_the_defaults_write_the_results_and_the_docs_copy():
  args = benchmark._parse_args([])  # pylint: disable=protected-access
  assert args.out == str(ROOT / "benchmarks" / "results" / "cluster_time.json")
  assert args.docs_json == str(ROOT / "docs" / "cluster_time.json")
  quick = benchmark._parse_args(["--quick"])  # pylint: disable=protected-access
  assert quick.out.endswith("cluster_time_quick.json") and quick.docs_json == ""
  with pytest.raises(ValueError, match="--devices 3: every batch size must be a multiple"):
    benchmark._parse_args(["--devices", "3"])  # pylint: disable=protected-access
  # The sweep times the calibration's batches and the validation's, each once.
  sizes = benchmark._sweep_sizes(args)  # pylint: disable=protected-access
  assert sizes["lm"] == sorted({*args.batch_sizes["lm"], *args.calibration_batch_sizes["lm"]})
  assert set(args.batch_sizes["mnist"]).isdisjoint(args.calibration_batch_sizes["mnist"])


def test_the_docs_copy_is_the_committed_results():
  results = json.loads((ROOT / "benchmarks" / "results" / "cluster_time.json").read_text())
  docs = json.loads((ROOT / "docs" / "cluster_time.json").read_text())
  assert docs == benchmark.docs_subset(results)
  assert {"devices", "batch_size", "measured_s", "predicted_s"} <= set(docs["validation"][0])
  assert set(docs["answers"]) == {"lm", "mnist"}
  for answer in docs["answers"].values():
    assert answer["h100"]["devices"] == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert set(answer["h100"]["crossover"]) == {"nvlink", "ethernet"}


def test_results_md_holds_the_tables_of_the_committed_results():
  results = json.loads((ROOT / "benchmarks" / "results" / "cluster_time.json").read_text())
  page = (ROOT / "docs" / "results.md").read_text()
  assert benchmark.markdown(results) in page, (
    "docs/results.md's cluster_time tables differ from benchmarks/results/cluster_time.json; "
    "print them with python benchmarks/cluster/cluster_time.py --markdown "
    "benchmarks/results/cluster_time.json"
  )
  within = sum(abs(v["error"]) <= benchmark.GOAL for v in results["validation"])
  worst = f"{results['max_abs_error']:.1%}"
  assert f"{within} of the {len(results['validation'])} points are, the worst is off" in page
  assert f"by {worst}" in page and results["goal"]["pass"] is False
