"""The first step's program starts while the run is set up: traced in a thread of its own (errors
raised in the Trainer's constructor as before), lowered there while the run's other lowerings
wait, then queued first on its compiler; the Trainer uses the functions it made from the state's
placeholders, once; a new run's checkpoint program starts after its first step."""

from __future__ import annotations

import contextlib
import contextvars
import threading

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from simigrad_jax.checkpoint.checkpointer import Checkpointer
from simigrad_jax.compile.first_program import FirstProgram
from simigrad_jax.compile.step_functions import APPLY
from simigrad_jax.compile.step_functions import Program
from simigrad_jax.compile.step_functions import ProgramShape
from simigrad_jax.compile.step_functions import StepFunctions
from simigrad_jax.compile.step_runner import StepRunner
from simigrad_jax.shapes import mesh_sharding
from simigrad_jax.trainer import run_setup
from tiny_run import make_trainer

_CHECKED = contextvars.ContextVar("checked", default=False)


@contextlib.contextmanager
def checked():
  token = _CHECKED.set(True)
  try:
    yield
  finally:
    _CHECKED.reset(token)


class Functions:
  """Stands in for StepFunctions: records each trace, and whether it ran in ``checked()``, each
  lowering ahead, and the marks of a trace under way (made, then ended), by program."""

  def __init__(self, error=None):
    self.traced, self.error, self.marks, self.lowered = [], error, [], []

  def trace_under_way(self, micro, program=Program.FUSED):
    key = (program, micro)
    self.marks.append(("marked", key, len(self.traced), len(self.lowered)))
    return lambda: self.marks.append(("ended", key, len(self.traced), len(self.lowered)))

  def trace(self, micro, program=Program.FUSED):
    self.traced.append(((program, micro), _CHECKED.get()))
    if self.error is not None:
      raise self.error

  def lower_ahead(self, micro, program=Program.FUSED):
    self.lowered.append((program, micro))


class Compiler:
  """Stands in for StepProgramCompiler: records the prefetches; ``closed`` refuses them as its
  compiler does."""

  def __init__(self, functions, closed=False):
    self.functions, self.closed, self.prefetched = functions, closed, []

  def prefetch(self, programs, *, first=False):
    if self.closed:
      raise RuntimeError("closed")
    self.prefetched.append((list(programs), first, list(self.functions.lowered)))


FUSED_4 = ProgramShape(Program.FUSED, 4)
MICRO_4 = ProgramShape(Program.MICRO, 4)


def test_the_first_program_is_traced_in_the_check_lowered_then_queued_first():
  compiler = Compiler(Functions())
  first = FirstProgram(compiler, "state", [FUSED_4], checked, queue=True)
  first.result()
  first._thread.join()  # (the lowering goes on after result())
  assert compiler.functions.traced == [(FUSED_4, True)]
  assert compiler.functions.lowered == [FUSED_4]
  # Queued once lowered.
  assert compiler.prefetched == [([FUSED_4], True, [FUSED_4])]
  # Marked under way before the trace began, the mark ended once it was traced and lowered.
  assert compiler.functions.marks == [("marked", FUSED_4, 0, 0), ("ended", FUSED_4, 1, 1)]


def test_a_first_step_that_accumulates_traces_both_programs_then_queues_each_once_lowered():
  compiler = Compiler(Functions())
  first = FirstProgram(compiler, "state", [MICRO_4, APPLY], checked, queue=True)
  first.result()
  first._thread.join()
  # Both traced in the check (the loss and data in the one, the optimizer in the other).
  assert compiler.functions.traced == [(MICRO_4, True), (APPLY, True)]
  assert compiler.functions.lowered == [MICRO_4, APPLY]
  # Each queued as soon as it was lowered: the micro-step compiles while the update lowers.
  assert compiler.prefetched == [([MICRO_4], True, [MICRO_4]), ([APPLY], True, [MICRO_4, APPLY])]
  marks = compiler.functions.marks
  assert marks[:2] == [("marked", MICRO_4, 0, 0), ("marked", APPLY, 0, 0)]  # before any trace
  # The micro-step's mark ended once it was lowered, before the update's lowering.
  assert marks[2] == ("ended", MICRO_4, 2, 1)
  assert ("ended", APPLY, 2, 2) in marks[3:]


