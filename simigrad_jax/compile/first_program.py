"""Host: the first step's program, traced and lowered in a thread of its own while the rest of a
run is set up, ahead of the run's other programs.

A warm start (every program in the persistent compilation cache) still
traces and lowers each program before JAX can compute its cache key and load
the executable; the first step waits for its own. :class:`FirstProgram`
starts that work as soon as the step's functions exist, before the state is
placed on the devices and the workdir and its checkpoints are opened, so
that this set-up overlaps it: the trace runs in a thread of its own (the
trace that checks that the model, loss, optimizer and data fit each other),
then the lowering, and the program is queued first on its compiler, which
loads (or compiles) it. Tracing and lowering hold the GIL, so the compiler's
threads hold the run's other programs (the fallback's micro-step and update,
queued meanwhile) until both are done
(:meth:`~simigrad_jax.compile.step_functions.StepFunctions.trace_under_way`):
what the first step needs goes first, and its load or compile, which
releases the GIL, runs beside theirs. Which program a step runs does not
change: only when the work on it begins.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from simigrad_jax.compile import exit_wait
from simigrad_jax.compile.program_compiler import StepProgramCompiler
from simigrad_jax.compile.step_functions import Program
from simigrad_jax.compile.step_functions import ProgramShape


class FirstProgram:
  """Traces and lowers the first step's fused program in a thread of its own, then queues it on its
  compiler.

  Args:
    compiler: the step's compiler (its ``functions`` trace the program).
    state: the placeholders of the state the functions were made from
      (kept as :attr:`state`: a caller compares them with the state the run
      resumes to before it uses this compiler).
    micro: the first step's shape, in rows per slot.
    checked: makes the context the trace runs in (the Trainer's check that
      the optimizer's transform is named for the step's axis).
    queue: lower the program once traced, and queue its load (or compile);
      False for a run that may resume, whose first shape its checkpoint
      decides (the trace still checks the run's objects).

  Example:
    ``first = FirstProgram(compiler, state, 4, contextlib.nullcontext, queue=True)``
    returns at once; ``first.result()`` waits for the trace and raises its
    error, if any, as it is.
  """

  def __init__(
    self,
    compiler: StepProgramCompiler,
    state: Any,
    micro: int,
    checked: Callable[[], contextlib.AbstractContextManager[object]],
    *,
    queue: bool,
  ) -> None:
    self.compiler, self.state, self.micro = compiler, state, micro
    self._checked = checked
    self._queue = queue
    self._error: BaseException | None = None
    self._traced = threading.Event()  # the trace is over (result() returns)
    # Marked before the thread starts: the lowerings queued meanwhile wait for this one's.
    self._work_over = compiler.functions.trace_under_way(micro)
    self._thread = threading.Thread(target=self._work, name="step-first-trace", daemon=True)
    self._thread.start()

  def _work(self) -> None:
    try:
      try:
        with self._checked():
          self.compiler.functions.trace(self.micro)
      except BaseException as error:  # raised again by result(), in the caller's thread
        self._error = error
        return
      finally:
        self._traced.set()
      if self._queue:
        self._lower()
        with contextlib.suppress(RuntimeError):  # the compiler closed: the set-up failed meanwhile
          self.compiler.prefetch([ProgramShape(Program.FUSED, self.micro)], first=True)
    finally:
      self._work_over()

  def _lower(self) -> None:
    """Lowers the traced program, counted as a compile in progress (the interpreter's exit waits
    for it: :mod:`~simigrad_jax.compile.exit_wait`); not once the exit began."""
    if not exit_wait.IN_FLIGHT.begin():
      return
    try:
      self.compiler.functions.lower_ahead(self.micro)
    finally:
      exit_wait.IN_FLIGHT.end()

  def result(self) -> None:
    """Waits for the trace (not for the lowering, which goes on in the background).

    Raises:
      Exception: the trace's error as it is (a ValueError naming the misfit of
        model, loss, optimizer and data, the loss function's contract error,
        or the transform's axis name refused).
    """
    self._traced.wait()
    if self._error is not None:
      raise self._error
