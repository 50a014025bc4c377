"""The run's console report (train/report.py): the runtime in parts, each second counted once, and
the evaluation's progress."""

import doctest
import math
import types

from train import report


def run_summary(**seconds):
  """A ``Trainer.train`` summary's timings: 10 s of steps, 6 s of them waiting for compiles, 4 s
  of which in the first runs, whose steps took 5 s."""
  return {
    "wall_seconds": 10.0,
    "step_compile_wait_seconds": 6.0,
    "first_run_seconds": 5.0,
    "first_run_wait_seconds": 4.0,
    **seconds,
  }


def test_the_runtimes_parts_add_up_to_it():
  parts = report.runtime_parts(run_summary(), 14.0, setup_seconds=3.0)
  assert parts == {
    "setup_seconds": 3.0,
    "step_seconds": 10.0,
    "step_wait_seconds": 6.0,
    "step_compute_seconds": 4.0,
    "first_run_extra_seconds": 1.0,
    "after_steps_seconds": 1.0,
  }
  whole = parts["setup_seconds"] + parts["step_seconds"] + parts["after_steps_seconds"]
  assert math.isclose(whole, 14.0)
  assert parts["step_wait_seconds"] + parts["step_compute_seconds"] == parts["step_seconds"]
  assert set(report.runtime_parts(run_summary(), 14.0, None).values()) == {None}


def test_the_summary_counts_the_waits_once(capsys):
  summary = {
    "seconds": 14.0,
    "compiles": 3,
    "compiled_micro_batch_sizes": [2, 4],
    "compile_seconds": 20.0,  # in background threads: more than the runtime
    "compile_fallback_steps": 0,
    "compile_cache_hits": 0,
    "compile_cache_hit_seconds": 0.0,
    "first_run_steps": 2,
    "first_run_seconds": 5.0,
    **report.runtime_parts(run_summary(), 14.0, setup_seconds=3.0),
  }
  assert report._runtime_row(summary) == (
    "14.0 s: 3.0 s before the first step (data, model, first trace), 10.0 s of steps (6.0 s "
    "waiting for compiles, 4.0 s training, evaluating and saving), 1.0 s after the last step "
    "(the final evaluation and save)"
  )
  assert report._first_runs_seconds(summary) == (
    " (1.0 s beyond their wait for its compile; this run's steps)"
  )
  # Without the parts (a summary made without setup_seconds): the runtime alone, as before.
  assert report._runtime_row({"seconds": 14.0, "setup_seconds": None}) == "14.0 s"


def test_the_step_programs_row_says_which_were_compiled_and_which_loaded():
  def row(compiles, loaded, seconds, loaded_seconds):
    return report._programs_row(
      {
        "compiles": compiles,
        "compile_cache_hits": loaded,
        "compile_seconds": seconds,
        "compile_cache_hit_seconds": loaded_seconds,
        "compiled_micro_batch_sizes": [4, 1, 2],
        "compile_fallback_steps": 33,
      }
    )

  assert row(5, 0, 90.5, 0.0) == (
    "5 compiled, 0 loaded from the compilation cache (micro-batch sizes [1, 2, 4]; 90.5 s "
    "compiling, in the background; 33 steps on a fallback shape)"
  )
  assert row(5, 5, 4.8, 4.8) == (
    "0 compiled, 5 loaded from the compilation cache (micro-batch sizes [1, 2, 4]; 4.8 s in the "
    "background, all of it tracing, lowering and loading; 33 steps on a fallback shape)"
  )
  assert row(6, 5, 15.5, 4.8) == (
    "1 compiled, 5 loaded from the compilation cache (micro-batch sizes [1, 2, 4]; 15.5 s in the "
    "background, 4.8 s of it tracing, lowering and loading; 33 steps on a fallback shape)"
  )


def test_the_evaluation_shows_its_progress_and_the_last_one_the_save(tmp_path, capsys):
  counted = []

  def evaluate(params, model_state, progress=None):
    for examples in (64, 64, 22):
      if progress is not None:
        progress(examples)
        counted.append(examples)
    return {"accuracy": 0.5, "loss": 1.0}

  printer = report.EpochPrinter(evaluate, tmp_path, 2, eval_name="test", eval_examples=150)
  printer.trainer = types.SimpleNamespace(
    sampler=types.SimpleNamespace(epoch=1, examples_seen=100),
    controller=types.SimpleNamespace(batch_size=32),
    step=7,
  )
  assert printer(None, None) == {"accuracy": 0.5, "loss": 1.0}
  err = capsys.readouterr().err
  assert "evaluate (test)" in err and "/150 " in err  # a bar over the evaluation's examples
  assert "saving" not in err  # not the last epoch
  printer.trainer.sampler.epoch = 2
  printer(None, None)
  assert "saving the checkpoint of step 7 ..." in capsys.readouterr().err
  assert counted == [64, 64, 22] * 2

  quiet = report.EpochPrinter(evaluate, tmp_path, 2, eval_name="test")  # no progress: no bar
  quiet.trainer = printer.trainer
  quiet(None, None)
  assert capsys.readouterr().err == ""


def test_doctests():
  result = doctest.testmod(report)
  assert result.attempted > 0 and result.failed == 0
