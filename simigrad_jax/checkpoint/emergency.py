"""Host: an emergency checkpoint when a save fails on its disk, and its adoption on resume.

When the file system stops a checkpoint save (a full disk, a quota, a
read-only or unwritable ``checkpoints/``), the steps since the last
completed save would be lost. A one-process run saves its state then, at
once and synchronously, to another folder: first ``<workdir>/emergency/``
(enough when only ``checkpoints/`` is read-only), then a new private folder
in ``$TMPDIR`` (another file system, often, when the workdir's is full).
:func:`save_elsewhere` returns where it went; the failure keeps it in its
``emergency_checkpoint`` attribute for the message that ends the run.

A resume first adopts the newest checkpoint of ``<workdir>/emergency/``
when it is newer than the newest of ``checkpoints/`` (:func:`adopt`): it is
moved there, so the same command resumes from it. One in ``$TMPDIR`` is
adopted once the user moves it into ``<workdir>/emergency/``.

A folder in ``$TMPDIR`` is outside the workdir, so the run records it
(:data:`RECORD`, ``<workdir>/emergency/elsewhere.json``, written atomically
where the disk takes it; the message that ends the run names the folder).
Once the run holds a checkpoint of that step or a later one (a resume
restored it, the emergency one adopted or not, or a later save finished),
:func:`remove_superseded` removes the folder and its entry in the record:
only the folder it recorded, and only while it is still what the run made
(a real folder of this user's, not a link, named ``simigrad-emergency-*``,
holding ``checkpoints/`` with at most that step's checkpoint, or
nothing); anything else is left in place, with a warning naming it.

Example::

  try:
    loop.run(...)
  except Exception as error:  # the run's last whole step, if a disk stopped a save
    emergency.save_after(error, workdir / "checkpoints", step, state, host)
    raise
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pathlib
import shutil
import stat
import tempfile
from collections.abc import Callable
from typing import Any

from simigrad_jax import files
from simigrad_jax.checkpoint.checkpointer import Checkpointer
from simigrad_jax.checkpoint.checkpointer import CheckpointFolderGoneError
from simigrad_jax.checkpoint.checkpointer import is_checkpoint_folder

logger = logging.getLogger("simigrad_jax")

FOLDER = "emergency"
# In FOLDER: the folders of $TMPDIR that hold this run's emergency checkpoints, with their steps.
RECORD = "elsewhere.json"
# The name of such a folder begins so (tempfile.mkdtemp's prefix).
ELSEWHERE_PREFIX = "simigrad-emergency-"
# The errors of a file system that stop a save: a new folder elsewhere may still take it.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)
# Texts by which C++ libraries (TensorStore, XLA) report the same errors without an errno.
DISK_TEXTS = {
  "No space left on device": errno.ENOSPC,
  "Disk quota exceeded": errno.EDQUOT,
  "File too large": errno.EFBIG,
  "Read-only file system": errno.EROFS,
  "Permission denied": errno.EACCES,
}


def chain(error: BaseException) -> list[BaseException]:
  """``error`` and the errors it was raised from or during, outermost first."""
  seen: list[BaseException] = []
  current: BaseException | None = error
  while current is not None and current not in seen:
    seen.append(current)
    current = current.__cause__ or current.__context__
  return seen


def disk_errno(error: BaseException) -> int | None:
  """The errno of a file system's failure somewhere in ``error``'s chain, or None.

  A :class:`~simigrad_jax.checkpoint.checkpointer.CheckpointFolderGoneError`
  counts (its ``ENOENT`` or ``ENOTDIR``): the checkpoints folder is gone.

  Example:
    >>> disk_errno(RuntimeError("the save failed: No space left on device"))
    28
  """
  for link in chain(error):
    if isinstance(link, OSError) and link.errno in DISK_ERRNOS:
      return link.errno
    if isinstance(link, CheckpointFolderGoneError):  # (ENOENT, ENOTDIR: the folder's, surely)
      return link.errno
    for text, number in DISK_TEXTS.items():
      if text in str(link):
        return number
  return None


def emergency_folder(checkpoints_dir: str | os.PathLike) -> pathlib.Path:
  """``<workdir>/emergency`` for the checkpoints in ``<workdir>/checkpoints``."""
  return pathlib.Path(checkpoints_dir).absolute().parent / FOLDER


def save_elsewhere(
  checkpoints_dir: str | os.PathLike, step: int, save: Callable[[Checkpointer], None]
) -> tuple[pathlib.Path | None, str]:
  """Saves the checkpoint of ``step`` outside ``checkpoints_dir``, where a disk still takes it.

  Tries ``<workdir>/emergency/``, then a new private folder in ``$TMPDIR``;
  each save is synchronous and complete when this returns.

  Args:
    checkpoints_dir: the run's checkpoint folder, whose save failed.
    step: the step saved.
    save: saves the checkpoint of ``step`` with the :class:`Checkpointer` given.

  Returns:
    ``(folder, why)``: the checkpoint's folder and an empty string, or None
    and why every place failed.
  """
  whys = []
  for place in (emergency_folder(checkpoints_dir), None):
    made = None  # the folder this attempt made in $TMPDIR, removed whole if the save fails
    try:
      if place is None:
        made = pathlib.Path(tempfile.mkdtemp(prefix=ELSEWHERE_PREFIX))
        place = made / "checkpoints"
      else:
        files.make_private_dir(place, what="emergency checkpoint folder")
      checkpointer = Checkpointer(place, max_to_keep=1, async_save=False)
      try:
        save(checkpointer)
      finally:
        checkpointer.close()
    except Exception as error:  # pylint: disable=broad-except  (the next place may take it)
      whys.append(f"{place}: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
      _remove_partial(made, place, step)
      continue
    folder = place / str(step)
    logger.warning("saved an emergency checkpoint of step %d in %s", step, folder)
    if made is not None:
      _record_elsewhere(checkpoints_dir, made, step)
    return folder, ""
  return None, "; ".join(whys)


def _remove_partial(made: pathlib.Path | None, place: pathlib.Path | None, step: int) -> None:
  """Removes what a failed emergency save of ``step`` left: no partial copy of the model stays.

  ``made``: the folder the attempt made in ``$TMPDIR`` (removed whole);
  else only the step's own folder and orbax's temporary ones for it in
  ``place`` (``<workdir>/emergency/``), never a link.
  """
  if made is not None:
    shutil.rmtree(made, ignore_errors=True)
    return
  if place is None or place.is_symlink() or not place.is_dir():
    return
  for entry in place.iterdir():
    if entry.name == str(step) or entry.name.startswith(f"{step}.orbax-checkpoint-tmp"):
      if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)


def record_path(checkpoints_dir: str | os.PathLike) -> pathlib.Path:
  """``<workdir>/emergency/elsewhere.json``: where the run records its folders in ``$TMPDIR``."""
  return emergency_folder(checkpoints_dir) / RECORD


def _read_record(path: pathlib.Path) -> list[dict[str, Any]]:
  """The entries ``{"folder", "step"}`` of the record at ``path`` ([] when there is none).

  Raises:
    OSError: it cannot be read.
    ValueError: it is not a record this module wrote (or a link, a special file).
  """
  try:
    data = json.loads(files.read_plain_file(path))
  except FileNotFoundError:
    return []
  saves = data.get("saves") if isinstance(data, dict) else None
  if not isinstance(saves, list) or not all(
    isinstance(e, dict) and isinstance(e.get("folder"), str) and type(e.get("step")) is int
    for e in saves
  ):
    raise ValueError(f"{path} is not a record of emergency checkpoints")
  return saves


def _write_record(path: pathlib.Path, saves: list[dict[str, Any]]) -> None:
  """Writes ``saves`` to the record at ``path`` atomically, or removes it when there are none."""
  if saves:
    files.write_atomic(path, json.dumps({"saves": saves}, indent=1) + "\n")
    return
  with contextlib.suppress(FileNotFoundError):
    os.unlink(path)
  with contextlib.suppress(OSError):  # (what else is there, the run did not make: it stays)
    path.parent.rmdir()


def _record_elsewhere(checkpoints_dir: str | os.PathLike, made: pathlib.Path, step: int) -> None:
  """Adds the folder ``made`` in ``$TMPDIR`` (the checkpoint of ``step``) to the run's record."""
  path = record_path(checkpoints_dir)
  try:
    files.make_private_dir(path.parent, what="emergency checkpoint folder")
    saves = [e for e in _read_record(path) if e["folder"] != str(made)]
    _write_record(path, [*saves, {"folder": str(made), "step": step}])
  except (OSError, ValueError) as error:  # (a full disk may not take even this)
    logger.warning(
      "could not record the emergency checkpoint's folder %s in %s (%s): remove the folder "
      "yourself once a checkpoint of step %d or later is saved",
      made,
      path,
      error,
      step,
    )


