"""Host: files and folders that other users cannot change under a run.

A run's files are written by this process alone, in folders no other user
can write to:

* :func:`write_atomic` writes a whole file (``config.json``,
  ``summary.json``, ``metrics.png``, a similarity profile, a rewritten
  ``metrics.jsonl``) to a temporary file in the same folder, syncs it and
  renames it over the old one: a reader sees the old file or the new one,
  never half of one, and a symlink in its place is replaced, never written
  through.
* :func:`open_for_append` opens a file to append to without following a
  symlink, and :func:`read_plain_file` reads one; neither opens a FIFO, a
  device or a socket planted where a run's file should be (such a file could
  block the run, or be another program's).
* :func:`make_private_dir` creates a folder (``0700``) and checks that it and
  its parents belong to this user (or root) and that no other user can write
  to them (:func:`check_private_dir`); otherwise another user could replace
  the run's checkpoints, its metrics, or the compiled programs of JAX's
  persistent cache, which JAX loads and runs.

Example:
  >>> import tempfile
  >>> folder = make_private_dir(tempfile.mkdtemp() + "/run")
  >>> oct(folder.stat().st_mode & 0o777)
  '0o700'
  >>> write_atomic(folder / "summary.json", '{"steps": 3}\\n').read_text()
  '{"steps": 3}\\n'
"""

from __future__ import annotations

import errno
import logging
import os
import pathlib
import stat
import tempfile
from typing import TextIO

from simigrad_jax.errors import SimiGradError

logger = logging.getLogger("simigrad_jax")

__all__ = [
  "UnsafePathError",
  "WorkdirAccessError",
  "check_private_dir",
  "make_private_dir",
  "open_for_append",
  "open_nofollow",
  "read_plain_file",
  "refuse_special",
  "refuse_symlink",
  "user_cache_home",
  "write_atomic",
]

# How to turn the folder checks off, for the messages.
ALLOW_SHARED = (
  "allow_shared_workdir=True (TrainerConfig; --config.allow_shared_workdir=True "
  "for python -m train)"
)


class UnsafePathError(SimiGradError, ValueError):
  """A folder other users can change (their own, or writable by them), or a symlink where a file is written.

  The message names the path, its owner and mode, and what would be valid.
  """


class WorkdirAccessError(SimiGradError, PermissionError, RuntimeError):
  """A run's folder (the workdir, its checkpoints, the cache) that this user may not create or use.

  The message names the folder and the fix.
  """


def user_cache_home() -> str:
  """This user's cache folder: ``$XDG_CACHE_HOME``, or ``~/.cache`` without it.

  A folder of this user's, not a shared one such as ``/tmp`` (where another
  user could make a folder first); ``$XDG_CACHE_HOME`` counts only when
  absolute, as the XDG specification says.
  """
  cache = os.environ.get("XDG_CACHE_HOME", "")
  if not os.path.isabs(cache):
    cache = os.path.join(os.path.expanduser("~"), ".cache")
  return cache


def current_uid() -> int:
  """The user the process acts as (its effective uid): the owner a private folder must have."""
  return os.geteuid()


def _user(uid: int) -> str:
  """``"alice (uid 1000)"``, or ``"uid 1000"`` for a uid without a name."""
  try:
    import pwd  # pylint: disable=import-outside-toplevel

    return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
  except (ImportError, KeyError):
    return f"uid {uid}"


# The mode of every file a run creates, whatever the umask: only this user reads a run's files.
PRIVATE_FILE_MODE = 0o600


def write_atomic(path: str | os.PathLike, data: bytes | str) -> pathlib.Path:
  """Replaces the file ``path`` by ``data`` through a synced temporary file in its folder.

  A reader (or a crash) sees the old content or the new one, never a mix. A
  symlink at ``path`` is replaced by the file (a warning names its target),
  never followed. An existing file keeps its mode; a new one is ``0600``
  whatever the umask (a run's files are this user's alone).

  Args:
    path: the file to write; its folder must exist.
    data: the content (``str`` is written as UTF-8).

  Returns:
    ``path`` as a :class:`pathlib.Path`.

  Example:
    >>> import tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "config.json"
    >>> write_atomic(path, b"{}").read_bytes()
    b'{}'
  """
  path = pathlib.Path(path)
  if isinstance(data, str):
    data = data.encode()
  try:
    old = os.lstat(path)
  except FileNotFoundError:
    old = None
  if old is not None and stat.S_ISLNK(old.st_mode):
    logger.warning(
      "%s is a symlink to %s; replacing the link by the file, not writing through it",
      path,
      os.readlink(path),
    )
  mode = (
    stat.S_IMODE(old.st_mode)
    if old is not None and stat.S_ISREG(old.st_mode)
    else PRIVATE_FILE_MODE
  )
  # mkstemp creates the file exclusively (O_EXCL), so it never opens a planted one.
  fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fchmod(f.fileno(), mode)
      os.fsync(f.fileno())
    os.replace(tmp, path)  # renames over the entry: a symlink there is replaced, not followed
  except BaseException:
    if os.path.lexists(tmp):
      os.unlink(tmp)
    raise
  _sync_folder(path.parent)
  return path


