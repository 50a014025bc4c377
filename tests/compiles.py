"""Counting the XLA compiles a piece of code runs in the calling thread (JAX's monitoring events)."""

import contextlib
import threading
from collections.abc import Iterator

import jax

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def compiled_in_this_thread() -> Iterator[list[float]]:
  """Yields a list that gathers the seconds of each XLA backend compile run in this thread until
  the block ends; compiles of other threads are left out."""
  caller, seconds = threading.current_thread(), []

  def count(name, duration, **kwargs):
    if name == BACKEND_COMPILE and threading.current_thread() is caller:
      seconds.append(duration)

  jax.monitoring.register_event_duration_secs_listener(count)
  try:
    yield seconds
  finally:
    jax.monitoring.unregister_event_duration_listener(count)
