"""Host: character-level text for the causal language model: the text, its vocabulary, its windows.

``config.dataset = "chars"``: one character is one token. The text is
tinyshakespeare (``config.text_source``): ``"local"`` reads
``tinyshakespeare.txt`` from ``config.local_data_dir``; ``"tfds"`` reads TFDS
``tiny_shakespeare`` through ``tfds.data_source`` (its train, validation and
test splits joined in that order: the same file); ``"auto"`` takes the local
file when present, else TFDS. ``config.text_files`` (paths or globs) replaces
both with your own text.

The split is fixed: the last ``config.eval_fraction`` of the characters is
the validation text, the rest is trained on. The vocabulary is every
character of the whole text, sorted. Each split is cut into windows of
``seq_length + 1`` characters that overlap by one (:class:`NextTokenWindows`),
so that every character but the first of a split is predicted exactly once.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any

import ml_collections
import numpy as np

from simigrad_jax.data.sources import check_indices
from train.datasets import Datasets
from train.datasets import resolve_local_dir
from train.text_data import read_text_file
from train.text_data import read_text_files
from train.text_data import text_sha256

TINY_SHAKESPEARE_FILE = "tinyshakespeare.txt"
TINY_SHAKESPEARE_TFDS = "tiny_shakespeare"
TEXT_SOURCES: tuple[str, ...] = ("auto", "local", "tfds")


@dataclasses.dataclass(frozen=True)
class CharVocabulary:
  """The characters of a text as token ids ``0 .. size - 1``, in sorted order.

  Example:
    >>> vocabulary = CharVocabulary.from_text("abracadabra")
    >>> vocabulary.decode(vocabulary.encode("cab"))
    'cab'
  """

  chars: str

  @classmethod
  def from_text(cls, text: str) -> CharVocabulary:
    """The vocabulary of every character in ``text``."""
    return cls("".join(sorted(set(text))))

  @property
  def size(self) -> int:
    return len(self.chars)

  def encode(self, text: str) -> np.ndarray:
    """The ids (int32) of ``text``'s characters; raises ValueError naming one not in the vocabulary."""
    table = {c: i for i, c in enumerate(self.chars)}
    try:
      return np.fromiter((table[c] for c in text), np.int32, count=len(text))
    except KeyError as e:
      raise ValueError(
        f"character {e.args[0]!r} is not in the vocabulary of {self.size} characters"
      ) from None

  def decode(self, ids: Any) -> str:
    """The text of token ids."""
    return "".join(self.chars[int(i)] for i in np.asarray(ids).reshape(-1))


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
  """The entropy, in nats per token, of the tokens' frequencies: the loss of a model without context.

  Example:
    >>> round(unigram_entropy(np.array([0, 1, 0, 1]), 2), 4)  # log(2)
    0.6931
  """
  counts = np.bincount(np.asarray(tokens).reshape(-1), minlength=vocab_size).astype(np.float64)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())


class NextTokenWindows:
  """A token stream as examples of ``seq_length + 1`` tokens: the inputs and, one later, the targets.

  Example ``i`` is ``tokens[i*L : i*L + L + 1]`` for ``L = seq_length``: the
  model reads its first ``L`` tokens and predicts its last ``L``. Windows
  overlap by one token, so every token but the first is a target once.

  Args:
    tokens: 1-D int32 token ids.
    seq_length: L, the tokens each example predicts.
  """

  def __init__(self, tokens: np.ndarray, seq_length: int):
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    if not isinstance(seq_length, int) or seq_length < 1:
      raise ValueError(f"seq_length must be a positive integer, got {seq_length!r}")
    count = (len(tokens) - 1) // seq_length
    if count < 1:
      raise ValueError(
        f"the text holds {len(tokens)} tokens, fewer than one window of "
        f"seq_length + 1 = {seq_length + 1}"
      )
    self.seq_length = seq_length
    starts = np.arange(count)[:, None] * seq_length
    self._windows = tokens[starts + np.arange(seq_length + 1)[None, :]]

  def __len__(self) -> int:
    return len(self._windows)

  def __repr__(self) -> str:
    return f"NextTokenWindows({len(self)} windows of {self.seq_length} + 1 tokens)"

  @property
  def element_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    return {"tokens": ((self.seq_length + 1,), np.dtype(np.int32))}

  def get_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    """The windows at ``indices``; ``-1`` gives a row of zeros (padding, weighted 0)."""
    shape = np.shape(indices)
    flat, _ = check_indices(indices, len(self))
    rows = self._windows[np.maximum(flat, 0)]
    rows[flat < 0] = 0
    return {"tokens": rows.reshape(shape + (self.seq_length + 1,))}