def test_the_first_program_needs_a_program():
  with pytest.raises(ValueError, match="needs the first step's programs, got none"):
    FirstProgram(Compiler(Functions()), "state", [], checked, queue=True)


def test_a_run_that_may_resume_only_traces_the_first_program():
  compiler = Compiler(Functions())
  first = FirstProgram(compiler, "state", [FUSED_4], checked, queue=False)
  first.result()
  first._thread.join()
  assert compiler.functions.traced == [(FUSED_4, True)]
  assert compiler.functions.lowered == []
  assert compiler.prefetched == []
  assert compiler.functions.marks == [("marked", FUSED_4, 0, 0), ("ended", FUSED_4, 1, 0)]


def test_the_traces_error_is_raised_as_it_is_and_nothing_is_queued():
  error = ValueError("loss_fn fails on one device's rows of this source")
  compiler = Compiler(Functions(error))
  first = FirstProgram(compiler, "state", [MICRO_4, APPLY], checked, queue=True)
  with pytest.raises(ValueError) as raised:
    first.result()
  assert raised.value is error
  first._thread.join()
  assert compiler.functions.traced == [(MICRO_4, True)]  # the first error stops the traces
  assert compiler.prefetched == [] and compiler.functions.lowered == []
  ended = [mark[1] for mark in compiler.functions.marks if mark[0] == "ended"]
  assert sorted(ended) == sorted([MICRO_4, APPLY])  # every mark ended on failure


def test_a_compiler_closed_while_the_first_program_traced_queues_nothing():
  compiler = Compiler(Functions(), closed=True)  # (the set-up failed meanwhile)
  first = FirstProgram(compiler, "state", [FUSED_4], checked, queue=True)
  first.result()  # no error
  first._thread.join()
  assert compiler.functions.traced == [(FUSED_4, True)]
  assert compiler.functions.marks[-1][0] == "ended"


def test_a_workdir_may_resume_when_its_checkpoint_folder_holds_anything(tmp_path):
  assert not run_setup.may_resume(tmp_path)
  (tmp_path / "checkpoints").mkdir()
  assert not run_setup.may_resume(tmp_path)
  (tmp_path / "checkpoints" / "3").mkdir()
  assert run_setup.may_resume(tmp_path)


def test_a_new_run_traces_its_first_step_once_on_functions_made_before_placing_the_state(
  tmp_path, monkeypatch
):
  made, traced, order = [], [], []
  real_init, real_trace = StepFunctions.__init__, StepFunctions.trace
  real_first, real_place = FirstProgram.__init__, run_setup.place_state

  def init(self, **kwargs):
    made.append(self)
    real_init(self, **kwargs)

  def trace(self, micro, program=Program.FUSED):
    traced.append((program, micro))
    real_trace(self, micro, program)

  def first(self, *args, **kwargs):
    order.append("first program")
    real_first(self, *args, **kwargs)

  def place(*args):
    order.append("state placed")
    return real_place(*args)

  monkeypatch.setattr(StepFunctions, "__init__", init)
  monkeypatch.setattr(StepFunctions, "trace", trace)
  monkeypatch.setattr(FirstProgram, "__init__", first)
  monkeypatch.setattr(run_setup, "place_state", place)
  with make_trainer(tmp_path / "run") as trainer:
    summary = trainer.train(num_steps=1)
  assert summary["run_steps"] == 1
  # One set of functions, made from the placeholders: the placed state's were the same.
  assert len(made) == 1 and trainer._programs.functions is made[0]
  assert len(traced) == 1
  assert order == ["first program", "state placed"]


