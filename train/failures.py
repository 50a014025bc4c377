"""The one line an expected failure of ``python -m train`` ends with: the cause, the file, the fix.

A refused start (a bad config, a workdir in use, unsafe or not writable, a
changed setting, a data folder that is not there, no readable checkpoint)
and a run stopped by its file system (a full disk, a file-size limit, a
folder made read-only) print one line on stderr and exit non-zero; the
traceback is printed too only with ``--verbose`` or ``SIMIGRAD_VERBOSE=1``.
When this process held the workdir, the traceback is also appended to
``<workdir>/failure.log`` (:func:`log_failure`). A failure of the disk names
the last checkpoint that was saved completely, so the line says which steps
a resume trains again.

Example:
  >>> error = OSError(28, "No space left on device", "/w/metrics.jsonl")
  >>> print(one_line(error, None))  # doctest: +ELLIPSIS
  simigrad: the disk is full: ... writing '/w/metrics.jsonl'...
"""

from __future__ import annotations

import datetime
import errno
import os
import pathlib
import re
import traceback

VERBOSE_ENV = "SIMIGRAD_VERBOSE"
FAILURE_LOG = "failure.log"

# The errors of a file system that stop a run: what they mean and what to do.
DISK_ERRORS = {
  errno.ENOSPC: ("the disk is full", "free space on that file system"),
  errno.EDQUOT: ("the disk quota is used up", "free space or raise the quota"),
  errno.EFBIG: (
    "a file reached the file-size limit (ulimit -f)",
    "raise the limit (ulimit -f unlimited)",
  ),
  errno.EROFS: ("the file system is read-only", "remount it read-write or give another --workdir"),
  errno.EACCES: ("permission denied", "give yourself write access (chmod u+rwX)"),
  errno.EPERM: ("operation not permitted", "give yourself write access (chmod u+rwX)"),
  errno.ENOENT: (
    "the checkpoints folder was removed while the run trained",
    "restore the workdir (or give another --workdir)",
  ),
  errno.ENOTDIR: (
    "the checkpoints folder was replaced by a file or a link while the run trained",
    "put the folder back in its place",
  ),
}


def verbose_requested(flag: bool = False) -> bool:
  """Whether tracebacks are wanted: ``--verbose``, or ``SIMIGRAD_VERBOSE`` set to other than 0."""
  return flag or os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def _chain(error: BaseException) -> list[BaseException]:
  """``error`` and the errors it was raised from or during, outermost first."""
  from simigrad_jax.checkpoint import emergency  # pylint: disable=import-outside-toplevel

  return emergency.chain(error)


def disk_errno(error: BaseException) -> int | None:
  """The errno of a file system's failure somewhere in ``error``'s chain, or None
  (:func:`simigrad_jax.checkpoint.emergency.disk_errno`: imported when called, as JAX is)."""
  from simigrad_jax.checkpoint import emergency  # pylint: disable=import-outside-toplevel

  return emergency.disk_errno(error)


def _file_of(error: BaseException, workdir: pathlib.Path | None) -> str | None:
  """The file a failure names: an OSError's ``filename``, or a path of the workdir in its text."""
  for link in _chain(error):
    if isinstance(link, OSError) and link.filename:
      return os.fsdecode(link.filename)
  if workdir is not None:
    found = re.search(
      re.escape(str(workdir)) + r"[^\s'\",:;)]*", "\n".join(map(str, _chain(error)))
    )
    if found:
      return found.group(0)
  return None


def last_checkpoint(workdir: pathlib.Path | None) -> int | None:
  """The step of the newest checkpoint saved completely in ``<workdir>/checkpoints``, or None
  (a link, a file or a folder the run did not write there is not one)."""
  if workdir is None:
    return None
  from simigrad_jax.checkpoint import checkpointer  # pylint: disable=import-outside-toplevel

  folder = workdir / "checkpoints"
  try:
    steps = [
      int(p.name)
      for p in folder.iterdir()
      if p.name.isdigit() and checkpointer.is_checkpoint_folder(p)
    ]
  except OSError:
    return None
  return max(steps, default=None)


def clean(text: str) -> str:
  """One line of ``text``: bound-method reprs of compiled libraries dropped, spaces squeezed."""
  text = re.sub(r"<bound method [^>]*>", "", text)
  return re.sub(r"\s+", " ", text).strip()


