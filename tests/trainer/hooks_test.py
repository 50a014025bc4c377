"""Step records and hooks: every step's typed record reaches the hooks in order, as it is logged."""

import dataclasses
import json
import math

import pytest

import simigrad_jax
from simigrad_jax.checkpoint.hook import CheckpointHook
from simigrad_jax.trainer import hooks as hooks_module
from simigrad_jax.trainer.hooks import StepHook
from simigrad_jax.trainer.step_record import StepRecord
from tiny_run import make_trainer


class Recorder:
  """A user hook: keeps each record and what the run looked like when it came."""

  def __init__(self, trainer_box, metrics_path):
    self.records, self.seen_then, self.logged_then = [], [], []
    self._box, self._metrics_path = trainer_box, metrics_path

  def on_step(self, record):
    self.records.append(record)
    self.seen_then.append(self._box[0].sampler.examples_seen)
    self.logged_then.append(sum(1 for _ in open(self._metrics_path, encoding="utf-8")))


def test_a_user_hook_gets_every_typed_record_in_order_after_the_metrics(tmp_path):
  box = []
  recorder = Recorder(box, tmp_path / "metrics.jsonl")
  late = Recorder(box, tmp_path / "metrics.jsonl")
  with make_trainer(
    tmp_path,
    hooks=[recorder],
    checkpoints=simigrad_jax.CheckpointConfig(every_steps=4),
    eval_fn=lambda params, model_state: {"accuracy": 0.5},
  ) as trainer:
    box.append(trainer)
    trainer.add_hook(late)
    summary = trainer.train(num_epochs=2.5)
  records = recorder.records
  assert all(isinstance(r, StepRecord) for r in records)
  assert [r.step for r in records] == list(range(1, summary["steps"] + 1))
  assert [r.step for r in late.records] == [r.step for r in records]  # added hooks too
  # Each record is its metrics line (the evaluation records come on their own lines).
  lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl", encoding="utf-8")]
  steps = [line for line in lines if "batch_size" in line]
  assert [json.loads(json.dumps(r.as_dict()).replace("NaN", "null")) for r in records] == steps
  assert [line["step"] for line in lines if "eval_accuracy" in line] == [
    r.step for r in records if r.epoch_end
  ]
  assert summary["eval_accuracy"] == 0.5
  # A record's hooks run after the next step took its examples, but a checkpointed step's
  # (every 4 steps, and at an epoch's end) run before: the checkpoint follows its record.
  checkpointed = CheckpointHook(lambda: None, every_steps=4)
  for i, record in enumerate(records):
    last = i == len(records) - 1
    if checkpointed.due(record) or last:
      assert recorder.seen_then[i] == record.examples_seen
    else:
      assert recorder.seen_then[i] == records[i + 1].examples_seen > record.examples_seen
    assert recorder.logged_then[i] == sum(
      1
      for line in lines
      if line["step"] < record.step or line["step"] == record.step and "batch_size" in line
    )
  assert any(r.epoch_end for r in records) and sum(r.epoch_end for r in records) == 2


class AtOnce(Recorder):
  runs_at_once = True


def test_a_hook_that_runs_at_once_sees_each_step_once_before_the_next_is_dispatched(tmp_path):
  box = []
  at_once = AtOnce(box, tmp_path / "metrics.jsonl")
  later = Recorder(box, tmp_path / "metrics.jsonl")
  every_3 = simigrad_jax.CheckpointConfig(every_steps=3)
  with make_trainer(tmp_path, hooks=[later, at_once], checkpoints=every_3) as trainer:
    box.append(trainer)
    summary = trainer.train(num_epochs=2.5)
  steps = list(range(1, summary["steps"] + 1))
  assert [r.step for r in at_once.records] == [r.step for r in later.records] == steps
  # Before the next step took its examples, and before any other hook (the metrics) saw it.
  assert at_once.seen_then == [r.examples_seen for r in at_once.records]
  assert [n + 1 for n in at_once.logged_then] == later.logged_then


def test_a_hook_without_on_step_is_refused_naming_it(tmp_path):
  with pytest.raises(ValueError, match=r"a hook must have a method on_step\(record\).*got <object"):
    make_trainer(tmp_path / "run", hooks=[object()])
  with make_trainer(tmp_path / "run") as trainer:
    with pytest.raises(
      ValueError, match=r"a hook must have a method on_step.*got <built-in function print>"
    ):
      trainer.add_hook(print)


def test_the_record_logs_every_field_but_the_epoch_end_then_the_compile_counters():
  fields = [f.name for f in dataclasses.fields(StepRecord)]
  required = [
    f.name
    for f in dataclasses.fields(StepRecord)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
  ]
  record = StepRecord(**{name: 0 for name in required})
  logged = record.with_compile_stats({"compiles": 3, "update_compiled": True}).as_dict()
  assert list(logged) == [n for n in fields if n not in ("epoch_end", "compile_stats")] + [
    "compiles",
    "update_compiled",
  ]
  assert isinstance(record, StepRecord) and isinstance(Recorder([], None), StepHook)
  assert math.isnan(
    StepRecord(**{**{n: 0 for n in required}, "similarity": math.nan}).as_dict()["similarity"]
  )


def test_doctests():
  import doctest  # pylint: disable=import-outside-toplevel

  assert doctest.testmod(hooks_module).failed == 0
