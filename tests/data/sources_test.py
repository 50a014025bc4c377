"""Tests for simigrad_jax.data.sources: in-memory arrays and TFDS without TensorFlow."""

import doctest
import re
import time

import numpy as np
import pytest
import tensorflow_datasets as tfds

from simigrad_jax.data import sources as sources_lib
from simigrad_jax.data.sampler import EpochSampler
from simigrad_jax.data.sources import ArraySource
from simigrad_jax.data.sources import TfdsSource
from simigrad_jax.data.sources import load_source
from simigrad_jax.shapes.batch_plan import BucketPolicy
from simigrad_jax.shapes.batch_plan import plan_batch


def make_arrays(n=6):
  return {
    "x": np.arange(n * 6, dtype=np.float32).reshape(n, 2, 3) + 1,
    "y": np.arange(n, dtype=np.int8) + 1,
    "flag": np.ones(n, dtype=bool),
    "name": np.array([f"ex{i}" for i in range(n)]),
  }


# ---------------------------------------------------------------- ArraySource


def test_array_source_basics():
  arrays = make_arrays()
  source = ArraySource(arrays)
  assert len(source) == 6
  assert source.element_spec == {
    "x": ((2, 3), np.dtype(np.float32)),
    "y": ((), np.dtype(np.int8)),
    "flag": ((), np.dtype(bool)),
    "name": ((), np.dtype("<U3")),
  }
  indices = np.array([5, 0, 3, 3])
  batch = source.get_batch(indices)
  assert list(batch) == ["x", "y", "flag", "name"]
  for name, array in arrays.items():
    assert batch[name].dtype == array.dtype
    np.testing.assert_array_equal(batch[name], array[indices])
  assert source.get_batch([1, 2])["name"].tolist() == ["ex1", "ex2"]


def test_array_source_padding_rows_are_zero():
  arrays = make_arrays()
  source = ArraySource(arrays)
  indices = np.array([[2, -1, 0], [-1, -1, 5]])
  batch = source.get_batch(indices)
  pad = indices == -1
  assert batch["x"].shape == (2, 3, 2, 3) and batch["y"].shape == (2, 3)
  for name, array in arrays.items():
    rows = batch[name]
    assert rows.dtype == array.dtype
    np.testing.assert_array_equal(rows[~pad], array[indices[~pad]])
    zero = np.zeros(array.shape[1:], array.dtype)
    for row in rows[pad]:
      np.testing.assert_array_equal(row, zero)
  assert batch["name"][0, 1] == "" and not batch["flag"][1, 0]
  # Real rows that hold zeros are not mistaken for padding and vice versa.
  assert (batch["x"][~pad] > 0).all() and (batch["y"][~pad] > 0).all()


def test_array_source_all_padding_and_empty_batches():
  source = ArraySource(make_arrays())
  batch = source.get_batch(np.full(4, -1))
  assert batch["x"].shape == (4, 2, 3) and not batch["x"].any()
  empty = source.get_batch(np.zeros((0,), np.int64))
  assert empty["x"].shape == (0, 2, 3) and empty["name"].shape == (0,)
  assert source.get_batch([])["y"].shape == (0,)


def test_array_source_returns_new_arrays():
  arrays = make_arrays()
  source = ArraySource(arrays)
  batch = source.get_batch(np.array([0, 1]))
  batch["x"][:] = -7
  batch["y"][:] = 0
  assert arrays["x"][0, 0, 0] == 1 and arrays["y"][1] == 2
  np.testing.assert_array_equal(source.get_batch(np.array([0]))["x"], arrays["x"][:1])


@pytest.mark.parametrize(
  "arrays,match",
  [
    ({}, "non-empty mapping"),
    ([np.zeros(3)], "non-empty mapping"),
    ({"x": np.zeros((3, 2)), "y": np.zeros(4)}, r"equal lengths, got \{'x': 3, 'y': 4\}"),
    ({"x": np.zeros((0, 2))}, r"at least 1 example, got \{'x': 0\}"),
    ({"x": np.zeros(3), "s": np.float32(1.0)}, "array 's' must have a leading example axis"),
    ({1: np.zeros(3)}, "array names must be strings, got 1"),
  ],
)
def test_array_source_refuses_bad_arrays(arrays, match):
  with pytest.raises(ValueError, match=match):
    ArraySource(arrays)