def _sync_folder(folder: pathlib.Path) -> None:
  """Makes a rename in ``folder`` durable where the platform allows it."""
  try:
    dir_fd = os.open(folder, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(dir_fd)
  except OSError:
    pass
  finally:
    os.close(dir_fd)


def open_for_append(path: str | os.PathLike) -> TextIO:
  """Opens the file ``path`` (created ``0600`` if missing) to append UTF-8 text to, refusing a symlink.

  Raises:
    UnsafePathError: ``path`` is a symlink (the message names its target).
  """
  return os.fdopen(
    open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, PRIVATE_FILE_MODE),
    "a",
    encoding="utf-8",
  )


def open_nofollow(path: str | os.PathLike, flags: int, mode: int = 0o666) -> int:
  """``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC, mode)``: a file descriptor, never through a
  symlink, and only of a plain file.

  The file is opened without blocking, so that a FIFO or a device where a
  run's file should be is refused at once instead of waiting for a writer.

  Raises:
    UnsafePathError: ``path`` is a symlink (the message names its target),
      or not a plain file (a FIFO, a device, a socket, a folder).
  """
  path = pathlib.Path(path)
  try:
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
  except OSError as error:
    if error.errno == errno.ELOOP or path.is_symlink():
      raise refuse_symlink(path) from error
    if error.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO without a reader, a folder
      raise refuse_special(path) from error
    raise
  try:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
      raise refuse_special(path)
    os.set_blocking(fd, True)
  except BaseException:
    os.close(fd)
    raise
  return fd


def read_plain_file(path: str | os.PathLike) -> bytes:
  """The bytes of the plain file ``path``, never read through a symlink nor from a FIFO or device.

  Raises:
    FileNotFoundError: ``path`` does not exist.
    UnsafePathError: ``path`` is a symlink or not a plain file.
  """
  with open(open_nofollow(path, os.O_RDONLY), "rb") as f:
    return f.read()


def refuse_special(path: pathlib.Path) -> UnsafePathError:
  """The error for something other than a plain file where a run's file is kept (to raise)."""
  try:
    kind = _KINDS.get(stat.S_IFMT(os.lstat(path).st_mode), "not a plain file")
  except OSError:
    kind = "not a plain file"
  remove = f"rm -r {path}" if kind == _KINDS.get(stat.S_IFDIR) else f"rm {path}"
  return UnsafePathError(
    f"{path} is {kind}, where the run keeps a plain file; a run never reads or writes its "
    f"files through one (it could block the run, or be another program's): remove it "
    f"({remove}), or use another workdir"
  )


# What a file that is not a plain one is, for the messages.
_KINDS = {
  stat.S_IFIFO: "a FIFO (named pipe)",
  stat.S_IFCHR: "a character device",
  stat.S_IFBLK: "a block device",
  stat.S_IFSOCK: "a socket",
  stat.S_IFDIR: "a folder",
}


def refuse_symlink(path: pathlib.Path, *, what: str | None = None) -> UnsafePathError:
  """The error for a symlink found where a run's file or folder is kept (to raise).

  Args:
    path: the link.
    what: what the folder is (``"checkpoint folder"``, ...), or None for a file.
  """
  named = f"the {what} {path}" if what else str(path)
  fix = (
    f"remove the link (rm {path}) and, to keep what it points to, move that folder there "
    f"(mv TARGET {path}), or use another workdir"
    if what
    else "remove the link, or use another workdir"
  )
  return UnsafePathError(
    f"{named} is a symlink to {os.readlink(path)!r}; a run never writes or reads its files "
    f"through a symlink (another user may have planted it): {fix}"
  )


