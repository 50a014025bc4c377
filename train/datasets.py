"""Host: what a config's data set is once loaded (:class:`Datasets`), and where its local files lie.

Shared by the loaders: :mod:`train.input_pipeline`, which picks the data set
of a config, and the loaders it calls, such as :mod:`train.char_data`.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Datasets:
  """The sources of one experiment and what the model needs to know about them.

  Attributes:
    train: the training source.
    eval: the evaluation source (None: no evaluation).
    num_classes: classes, for classification sets.
    vocab_size: token ids are in ``[0, vocab_size)``, for text sets.
    image_mean: per-channel mean (0-255 scale) to normalise with; None: uint8
      images are divided by 255 and float images are used as they are.
    image_std: per-channel standard deviation, with ``image_mean``.
    description: one line for the console.
    eval_name: what the evaluation set is called on the console.
    tokens_per_example: for a language model's data: the tokens each
      example predicts (tokens seen = examples seen x this).
    unigram_entropy: the entropy of the training tokens' frequencies, nats
      per token: the loss of a model that ignores the context.
    vocabulary: what turns tokens back into text, for ``"chars"``.
    text_sha256: for data read from text files (``"chars"``, ``"text"``), the
      first 16 hex digits of the text's SHA-256: the run records it
      (:func:`train.run_settings.run_settings`), so that a resume on another
      text, or on the same file changed, is refused rather than trained on
      other characters.
  """

  train: Any
  eval: Any | None
  num_classes: int | None = None
  vocab_size: int | None = None
  image_mean: tuple[float, ...] | None = None
  image_std: tuple[float, ...] | None = None
  description: str = ""
  eval_name: str = "test"
  tokens_per_example: int | None = None
  unigram_entropy: float | None = None
  vocabulary: Any = None
  text_sha256: str | None = None


def resolve_local_dir(path: str) -> pathlib.Path:
  """``path``, relative paths taken from the repository root (so ``../shared/data`` works from any cwd)."""
  candidate = pathlib.Path(os.path.expanduser(path))
  return candidate if candidate.is_absolute() else (REPO_ROOT / candidate).resolve()
