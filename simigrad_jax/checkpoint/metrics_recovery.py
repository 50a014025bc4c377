"""Host: a run's ``metrics.jsonl`` read back on resume, whatever damage it took.

The file holds one JSON object per line, each with an integer ``"step"``
(:class:`simigrad_jax.trainer.MetricsWriter` writes it). A crash can tear its
last line; a disk or a person can do worse: truncate it mid-file, write a line
of NUL bytes into it, or garble a line. None of that blocks a resume whose
checkpoints are good (:func:`prepare_for_append`):

* a line that is not a JSON object is dropped (counted, and named in the
  warning);
* a step record (one with ``"batch_size"``) or an evaluation (one with
  ``"eval_accuracy"``) of a step up to the resumed one that the file lost is
  restored from the TensorBoard event files the run wrote beside it (every
  number of the record; strings and lists are not in the events). A
  restored record carries ``"restored_from": "tensorboard"``, and its values
  are the events' float32s;
* the steps that nothing holds any more are named by range in the same one
  warning line; :func:`missing_steps` finds them in a file, so that a summary
  never counts them as present.

Example:
  >>> missing_steps([{"step": 1, "batch_size": 8}, {"step": 4, "batch_size": 8}])
  [[2, 3]]
"""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import struct
from collections.abc import Iterator, Mapping
from typing import Any

from simigrad_jax import files
from simigrad_jax import validation

logger = logging.getLogger("simigrad_jax")

__all__ = ["missing_steps", "parse_records", "prepare_for_append", "step_ranges"]

# The keys that make a record a step's, and an evaluation's.
STEP_KEY, EVAL_KEY = "batch_size", "eval_accuracy"
RESTORED_FROM = "restored_from"


def _parse_line(line: bytes) -> dict[str, Any] | None:
  """The JSON object on ``line`` with an integer ``"step"``, or None if it is not one."""
  try:
    value = json.loads(line)
  except ValueError:  # json.JSONDecodeError and UnicodeDecodeError alike
    return None
  if not isinstance(value, dict) or not validation.is_int(value.get("step")):
    return None
  return value


def parse_records(
  data: bytes,
) -> tuple[list[tuple[bytes, dict[str, Any]]], list[int], bytes | None]:
  """Splits a metrics file into its records, its damaged lines and a torn last line.

  Args:
    data: the file's bytes.

  Returns:
    ``(entries, damaged, torn)``: ``entries`` holds ``(line, record)`` per
    record in file order, each line newline-terminated and otherwise
    verbatim; ``damaged`` the numbers (from 1) of the other lines that are
    not a JSON object with an integer ``"step"`` (blank lines are skipped);
    ``torn`` the unterminated last line that is not one (a crash mid-write),
    or None.

  Example:
    >>> parse_records(b'{"step": 1}\\n\\x00\\x00\\n{"step": 2}\\n{"st')[1:]
    ([2], b'{"st')
  """
  lines = data.split(b"\n")
  tail = lines.pop()  # b"" when the file ends with a newline
  entries, damaged = [], []
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    record = _parse_line(line)
    if record is None:
      damaged.append(number)
    else:
      entries.append((line + b"\n", record))
  torn = None
  if tail.strip():
    record = _parse_line(tail)
    if record is None:
      torn = tail
    else:  # complete but for its newline
      entries.append((tail + b"\n", record))
  return entries, damaged, torn


def step_ranges(steps: list[int]) -> list[list[int]]:
  """Sorted steps as ``[first, last]`` ranges of consecutive steps.

  Example:
    >>> step_ranges([3, 1, 2, 7])
    [[1, 3], [7, 7]]
  """
  ranges: list[list[int]] = []
  for step in sorted(set(steps)):
    if ranges and step == ranges[-1][1] + 1:
      ranges[-1][1] = step
    else:
      ranges.append([step, step])
  return ranges


def missing_steps(records: list[dict[str, Any]], last: int | None = None) -> list[list[int]]:
  """The steps from 1 to ``last`` (default: the last step's) without a record other than an evaluation.

  Args:
    records: a metrics file's records (:func:`simigrad_jax.read_metrics`).
    last: the last step the run did: an integer >= 0 (0: none yet; NumPy's
      integers are taken as Python's).

  Returns:
    ``[first, last]`` ranges; empty when every step has its record.

  Raises:
    ValueError: ``last`` is not an integer >= 0 (a bool, a float, a negative step).
  """
  if last is not None:
    last = validation.check_int("last", last, 0)
  steps = {r["step"] for r in records if EVAL_KEY not in r and validation.is_int(r.get("step"))}
  if last is None:
    last = max(steps, default=0)
  return step_ranges([s for s in range(1, last + 1) if s not in steps])


