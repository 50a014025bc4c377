"""Host: grain-style random-access data (``__len__``, ``__getitem__``) as a Trainer source.

Plain Python and NumPy; nothing here is traced.

:class:`GrainSource` wraps anything that maps a record index to an example
(a ``grain.MapDataset`` such as ``grain.MapDataset.source(tfds.data_source(
...)).map(decode)``, a ``tfds.data_source``, a list) and serves it through the
source contract of :mod:`simigrad_jax.data.sources` (``len``,
``element_spec``, ``get_batch(indices)``). In a one-process run the Trainer
reads its training rows through :meth:`GrainSource.reader` instead: a
:class:`~simigrad_jax.data.stream_reader.StreamReader` whose grain worker
processes read, decode and augment the examples ahead, in the order of the
run's :class:`~simigrad_jax.data.sampler.EpochSampler`. SimiGrad takes the
next examples of that order whatever the batch size, so the workers can run
ahead without knowing the next batch size, and the reader's position is the
sampler's ``examples_seen``, which every checkpoint holds: a resume needs no
iterator state.

Each stream position ``p`` (the ``p``-th example the run trains on) is read
from record ``sampler order[p]`` and, with an ``augment`` function, augmented
with a NumPy generator seeded by ``(seed, p)``: the same pixels whatever the
number of workers, and again after a resume.

A record that cannot be read or decoded (a corrupt or truncated JPEG), or
whose arrays differ in shape or dtype from ``element_spec``, raises
:class:`BadRecordError` naming its index; with ``on_bad_record="skip"`` its row
takes the next readable record instead, and the bad one is counted
(:attr:`GrainSource.bad_records`) and logged.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from simigrad_jax import validation
from simigrad_jax.data.record_reader import Augment
from simigrad_jax.data.record_reader import BadRecordError
from simigrad_jax.data.record_reader import ElementSpec
from simigrad_jax.data.record_reader import RecordReader
from simigrad_jax.data.record_reader import as_arrays
from simigrad_jax.data.record_reader import spec_of
from simigrad_jax.data.sources import check_indices
from simigrad_jax.data.stream_reader import StreamReader

__all__ = ["BadRecordError", "GrainSource", "as_source", "default_num_workers"]

BAD_RECORD_POLICIES = ("raise", "skip")
_logger = logging.getLogger("simigrad_jax")


def default_num_workers() -> int:
  """The available cores minus one (the training process's), at least 0.

  Example:
    >>> default_num_workers() >= 0
    True
  """
  try:
    cores = len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    cores = os.cpu_count() or 1
  return max(cores - 1, 0)


class GrainSource:
  """Any grain-style random-access data as a Trainer source, read ahead in grain worker processes.

  Args:
    data: maps a record index in ``[0, len(data))`` to an example, a mapping
      of feature name to array (or a value ``np.asarray`` takes): a
      ``grain.MapDataset``, a ``tfds.data_source``, a list... It must be
      picklable for ``num_workers > 0`` (grain's workers are spawned).
    element_spec: ``{name: (shape, dtype)}`` of one example (after
      ``augment``); None: taken from record 0. Every record must match it.
    augment: optional ``augment(example, rng) -> example``, applied to the
      training stream only (not to :meth:`get_batch`, e.g. evaluation);
      ``rng`` is a NumPy generator seeded by the run's seed and the example's
      stream position. Must be picklable (a module-level function).
    num_workers: grain worker processes that read ahead for the Trainer; 0
      reads in the training process. Default: :func:`default_num_workers`.
    buffer_size: examples each worker decodes ahead (and holds), >= 1.
    read_threads: threads each worker reads records with (I/O overlap), >= 0.
    on_bad_record: ``"raise"`` (default): a bad record raises
      :class:`BadRecordError` naming its index; ``"skip"``: its row takes the
      next readable record, and it is counted and logged.
    num_threads: threads :meth:`get_batch` reads with in the training process.

  Example:
    >>> data = [{"x": np.full(2, i, np.float32), "y": i % 3} for i in range(6)]
    >>> source = GrainSource(data, num_workers=0)
    >>> len(source), source.element_spec["x"]
    (6, ((2,), dtype('float32')))
    >>> source.get_batch(np.array([4, -1]))["y"].tolist()
    [1, 0]
  """

  def __init__(
    self,
    data: Any,
    *,
    element_spec: Mapping[str, tuple[Any, Any]] | None = None,
    augment: Augment | None = None,
    num_workers: int | None = None,
    buffer_size: int = 64,
    read_threads: int = 2,
    on_bad_record: str = "raise",
    num_threads: int = 8,
  ):
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
      raise ValueError(f"data must be random-access (__len__, __getitem__), got {data!r:.200}")
    self._length = validation.check_int("len(data)", len(data), 1)
    if on_bad_record not in BAD_RECORD_POLICIES:
      raise ValueError(
        f"on_bad_record={on_bad_record!r} is not valid; choose one of {BAD_RECORD_POLICIES}"
      )
    if augment is not None and not callable(augment):
      raise ValueError(f"augment must be None or callable, got {augment!r:.200}")
    self.num_workers = validation.check_int(
      "num_workers", default_num_workers() if num_workers is None else num_workers, 0
    )
    self.buffer_size = validation.check_int("buffer_size", buffer_size, 1)
    self.read_threads = validation.check_int("read_threads", read_threads, 0)
    num_threads = validation.check_int("num_threads", num_threads, 1)
    self.data, self.augment, self.on_bad_record = data, augment, on_bad_record
    if element_spec is None:
      first = as_arrays(data[0])
      self._record_spec: ElementSpec | None = spec_of(first)
      spec = (
        self._record_spec
        if augment is None
        else spec_of(as_arrays(augment(first, np.random.default_rng(0))))
      )
    else:  # records of any shape (augment makes them fixed); checked after augment
      spec = {
        name: (tuple(shape), np.dtype(dtype)) for name, (shape, dtype) in element_spec.items()
      }
      self._record_spec = None if augment is not None else spec
    if not spec:
      raise ValueError("element_spec must name at least one feature")
    self._spec: ElementSpec = spec
    self.bad_records: list[int] = []
    self._pool = concurrent.futures.ThreadPoolExecutor(
      num_threads, thread_name_prefix="grain-source"
    )

  def __len__(self) -> int:
    return self._length

  def __repr__(self) -> str:
    return f"GrainSource({self._length} examples, {self.num_workers} workers, {self.element_spec})"

  @property
  def element_spec(self) -> ElementSpec:
    """The shape and dtype of one example of each feature."""
    return dict(self._spec)

  def record_reader(self) -> RecordReader:
    """The picklable function that reads one record (without ``augment``)."""
    return RecordReader(self.data, self._record_spec, self.on_bad_record)

  def note_bad_records(self, bad: list[int], where: str) -> None:
    """Counts and logs records skipped under ``on_bad_record="skip"``."""
    for index in bad:
      self.bad_records.append(int(index))
      _logger.warning(
        "skipped bad record %d (%s); %d skipped so far", index, where, len(self.bad_records)
      )

  def get_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    """Returns the records at ``indices`` (no ``augment``), with zero rows for ``-1``.

    Args:
      indices: integer array of any shape; entries in ``[0, len(self))``, or
        ``-1`` for a padding row.

    Returns:
      ``{name: array}`` with shape ``indices.shape + element shape``.

    Raises:
      BadRecordError: for a bad record under ``on_bad_record="raise"``.
      IndexError: for an index outside ``[0, len(self))`` other than ``-1``.
    """
    shape = np.shape(indices)
    flat, pad = check_indices(indices, self._length)
    read = self.record_reader()
    if read.spec is None:
      raise ValueError(
        "get_batch needs fixed-shape records: this source's records take their "
        "shape from augment, which get_batch does not apply"
      )
    spec = read.spec
    rows = np.flatnonzero(~pad)
    batch = {name: np.zeros((len(flat),) + s, d) for name, (s, d) in spec.items()}
    for row, (example, bad) in zip(rows, self._pool.map(read, flat[rows].tolist()), strict=True):
      self.note_bad_records(bad, "get_batch")
      for name in spec:
        batch[name][row] = example[name]
    return {name: a.reshape(shape + a.shape[1:]) for name, a in batch.items()}

  def reader(self, sampler: Any) -> Any:
    """A reader of the run's example stream in ``sampler``'s order, decoded ahead in workers.

    Args:
      sampler: the run's :class:`~simigrad_jax.data.sampler.EpochSampler`
        (its order only; it is not advanced).

    Returns:
      A :class:`~simigrad_jax.data.stream_reader.StreamReader`; close it.
    """
    return StreamReader(self, sampler)

  def close(self) -> None:
    """Stops the threads of :meth:`get_batch`."""
    self._pool.shutdown(wait=True)


def as_source(source: Any) -> Any:
  """``source`` itself if it has the source contract, else a :class:`GrainSource` of it.

  Args:
    source: a source (``len``, ``element_spec``, ``get_batch``), or any
      grain-style random-access data (``__len__``, ``__getitem__``).

  Returns:
    A source for the Trainer.

  Example:
    >>> as_source([{"x": np.zeros(3)}] * 4).element_spec
    {'x': ((3,), dtype('float64'))}
  """
  if hasattr(source, "get_batch") or not (
    hasattr(source, "__len__") and hasattr(source, "__getitem__")
  ):
    return source
  if isinstance(source, (str, bytes, Mapping)):
    return source  # refused by the Trainer's check, with its message
  return GrainSource(source)
