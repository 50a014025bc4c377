"""Host: a training run's checkpoints: the host state saved beside the arrays, resume, waits.

Plain Python between steps; nothing here is traced. The arrays (parameters,
optimizer and model state) go through :class:`~simigrad_jax.checkpoint.checkpointer.
Checkpointer` (orbax); beside them each checkpoint holds what the host needs to
continue exactly (the step, the seed, the controller's and the sampler's state
and the count of non-finite steps) and what the run is: its record
(:mod:`simigrad_jax.checkpoint.run_record`: the optimizer's hyperparameters, the
settings, the controller, the data, the model, the devices and the versions)
and the history of the changes its resumes allowed.

A resume compares the checkpoint's record with the run's own: a changed
optimizer setting, model, data set or other setting that decides the
trajectory is refused with :class:`~simigrad_jax.checkpoint.checkpointer.
CheckpointMismatchError` listing the differences, unless the run allows
changed settings; then, as for a changed device count or version, which is
always allowed, the changes are logged and kept in the history that every
later checkpoint carries (the checks: :mod:`simigrad_jax.checkpoint.resume_checks`).
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Mapping
from typing import Any, NamedTuple

from simigrad_jax import files
from simigrad_jax.checkpoint import emergency
from simigrad_jax.checkpoint import metrics_recovery
from simigrad_jax.checkpoint import resume_checks
from simigrad_jax.checkpoint import run_record
from simigrad_jax.checkpoint.checkpointer import Checkpointer
from simigrad_jax.checkpoint.checkpointer import CheckpointMismatchError
from simigrad_jax.errors import SimiGradError
from simigrad_jax.multihost.process_agreement import ProcessAgreement

logger = logging.getLogger("simigrad_jax")

# Multi-host: how long a process waits for a checkpoint save before it checks on the others.
SAVE_WAIT_ROUND_SECONDS = 1.0


class CheckpointSaveError(SimiGradError, RuntimeError):
  """Multi-host: another process's background checkpoint save failed, so every process stops.

  The process whose save failed raises the save's own error instead.
  """


class CheckpointsMissingError(SimiGradError, ValueError):
  """A workdir whose metrics record trained steps but whose checkpoints folder is gone."""


def check_checkpoints_kept(workdir: str | os.PathLike) -> None:
  """Refuses a workdir whose ``metrics.jsonl`` records steps while ``checkpoints/`` is missing.

  Call it before the checkpoints folder is made. A run killed before its
  first save keeps an empty ``checkpoints/`` and starts again from step 0, as
  it should; a workdir whose ``checkpoints/`` was deleted (or never copied
  along) would start again too, and rewrite the records of the steps it
  trained, so it is refused with the choices spelled out.

  Raises:
    CheckpointsMissingError: the metrics record steps and no checkpoints
      folder is there.
  """
  workdir = pathlib.Path(workdir)
  folder, metrics = workdir / "checkpoints", workdir / "metrics.jsonl"
  if os.path.lexists(folder) or not os.path.lexists(metrics):
    return
  entries, _, _ = metrics_recovery.parse_records(files.read_plain_file(metrics))
  steps = [r["step"] for _, r in entries if metrics_recovery.STEP_KEY in r]
  if not steps:
    return
  raise CheckpointsMissingError(
    f"{metrics} records steps {min(steps)}-{max(steps)} of a run, but its checkpoints folder "
    f"{folder} is gone: starting here would train again from step 0 and rewrite those records. "
    f"To resume, put the checkpoints back in {folder}; to start anew keeping the old records, "
    f"move them aside (mv {metrics} {metrics}.old) or use another workdir"
  )


class Resumed(NamedTuple):
  """What a run continues from: the restored arrays, the step and the non-finite steps so far,
  and the compiled programs that the saving process recorded (None if it recorded none)."""

  state: Any
  step: int
  nonfinite_steps: int
  compiled_programs: dict[str, Any] | None = None


class RunCheckpoints:
  """Saves a run's state every so often and resumes it from the newest readable checkpoint.

  Args:
    directory: where the checkpoints go (created if missing).
    seed: the run's seed; a checkpoint made with another seed is refused.
    max_to_keep: how many checkpoints are kept.
    agreement: the run's :class:`~simigrad_jax.multihost.process_agreement.
      ProcessAgreement`: with several processes, they wait for each other's
      saves through it, and a lost one is reported within its timeout.
    record: the run's record (:func:`simigrad_jax.checkpoint.run_record.
      make_record`), saved with every checkpoint and compared on resume;
      None: nothing is recorded or compared.
    allow_changed_settings: resume a checkpoint whose record differs in a
      setting that decides the trajectory (the optimizer, the settings, the
      controller, the data), recording the change, instead of refusing it.

  Attributes:
    changes: the history of the changes the run's resumes allowed, oldest
      first: ``{"step", "settings", "environment"}`` each, the last two lists
      of differences (see :func:`simigrad_jax.checkpoint.run_record.compare`).

  Example::

    checkpoints = RunCheckpoints(workdir / "checkpoints", seed=0, max_to_keep=3,
                                 agreement=ProcessAgreement(timeout=300.0))
    resumed = checkpoints.resume(state, sampler, controller)
  """

  def __init__(
    self,
    directory: str | os.PathLike,
    *,
    seed: int,
    max_to_keep: int,
    agreement: ProcessAgreement,
    record: dict[str, Any] | None = None,
    allow_changed_settings: bool = False,
  ):
    self.checkpointer = Checkpointer(directory, max_to_keep=max_to_keep)
    self.seed = seed
    self.record = record
    self.allow_changed_settings = allow_changed_settings
    self.changes: list[dict[str, Any]] = []
    self._agreement = agreement
    self._last_saved: int | None = None  # the step of the last save

  def resume(self, like: Any, sampler: Any, controller: Any) -> Resumed | None:
    """Restores the newest readable checkpoint into ``sampler`` and ``controller``.

    An emergency checkpoint newer than the newest in the directory is moved
    there first (:func:`simigrad_jax.checkpoint.emergency.adopt`); the run's
    emergency checkpoints in ``$TMPDIR`` up to the step restored are removed
    (:func:`simigrad_jax.checkpoint.emergency.remove_superseded`).

    Args:
      like: the train state whose structure, shapes and shardings the arrays
        are restored to (with :attr:`allow_changed_settings`, the source of
        the changed ``inject_hyperparams`` values).
      sampler: the run's :class:`~simigrad_jax.data.sampler.EpochSampler`.
      controller: the run's controller.

    Returns:
      The restored state, step and non-finite step count, or None when the
      directory holds no checkpoint.

    Raises:
      CheckpointMismatchError: (a ValueError) the checkpoints belong to
        another run (other shapes, another seed, or, unless
        :attr:`allow_changed_settings`, other settings); the message lists the
        differences, and nothing is changed.
    """
    checkpointer = self.checkpointer
    if self._agreement.num_processes == 1:  # (only one process saves one)
      if emergency.adopt(checkpointer.directory, checkpointer.latest_step()) is not None:
        checkpointer.reload()
    self._refuse_foreign_ahead()
    if checkpointer.latest_step() is None:
      return None
    directory = checkpointer.directory
    checkpointer.prepare(like)  # (the restore's check, and the first save, then wait for less)
    try:
      state, host, step = checkpointer.restore(like)
    except CheckpointMismatchError as error:
      workdir, saved = os.path.dirname(directory), self._newest_saved_run()
      message = resume_checks.other_run_message(error, workdir, saved, self.record)
      raise CheckpointMismatchError(message) from error
    where = f"the checkpoint at step {step} in {directory}"
    resume_checks.check_seed(host, self.seed, where)
    changes = resume_checks.changes_since(
      host, self.record, allow_changed_settings=self.allow_changed_settings, where=where
    )
    sampler_state, controller_state = host["sampler"], host["controller"]
    if changes is not None and changes.checked:  # allowed: the saved settings give way
      sampler_state = {**sampler_state, "num_examples": sampler.num_examples}
      controller_state = {**controller_state, "config": None}
      assert self.record is not None  # changes are found only against a record
      injected = run_record.changed_injected(host["run"], self.record)
      if injected:
        state = run_record.with_injected(state, like, injected)
    try:  # both refuse without changing anything
      sampler.load_state_dict(sampler_state)
      controller.load_state_dict(controller_state)
    except (KeyError, TypeError, ValueError) as error:
      raise CheckpointMismatchError(
        f"{where} does not match this run's settings: {error}; resume with the settings it "
        "was made with, or use a new workdir"
      ) from error
    self.changes = list(host.get("run_changes", []))
    if changes is not None and (changes.checked or changes.recorded):
      self.changes.append(
        {"step": step, "settings": changes.checked, "environment": changes.recorded}
      )
      resume_checks.log_changes(changes, where)
    skipped = checkpointer.skipped
    if skipped:
      logger.warning(
        "resumed from the checkpoint at step %d in %s after skipping %d unreadable "
        "newer one(s): %s",
        step,
        directory,
        len(skipped),
        "; ".join(f"step {s}: {why}" for s, why in skipped),
      )
    else:
      logger.info("resumed from the checkpoint at step %d in %s", step, directory)
    if self._agreement.num_processes == 1:  # (only one process saves one)
      emergency.remove_superseded(directory, step)
    return Resumed(
      state,
      int(host["step"]),
      int(host.get("nonfinite_steps", 0)),
      host.get("compiled_programs"),
    )

  def prepare_saves(self, like: Any) -> None:
    """Starts compiling, in the background, what a save of a state like ``like`` needs (its
    checksum program: :meth:`~simigrad_jax.checkpoint.checkpointer.Checkpointer.prepare`).

    A resume prepares it before its restore; a new run calls this after its
    first step, so that the program's trace does not compete with the first
    step's own (tracing holds the GIL). A no-op once prepared.

    Args:
      like: the state to be saved (arrays, or ``jax.ShapeDtypeStruct`` with shardings).
    """
    self.checkpointer.prepare(like)

  def _refuse_foreign_ahead(self) -> None:
    """Refuses an entry named like a step the run will save, that the run did not make.

    Older ones are left alone (named in a warning): the run never reads,
    moves or deletes them. One newer than the newest checkpoint would block
    that step's save in the middle of training.

    Raises:
      UnsafePathError: such an entry (a link, a file, a FIFO, a folder
        someone else made), named, with the fix.
    """
    checkpointer = self.checkpointer
    latest = checkpointer.latest_step() or 0
    ahead = [
      path for path in checkpointer.foreign_entries() if int(os.path.basename(path)) > latest
    ]
    if ahead:
      raise files.UnsafePathError(
        f"{ahead[0]} is named like a checkpoint of step {os.path.basename(ahead[0])} but this "
        f"run did not make it ({checkpointer.describe(ahead[0])}): the run would stop when it "
        f"reaches that step, and never writes through, reads or deletes what it did not "
        f"make; move it out of {checkpointer.directory}, then run again"
        + (f" (and {len(ahead) - 1} more such entries)" if len(ahead) > 1 else "")
      )

  def _newest_saved_run(self) -> dict[str, Any] | None:
    """The record saved with the newest checkpoint; None without one, or when the run keeps
    none (nothing is read then)."""
    if self.record is None:
      return None
    try:
      latest = self.checkpointer.latest_step()
      return None if latest is None else self.checkpointer.read_host(latest).get("run")
    except Exception:  # pylint: disable=broad-except  (the layouts' differences say enough)
      return None

  def save(
    self,
    step: int,
    state: Any,
    *,
    sampler: Any,
    controller: Any,
    nonfinite_steps: int,
    compiled_programs: Mapping[str, Any] | None = None,
  ) -> None:
    """Saves ``state`` and the host state as the checkpoint of ``step`` (once per step).

    The last save is waited for first, on every process. ``compiled_programs``
    (JSON: what the run has compiled into its persistent compilation cache)
    comes back in :attr:`Resumed.compiled_programs`.
    """
    if self.checkpointer.latest_step() == step:
      return
    self.wait(f"checkpoint of step {step}")
    host = _host_state(
      self,
      step,
      sampler=sampler,
      controller=controller,
      nonfinite_steps=nonfinite_steps,
      compiled_programs=compiled_programs,
    )
    self.checkpointer.save(step, state, host)
    self._last_saved = step

  def save_elsewhere(self, error: BaseException, step: int, state: Any, **saved_with: Any) -> None:
    """After ``error``, a save its disk stopped: the checkpoint of ``step`` saved elsewhere.

    One process only (several save together), a step not saved yet, in
    ``<workdir>/emergency/`` or ``$TMPDIR`` (:func:`simigrad_jax.checkpoint.
    emergency.save_after`, which records on ``error`` where it went). The
    other arguments are :meth:`save`'s; ``state`` None: not a whole step's (the
    next was under way), nothing is saved and ``error`` says so.
    """
    if self._agreement.num_processes == 1 and step > (self.checkpointer.latest_step() or 0):
      host = _host_state(self, step, **saved_with)
      emergency.save_after(error, self.checkpointer.directory, step, state, host)

  def save_before_failing(
    self, error: BaseException, step: int, state: Any, **saved_with: Any
  ) -> None:
    """After ``error``, not a disk's, the checkpoint of ``step`` saved as usual, if it can be.

    A failure after a whole step (a hook's, the evaluation at an epoch's end,
    a streak of non-finite steps) would otherwise lose the steps since the
    last checkpoint. One process only (several would have to save together),
    a whole step's ``state`` (None: the next step was under way), a step not
    saved yet; a save that fails too is logged and ``error`` is raised as it
    was. A disk's error goes to :meth:`save_elsewhere` instead.
    """
    if (
      self._agreement.num_processes != 1
      or state is None
      or emergency.disk_errno(error) is not None
      or step <= (self.checkpointer.latest_step() or 0)
    ):
      return
    try:
      self.save(step, state, **saved_with)
      self.wait(f"checkpoint of step {step}")
    except Exception as save_error:  # pylint: disable=broad-except  (the first error is raised)
      logger.warning(
        "could not save the checkpoint of step %d after %r: %r", step, error, save_error
      )
      return
    error.add_note(f"the checkpoint of step {step} was saved before stopping")

  def failed_save(self) -> str | None:
    """``"ErrorType: message"`` (short) when this process's last save failed in the background,
    else None (also while it is under way); never waits. See :meth:`stop_on_failed_saves`."""
    error = self.checkpointer.failed_save()
    if error is None:
      return None
    text = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
    return text.encode("ascii", "replace").decode()[:150]  # (it rides in the step's agreement)

  def stop_on_failed_saves(self, failed: list[str | None], step: int) -> None:
    """Raises when a process's last save failed in the background; every process calls it.

    Args:
      failed: every process's :meth:`failed_save`, in process order (the
        same list on every process, gathered at a step's agreement).
      step: the step training stops at.

    Raises:
      Exception: on a process whose save failed, the save's own error (e.g.
        ``OSError`` of a full disk), with a note naming the checkpoint.
      CheckpointSaveError: on the other processes, naming the process and
        its error.
    """
    failures = {process: text for process, text in enumerate(failed) if text is not None}
    if not failures:
      return
    saved = (
      f"the background save of the checkpoint of step {self._last_saved} in "
      f"{self.checkpointer.directory}"
    )
    then = f"training stopped at step {step}; a restart resumes from the newest finished checkpoint"
    error = self.checkpointer.failed_save()
    if error is not None:
      newest = self.checkpointer.latest_step()
      error.add_note(f"{saved} failed: {then} ({'none' if newest is None else f'step {newest}'})")
      raise error
    processes = ", ".join(f"process {p} ({text})" for p, text in failures.items())
    raise CheckpointSaveError(f"{saved} failed on {processes}: {then}")

  def wait(self, what: str) -> None:
    """Waits until the last checkpoint save has finished on every process.

    Multi-host: orbax's commit waits for every process with a timeout of 20
    minutes, so the processes wait in rounds of at most
    :data:`SAVE_WAIT_ROUND_SECONDS` and tell each other after each round
    whether theirs has finished (all of them go on together): a process lost
    meanwhile is reported within the agreement timeout. One process: the
    run's emergency checkpoints in ``$TMPDIR`` that the finished save
    supersedes are removed then (:func:`simigrad_jax.checkpoint.emergency.
    remove_superseded`).

    Args:
      what: names the wait in a report of a lost process.
    """
    if self._agreement.num_processes == 1:
      self.checkpointer.wait()
      emergency.remove_superseded(self.checkpointer.directory, self.checkpointer.latest_step())
      return
    while True:
      finished = self.checkpointer.wait(timeout=SAVE_WAIT_ROUND_SECONDS)
      if all(self._agreement.gather(what, finished)):
        return

  def close(self) -> None:
    """Waits for the last save and releases orbax's resources.

    After a lost process it does not wait for a save under way: the save
    would wait for the lost process.
    """
    if not self._agreement.lost_processes():
      self.checkpointer.close()


def _host_state(
  checkpoints: RunCheckpoints,
  step: int,
  *,
  sampler: Any,
  controller: Any,
  nonfinite_steps: int,
  compiled_programs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
  """What a checkpoint of ``step`` holds beside the arrays (JSON)."""
  host = {
    "step": step,
    "seed": checkpoints.seed,
    "controller": controller.state_dict(),
    "sampler": sampler.state_dict(),
    "nonfinite_steps": nonfinite_steps,
  }
  if checkpoints.record is not None:
    host.update(run=checkpoints.record, run_changes=checkpoints.changes)
  if compiled_programs is not None:
    host["compiled_programs"] = dict(compiled_programs)
  return host
