"""benchmarks/step_cost/sharded.py: a quick run over every layout and kind of mesh axes, its JSON, goals."""

import json
import math

import pytest

from benchmarks.step_cost import sharded_models

RUN_KEYS = (
  "model",
  "layout",
  "axes",
  "mesh",
  "variants",
  "transform_temp_ratio",
  "collectives_beyond_plain",
  "collective_permutes",
  "transform_collective_bytes",
  "sharding_kept",
  "similarity",
  "reference_similarity",
  "similarity_error",
)
VARIANT_KEYS = (
  "step_seconds",
  "temp_bytes",
  "time_ratio_to_plain",
  "temp_ratio_to_plain",
  "collectives",
  "collective_bytes",
  "compile_seconds",
)


@pytest.fixture(scope="module")
def sharded():
  """The benchmark script's module."""
  from benchmarks.step_cost import sharded as module  # pylint: disable=import-outside-toplevel

  return module


@pytest.fixture(scope="module")
def quick_run(sharded, tmp_path_factory, devices):
  """One ``--quick`` run of the kernel model: (the JSON written to --out, what main returned)."""
  del devices  # 8 devices, set up by conftest
  out = tmp_path_factory.mktemp("sharded") / "sharded.json"
  returned = sharded.main(["--quick", "--models", "kernel", "--out", str(out)])
  return json.loads(out.read_text()), returned


def test_every_layout_and_kind_of_axes_runs_and_is_recorded(quick_run):
  written, returned = quick_run
  expected = {
    f"kernel/{layout}/{axes}"
    for layout in sharded_models.LAYOUTS
    for axes in sharded_models.AXIS_TYPES
  }
  assert set(written["runs"]) == expected
  for key, run in written["runs"].items():
    assert set(RUN_KEYS) <= set(run), key
    assert set(run["variants"]) == set(sharded_models.VARIANTS), key
    for name, entry in run["variants"].items():
      for field in VARIANT_KEYS:
        assert field in entry, (key, name, field)
      assert entry["temp_bytes"] > 0 and math.isfinite(entry["step_seconds"]), (key, name)
    plain = run["variants"]["plain"]
    assert plain["temp_ratio_to_plain"] == plain["time_ratio_to_plain"] == 1.0
    simigrad = run["variants"]["simigrad"]
    assert simigrad["temp_ratio_to_plain"] == pytest.approx(
      simigrad["temp_bytes"] / plain["temp_bytes"]
    )
    assert run["similarity"] == pytest.approx(returned["runs"][key]["similarity"])
  assert written["models"]["kernel"]["widths"] == [512, 512, 10]
  assert written["device"]["devices_visible"] == 8


def test_the_simigrad_step_moves_no_rows_and_measures_the_even_and_odd_examples(quick_run):
  """No collective-permute; the similarity of the float64 reference; the layout kept."""
  written, _ = quick_run
  reference = written["models"]["kernel"]["reference_similarity"]
  assert 0.01 < abs(reference) < 0.99  # the halves differ, and are not unrelated
  for key, run in written["runs"].items():
    assert run["collective_permutes"] == 0, key
    assert "collective-permute" not in run["variants"]["simigrad"]["collectives"], key
    assert run["similarity_error"] <= 1e-4, key
    assert run["similarity_error"] == pytest.approx(abs(run["similarity"] - reference))
    assert run["sharding_kept"], key
  goals = written["goals"]
  for goal in (
    "no collective-permute in the SimiGrad step",
    "|similarity - float64 reference|",
    "parameters' sharding lost",
  ):
    assert goals[goal]["met"], (goal, goals[goal])


def test_the_transform_adds_no_gradient_sized_memory_or_collectives(quick_run):
  """Against the same step without it: <= 1.05x the temporary memory (but with replicated
  parameters, below), a few scalars of bytes."""
  written, _ = quick_run
  leaf_bytes = 4 * 512 * 512
  for key, run in written["runs"].items():
    if run["layout"] != "data":
      assert run["transform_temp_ratio"] <= 1.05, key
    # Scalars, or each row's partial sums where a kernel's last axis is sharded (at most
    # 3 x 512 float32 per kernel, ring model): never a gradient.
    assert 0 <= run["transform_collective_bytes"] <= 0.03 * leaf_bytes, key
    beyond_halves = set(run["variants"]["simigrad"]["collectives"]) - set(
      run["variants"]["halves"]["collectives"]
    )
    assert beyond_halves <= {"all-reduce", "all-gather"}, key


@pytest.mark.xfail(
  strict=True,
  reason="with replicated parameters the halves step holds 0.20x the plain step's memory (the "
  "halves in blocks, the mean gathered once); transform(nonfinite='zero') zeroes that mean "
  "after the statistics, and XLA then averages the halves before it sums their statistics, "
  "holding a third block: 1.25x the halves step's (0.25x the plain step's; 0.98x with "
  "nonfinite='propagate')",
)
def test_with_replicated_parameters_the_transform_adds_at_most_5_percent(quick_run):
  written, _ = quick_run
  for key, run in written["runs"].items():
    if run["layout"] == "data":
      assert run["transform_temp_ratio"] <= 1.05, key


def test_batch_sizes_that_leave_a_device_an_odd_number_of_rows_are_refused(sharded):
  with pytest.raises(SystemExit):
    sharded.main(["--quick", "--batch-size", "24"])
  with pytest.raises(SystemExit):
    sharded.main(["--quick", "--layouts", "data,pipeline"])


def test_the_groups_step_meets_its_goals_but_where_xla_moves_activations(quick_run):
  """Even against odd data positions: no permute, the similarity of the dealt batch's even and
  odd examples, the plain step's update; at most the plain step's memory and bytes, FSDP blocks
  kept, but with FSDP and tensor parallelism under Auto axes (XLA plans that plain step around
  the blocks, moving activations)."""
  written, _ = quick_run
  for key, run in written["runs"].items():
    groups = run["groups"]
    assert groups["collective_permutes"] == 0, key
    assert groups["similarity_error"] <= 1e-4, key
    assert groups["update_error"] <= 1e-6, key
    assert groups["sharding_kept"], key
    if run["layout"] != "fsdp_tp" or run["axes"] == "explicit":
      assert groups["temp_ratio_to_plain"] <= 1.05, key
      assert groups["collective_bytes_ratio_to_plain"] <= 1.001, key
  for goal in ("groups: collective-permutes", "groups: |similarity - float64 reference|"):
    assert written["goals"][goal]["met"], goal


def test_every_layout_has_a_simigrad_step_within_the_plain_steps_memory(quick_run):
  """The lighter of the two SimiGrad steps, by temporary memory: at most 1.05x the plain step's."""
  written, _ = quick_run
  for key, run in written["runs"].items():
    ratios = {name: run["variants"][name]["temp_ratio_to_plain"] for name in ("simigrad", "groups")}
    assert run["lighter_step"] == min(ratios, key=ratios.get), key
    assert run["lighter_temp_ratio_to_plain"] == min(ratios.values()) <= 1.05, key
  assert written["runs"]["kernel/fsdp_tp/auto"]["lighter_step"] == "simigrad"
  assert written["goals"]["lighter SimiGrad step temp / plain temp"]["met"]
