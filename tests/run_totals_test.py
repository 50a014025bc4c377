"""RunTotals: the totals that Trainer.train returns, added up from its step records."""

import math

from simigrad_jax.engine.run_totals import RunTotals


def record(batch_size, host_seconds, fallback=False, loss=1.0):
  return {"batch_size": batch_size, "step_seconds": 0.5, "data_seconds": 0.1,
          "compile_fallback": fallback, "host_seconds": host_seconds, "loss": loss,
          "similarity": 0.3}


def test_totals_add_up_the_records_and_skip_an_unmeasured_host_time():
  totals = RunTotals()
  totals.add(record(64, math.nan))  # the first step has no previous read
  totals.add(record(128, 0.002, fallback=True))
  totals.add(record(256, 0.004, loss=0.25))
  totals.evaluation = {"eval_accuracy": 0.9}
  summary = totals.summary()
  assert summary["run_steps"] == 3 and summary["run_examples"] == 448
  assert summary["average_batch_size"] == 448 / 3
  assert math.isclose(summary["wall_seconds"], 1.5) and math.isclose(summary["data_seconds"], 0.3)
  assert summary["host_seconds_median"] == 0.003
  assert summary["compile_fallback_steps"] == 1
  assert summary["loss"] == 0.25 and summary["eval_accuracy"] == 0.9


def test_a_run_without_steps_has_no_average():
  summary = RunTotals().summary()
  assert summary["run_steps"] == 0 and math.isnan(summary["average_batch_size"])
  assert math.isnan(summary["host_seconds_median"]) and summary["loss"] is None
