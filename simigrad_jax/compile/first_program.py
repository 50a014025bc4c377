"""Host: the first step's programs, traced and lowered in a thread of their own while the rest of
a run is set up, ahead of the run's other programs.

A warm start (every program in the persistent compilation cache) still
traces and lowers each program before JAX can compute its cache key and load
the executable; the first step waits for its own. :class:`FirstProgram`
starts that work as soon as the step's functions exist, before the state is
placed on the devices and the workdir and its checkpoints are opened, so
that this set-up overlaps it: the traces run in a thread of their own (the
traces that check that the model, loss, optimizer and data fit each other),
then the lowerings, and the programs are queued first on their compiler,
which loads (or compiles) them. The first step's programs are its shape's
fused step, or where the run starts by accumulating
(:func:`~simigrad_jax.compile.schedule.starts_accumulating`) the grid's
smallest shape's micro-step and the update. Tracing and lowering hold the GIL, so the
compiler's threads hold the run's other programs (queued meanwhile) until
all are done
(:meth:`~simigrad_jax.compile.step_functions.StepFunctions.trace_under_way`):
what the first step needs goes first, and its loads or compiles, which
release the GIL, run beside theirs. Which program a step runs does not
change: only when the work on it begins.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from simigrad_jax.compile import exit_wait
from simigrad_jax.compile.program_compiler import StepProgramCompiler
from simigrad_jax.compile.step_functions import ProgramShape


class FirstProgram:
  """Traces and lowers the first step's programs in a thread of its own, then queues them on their
  compiler.

  Args:
    compiler: the step's compiler (its ``functions`` trace the programs).
    state: the placeholders of the state the functions were made from
      (kept as :attr:`state`: a caller compares them with the state the run
      resumes to before it uses this compiler).
    programs: the first step's programs, in the order to prepare them (its
      shape's fused step; or the micro-step of each shape it accumulates on
      and the update), kept as :attr:`programs`. Their traces check the run's
      objects: together they hold the loss, the data and the optimizer.
    checked: makes the context the traces run in (the Trainer's check that
      the optimizer's transform is named for the step's axis).
    queue: lower the programs once traced, and queue their loads (or
      compiles); False for a run that may resume, whose first shape its
      checkpoint decides (the traces still check the run's objects).

  Example:
    ``first = FirstProgram(compiler, state, [ProgramShape(Program.FUSED, 4)],
    contextlib.nullcontext, queue=True)`` returns at once; ``first.result()``
    waits for the traces and raises the first error, if any, as it is.
  """

  def __init__(
    self,
    compiler: StepProgramCompiler,
    state: Any,
    programs: list[ProgramShape],
    checked: Callable[[], contextlib.AbstractContextManager[object]],
    *,
    queue: bool,
  ) -> None:
    if not programs:
      raise ValueError("FirstProgram needs the first step's programs, got none")
    self.compiler, self.state, self.programs = compiler, state, list(programs)
    self._checked = checked
    self._queue = queue
    self._error: BaseException | None = None
    self._traced = threading.Event()  # the traces are over (result() returns)
    # Marked before the thread starts: the lowerings queued meanwhile wait for these (each mark
    # ends once its program is lowered, the rest when the work is over).
    functions = compiler.functions
    self._marks = [functions.trace_under_way(p.micro, p.program) for p in self.programs]
    self._thread = threading.Thread(target=self._work, name="step-first-trace", daemon=True)
    self._thread.start()

  def _work(self) -> None:
    try:
      try:
        with self._checked():
          for program in self.programs:
            self.compiler.functions.trace(program.micro, program.program)
      except BaseException as error:  # raised again by result(), in the caller's thread
        self._error = error
        return
      finally:
        self._traced.set()
      if self._queue:
        self._lower_and_queue()
    finally:
      while self._marks:
        self._marks.pop(0)()

  def _lower_and_queue(self) -> None:
    """Lowers each traced program and queues its load (or compile) at once, so that it compiles
    while the next one lowers; counted as a compile in progress (the interpreter's exit waits for
    it: :mod:`~simigrad_jax.compile.exit_wait`); not once the exit began."""
    if not exit_wait.IN_FLIGHT.begin():
      return
    try:
      for program in self.programs:
        self.compiler.functions.lower_ahead(program.micro, program.program)
        self._marks.pop(0)()  # (its compile need not wait for the next program's lowering)
        with contextlib.suppress(RuntimeError):  # the compiler closed: the set-up failed meanwhile
          self.compiler.prefetch([program], first=True)
    finally:
      exit_wait.IN_FLIGHT.end()

  def result(self) -> None:
    """Waits for the traces (not for the lowerings, which go on in the background).

    Raises:
      Exception: the first trace's error as it is (a ValueError naming the
        misfit of model, loss, optimizer and data, the loss function's
        contract error, or the transform's axis name refused).
    """
    self._traced.wait()
    if self._error is not None:
      raise self._error
