"""benchmarks/step_cost/halves.py: a quick run, its JSON layout and its ratios."""

import json
import math

import pytest

PER_SIZE_KEYS = (
  "step_seconds",
  "compile_seconds",
  "temp_bytes",
  "time_ratio_to_plain",
  "temp_ratio_to_plain",
  "paired_time_ratio",
  "min_seconds",
  "min_time_ratio_to_plain",
)


@pytest.fixture(scope="module")
def halves():
  """The benchmark script's module."""
  from benchmarks.step_cost import halves as module  # pylint: disable=import-outside-toplevel

  return module


@pytest.fixture(scope="module")
def quick_run(halves, tmp_path_factory):
  """One ``--quick`` run: (the JSON written to --out, the dict main returned)."""
  out = tmp_path_factory.mktemp("halves") / "halves.json"
  returned = halves.main(["--quick", "--out", str(out)])
  return json.loads(out.read_text()), returned


def test_json_has_both_variants_at_every_batch_size(halves, quick_run):
  written, returned = quick_run
  sizes = [str(size) for size in halves.QUICK["batch_sizes"]]
  assert written["batch_sizes"] == list(halves.QUICK["batch_sizes"])
  assert set(written["variants"]) == {"plain", "halves"}
  for name, by_size in written["variants"].items():
    assert sorted(by_size) == sorted(sizes), name
    for size, entry in by_size.items():
      for key in PER_SIZE_KEYS:
        value = entry[key]
        assert isinstance(value, (int, float)) and math.isfinite(value), (name, size, key)
        assert value > 0, (name, size, key)
      assert isinstance(entry["temp_bytes"], int)
      assert len(entry["seconds"]) == halves.QUICK["repeats"]
      returned_entry = returned["variants"][name][size]
      assert entry["step_seconds"] == pytest.approx(returned_entry["step_seconds"])
  assert written["device"]["devices_used"] == 1
  assert written["device"]["platform"] == "cpu"
  assert written["model"]["width"] == halves.QUICK["width"]


def test_ratios_are_relative_to_plain(quick_run):
  written, _ = quick_run
  for size, plain in written["variants"]["plain"].items():
    assert plain["time_ratio_to_plain"] == plain["temp_ratio_to_plain"] == 1.0
    assert plain["paired_time_ratio"] == plain["min_time_ratio_to_plain"] == 1.0
    entry = written["variants"]["halves"][size]
    assert entry["time_ratio_to_plain"] == pytest.approx(
      entry["step_seconds"] / plain["step_seconds"]
    )
    assert entry["min_time_ratio_to_plain"] == pytest.approx(
      entry["min_seconds"] / plain["min_seconds"]
    )
    assert entry["temp_ratio_to_plain"] == pytest.approx(entry["temp_bytes"] / plain["temp_bytes"])


def test_odd_batch_sizes_are_refused(halves):
  with pytest.raises(SystemExit):
    halves.main(["--quick", "--batch-sizes", "4,7"])
