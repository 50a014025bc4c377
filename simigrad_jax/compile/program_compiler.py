"""Host: the one compiler of a training step's programs, keyed by program and shape.

The fused steps and the micro-steps are compiled per shape, the update of
accumulated steps once, all from the lowerings of
:class:`~simigrad_jax.compile.step_functions.StepFunctions` and all by one
:class:`StepProgramCompiler`, keyed by
:class:`~simigrad_jax.compile.step_functions.ProgramShape`. Each program's
compiles run in a background thread of their own, so that a fused step, a
micro-step and the update compile side by side. The compiler says what it has
compiled (the *view* the compile fallback reads:
:mod:`simigrad_jax.compile.fallback`), how long compiles took and steps
waited, and what a program's memory is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from simigrad_jax import validation
from simigrad_jax.compile.compiler import MicroBatchSizes
from simigrad_jax.compile.compiler import StepCompiler
from simigrad_jax.compile.exit_wait import abandon_at_exit
from simigrad_jax.compile.step_functions import APPLY
from simigrad_jax.compile.step_functions import Program
from simigrad_jax.compile.step_functions import ProgramShape
from simigrad_jax.compile.step_functions import StepFunctions
from simigrad_jax.compile.step_functions import programs_of
from simigrad_jax.shapes import batch_plan
from simigrad_jax.shapes.layout import StepLayout


class ProgramShapes(MicroBatchSizes):
  """How the compiler of a step's programs names them: by program and shape
  (:class:`~simigrad_jax.compile.step_functions.ProgramShape`), each program in a background
  thread of its own."""

  def check(self, key: Any) -> ProgramShape:
    """``key`` as a :class:`~simigrad_jax.compile.step_functions.ProgramShape`: a program and
    its shape (an int ``>= 1``; 0 for the update).

    Raises:
      ValueError: when it names none.
    """
    try:
      program, micro = key
      program = Program(program)
    except (TypeError, ValueError):
      raise ValueError(
        f"a step's program must be a (program, micro_batch_size) pair, got {key!r}"
      ) from None
    if program is Program.APPLY:
      if micro != APPLY.micro:
        raise ValueError(f"the update has one shape, {APPLY.micro}: got {micro!r}")
      return APPLY
    return ProgramShape(program, validation.check_int("micro_batch_size", micro))

  def describe(self, key: ProgramShape) -> str:
    """The program ``key`` in words, for errors."""
    if key.program is Program.APPLY:
      return "the apply program (the update of accumulated micro-steps)"
    return f"the {key.program.value} program for micro_batch_size={key.micro}"

  def lane(self, key: ProgramShape) -> str:
    """The program's own background thread."""
    return key.program.value


