"""Host: save and restore training state with orbax-checkpoint, and detect damaged checkpoints.

A checkpoint holds two items: ``state`` (a pytree of arrays: parameters,
optimizer state, model state) saved with ``StandardSave``, and ``host`` (plain
JSON: step, controller, sampler position, counters) saved with ``JsonSave``.
orbax writes each checkpoint into a temporary directory and renames it when
complete, so a crash mid-save leaves the previous checkpoint usable.

orbax does not notice every damaged file, so the ``host`` item also carries
the layout of the state, checksums of its arrays and a CRC-32 of the JSON
itself (:mod:`simigrad_jax.checkpoint.integrity`). Restore checks all
three: a checkpoint that fails is *unreadable*, reported as a warning, and the
one before it is tried; unreadable checkpoints newer than the one restored are
moved aside to ``<directory>.unreadable/`` so that the resumed run can save
those steps again. A readable checkpoint whose layout differs from the model
(a different model, or a different optimizer) is *not* skipped: restore
raises :class:`CheckpointMismatchError` naming the differences. Checkpoints
written before these records existed are restored unverified, with a warning.

Only damage is moved aside. A read that fails with an error of the file
system (an ``OSError`` such as EIO, or tensorstore's report of one), not of
the checkpoint's contents, is tried again :data:`READ_ATTEMPTS` times in all,
waiting a little longer each time, and then raised as an ``OSError`` that
names the checkpoint; nothing is skipped or moved. A file the checkpoint
should hold but that is missing is damage.

A background save that fails is reported by :meth:`Checkpointer.failed_save`
without waiting, so that a run can stop at its next step instead of at its
next save.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import os
import re
import threading
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from simigrad_jax.checkpoint import integrity
from simigrad_jax.errors import SimiGradError

logger = logging.getLogger("simigrad_jax")

# A read that fails with a file-system error is tried this many times in all, the waits between
# the tries doubling from READ_RETRY_SECONDS.
READ_ATTEMPTS = 4
READ_RETRY_SECONDS = 0.25
# File-system errors that mean a file of the checkpoint is missing: damage, not a failed read.
_MISSING_FILE_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR})


class CheckpointMismatchError(SimiGradError, ValueError):
  """A readable checkpoint that does not fit the state it is restored into (e.g. a different model)."""


class Checkpointer:
  """Keeps the newest ``max_to_keep`` checkpoints of a run in ``directory``.

  Args:
    directory: where the checkpoints live (created if missing; its parent must exist).
    max_to_keep: how many of the newest checkpoints to keep (>= 1).
    async_save: save in the background (the next save, :meth:`wait` and
      :meth:`close` wait for it).

  Attributes:
    skipped: after :meth:`restore`, ``(step, reason)`` for every newer
      checkpoint that was unreadable and skipped.
    quarantined: after :meth:`restore`, the folders the skipped checkpoints
      were moved to.

  Example:
    >>> ckpt = Checkpointer("/tmp/run/checkpoints")  # doctest: +SKIP
    >>> ckpt.save(10, {"params": params}, {"step": 10})  # doctest: +SKIP
    >>> state, host, step = ckpt.restore({"params": params})  # doctest: +SKIP
  """

  def __init__(
    self, directory: str | os.PathLike, *, max_to_keep: int = 3, async_save: bool = True
  ):
    directory = os.path.abspath(os.fspath(directory))
    parent = os.path.dirname(directory)
    if not os.path.isdir(parent):
      raise ValueError(f"the checkpoint directory's parent {parent!r} does not exist")
    if os.path.exists(directory) and not os.path.isdir(directory):
      raise ValueError(f"the checkpoint directory {directory!r} exists and is not a directory")
    if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
      raise ValueError(f"max_to_keep must be an integer >= 1, got {max_to_keep!r}")
    self.directory = directory
    # Settles when the last save has finished or failed (a helper thread waits for it).
    self._waiting: concurrent.futures.Future | None = None
    self._reported: BaseException | None = None  # a failed save's error, once handed to the caller
    self.skipped: list[tuple[int, str]] = []
    self.quarantined: list[str] = []
    self._manager = ocp.CheckpointManager(
      directory,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True
      ),
    )

  def all_steps(self) -> list[int]:
    """The steps of the checkpoints on disk, oldest first."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest checkpoint's step, or None when there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def read_host(self, step: int) -> dict[str, Any]:
    """The host item of the checkpoint of ``step`` (its CRC checked), without its arrays.

    Raises:
      ValueError: a damaged record (orbax's own error where it cannot read it).
    """
    record = self._manager.restore(step, args=ocp.args.Composite(host=ocp.args.JsonRestore())).host
    payload = integrity.verified_payload(record, step)
    return dict(record) if payload is None else payload["host"]

  def save(self, step: int, state: Any, host: dict[str, Any]) -> None:
    """Saves ``state`` (arrays) and ``host`` (JSON) as the checkpoint of ``step``.

    The host item also records the state's layout and checksums (see the
    module docstring). Every process must call it (multi-host runs). The
    last save is waited for first (see :meth:`wait`).
    """
    record = integrity.host_record(state, host)
    self.wait()
    self._manager.save(
      step,
      args=ocp.args.Composite(state=ocp.args.StandardSave(state), host=ocp.args.JsonSave(record)),
      force=True,
    )
    # A helper thread waits for the background part, so that failed_save() knows at once.
    self._waiting = concurrent.futures.Future()
    threading.Thread(
      target=_settle,
      args=(self._waiting, self._manager.wait_until_finished),
      name="simigrad-checkpoint-wait",
      daemon=True,
    ).start()

  def failed_save(self) -> BaseException | None:
    """The error of the last save if its background part has failed; never waits.

    Returns:
      The save's error (e.g. an ``OSError`` of a full disk), or None while
      the save is under way, after it finished, or when there was none. The
      error counts as reported: :meth:`close` does not raise it again.

    Example:
      >>> ckpt.save(10, state, {"step": 10})  # doctest: +SKIP
      >>> if (error := ckpt.failed_save()) is not None:  # doctest: +SKIP
      ...   raise error
    """
    waiting = self._waiting
    if waiting is None or not waiting.done():
      return None
    error = waiting.exception()
    return None if error is None else self._report(error)

  def restore(self, like: Any, step: int | None = None) -> tuple[Any, dict[str, Any], int]:
    """Restores the newest readable checkpoint (or ``step``) into the structure of ``like``.

    Args:
      like: a pytree with the structure, shapes, dtypes and shardings to
        restore into (arrays or ``jax.ShapeDtypeStruct``).
      step: a specific step; None tries the newest first and falls back to
        older ones when a checkpoint is unreadable (damaged files, checksum or
        layout record wrong; logged as a warning). Unreadable checkpoints
        newer than the restored one are moved to ``<directory>.unreadable/``.

    Returns:
      ``(state, host, step)``.

    Raises:
      FileNotFoundError: no checkpoint exists.
      CheckpointMismatchError: a readable checkpoint holds a different layout
        than ``like`` (e.g. another model); the message names the differences.
        No older checkpoint is tried and nothing is moved.
      OSError: a read failed :data:`READ_ATTEMPTS` times with an error of the
        file system (e.g. EIO), not of the checkpoint's contents; the message
        names the checkpoint. No older checkpoint is tried and nothing is moved.
      ValueError: no checkpoint could be read; the message names each step
        and its error.
    """
    abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), like
    )
    want_layout = integrity.layout(abstract)
    candidates = [step] if step is not None else list(reversed(self.all_steps()))
    if not candidates:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    self.skipped, self.quarantined = [], []
    errors = []
    for candidate in candidates:
      try:
        state, host = self._read(candidate, abstract, want_layout)
      except _Damaged as damage:
        error = damage.__cause__ or damage
        reason = f"{type(error).__name__}: {_first_line(error)}"
        logger.warning(
          "checkpoint at step %d in %s is unreadable (%s); trying an older one",
          candidate,
          self.directory,
          reason,
        )
        errors.append(f"step {candidate}: {reason}")
        self.skipped.append((candidate, reason))
        continue
      if self.skipped:
        self._quarantine([s for s, _ in self.skipped])
        logger.warning(
          "restored the checkpoint at step %d in %s; skipped unreadable checkpoint(s) "
          "at step(s) %s, moved to %s",
          candidate,
          self.directory,
          [s for s, _ in self.skipped],
          self.quarantined,
        )
      return state, host, candidate
    raise ValueError(f"no readable checkpoint in {self.directory}: " + "; ".join(errors))

  def _read(self, step: int, abstract: Any, want_layout: list) -> tuple[Any, dict[str, Any]]:
    """Restores the checkpoint of ``step``, trying a read that the file system failed again.

    Raises:
      _Damaged: the checkpoint is damaged (its error is the ``__cause__``).
      OSError: the file system failed every one of :data:`READ_ATTEMPTS` reads.
      CheckpointMismatchError: as :meth:`restore`.
    """
    for attempt in range(1, READ_ATTEMPTS + 1):
      try:
        return self._restore_one(step, abstract, want_layout)
      except CheckpointMismatchError:
        raise
      except Exception as error:  # pylint: disable=broad-except  (sorted into damage and failed reads)
        code = _file_system_errno(error)
        if code is None:
          raise _Damaged() from error
        reason = f"{type(error).__name__}: {_first_line(error)}"
        if attempt == READ_ATTEMPTS:
          raise OSError(
            code,
            f"reading the checkpoint at step {step} in {self.directory} failed "
            f"{READ_ATTEMPTS} times with an error of the file system ({reason}); "
            "the checkpoint may be intact, so nothing was skipped or moved: check "
            "the file system and run again",
          ) from error
        wait = READ_RETRY_SECONDS * 2 ** (attempt - 1)
        logger.warning(
          "reading the checkpoint at step %d in %s failed (%s); trying again in %g s",
          step,
          self.directory,
          reason,
          wait,
        )
        time.sleep(wait)
    raise AssertionError("unreachable")

  def _restore_one(self, step: int, abstract: Any, want_layout: list) -> tuple[Any, dict[str, Any]]:
    record = self._manager.restore(step, args=ocp.args.Composite(host=ocp.args.JsonRestore())).host
    payload = integrity.verified_payload(record, step)
    if payload is None:  # an older simigrad_jax's checkpoint: restore it as before, unverified
      logger.warning(
        "checkpoint at step %d in %s has no checksums (written by an older "
        "simigrad_jax): its data cannot be verified",
        step,
        self.directory,
      )
      restored = self._manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
      ).state
      integrity.check_matches(abstract, restored, step)
      return restored, dict(record)
    # Paths are for the message only: a JAX or optax release that names them differently
    # must not make old checkpoints unreadable.
    if [entry[1:] for entry in payload["layout"]] != [entry[1:] for entry in want_layout]:
      differences = integrity.describe_differences(payload["layout"], want_layout)
      raise CheckpointMismatchError(
        f"the checkpoint at step {step} in {self.directory} was written for a different "
        f"model or optimizer: {differences}. "
        "Restore it into the model it was made with, or use a new directory"
      )
    restored = self._manager.restore(
      step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
    ).state
    integrity.check_matches(abstract, restored, step)
    integrity.check_checksums(payload, restored, step)
    return restored, payload["host"]

  def _quarantine(self, steps: list[int]) -> None:
    """Moves the unreadable checkpoints of ``steps`` to ``<directory>.unreadable/`` (process 0)."""
    multi = jax.process_count() > 1
    if multi:  # every process has finished reading before anything moves
      multihost_utils.sync_global_devices("simigrad_jax:quarantine:read")
    root = self.directory + ".unreadable"
    taken = set(os.listdir(root)) if os.path.isdir(root) else set()
    moves = []
    for step in steps:  # <step>.<n>: the same names on every process
      n = 0
      while f"{step}.{n}" in taken:
        n += 1
      taken.add(f"{step}.{n}")
      moves.append((os.path.join(self.directory, str(step)), os.path.join(root, f"{step}.{n}")))
    if multi:
      multihost_utils.sync_global_devices("simigrad_jax:quarantine:named")
    if jax.process_index() == 0:
      for source, destination in moves:
        if os.path.isdir(source):
          os.makedirs(root, mode=0o700, exist_ok=True)  # private, as the checkpoints
          os.replace(source, destination)
    if multi:
      multihost_utils.sync_global_devices("simigrad_jax:quarantine:moved")
    self.quarantined = [destination for _, destination in moves]
    self._manager.reload()

  def wait(self, timeout: float | None = None) -> bool:
    """Waits until a background save has finished; returns whether it has.

    Args:
      timeout: wait at most this many seconds (None: until it has finished).
        The wait goes on in a helper thread, which the next call joins: in a
        multi-host run a save's commit waits for every process, so a lost
        process would block it for orbax's own timeout (20 minutes).

    Raises:
      Exception: the save's error, when its background part failed (once:
        not an error that :meth:`failed_save` returned).
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

  def close(self) -> None:
    """Waits for the last save and releases orbax's resources (raising as :meth:`wait`)."""
    self.wait()
    self._manager.close()

  def _report(self, error: BaseException) -> BaseException:
    """Remembers ``error``, a failed save's, as reported, and returns it.

    orbax raises a failed save's error once in every thread that waits for
    it: this thread's turn is taken here, so that orbax's own waits (before
    the next save, at close) do not raise it again.
    """
    self._reported = error
    try:
      self._manager.wait_until_finished()
    except Exception as again:  # pylint: disable=broad-except
      if again is not error:
        raise
    return error


class _Damaged(Exception):
  """A checkpoint found damaged by :meth:`Checkpointer._read`; its error is the ``__cause__``."""


def _file_system_errno(error: BaseException | None) -> int | None:
  """The errno of a read that the file system failed, or None when ``error`` means damage.

  An ``OSError``, or tensorstore's report of one (``[OS error 5: ...]``), in
  ``error`` or its causes, is a failed read, unless it says that a file is
  missing: a checkpoint without one of its files is damaged.
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


def _first_line(error: BaseException) -> str:
  return (str(error).strip().splitlines() or [""])[0][:400]


def _settle(future: concurrent.futures.Future, fn: Any) -> None:
  """Runs ``fn()`` and settles ``future`` with its result or error."""
  try:
    future.set_result(fn())
  except BaseException as error:  # pylint: disable=broad-except  (handed to the waiting thread)
    future.set_exception(error)
