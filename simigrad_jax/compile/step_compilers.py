"""Host: the compilers of a training step's three programs, and what they have compiled.

The one-micro-batch programs and the micro-steps are compiled per shape
(:class:`~simigrad_jax.compile.compiler.StepCompiler`), the update of
accumulated steps once (:class:`~simigrad_jax.compile.compiler.ProgramCompiler`),
all from the lowerings of
:class:`~simigrad_jax.compile.step_functions.StepFunctions`.
:class:`StepCompilers` holds the three and says what they have compiled (the
*view* the compile fallback reads: :mod:`simigrad_jax.compile.fallback`), how
long compiles took and steps waited, and what a program's memory is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from simigrad_jax.compile.compiler import ProgramCompiler
from simigrad_jax.compile.compiler import StepCompiler
from simigrad_jax.compile.exit_wait import abandon_at_exit
from simigrad_jax.compile.step_functions import StepFunctions
from simigrad_jax.shapes import batch_plan
from simigrad_jax.shapes.layout import StepLayout

# The counts a compiler's stats() gives that the step's stats() adds up over its three compilers.
_SUMMED = ("compiles", "compile_seconds", "compile_wait_seconds", "cache_hits", "cache_hit_seconds")


class StepCompilers:
  """The compilers of a step's one-micro-batch programs, micro-steps and update.

  Attributes:
    fused: the one-micro-batch programs, one per shape (rows per slot).
    micro: the micro-steps, one per shape.
    update: the update of accumulated steps.

  Args:
    functions: the step's jitted functions (their lowerings are compiled).
    layout: the step layout (shapes are reported in rows per device).
    background: compile in background threads.

  Example:
    ``StepCompilers(functions, layout, background=True).view()`` is empty
    until a compile finishes; ``compilers.fused.prefetch([4])`` starts one.
  """

  def __init__(self, functions: StepFunctions, layout: StepLayout, *, background: bool):
    self._layout = layout
    self._background = background
    self.fused = StepCompiler(functions.lower_fused, background=background, name="fused_step")
    self.micro = StepCompiler(functions.lower_micro, background=background, name="micro_step")
    self.update = ProgramCompiler(functions.lower_apply, background=background, name="apply")

  def view(self) -> dict[str, Any]:
    """The shapes (rows per slot) compiled so far, or whose compile failed.

    Returns:
      ``fused`` and ``micro``: the shapes with a one-micro-batch program and
      with a micro-step; ``apply``: whether the update's compile has
      finished (compiled or failed); ``failed_fused`` and ``failed_micro``:
      the shapes whose compile failed.
    """
    fused, micro = self.fused.stats(), self.micro.stats()
    return {
      "fused": set(fused["compiled_sizes"]),
      "micro": set(micro["compiled_sizes"]),
      "apply": self.update.done,
      "failed_fused": set(fused["failed_sizes"]),
      "failed_micro": set(micro["failed_sizes"]),
    }

  def wait_seconds(self) -> float:
    """Seconds steps have waited for compiles so far (cheap enough for every step)."""
    return self.fused.wait_seconds + self.micro.wait_seconds + self.update.wait_seconds

  def stats(self) -> dict[str, Any]:
    """Compiles so far, their seconds, the seconds steps waited, and the compiled shapes.

    Returns:
      ``compiles``, ``compile_seconds``, ``compile_wait_seconds``,
      ``compile_cache_hits`` (the compiles, of ``compiles``, that loaded
      their program from JAX's persistent compilation cache) and
      ``compile_cache_hit_seconds`` (their seconds, of ``compile_seconds``:
      tracing and lowering, then the load), over the three compilers;
      ``compiled_step_sizes``, the shapes with a one-micro-batch program,
      ``compiled_accumulation_sizes``, those with a micro-step, and
      ``compiled_micro_batch_sizes``, either (all in rows per device); and
      ``update_compiled``, whether the update of accumulated steps is.
    """
    fused, micro, update = self.fused.stats(), self.micro.stats(), self.update.stats()
    total = {key: fused[key] + micro[key] + update[key] for key in _SUMMED}
    return {
      "compiles": total["compiles"],
      "compile_seconds": total["compile_seconds"],
      "compile_wait_seconds": total["compile_wait_seconds"],
      "compile_cache_hits": total["cache_hits"],
      "compile_cache_hit_seconds": total["cache_hit_seconds"],
      "compiled_micro_batch_sizes": self._device_rows(
        sorted(set(fused["compiled_sizes"]) | set(micro["compiled_sizes"]))
      ),
      "compiled_step_sizes": self._device_rows(fused["compiled_sizes"]),
      "compiled_accumulation_sizes": self._device_rows(micro["compiled_sizes"]),
      "update_compiled": update["compiled"],
    }

  def memory(self, micro: int) -> dict[str, int]:
    """Compiled memory of the one-micro-batch program of shape ``micro`` (compiling it if needed).

    Returns:
      ``micro_batch_size`` (rows per device), ``argument_bytes``,
      ``output_bytes``, ``alias_bytes`` (outputs that reuse donated
      arguments) and ``temp_bytes``, from XLA's ``memory_analysis()``.

    Raises:
      RuntimeError: when the backend reports no memory analysis.
    """
    analysis = self.fused.get(micro).memory_analysis()
    if analysis is None:
      raise RuntimeError(f"XLA reports no memory analysis for the {jax.default_backend()} backend")
    return {
      "micro_batch_size": self._layout.device_rows(micro),
      "argument_bytes": int(analysis.argument_size_in_bytes),
      "output_bytes": int(analysis.output_size_in_bytes),
      "alias_bytes": int(analysis.alias_size_in_bytes),
      "temp_bytes": int(analysis.temp_size_in_bytes),
    }

  def queue(self, programs: list[tuple[str, int]], *, first: bool = False) -> None:
    """Queues ``programs`` (``("fused", shape)``, ``("micro", shape)`` or ``("apply", 0)``) for
    the background compilers, in order (each compiler's queue apart); with ``first``, ahead of
    those queued before (those of them still waiting move ahead too). A no-op without background
    compiles."""
    if not self._background:
      return
    fused = [size for kind, size in programs if kind == "fused"]
    micro = [size for kind, size in programs if kind == "micro"]
    if fused:
      self.fused.prefetch(fused, first=first)
    if micro:
      self.micro.prefetch(micro, first=first)
    if ("apply", 0) in programs:
      self.update.prefetch()

  def wait_for(self, plan: batch_plan.BatchPlan) -> None:
    """Waits until ``plan``'s programs are compiled (a no-op when they are).

    Raises:
      CompileAbandoned: the interrupt (:meth:`set_interrupt`) said to give up.
      StepCompileError: the compile of one of them failed.
    """
    if plan.accumulation_steps == 1:
      self.fused.get(plan.micro_batch_size)
    else:
      self.micro.get(plan.micro_batch_size)
      self.update.get()

  def set_interrupt(self, interrupt: Callable[[], bool] | None) -> None:
    """Makes a wait for a compile ask ``interrupt()`` every 50 ms whether to give up
    (:class:`~simigrad_jax.compile.compiler.CompileAbandoned`); None: never give up.

    When the interrupt it replaces says to give up (the run stopped on a
    signal), the interpreter's exit will wait for no compile in progress
    (:func:`~simigrad_jax.compile.exit_wait.abandon_at_exit`).
    """
    for compiler in (self.fused, self.micro, self.update):
      previous = compiler.interrupt
      if previous is not None and previous():
        abandon_at_exit()
      compiler.interrupt = interrupt

  def close(self) -> None:
    """Cancels queued compiles and abandons those in progress (returns at once)."""
    self.fused.close()
    self.micro.close()
    self.update.close()

  def _device_rows(self, sizes: list[int]) -> list[int]:
    return [self._layout.device_rows(size) for size in sizes]
