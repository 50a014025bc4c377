"""benchmarks/cold_start/cold_start.py: a reduced run of the demo, cold then warm, and its table."""

import json
import pathlib

import pytest

from benchmarks.cold_start import cold_start

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def reduced_run(tmp_path_factory):
  """The demo adaptive, 2 steps, one seed, cold then warm: (the JSON written, the runs' root)."""
  tmp = tmp_path_factory.mktemp("cold_start")
  out = tmp / "cold_start.json"
  argv = ["--recipes", "demo", "--variants", "adaptive", "--seeds", "1", "--steps", "2"]
  cold_start.main([*argv, "--device", "cpu", "--out", str(out), "--workdir", str(tmp / "runs")])
  return json.loads(out.read_text()), tmp / "runs"


def test_a_warm_cache_in_a_new_workdir_compiles_nothing(reduced_run):
  result, root = reduced_run
  cold, warm = result["runs"]
  assert [(r["variant"], r["cache"]) for r in (cold, warm)] == [
    ("adaptive", "cold"),
    ("adaptive", "warm"),
  ]
  assert "failed" not in cold and "failed" not in warm, (cold.get("failed"), warm.get("failed"))
  assert cold["steps"] == warm["steps"] == 2
  assert cold["programs_compiled"] >= 1 and cold["compile_cache_hits"] == 0
  assert warm["programs_compiled"] == 0 and warm["compile_cache_hits"] >= 1
  assert warm["eval_accuracy"] == cold["eval_accuracy"]  # the same programs, loaded
  assert sorted(path.name for path in root.iterdir() if "cache" not in path.name) == [
    "demo-adaptive-0-cold",
    "demo-adaptive-0-warm",
  ]


def test_the_summary_and_the_table_are_the_runs(reduced_run):
  result, _ = reduced_run
  rows = result["summary"]
  assert [(r["variant"], r["cache"], r["runs"]) for r in rows] == [
    ("adaptive", "cold", 1),
    ("adaptive", "warm", 1),
  ]
  cold_run, cold_row = result["runs"][0], rows[0]
  assert cold_row["compile_wait_seconds"]["mean"] == cold_run["compile_wait_seconds"]
  assert cold_row["waited_over_fixed"] is None  # no fixed run to pair with
  for run in result["runs"]:  # the waits split at the first step, and their share of the runtime
    waited = run["compile_wait_seconds"]
    assert 0 <= run["first_step_wait_seconds"] <= waited
    assert run["first_step_wait_seconds"] + run["later_wait_seconds"] == pytest.approx(waited)
    assert run["waited_fraction"] == pytest.approx(waited / run["seconds"])
    assert 0 < run["setup_seconds"] < run["seconds"]
    before, after = run["load_average"]  # the machine's, around the run
    assert before >= 0 and after >= 0
  table = cold_start.markdown(result).splitlines()
  assert len(table) == 2 + 2
  assert table[2].startswith(f"| demo | cold | adaptive | {cold_run['programs_compiled']} (0) |")


def test_paired_ratios_and_spreads_come_from_the_same_seed():
  runs = [
    {"recipe": "lm", "variant": v, "seed": s, "cache": "cold", "compile_wait_seconds": w}
    for v, s, w in [
      ("fixed", 0, 2.0),
      ("adaptive", 0, 3.0),
      ("fixed", 1, 4.0),
      ("adaptive", 1, 2.0),
    ]
  ]
  rows = {row["variant"]: row for row in cold_start.summarize(runs)}
  assert rows["adaptive"]["waited_over_fixed"] == pytest.approx((1.5 + 0.5) / 2)
  assert rows["fixed"]["waited_over_fixed"] == pytest.approx(1.0)
  assert rows["adaptive"]["compile_wait_seconds"] == {"mean": 2.5, "min": 2.0, "max": 3.0}
  assert list(rows) == ["adaptive", "fixed"]  # the order of VARIANTS


def test_a_setting_given_with_set_reaches_every_runs_command_after_its_variants():
  args = cold_start.parse_args(["--set", "steps_per_compile=256", "--set", "whole_rows=True"])
  assert args.set == {"steps_per_compile": "256", "whole_rows": "True"}
  before = cold_start.run_command("lm", "before", 0, "w", "c", args)
  assert before.index("--config.steps_per_compile=256") > before.index("--config.shapes_per_step=1")
  assert "--config.steps_per_compile=4.0" not in before  # the variant's own, replaced
  assert "--config.whole_rows=True" in cold_start.run_command("demo", "fixed", 1, "w", "c", args)
  with pytest.raises(SystemExit):
    cold_start.parse_args(["--set", "steps_per_compile"])


def test_unknown_names_are_refused():
  with pytest.raises(SystemExit, match="--recipes='mnist': choose from"):
    cold_start.parse_args(["--recipes", "mnist"])


@pytest.mark.parametrize("name", ["cold_start", "cold_start_lm_seeds"])
def test_the_docs_table_is_the_committed_json(name):
  result_path = ROOT / "benchmarks" / "results" / f"{name}.json"
  page = (ROOT / "docs" / "results.md").read_text()
  command = f"python benchmarks/cold_start/cold_start.py --markdown benchmarks/results/{name}.json"
  start, end = f"<!-- {name} table: {command} -->\n", f"\n<!-- end {name} table -->"
  assert start in page and end in page, "docs/results.md lost the markers of the cold-start table"
  block = page[page.index(start) + len(start) : page.index(end)]
  assert block == cold_start.markdown(json.loads(result_path.read_text())), (
    f"docs/results.md's cold-start table differs from the JSON; regenerate it with {command}"
  )