@pytest.mark.parametrize(
  "indices,error,match",
  [
    ([6], IndexError, r"\[0, 6\) or -1 for padding, got \[6\]"),
    ([0, -2, 1], IndexError, r"got \[-2\]"),
    ([[0, 100], [-5, 1]], IndexError, r"got \[100, -5\]"),
    (np.array([0.0, 1.0]), ValueError, "integers .* got dtype float64"),
    (np.array([True, False]), ValueError, "got dtype bool"),
  ],
)
def test_array_source_refuses_bad_indices(indices, error, match):
  source = ArraySource(make_arrays())
  with pytest.raises(error, match=match):
    source.get_batch(indices)


def test_sampler_and_array_source_serve_each_example_once_per_epoch():
  """End to end: plan layout -> global indices -> rows, padding weighted out."""
  n = 50
  source = ArraySource({"id": np.arange(n) + 1000})
  sampler = EpochSampler(n, 3)
  policy = BucketPolicy(4, 1)
  rng = np.random.default_rng(0)
  served = []
  for _ in range(60):
    plan = plan_batch(int(rng.integers(1, 30)), 4, policy)
    indices = sampler.take(plan.global_batch_size)
    layout = plan.example_layout()
    rows = np.where(layout >= 0, indices[np.maximum(layout, 0)], -1)
    batch = source.get_batch(rows)["id"]
    weights = plan.example_weights()
    assert batch.shape == layout.shape
    assert (batch[weights == 0] == 0).all() and (batch[weights == 1] >= 1000).all()
    served.append(np.sort(batch[weights == 1]) - 1000)
    np.testing.assert_array_equal(served[-1], np.sort(indices))
  stream = np.concatenate(
    [sampler.indices_at(0, n)] + [sampler.indices_at(k * n, n) for k in range(1, sampler.epoch)]
  )
  for e in range(sampler.epoch):
    np.testing.assert_array_equal(np.sort(stream[e * n : (e + 1) * n]), np.arange(n))


# ------------------------------------------------------- TfdsSource (mocked)


def test_tfds_mnist_under_mock_data():
  with tfds.testing.mock_data(num_examples=10):
    source = TfdsSource("mnist", "train", download=False)
    raw = tfds.data_source("mnist", split="train", download=False)
  assert len(source) == 10
  assert source.features == ("image", "label")
  assert source.element_spec == {
    "image": ((28, 28, 1), np.dtype(np.uint8)),
    "label": ((), np.dtype(np.int64)),
  }
  indices = np.array([3, -1, 0, 9])
  batch = source.get_batch(indices)
  assert batch["image"].shape == (4, 28, 28, 1) and batch["image"].dtype == np.uint8
  assert batch["label"].shape == (4,) and batch["label"].dtype == np.int64
  assert not batch["image"][1].any() and batch["label"][1] == 0
  for row, i in enumerate(indices):
    if i >= 0:
      np.testing.assert_array_equal(batch["image"][row], raw[int(i)]["image"])
      assert batch["label"][row] == raw[int(i)]["label"]
  assert batch["image"][[0, 2, 3]].any()  # mock images are random, not blank
  assert ((batch["label"] >= 0) & (batch["label"] < 10)).all()
  grid = source.get_batch(np.array([[0, 1], [-1, 2]]))
  assert grid["image"].shape == (2, 2, 28, 28, 1) and not grid["image"][1, 0].any()
  np.testing.assert_array_equal(grid["image"][0, 1], raw[1]["image"])


