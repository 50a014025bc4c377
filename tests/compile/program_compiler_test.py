"""The compiler of a step's three programs, keyed by program and shape: what it compiled, in which
threads, its totals, a program's memory."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from simigrad_jax.compile.compiler import CompileAbandoned
from simigrad_jax.compile.compiler import StepCompileError
from simigrad_jax.compile.program_compiler import StepProgramCompiler
from simigrad_jax.compile.step_functions import APPLY
from simigrad_jax.compile.step_functions import Program
from simigrad_jax.compile.step_functions import ProgramShape
from simigrad_jax.compile.step_functions import StepFunctions
from simigrad_jax.shapes.layout import StepLayout
from waiting import wait_until

TIMEOUT = 20.0  # seconds; generous upper bound for anything we wait on


def fused(micro):
  return ProgramShape(Program.FUSED, micro)


def micro_step(micro):
  return ProgramShape(Program.MICRO, micro)


class TinyFunctions:
  """Lowerings of tiny programs in place of a step's (``fail``: shapes whose lowering fails)."""

  def __init__(self, fail=(), fail_apply=False, gate=None):
    self.fail, self.fail_apply, self.gate = set(fail), fail_apply, gate
    self.double = jax.jit(lambda x: 2 * x)
    self.threads = []  # the threads each lowering ran in
    self._traces_under_way = {}  # (none: StepFunctions.lower waits for no trace)
    self._lowered = {}  # (none lowered ahead)

  lower = StepFunctions.lower  # (dispatches on the program, as the step's own)

  def lower_fused(self, micro):
    self.threads.append(threading.current_thread().name)
    if micro in self.fail:
      raise RuntimeError(f"out of memory at {micro} (injected)")
    return self.double.lower(jax.ShapeDtypeStruct((micro, 3), jnp.float32))

  def lower_micro(self, micro):
    self.threads.append(threading.current_thread().name)
    return self.double.lower(jax.ShapeDtypeStruct((micro, 5), jnp.float32))

  def lower_apply(self):
    self.threads.append(threading.current_thread().name)
    if self.gate is not None:
      assert self.gate.wait(TIMEOUT)
    if self.fail_apply:
      raise ValueError("no update (injected)")
    return self.double.lower(jax.ShapeDtypeStruct((7,), jnp.float32))


def layout(halves):
  return StepLayout.create(
    halves, 4, mode="recompile", max_micro=16, min_micro=2, lower=8, upper=64
  )


@pytest.fixture
def compiler():
  compiler = StepProgramCompiler(TinyFunctions(fail={8}), layout("local"), background=True)
  yield compiler
  compiler.close()


def test_the_view_holds_what_is_compiled_and_what_failed(compiler):
  assert compiler.view() == {
    "fused": set(),
    "micro": set(),
    "apply": False,
    "failed_fused": set(),
    "failed_micro": set(),
  }
  compiler.get(fused(2))
  compiler.get(micro_step(4))
  compiler.get(APPLY)
  with pytest.raises(Exception, match="injected"):
    compiler.get(fused(8))
  assert compiler.view() == {
    "fused": {2},
    "micro": {4},
    "apply": True,
    "failed_fused": {8},
    "failed_micro": set(),
  }


def test_the_totals_add_up_the_three_programs_in_rows_per_device(compiler):
  compiler.get(fused(2))
  compiler.get(fused(4))
  compiler.get(micro_step(4))
  stats = compiler.totals()
  assert stats["compiles"] == 3 and not stats["update_compiled"]
  compiler.get(APPLY)
  stats = compiler.totals()
  assert stats["compiles"] == 4 and stats["update_compiled"]
  assert stats["compile_seconds"] == compiler.stats()["compile_seconds"] > 0
  assert stats["compile_cache_hits"] == 0 and stats["compile_cache_hit_seconds"] == 0
  # The local split: two slots a device, so rows per device are twice the shapes.
  assert stats["compiled_step_sizes"] == [4, 8]
  assert stats["compiled_accumulation_sizes"] == [8]
  assert stats["compiled_micro_batch_sizes"] == [4, 8]


def test_the_wait_counts_every_program_a_caller_blocked_on(compiler):
  assert compiler.wait_seconds == 0
  compiler.get(fused(2))  # compiled in this thread, so waited for
  after_fused = compiler.wait_seconds
  compiler.get(APPLY)
  waited = compiler.wait_seconds
  assert 0 < after_fused < waited and waited == compiler.totals()["compile_wait_seconds"]


def test_memory_is_reported_in_rows_per_device():
  compiler = StepProgramCompiler(TinyFunctions(), layout("device"), background=False)
  memory = compiler.memory(4)
  compiler.close()
  assert memory["micro_batch_size"] == 4
  assert memory["argument_bytes"] == 4 * 3 * 4 and memory["output_bytes"] == 4 * 3 * 4
  assert set(memory) == {
    "micro_batch_size",
    "argument_bytes",
    "output_bytes",
    "alias_bytes",
    "temp_bytes",
  }


def test_close_closes_every_program_and_keeps_what_is_compiled():
  compiler = StepProgramCompiler(TinyFunctions(), layout("device"), background=True)
  compiler.get(fused(2))
  compiler.prefetch([micro_step(2), micro_step(4), micro_step(8)])
  compiler.close()
  for program in (fused(4), micro_step(4)):
    with pytest.raises(RuntimeError, match="closed"):
      compiler.prefetch([program])
  assert 2 in compiler.view()["fused"]


