"""benchmarks/trainer_overhead/switching.py: a quick run of both modes, its JSON schema and its compile counts."""

import json
import math
import numbers
import pathlib

import pytest

import simigrad_jax

ROOT = pathlib.Path(__file__).resolve().parents[3]
# The runs docs/results.md's switching table shows: cold, warm, warm at 24 steps a program,
# cold and warm at the training scripts' settings (64 steps a program, steps of up to 3 shapes),
# and one process cold at those settings again.
DOCS_RUNS = (
  "switching",
  "switching_warm",
  "switching_warm_pace24",
  "switching_scripts",
  "switching_scripts_warm",
  "switching_scripts_rerun",
)


@pytest.fixture(scope="module")
def switching():
  """The benchmark script's module."""
  from benchmarks.trainer_overhead import switching as module  # pylint: disable=import-outside-toplevel

  return module


@pytest.fixture(scope="module")
def quick_run(switching, tmp_path_factory):
  """One ``--quick`` run: (the JSON written to --out, the dict main returned)."""
  tmp = tmp_path_factory.mktemp("switching")
  out = tmp / "switching.json"
  returned = switching.main(["--quick", "--out", str(out), "--workdir", str(tmp / "runs")])
  return json.loads(out.read_text()), returned


def test_rule_sweep_moves_like_the_controller_up_and_down(switching):
  assert switching.rule_sweep(8, 12, 9) == [8, 9, 10, 11, 12, 10, 9, 8, 9]
  sizes = switching.rule_sweep(8, 1600, 214)
  assert min(sizes) == 8 and max(sizes) == 1600
  for before, after in zip(sizes, sizes[1:]):
    grow = min(max(before + 1, int(before * 1.1)), 1600)
    shrink = max(min(before - 1, int(before * 0.9)), 8)
    assert after in (grow, shrink)
  # The full preset visits at least 10 shapes in recompile mode.
  policy = simigrad_jax.shapes.BucketPolicy(switching.FULL["max_micro"], 1)
  visited = {simigrad_jax.shapes.plan_batch(b, 8, policy).micro_batch_size for b in sizes}
  assert len(visited) >= 10


def test_quick_run_schema(quick_run, devices):
  written, returned = quick_run
  assert written["devices"] == len(devices) == 8
  assert set(written["modes"]) == {"recompile", "recompile_wait", "pad", "recompile_2proc"}
  for mode, result in written["modes"].items():
    for key in (
      "steps",
      "buckets_visited",
      "compiles",
      "compile_seconds",
      "compile_wait_seconds",
      "wall_seconds",
      "data_seconds",
      "padding_fraction",
    ):
      value = result[key]
      assert isinstance(value, numbers.Real) and not isinstance(value, bool), (mode, key)
      assert math.isfinite(result[key]) and result[key] >= 0, (mode, key)
      assert result[key] == pytest.approx(returned["modes"][mode][key]), (mode, key)
    assert result["steps"] == len(written["schedule"]) > 0
    assert result["compile_cache_hits"] == 0  # (no --persistent-cache: every program compiled)
    assert result["wall_seconds"] > 0
    assert result["compile_wait_seconds"] <= result["wall_seconds"]
    assert result["data_seconds"] <= result["wall_seconds"]
    assert result["wall_seconds"] <= result["total_seconds"]
    assert result["examples_per_second"] > 0
    # The benchmark's sums agree with the Trainer's own summary.
    assert result["wall_seconds"] == pytest.approx(result["trainer_wall_seconds"])
    assert result["data_seconds"] == pytest.approx(result["trainer_data_seconds"])
  assert written["same_batch_sizes"]
  assert written["modes"]["recompile"]["examples"] == written["modes"]["pad"]["examples"]
  # How it ran: the schedule's pace (the Trainer's default here) and the host's load around it.
  assert written["steps_per_compile"] == simigrad_jax.CompileConfig().steps_per_compile
  assert written["shapes_per_step"] == 1  # one shape a step, on the grid of halvings
  assert written["micro_batch_grid"] == written["modes"]["recompile"]["grid_micro_batch_sizes"]
  assert len(written["load_average"]) == 2 and min(written["load_average"]) >= 0


def test_steps_per_compile_is_read_from_the_command_line(switching):
  assert switching._parse_args(["--quick"]).steps_per_compile is None  # the Trainer's default
  assert switching._parse_args(["--quick", "--steps-per-compile", "12.5"]).steps_per_compile == 12.5


def test_shapes_per_step_is_read_from_the_command_line_and_checked(switching, capsys):
  assert switching._parse_args(["--quick"]).shapes_per_step is None  # one shape a step
  assert switching._parse_args(["--quick", "--shapes-per-step", "3"]).shapes_per_step == 3
  with pytest.raises(SystemExit):
    switching._parse_args(["--quick", "--shapes-per-step", "5"])
  assert "--shapes-per-step 5: expected 1 to 4" in capsys.readouterr().err


def test_the_grid_recorded_with_shapes_per_step_is_the_one_the_recompile_modes_ran(switching):
  ran = {"pad": {"grid_micro_batch_sizes": [300]}, "recompile": {"grid_micro_batch_sizes": [1, 3]}}
  assert switching.ran_grid(ran) == [1, 3]
  assert switching.ran_grid({"pad": ran["pad"]}) is None