def test_tfds_cifar10_under_mock_data():
  with tfds.testing.mock_data(num_examples=6):
    source = TfdsSource("cifar10", "test", download=False, features=["image", "label"])
    everything = TfdsSource("cifar10", "test", download=False)
  assert len(source) == 6
  assert source.element_spec == {
    "image": ((32, 32, 3), np.dtype(np.uint8)),
    "label": ((), np.dtype(np.int64)),
  }
  batch = source.get_batch(np.array([-1, 5, 2]))
  assert batch["image"].shape == (3, 32, 32, 3) and batch["label"].shape == (3,)
  assert not batch["image"][0].any() and batch["image"][1:].any()
  # Unselected features stay out; text features become object arrays.
  assert set(batch) == {"image", "label"}
  assert everything.features == ("id", "image", "label")
  assert everything.element_spec["id"] == ((), np.dtype(object))
  ids = everything.get_batch(np.array([0, -1]))["id"]
  assert isinstance(ids[0], str) and ids[0] and ids[1] == ""
  np.testing.assert_array_equal(everything.get_batch(np.array([5, 2]))["image"], batch["image"][1:])


def test_tfds_source_checks_the_range_the_mock_does_not():
  with tfds.testing.mock_data(num_examples=4):
    source = TfdsSource("mnist", "train", download=False)
    raw = tfds.data_source("mnist", split="train", download=False)
  assert raw[4]["image"].shape == (28, 28, 1)  # the mock serves index 4 anyway
  with pytest.raises(IndexError, match=r"\[0, 4\) or -1 for padding, got \[4\]"):
    source.get_batch(np.array([0, 4]))
  with pytest.raises(IndexError, match=r"got \[-3\]"):
    source.get_batch(np.array([-3]))
  with pytest.raises(ValueError, match="got dtype float"):
    source.get_batch(np.array([0.5]))


def test_tfds_mock_facts_getitems_fails_and_we_fall_back():
  """TFDS 4.9.10 facts under mock_data; if one changes, update sources.py."""
  with tfds.testing.mock_data(num_examples=5):
    raw = tfds.data_source("mnist", split="train", download=False)
    sliced = tfds.data_source("mnist", split="train[:2]", download=False)
    source = TfdsSource("mnist", "train", download=False)
  with pytest.raises(TypeError):
    raw.__getitems__([0, 1])
  assert len(sliced) == 5  # split slices are ignored under the mock
  with pytest.raises(ValueError):
    raw[-1]  # negative indices are refused: -1 must never reach TFDS
  assert source.get_batch(np.array([0, 1, -1]))["image"].shape == (3, 28, 28, 1)
  assert source._batched_reads is False  # pylint: disable=protected-access


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (
      dict(name="mnist", split="train", features=["image", "pixels"]),
      r"features \['pixels'\] are not in TFDS 'mnist'; available: \['image', 'label'\]",
    ),
    (dict(name="mnist", split="train", features="image"), "features must be None or"),
    (dict(name="mnist", split="train", features=[]), "features must be None or"),
    (dict(name="mnist", split="train", features=3), "features must be None or"),
    (dict(name="mnist", split="train", features=["image", 3]), "features must be None or"),
    (dict(name="mnist", split="train", download="no"), "download must be True or False"),
    (dict(name="", split="train"), "name must be a non-empty string"),
    (dict(name="mnist", split=None), "split must be a non-empty string, got None"),
  ],
)
def test_tfds_source_refuses_bad_arguments(kwargs, match):
  with tfds.testing.mock_data(num_examples=3):
    with pytest.raises(ValueError, match=match):
      TfdsSource(**{"download": False, **kwargs})


def test_load_source():
  with tfds.testing.mock_data(num_examples=3):
    source = load_source("tfds:mnist:train[:50%]", download=False, features=["label"])
  assert isinstance(source, TfdsSource) and len(source) == 3
  assert source.element_spec == {"label": ((), np.dtype(np.int64))}
  with tfds.testing.mock_data(num_examples=3):
    generated = TfdsSource(
      "mnist", "train", download=False, features=(f for f in ["label", "image"])
    )
  assert generated.features == ("label", "image")
  arrays = load_source({"x": np.zeros((4, 2))})
  assert isinstance(arrays, ArraySource) and len(arrays) == 4
  for bad in ("mnist:train", "tfds:mnist", "tfds::train", 3):
    with pytest.raises(ValueError, match="'tfds:NAME:SPLIT' or a mapping"):
      load_source(bad)
  with pytest.raises(ValueError, match=r"takes no options, got \['download'\]"):
    load_source({"x": np.zeros(2)}, download=False)
  match = sources_lib._TFDS_SPEC.fullmatch("tfds:cifar10:3.0.2:train[:90%]")  # pylint: disable=protected-access
  assert (match["name"], match["split"]) == ("cifar10:3.0.2", "train[:90%]")