def test_each_program_compiles_in_a_background_thread_of_its_own():
  gate = threading.Event()
  functions = TinyFunctions(gate=gate)
  compiler = StepProgramCompiler(functions, layout("device"), background=True)
  compiler.prefetch([APPLY, fused(2), micro_step(4)])  # the update's compile waits for the gate
  # The update's compile must have started in its own thread before the get() below: on a loaded
  # machine that thread may start after the others are done, and a get() of a program still
  # queued compiles it in the calling thread.
  wait_until(
    lambda: (
      "step-apply-compiler" in functions.threads
      and compiler.view()["fused"] == {2}
      and compiler.view()["micro"] == {4}
    ),
    TIMEOUT,
    "the others to compile beside the update",
  )
  gate.set()
  compiler.get(APPLY)
  compiler.close()
  assert sorted(functions.threads) == [
    "step-apply-compiler",
    "step-fused-compiler",
    "step-micro-compiler",
  ]


def test_the_update_compiles_once_and_a_get_before_it_is_done_counts_as_wait():
  gate = threading.Event()
  functions = TinyFunctions(gate=gate)
  compiler = StepProgramCompiler(functions, layout("device"), background=True)
  compiler.prefetch([APPLY])
  compiler.prefetch([APPLY])  # once only
  # The compile thread takes it (on a busy machine, later).
  wait_until(lambda: functions.threads, TIMEOUT, "the update's compile to start")
  # The gate opens once the get() below waits (its first ask of the interrupt, 50 ms in): a timer
  # could open it, on a loaded machine, before the get() is reached and the compile be done.
  waiting = threading.Event()
  compiler.set_interrupt(lambda: (waiting.set(), False)[1])
  threading.Thread(target=lambda: (waiting.wait(TIMEOUT), gate.set())).start()
  np.testing.assert_allclose(compiler.get(APPLY)(jnp.ones(7)), np.full(7, 2.0))
  assert compiler.get(APPLY) is compiler.get(APPLY)
  compiler.close()
  stats = compiler.stats()
  assert functions.threads == ["step-apply-compiler"]
  assert stats["compiles"] == 1 and stats["compile_seconds"] > 0 and stats["cache_hits"] == 0
  assert compiler.wait_seconds >= 0.05 and stats["compile_wait_seconds"] == compiler.wait_seconds


def test_without_background_a_program_compiles_at_its_get_in_the_calling_thread():
  functions = TinyFunctions()
  compiler = StepProgramCompiler(functions, layout("device"), background=False)
  compiler.prefetch([APPLY])
  assert functions.threads == [] and not compiler.view()["apply"]
  compiler.get(APPLY)
  compiler.close()
  assert functions.threads == [threading.current_thread().name]
  assert compiler.totals()["compiles"] == 1 and compiler.totals()["update_compiled"]


def test_a_failed_update_raises_its_error_at_every_get():
  compiler = StepProgramCompiler(TinyFunctions(fail_apply=True), layout("device"), background=True)
  for _ in range(2):
    with pytest.raises(StepCompileError, match=r"the apply program.*no update \(injected\)"):
      compiler.get(APPLY)
  compiler.close()
  assert compiler.view()["apply"]  # done: a step would raise, never wait for it
  assert compiler.totals()["compiles"] == 0 and not compiler.totals()["update_compiled"]


def test_a_failed_shape_is_named_by_its_program():
  compiler = StepProgramCompiler(TinyFunctions(fail={8}), layout("device"), background=False)
  with pytest.raises(StepCompileError, match=r"'step'.*the fused program for micro_batch_size=8"):
    compiler.get(fused(8))
  compiler.close()


def test_a_wait_for_the_update_gives_up_on_the_interrupt():
  gate = threading.Event()
  compiler = StepProgramCompiler(TinyFunctions(gate=gate), layout("device"), background=True)
  compiler.set_interrupt(lambda: True)
  with pytest.raises(CompileAbandoned, match="apply"):
    compiler.get(APPLY)
  compiler.close()  # at once, the compile still running
  gate.set()
  compiler.set_interrupt(None)
  np.testing.assert_allclose(compiler.get(APPLY)(jnp.ones(7)), np.full(7, 2.0))


@pytest.mark.parametrize(
  "bad", [4, ("fused",), ("step", 4), ("fused", 0), ("micro", 2.5), ("apply", 1), None]
)
def test_a_key_that_names_no_program_is_refused(compiler, bad):
  with pytest.raises(ValueError, match="program|micro_batch_size|one shape"):
    compiler.get(bad)
  with pytest.raises(ValueError, match="program|micro_batch_size|one shape"):
    compiler.prefetch([bad])


def test_keys_given_as_names_are_the_programs():
  compiler = StepProgramCompiler(TinyFunctions(), layout("device"), background=False)
  assert compiler.get(("fused", 2)) is compiler.get(fused(2))
  assert compiler.get(("apply", 0)) is compiler.get(APPLY)
  compiler.close()
  assert compiler.stats()["compiled_sizes"] == [APPLY, fused(2)]
