"""Host: this process's compiles in progress, and the interpreter's exit that waits for them.

Compiles run in daemon threads, and a compile inside XLA cannot be stopped.
At a normal interpreter exit (a script that returns with a neighbouring
shape still compiling), an ``atexit`` hook registered at the first compile
(after JAX's own, so it runs before JAX's clean-up) cancels the queued
compiles, starts no new one, and waits for those in progress, saying so on
stderr after a second: otherwise the interpreter's shutdown would meet them
inside JAX and abort the process (exit status 134). After a run stopped on a
signal it waits for none (:func:`abandon_at_exit`): the stop is prompt
(``python -m train`` ends with ``os._exit``, which runs no hook at all).
"""

from __future__ import annotations

import atexit
import sys
import threading
import weakref
from typing import Any, TextIO

# How long the exit waits for compiles in progress before it says so on stderr (seconds).
_EXIT_QUIET_SECONDS = 1.0


class _InFlight:
  """This process's compiles in progress, and the interpreter's exit that waits for them.

  Every compile starts through :meth:`begin` and ends with :meth:`end`; the
  first start registers :meth:`at_exit` with ``atexit`` (after JAX's own
  hooks, registered when JAX was imported: ``atexit`` runs the last
  registered first). Compilers register themselves (:meth:`track`, weakly)
  so that the exit can cancel what they have queued.
  """

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._idle = threading.Condition(self._lock)
    self._count = 0  # compiles in progress, in any thread
    self._exiting = False  # no compile starts once set
    self._abandon = False  # a run stopped on a signal: the exit waits for none
    self._hooked = False
    self._compilers: weakref.WeakSet[Any] = weakref.WeakSet()

  @property
  def in_progress(self) -> int:
    """The compiles in progress now."""
    with self._lock:
      return self._count

  def track(self, compiler: Any) -> None:
    """Cancels ``compiler``'s queued compiles (its ``close()``) at the exit, while it lives."""
    with self._lock:
      self._compilers.add(compiler)

  def begin(self) -> bool:
    """Counts a compile as started; False (not started, not counted) once the exit began."""
    with self._lock:
      if self._exiting:
        return False
      self._count += 1
      if not self._hooked:
        self._hooked = True
        atexit.register(self.at_exit)
    return True

  def end(self) -> None:
    """Counts a compile :meth:`begin` started as ended."""
    with self._lock:
      self._count -= 1
      self._idle.notify_all()

  def abandon(self) -> None:
    """Makes the exit wait for no compile: the run stopped on a signal."""
    with self._lock:
      self._abandon = True

  def at_exit(
    self, stream: TextIO | None = None, quiet_seconds: float = _EXIT_QUIET_SECONDS
  ) -> int:
    """Starts no more compiles, cancels the queued ones and waits for those in progress (unless
    :meth:`abandon` was called), saying so on ``stream`` (stderr) after ``quiet_seconds``.

    Returns:
      The compiles that were in progress.
    """
    with self._lock:
      self._exiting = True
      compilers, in_progress = list(self._compilers), self._count
    for compiler in compilers:
      compiler.close()
    with self._lock:
      if self._abandon or self._idle.wait_for(lambda: self._count == 0, quiet_seconds):
        return in_progress
      count = self._count
    noun = "compile" if count == 1 else "compiles"
    print(
      f"simigrad: waiting for {count} {noun} in progress before exit",
      file=sys.stderr if stream is None else stream,
      flush=True,
    )
    with self._lock:
      self._idle.wait_for(lambda: self._count == 0)
    return in_progress


# The process's compiles in progress (see _InFlight).
IN_FLIGHT = _InFlight()


def abandon_at_exit() -> None:
  """Makes the interpreter's exit wait for no compile in progress: the run stopped on a signal.

  A compile inside XLA cannot be stopped; a normal exit waits for those in
  progress, but after a SIGTERM's stop the process should end at once.
  """
  IN_FLIGHT.abandon()
