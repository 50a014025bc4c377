"""StepAgreement: every process holds a step's decision, and acts on every process's report alike.

One process exchanges nothing; several are simulated by the exchange's gathered rows (each
process's decision and report, as jax.distributed's key-value store returns them). Real
processes agree in tests/trainer/trainer_processes_test.py and tests/reliability/.
"""

import json
import signal

import pytest

from simigrad_jax.checkpoint.hook import CheckpointHook
from simigrad_jax.multihost import preemption
from simigrad_jax.multihost import process_agreement
from simigrad_jax.multihost.process_agreement import ProcessAgreement
from simigrad_jax.multihost.process_agreement import ProcessDisagreementError
from simigrad_jax.trainer.step_agreement import StepAgreement


class FakePolicy:
  """The compile policy as the agreement sees it: a compiled report, the agreed compiles."""

  def __init__(self, compiled: dict[str, int] | None):
    self.compiled = compiled
    self.agreed: list[dict[str, int]] | None = None

  def compiled_report(self) -> dict[str, int] | None:
    return self.compiled

  def agree_on_compiles(self, reports: list[dict[str, int]]) -> None:
    self.agreed = reports


class FakeCheckpoints:
  """The run's checkpoints as the agreement sees them: this process's failed save, if any."""

  def __init__(self, failed: str | None = None):
    self.failed = failed
    self.stopped_on: list[tuple[list[str | None], int]] = []

  def failed_save(self) -> str | None:
    return self.failed

  def stop_on_failed_saves(self, failed: list[str | None], step: int) -> None:
    self.stopped_on.append((failed, step))
    if any(failed):
      raise RuntimeError(f"a background save failed: {failed}")


class Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now


DECISION = {"step": 3, "batch_size": 64, "next_batch_size": 96, "lr_factor": 1.5}


def _agreement(policy, checkpoints, every_seconds=None, clock=None):
  saves = []
  hook = CheckpointHook(lambda: saves.append(1), None, every_seconds, clock or Clock())
  stop = preemption.RunStop()
  agreement = StepAgreement(ProcessAgreement(timeout=5.0), policy, checkpoints, hook, stop)
  return agreement, hook, stop


class _Step:
  def __init__(self, step: int, epoch_end: bool = False):
    self.step, self.epoch_end = step, epoch_end


def test_one_process_acts_on_its_own_report():
  policy, checkpoints = FakePolicy({"step": 0b101}), FakeCheckpoints()
  clock = Clock()
  agreement, hook, stop = _agreement(policy, checkpoints, every_seconds=10.0, clock=clock)
  clock.now = 4.0
  assert agreement.agree(3, DECISION) >= 0.0
  assert policy.agreed == [{"step": 0b101}]  # every process's compiles: this one's
  assert stop.agreed is None and not hook.due(_Step(3))
  clock.now = 12.0  # past checkpoint_every_seconds: the step agreed on saves on time
  agreement.agree(4, dict(DECISION, step=4))
  assert hook.due(_Step(4)) and not hook.due(_Step(5))
  agreement.raise_failed_saves(4)
  assert checkpoints.stopped_on == [([None], 4)]


def test_without_shared_compiles_nothing_is_agreed_on_them():
  policy = FakePolicy(None)
  agreement, _, _ = _agreement(policy, FakeCheckpoints())
  agreement.agree(1, DECISION)
  assert policy.agreed is None


def test_a_signal_on_this_process_stops_the_run_after_the_step():
  agreement, _, stop = _agreement(FakePolicy(None), FakeCheckpoints())
  with stop:
    stop.signals.received = signal.SIGTERM
    agreement.agree(2, DECISION)
  assert stop.agreed == "SIGTERM"


def test_a_failed_save_is_raised_once_the_records_are_out_and_only_once():
  checkpoints = FakeCheckpoints(failed="OSError: [Errno 28] No space left on device")
  agreement, _, _ = _agreement(FakePolicy(None), checkpoints)
  agreement.agree(5, DECISION)
  assert checkpoints.stopped_on == []  # not during the agreement
  with pytest.raises(RuntimeError, match="No space left on device"):
    agreement.raise_failed_saves(5)
  agreement.raise_failed_saves(6)  # the failure was handed on: nothing is raised again
  assert checkpoints.stopped_on[-1] == ([], 6)


def _simulate_processes(monkeypatch, others: list[tuple[dict, dict]]) -> list:
  """Makes this process process 0 of ``1 + len(others)``; each other has (decision, report)."""
  sent = []

  def gather(texts, what="values", *, timeout=None, set_up=False):
    sent.append((what, texts))
    rows = [list(texts)]
    for decision, report in others:
      values = [json.dumps(decision[key], sort_keys=True, default=str) for key in decision]
      rows.append(values + [json.dumps(report, sort_keys=True)])
    return rows

  monkeypatch.setattr(process_agreement.jax, "process_count", lambda: 1 + len(others))
  monkeypatch.setattr(process_agreement, "_gather_texts", gather)
  return sent


def test_several_processes_act_alike_on_every_report(monkeypatch):
  reports = [
    {"compiled": {"step": 0b011}, "signal": None, "since_checkpoint": 30.0, "failed_save": None},
    {"compiled": {"step": 0b110}, "signal": "SIGINT", "since_checkpoint": 1.0, "failed_save": None},
  ]
  sent = _simulate_processes(monkeypatch, [(DECISION, r) for r in reports])
  policy, checkpoints = FakePolicy({"step": 0b111}), FakeCheckpoints()
  agreement, hook, stop = _agreement(policy, checkpoints, every_seconds=20.0)
  agreement.agree(3, DECISION)
  assert sent[0][0] == "decision of step 3"
  # Every process's compiled shapes, in process order; process 0's clock decides a save on
  # time (this process's 0 s: none); a signal on any process stops every one.
  assert policy.agreed == [{"step": 0b111}, {"step": 0b011}, {"step": 0b110}]
  assert not hook.due(_Step(3))
  assert stop.agreed == "SIGINT"
  agreement.raise_failed_saves(3)
  assert checkpoints.stopped_on == [([None, None, None], 3)]


def test_another_processs_failed_save_stops_this_one_too(monkeypatch):
  failed = {"compiled": None, "signal": None, "since_checkpoint": 0.0, "failed_save": "OSError"}
  _simulate_processes(monkeypatch, [(DECISION, failed)])
  checkpoints = FakeCheckpoints()
  agreement, _, _ = _agreement(FakePolicy(None), checkpoints)
  agreement.agree(7, DECISION)
  with pytest.raises(RuntimeError, match=r"\[None, 'OSError'\]"):
    agreement.raise_failed_saves(7)


def test_processes_that_decided_differently_are_refused_naming_each_value(monkeypatch):
  report = {"compiled": None, "signal": None, "since_checkpoint": 0.0, "failed_save": None}
  _simulate_processes(monkeypatch, [(dict(DECISION, next_batch_size=80), report)])
  agreement, _, stop = _agreement(FakePolicy(None), FakeCheckpoints())
  with pytest.raises(
    ProcessDisagreementError,
    match=r"decision of step 3.*next_batch_size: process 0 has 96, process 1 has 80",
  ):
    agreement.agree(3, DECISION)
  assert stop.agreed is None
