"""benchmarks/trainer_overhead/overhead_adaptive.py: a quick run, its layout, ratios and goals."""

import json
import math

import pytest


@pytest.fixture(scope="module")
def adaptive_benchmark():
  """The benchmark script's module."""
  from benchmarks.trainer_overhead import overhead_adaptive as module  # pylint: disable=import-outside-toplevel

  return module


@pytest.fixture(scope="module")
def quick_run(adaptive_benchmark, tmp_path_factory):
  """One ``--quick`` run, also on the halving grid: the JSON written to --out."""
  out = tmp_path_factory.mktemp("overhead_adaptive") / "adaptive.json"
  adaptive_benchmark.main(
    ["--quick", "--also-shapes-per-octave", "1", "--step-curve", "16", "64", "--out", str(out)]
  )
  return json.loads(out.read_text())


def test_fixed_is_held_at_the_adaptive_average_and_ratios_are_to_it(quick_run):
  variants = quick_run["variants"]
  assert set(variants) == {
    "adaptive",
    "fixed",
    "replay",
    "adaptive_late",
    "replay_late",
    "adaptive_s1",
    "curve_16",
    "curve_64",
  }
  fixed = variants["fixed"]
  assert fixed["average_batch_size"] == quick_run["fixed_batch_size"]
  assert fixed["padding_fraction"] == 0 and quick_run["fixed_batch_size"] % 8 == 0
  # The timed adaptive steps are those the untimed run measured the average of.
  assert variants["adaptive"]["average_batch_size"] == pytest.approx(
    quick_run["adaptive_average_batch_size"]
  )
  assert abs(quick_run["fixed_batch_size"] - quick_run["adaptive_average_batch_size"]) <= 4
  assert fixed["ratio_to_fixed"] == fixed["ratio_to_fixed_paired"] == 1.0
  assert fixed["ratio_to_fixed_run"] == 1.0
  # The fixed run's one shape first ran in its warm-up.
  assert fixed["first_run_steps"] == 0 and fixed["ratio_to_fixed_without_first_runs"] == 1.0
  for name, variant in variants.items():
    rounds = variant["examples_per_second_rounds"]
    assert len(rounds) == quick_run["rounds"] == 2, name
    # The whole run's examples/s lies between its slowest and fastest round's.
    assert (
      min(rounds) * (1 - 1e-9) <= variant["examples_per_second_run"] <= max(rounds) * (1 + 1e-9)
    ), name
    assert variant["ratio_to_fixed_run"] == pytest.approx(
      variant["examples_per_second_run"] / fixed["examples_per_second_run"]
    )
    assert variant["ratio_to_fixed"] == pytest.approx(
      variant["examples_per_second"] / fixed["examples_per_second"]
    )
    low, high = variant["ratio_to_fixed_paired_range"]
    assert low <= variant["ratio_to_fixed_paired"] <= high, name
    assert 0 <= variant["padding_fraction"] < 0.5, name
    assert variant["host_seconds"] > 0 and math.isfinite(variant["host_seconds"]), name
    assert variant["timed_steps"] == 3 * 2 and variant["compile_fallback_steps"] == 0, name
    assert variant["average_accumulation_steps"] == 1.0, name  # the memory bound holds them
    # The timed steps' CPU: the host's Python threads, and XLA's, which compute the steps.
    cpu = variant["cpu_seconds_per_step"]
    assert 0 < cpu["python_threads"] and 0 < cpu["other_threads"], name
    assert variant["rows_computed"] >= variant["average_batch_size"] * variant["timed_steps"]
  assert variants["adaptive_s1"]["shapes_per_octave"] == 1
  assert variants["adaptive"]["shapes"] > variants["adaptive_s1"]["shapes"]
  # The adaptive run's first steps on a new shape, set aside in a ratio of their own.
  adaptive = variants["adaptive"]
  if adaptive["first_run_steps"] < adaptive["timed_steps"]:
    assert adaptive["ratio_to_fixed_without_first_runs"] == pytest.approx(
      adaptive["examples_per_second_without_first_runs"]
      / fixed["examples_per_second_without_first_runs"]
    )
  for size in (16, 64):
    assert variants[f"curve_{size}"]["first_run_steps"] == 0
    assert variants[f"curve_{size}"]["average_batch_size"] == size
    assert variants[f"curve_{size}"]["padding_fraction"] == 0


