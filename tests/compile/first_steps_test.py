"""A run on the compile schedule waits only for the programs its steps run: the first step does not
wait for the micro-step and the update the schedule admits beside its own program."""

from __future__ import annotations

import threading
import time

from simigrad_jax.compile.step_functions import StepFunctions
from tiny_run import make_trainer

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
  with make_trainer(tmp_path / "run", hooks=[FirstStepSeen(gate)]) as trainer:
    # 20 examples: 3 rows a device in one micro-batch (the micro-step of 3 and the update are
    # admitted with it, for the fallback to accumulate on).
    summary = trainer.train(num_steps=3)
    deadline = time.monotonic() + GATE_SECONDS
    while not trainer.compile_stats()["update_compiled"] and time.monotonic() < deadline:
      time.sleep(0.05)  # (it compiles in the background, after the first step)
  assert summary["run_steps"] == 3
  assert opened_by_the_step and all(opened_by_the_step)  # (the update's among them)
