"""benchmarks/step_cost/trainer_mesh.py: a quick run, its layout and goals, and what FSDP blocks save."""

import json

import pytest


@pytest.fixture(scope="module")
def trainer_mesh():
  """The benchmark script's module."""
  from benchmarks.step_cost import trainer_mesh as module  # pylint: disable=import-outside-toplevel

  return module


@pytest.fixture(scope="module")
def quick_run(trainer_mesh, tmp_path_factory, devices):
  """One ``--quick`` run: the JSON written to --out."""
  del devices  # 8 devices, set up by conftest
  out = tmp_path_factory.mktemp("trainer_mesh") / "trainer_mesh.json"
  trainer_mesh.main(["--quick", "--out", str(out)])
  return json.loads(out.read_text())


def test_every_layout_is_measured_against_tensor_parallel(quick_run):
  layouts = quick_run["layouts"]
  assert set(layouts) == {"replicated", "tp", "fsdp_tp", "fsdp_tp_gathered"}
  tp = layouts["tp"]
  for name, entry in layouts.items():
    assert entry["argument_bytes"] > 0 and entry["temp_bytes"] > 0, name
    assert entry["arguments_to_tp"] == pytest.approx(entry["argument_bytes"] / tp["argument_bytes"])
    assert entry["temp_to_tp"] == pytest.approx(entry["temp_bytes"] / tp["temp_bytes"])
  # The state at rest: blocks over the data axis hold less than tensor parallelism alone, and
  # the two FSDP layouts store the same; only the one kept in blocks steps without gathering.
  assert layouts["fsdp_tp"]["argument_bytes"] == layouts["fsdp_tp_gathered"]["argument_bytes"]
  assert layouts["fsdp_tp"]["argument_bytes"] < tp["argument_bytes"]
  assert layouts["fsdp_tp"]["temp_bytes"] < layouts["fsdp_tp_gathered"]["temp_bytes"]
  assert layouts["replicated"]["argument_bytes"] > tp["argument_bytes"]


def test_goals_follow_the_ratios(quick_run, trainer_mesh):
  goals = quick_run["goals"]
  assert set(goals) == set(trainer_mesh.GOALS)
  fsdp = quick_run["layouts"]["fsdp_tp"]
  values = {
    "fsdp_tp temp / tp temp": fsdp["temp_to_tp"],
    "fsdp_tp arguments / tp arguments": fsdp["arguments_to_tp"],
  }
  for key, goal in goals.items():
    assert goal["value"] == values[key] and goal["pass"] == (goal["value"] <= goal["bound"])


def test_a_batch_the_data_positions_cannot_share_is_refused(trainer_mesh):
  with pytest.raises(ValueError, match="multiple of the 4 data positions, got 6"):
    trainer_mesh.main(["--quick", "--batch-size", "6"])
