"""Host-side text data of the training scripts: byte-level tokens as random-access sources.

Tokenization for the BERT configs is byte-level: each UTF-8 byte is one token
(ids 2-257), plus PAD (0) and MASK (1). It needs no vocabulary file, works on
any text, and makes sequences about 4x longer than WordPiece for English.
"""

from __future__ import annotations

import glob
import hashlib
import os
import pathlib

import numpy as np

from simigrad_jax.data import open_tfds
from simigrad_jax.data.sources import check_indices

PAD_ID = 0
MASK_ID = 1
FIRST_BYTE_ID = 2
BYTE_VOCAB_SIZE = FIRST_BYTE_ID + 256


def encode_bytes(text: str | bytes) -> np.ndarray:
  """Byte-level token ids (int32): byte ``b`` becomes ``b + FIRST_BYTE_ID``."""
  data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
  return np.frombuffer(data, np.uint8).astype(np.int32) + FIRST_BYTE_ID


def decode_bytes(tokens: np.ndarray) -> str:
  """The text of byte-level ids; PAD and MASK are dropped, MASK shown as nothing."""
  tokens = np.asarray(tokens)
  data = (tokens[tokens >= FIRST_BYTE_ID] - FIRST_BYTE_ID).astype(np.uint8).tobytes()
  return data.decode("utf-8", errors="replace")


