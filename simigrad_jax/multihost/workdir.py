"""Host: one run per workdir: the workdir checked, made private and locked before anything is read or written in it.

Two runs in one workdir destroy each other's files (one rewrites
``metrics.jsonl`` while the other appends to it; one deletes the other's
unfinished checkpoint), so a run takes an exclusive lock first
(:func:`open_workdir`), and a second run fails at once with a
:class:`WorkdirLockedError` that names the first: its pid, host, start time
and command, read from the lock file.

The lock is ``fcntl.flock`` on ``<workdir>/run.lock``: the kernel releases it
when its process ends, however it ends, so the lock of a dead run never
blocks (the file stays, holding the last holder's details). With several
processes, process 0 holds ``run.lock`` and process ``i`` ``run.lock.process-i``
(every process writes its part of the checkpoints), and the processes
exchange their outcomes, so that all of them fail together when one cannot
take its lock. On a network file system the lock works where the file system
supports locks (NFS does).

Example:
  >>> import tempfile
  >>> folder = tempfile.mkdtemp()
  >>> with open_workdir(folder + "/run") as workdir:
  ...   open_workdir(folder + "/run")  # a second run
  Traceback (most recent call last):
  ...
  simigrad_jax.multihost.workdir.WorkdirLockedError: the workdir '.../run' is in use by another run: pid ...
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import pathlib
import socket
import sys
import threading
import weakref
from typing import Any

import jax

from simigrad_jax import files
from simigrad_jax.errors import SimiGradError
from simigrad_jax.multihost.process_agreement import ProcessAgreement

__all__ = ["LOCK_FILENAME", "WorkdirLock", "WorkdirLockedError", "lock_filename", "open_workdir"]

LOCK_FILENAME = "run.lock"


class WorkdirLockedError(SimiGradError, RuntimeError):
  """Another run holds the workdir's lock; the message names it (pid, host, since when, command)."""


def lock_filename(process_index: int) -> str:
  """``run.lock`` for process 0 (the workdir's lock), ``run.lock.process-<i>`` for process ``i``."""
  return LOCK_FILENAME if process_index == 0 else f"{LOCK_FILENAME}.process-{process_index}"


class WorkdirLock(os.PathLike):
  """A workdir this process holds the lock of, until :meth:`close`; a path (``os.fspath`` gives the workdir).

  Made by :func:`open_workdir`. A :class:`simigrad_jax.Trainer` given one as
  its ``workdir`` uses it as it is (the caller closes it); given a path, the
  Trainer opens its own and closes it in ``close()``.

  Attributes:
    path: the absolute workdir.
    lock_path: the lock file.
  """

  def __init__(self, path: pathlib.Path, lock_path: pathlib.Path, fd: int):
    self.path, self.lock_path = path, lock_path
    self._fd: int | None = fd
    with _held_lock:
      _held.add(self)

  def __fspath__(self) -> str:
    return str(self.path)

  def __repr__(self) -> str:
    return f"WorkdirLock({str(self.path)!r}, {'held' if self.held else 'released'})"

  @property
  def held(self) -> bool:
    """Whether this process still holds the lock."""
    return self._fd is not None

  def close(self) -> None:
    """Releases the lock (safe to call twice)."""
    with _held_lock:
      fd, self._fd = self._fd, None
      _held.discard(self)
    if fd is not None:
      os.close(fd)  # closing the last descriptor of the lock file releases the flock

  def __del__(self):
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except  (at interpreter exit)
      pass

  def __enter__(self) -> WorkdirLock:
    return self

  def __exit__(self, *exc_info: object) -> None:
    self.close()


# The locks this process holds. A child made by fork() (e.g. a data worker) shares their
# descriptors, and with them the flock, which would outlive this process: it closes its copies.
_held: weakref.WeakSet[WorkdirLock] = weakref.WeakSet()
_held_lock = threading.Lock()