def _describe(ranges: list[list[int]]) -> str:
  return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)


def _events(path: pathlib.Path) -> Iterator[Any]:
  """The events of one TensorBoard file, up to a torn or damaged end."""
  from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel

  with open(files.open_nofollow(path, os.O_RDONLY), "rb") as f:
    size = os.fstat(f.fileno()).st_size
    while True:
      header = f.read(12)  # the length (8 bytes) and its CRC (4)
      if len(header) < 12:
        return
      (length,) = struct.unpack("<Q", header[:8])
      if length > size - f.tell():  # damage (or not an event file): more than the file holds
        return
      data = f.read(length)
      if len(data) < length or len(f.read(4)) < 4:
        return
      event = event_pb2.Event()
      try:
        event.ParseFromString(data)
      except Exception:  # pylint: disable=broad-except  (protobuf's DecodeError: damage)
        return
      yield event


def _number(value: float) -> float | int:
  return int(value) if value.is_integer() and abs(value) < 2**24 else value


def _disagreement(records: list[dict[str, Any]], known: Mapping[int, dict[str, Any]]) -> str | None:
  """Where an event file's step records contradict the metrics file's (None: nowhere)."""
  for record in records:
    mine = known.get(record["step"])
    if mine is None or STEP_KEY not in record:
      continue
    for key in (STEP_KEY, "loss"):
      theirs, ours = record.get(key), mine.get(key)
      if not (validation.is_real(theirs) and validation.is_real(ours)):
        continue
      both_nan = math.isnan(theirs) and math.isnan(ours)  # (a non-finite step's loss)
      if not (both_nan or math.isclose(theirs, ours, rel_tol=1e-5)):
        return (
          f"step {record['step']}: {key} {record[key]!r} there, {mine[key]!r} in the metrics file"
        )
  return None