def check_private_dir(
  path: str | os.PathLike, *, what: str = "workdir", named: str | os.PathLike | None = None
) -> None:
  """Raises :class:`UnsafePathError` unless only this user (and root) can change the folder ``path``.

  The folder must belong to this user and be writable by no group or other
  user. Each of its parents (of the path as given and of the path with
  symlinks resolved) must belong to this user or to root, and be writable by
  no other user unless it has the sticky bit (as ``/tmp`` has: then nobody
  can rename or remove what another user made in it); otherwise their owner
  could swap the folder for one of theirs.

  Args:
    path: an existing folder (a symlink to one is checked at its target).
    what: what the folder is, for the message (``"workdir"``, ...).
    named: the folder that is wanted, when ``path`` is the existing folder it
      is to be created in: then ``path`` is checked as a parent (its owner,
      and no other user may write to it without the sticky bit).

  Raises:
    UnsafePathError: the message names the folder, its owner and mode, and
      how to turn the check off.
  """
  path = pathlib.Path(path).absolute()
  uid = current_uid()
  risk = (
    f"another user could change the run's files there (its checkpoints, or the compiled "
    f"programs JAX loads and runs). Use a folder of your own (mode 0700 or 0755), or set "
    f"{ALLOW_SHARED} if you trust every user who can write there"
  )
  real = pathlib.Path(os.path.realpath(path))
  if named is None:
    wanted = path
    info = os.stat(path)
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != uid:
      raise UnsafePathError(
        f"the {what} {str(path)!r} belongs to {_user(info.st_uid)}, not to this "
        f"user, {_user(uid)}: {risk}"
      )
    if mode & 0o022:
      raise UnsafePathError(
        f"the {what} {str(path)!r} has mode {mode:#o}: it is {_writable_by(mode)}-writable, "
        f"so {risk}"
      )
    parents = dict.fromkeys([*path.parents, *real.parents])
  else:
    wanted = pathlib.Path(named).absolute()
    parents = dict.fromkeys([path, *path.parents, real, *real.parents])
  for parent in parents:
    info = os.stat(parent)
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid not in (uid, 0):
      raise UnsafePathError(
        f"the {what} {str(wanted)!r} is inside {str(parent)!r}, which belongs to "
        f"{_user(info.st_uid)}, who could replace the {what} by a folder of theirs: {risk}"
      )
    if mode & 0o022 and not mode & stat.S_ISVTX:
      raise UnsafePathError(
        f"the {what} {str(wanted)!r} is inside {str(parent)!r}, which has mode {mode:#o}: it is "
        f"{_writable_by(mode)}-writable without the sticky bit, so any user who can write "
        f"there could replace the {what} by a folder of theirs: {risk}"
      )


def _writable_by(mode: int) -> str:
  return " and ".join(name for bit, name in ((0o020, "group"), (0o002, "world")) if mode & bit)


def make_private_dir(
  path: str | os.PathLike,
  *,
  what: str = "workdir",
  allow_shared: bool = False,
  tighten: bool = False,
  allow_link: bool = False,
) -> pathlib.Path:
  """Creates the folder ``path`` (mode ``0700``, as any missing parent) and checks it.

  The parents that exist are checked first, so that nothing is created in a
  folder that is refused (e.g. another user's world-writable one). A symlink
  at ``path`` is refused unless ``allow_link``: a run never writes its files
  through a link (a planted ``checkpoints`` link would send them elsewhere).
  Only the folders this call creates are given a mode; an existing folder
  keeps its own (a warning names one that other users can read).

  Args:
    path: the folder.
    what: what the folder is, for the messages.
    allow_shared: skip :func:`check_private_dir`: for a shared file system
      whose users are trusted (a symlink is refused all the same).
    tighten: warn when an existing folder can be read by other users (for the
      library's own folders: the checkpoints and the compilation cache).
    allow_link: accept a symlink at ``path`` (checked at its target): for the
      workdir the user names, never for the folders inside it.

  Returns:
    The absolute folder.

  Raises:
    UnsafePathError: see :func:`check_private_dir`, or ``path`` is a symlink.
    WorkdirAccessError: (a PermissionError) the folder cannot be created or
      read for lack of permission; the message names it.
    ValueError: ``path`` exists and is not a folder.

  Example:
    >>> import tempfile
    >>> oct(make_private_dir(tempfile.mkdtemp() + "/a/b").stat().st_mode & 0o777)
    '0o700'
  """
  path = pathlib.Path(path).absolute()
  if not allow_link and path.is_symlink():
    raise refuse_symlink(path, what=what)
  missing = []
  for folder in (path, *path.parents):
    if os.path.lexists(folder):
      break
    missing.append(folder)
  try:
    if missing and not allow_shared:  # refused before anything is created in it
      check_private_dir(missing[-1].parent, what=what, named=path)
    for folder in reversed(missing):
      try:
        folder.mkdir(mode=0o700)
      except FileExistsError:  # made by another process meanwhile: checked below
        pass
      else:
        folder.chmod(0o700)  # mkdir's mode is cut by the umask, never widened: exactly 0700
    if not allow_link and path.is_symlink():  # planted between the check and the mkdir
      raise refuse_symlink(path, what=what)
    if not path.is_dir():
      raise ValueError(f"the {what} {str(path)!r} exists and is not a directory")
    if allow_shared:
      return path
    check_private_dir(path, what=what)
  except PermissionError as error:
    raise WorkdirAccessError(
      f"the {what} {str(path)!r} cannot be {'created' if missing else 'used'}: permission denied "
      f"on {error.filename or str(path)!r}; give a {what} in a folder you can write to, or fix "
      f"its permissions (e.g. chmod u+rwx)"
    ) from error
  mode = stat.S_IMODE(path.stat().st_mode)
  if tighten and mode & 0o077 and path not in missing:
    logger.warning(
      "the %s %s has mode %#o: other users can read the run's files there; it was not made by "
      "this run, so it is left as it is (chmod 700 %s to make it private)",
      what,
      path,
      mode,
      path,
    )
  return path
