"""Where the benchmarks write: their JSON in benchmarks/results/, the plots the docs show in docs/."""

import importlib
import os
import pathlib
import re
import subprocess

import pytest

from benchmarks import common
from benchmarks.pareto import pareto

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SCRIPTS = sorted(  # ROOM/NAME, each script's path in benchmarks/ without ".py"
  path.relative_to(ROOT / "benchmarks").with_suffix("").as_posix()
  for path in (ROOT / "benchmarks").rglob("*.py")
  if re.search(r"^def main\(", path.read_text(), re.M)
)


def test_the_default_json_lies_in_benchmarks_results():
  assert pathlib.Path(common.RESULTS_DIR) == RESULTS
  assert common.out_path(None, "halves") == str(RESULTS / "halves.json")
  assert common.out_path(None, "halves", quick=True) == str(RESULTS / "halves_quick.json")
  assert common.out_path("/tmp/mine.json", "halves", quick=True) == "/tmp/mine.json"
  assert common.out_path("", "halves") == ""  # --out '': no file


def test_a_result_in_benchmarks_results_draws_its_plot_in_docs():
  assert common.plot_path(None, str(RESULTS / "pareto_mnist.json")) == str(
    ROOT / "docs" / "pareto_mnist.png"
  )
  assert common.plot_path(None, "/tmp/lm.json") == "/tmp/lm.png"
  assert common.plot_path("/tmp/p.png", str(RESULTS / "pareto_mnist.json")) == "/tmp/p.png"
  assert common.plot_path(None, "") is None
  assert common.repository_path(ROOT / "docs" / "pareto_mnist.png") == "docs/pareto_mnist.png"
  assert common.repository_path("/tmp/lm.png") == "/tmp/lm.png"


@pytest.mark.parametrize(
  "task, dataset, quick, committed",
  [
    ("images", "mnist", False, "pareto_mnist"),
    ("images", "digits", True, "pareto_quick"),
    ("mlm", "text", False, "pareto_mlm"),
  ],
)
def test_the_pareto_runs_the_docs_show_write_the_committed_files(task, dataset, quick, committed):
  out = common.out_path(None, pareto.result_name(task, dataset, quick), quick)
  assert out == str(RESULTS / f"{committed}.json") and os.path.exists(out)
  plot = common.plot_path(None, out)
  assert plot == str(ROOT / "docs" / f"{committed}.png") and os.path.exists(plot)
  assert pareto.result_name("mlm", "text", True) == "pareto_mlm"  # + _quick: never the full run's


@pytest.mark.parametrize(
  "name, argv, result",
  [
    ("step_cost/halves", ["--quick"], "halves_resnet_quick"),
    ("step_cost/halves_steps", ["--quick"], "halves_quick"),
    ("step_cost/halves_steps", [], "halves"),
    ("trainer_overhead/overhead", ["--quick"], "overhead_quick"),
    ("trainer_overhead/overhead_adaptive", ["--quick"], "overhead_adaptive_quick"),
    ("trainer_overhead/adaptive_loop", [], "adaptive_loop"),
    ("trainer_overhead/measure_every", [], "measure_every"),
    ("step_cost/reduction", [], "reduction"),
    ("step_cost/sharded", ["--quick"], "sharded_quick"),
    ("step_cost/sharded_memory", ["--quick"], "sharded_memory_quick"),
    ("trainer_overhead/switching", ["--quick"], "switching_quick"),
    ("lm/pareto_lm", ["--quick"], "pareto_lm_quick"),
  ],
)
def test_each_benchmark_writes_its_json_to_benchmarks_results_by_default(name, argv, result):
  module = importlib.import_module(f"benchmarks.{name.replace('/', '.')}")
  args = module._parse_args(argv)  # pylint: disable=protected-access
  assert args.out == str(RESULTS / f"{result}.json")
  assert module._parse_args([*argv, "--out", "/tmp/x.json"]).out == "/tmp/x.json"  # pylint: disable=protected-access


# Scripts that write one JSON per task take a folder, --results, not --out: benchmarks/results/ too.
PER_TASK_RESULTS = {"lm/verdict_lm": "lm_<task>.json"}


@pytest.mark.parametrize("name", sorted(PER_TASK_RESULTS))
def test_a_script_of_one_json_per_task_writes_them_to_benchmarks_results(name):
  source = (ROOT / "benchmarks" / f"{name}.py").read_text()
  assert "pathlib.Path(common.RESULTS_DIR)" in source and '"--results"' in source, name
  assert f"benchmarks/results/{PER_TASK_RESULTS[name]}" in source, name
  module = importlib.import_module(f"benchmarks.{name.replace('/', '.')}")
  assert module.RESULTS == RESULTS


@pytest.mark.parametrize("name", [name for name in SCRIPTS if name not in PER_TASK_RESULTS])
def test_every_script_takes_its_out_flag_and_path_from_common(name):
  source = (ROOT / "benchmarks" / f"{name}.py").read_text()
  flags = (
    (ROOT / "benchmarks" / "pareto" / "flags.py").read_text() if name == "pareto/pareto" else source
  )
  assert '"--out"' not in source, f"{name}.py adds --out itself; use common.add_out_flag"
  assert "common.add_out_flag(" in flags or '"--out"' in flags, name
  assert "common.out_path(" in source, f"{name}.py does not resolve --out with common.out_path"
  assert "benchmarks/results/" in source, f"{name}.py's docstring does not say where its JSON goes"


def test_the_code_version_names_the_commit_and_whether_the_code_differs(tmp_path, monkeypatch):
  def git(*args):
    subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

  git("init", "-q")
  (tmp_path / "benchmarks" / "results").mkdir(parents=True)
  (tmp_path / "code.py").write_text("x = 1\n")
  (tmp_path / "benchmarks" / "results" / "runs.jsonl").write_text("{}\n")
  git("add", "-A")
  git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
  monkeypatch.setattr(common, "REPOSITORY_ROOT", str(tmp_path))
  head = subprocess.run(
    ["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True, check=True
  ).stdout.strip()
  assert common.code_version() == {"commit": head, "changed": False}
  (tmp_path / "benchmarks" / "results" / "runs.jsonl").write_text("{}\n{}\n")  # results grow
  assert common.code_version() == {"commit": head, "changed": False}
  (tmp_path / "code.py").write_text("x = 2\n")  # the code does not
  assert common.code_version() == {"commit": head, "changed": True}
  monkeypatch.setattr(common, "REPOSITORY_ROOT", str(tmp_path / "benchmarks"))  # still inside
  assert common.code_version()["commit"] == head
  monkeypatch.setattr(common, "REPOSITORY_ROOT", "/")  # no repository
  assert common.code_version() is None