@pytest.mark.parametrize("mode", ["recompile", "recompile_wait", "recompile_2proc"])
def test_recompile_compiles_each_visited_shape_once(quick_run, mode):
  result = quick_run[0]["modes"][mode]
  visited = result["visited_micro_batch_sizes"]
  compiled = result["compiled_micro_batch_sizes"]
  # Waiting, each step runs its own shape; with the fallback, the compiled ones (at least one).
  assert result["buckets_visited"] == len(visited) >= (3 if mode == "recompile_wait" else 1)
  assert set(visited) <= set(compiled) <= set(result["grid_micro_batch_sizes"])
  # One compile per program (prefetched ones included): a step program per shape, a
  # micro-step per shape that accumulated, the update of accumulated steps.
  assert result["compiles"] == (
    result["step_compiles"] + result["accumulation_compiles"] + result["update_compiled"]
  )
  assert result["step_compiles"] <= len(compiled)
  # A step waits only for a program's first use (with the fallback, one the compile schedule
  # has admitted, decided by the step count: a busy machine waits more, never falls back more);
  # a shape's micro-step or the update may be first used after the shape's first visit.
  assert result["steps_that_waited"] <= result["compiles"]
  if mode == "recompile_wait":
    assert result["compile_fallback_steps"] == 0


def test_pad_compiles_one_shape(quick_run):
  written = quick_run[0]
  result = written["modes"]["pad"]
  assert result["buckets_visited"] == 1
  assert (
    result["visited_micro_batch_sizes"]
    == result["compiled_micro_batch_sizes"]
    == [written["max_micro_batch_size"]]
  )
  # The one shape's step program, and the micro-step and update if a batch outgrew it.
  assert result["step_compiles"] == 1
  assert result["compiles"] == 1 + result["accumulation_compiles"] + result["update_compiled"]
  assert result["compile_wait_share_after_first_step"] == 0


def test_padding_fraction_matches_the_plans(quick_run):
  written = quick_run[0]
  for mode, result in written["modes"].items():
    assert result["rows_computed"] == result["examples"] + result["padded_examples"]
    if result["compile_fallback_steps"]:  # steps on another shape than their plan's
      continue
    low = written["max_micro_batch_size"] if mode == "pad" else 1
    policy = simigrad_jax.shapes.BucketPolicy(written["max_micro_batch_size"], low)
    plans = [simigrad_jax.shapes.plan_batch(b, 8, policy) for b in written["schedule"]]
    padded = sum(p.padded_examples for p in plans)
    rows = sum(p.rows_per_step for p in plans)
    assert 0 <= result["padding_fraction"] < 1
    assert result["padding_fraction"] == pytest.approx(padded / rows), mode
    assert result["rows_computed"] == rows, mode
  pad, recompile = written["modes"]["pad"], written["modes"]["recompile"]
  assert pad["padding_fraction"] > 0
  assert pad["padding_fraction"] > recompile["padding_fraction"]


def test_both_modes_train_the_same_model(quick_run):
  """Same sizes, same examples, padding rows weigh 0: the two modes end at the same loss."""
  modes = quick_run[0]["modes"]
  assert modes["recompile"]["batch_sizes"] == modes["pad"]["batch_sizes"]
  assert modes["recompile"]["final_loss"] == pytest.approx(modes["pad"]["final_loss"], rel=1e-4)


def test_two_processes_run_the_same_sweep_and_report_their_agreement(quick_run):
  """recompile_2proc: 2 processes x 4 devices train what 1 process x 8 devices trains."""
  written = quick_run[0]
  two, one = written["modes"]["recompile_2proc"], written["modes"]["recompile"]
  assert two["processes"] == 2 and two["devices_per_process"] == 4
  assert two["batch_sizes"] == one["batch_sizes"] == written["schedule"]
  assert two["examples"] == one["examples"]
  # The processes exchanged their decision every step (one process needs no exchange).
  assert two["agreement_seconds_per_step"] > one["agreement_seconds_per_step"] >= 0
  ratios = written["ratios"]["recompile_2proc_over_recompile"]
  assert ratios["examples_per_second"] == pytest.approx(
    two["examples_per_second"] / one["examples_per_second"]
  )
  # The same model: the fallback shapes differ with compile timing, the trajectory does not.
  assert two["final_loss"] == pytest.approx(one["final_loss"], rel=1e-4)


def test_the_docs_table_is_the_committed_json(switching, capsys):
  paths = [f"benchmarks/results/{name}.json" for name in DOCS_RUNS]
  command = "python benchmarks/trainer_overhead/switching.py --markdown " + " ".join(paths)
  text = (ROOT / "docs" / "results.md").read_text()
  start, end = f"<!-- switching table: {command} -->\n", "\n<!-- end switching table -->"
  assert start in text and end in text, "docs/results.md lost the markers of the switching table"
  block = text[text.index(start) + len(start) : text.index(end)]
  assert switching.main(["--markdown", *(str(ROOT / path) for path in paths)]) == {}
  printed = capsys.readouterr().out
  assert block + "\n" == printed, (
    f"docs/results.md's switching table differs: regenerate it with {command}"
  )
  runs = [json.loads((ROOT / path).read_text()) for path in paths]
  assert len(block.splitlines()) == 2 + sum(len(run["modes"]) for run in runs)