class StepProgramCompiler(StepCompiler):
  """The compiler of a step's fused steps, micro-steps and update, keyed by program and shape.

  A :class:`~simigrad_jax.compile.compiler.StepCompiler` whose variants are
  :class:`~simigrad_jax.compile.step_functions.ProgramShape` keys (a
  ``(program, shape)`` pair: :meth:`prefetch` and :meth:`get` take them),
  with the fused steps, the micro-steps and the update each compiled in a
  background thread of their own, in the order each was queued.

  Args:
    functions: the step's jitted functions (their lowerings are compiled; kept as
      :attr:`functions`).
    layout: the step layout (shapes are reported in rows per device).
    background: compile in background threads.
    threads: each program's compiles that run at once (``threads`` threads
      for the fused steps' shapes, as many for the micro-steps').

  Example:
    ``StepProgramCompiler(functions, layout, background=True).view()`` is
    empty until a compile finishes; ``compiler.prefetch([(Program.FUSED,
    4)])`` starts one, ``compiler.get(APPLY)`` waits for the update's.
  """

  def __init__(
    self, functions: StepFunctions, layout: StepLayout, *, background: bool, threads: int = 1
  ):
    super().__init__(
      functions.lower, background=background, name="step", keys=ProgramShapes(), threads=threads
    )
    self.functions = functions
    self._layout = layout

  def view(self) -> dict[str, Any]:
    """The shapes (rows per slot) compiled so far, or whose compile failed.

    Returns:
      ``fused`` and ``micro``: the shapes with a fused step and with a
      micro-step; ``apply``: whether the update's compile has finished
      (compiled or failed); ``failed_fused`` and ``failed_micro``: the shapes
      whose compile failed.
    """
    stats = self.stats()
    compiled, failed = stats["compiled_sizes"], stats["failed_sizes"]
    return {
      "fused": _shapes(compiled, Program.FUSED),
      "micro": _shapes(compiled, Program.MICRO),
      "apply": APPLY in compiled or APPLY in failed,
      "failed_fused": _shapes(failed, Program.FUSED),
      "failed_micro": _shapes(failed, Program.MICRO),
    }

  def totals(self) -> dict[str, Any]:
    """Compiles so far, their seconds, the seconds steps waited, and the compiled shapes.

    Returns:
      ``compiles``, ``compile_seconds``, ``compile_wait_seconds``,
      ``compile_cache_hits`` (the compiles, of ``compiles``, that loaded
      their program from JAX's persistent compilation cache) and
      ``compile_cache_hit_seconds`` (their seconds, of ``compile_seconds``:
      tracing and lowering, then the load), over the three programs;
      ``compiled_step_sizes``, the shapes with a fused step,
      ``compiled_accumulation_sizes``, those with a micro-step, and
      ``compiled_micro_batch_sizes``, either (all in rows per device); and
      ``update_compiled``, whether the update of accumulated steps is.
    """
    stats = self.stats()
    compiled = stats["compiled_sizes"]
    fused, micro = _shapes(compiled, Program.FUSED), _shapes(compiled, Program.MICRO)
    return {
      "compiles": stats["compiles"],
      "compile_seconds": stats["compile_seconds"],
      "compile_wait_seconds": stats["compile_wait_seconds"],
      "compile_cache_hits": stats["cache_hits"],
      "compile_cache_hit_seconds": stats["cache_hit_seconds"],
      "compiled_micro_batch_sizes": self._device_rows(fused | micro),
      "compiled_step_sizes": self._device_rows(fused),
      "compiled_accumulation_sizes": self._device_rows(micro),
      "update_compiled": APPLY in compiled,
    }

  def memory(self, micro: int) -> dict[str, int]:
    """Compiled memory of the fused step of shape ``micro`` (compiling it if needed).

    Returns:
      ``micro_batch_size`` (rows per device), ``argument_bytes``,
      ``output_bytes``, ``alias_bytes`` (outputs that reuse donated
      arguments) and ``temp_bytes``, from XLA's ``memory_analysis()``.

    Raises:
      RuntimeError: when the backend reports no memory analysis.
    """
    analysis = self.get(ProgramShape(Program.FUSED, micro)).memory_analysis()
    if analysis is None:
      raise RuntimeError(f"XLA reports no memory analysis for the {jax.default_backend()} backend")
    return {
      "micro_batch_size": self._layout.device_rows(micro),
      "argument_bytes": int(analysis.argument_size_in_bytes),
      "output_bytes": int(analysis.output_size_in_bytes),
      "alias_bytes": int(analysis.alias_size_in_bytes),
      "temp_bytes": int(analysis.temp_size_in_bytes),
    }

  def wait_for(self, plan: batch_plan.BatchPlan, measure: bool = True) -> None:
    """Waits until ``plan``'s programs are compiled (a no-op when they are); ``measure=False``:
    those of a step that does not measure.

    Raises:
      CompileAbandoned: the interrupt (:meth:`set_interrupt`) said to give up.
      StepCompileError: the compile of one of them failed.
    """
    for key in programs_of(plan, measure):
      self.get(key)

  def set_interrupt(self, interrupt: Callable[[], bool] | None) -> None:
    """Makes a wait for a compile ask ``interrupt()`` every 50 ms whether to give up
    (:class:`~simigrad_jax.compile.compiler.CompileAbandoned`); None: never give up.

    When the interrupt it replaces says to give up (the run stopped on a
    signal), the interpreter's exit will wait for no compile in progress
    (:func:`~simigrad_jax.compile.exit_wait.abandon_at_exit`).
    """
    previous = self.interrupt
    if previous is not None and previous():
      abandon_at_exit()
    self.interrupt = interrupt

  def _device_rows(self, shapes: set[int]) -> list[int]:
    return [self._layout.device_rows(shape) for shape in sorted(shapes)]


def _shapes(keys: list[ProgramShape], program: Program) -> set[int]:
  """The shapes of ``program`` among ``keys``."""
  return {micro for kind, micro in keys if kind is program}
