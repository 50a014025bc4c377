"""Host: the background part of a checkpoint save, watched so that its failure is known at once.

orbax finishes an asynchronous save in a thread of its own and raises a
failed save's error only in a thread that waits for it. :class:`BackgroundSave`
waits for it in a helper thread of its own, so that :meth:`BackgroundSave.failed`
reports a failed save without waiting (a run stops at its next step instead of
at its next save), and hands each failure to the caller once.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any


class BackgroundSave:
  """Watches the background part of the last save, started by :meth:`started`.

  Args:
    wait_until_finished: waits until the save under way has finished and
      raises its error if it failed (orbax's
      ``CheckpointManager.wait_until_finished``, which raises a failed save's
      error once in every thread that waits for it).

  Example:
    >>> save = BackgroundSave(lambda: None)
    >>> save.started()  # after each save
    >>> save.wait(timeout=10.0)
    True
    >>> save.failed() is None
    True
  """

  def __init__(self, wait_until_finished: Callable[[], Any]):
    self._wait_until_finished = wait_until_finished
    # Settles when the last save has finished or failed (a helper thread waits for it).
    self._waiting: concurrent.futures.Future | None = None
    self._reported: BaseException | None = None  # a failed save's error, once handed to the caller

  def started(self) -> None:
    """Starts watching the save just begun (the one before it waited for, see :meth:`wait`)."""
    self._waiting = concurrent.futures.Future()
    threading.Thread(
      target=_settle,
      args=(self._waiting, self._wait_until_finished),
      name="simigrad-checkpoint-wait",
      daemon=True,
    ).start()

  def failed(self) -> BaseException | None:
    """The error of the last save if its background part has failed; never waits.

    Returns:
      The save's error, or None while the save is under way, after it
      finished, or when there was none. The error counts as reported:
      :meth:`wait` does not raise it again.
    """
    waiting = self._waiting
    if waiting is None or not waiting.done():
      return None
    error = waiting.exception()
    return None if error is None else self._report(error)

  def wait(self, timeout: float | None = None) -> bool:
    """Waits until the last save's background part has finished; returns whether it has.

    Args:
      timeout: wait at most this many seconds (None: until it has finished).
        The wait goes on in the helper thread, which the next call joins.

    Returns:
      True when no save is under way any more, False when ``timeout`` ran out.

    Raises:
      Exception: the save's error, when its background part failed (once:
        not an error that :meth:`failed` returned).
    """
    waiting = self._waiting
    if waiting is None:  # no save since the last wait
      return True
    if not concurrent.futures.wait([waiting], timeout).done:
      return False
    self._waiting = None
    error = waiting.exception()
    if error is not None and error is not self._reported:
      raise self._report(error)
    return True

  def _report(self, error: BaseException) -> BaseException:
    """Remembers ``error``, a failed save's, as reported, and returns it.

    orbax raises a failed save's error once in every thread that waits for
    it: this thread's turn is taken here, so that orbax's own waits (before
    the next save, at close) do not raise it again.
    """
    self._reported = error
    try:
      self._wait_until_finished()
    except Exception as again:  # pylint: disable=broad-except
      if again is not error:
        raise
    return error


def _settle(future: concurrent.futures.Future, fn: Callable[[], Any]) -> None:
  """Runs ``fn()`` and settles ``future`` with its result or error."""
  try:
    future.set_result(fn())
  except BaseException as error:  # pylint: disable=broad-except  (handed to the waiting thread)
    future.set_exception(error)
