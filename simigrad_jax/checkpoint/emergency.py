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
import logging
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from simigrad_jax import files
from simigrad_jax.checkpoint.checkpointer import Checkpointer
from simigrad_jax.checkpoint.checkpointer import CheckpointFolderGoneError
from simigrad_jax.checkpoint.checkpointer import is_checkpoint_folder

logger = logging.getLogger("simigrad_jax")

FOLDER = "emergency"
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
        made = pathlib.Path(tempfile.mkdtemp(prefix="simigrad-emergency-"))
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
