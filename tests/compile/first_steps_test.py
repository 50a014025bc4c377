"""A run waits only for the programs its steps run: on the compile schedule the first step does not
wait for the micro-step and the update admitted beside its own program, and the programs of the
plans the next step is likely to run compile ahead of the others."""

from __future__ import annotations

import threading

import schedule_test
from recording_compilers import RecordingCompiler

import simigrad_jax
from simigrad_jax.compile.policy import ExactPrograms
from simigrad_jax.compile.schedule import CompileSchedule
from simigrad_jax.compile.schedule import ScheduledFallback
from simigrad_jax.compile.step_functions import StepFunctions
from tiny_run import make_trainer
from waiting import wait_until

# A deadlock breaker, not a timing: the gated compiles wait at most this long for the first step.
GATE_SECONDS = 300


class FirstStepSeen:
  """A hook that opens ``gate`` when the first step's record comes (as soon as it is decided)."""

  runs_at_once = True

  def __init__(self, gate: threading.Event):
    self.gate = gate

  def on_step(self, record):
    if record.step == 1:
      self.gate.set()


def test_the_first_step_does_not_wait_for_the_fallbacks_micro_step_and_update(
  tmp_path, monkeypatch
):
  gate = threading.Event()
  opened_by_the_step = []  # per gated compile: whether the first step opened its gate
  for name in ("lower_micro", "lower_apply"):
    real = getattr(StepFunctions, name)

    def gated(self, *args, _real=real):
      opened_by_the_step.append(gate.wait(GATE_SECONDS))
      return _real(self, *args)

    monkeypatch.setattr(StepFunctions, name, gated)
  # Steps on one shape: 20 examples are 3 rows a device in one micro-batch, one fused program
  # (the grid's smallest micro-step and the update are admitted with it, for the fallback to
  # accumulate on). With steps of several shapes they would be 2 + 1 rows, on micro-steps.
  one_shape = simigrad_jax.CompileConfig(shapes_per_step=1)
  with make_trainer(tmp_path / "run", hooks=[FirstStepSeen(gate)], compile=one_shape) as trainer:
    summary = trainer.train(num_steps=3)
    # (it compiles in the background, after the first step)
    wait_until(lambda: trainer.compile_stats()["update_compiled"], GATE_SECONDS, "the update")
  assert summary["run_steps"] == 3
  assert opened_by_the_step and all(opened_by_the_step)  # (the update's among them)


def policy_on(schedule):
  """A compile policy's choices alone (no compiles): on ``schedule``, or without the fallback."""
  compiler = RecordingCompiler()
  if schedule is None:
    return ExactPrograms(compiler, None, None), compiler
  scheduled = ScheduledFallback(compiler, schedule, schedule_test.layout(), None)
  compiler.calls.clear()  # (the update's compile, queued at once)
  return scheduled, compiler


def test_a_plan_a_step_is_about_to_run_moves_its_programs_ahead_of_the_queue():
  grid = schedule_test.layout()
  plans = CompileSchedule(grid, 0.5, [])
  plans.start(grid.plan(8), 0)
  policy, compiler = policy_on(plans)
  chosen = policy.ready_plan(grid.plan(24), 1)  # 3 rows: not admitted, on 1 row instead
  assert (chosen.micro_batch_size, chosen.accumulation_steps) == (1, 3)
  assert compiler.calls == [([("micro", 1), ("apply", 0)], True)]
  assert policy.ready_plan(grid.plan(24), 1, prefetch=False) == chosen  # (the run's last step)
  assert len(compiler.calls) == 1
  unscheduled, compiler = policy_on(None)  # without the fallback: the plan itself, ahead
  assert unscheduled.ready_plan(grid.plan(24), 1) == grid.plan(24)
  assert compiler.calls == [([("fused", 3)], True)]
