"""Host: random-access data sources that serve any batch of example indices.

Plain Python and NumPy; nothing here is traced.

A source maps global example indices (from :class:`~simigrad_jax.data.sampler.
EpochSampler`, laid out by a :class:`~simigrad_jax.shapes.batch_plan.BatchPlan`)
to arrays. Every source has the same small contract:

* ``len(source)``: the number of examples;
* ``source.element_spec``: ``{name: (shape, dtype)}`` of one example;
* ``source.get_batch(indices)``: ``{name: array}`` with shape
  ``indices.shape + shape``; an index of ``-1`` marks a padding row and gets
  an all-zero row (its weight 0 is the caller's business).

:class:`ArraySource` holds NumPy arrays in memory. :class:`TfdsSource` reads a
TFDS data set through ``tfds.data_source`` (ArrayRecord files, random access),
which works without TensorFlow. What we measured with TFDS 4.9.10 and no
TensorFlow installed:

* ``tfds.data_source(name, split=..., data_dir=..., download=False)`` opens an
  ArrayRecord copy; ``ds[i]`` returns a dict of NumPy arrays (images decoded
  with Pillow), Python ints for ``ClassLabel`` and ``bytes`` for ``Text``;
  ``ds.__getitems__(keys)`` reads several records at once; split slices such
  as ``"train[:90%]"`` are honoured; an index outside ``[0, len)`` raises.
* Under ``tfds.testing.mock_data`` the same call returns random records of the
  right shapes (``ClassLabel`` as 0-d int64 arrays, ``Text`` as ``str``);
  ``ds[i]`` works but ``ds.__getitems__`` raises ``TypeError``, any split name
  (and slice) gives the same ``num_examples`` records, and an index past the
  end still returns a record: we check the range ourselves.
* Preparing a data set needs TensorFlow whenever a feature is encoded with it
  (``Image``, hence the official mnist and cifar10 builders); a builder with
  only ``Tensor``, ``ClassLabel`` and ``Text`` features prepares ArrayRecord
  files without it.
* With ``download=False`` and no prepared copy, ``tfds.data_source`` raises
  ``NotImplementedError`` at once (it reports the missing files as an
  unsupported TFRECORD format); with ``download=True`` and no network it
  retries downloads for a long time.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from simigrad_jax import validation

__all__ = ["ArraySource", "TfdsSource", "load_source"]

ElementSpec = dict[str, tuple[tuple[int, ...], np.dtype]]
# "tfds:" NAME (optionally ":X.Y.Z", a version) ":" SPLIT (may hold colons).
_TFDS_SPEC = re.compile(r"tfds:(?P<name>[^:\[\]]+?(?::\d+\.\d+\.\d+)?):(?P<split>.+)")


def check_indices(indices: Any, length: int) -> tuple[np.ndarray, np.ndarray]:
  """Returns ``(flat int64 indices, flat padding mask)`` after checking them.

  Raises:
    ValueError: if the indices are not integers.
    IndexError: if one is outside ``[0, length)`` and not ``-1``.
  """
  idx = np.asarray(indices)
  if idx.size and idx.dtype.kind not in "iu":
    raise ValueError(
      f"indices must be integers in [0, {length}) or -1 for padding, got dtype {idx.dtype}"
    )
  flat = idx.astype(np.int64, copy=False).reshape(-1)
  bad = (flat < -1) | (flat >= length)
  if bad.any():
    raise IndexError(
      f"indices must be in [0, {length}) or -1 for padding, got {flat[bad][:8].tolist()}"
    )
  return flat, flat == -1


class ArraySource:
  """In-memory NumPy arrays (a dict of equal-length arrays) as a random-access source.

  Example ``i`` is ``{name: array[i]}``. The arrays are not copied; every
  :meth:`get_batch` returns new arrays.

  Args:
    arrays: at least one array, keyed by name; all of the same length
      ``>= 1`` along the first axis.

  Example:
    >>> source = ArraySource({"x": np.arange(6.0).reshape(3, 2),
    ...                       "y": np.array([7, 8, 9])})
    >>> len(source), source.element_spec["x"]
    (3, ((2,), dtype('float64')))
    >>> batch = source.get_batch(np.array([2, -1]))
    >>> batch["x"].tolist(), batch["y"].tolist()
    ([[4.0, 5.0], [0.0, 0.0]], [9, 0])
  """

  def __init__(self, arrays: Mapping[str, np.ndarray]):
    if not isinstance(arrays, Mapping) or not arrays:
      raise ValueError(f"arrays must be a non-empty mapping of name to array, got {arrays!r}")
    converted = {}
    for name, value in arrays.items():
      if not isinstance(name, str):
        raise ValueError(f"array names must be strings, got {name!r}")
      array = np.asarray(value)
      if array.ndim == 0:
        raise ValueError(f"array {name!r} must have a leading example axis, got a scalar")
      converted[name] = array
    lengths = {name: len(a) for name, a in converted.items()}
    if len(set(lengths.values())) != 1:
      raise ValueError(f"arrays must have equal lengths, got {lengths}")
    length = next(iter(lengths.values()))
    if length < 1:
      raise ValueError(f"arrays must hold at least 1 example, got {lengths}")
    self._arrays = converted
    self._length = length

  def __len__(self) -> int:
    return self._length

  def __repr__(self) -> str:
    return f"ArraySource({len(self)} examples, {self.element_spec})"

  @property
  def element_spec(self) -> ElementSpec:
    """The shape and dtype of one example of each array."""
    return {name: (a.shape[1:], a.dtype) for name, a in self._arrays.items()}

  def get_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    """Returns the examples at ``indices``, with zero rows for ``-1``.

    Args:
      indices: integer array of any shape; entries in ``[0, len(self))``, or
        ``-1`` for a padding row.

    Returns:
      ``{name: array}`` with shape ``indices.shape + element shape`` and the
      source's dtypes; padding rows hold zeros (empty strings for strings).

    Raises:
      ValueError: for non-integer indices.
      IndexError: for an index outside ``[0, len(self))`` other than ``-1``.
    """
    shape = np.shape(indices)
    flat, pad = check_indices(indices, self._length)
    safe = np.where(pad, 0, flat)
    batch = {}
    for name, array in self._arrays.items():
      rows = array[safe]
      if pad.any():
        rows[pad] = np.zeros((), array.dtype)
      batch[name] = rows.reshape(shape + array.shape[1:])
    return batch


def open_tfds(name: str, split: str, *, data_dir: str | None, download: bool) -> Any:
  """``tfds.data_source`` of a TFDS split, random access to its records (ArrayRecord).

  Args:
    name: the TFDS name, e.g. ``"mnist"``.
    split: a split, e.g. ``"train"``.
    data_dir: where TFDS keeps prepared data (TFDS's default if None).
    download: let TFDS download and prepare the data if it is missing.

  Returns:
    The data source: ``len()`` and ``source[i]``.

  Raises:
    FileNotFoundError: the data set is not prepared where TFDS looked; the
      message names the folder and the options (``data_dir``, ``download``).
    RuntimeError: TFDS cannot read the split by index (not prepared in
      ArrayRecord format); the message says so and quotes TFDS.

  Example:
    >>> import tensorflow_datasets as tfds
    >>> with tfds.testing.mock_data(num_examples=4):
    ...   len(open_tfds("mnist", "train", data_dir=None, download=False))
    4
  """
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

  try:
    return tfds.data_source(name, split=split, data_dir=data_dir, download=download)
  except (KeyError, NotImplementedError) as e:
    # TFDS says "splits is empty" (its default data_dir) or blames a TFRecord copy (another
    # data_dir) when nothing is prepared at all.
    folder = _unprepared_tfds_folder(tfds, name, data_dir)
    if folder is not None:
      where = "TFDS's default data_dir" if data_dir is None else f"data_dir={data_dir!r}"
      raise FileNotFoundError(
        f"TFDS has no prepared {name!r} in {folder} ({where}, download={download}): set "
        "data_dir to the folder where it is prepared in ArrayRecord format, or download=True "
        "to let TFDS download and prepare it there"
      ) from e
    if isinstance(e, KeyError):
      raise
    raise RuntimeError(
      f"TFDS could not open {name!r} split {split!r} in data_dir "
      f"{data_dir!r} for random access (download={download}); it needs the "
      f"data prepared in ArrayRecord format there. TFDS says: {e}"
    ) from e


def _unprepared_tfds_folder(tfds: Any, name: str, data_dir: str | None) -> str | None:
  """The folder where TFDS looks for ``name`` if nothing is prepared there, else None."""
  try:
    builder = tfds.builder(name, data_dir=data_dir)
    return None if builder.is_prepared() else str(builder.data_dir)
  except Exception:  # an unknown name or a broken install: TFDS's own error is the clearer one
    return None


class TfdsSource:
  """A TFDS data set read with random access through tfds.data_source (ArrayRecord; works without TensorFlow).

  Records are decoded one by one (``ds[i]``) or, where the data source
  supports it, several at once (``ds.__getitems__``); each selected feature
  is turned into a NumPy array. The shape and dtype of every feature are taken
  from record 0 and every record must match them: a data set with
  variable-sized features (ImageNet images) needs a fixed-size copy or a
  source of its own. ``Text`` features become ``object`` arrays.

  Args:
    name: the TFDS name, e.g. ``"mnist"`` or ``"cifar10:3.0.2"``.
    split: a split, e.g. ``"train"`` or ``"train[:90%]"``.
    data_dir: where TFDS keeps prepared data (TFDS's default if None).
    download: let TFDS download and prepare the data if it is missing. Use
      False offline: TFDS otherwise retries the download for a long time.
    features: the feature names to read (default: all top-level features).

  Example:
    >>> import tensorflow_datasets as tfds
    >>> with tfds.testing.mock_data(num_examples=8):
    ...   source = TfdsSource("mnist", "train", features=["image", "label"])
    >>> len(source), source.element_spec["image"]
    (8, ((28, 28, 1), dtype('uint8')))
    >>> source.get_batch(np.array([3, -1]))["image"].shape
    (2, 28, 28, 1)
  """

  def __init__(
    self,
    name: str,
    split: str,
    *,
    data_dir: str | None = None,
    download: bool = True,
    features: Sequence[str] | None = None,
  ):

    for arg, value in (("name", name), ("split", split)):
      if not isinstance(value, str) or not value:
        raise ValueError(f"{arg} must be a non-empty string, got {value!r}")
    download = validation.check_bool("download", download)
    if features is not None:
      if isinstance(features, str) or not isinstance(features, Iterable):
        chosen = None
      else:
        chosen = tuple(features)
      if not chosen or not all(isinstance(f, str) for f in chosen):
        raise ValueError(
          f"features must be None or a non-empty sequence of names, got {features!r}"
        )
      features = chosen
    self._ds = open_tfds(name, split, data_dir=data_dir, download=download)
    self._name, self._split = name, split
    self._length = len(self._ds)
    if self._length < 1:
      raise ValueError(f"TFDS {name!r} split {split!r} holds no examples")
    first = self._ds[0]
    available = sorted(first)
    names = available if features is None else list(features)
    unknown = [f for f in names if f not in first]
    if unknown:
      raise ValueError(f"features {unknown} are not in TFDS {name!r}; available: {available}")
    nested = [f for f in names if isinstance(first[f], Mapping)]
    if nested:
      raise ValueError(
        f"features {nested} of TFDS {name!r} are nested dicts; select flat features only"
      )
    self._features = tuple(names)
    self._spec: ElementSpec = {}
    self._pad: dict[str, Any] = {}
    for f in self._features:
      example = _to_numpy(first[f])
      self._spec[f] = (example.shape, example.dtype)
      self._pad[f] = type(first[f])() if isinstance(first[f], (str, bytes)) else 0
    self._batched_reads: bool | None = None  # unknown until first tried

  def __len__(self) -> int:
    return self._length

  def __repr__(self) -> str:
    return f"TfdsSource({self._name!r}, {self._split!r}, {len(self)} examples, {self.element_spec})"

  @property
  def features(self) -> tuple[str, ...]:
    """The feature names this source reads."""
    return self._features

  @property
  def element_spec(self) -> ElementSpec:
    """The shape and dtype of one example of each selected feature."""
    return dict(self._spec)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    """Record ``index``'s selected features as arrays (text: 0-d object arrays).

    With ``__len__`` this makes the source grain-style random-access data,
    e.g. for :class:`simigrad_jax.GrainSource` (it pickles into worker
    processes).

    Raises:
      IndexError: for an index outside ``[0, len(self))``.
    """
    if not validation.is_int(index) or not 0 <= int(index) < self._length:
      raise IndexError(f"index must be an int in [0, {self._length}), got {index!r}")
    record = self._ds[int(index)]
    return {f: _to_numpy(record[f]) for f in self._features}

  def get_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    """Returns the examples at ``indices``, with zero rows for ``-1``.

    Args:
      indices: integer array of any shape; entries in ``[0, len(self))``, or
        ``-1`` for a padding row.

    Returns:
      ``{name: array}`` with shape ``indices.shape + element shape``; padding
      rows hold zeros (empty strings for text).

    Raises:
      ValueError: for non-integer indices, or a record whose feature shape
        differs from record 0's.
      IndexError: for an index outside ``[0, len(self))`` other than ``-1``.
    """
    shape = np.shape(indices)
    flat, pad = check_indices(indices, self._length)
    batch = {}
    for f, (elem_shape, dtype) in self._spec.items():
      batch[f] = np.zeros((len(flat),) + elem_shape, dtype)
      if dtype.kind == "O":  # strings and bytes: padded with an empty one
        batch[f][...] = self._pad[f]
    rows = np.flatnonzero(~pad)
    for row, record in zip(rows, self._read([int(i) for i in flat[rows]]), strict=True):
      for f, (elem_shape, _) in self._spec.items():
        value = _to_numpy(record[f])
        if value.shape != elem_shape:
          raise ValueError(
            f"feature {f!r} of record {int(flat[row])} has shape "
            f"{value.shape}, but record 0 has {elem_shape}; TfdsSource needs "
            "fixed-shape features"
          )
        batch[f][row] = value[()] if value.ndim == 0 else value  # text: the str
    return {f: a.reshape(shape + a.shape[1:]) for f, a in batch.items()}

  def _read(self, keys: list[int]) -> list[Mapping[str, Any]]:
    """Reads records, several at once where the data source supports it."""
    if not keys:
      return []
    if self._batched_reads is not False:
      try:
        records = list(self._ds.__getitems__(keys))
        if len(records) == len(keys):
          self._batched_reads = True
          return records
      except Exception:  # pylint: disable=broad-except
        # e.g. TypeError under tfds.testing.mock_data: read one by one.
        if self._batched_reads:
          raise
      self._batched_reads = False
    return [self._ds[k] for k in keys]


def _to_numpy(value: Any) -> np.ndarray:
  """One feature value as an array; text becomes a 0-d object array."""
  if isinstance(value, (str, bytes)):
    out = np.empty((), object)
    out[()] = value
    return out
  return np.asarray(value)


def load_source(spec: str | Mapping[str, np.ndarray], **kwargs: Any) -> ArraySource | TfdsSource:
  """Returns a source from a short description.

  Args:
    spec: ``"tfds:NAME:SPLIT"`` for a :class:`TfdsSource` (the name may
      carry a version and the split a slice, e.g.
      ``"tfds:cifar10:3.0.2:train[:90%]"``), or a mapping of arrays for an
      :class:`ArraySource`.
    **kwargs: passed to :class:`TfdsSource` (``data_dir``, ``download``,
      ``features``); none are accepted for arrays.

  Returns:
    The source.

  Example:
    >>> len(load_source({"x": np.zeros((4, 2))}))
    4
  """
  if isinstance(spec, Mapping):
    if kwargs:
      raise ValueError(f"an ArraySource takes no options, got {sorted(kwargs)}")
    return ArraySource(spec)
  if isinstance(spec, str):
    match = _TFDS_SPEC.fullmatch(spec)
    if match:
      return TfdsSource(match["name"], match["split"], **kwargs)
  raise ValueError(f"spec must be 'tfds:NAME:SPLIT' or a mapping of arrays, got {spec!r}")