def _why_not_the_runs_own(folder: pathlib.Path, step: int) -> str | None:
  """None when ``folder`` is still the private folder a run made for the checkpoint of ``step``
  (:func:`save_elsewhere`), else what it is instead."""
  if not folder.is_absolute() or not folder.name.startswith(ELSEWHERE_PREFIX):
    return f"it is not named {ELSEWHERE_PREFIX}* in an absolute path"
  try:
    mode = os.lstat(folder)
  except FileNotFoundError:
    return "it is gone"
  if not stat.S_ISDIR(mode.st_mode):
    return "it is no longer a folder (a link or a file)"
  if mode.st_uid != files.current_uid():
    return f"it belongs to uid {mode.st_uid}"
  inside = folder / "checkpoints"
  if not os.listdir(folder):  # (its checkpoints/ moved away whole)
    return None
  if os.listdir(folder) != ["checkpoints"] or not stat.S_ISDIR(os.lstat(inside).st_mode):
    return "it holds more than checkpoints/"
  entries = os.listdir(inside)
  if entries and (entries != [str(step)] or not is_checkpoint_folder(inside / str(step))):
    return f"its checkpoints/ holds more than the checkpoint of step {step}"
  return None


_warned: set[str] = set()  # the damaged records named in a warning once


def remove_superseded(checkpoints_dir: str | os.PathLike, step: int | None) -> list[pathlib.Path]:
  """Removes the run's emergency checkpoints in ``$TMPDIR`` of ``step`` or earlier.

  Call it once the run holds a whole checkpoint of ``step`` (one restored,
  or a save that has finished): the emergency ones up to it are no longer
  needed. Each folder in the run's record (:func:`record_path`) is removed
  whole only while it is what the run made there: a real folder of this
  user's, named ``simigrad-emergency-*``, holding ``checkpoints/`` with
  nothing but that step's checkpoint (or nothing, once it was moved away to
  be adopted). Anything else is left in place, named in a warning, and its
  entry dropped; the record goes once it is empty.

  Args:
    checkpoints_dir: the run's checkpoint folder.
    step: the step of the newest checkpoint the run holds, or None.

  Returns:
    The folders removed.

  Example:
    >>> remove_superseded("/tmp/nowhere/checkpoints", 3)  # no record: nothing to do
    []
  """
  path = record_path(checkpoints_dir)
  if step is None or not os.path.lexists(path):
    return []
  try:
    saves = _read_record(path)
  except (OSError, ValueError) as error:
    if str(path) not in _warned:
      _warned.add(str(path))
      logger.warning("left the emergency checkpoints recorded in %s alone: %s", path, error)
    return []
  kept, removed = [], []
  for entry in saves:
    folder = pathlib.Path(entry["folder"])
    if entry["step"] > step:
      kept.append(entry)
      continue
    try:
      why = _why_not_the_runs_own(folder, entry["step"])
      if why is None:
        shutil.rmtree(folder)
        removed.append(folder)
        logger.info(
          "removed the emergency checkpoint of step %d in %s: the run holds step %d",
          entry["step"],
          folder,
          step,
        )
        continue
    except OSError as error:
      why = f"{type(error).__name__}: {error}"
    if why != "it is gone":
      logger.warning(
        "left %s in place, no longer needed for the emergency checkpoint of step %d: %s",
        folder,
        entry["step"],
        why,
      )
  try:
    _write_record(path, kept)
  except OSError as error:
    logger.warning("could not update %s: %s", path, error)
  return removed


