"""Waiting for what another thread or process does: a condition polled until it holds.

The timeout only ends a hang; a test never waits a fixed time for another
thread or process to reach a point (a loaded machine can hold either for
seconds).
"""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
  condition: Callable[[], object], timeout: float, what: str = "the condition", poll: float = 0.005
) -> None:
  """Returns once ``condition()`` is true; fails the test after ``timeout`` seconds."""
  deadline = time.monotonic() + timeout
  while not condition():
    assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
    time.sleep(poll)