# ---------------------------------------- TfdsSource on real ArrayRecord files


class SimigradTinyRecords(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """A tiny data set TFDS prepares as ArrayRecord files without TensorFlow."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(
      builder=self,
      features=tfds.features.FeaturesDict(
        {
          "image": tfds.features.Tensor(shape=(4, 4, 3), dtype=np.uint8),
          "label": tfds.features.ClassLabel(num_classes=10),
          "name": tfds.features.Text(),
          "ragged": tfds.features.Tensor(shape=(None,), dtype=np.int32),
        }
      ),
    )

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples(12), "test": self._generate_examples(5)}

  def _generate_examples(self, n):
    for i in range(n):
      yield (
        i,
        {
          "image": np.full((4, 4, 3), i + 1, np.uint8),
          "label": i % 10,
          "name": f"r{i}",
          "ragged": np.arange(i % 3 + 1, dtype=np.int32),
        },
      )


@pytest.fixture(scope="module")
def tiny_data_dir(tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  SimigradTinyRecords(data_dir=data_dir, file_format="array_record").download_and_prepare()
  return data_dir


def test_tfds_source_reads_real_array_record_files(tiny_data_dir):
  source = TfdsSource(
    "simigrad_tiny_records",
    "train",
    data_dir=tiny_data_dir,
    download=False,
    features=["image", "label", "name"],
  )
  assert len(source) == 12
  assert source.element_spec == {
    "image": ((4, 4, 3), np.dtype(np.uint8)),
    "label": ((), np.dtype(np.int64)),
    "name": ((), np.dtype(object)),
  }
  batch = source.get_batch(np.arange(-1, 12))
  assert source._batched_reads is True  # pylint: disable=protected-access
  names, images, labels = batch["name"][1:], batch["image"][1:], batch["label"][1:]
  # Every record once, consistent across features, whatever the on-disk order.
  ids = sorted(int(name.decode()[1:]) for name in names)
  assert ids == list(range(12))
  for name, image, label in zip(names, images, labels):
    i = int(name.decode()[1:])
    assert (image == i + 1).all() and label == i % 10
  assert batch["name"][0] == b"" and not batch["image"][0].any()
  assert (
    len(TfdsSource("simigrad_tiny_records", "test", data_dir=tiny_data_dir, download=False)) == 5
  )
  head = TfdsSource(
    "simigrad_tiny_records", "train[:4]", data_dir=tiny_data_dir, download=False, features=["name"]
  )
  assert len(head) == 4  # real data honours split slices
  np.testing.assert_array_equal(head.get_batch(np.arange(4))["name"], names[:4])


def test_tfds_source_refuses_variable_shapes(tiny_data_dir):
  source = TfdsSource(
    "simigrad_tiny_records",
    "train",
    data_dir=tiny_data_dir,
    download=False,
    features=["ragged", "label"],
  )
  first = source.element_spec["ragged"][0]
  with pytest.raises(
    ValueError,
    match=r"feature 'ragged' of record \d+ has shape "
    r"\(\d,\), but record 0 has " + re.escape(str(first)) + "; .*fixed-shape",
  ):
    source.get_batch(np.arange(12))


def test_tfds_source_without_data_fails_fast(tmp_path):
  start = time.perf_counter()
  # Nothing prepared there: the folder TFDS looked in and the two options, not TFDS's
  # complaint about a TFRecord copy that does not exist.
  with pytest.raises(
    FileNotFoundError,
    match=f"TFDS has no prepared 'mnist' in {tmp_path}/mnist/[0-9.]+ "
    rf"\(data_dir='{tmp_path}', download=False\): set data_dir .* or download=True",
  ):
    TfdsSource("mnist", "train", data_dir=str(tmp_path), download=False)
  assert time.perf_counter() - start < 10


def test_docstring_examples():
  result = doctest.testmod(sources_lib, optionflags=doctest.ELLIPSIS)
  assert result.attempted >= 8 and result.failed == 0