def one_line(error: BaseException, workdir: pathlib.Path | None, *, step: int | None = None) -> str:
  """The line that ends a failed ``python -m train``: the cause, the file and the fix.

  Args:
    error: what stopped the run.
    workdir: the run's workdir (for the last checkpoint and the log), or None.
    step: the last step the run finished, when known.

  Returns:
    One line (no newline), starting with ``"simigrad: "``.
  """
  number = disk_errno(error)
  if number is not None:
    cause, fix = DISK_ERRORS[number]
    where = _file_of(error, workdir)
    saved = last_checkpoint(workdir)
    step = _emergency_attribute(error, "emergency_step", step)
    rescued = _emergency_attribute(error, "emergency_checkpoint", None)
    if saved is None:
      kept = "no checkpoint was saved before"
      lost = f"the steps trained (1-{step}) are lost" if step else "the steps trained are lost"
    else:
      kept = f"the last good checkpoint is step {saved} in {workdir / 'checkpoints' / str(saved)}"
      again = f" (steps {saved + 1}-{step})" if step is not None and step > saved else ""
      lost = f"a resume trains the steps after it again{again}"
    if rescued is not None:
      kept += f"; step {step} was saved in an emergency checkpoint, {rescued}, so nothing is lost"
      lost = _resume_from(pathlib.Path(rescued), workdir)
    elif _emergency_attribute(error, "emergency_step", None) is not None:
      why = _emergency_attribute(error, "emergency_why", "")
      lost = f"no emergency checkpoint of step {step} ({clean(why)[:200]}): {lost}"
    kept = f"{kept}; {lost}"
    return clean(
      f"simigrad: {cause}: {type(error).__name__} writing {where!r}"
      f"{'' if where else ' (file unknown)'}; {kept}. Fix: {fix}, then run the same command "
      f"to resume"
    )
  return clean(f"simigrad: {_message(error)}")


def _emergency_attribute(error: BaseException, name: str, default):
  """An attribute that :func:`simigrad_jax.checkpoint.emergency.save_after` set in the chain."""
  for link in _chain(error):
    if hasattr(link, name):
      return getattr(link, name)
  return default


def _resume_from(folder: pathlib.Path, workdir: pathlib.Path | None) -> str:
  """How a resume takes the emergency checkpoint in ``folder``."""
  emergency = None if workdir is None else workdir / "emergency"
  if emergency is not None and folder.parent == emergency:
    return "the same command resumes from it"
  into = emergency or "<workdir>/emergency"
  return f"to resume from it: mkdir -p {into} && mv {folder} {into}/, then the same command"


def _message(error: BaseException) -> str:
  """The error's own message, with what the kind of error needs said around it."""
  text = str(error) or type(error).__name__
  if isinstance(error, FileNotFoundError) and error.filename:
    return f"{os.fsdecode(error.filename)!r} does not exist ({error.strerror})"
  if "no readable checkpoint" in text:
    return text
  if isinstance(error, PermissionError) and error.filename:
    return (
      f"permission denied on {os.fsdecode(error.filename)!r}; give yourself access "
      f"(chmod u+rwX) or another --workdir"
    )
  return text


def is_expected(error: BaseException) -> bool:
  """Whether ``error`` is a failure the user can fix (one line), not a bug (a traceback)."""
  from simigrad_jax.errors import SimiGradError  # pylint: disable=import-outside-toplevel

  return isinstance(error, (SimiGradError, OSError, ValueError)) or disk_errno(error) is not None


def log_failure(workdir: pathlib.Path, error: BaseException) -> pathlib.Path | None:
  """Appends ``error``'s traceback to ``<workdir>/failure.log`` (0600); the file, or None if it cannot."""
  from simigrad_jax import files  # pylint: disable=import-outside-toplevel

  path = workdir / FAILURE_LOG
  stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
  text = "".join(traceback.format_exception(error))
  try:
    with files.open_for_append(path) as f:
      f.write(f"--- {stamp}\n{text}")
  except (OSError, ValueError):  # a full disk cannot take the log either
    return None
  return path


class TracebackFilter:
  """A text stream that passes everything to ``stream`` but Python's tracebacks.

  Installed as ``sys.stderr`` without ``--verbose``: a failure in a library's
  background thread (a save, a callback after its event loop closed) prints
  tracebacks there, and the one line that ends the run must not be buried
  under them. The run's own failure goes to ``failure.log`` whole.

  Example:
    >>> import io
    >>> out = io.StringIO()
    >>> quiet = TracebackFilter(out)
    >>> _ = quiet.write('kept\\nTraceback (most recent call last):\\n  File "x"\\nOSError: y\\nkept too\\n')
    >>> out.getvalue()
    'kept\\nkept too\\n'
  """

  STARTS = ("Traceback (most recent call last)", "Exception ignored in", "Exception in thread")
  CHAINS = ("During handling of the above exception", "The above exception was the direct cause")

  def __init__(self, stream):
    self._stream = stream
    self._skipping = False
    self._pending = ""
    self.skipped = 0

  def write(self, text: str) -> int:
    self._pending += text
    out = []
    while "\n" in self._pending:
      line, self._pending = self._pending.split("\n", 1)
      if self._skip(line):
        self.skipped += 1
      else:
        out.append(line + "\n")
    if self._pending and not self._skipping:
      if not any(start.startswith(self._pending[: len(start)]) for start in self.STARTS):
        out.append(self._pending)  # a progress bar's partial line: shown now
        self._pending = ""
    if out:
      self._stream.write("".join(out))
    return len(text)

  def _skip(self, line: str) -> bool:
    if self._skipping:
      if not line or line[0] in " \t" or line.startswith(self.CHAINS):
        return True
      self._skipping = False  # the exception's own line ends the traceback
      return True
    if line.startswith(self.STARTS):
      self._skipping = True
      return True
    return False

  def flush(self) -> None:
    self._stream.flush()

  def __getattr__(self, name: str):
    return getattr(self._stream, name)
