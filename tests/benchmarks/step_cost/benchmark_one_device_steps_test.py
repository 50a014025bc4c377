"""benchmarks/step_cost/one_device_steps.py: a tiny run, its JSON written per step, its docs table."""

import json
import math

import numpy as np
import optax
import pytest

from benchmarks.step_cost import one_device_steps

STEPS = ("plain", "halves_signed", "trainer_stacked", "trainer_every_4")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """One tiny run of the MLP: (the JSON written to --out, the dict main returned)."""
  out = tmp_path_factory.mktemp("one_device_steps") / "steps.json"
  argv = ["--size", "tiny", "--workloads", "mlp", "--steps", ",".join(STEPS), "--rounds", "1"]
  returned = one_device_steps.main([*argv, "--out", str(out)])
  return json.loads(out.read_text()), returned


def test_every_step_has_a_row_against_the_plain_step(tiny_run):
  written, returned = tiny_run
  assert written == returned
  assert written["size"] == "tiny" and written["rounds"] == 1
  part = written["workloads"]["mlp"]
  assert list(part["steps"]) == list(STEPS)
  assert part["gradient_bytes"] == 4 * part["parameters"] > 0
  for name, row in part["steps"].items():
    for key in ("paired_time_ratio", "step_seconds", "plain_step_seconds", "compile_seconds"):
      assert math.isfinite(row[key]) and row[key] > 0, (name, key)
    assert row["temp_ratio"] == pytest.approx(row["temp_bytes"] / row["plain_temp_bytes"])
    expected = (row["temp_bytes"] - row["plain_temp_bytes"]) / part["gradient_bytes"]
    assert row["extra_temp_gradients"] == pytest.approx(expected)
  assert part["steps"]["plain"]["similarity"] is None
  assert part["steps"]["plain"]["extra_temp_gradients"] == 0
  # measure_every=4's cycle: four calls (three plain programs, one measuring) against four plain
  # steps; its seconds are per step, its memory and similarity the measuring program's.
  assert {name: row["calls"] for name, row in part["steps"].items()} == {
    "plain": 1,
    "halves_signed": 1,
    "trainer_stacked": 1,
    "trainer_every_4": 4,
  }


def test_the_steps_that_measure_record_a_similarity(tiny_run):
  # That the passes agree with each other is tests/ingraph/half_passes_test.py's.
  written, _ = tiny_run
  rows = written["workloads"]["mlp"]["steps"]
  for name in ("halves_signed", "trainer_stacked", "trainer_every_4"):
    similarity = rows[name]["similarity"]
    assert -1.0 <= similarity <= 1.0 and similarity != 0.0, name


def test_the_docs_table_has_a_row_per_workload(tiny_run):
  written, _ = tiny_run
  passes, every = one_device_steps.markdown_table(written).split("\n\n")
  assert passes == one_device_steps.passes_markdown_table(written)
  assert every == one_device_steps.every_markdown_table(written)
  lines = passes.splitlines()
  assert len(lines) == 3 and lines[2].startswith("| mlp | ")
  ratio = written["workloads"]["mlp"]["steps"]["halves_signed"]["paired_time_ratio"]
  assert f"{ratio:.2f}x" in lines[2]
  assert lines[2].count(" - ") == 4  # the steps that did not run
  every = every.splitlines()
  ratio = written["workloads"]["mlp"]["steps"]["trainer_every_4"]["paired_time_ratio"]
  assert len(every) == 3 and every[2].startswith("| mlp | ") and f"{ratio:.2f}x" in every[2]
  assert "| - |" in every[2]  # the plain program's own row did not run


@pytest.mark.parametrize(
  "argv", [["--workloads", "rnn"], ["--steps", "halves_parallel"], ["--rounds", "0"]]
)
def test_bad_settings_are_refused(argv, capsys):
  with pytest.raises(SystemExit):
    one_device_steps.main(["--size", "tiny", "--out", "", *argv])
  assert argv[1] in capsys.readouterr().err


def test_a_step_donates_its_state_and_hands_the_new_one_to_the_next_call():
  workload = one_device_steps.make_workload("mlp", one_device_steps.SIZES["tiny"]["mlp"])
  cycle = one_device_steps.make_step("trainer_every_4", workload)
  plain = one_device_steps.make_step("plain", workload)
  for step, calls in ((cycle, 4), (plain, 1)):
    assert step.compiled.memory_analysis().alias_size_in_bytes > 0  # outputs in donated buffers
    step.run_seconds()
    step.run_seconds()
    # Adam's count: every call of the cycle's programs (three plain, one measuring) stepped the
    # one state the cycle hands on.
    state = step.args[:3]  # (the plain step's order differs from the Trainer's)
    assert optax.tree_utils.tree_get(state, "count") == 2 * calls
  # Each step started from its own copy: the workload's parameters are neither donated nor moved.
  kernel = workload.params["Dense_0"]["kernel"]
  assert not kernel.is_deleted()
  assert not np.allclose(kernel, cycle.args[0]["Dense_0"]["kernel"])
