"""benchmarks/trainer_overhead/measure_every.py: a quick run, its JSON, its ratios and its table."""

import json
import math
import pathlib

import pytest

from benchmarks.trainer_overhead import measure_every

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
  """One ``--quick`` run: (the JSON written to --out, the dict main returned)."""
  out = tmp_path_factory.mktemp("measure_every") / "measure_every.json"
  returned = measure_every.main(["--quick", "--out", str(out)])
  return json.loads(out.read_text()), returned


def test_every_k_has_a_row_on_each_device_count(quick_run):
  written, returned = quick_run
  assert written == returned
  assert sorted(written["devices"]) == ["1", "8"]
  assert written["settings"]["steps_per_round"] % max(measure_every.EVERY) == 0
  for count, part in written["devices"].items():
    assert part["device"]["devices_visible"] == int(count)
    assert len(part["load_average"]) == 2 and min(part["load_average"]) >= 0
    assert list(part["rows"]) == [str(k) for k in measure_every.EVERY]
    for every, row in part["rows"].items():
      assert row["halves"] == ("local" if count == "1" else "device")
      assert row["batch_sizes"] == [measure_every.QUICK["batch"]]
      for key in ("paired_time_ratio", "paired_cpu_ratio", "step_seconds", "plain_step_seconds"):
        value = row[key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (count, every)
      assert (measure_every.met_goal(every, row) is None) == (int(every) not in measure_every.GOAL)


def test_each_program_s_cost_is_the_compiler_s(quick_run):
  """The plain jax.jit step's and AdaptiveStep's two programs, each with its memory traffic,
  arithmetic and temporaries, and one docs row each per device count."""
  written, _ = quick_run
  names = ["plain_jit", "adaptive_step_fused", "adaptive_step_plain"]
  for part in written["devices"].values():
    assert sorted(part["programs"]) == sorted(names)
    for cost in part["programs"].values():
      assert cost["bytes_accessed"] > 0 and cost["flops"] > 0 and cost["temp_bytes"] >= 0
  lines = measure_every.programs_table(written).splitlines()
  assert len(lines) == 2 + 2 * len(names)
  plain = written["devices"]["1"]["programs"]["adaptive_step_plain"]
  ratio = (
    plain["bytes_accessed"] / written["devices"]["1"]["programs"]["plain_jit"]["bytes_accessed"]
  )
  assert any(
    line.startswith("| 1 | `AdaptiveStep`'s plain step | ") and f"| {ratio:.2f}x |" in line
    for line in lines
  )


def test_the_docs_table_has_a_row_per_device_count(quick_run):
  written, _ = quick_run
  lines = measure_every.markdown_table(written).splitlines()
  assert len(lines) == 2 + 2 * 2  # wall clock and CPU seconds per device count
  row = written["devices"]["8"]["rows"]["4"]
  assert lines[4].startswith("| 8 | wall | ") and f"{row['paired_time_ratio']:.2f}x" in lines[4]
  assert (
    lines[5].startswith("| 8 | CPU seconds | ") and f"{row['paired_cpu_ratio']:.2f}x" in lines[5]
  )


@pytest.mark.parametrize(
  "argv", [["--batch", "20"], ["--rounds", "0"], ["--widths", "0"], ["--devices", "0"]]
)
def test_bad_settings_are_refused(argv, capsys):
  with pytest.raises(SystemExit):
    measure_every.main(["--quick", *argv])
  assert argv[0] in capsys.readouterr().err


def test_the_docs_table_is_the_committed_results():
  committed = json.loads((ROOT / "benchmarks" / "results" / "measure_every.json").read_text())
  page = (ROOT / "docs" / "results.md").read_text()
  assert measure_every.markdown_table(committed) in page
  assert measure_every.programs_table(committed) in page
  assert committed["settings"]["batch"] == 256 and committed["settings"]["rounds"] == 15
  assert sorted(committed["devices"]) == ["1", "8"]
