"""Host: a checkpoint read that the file system failed, told apart from damage and tried again.

A read of a checkpoint can fail for two reasons. The checkpoint is *damaged*
(a file garbled, truncated or missing): no later read can succeed, and the
caller skips it for an older one. Or the *file system* failed the read (an
``OSError`` such as EIO, or tensorstore's report of one, ``[OS error 5:
...]``): the checkpoint may be intact, so :func:`read_with_retries` tries the
read again, :data:`READ_ATTEMPTS` times in all, waiting a little longer each
time, and then raises an ``OSError`` that names the checkpoint.
"""

from __future__ import annotations

import errno
import logging
import re
import time
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger("simigrad_jax")

# A read that fails with a file-system error is tried this many times in all, the waits between
# the tries doubling from READ_RETRY_SECONDS.
READ_ATTEMPTS = 4
READ_RETRY_SECONDS = 0.25
# File-system errors that mean a file of the checkpoint is missing: damage, not a failed read.
_MISSING_FILE_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR})

T = TypeVar("T")


class Damaged(Exception):
  """A checkpoint found damaged by :func:`read_with_retries`; its error is the ``__cause__``."""


def read_with_retries(
  read: Callable[[], T],
  *,
  step: int,
  directory: str,
  not_damage: tuple[type[BaseException], ...] = (),
) -> T:
  """Returns ``read()``, trying it again while the file system fails it.

  Args:
    read: reads the checkpoint of ``step``.
    step: the checkpoint's step (for the messages).
    directory: the checkpoints' directory (for the messages).
    not_damage: errors of ``read`` that are raised as they are, neither
      damage nor a failed read (e.g. a checkpoint of another model).

  Returns:
    What ``read()`` returned.

  Raises:
    Damaged: ``read`` failed with any other error that is not of the file
      system (that error is the ``__cause__``).
    OSError: the file system failed every one of :data:`READ_ATTEMPTS` reads;
      its ``errno`` is the last read's.

  Example:
    >>> read_with_retries(lambda: {"step": 3}, step=3, directory="/tmp/ckpt")
    {'step': 3}
  """
  for attempt in range(1, READ_ATTEMPTS + 1):
    try:
      return read()
    except not_damage:
      raise
    except Exception as error:  # pylint: disable=broad-except  (sorted into damage and failed reads)
      code = file_system_errno(error)
      if code is None:
        raise Damaged() from error
      reason = f"{type(error).__name__}: {first_line(error)}"
      if attempt == READ_ATTEMPTS:
        raise OSError(
          code,
          f"reading the checkpoint at step {step} in {directory} failed "
          f"{READ_ATTEMPTS} times with an error of the file system ({reason}); "
          "the checkpoint may be intact, so nothing was skipped or moved: check "
          "the file system and run again",
        ) from error
      wait = READ_RETRY_SECONDS * 2 ** (attempt - 1)
      logger.warning(
        "reading the checkpoint at step %d in %s failed (%s); trying again in %g s",
        step,
        directory,
        reason,
        wait,
      )
      time.sleep(wait)
  raise AssertionError("unreachable")


def file_system_errno(error: BaseException | None) -> int | None:
  """The errno of a read that the file system failed, or None when ``error`` means damage.

  An ``OSError``, or tensorstore's report of one (``[OS error 5: ...]``), in
  ``error`` or its causes, is a failed read, unless it says that a file is
  missing: a checkpoint without one of its files is damaged.

  Args:
    error: what a read of a checkpoint raised.

  Returns:
    The errno (EIO for an ``OSError`` without one), or None for damage.

  Example:
    >>> file_system_errno(ValueError("read failed [OS error 5: Input/output error]"))
    5
    >>> file_system_errno(FileNotFoundError(2, "No such file")) is None
    True
  """
  while error is not None:
    if isinstance(error, OSError):
      code = errno.EIO if error.errno is None else error.errno
      return None if code in _MISSING_FILE_ERRNOS else code
    reported = re.search(r"\[OS error:? (\d+)", str(error))
    if reported:
      code = int(reported[1])
      return None if code in _MISSING_FILE_ERRNOS else code
    error = error.__cause__
  return None


def first_line(error: BaseException) -> str:
  """The first line of ``error``'s message, at most 400 characters (for a log line)."""
  return (str(error).strip().splitlines() or [""])[0][:400]