def records_from_events(
  folder: pathlib.Path, up_to: int, known: Mapping[int, dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
  """The records of steps up to ``up_to`` that the event files in ``folder`` hold, newest write last.

  One event is one record (:class:`~simigrad_jax.trainer.MetricsWriter`
  writes a record's numbers as one summary); a step written again by a later
  run (after a resume) replaces the earlier one. An event file whose step
  records contradict ``known`` (the metrics file's step records by step: a
  batch size or loss of another value) is another run's, copied in: it is
  left out, with a warning.
  """
  if folder.is_symlink() or not folder.is_dir():
    return []
  try:
    import tensorboardX  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    return []
  found: list[tuple[float, list[dict[str, Any]]]] = []
  for path in sorted(folder.glob("events.out.tfevents.*")):
    if path.is_symlink():
      continue
    records, first_time = [], None
    try:
      for event in _events(path):
        first_time = event.wall_time if first_time is None else first_time
        values = event.summary.value if event.HasField("summary") else ()
        if values and 0 < event.step <= up_to:
          record: dict[str, Any] = {"step": int(event.step)}
          record.update((v.tag, _number(float(v.simple_value))) for v in values)
          records.append(record)
    except OSError:
      continue
    contradiction = _disagreement(records, known or {})
    if contradiction is not None:
      logger.warning(
        "%s: not restoring from %s, another run's events (%s)", folder, path.name, contradiction
      )
      continue
    found.append((first_time or 0.0, records))
  latest: dict[tuple[int, bool], dict[str, Any]] = {}
  for _, records in sorted(found, key=lambda item: item[0]):
    for record in records:
      latest[(record["step"], EVAL_KEY in record)] = record
  return [latest[key] for key in sorted(latest)]


def _in_step_order(
  entries: list[tuple[bytes, dict[str, Any]]],
) -> tuple[list[tuple[bytes, dict[str, Any]]], list[int]]:
  """The entries as a run writes them, and the steps of the others (in file order).

  A run appends its records in step order, each step's record (the one with
  :data:`STEP_KEY`) once, and its evaluations after it: a step record of a
  step already recorded, or any record of a step before the latest, is
  another file's line or one copied in (it would be counted twice in the
  epoch's averages, or read as the final evaluation).
  """
  kept, dropped, seen, latest = [], [], set(), 0
  for line, record in entries:
    step = record["step"]
    if (STEP_KEY in record and step in seen) or step < latest:
      dropped.append(step)
      continue
    if STEP_KEY in record:
      seen.add(step)
    latest = step
    kept.append((line, record))
  return kept, dropped


def prepare_for_append(
  path: pathlib.Path, resume_step: int | None, events: pathlib.Path | None = None
) -> list[list[int]]:
  """Readies ``metrics.jsonl`` for a run to append to, resumed after ``resume_step`` (None: a new run).

  Drops a torn last line; on resume also the records after ``resume_step``
  (they are written again) and every damaged line, restores the step records
  and evaluations up to ``resume_step`` that the file lost from the event
  files in ``events``, and rewrites the file atomically. One warning line
  says what was dropped, restored and lost.

  Args:
    path: the metrics file (refused if it is a symlink).
    resume_step: the step the run resumes after, or None.
    events: the run's TensorBoard folder, or None.

  Returns:
    The steps up to ``resume_step`` that have no step record now, as
    ``[first, last]`` ranges.

  Raises:
    UnsafePathError: ``path`` is a symlink, or not a plain file (a FIFO, a device).
  """
  if path.is_symlink():  # never read or write a run's metrics through a link
    raise files.refuse_symlink(path)
  if not path.exists() and resume_step is None:
    return []
  data = files.read_plain_file(path) if path.exists() else b""
  if resume_step is None:
    if not data or data.endswith(b"\n"):
      return []
    cut = data.rfind(b"\n") + 1
    tail = data[cut:]
    if _parse_line(tail) is not None or not tail.strip():
      with files.open_for_append(path) as f:  # complete but for its newline
        f.write("\n")
    else:
      logger.warning("%s: dropping a torn last line (%d bytes)", path, len(tail))
      files.write_atomic(path, data[:cut])
    return []
  entries, damaged, torn = parse_records(data)
  kept = [(line, record) for line, record in entries if record["step"] <= resume_step]
  kept, out_of_order = _in_step_order(kept)
  have = {(r["step"], EVAL_KEY in r) for _, r in kept}
  # A Trainer's file has a record of every step; another writer's may skip steps by design.
  every_step = not entries or any(STEP_KEY in r for _, r in entries)
  lost = missing_steps([r for _, r in kept], resume_step) if every_step else []
  restored = []
  if (lost or damaged or torn is not None) and events is not None:
    known = {r["step"]: r for _, r in kept if STEP_KEY in r}
    for record in records_from_events(events, resume_step, known):
      if (record["step"], EVAL_KEY in record) not in have:
        record[RESTORED_FROM] = "tensorboard"
        restored.append(record)
  if restored:
    lines = kept + [((json.dumps(r) + "\n").encode(), r) for r in restored]
    kept = sorted(lines, key=lambda item: (item[1]["step"], EVAL_KEY in item[1]))
  still_lost = missing_steps([r for _, r in kept], resume_step) if every_step else []
  notes = []
  if damaged:
    shown = ", ".join(map(str, damaged[:5])) + (", ..." if len(damaged) > 5 else "")
    notes.append(f"dropped {len(damaged)} damaged line(s) (line {shown})")
  if torn is not None:
    notes.append(f"dropped a torn last line ({len(torn)} bytes)")
  if out_of_order:
    notes.append(
      f"dropped {len(out_of_order)} record(s) out of step order (of step(s) "
      f"{_describe(step_ranges(out_of_order))}: a step written twice, or after a later one; "
      "lines of another run's file, or copied in)"
    )
  if restored:
    notes.append(
      f"restored {len(restored)} record(s) of step(s) "
      f"{_describe(step_ranges([r['step'] for r in restored]))} from the TensorBoard events"
    )
  if still_lost:
    notes.append(
      f"no record of step(s) {_describe(still_lost)} is left anywhere: they are missing from "
      f"the metrics (the summary's missing_steps)"
    )
  if notes:
    logger.warning("%s: resuming after step %d: %s", path, resume_step, "; ".join(notes))
  dropped_after = len(entries) - len([1 for _, r in entries if r["step"] <= resume_step])
  if dropped_after:
    logger.info(
      "%s: resuming after step %d, dropping %d record(s) of later steps",
      path,
      resume_step,
      dropped_after,
    )
  if notes or dropped_after or not path.exists():
    files.write_atomic(path, b"".join(line for line, _ in kept))
  return still_lost
