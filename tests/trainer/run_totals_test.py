"""RunTotals: the totals that Trainer.train returns, added up from its step records."""

import dataclasses
import math

import tiny_run
from simigrad_jax.trainer.run_totals import RunTotals
from simigrad_jax.trainer.step_record import StepRecord

BASE = StepRecord(
  step=1,
  epoch=0,
  examples_seen=64,
  batch_size=64,
  micro_batch_size=8,
  accumulation_steps=1,
  padded_examples=0,
  compile_fallback=False,
  lr_factor=1.0,
  next_batch_size=70,
  next_lr_factor=1.05,
  schedule_factor=1.0,
  decision="grow",
  similarity_target=0.1,
  loss=1.0,
  similarity=0.3,
  norm_a=1.0,
  norm_b=1.0,
  norm_mean=0.9,
  grads_finite=True,
  nonfinite_steps=0,
  step_seconds=0.5,
  examples_per_second=128.0,
  data_seconds=0.1,
  host_seconds=math.nan,
  agreement_seconds=0.0,
  compile_wait_step_seconds=0.0,
  epoch_end=False,
)


def record(batch_size, host_seconds, fallback=False, loss=1.0):
  return dataclasses.replace(
    BASE, batch_size=batch_size, host_seconds=host_seconds, compile_fallback=fallback, loss=loss
  )


def test_totals_add_up_the_records_and_skip_an_unmeasured_host_time():
  totals = RunTotals()
  totals.on_step(record(64, math.nan))  # the first step has no previous read
  totals.on_step(record(128, 0.002, fallback=True))
  totals.on_step(record(256, 0.004, loss=0.25))
  summary = totals.summary()
  assert summary["run_steps"] == 3 and summary["run_examples"] == 448
  assert summary["average_batch_size"] == summary["run_average_batch_size"] == 448 / 3
  assert math.isclose(summary["wall_seconds"], 1.5) and math.isclose(summary["data_seconds"], 0.3)
  assert summary["host_seconds_median"] == 0.003
  assert summary["compile_fallback_steps"] == 1
  assert summary["loss"] == 0.25 and summary["similarity"] == 0.3
  assert summary["padding_fraction"] == 0.0


def test_padding_fraction_is_the_share_of_rows_computed():
  totals = RunTotals()
  totals.on_step(dataclasses.replace(BASE, batch_size=60, padded_examples=4))
  totals.on_step(dataclasses.replace(BASE, batch_size=100, padded_examples=4))
  assert totals.summary()["padding_fraction"] == 8 / 168


def test_first_runs_are_counted_with_their_seconds():
  totals = RunTotals()
  totals.on_step(dataclasses.replace(BASE, first_run=True, step_seconds=0.25))
  totals.on_step(dataclasses.replace(BASE, step_seconds=0.5))
  totals.on_step(dataclasses.replace(BASE, first_run=True, step_seconds=0.125))
  summary = totals.summary()
  assert summary["first_run_steps"] == 2 and summary["first_run_seconds"] == 0.375
  assert RunTotals().summary()["first_run_steps"] == 0


def test_the_compile_waits_are_counted_once_among_the_steps_seconds():
  totals = RunTotals()
  first = dict(first_run=True, step_seconds=2.0, compile_wait_step_seconds=1.5)
  totals.on_step(dataclasses.replace(BASE, **first))
  totals.on_step(dataclasses.replace(BASE, step_seconds=1.0, compile_wait_step_seconds=0.75))
  totals.on_step(dataclasses.replace(BASE, step_seconds=0.25, compile_wait_step_seconds=0.0))
  summary = totals.summary()
  assert summary["wall_seconds"] == 3.25
  assert summary["step_compile_wait_seconds"] == 2.25  # the first run's wait and a later one
  assert summary["first_run_seconds"] == 2.0 and summary["first_run_wait_seconds"] == 1.5
  besides_waiting = summary["wall_seconds"] - summary["step_compile_wait_seconds"]
  assert besides_waiting == 1.0  # the first run's 0.5 s and the other steps' 0.5 s


def test_the_whole_runs_average_covers_the_whole_runs_steps_and_this_calls_its_own():
  totals = RunTotals()
  for size in (40, 60):  # this call: 2 steps after a resume at step 151
    totals.on_step(dataclasses.replace(BASE, batch_size=size))
  summary = totals.summary(steps=153, examples_seen=7_500)
  assert summary["steps"] == 153 and summary["examples_seen"] == 7_500
  assert summary["average_batch_size"] == 7_500 / 153  # 49.0, the same steps as the totals
  assert summary["run_steps"] == 2 and summary["run_examples"] == 100
  assert summary["run_average_batch_size"] == 50.0


def test_a_run_without_steps_has_no_average():
  summary = RunTotals().summary()
  assert summary["run_steps"] == 0 and math.isnan(summary["average_batch_size"])
  assert math.isnan(summary["host_seconds_median"]) and summary["loss"] is None
  assert math.isnan(summary["padding_fraction"])


def test_a_resumed_trainers_average_covers_the_same_steps_as_its_totals(tmp_path):
  workdir, cache = tmp_path / "run", tmp_path / "cache"
  tiny_run.train_records(workdir, cache, 3)
  summary, _, records = tiny_run.train_records(workdir, cache, 6)  # resumed at step 3
  assert (summary["steps"], summary["run_steps"]) == (6, 3)
  assert summary["examples_seen"] == records[-1]["examples_seen"]
  assert summary["average_batch_size"] == summary["examples_seen"] / 6
  this_call = [r["batch_size"] for r in records if r["step"] > 3]
  assert summary["run_average_batch_size"] == sum(this_call) / 3 == summary["run_examples"] / 3
