"""Host: reads one record of random-access data as a dict of arrays, under a bad-record policy.

Plain Python and NumPy; nothing here is traced. Used in the training process
(:meth:`~simigrad_jax.data.grain_source.GrainSource.get_batch`) and in grain's
worker processes (:class:`~simigrad_jax.data.stream_reader.StreamReader`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from simigrad_jax.errors import SimiGradError

__all__ = ["Augment", "BadRecordError", "ElementSpec", "RecordReader", "as_arrays", "spec_of"]

ElementSpec = dict[str, tuple[tuple[int, ...], np.dtype]]
Augment = Callable[[dict[str, np.ndarray], np.random.Generator], Mapping[str, Any]]
# Records tried after a bad one (skip) before giving up: a run of this many is a broken data set.
_MAX_SUBSTITUTES = 100


class BadRecordError(SimiGradError, ValueError):
  """A record could not be read or decoded, or does not match the element spec.

  Attributes:
    index: the record's index in the data.
  """

  def __init__(self, index: int, message: str):
    super().__init__(message)
    self.index = index

  def __reduce__(self):  # raised in a grain worker process, re-raised in the training process
    return (BadRecordError, (self.index, str(self)))


def as_arrays(record: Any) -> dict[str, np.ndarray]:
  if not isinstance(record, Mapping):
    raise TypeError(
      f"a record must be a mapping of feature name to array, got {type(record).__name__}"
    )
  return {name: np.asarray(value) for name, value in record.items()}


def spec_of(example: Mapping[str, np.ndarray]) -> ElementSpec:
  return {name: (value.shape, value.dtype) for name, value in example.items()}


class RecordReader:
  """Reads record ``index`` as a dict of arrays of the element spec, under a bad-record policy.

  Picklable (it travels to grain's worker processes) when ``data`` is.

  Args:
    data: the random-access data (``__len__``, ``__getitem__``).
    spec: the element spec every record must match (None: any shapes).
    on_bad_record: ``"raise"`` or ``"skip"`` (take the next readable record).
  """

  def __init__(self, data: Any, spec: ElementSpec | None, on_bad_record: str):
    self.data, self.spec, self.on_bad_record = data, spec, on_bad_record

  def _one(self, index: int) -> dict[str, np.ndarray]:
    try:
      example = as_arrays(self.data[index])
    except Exception as error:  # pylint: disable=broad-except
      raise BadRecordError(
        index, f"record {index} could not be read or decoded: {type(error).__name__}: {error}"
      ) from error
    if self.spec is not None and spec_of(example) != self.spec:
      raise BadRecordError(
        index,
        f"record {index} has features {spec_of(example)}, expected "
        f"{self.spec} (the element spec, from record 0 unless given)",
      )
    return example

  def __call__(self, index: int) -> tuple[dict[str, np.ndarray], list[int]]:
    """``(example, the bad records skipped to read it)``; raises BadRecordError under "raise"."""
    bad: list[int] = []
    for attempt in range(_MAX_SUBSTITUTES + 1):
      candidate = (index + attempt) % len(self.data)
      try:
        return self._one(candidate), bad
      except BadRecordError:
        if self.on_bad_record == "raise":
          raise
        bad.append(candidate)
    raise BadRecordError(
      index,
      f"records {bad[0]}..{bad[-1]}: {len(bad)} bad records in a row "
      f"from record {index}; the data set looks broken",
    )
