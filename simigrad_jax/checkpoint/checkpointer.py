"""Host: save and restore training state with orbax-checkpoint, and detect damaged checkpoints.

A checkpoint holds two items: ``state`` (a pytree of arrays: parameters,
optimizer state, model state) saved with ``StandardSave``, and ``host`` (plain
JSON: step, controller, sampler position, counters) saved with ``JsonSave``.
orbax writes each checkpoint into a temporary directory and renames it when
complete, so a crash mid-save leaves the previous checkpoint usable. The
``state`` item saves every array whole, one piece per shard, without orbax's
per-replica slicing (which compiles a small program per slice at a run's
first save); :meth:`Checkpointer.prepare` compiles the checksum program of a
state ahead, in the background, so that a run's first save (often a stop on
a signal) compiles nothing in the calling thread.

orbax does not notice every damaged file, so the ``host`` item also carries
the layout of the state, checksums of its arrays and a CRC-32 of the JSON
itself (:mod:`simigrad_jax.checkpoint.integrity`). Restore checks all
three: a checkpoint that fails is *unreadable*, reported as a warning, and the
one before it is tried; unreadable checkpoints newer than the one restored are
moved aside to ``<directory>.unreadable/`` so that the resumed run can save
those steps again (:mod:`simigrad_jax.checkpoint.quarantine`). A readable
checkpoint whose layout differs from the model (a different model, or a
different optimizer) is *not* skipped: restore raises
:class:`CheckpointMismatchError` naming the differences. Checkpoints written
before these records existed are restored unverified, with a warning.

Only damage is moved aside. A read that fails with an error of the file
system (an ``OSError`` such as EIO, or tensorstore's report of one), not of
the checkpoint's contents, is tried again a few times, waiting a little
longer each time, and then raised as an ``OSError`` that names the
checkpoint; nothing is skipped or moved. A file the checkpoint should hold
but that is missing is damage (:mod:`simigrad_jax.checkpoint.read_retry`).

A background save that fails is reported by :meth:`Checkpointer.failed_save`
without waiting (:mod:`simigrad_jax.checkpoint.background_save`), so that a
run can stop at its next step instead of at its next save.

The directory trusts nothing it did not make. A step folder is a checkpoint
only when it is a real folder (not a link) holding what orbax writes
(:func:`is_checkpoint_folder`); anything else named like a step (a link, a
file, a FIFO, a folder someone else made) is never read, moved or deleted,
and a warning names it. The newest checkpoints are kept by this class, not
by orbax (which deletes every folder named like a step): only the steps
this run saved are ever deleted, as the ledger that every checkpoint
carries in its host item (``written_steps``) lists them.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import shutil
import stat
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint._src.metadata import array_metadata_store  # (its default, not exported)

from simigrad_jax import files
from simigrad_jax import validation
from simigrad_jax.checkpoint import integrity
from simigrad_jax.checkpoint import read_retry
from simigrad_jax.checkpoint.background_save import BackgroundSave
from simigrad_jax.checkpoint.quarantine import quarantine
from simigrad_jax.errors import SimiGradError

logger = logging.getLogger("simigrad_jax")


# The host item's key of the ledger: the steps of the checkpoints the run saved and keeps.
WRITTEN_STEPS = "written_steps"
# The names orbax writes into a checkpoint's folder; a folder with none of them is not one.
_ORBAX_NAMES = ("_CHECKPOINT_METADATA", "commit_success.txt", "host", "state")


def is_checkpoint_folder(path: str | os.PathLike) -> bool:
  """Whether ``path`` is a folder orbax wrote: a real folder, not a link, holding its files.

  A damaged checkpoint still is one (it keeps some of orbax's names); a link,
  a file, a FIFO or a folder someone else made is not.
  """
  try:
    if not stat.S_ISDIR(os.lstat(path).st_mode):
      return False
    return any(name in _ORBAX_NAMES for name in os.listdir(path))
  except OSError:
    return False


def _plain(text: str) -> str:
  """``text`` without the ``<bound method ...>`` reprs that compiled libraries put in messages."""
  return re.sub(r"\s*<bound method [^>]*>", "", text)


def _kind(path: str) -> str:
  """What the entry ``path`` is, for a message."""
  try:
    mode = os.lstat(path).st_mode
  except OSError:
    return "gone"
  if stat.S_ISLNK(mode):
    return f"a link to {os.readlink(path)!r}"
  if stat.S_ISDIR(mode):
    return "a folder without orbax's files"
  return "a plain file" if stat.S_ISREG(mode) else "a special file (a FIFO, a device)"


class _StateHandler(ocp.StandardCheckpointHandler):
  """orbax's handler of the ``state`` item, saving every array in one piece per shard.

  orbax's default splits the save of an array that several devices hold
  (replica-parallel saving, on CPU devices and TPUs), compiling one small
  program per slice of each such array: a run's first save, often a stop on a
  signal, would wait for those compiles in the main thread. The files are the
  same either way (replica-parallel saving only shares out the writing), so
  checkpoints written with either setting restore with this handler.
  """

  def __init__(self) -> None:
    super().__init__()
    # StandardCheckpointHandler takes no registry of its own: its PyTree handler gets one,
    # orbax's default handlers with jax.Array's as orbax makes it but for the slicing.
    whole_array = ocp.type_handlers.ArrayHandler(
      use_replica_parallel=False, array_metadata_store=array_metadata_store.Store()
    )
    whole_arrays = ocp.type_handlers.create_type_handler_registry(
      *[(ty, ocp.type_handlers.get_type_handler(ty)) for ty in ocp.type_handlers.supported_types()],
      (jax.Array, whole_array),
    )
    self._impl.close()  # type: ignore[has-type]  # (made with the global registry, unused)
    self._impl = ocp.PyTreeCheckpointHandler(  # (with StandardCheckpointHandler's settings)
      save_concurrent_gb=96,
      restore_concurrent_gb=96,
      use_ocdbt=True,
      type_handler_registry=whole_arrays,
    )


def _handler_registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
  """The handlers of a checkpoint's two items: ``state`` (:class:`_StateHandler`), ``host``."""
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  state = _StateHandler()
  registry.add("state", ocp.args.StandardSave, state)
  registry.add("state", ocp.args.StandardRestore, state)
  registry.add("host", ocp.args.JsonSave)
  registry.add("host", ocp.args.JsonRestore)
  return registry


class CheckpointFolderGoneError(SimiGradError, OSError):
  """The checkpoints folder is gone, or no longer a folder, while the run trains.

  Its ``errno`` is ``ENOENT`` (removed) or ``ENOTDIR`` (replaced by a file or
  a link); an emergency save takes the run's last step elsewhere
  (:mod:`simigrad_jax.checkpoint.emergency`).
  """


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
    self.directory = directory
    self.max_to_keep = validation.check_int("max_to_keep", max_to_keep, 1)
    self.skipped: list[tuple[int, str]] = []
    self.quarantined: list[str] = []
    # orbax keeps every checkpoint: it would delete any folder named like a step.
    self._manager = ocp.CheckpointManager(
      directory,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=None, enable_async_checkpointing=async_save, create=True
      ),
      handler_registry=_handler_registry(),
    )
    self._background = BackgroundSave(self._manager.wait_until_finished)
    self._async = async_save
    self._written: list[int] = []  # the steps this run saved and keeps, oldest first
    self._saving: int | None = None  # the step of the save under way
    self._warned: set[str] = set()  # the foreign entries already named in a warning

  def all_steps(self) -> list[int]:
    """The steps of the checkpoints on disk, oldest first (only folders orbax wrote)."""
    steps = []
    for step in sorted(self._manager.all_steps()):
      path = os.path.join(self.directory, str(step))
      if step == self._saving or is_checkpoint_folder(path):  # (its own save may be under way)
        steps.append(step)
      elif os.path.lexists(path) and path not in self._warned:
        self._warned.add(path)
        logger.warning(
          "%s is named like a checkpoint but is not a folder this run wrote (%s): it is "
          "never read, moved or deleted",
          path,
          _kind(path),
        )
    return steps

  def foreign_entries(self) -> list[str]:
    """The entries of the directory named like a step that are not checkpoints (links, files,
    folders someone else made), oldest step first."""
    try:
      names = os.listdir(self.directory)
    except OSError:
      return []
    steps = sorted(int(n) for n in names if n.isdigit())
    paths = [os.path.join(self.directory, str(step)) for step in steps]
    return [path for path in paths if not is_checkpoint_folder(path)]

  @staticmethod
  def describe(path: str) -> str:
    """What the entry ``path`` is (a link, a file, a folder without orbax's files), for a message."""
    return _kind(path)

  def latest_step(self) -> int | None:
    """The newest checkpoint's step, or None when there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def read_host(self, step: int) -> dict[str, Any]:
    """The host item of the checkpoint of ``step`` (its CRC checked), without its arrays.

    Raises:
      ValueError: a damaged record (orbax's own error where it cannot read it).
    """
    record = self._host_record(step)
    payload = integrity.verified_payload(record, step)
    host = dict(record) if payload is None else dict(payload["host"])
    host.pop(WRITTEN_STEPS, None)  # (the directory's own: the caller gets back what it saved)
    return host

  def prepare(self, like: Any) -> None:
    """Starts compiling, in the background, what a save or restore of a state like ``like`` needs.

    A run's first save otherwise compiles the checksum program of its state's
    arrays (:mod:`.integrity`) in the calling thread: a stop on a signal
    before any checkpoint would wait for it. Calling it is optional.

    Args:
      like: the state to be saved or restored (arrays, or
        ``jax.ShapeDtypeStruct`` with shardings).
    """
    integrity.prepare_checksums(like)

  def save(self, step: int, state: Any, host: dict[str, Any]) -> None:
    """Saves ``state`` (arrays) and ``host`` (JSON) as the checkpoint of ``step``.

    The host item also records the state's layout and checksums (see the
    module docstring). Every process must call it (multi-host runs). The
    last save is waited for first (see :meth:`wait`).
    """
    self.wait()
    if step in self._written:  # saved already (a step is saved once)
      return
    self.check_folder(step)
    path = os.path.join(self.directory, str(step))
    if os.path.lexists(path):  # (a run saves each step once: someone else put this there)
      raise files.UnsafePathError(
        f"cannot save the checkpoint of step {step}: {path} exists and is {_kind(path)}, not "
        f"made by this run (it is left alone); move it out of {self.directory} and resume"
      )
    host = {**host, WRITTEN_STEPS: self._kept_after(step)}
    record = integrity.host_record(state, host, step)
    self._saving = step
    self._manager.save(
      step,
      args=ocp.args.Composite(state=ocp.args.StandardSave(state), host=ocp.args.JsonSave(record)),
      force=True,
    )
    self._background.started()  # so that failed_save() knows at once
    if not self._async:  # finished: the old ones go now (else once it has, at the next wait)
      self._saved()

  def check_folder(self, step: int) -> None:
    """Raises :class:`CheckpointFolderGoneError` when the directory is no longer a real folder.

    A workdir removed while the run trains, or ``checkpoints/`` replaced by
    a file or a link, would otherwise fail inside orbax with a raw error.
    """
    try:
      mode = os.lstat(self.directory).st_mode
    except FileNotFoundError:
      gone, what = errno.ENOENT, "is gone (the workdir or the folder was removed)"
    else:
      if stat.S_ISDIR(mode):
        return
      gone, what = errno.ENOTDIR, f"is no longer a folder: it is now {_kind(self.directory)}"
    raise CheckpointFolderGoneError(
      gone,
      f"the checkpoint of step {step} cannot be saved: {self.directory} {what}",
      self.directory,
    )

  def _kept_after(self, step: int) -> list[int]:
    """The steps this run keeps once the checkpoint of ``step`` is saved, oldest first."""
    return [*self._written, step][-self.max_to_keep :]

  def _saved(self) -> None:
    """Takes the finished save into the ledger, then deletes the run's checkpoints beyond the
    newest :attr:`max_to_keep` (process 0: the others see the same storage)."""
    step, self._saving = self._saving, None
    if step is None or not is_checkpoint_folder(os.path.join(self.directory, str(step))):
      return  # (a failed save: nothing new to keep, nothing old to give up)
    kept = self._kept_after(step)
    dropped = [s for s in self._written if s not in kept]
    self._written = kept
    if jax.process_index() != 0:
      return
    for old in dropped:
      path = os.path.join(self.directory, str(old))
      if is_checkpoint_folder(path):  # (never through a link put in its place since)
        shutil.rmtree(path)
    if dropped:
      self._manager.reload()

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
    return self._background.failed()

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
      OSError: a read failed :data:`~simigrad_jax.checkpoint.read_retry.
        READ_ATTEMPTS` times with an error of the file system (e.g. EIO), not
        of the checkpoint's contents; the message names the checkpoint. No
        older checkpoint is tried and nothing is moved.
      ValueError: no checkpoint could be read; the message names each step
        and its error. :class:`~simigrad_jax.checkpoint.integrity.OtherFormatError`
        (a ValueError): the newest checkpoint is in the format of another
        version of simigrad_jax; nothing is moved.
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
        state, host = read_retry.read_with_retries(
          functools.partial(self._restore_one, candidate, abstract, want_layout),
          step=candidate,
          directory=self.directory,
          not_damage=(CheckpointMismatchError, integrity.OtherFormatError),
        )
      except read_retry.Damaged as damage:
        error = damage.__cause__ or damage
        reason = f"{type(error).__name__}: {_plain(read_retry.first_line(error))}"
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
        self.quarantined = quarantine(self.directory, [s for s, _ in self.skipped])
        self._manager.reload()
        logger.warning(
          "restored the checkpoint at step %d in %s; skipped unreadable checkpoint(s) "
          "at step(s) %s, moved to %s",
          candidate,
          self.directory,
          [s for s, _ in self.skipped],
          self.quarantined,
        )
      host = dict(host)
      self._adopt_ledger(host.pop(WRITTEN_STEPS, None), candidate)
      return state, host, candidate
    raise ValueError(
      f"no readable checkpoint in {self.directory}: " + "; ".join(errors) + ". Every checkpoint "
      f"there is damaged: restore one from a backup into {self.directory}, or move the folder "
      f"aside (mv {self.directory} {self.directory}.damaged) to start the run again from step 0"
    )

  def _adopt_ledger(self, ledger: Any, step: int) -> None:
    """Takes the restored checkpoint's ledger as the run's: the steps it saved up to ``step``.

    A checkpoint written before the ledger existed (``ledger`` None) counts
    as the run's, with the older checkpoints orbax wrote beside it.
    """
    steps = self.all_steps()
    if not isinstance(ledger, list):
      ledger = steps
    self._written = [s for s in ledger if isinstance(s, int) and s <= step and s in steps]
    if step not in self._written:
      self._written.append(step)

  def _host_record(self, step: int) -> Any:
    """The host item of the checkpoint of ``step`` as saved (see :mod:`.integrity`)."""
    return self._manager.restore(step, args=ocp.args.Composite(host=ocp.args.JsonRestore())).host

  def _restore_one(self, step: int, abstract: Any, want_layout: list) -> tuple[Any, dict[str, Any]]:
    """Restores the checkpoint of ``step`` once, checking it against its record.

    Raises:
      CheckpointMismatchError: as :meth:`restore`.
      Exception: the checkpoint is damaged, or the file system failed the read.
    """
    record = self._host_record(step)
    try:
      payload = integrity.verified_payload(record, step)
    except integrity.OtherFormatError as error:
      raise integrity.OtherFormatError(f"{error} (in {self.directory})") from None
    if payload is None:  # an older simigrad_jax's checkpoint: restore it as before, unverified
      logger.warning(
        "checkpoint at step %d in %s has no checksums (written by an older "
        "simigrad_jax): its data cannot be verified",
        step,
        self.directory,
      )
    # Paths are for the message only: a JAX or optax release that names them differently
    # must not make old checkpoints unreadable.
    elif [entry[1:] for entry in payload["layout"]] != [entry[1:] for entry in want_layout]:
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
    if payload is None:
      return restored, dict(record)
    integrity.check_checksums(payload, restored, step)
    return restored, payload["host"]

  def reload(self) -> None:
    """Reads the directory's checkpoints again (after one was moved in from elsewhere)."""
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
    finished = self._background.wait(timeout)
    if finished:
      self._saved()
    return finished

  def close(self) -> None:
    """Waits for the last save and releases orbax's resources (raising as :meth:`wait`)."""
    self.wait()
    self._manager.close()