def adopt(checkpoints_dir: str | os.PathLike, latest: int | None) -> int | None:
  """Moves the newest emergency checkpoint into ``checkpoints_dir`` if it is newer than ``latest``.

  Args:
    checkpoints_dir: the run's checkpoint folder.
    latest: the step of its newest checkpoint, or None.

  Returns:
    The step adopted, or None (no emergency checkpoint newer than ``latest``;
    older ones are deleted).

  Raises:
    OSError: the move failed (e.g. ``checkpoints/`` is still read-only).
  """
  folder = emergency_folder(checkpoints_dir)
  if folder.is_symlink() or not folder.is_dir():
    return None
  steps = sorted(
    int(p.name) for p in folder.iterdir() if p.name.isdigit() and is_checkpoint_folder(p)
  )
  if not steps:
    return None
  newest = steps[-1]
  adopted = None
  if latest is None or newest > latest:
    os.rename(folder / str(newest), pathlib.Path(checkpoints_dir) / str(newest))
    logger.warning(
      "resuming from the emergency checkpoint of step %d (moved from %s into %s)",
      newest,
      folder,
      checkpoints_dir,
    )
    adopted = newest
  for old in steps[:-1] if adopted is not None else steps:  # older than a checkpoint kept
    shutil.rmtree(folder / str(old), ignore_errors=True)
    logger.warning(
      "removed the emergency checkpoint of step %d in %s: the run holds a newer checkpoint",
      old,
      folder,
    )
  with contextlib.suppress(OSError):  # (what else is there, the run did not make: it stays)
    folder.rmdir()
  return adopted


def save_after(
  error: BaseException,
  checkpoints_dir: str | os.PathLike,
  step: int,
  state: Any,
  host: dict[str, Any],
) -> None:
  """After ``error``, if a disk's (:func:`disk_errno`): ``state`` and ``host`` saved elsewhere.

  :func:`save_elsewhere`, then records on ``error`` where the checkpoint of
  ``step`` went: ``error.emergency_checkpoint`` (its folder, or None when no
  place took it, or ``state`` is None: not the state of a whole step),
  ``error.emergency_step`` and ``error.emergency_why`` (why not), and a note.
  """
  if disk_errno(error) is None:
    return
  if state is None:
    folder, why = None, f"step {step + 1} was under way"
  else:
    save = lambda other: other.save(step, state, host)
    folder, why = save_elsewhere(checkpoints_dir, step, save)
  try:
    error.emergency_checkpoint = folder  # type: ignore[attr-defined]
    error.emergency_step = step  # type: ignore[attr-defined]
    error.emergency_why = why  # type: ignore[attr-defined]
  except AttributeError:  # (an exception type with slots)
    pass
  if folder is None:
    error.add_note(f"no emergency checkpoint of step {step}: {why}")
  else:
    error.add_note(f"step {step} was saved in an emergency checkpoint: {folder}")