def test_the_placeholders_made_before_placing_are_those_of_the_placed_state(devices):
  mesh = Mesh(np.array(devices), ("data",))
  params = {"w": np.ones((3, 2), np.float64), "b": np.zeros(2, np.float32), "s": 1.5}
  optimizer = optax.sgd(0.1, momentum=0.9)
  initial = {"params": params, "opt_state": optimizer.init(params), "model_state": None}
  specs = mesh_sharding.param_specs(None, params, mesh)
  placed = run_setup.place_state(initial, optimizer, specs, mesh)
  abstract = run_setup.abstract_state(initial, optimizer, specs, mesh)
  assert run_setup._same_placeholders(placed, abstract)
  assert abstract["params"]["w"].dtype == jax.numpy.float32  # as JAX places a float64 leaf


def test_a_lowering_of_a_shape_under_way_waits_for_its_trace_and_lowers_from_it(tmp_path):
  with make_trainer(tmp_path / "run") as trainer:
    functions = trainer._programs.functions
    # A shape no program of the run compiles: the run's first program (its own mark, its
    # lowering ahead, its compile) may still be under way in the background, on its shape.
    micro = max(trainer.layout.grid) + 1
    end = functions.trace_under_way(micro)
    lowered = []
    lowering = threading.Thread(target=lambda: lowered.append(functions.lower_fused(micro)))
    lowering.start()
    lowering.join(0.5)
    assert lowering.is_alive() and not lowered  # waits while the trace is under way
    functions.trace(micro)
    end()
    lowering.join()
    assert len(lowered) == 1 and isinstance(lowered[0], jax.stages.Lowered)
    assert (Program.FUSED, micro) not in functions._traced  # lowered from it, not traced again


def test_every_lowering_waits_for_the_first_programs_and_its_own_lowers_ahead(tmp_path):
  with make_trainer(tmp_path / "run") as trainer:
    functions = trainer._programs.functions
    # A shape no compile of the run asks for (its first step's may still be lowering, and its
    # compile threads take the others': either would take this shape's lowering ahead).
    micro = max(trainer.layout.grid) + 1
    end = functions.trace_under_way(micro)
    lowered = []
    update = threading.Thread(target=lambda: lowered.append(functions.lower(APPLY)))
    update.start()
    update.join(0.5)
    assert update.is_alive() and not lowered  # the update's lowering waits while it is under way
    key = ProgramShape(Program.FUSED, micro)
    functions.trace(micro)
    functions.lower_ahead(micro)
    assert key not in functions._traced  # lowered from the trace, in this thread
    ahead = functions._lowered[key]
    end()
    update.join()
    assert len(lowered) == 1 and isinstance(lowered[0], jax.stages.Lowered)
    assert functions.lower(key) is ahead  # not lowered again
    assert key not in functions._lowered


def test_a_new_runs_checkpoint_program_starts_after_its_first_step_a_resumes_before(
  tmp_path, monkeypatch
):
  events = []
  real_prepare, real_run = Checkpointer.prepare, StepRunner.run

  def prepare(self, like):
    events.append("checkpoint program")
    real_prepare(self, like)

  def run(self, *args, **kwargs):
    events.append("step")
    return real_run(self, *args, **kwargs)

  monkeypatch.setattr(Checkpointer, "prepare", prepare)
  monkeypatch.setattr(StepRunner, "run", run)
  with make_trainer(tmp_path / "run") as trainer:
    trainer.train(num_steps=2)
  assert events == ["step", "checkpoint program", "step"]
  events.clear()
  with make_trainer(tmp_path / "run") as trainer:  # resumed at step 2: prepared for the restore
    assert trainer.step == 2
    assert events == ["checkpoint program"]
    trainer.train(num_steps=3)
  assert events[:2] == ["checkpoint program", "step"]
