"""benchmarks/trainer_overhead/overhead.py: a quick run, its JSON layout and its ratios."""

import json
import math
import numbers

import pytest


@pytest.fixture(scope="module")
def overhead():
  """The benchmark script's module."""
  from benchmarks.trainer_overhead import overhead as module  # pylint: disable=import-outside-toplevel

  return module


@pytest.fixture(scope="module")
def quick_run(overhead, tmp_path_factory):
  """One ``--quick`` run: (the JSON written to --out, the dict main returned)."""
  out = tmp_path_factory.mktemp("overhead") / "overhead.json"
  returned = overhead.main(["--quick", "--steps", "3", "--rounds", "2", "--out", str(out)])
  return json.loads(out.read_text()), returned


def _positive(value) -> bool:
  return (
    isinstance(value, numbers.Real)
    and not isinstance(value, bool)
    and math.isfinite(value)
    and value > 0
  )


def test_layout_and_every_number_finite_and_positive(quick_run, overhead, devices):
  written, returned = quick_run
  assert written["devices"] == len(devices) == 8
  assert written["global_batch_size"] == overhead.QUICK["batch_size"]
  assert list(written["models"]) == ["mlp"]
  assert written["variants"] == written["models"]["mlp"]["variants"]
  assert set(written["variants"]) == set(overhead.VARIANTS)
  for name, variant in written["variants"].items():
    for key in (
      "examples_per_second",
      "ratio_to_plain",
      "ratio_to_plain_paired",
      "average_batch_size",
    ):
      assert _positive(variant[key]), (name, key, variant[key])
    rounds = variant["examples_per_second_rounds"]
    assert len(rounds) == written["rounds"] == 2 and all(map(_positive, rounds)), name
    assert min(rounds) <= variant["examples_per_second"] <= max(rounds), name
    assert variant["examples_per_second"] == pytest.approx(
      returned["variants"][name]["examples_per_second"]
    )
    # Optional Trainer reports: absent (None) or a positive number.
    critical = variant["host_seconds"]
    assert critical is None or _positive(critical), name
    for value in (variant["step_memory"] or {}).values():
      assert value is None or (isinstance(value, int) and value >= 0), name


def _numbers(tree, where=""):
  """Every number in a JSON tree, with where it is."""
  if isinstance(tree, dict):
    for key, value in tree.items():
      yield from _numbers(value, f"{where}.{key}")
  elif isinstance(tree, list):
    for i, value in enumerate(tree):
      yield from _numbers(value, f"{where}[{i}]")
  elif isinstance(tree, numbers.Real) and not isinstance(tree, bool):
    yield where, tree


def test_every_number_in_the_json_is_finite_and_not_negative(quick_run):
  found = dict(_numbers(quick_run[0]))
  assert len(found) > 50
  for where, value in found.items():
    assert math.isfinite(value) and value >= 0, (where, value)


def test_ratios_are_relative_to_plain(quick_run):
  variants = quick_run[0]["variants"]
  plain = variants["plain"]
  assert plain["ratio_to_plain"] == 1.0
  assert plain["ratio_to_plain_paired"] == 1.0
  assert plain["ratio_to_plain_paired_range"] == [1.0, 1.0]
  for name, variant in variants.items():
    assert variant["ratio_to_plain"] == pytest.approx(
      variant["examples_per_second"] / plain["examples_per_second"]
    ), name
    paired = [
      a / b
      for a, b in zip(variant["examples_per_second_rounds"], plain["examples_per_second_rounds"])
    ]
    assert variant["ratio_to_plain_paired_range"] == pytest.approx([min(paired), max(paired)])
    low, high = variant["ratio_to_plain_paired_range"]
    assert low <= variant["ratio_to_plain_paired"] <= high, name


def test_goals_follow_the_ratios(quick_run, overhead):
  written = quick_run[0]
  assert set(written["goals"]) == set(overhead.GOALS) == {"trainer_fixed", "transform"}
  for name, goal in written["goals"].items():
    assert goal["min_ratio"] == overhead.GOALS[name]
    assert goal["ratio"] == written["variants"][name]["ratio_to_plain"]
    assert goal["pass"] == (goal["ratio"] >= goal["min_ratio"])


def test_batch_sizes_and_trainer_records(quick_run):
  written = quick_run[0]
  batch = written["global_batch_size"]
  variants = written["variants"]
  for name in ("plain", "plain_read", "transform", "trainer_fixed"):
    assert variants[name]["average_batch_size"] == batch, name
  adaptive = variants["trainer_adaptive"]
  assert batch // 4 <= adaptive["average_batch_size"] <= 4 * batch
  for name in ("trainer_fixed", "trainer_adaptive"):
    variant = variants[name]
    # Every timed step has its record; none was skipped or ran on a fallback shape.
    assert variant["timed_steps"] == 3 * written["rounds"], name
    assert variant["nonfinite_steps"] == 0, name
    assert variant["compile_fallback_steps"] == 0, name
    assert _positive(variant["record_step_seconds"]), name
    assert variant["checkpoint_seconds"] >= 0, name
  memory = variants["plain"]["step_memory"]
  assert memory == written["models"]["mlp"]["plain_step_memory"]
  assert memory["argument_bytes"] > 0


def test_rejects_a_batch_the_devices_cannot_split(overhead):
  with pytest.raises(ValueError, match="multiple of the 8 devices"):
    overhead.main(["--quick", "--batch-size", "36"])
