"""Host: what a resume checks before it continues a checkpoint's run: the seed and the run's record.

Plain Python between steps; nothing here is traced. A checkpoint made with
another seed is refused (:func:`check_seed`). The record saved with the
checkpoint (:mod:`simigrad_jax.checkpoint.run_record`) is compared with the
run's own (:func:`changes_since`): a changed setting that decides the
trajectory is refused unless the run allows it; an allowed change, and a
changed device count or version, which is always allowed, is logged
(:func:`log_changes`) and kept in the run's history. When the checkpoint's
arrays do not fit the run at all, :func:`other_run_message` says how the two
runs differ.
"""

from __future__ import annotations

import logging
from typing import Any

from simigrad_jax.checkpoint import run_record
from simigrad_jax.checkpoint.checkpointer import CheckpointMismatchError

logger = logging.getLogger("simigrad_jax")

HOW_TO_ALLOW = (
  "Resume with the settings it was made with, use a new workdir, or allow the "
  "change with CheckpointConfig(allow_changed_settings=True) (it is then recorded in the run's "
  "history)"
)


def check_seed(host: dict[str, Any], seed: int, where: str) -> None:
  """Refuses a checkpoint whose host state was saved by a run with another seed.

  Args:
    host: the checkpoint's host state (its ``"seed"``).
    seed: this run's seed.
    where: names the checkpoint in the message.

  Raises:
    CheckpointMismatchError: the seeds differ.

  Example:
    >>> check_seed({"seed": 0}, 0, "the checkpoint at step 3")
  """
  if host.get("seed") != seed:
    raise CheckpointMismatchError(
      f"{where} was made with seed={host.get('seed')!r}, this run has seed={seed}; use "
      "the same seed to resume, or a new workdir"
    )


def changes_since(
  host: dict[str, Any],
  record: dict[str, Any] | None,
  *,
  allow_changed_settings: bool,
  where: str,
) -> run_record.RecordChanges | None:
  """How this run differs from the one that saved ``host``; a changed setting refused unless allowed.

  Args:
    host: the checkpoint's host state (its ``"run"``: the saved record).
    record: this run's record (None: nothing is compared).
    allow_changed_settings: allow a change in the parts that decide the
      trajectory (:data:`~simigrad_jax.checkpoint.run_record.CHECKED_PARTS`).
    where: names the checkpoint in the messages.

  Returns:
    The differences, or None when either has no record (a checkpoint of an
    older simigrad_jax is resumed with a warning).

  Raises:
    CheckpointMismatchError: a checked part differs and the change is not
      allowed; the message lists the differences.

  Example:
    >>> changes_since({"run": {"settings": {"lr": 0.1}}}, {"settings": {"lr": 0.2}},
    ...               allow_changed_settings=True, where="the checkpoint at step 3")
    RecordChanges(checked=['settings.lr: 0.1 there, 0.2 here'], recorded=[])
  """
  if record is None:
    return None
  saved = host.get("run")
  if saved is None:
    logger.warning(
      "%s was written before simigrad_jax recorded a run's settings in its "
      "checkpoints: they cannot be checked against this run's; they are recorded "
      "from the next checkpoint on",
      where,
    )
    return None
  changes = run_record.compare(saved, record)
  if changes.checked and not allow_changed_settings:
    raise CheckpointMismatchError(
      f"{where} was made by a run with other settings:\n{run_record.listed(changes.checked)}"
      f"\n{HOW_TO_ALLOW}"
    )
  return changes


def other_run_message(
  error: CheckpointMismatchError,
  workdir: str,
  saved: dict[str, Any] | None,
  record: dict[str, Any] | None,
) -> str:
  """The message for a checkpoint whose arrays do not fit this run.

  Args:
    error: the restore's error, naming how the arrays' layouts differ.
    workdir: the run's workdir (the checkpoints' parent).
    saved: the record of the newest checkpoint, None when it has none or it
      cannot be read.
    record: this run's record, None when the run keeps none.

  Returns:
    How the two records differ when they say (they differ in a checked part),
    else the layouts' differences.

  Example:
    >>> print(other_run_message(CheckpointMismatchError("w is float32[3] there"),
    ...                         "/tmp/run", None, None))
    the workdir '/tmp/run' holds checkpoints of another run: w is float32[3] there
  """
  changes = None if saved is None or record is None else run_record.compare(saved, record)
  if changes is None or not changes.checked:
    return f"the workdir {workdir!r} holds checkpoints of another run: {error}"
  return (
    f"the workdir {workdir!r} holds checkpoints of another run, whose arrays do not fit "
    f"this one's; the runs differ in:\n"
    f"{run_record.listed(changes.checked + changes.recorded)}\n"
    "A changed model or optimizer structure cannot be resumed, allowed or not: use the "
    "model and optimizer it was made with, or a new workdir"
  )


def log_changes(changes: run_record.RecordChanges, where: str) -> None:
  """Warns of the changes a resume allowed (they are also kept in the run's history).

  Args:
    changes: the differences :func:`changes_since` found.
    where: names the checkpoint in the warnings.
  """
  if changes.checked:
    logger.warning(
      "%s was made by a run with other settings; resuming with this run's, as "
      "allow_changed_settings=True allows (recorded in the run's history):\n%s",
      where,
      run_record.listed(changes.checked),
    )
  if changes.recorded:
    logger.warning(
      "%s was made on other devices, shapes or versions; resuming exactly "
      "(recorded in the run's history):\n%s",
      where,
      run_record.listed(changes.recorded),
    )