def _tfds_tiny_shakespeare(data_dir: str | None, download: bool) -> str:
  """TFDS ``tiny_shakespeare``'s train, validation and test text, joined in that order."""
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

  parts = []
  for split in ("train", "validation", "test"):
    source = tfds.data_source(
      TINY_SHAKESPEARE_TFDS, split=split, data_dir=data_dir, download=download
    )
    for i in range(len(source)):
      value = source[i]["text"]
      parts.append(value.decode("utf-8") if isinstance(value, bytes) else str(value))
  return "".join(parts)


def read_text(config: ml_collections.ConfigDict) -> tuple[str, str]:
  """``(text, where)``: the text ``config.text_files`` or ``config.text_source`` names.

  Raises:
    ValueError: for an unknown ``config.text_source``.
    FileNotFoundError: no text where the config says to look; the message
      names the places tried and the options that change them.
  """
  if config.text_files:
    return read_text_files(config.text_files)
  if config.text_source not in TEXT_SOURCES:
    raise ValueError(
      f"config.text_source={config.text_source!r} is not valid; choose one of {TEXT_SOURCES}"
    )
  path = local_text_path(config.local_data_dir)
  if config.text_source != "tfds" and path.is_file():
    return read_text_file(path, "config.local_data_dir"), str(path)
  local_hint = (
    f"{TINY_SHAKESPEARE_FILE} is not in {str(path.parent)!r}: set --config.local_data_dir "
    "to the folder that holds it"
  )
  if config.text_source == "local":
    raise FileNotFoundError(local_hint)
  try:
    return _tfds_tiny_shakespeare(config.data_dir, config.download), (
      f"TFDS {TINY_SHAKESPEARE_TFDS}"
    )
  except Exception as e:  # TFDS raises many kinds for data that is not there
    tried = "" if config.text_source == "tfds" else f"{local_hint}; and "
    raise FileNotFoundError(
      f"{tried}TFDS could not open {TINY_SHAKESPEARE_TFDS!r} in data_dir "
      f"{config.data_dir!r} (set --config.data_dir, or --config.download=True to let TFDS "
      f"fetch it, or --config.text_files for your own text). TFDS says: "
      f"{type(e).__name__}: {e}"
    ) from e


def load_chars(config: ml_collections.ConfigDict) -> Datasets:
  """The ``"chars"`` data set: training and validation windows of character ids.

  Args:
    config: the experiment config (``text_source``, ``text_files``,
      ``local_data_dir``, ``eval_fraction``, ``seq_length``).

  Returns:
    A :class:`train.datasets.Datasets` with ``vocab_size``,
    ``tokens_per_example`` (``seq_length``, the tokens each example
    predicts) and ``unigram_entropy`` (of the training text, nats/token).

  Raises:
    ValueError: for a bad ``eval_fraction`` or a text too short to split.
    FileNotFoundError: no text (see :func:`read_text`).
  """
  if not 0.0 < config.eval_fraction < 1.0:
    raise ValueError(
      f"config.eval_fraction={config.eval_fraction!r} is not valid for 'chars': the "
      "validation share of the text, in (0, 1)"
    )
  text, where = read_text(config)
  vocabulary = CharVocabulary.from_text(text)
  tokens = vocabulary.encode(text)
  held_out = int(math.floor(len(tokens) * config.eval_fraction))
  train_tokens, val_tokens = tokens[: len(tokens) - held_out], tokens[len(tokens) - held_out :]
  for name, part in (("training", train_tokens), ("validation", val_tokens)):
    if len(part) < config.seq_length + 1:
      raise ValueError(
        f"the {name} text ({len(part)} characters of {where}) is shorter than one window of "
        f"config.seq_length + 1 = {config.seq_length + 1} characters; lower "
        "config.seq_length, change config.eval_fraction or give a longer text"
      )
  entropy = unigram_entropy(train_tokens, vocabulary.size)
  return Datasets(
    NextTokenWindows(train_tokens, config.seq_length),
    NextTokenWindows(val_tokens, config.seq_length),
    vocab_size=vocabulary.size,
    description=(
      f"{len(tokens):,} characters from {where} ({vocabulary.size} distinct; the last "
      f"{config.eval_fraction:.0%} for validation; unigram entropy {entropy:.3f} nats/char)"
    ),
    eval_name="validation",
    tokens_per_example=config.seq_length,
    unigram_entropy=entropy,
    vocabulary=vocabulary,
    text_sha256=text_sha256(text),
  )


def local_text_path(local_data_dir: str | pathlib.Path) -> pathlib.Path:
  """Where ``"chars"`` looks for tinyshakespeare with ``text_source`` ``"local"`` or ``"auto"``."""
  return resolve_local_dir(str(local_data_dir)) / TINY_SHAKESPEARE_FILE