class TextWindowSource:
  """A token stream cut into non-overlapping windows: example ``i`` is ``tokens[i*L:(i+1)*L]``.

  Args:
    tokens: 1-D int32 token ids.
    seq_length: L, the tokens per example.
  """

  def __init__(self, tokens: np.ndarray, seq_length: int):
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    if len(tokens) < seq_length:
      raise ValueError(
        f"the text holds {len(tokens)} tokens, fewer than one window of seq_length={seq_length}"
      )
    self.seq_length = seq_length
    self._windows = tokens[: len(tokens) // seq_length * seq_length].reshape(-1, seq_length)

  def __len__(self) -> int:
    return len(self._windows)

  def __repr__(self) -> str:
    return f"TextWindowSource({len(self)} windows of {self.seq_length} tokens)"

  @property
  def element_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    return {"tokens": ((self.seq_length,), np.dtype(np.int32))}

  def get_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    """The windows at ``indices``; ``-1`` gives a row of PAD."""
    shape = np.shape(indices)
    flat, _ = check_indices(indices, len(self))
    rows = self._windows[np.maximum(flat, 0)]
    rows[flat < 0] = PAD_ID
    return {"tokens": rows.reshape(shape + (self.seq_length,))}


class TfdsTextSource:
  """A TFDS text set as byte-level examples: example ``i`` joins records ``[i*G, (i+1)*G)`` with newlines.

  Packing ``G = records_per_example`` consecutive records keeps random access
  (no index over the whole set is needed) while filling sequences of short
  records such as lm1b's sentences. The bytes are cut at ``seq_length`` and
  padded with PAD.

  Args:
    name: the TFDS name, e.g. ``"lm1b"``.
    split: the split.
    seq_length: tokens per example.
    feature: the text feature.
    records_per_example: G.
    data_dir: where TFDS keeps the prepared data.
    download: let TFDS download and prepare the data if it is missing.
  """

  def __init__(
    self,
    name: str,
    split: str,
    seq_length: int,
    *,
    feature: str = "text",
    records_per_example: int = 1,
    data_dir: str | None = None,
    download: bool = False,
  ):
    if records_per_example < 1:
      raise ValueError(f"records_per_example must be >= 1, got {records_per_example}")
    self._ds = open_tfds(name, split, data_dir=data_dir, download=download)
    self._name, self._split, self._feature = name, split, feature
    self.seq_length, self._group = seq_length, records_per_example
    self._length = len(self._ds) // records_per_example
    if self._length < 1:
      raise ValueError(
        f"TFDS {name!r} split {split!r} holds fewer than "
        f"records_per_example={records_per_example} records"
      )
    if feature not in self._ds[0]:
      raise ValueError(f"TFDS {name!r} has no feature {feature!r}; it has {sorted(self._ds[0])}")

  def __len__(self) -> int:
    return self._length

  def __repr__(self) -> str:
    return (
      f"TfdsTextSource({self._name!r}, {self._split!r}, {len(self)} examples of "
      f"{self._group} records)"
    )

  @property
  def element_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    return {"tokens": ((self.seq_length,), np.dtype(np.int32))}

  def _example(self, index: int) -> np.ndarray:
    texts = []
    for k in range(index * self._group, (index + 1) * self._group):
      value = self._ds[k][self._feature]
      texts.append(value.encode("utf-8") if isinstance(value, str) else bytes(value))
    tokens = encode_bytes(b"\n".join(texts))[: self.seq_length]
    return np.pad(tokens, (0, self.seq_length - len(tokens)), constant_values=PAD_ID)

  def get_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    """The examples at ``indices``; ``-1`` gives a row of PAD."""
    shape = np.shape(indices)
    flat, _ = check_indices(indices, self._length)
    rows = np.full((len(flat), self.seq_length), PAD_ID, np.int32)
    for row in np.flatnonzero(flat >= 0):
      rows[row] = self._example(int(flat[row]))
    return {"tokens": rows.reshape(shape + (self.seq_length,))}


def read_text_file(path: str | os.PathLike, option: str) -> str:
  """The text of ``path``, a file of UTF-8 text, or a ValueError naming the file and ``option``.

  A folder, a pipe or a device, bytes that are not UTF-8 (a Latin-1 file, a
  binary) and NUL bytes are refused: read leniently, each would train on
  other characters than the file's without a word.

  Args:
    path: the file.
    option: the config option that named it (``"config.text_files"``), for
      the message.

  Returns:
    The decoded text.

  Example:
    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "latin1.txt"
    >>> _ = path.write_bytes("caf\u00e9".encode("latin-1"))
    >>> try:
    ...   read_text_file(path, "config.text_files")
    ... except ValueError as error:
    ...   print(error)  # doctest: +ELLIPSIS
    config.text_files: '.../latin1.txt' is not UTF-8 text: byte 0xe9 at offset 3 (line 1); ...
  """
  path = pathlib.Path(path)
  if not path.is_file():
    what = (
      "a folder; name the files in it (e.g. 'folder/*.txt')"
      if path.is_dir()
      else "not a regular file (a pipe, a socket or a device); give a text file"
    )
    raise ValueError(f"{option}: {str(path)!r} is {what}")
  data = path.read_bytes()
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as error:
    line = data.count(b"\n", 0, error.start) + 1
    raise ValueError(
      f"{option}: {str(path)!r} is not UTF-8 text: byte 0x{data[error.start]:02x} at offset "
      f"{error.start} (line {line}); convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8) or "
      "give another file"
    ) from error
  nul = text.find("\x00")
  if nul >= 0:
    raise ValueError(
      f"{option}: {str(path)!r} holds a NUL byte (character {nul}): a binary file, not text"
    )
  return text


def text_sha256(text: str) -> str:
  """The first 16 hex digits of the SHA-256 of ``text`` in UTF-8 (``Datasets.text_sha256``).

  Example:
    >>> text_sha256("abc")
    'ba7816bf8f01cfea'
  """
  return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def default_text(local_data_dir: str | os.PathLike) -> tuple[str, str]:
  """``(text, source)``: tinyshakespeare from ``local_data_dir``, else ``pydoc_data.topics``."""
  path = pathlib.Path(local_data_dir) / "tinyshakespeare.txt"
  if path.is_file():
    return read_text_file(path, "config.local_data_dir"), str(path)
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel

  return "\n\n".join(topics.topics[k] for k in sorted(topics.topics)), "pydoc_data.topics"


def read_text_files(spec: str) -> tuple[str, str]:
  """``(text, where)``: the files of ``spec`` (comma-separated paths or glob patterns, ``~``
  expanded), in order, joined by blank lines; each a UTF-8 text file (:func:`read_text_file`)."""
  paths = []
  for part in (p.strip() for p in spec.split(",")):
    if not part:
      continue
    matches = sorted(glob.glob(os.path.expanduser(part)))
    if not matches:
      raise FileNotFoundError(f"config.text_files: no file matches {part!r}")
    paths.extend(pathlib.Path(m) for m in matches)
  text = "\n\n".join(read_text_file(p, "config.text_files") for p in paths)
  return text, f"{len(paths)} text file(s)"
