"""Host: the run's example stream, read and decoded ahead by grain worker processes.

Plain Python and NumPy; nothing here is traced.

The stream is the endless sequence of examples of an
:class:`~simigrad_jax.data.sampler.EpochSampler` (epoch after epoch); its
position ``p`` is the number of examples served before. A grain pipeline
``MapDataset.range(...).map(chunk).to_iter_dataset().mp_prefetch()`` reads
position after position from ``start``, a few consecutive positions per
element (:class:`StreamChunk`); its workers decode ahead of
what the Trainer asked for, whatever batch size it asks for next. The data
thread asks for a window of positions per step (the step's rows and the
speculative ones of a grow, :mod:`simigrad_jax.data.data_loader`); windows only
move forward, and overlap by the speculative rows, so the reader keeps the
examples from the start of the last window on. A window that starts before
what the reader still holds, or far ahead of it (the first window, a resume),
restarts the pipeline there: its position comes from the sampler, so a resume
needs no iterator state.

A worker that dies makes grain raise within about a second; the reader then
closes its pipeline and re-raises. A worker whose training process died (a
SIGKILL closes nothing) ends itself within a second. Pipelines are closed by :meth:`StreamReader.close`,
and at interpreter exit for any reader left open (an open grain iterator
otherwise leaves tracebacks and shared memory behind).
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
import threading
import time
import weakref
from typing import Any, Protocol

import numpy as np

from simigrad_jax.data import record_reader
from simigrad_jax.data.sampler import EpochSampler

__all__ = ["StreamChunk", "StreamElement", "StreamReader", "StreamSource"]

POSITION_KEY = "__simigrad_stream_position__"
BAD_KEY = "__simigrad_bad_records__"
# A window starting this many positions (or one window) past the reader's next position
# restarts the pipeline there rather than reading through the gap.
_MAX_GAP = 4096
_STREAM_SPAN = 1 << 50  # positions a pipeline covers (never reached)
_PARENT_POLL_SECONDS = 0.5
_CHUNK = 8  # positions a worker decodes and hands over at once
_open_readers: weakref.WeakSet = weakref.WeakSet()


class StreamSource(Protocol):
  """What a :class:`StreamReader` reads of its source: a
  :class:`~simigrad_jax.data.grain_source.GrainSource` is one."""

  num_workers: int  # grain worker processes (0: decode in this process)
  buffer_size: int  # examples each worker decodes ahead
  read_threads: int  # threads each worker reads records with
  augment: record_reader.Augment | None  # optional augment(example, rng)

  @property
  def element_spec(self) -> record_reader.ElementSpec: ...

  def record_reader(self) -> record_reader.RecordReader: ...

  def note_bad_records(self, bad: list[int], where: str) -> None: ...


class _Pipeline(Protocol):
  """grain's iterator over a pipeline's chunks; closing it stops the worker processes."""

  def __next__(self) -> dict[str, Any]: ...

  def close(self) -> None: ...


class StreamElement:
  """Position ``p`` of the stream: the record at the sampler's ``p``-th index, augmented.

  Picklable; runs in grain's worker processes (or in the training process
  with no workers).

  Args:
    read: reads a record (a :class:`~simigrad_jax.data.record_reader.RecordReader`).
    augment: optional ``augment(example, rng)``; ``rng`` is seeded by
      ``(seed, p)``.
    spec: the element spec the augmented example must match.
    num_examples, seed, shuffle: the sampler's settings (its order).
  """

  def __init__(
    self,
    read: record_reader.RecordReader,
    augment: record_reader.Augment | None,
    spec: record_reader.ElementSpec,
    num_examples: int,
    seed: int,
    shuffle: bool,
  ):
    self.read, self.augment, self.spec = read, augment, spec
    self.order = (num_examples, seed, shuffle)
    self._sampler: EpochSampler | None = None

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_sampler"] = None  # each process draws its own permutations
    return state

  def __call__(self, position: int) -> dict[str, Any]:
    position = int(position)
    if self._sampler is None:
      num_examples, seed, shuffle = self.order
      self._sampler = EpochSampler(num_examples, seed, shuffle=shuffle)
    index = int(self._sampler.indices_at(position, 1)[0])
    example, bad = self.read(index)
    if self.augment is not None:
      rng = np.random.default_rng([self.order[1], position])
      example = {k: np.asarray(v) for k, v in self.augment(example, rng).items()}
      got = {k: (v.shape, v.dtype) for k, v in example.items()}
      if got != self.spec:
        raise ValueError(
          f"augment made record {index} (stream position {position}) into "
          f"{got}, but the element spec is {self.spec}"
        )
    return {**example, POSITION_KEY: np.int64(position), BAD_KEY: bad}


class StreamChunk:
  """Chunk ``c`` of a pipeline from ``first``: positions ``first + c * size ...``, stacked.

  Workers hand over one chunk of rows at a time: one shared-memory transfer
  and one copy per feature and chunk, not per example.

  Args:
    element: the :class:`StreamElement`.
    first: the pipeline's first position.
    size: positions per chunk.
  """

  def __init__(self, element: StreamElement, first: int, size: int):
    self.element, self.first, self.size = element, first, size

  def __call__(self, chunk: int) -> dict[str, Any]:
    start = self.first + int(chunk) * self.size
    rows = [self.element(p) for p in range(start, start + self.size)]
    out: dict[str, Any] = {
      name: np.stack([row[name] for row in rows]) for name in self.element.spec
    }
    out[POSITION_KEY] = np.arange(start, start + self.size, dtype=np.int64)
    out[BAD_KEY] = [(int(row[POSITION_KEY]), row[BAD_KEY]) for row in rows if row[BAD_KEY]]
    return out


class StreamReader:
  """Serves windows of stream positions, decoded ahead by grain worker processes.

  The worker processes start at once, reading from the sampler's position.

  Args:
    source: a :class:`StreamSource`, such as the
      :class:`~simigrad_jax.data.grain_source.GrainSource` that makes this
      reader (its data, ``augment``, spec, worker and buffer settings,
      bad-record policy).
    sampler: the run's sampler (its order, and where to start reading).

  Example:
    >>> data = [{"x": np.array([i])} for i in range(5)]
    >>> from simigrad_jax.data.grain_source import GrainSource
    >>> source = GrainSource(data, num_workers=0)
    >>> with StreamReader(source, EpochSampler(5, seed=0, shuffle=False)) as reader:
    ...   reader.read(np.array([4, 5, 6]))["x"][:, 0].tolist()
    [4, 0, 1]
  """

  def __init__(self, source: StreamSource, sampler: EpochSampler):
    self._source = source
    self._spec = source.element_spec
    self._element = StreamElement(
      source.record_reader(),
      source.augment,
      self._spec,
      sampler.num_examples,
      sampler.seed,
      sampler.shuffle,
    )
    self._iterator: _Pipeline | None = None
    self._next = 0  # the position the pipeline yields next
    self._buffer: dict[int, dict[str, np.ndarray]] = {}
    self._lock = threading.Lock()
    self._closed = False
    self.restarts = 0  # pipelines started (the first one included)
    _open_readers.add(self)
    if source.num_workers:  # the workers start (seconds) while the Trainer compiles
      self._start(sampler.examples_seen)

  def __enter__(self) -> StreamReader:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()

  def read(self, positions: np.ndarray) -> dict[str, np.ndarray]:
    """Returns the examples at stream ``positions`` (ascending), one row each.

    Args:
      positions: int array of positions ``>= 0``, in ascending order (a
        window, or this process's rows of one).

    Returns:
      ``{name: array}`` of shape ``(len(positions),) + element shape``.

    Raises:
      BadRecordError: for a bad record under ``on_bad_record="raise"``.
      RuntimeError: when a worker process died, or the reader is closed.
    """
    positions = np.asarray(positions, np.int64).reshape(-1)
    if positions.size and (positions[0] < 0 or np.any(np.diff(positions) <= 0)):
      raise ValueError(f"positions must be ascending and >= 0, got {positions[:8].tolist()}...")
    with self._lock:
      if self._closed:
        raise RuntimeError("the stream reader is closed")
      try:
        examples = self._examples(positions)
      except BaseException:
        self._close_pipeline()
        raise
    batch = {
      name: np.empty((len(positions),) + shape, dtype)
      for name, (shape, dtype) in self._spec.items()
    }
    for row, example in enumerate(examples):
      for name in batch:
        batch[name][row] = example[name]
    return batch

  def _examples(self, positions: np.ndarray) -> list[dict[str, np.ndarray]]:
    if not positions.size:
      return []
    if self._source.num_workers == 0:
      return [self._keep(self._element(p)) for p in positions]
    first, last = int(positions[0]), int(positions[-1])
    self._buffer = {p: e for p, e in self._buffer.items() if p >= first}
    missing = any(p < self._next and p not in self._buffer for p in positions)
    iterator = self._iterator
    if iterator is None or missing or first > self._next + max(_MAX_GAP, len(positions)):
      iterator = self._start(first)
    while self._next <= last:
      chunk = next(iterator)
      first_position = int(chunk[POSITION_KEY][0])
      if first_position != self._next:
        raise RuntimeError(
          f"the grain pipeline yielded stream position {first_position}, expected {self._next}"
        )
      for position, bad in chunk[BAD_KEY]:
        self._source.note_bad_records(bad, f"stream position {position}")
      rows = {name: np.array(chunk[name]) for name in self._spec}  # out of shared memory
      for row in range(len(chunk[POSITION_KEY])):
        self._buffer[self._next] = {name: rows[name][row] for name in self._spec}
        self._next += 1
    return [self._buffer[int(p)] for p in positions]

  def _keep(self, element: dict[str, Any]) -> dict[str, np.ndarray]:
    """An element read in this process, its skipped records counted."""
    if element[BAD_KEY]:
      self._source.note_bad_records(
        element[BAD_KEY], f"stream position {int(element[POSITION_KEY])}"
      )
    return {name: element[name] for name in self._spec}

  def _start(self, first: int) -> _Pipeline:
    """Starts a pipeline that yields positions ``first, first + 1, ...``; returns it."""
    import grain  # pylint: disable=import-outside-toplevel
    from absl import flags  # pylint: disable=import-outside-toplevel

    if not flags.FLAGS.is_parsed():  # grain's workers read absl flags
      flags.FLAGS.mark_as_parsed()
    self._close_pipeline()
    chunk = min(_CHUNK, self._source.buffer_size)
    chunks = max(self._source.buffer_size // chunk, 1)  # each worker's read-ahead, in chunks
    dataset = grain.MapDataset.range(_STREAM_SPAN).map(StreamChunk(self._element, first, chunk))
    iter_dataset = dataset.to_iter_dataset(
      grain.ReadOptions(num_threads=self._source.read_threads, prefetch_buffer_size=chunks)
    )
    iter_dataset = iter_dataset.mp_prefetch(
      grain.MultiprocessingOptions(
        num_workers=self._source.num_workers, per_worker_buffer_size=chunks
      ),
      worker_init_fn=functools.partial(exit_with_parent, os.getpid()),
    )
    self._iterator = iterator = iter(iter_dataset)
    self._next = first
    self.restarts += 1
    _close_at_exit()
    return iterator

  def _close_pipeline(self) -> None:
    iterator, self._iterator = self._iterator, None
    self._buffer = {}
    if iterator is not None:
      iterator.close()
      del iterator
      gc.collect()  # grain's inner iterators sit in reference cycles; end them now, not at exit

  def close(self) -> None:
    """Stops the worker processes and frees their shared memory. Idempotent."""
    with self._lock:
      self._closed = True
      self._close_pipeline()
    _open_readers.discard(self)


def exit_with_parent(parent: int, worker: int, num_workers: int) -> None:
  """Runs in each worker: ends it within a second of the training process's death.

  A training process killed by SIGKILL closes nothing; its workers would
  otherwise live on, blocked on a full queue, holding its output pipes open.
  """
  del worker, num_workers

  def watch():
    while os.getppid() == parent:
      time.sleep(_PARENT_POLL_SECONDS)
    os._exit(1)  # pylint: disable=protected-access

  threading.Thread(target=watch, name="simigrad-parent-watch", daemon=True).start()


def _close_open_readers() -> None:
  for reader in list(_open_readers):
    reader.close()


@functools.cache
def _close_at_exit() -> None:
  """Closes open readers at exit, before multiprocessing's own exit handler ends the workers.

  Exit handlers run last-registered first, so this registers once a pipeline
  exists (multiprocessing registers its handler when grain starts); closing
  after it would leave the workers' queued shared memory behind.
  """
  atexit.register(_close_open_readers)