def test_each_replay_runs_its_online_variants_sizes_and_is_compared_with_it(quick_run):
  variants = quick_run["variants"]
  for online, replay, key in (
    ("adaptive", "replay", "adaptive_to_replay_run"),
    ("adaptive_late", "replay_late", "adaptive_late_to_replay_late_run"),
  ):
    # The same sizes, so the same rows and padding: only knowing each size ahead differs.
    for number in ("average_batch_size", "padding_fraction"):
      assert variants[replay][number] == variants[online][number], (replay, number)
    assert quick_run[key] == pytest.approx(
      variants[online]["examples_per_second_run"] / variants[replay]["examples_per_second_run"]
    )


def test_the_breakdown_multiplies_to_the_adaptive_steps_against_held(quick_run):
  variants = quick_run["variants"]
  assert quick_run["breakdown"] == variants["adaptive"]["breakdown"]
  for name, variant in variants.items():
    breakdown = variant["breakdown"]
    if name.startswith("curve_"):
      assert breakdown is None, name
      continue
    assert set(breakdown["curve_step_seconds"]) == {"16", "64"}
    ratio = breakdown["measured_seconds"] / breakdown["held_at_average_predicted_seconds"]
    product = (
      breakdown["padding"]
      * breakdown["trajectory"]
      * breakdown["first_runs"]
      * breakdown["adapting"]
    )
    assert product == pytest.approx(ratio), name
    # First runs: the steps that ran a program for the first time, their time beyond the curve.
    assert breakdown["first_run_steps"] == variant["first_run_steps"] <= variant["timed_steps"]
    measured, excess = breakdown["measured_seconds"], breakdown["first_run_excess_seconds"]
    assert breakdown["adapting"] == pytest.approx(
      (measured - excess) / breakdown["predicted_seconds"]
    )
    if not variant["first_run_steps"]:
      assert excess == 0 and breakdown["first_runs"] == 1.0, name
    assert 0 <= breakdown["outside_curve_steps"] <= variant["timed_steps"], name
  # The control: the fixed run has no padding and no trajectory, only its steps against the
  # curve's.
  control = variants["fixed"]["breakdown"]
  assert control["padding"] == 1.0 and control["trajectory"] == pytest.approx(1.0)
  # The replay computes the adaptive run's rows: the same prediction from the curve.
  assert variants["replay"]["breakdown"]["predicted_seconds"] == pytest.approx(
    quick_run["breakdown"]["predicted_seconds"]
  )


def test_step_curve_sizes_must_divide_over_the_devices(adaptive_benchmark):
  with pytest.raises(ValueError, match="multiples of the 8 devices, got 12"):
    adaptive_benchmark.main(["--quick", "--step-curve", "12", "16"])


def test_goals_follow_the_adaptive_numbers(quick_run, adaptive_benchmark):
  assert set(quick_run["goals"]) == set(adaptive_benchmark.GOALS)  # every goal, each judged
  # A ratio to the fixed run is a floor, the others are ceilings: just past each bound misses.
  at_bound = {k: v for k, v in adaptive_benchmark.GOALS.items() if k != "warm_start_fallback_steps"}
  past = {k: v - 0.01 if k.startswith("ratio") else v + 0.01 for k, v in at_bound.items()}
  for numbers, passed in ((at_bound, True), (past, False)):
    goals = adaptive_benchmark._goals(numbers, {"fallback_steps": 5 if passed else 6})
    assert {k: g["pass"] for k, g in goals.items()} == dict.fromkeys(goals, passed)
  adaptive = quick_run["variants"]["adaptive"]
  numbers = {**adaptive, "warm_start_fallback_steps": quick_run["warm_start"]["fallback_steps"]}
  for key, goal in quick_run["goals"].items():
    assert goal["bound"] == adaptive_benchmark.GOALS[key] and goal["value"] == numbers[key]
    at_least = key.startswith("ratio_to_fixed")
    assert goal["pass"] == (
      goal["value"] >= goal["bound"] if at_least else goal["value"] <= goal["bound"]
    )


def test_rejects_a_window_without_steps(adaptive_benchmark):
  with pytest.raises(ValueError, match="--steps must be >= 1, got 0"):
    adaptive_benchmark.main(["--quick", "--steps", "0"])


def test_a_warm_start_is_timed_from_step_1_and_counts_its_fallback_steps(quick_run):
  warm = quick_run["warm_start"]
  assert warm["steps"] == 6 and len(warm["rounds"]) == 1
  adaptive = warm["rounds"][0]["adaptive"]
  assert warm["fallback_steps"] == adaptive["fallback_steps"] <= warm["steps"]
  assert adaptive["compile_cache_hits"] > 0  # the untimed runs left the cache warm
  assert warm["ratio_to_fixed_paired"] > 0
  goal = quick_run["goals"]["warm_start_fallback_steps"]
  assert goal["value"] == warm["fallback_steps"] and goal["bound"] == 5