def _close_in_child() -> None:
  for lock in list(_held):
    if lock._fd is not None:  # pylint: disable=protected-access
      os.close(lock._fd)  # pylint: disable=protected-access
      lock._fd = None  # pylint: disable=protected-access
  _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def open_workdir(
  workdir: str | os.PathLike,
  *,
  allow_shared: bool = False,
  agreement: ProcessAgreement | None = None,
) -> WorkdirLock:
  """Creates the workdir (``0700``), checks it, and takes this process's lock on it.

  Args:
    workdir: the run's folder; created with any missing parent.
    allow_shared: skip the check that only this user (and root) can change
      the workdir and its parents
      (:func:`simigrad_jax.files.check_private_dir`).
    agreement: with several processes, every process's outcome is exchanged
      through it, so that all of them raise when one cannot take its lock
      (default: one with the default timeout).

  Returns:
    The :class:`WorkdirLock`; close it (or use it in a ``with`` block) to
    release the lock.

  Raises:
    WorkdirLockedError: another run holds the lock (named).
    UnsafePathError: a workdir other users can change, or a symlink where
      the lock file goes.
    WorkdirAccessError: (a PermissionError) the workdir cannot be created,
      or its lock file written, by this user.
  """
  error, lock = None, None
  try:
    path = files.make_private_dir(
      workdir, what="workdir", allow_shared=allow_shared, allow_link=True
    )
    lock = _lock(path, jax.process_index())
  except (WorkdirLockedError, files.UnsafePathError, files.WorkdirAccessError) as e:
    error = e
  outcome = None if error is None else [type(error).__name__, str(error)]
  outcomes = (agreement or ProcessAgreement()).gather("workdir locks", outcome)
  if error is not None:
    raise error
  assert lock is not None  # taken, as nothing failed here
  failed = [(i, o) for i, o in enumerate(outcomes) if o is not None]
  if failed:
    lock.close()
    kinds = {k.__name__: k for k in (files.UnsafePathError, files.WorkdirAccessError)}
    kind = kinds.get(failed[0][1][0], WorkdirLockedError)
    raise kind(
      "; ".join(f"process {i} could not open the workdir: {message}" for i, (_, message) in failed)
    )
  return lock


def _lock(path: pathlib.Path, process_index: int) -> WorkdirLock:
  """Takes the lock file of ``process_index`` in ``path``, or raises naming its holder."""
  lock_path = path / lock_filename(process_index)
  try:
    fd = files.open_nofollow(lock_path, os.O_RDWR | os.O_CREAT, files.PRIVATE_FILE_MODE)
  except PermissionError as error:
    raise files.WorkdirAccessError(
      f"the workdir {str(path)!r} is not writable by this user: cannot create its lock file "
      f"{str(lock_path)!r} ({error.strerror}); fix its permissions (chmod u+rwx) or give the run "
      f"another workdir"
    ) from error
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    os.close(fd)
    raise WorkdirLockedError(
      f"the workdir {str(path)!r} is in use by another run: {_describe_holder(lock_path)}. One "
      f"run per workdir: wait for it to end or stop it, or give this run another workdir. (The "
      f"lock of a process that has ended never blocks: the kernel releases it.)"
    ) from None
  except BaseException:
    os.close(fd)
    raise
  holder = {
    "pid": os.getpid(),
    "host": socket.gethostname(),
    "process_index": process_index,
    "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "command": " ".join([os.path.basename(sys.executable), *sys.argv])[:300],
  }
  os.ftruncate(fd, 0)
  os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
  return WorkdirLock(path, lock_path, fd)


def _describe_holder(lock_path: pathlib.Path) -> str:
  """``pid 12 on host h since 2026-...; command: ...``, from the lock file (what it says)."""
  try:
    fd = files.open_nofollow(lock_path, os.O_RDONLY)
    try:
      holder: Any = json.loads(os.read(fd, 4096))
    finally:
      os.close(fd)
    pid, host = int(holder["pid"]), str(holder["host"])
  except (OSError, ValueError, KeyError, TypeError):
    return f"no run's details in {str(lock_path)!r}: {_actual_holder(lock_path)}"
  text = (
    f"pid {pid} on host {host} (process {holder.get('process_index', 0)} of its run), "
    f"since {holder.get('since', '?')}; command: {holder.get('command', '?')}"
  )
  if host == socket.gethostname() and not _alive(pid):
    text += f". Pid {pid} is no longer running: {_actual_holder(lock_path)}"
  return text


def _actual_holder(lock_path: pathlib.Path) -> str:
  """Who holds the lock file open now (Linux's ``/proc``; the processes this user may see)."""
  holders = _processes_with_open(lock_path)
  if holders:
    named = "; ".join(f"pid {pid} ({_command_of(pid)})" for pid in holders[:3])
    return (
      f"{named} {'has' if len(holders) == 1 else 'have'} {str(lock_path)!r} open now, one of "
      f"them holding the lock (a process the run started, or one of its own); stop it, or give "
      f"this run another workdir"
    )
  return (
    f"a process this user cannot see holds {str(lock_path)!r} (`fuser -v {lock_path}` names "
    f"it); stop it, or give this run another workdir"
  )


def _processes_with_open(path: pathlib.Path) -> list[str]:
  """The pids (other than this one) with a descriptor open on the file ``path``."""
  try:
    target = os.stat(path)
    pids = [name for name in os.listdir("/proc") if name.isdigit()]
  except OSError:
    return []
  found = []
  for pid in pids:
    if int(pid) == os.getpid():
      continue
    try:
      descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # another user's process, or one that has ended
      continue
    for fd in descriptors:
      try:
        info = os.stat(f"/proc/{pid}/fd/{fd}")
      except OSError:
        continue
      if (info.st_dev, info.st_ino) == (target.st_dev, target.st_ino):
        found.append(pid)
        break
  return found


def _command_of(pid: str) -> str:
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200] or "?"
  except OSError:
    return "command unknown"


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True
