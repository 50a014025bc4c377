"""Host: per-step metrics to a JSON-lines file and TensorBoard.

Plain Python; nothing here is traced. A training loop writes one record per
optimizer step (and one per evaluation) with :class:`MetricsWriter`; every
number the controller decided from belongs in it, so that a run can be
explained afterwards from ``metrics.jsonl`` alone (:mod:`simigrad_jax.plot`
draws it).

The file format is one JSON object per line, each with an integer ``"step"``.
JSON has no NaN or infinity: non-finite floats are written as ``null`` (the
TensorBoard scalar keeps the real value). Each line is written in one call and
flushed, so a crash loses at most the line being written; such a torn last
line is dropped when the file is read or reopened.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import pathlib
import time
from collections.abc import Mapping
from typing import Any, TextIO

import numpy as np

from simigrad_jax import files
from simigrad_jax import validation
from simigrad_jax.checkpoint import metrics_recovery

logger = logging.getLogger("simigrad_jax")

__all__ = ["METRICS_FILENAME", "MetricsWriter", "read_metrics"]

METRICS_FILENAME = "metrics.jsonl"
TENSORBOARD_DIRNAME = "tensorboard"


# ------------------------------------------------------------------ file format


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
  """Returns the records of a metrics file in order, skipping a torn last line.

  Args:
    path: a JSON-lines file, e.g. the ``metrics.jsonl`` of a
      :class:`MetricsWriter`.

  Returns:
    One dict per line. Non-finite floats were written as JSON ``null`` and
    come back as None.

  Raises:
    FileNotFoundError: if ``path`` does not exist.
    ValueError: if a line other than an unterminated last one is not a JSON
      object with an integer ``"step"`` (the message names the line).

  Example:
    >>> with MetricsWriter(f"{workdir}/read", tensorboard=False) as writer:
    ...   writer.write({"step": 1, "loss": float("nan")})
    >>> read_metrics(f"{workdir}/read/metrics.jsonl")
    [{'step': 1, 'loss': None}]
  """
  path = pathlib.Path(path)
  data = path.read_bytes()
  entries, damaged, torn = metrics_recovery.parse_records(data)
  if damaged:
    line = data.split(b"\n")[damaged[0] - 1]
    raise ValueError(
      f"{path}: line {damaged[0]} is not a JSON object with an integer 'step': {line[:80]!r} "
      f"({len(damaged)} such line(s); a resume drops them and restores what the TensorBoard "
      f"events hold)"
    )
  if torn is not None:
    logger.warning("%s: ignoring a torn last line (%d bytes)", path, len(torn))
  return [record for _, record in entries]


def _to_json(value: Any, where: str) -> Any:
  """``value`` as plain JSON data; non-finite floats become None."""
  if value is None or isinstance(value, str):
    return value
  if validation.is_bool(value):
    return bool(value)
  if validation.is_int(value):
    return int(value)
  if validation.is_real(value):
    value = float(value)
    return value if math.isfinite(value) else None
  if isinstance(value, Mapping):
    out = {}
    for key, item in value.items():
      if not isinstance(key, str):
        raise TypeError(f"{where} has a non-string key {key!r}; JSON keys are strings")
      out[key] = _to_json(item, f"{where}[{key!r}]")
    return out
  if isinstance(value, (list, tuple)):
    return [_to_json(item, f"{where}[{i}]") for i, item in enumerate(value)]
  if hasattr(value, "__array__"):  # NumPy and JAX arrays
    array = np.asarray(value)
    if array.dtype.kind in "biuf":
      return _to_json(array.item() if array.ndim == 0 else array.tolist(), where)
  raise TypeError(
    f"{where} must be JSON data (numbers, strings, None, lists, dicts), "
    f"got {value!r} ({type(value).__name__})"
  )


# ----------------------------------------------------------------------- writer


def tensorboard_available(wanted: bool | None = None) -> bool:
  """Whether TensorBoard event files can be written (tensorboardX is installed).

  Args:
    wanted: None (write them if tensorboardX is installed), True (they must
      be: raise if it is not) or False.

  Returns:
    Whether to write them.

  Raises:
    ModuleNotFoundError: ``wanted`` is True and tensorboardX is not installed.

  Example:
    >>> tensorboard_available(False)
    False
  """
  if wanted is False:
    return False
  installed = importlib.util.find_spec("tensorboardX") is not None
  if wanted and not installed:
    raise ModuleNotFoundError(
      "tensorboard=True needs tensorboardX, which is not installed: pip install "
      "'simigrad-jax[tensorboard]' (or leave tensorboard=None to write event files only when "
      "it is installed)",
      name="tensorboardX",
    )
  return installed


class MetricsWriter:
  """Writes one JSON object per line to <workdir>/metrics.jsonl and the numeric values to TensorBoard event files.

  Every top-level numeric value of a record (bool, int, float, NumPy or 0-d
  JAX scalar; finite or not) other than ``"step"`` also becomes a TensorBoard
  scalar with the key as its tag and ``"step"`` as its step. Other values
  (strings, lists, dicts, None) go to the JSON file only. Non-finite floats
  are written to the file as ``null``, since JSON has no NaN.

  Args:
    workdir: the run's folder, created if missing. The records go to
      ``<workdir>/metrics.jsonl`` (appended to, never truncated unless
      resuming) and the event files to ``<workdir>/tensorboard``.
    tensorboard: whether to write TensorBoard event files (with tensorboardX,
      which the ``tensorboard`` and ``train`` extras install). None: when
      tensorboardX is installed; True: raise if it is not.
    resume_step: for a run resumed from a checkpoint taken after step
      ``resume_step``: records with a larger step are first removed from the
      file (atomically: a synced temporary file replaces it), so the steps
      that are run again are not logged twice; TensorBoard is told to hide
      its own events from step ``resume_step + 1`` on (``purge_step``).
      Damaged lines are dropped and the records they held restored from the
      event files where those hold them
      (:mod:`simigrad_jax.checkpoint.metrics_recovery`).
    enabled: False makes a writer that checks records but writes nothing and
      creates no files (for processes other than 0 in a multi-host run).

  Attributes:
    missing_steps: on resume, the steps up to ``resume_step`` that have no
      record left (neither the file nor the events hold one), as
      ``[first, last]`` ranges; empty otherwise.

  Raises:
    ValueError: for a bad setting.
    UnsafePathError: the file or the TensorBoard folder is a symlink.

  Example:
    >>> with MetricsWriter(f"{workdir}/run", tensorboard=False) as writer:
    ...   writer.write({"step": 1, "batch_size": 128, "similarity": 0.05})
    ...   writer.write({"step": 2, "batch_size": 140, "similarity": 0.12})
    >>> [r["batch_size"] for r in read_metrics(writer.path)]
    [128, 140]

  Note:
    A torn last line left by a crash is dropped when the file is reopened, so
    appending never glues a new record onto half an old one. Lines are
    flushed, not synced: a process crash loses at most the line being
    written, a power loss what the OS had not yet written.
  """

  def __init__(
    self,
    workdir: str | os.PathLike,
    *,
    tensorboard: bool | None = None,
    resume_step: int | None = None,
    enabled: bool = True,
  ):
    tensorboard = tensorboard_available(
      None if tensorboard is None else validation.check_bool("tensorboard", tensorboard)
    )
    self._enabled = validation.check_bool("enabled", enabled)
    self._resume_step = (
      None if resume_step is None else validation.check_int("resume_step", resume_step, 0)
    )
    self._workdir = pathlib.Path(workdir)
    self._path = self._workdir / METRICS_FILENAME
    self._file: TextIO | None = None
    self._tensorboard = None
    self._closed = False
    self.missing_steps: list[list[int]] = []
    if not self._enabled:
      return
    self._workdir.mkdir(parents=True, exist_ok=True)
    events = self._workdir / TENSORBOARD_DIRNAME
    self.missing_steps = metrics_recovery.prepare_for_append(self._path, self._resume_step, events)
    self._file = files.open_for_append(self._path)
    if tensorboard:
      try:
        import tensorboardX  # pylint: disable=g-import-not-at-top
        from tensorboardX.proto import summary_pb2  # pylint: disable=g-import-not-at-top

        self._summary = summary_pb2.Summary
        # tensorboardX names event files by the second and host; the suffix
        # keeps a writer reopened within the same second from overwriting.
        files.make_private_dir(events, what="TensorBoard folder", allow_shared=True)
        suffix = f".{time.time_ns()}"
        self._tensorboard = tensorboardX.SummaryWriter(
          str(events),
          purge_step=None if self._resume_step is None else self._resume_step + 1,
          filename_suffix=suffix,
        )
        for made in events.glob(f"events.out.tfevents.*{suffix}"):  # its file: 0600, as ours
          if not made.is_symlink():
            made.chmod(files.PRIVATE_FILE_MODE)
      except BaseException:
        self._file.close()
        raise

  @property
  def path(self) -> pathlib.Path:
    """The JSON-lines file, ``<workdir>/metrics.jsonl``."""
    return self._path

  @property
  def enabled(self) -> bool:
    """Whether this writer writes anything."""
    return self._enabled

  def write(self, record: Mapping[str, Any]) -> None:
    """Appends one record to the file (flushed) and its numbers to TensorBoard.

    Args:
      record: a mapping with string keys and an integer ``"step"`` >= 0; the
        values are JSON data (numbers, strings, None, lists, dicts) or NumPy /
        JAX arrays of numbers.

    Raises:
      ValueError: if ``"step"`` is missing or not an integer >= 0.
      TypeError: for a record that is not a mapping, a non-string key or a
        value that is not JSON data (the message names it).
      RuntimeError: if the writer was closed.
    """
    if not isinstance(record, Mapping):
      raise TypeError(f"record must be a mapping, got {record!r} ({type(record).__name__})")
    if "step" not in record:
      raise ValueError(f"record must have an integer 'step', got keys {sorted(map(str, record))}")
    step = validation.check_int("record['step']", record["step"], 0)
    data = _to_json(record, "record")
    data["step"] = step
    line = json.dumps(data, allow_nan=False) + "\n"
    if self._closed:
      raise RuntimeError(f"MetricsWriter for {self._path} is closed")
    if self._file is None:  # not enabled
      return
    try:
      self._file.write(line)
      self._file.flush()
    except OSError as error:  # (a full disk's flush names no file: this error does)
      raise OSError(error.errno, error.strerror, str(self._path)) from error
    if self._tensorboard is not None:
      # One Summary holding every scalar of the record: a tenth of the cost of one
      # add_scalar call per key, and the same events for TensorBoard's readers.
      numbers = (
        (key, None if key == "step" else validation.as_float(value))
        for key, value in record.items()
      )
      values = [
        self._summary.Value(tag=key, simple_value=number)
        for key, number in numbers
        if number is not None
      ]
      if values:
        self._tensorboard._get_file_writer().add_summary(  # pylint: disable=protected-access
          self._summary(value=values), step
        )

  def flush(self) -> None:
    """Pushes pending TensorBoard events and file contents to the OS."""
    if self._file is not None and not self._closed:
      self._file.flush()
    if self._tensorboard is not None and not self._closed:
      self._tensorboard.flush()

  def close(self) -> None:
    """Flushes and closes the file and the event writer; safe to call twice."""
    if self._closed:
      return
    self._closed = True
    try:
      if self._tensorboard is not None:
        self._tensorboard.close()
    finally:
      if self._file is not None:
        self._file.close()

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc_info: object) -> None:
    self.close()
