"""Benchmark: how fast the host feeds ImageNet-style images, and whether the Trainer waits for them.

Source: JPEG bytes as ImageNet stores them, generated here with Pillow
(``--image-size`` 400x350 by default: smooth gradients, a few shapes and
noise, like a photo rather than a constant colour; quality 90, about 40 KB
each). Work per image: decode, Inception random-resized crop (8-100% of the
area, aspect 3/4-4/3) resized to 224x224 (bilinear), horizontal flip half of
the time, as uint8, with a NumPy generator seeded by the stream position
(:class:`simigrad_jax.GrainSource`'s ``augment``).

Measured:

* ``single_thread``: images/s of that work in a plain loop in this process;
* ``single_thread`` and ``workers``, side by side: a plain loop in this
  process, and a :class:`simigrad_jax.GrainSource` reader with 1 and with 2
  grain worker processes, reading windows of ``--window`` stream positions as
  the Trainer does. The readers start (and their workers decode a first
  window) before any timing; then ``--rounds`` rounds time ``--timed-images``
  images of each, the order rotating, and the median images/s is reported.
  A reader not being timed is idle: its workers block on a full buffer.
  ``speedup_2_over_1`` is the median over rounds of the 2-worker rate over the
  1-worker rate of the same round;
* ``data_wait_share_by_bucket``: for each batch size of ``--batch-sizes``,
  a :class:`simigrad_jax.Trainer` run at that fixed size (the ``"fixed"``
  controller) on 8 simulated devices reading through the grain reader with
  ``--trainer-workers`` workers (default: cores minus one), training a
  three-layer convolutional network on the 224x224 crops: the share of the
  step time the Trainer spent waiting for data (``data_seconds /
  wall_seconds`` of a ``train()`` call, after a first call that compiles and
  starts the workers); ``trainer_images_per_second_by_bucket`` is what the
  devices consumed. On this CPU-only machine the model's compute and the
  decoding share the same cores, so the model is sized to consume fewer
  images per second than one worker decodes (as a GPU host with enough cores
  would be provisioned): the wait then measures the pipeline's own stalls
  (start-up, windows, batch-size changes). A model lighter than the decoding
  makes the pipeline wait here, because XLA's threads take both cores and
  leave the worker a fraction of one (``CONV_WIDTH`` sets the model's width;
  docs/trainer.md shows the waits of lighter and heavier ones).

Goals, printed as PASS/FAIL: 2 workers give at least 1.6x the images/s of 1,
and the data wait is under 5% of the step time at every bucket.

python benchmarks/trainer_overhead/input.py [--quick] [--out input.json]

The JSON goes to ``benchmarks/results/input.json`` (``input_quick.json`` with
``--quick``) unless ``--out`` says otherwise (``--out ''``: none).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
  from benchmarks import common  # noqa: E402  (imports no JAX)

  common.prepare_script()

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse  # noqa: E402
import io  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402

CROP = 224
FULL = dict(
  num_images=600,
  image_size=(400, 350),
  workers=(1, 2),
  window=64,
  timed_images=384,
  rounds=5,
  batch_sizes=(16, 32, 64, 128),
  steps=4,
)
QUICK = dict(
  num_images=24,
  image_size=(120, 100),
  workers=(1, 2),
  window=16,
  timed_images=32,
  rounds=2,
  batch_sizes=(8, 16),
  steps=2,
  crop=32,
)
GOAL_SPEEDUP, GOAL_WAIT_SHARE = 1.6, 0.05
CONV_WIDTH = 32


def photo_jpeg(index: int, size: tuple[int, int]) -> bytes:
  """A photo-like JPEG of ``size`` (width, height): gradients, ellipses and noise, seeded by ``index``."""
  from PIL import Image  # pylint: disable=import-outside-toplevel
  from PIL import ImageDraw  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(index)
  width, height = size
  y, x = np.mgrid[0:height, 0:width]
  base = rng.uniform(40, 200, 3)
  slope = rng.uniform(-0.4, 0.4, (2, 3))
  pixels = base + x[..., None] * slope[0] + y[..., None] * slope[1]
  pixels += rng.normal(0, 12, pixels.shape)
  picture = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
  draw = ImageDraw.Draw(picture)
  for _ in range(6):
    x0, y0 = rng.uniform(0, width), rng.uniform(0, height)
    w, h = rng.uniform(10, width / 2), rng.uniform(10, height / 2)
    draw.ellipse((x0, y0, x0 + w, y0 + h), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
  out = io.BytesIO()
  picture.save(out, format="JPEG", quality=90)
  return out.getvalue()


class JpegBlobs:
  """Grain-style records ``{"jpeg": bytes, "label": int}``; decoding happens in :func:`decode_crop_flip`."""

  def __init__(self, blobs: list[bytes]):
    self.blobs = blobs

  def __len__(self) -> int:
    return len(self.blobs)

  def __getitem__(self, index: int) -> dict[str, object]:
    return {"jpeg": self.blobs[index], "label": np.int32(index % 1000)}


class DecodeCropFlip:
  """Decode, random-resized crop to ``size``, flip half: the augment of a GrainSource."""

  def __init__(self, size: int = CROP):
    self.size = size

  def __call__(self, example: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    from PIL import Image  # pylint: disable=import-outside-toplevel

    picture = Image.open(
      io.BytesIO(
        example["jpeg"].item() if isinstance(example["jpeg"], np.ndarray) else example["jpeg"]
      )
    ).convert("RGB")
    width, height = picture.size
    for _ in range(10):  # the Inception crop, falling back to the whole image
      area = rng.uniform(0.08, 1.0) * width * height
      aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
      w, h = int(round(np.sqrt(area * aspect))), int(round(np.sqrt(area / aspect)))
      if 0 < w <= width and 0 < h <= height:
        left, top = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
        break
    else:
      left, top, w, h = 0, 0, width, height
    crop = picture.resize(
      (self.size, self.size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h)
    )
    if rng.random() < 0.5:
      crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return {"image": np.asarray(crop, np.uint8), "label": np.int32(example["label"])}


def make_source(blobs: list[bytes], workers: int, size: int):
  import simigrad_jax  # pylint: disable=import-outside-toplevel

  spec = {"image": ((size, size, 3), np.uint8), "label": ((), np.int32)}
  return simigrad_jax.GrainSource(
    JpegBlobs(blobs),
    element_spec=spec,
    augment=DecodeCropFlip(size),
    num_workers=workers,
    buffer_size=32,
    read_threads=0,
  )


def decode_rates(
  blobs: list[bytes], workers, count: int, window: int, size: int, rounds: int
) -> dict[str, list[float]]:
  """Images/s per round: ``{"single_thread": [...], "1": [...], "2": [...]}`` (one key per worker count).

  Every reader starts first; the rounds then time ``count`` images of each
  pipeline, the order rotating.
  """
  from simigrad_jax.data import EpochSampler  # pylint: disable=import-outside-toplevel

  work = DecodeCropFlip(size)
  records = JpegBlobs(blobs)
  position = {"single_thread": 0}

  def single_thread(count):
    start = position["single_thread"]
    for p in range(start, start + count):
      work(records[p % len(records)], np.random.default_rng([0, p]))
    position["single_thread"] = start + count

  def reading(reader, name):
    def read(count):
      start = position[name]
      for first in range(start, start + count, window):
        reader.read(np.arange(first, first + window))
      position[name] = start + count

    return read

  readers = {
    str(w): make_source(blobs, w, size).reader(EpochSampler(len(blobs), seed=0)) for w in workers
  }
  try:
    pipelines = {"single_thread": single_thread}
    for name, reader in readers.items():
      position[name] = 0
      pipelines[name] = reading(reader, name)
      pipelines[name](window)  # the workers start and decode a first window
    names = list(pipelines)
    rates = {name: [] for name in names}
    for r in range(rounds):
      for name in names[r % len(names) :] + names[: r % len(names)]:
        began = time.perf_counter()
        pipelines[name](count)
        rates[name].append(count / (time.perf_counter() - began))
    return rates
  finally:
    for reader in readers.values():
      reader.close()


def data_wait_shares(
  blobs: list[bytes], batch_sizes, steps: int, workers: int, size: int
) -> tuple[dict[str, float], dict[str, float]]:
  """``({B: data_seconds / wall_seconds}, {B: images/s})`` of a Trainer at each fixed batch size."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  import simigrad_jax  # pylint: disable=import-outside-toplevel

  class ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = x.astype(np.float32) / 255.0
      x = nn.relu(nn.Conv(CONV_WIDTH, (7, 7), strides=(2, 2))(x))
      x = nn.relu(nn.Conv(2 * CONV_WIDTH, (3, 3), strides=(2, 2))(x))
      x = nn.relu(nn.Conv(2 * CONV_WIDTH, (3, 3), strides=(2, 2))(x))
      return nn.Dense(10)(x.mean(axis=(1, 2)))

  def loss_fn(params, state, batch, weights, rng):
    del weights, rng
    logits = ConvNet().apply({"params": params}, batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"] % 10), state

  params = jax.tree.map(
    np.asarray,
    ConvNet().init(  # NumPy: each Trainer gets its own copy
      jax.random.key(0), np.zeros((1, size, size, 3), np.uint8)
    )["params"],
  )
  shares, rates = {}, {}
  for batch_size in batch_sizes:
    optimizer = optax.chain(
      simigrad_jax.transform("batch"), optax.sgd(0.01), simigrad_jax.scale_by_lr_factor()
    )
    controller = simigrad_jax.make_controller(
      "fixed",
      initial_batch_size=batch_size,
      batch_size_lower_bound=batch_size,
      batch_size_upper_bound=batch_size,
    )
    with (
      tempfile.TemporaryDirectory() as workdir,
      simigrad_jax.Trainer(
        loss_fn=loss_fn,
        params=params,
        optimizer=optimizer,
        source=make_source(blobs, workers, size),
        controller=controller,
        workdir=workdir,
        config=simigrad_jax.TrainerConfig(
          max_micro_batch_size=max(batch_size // len(jax.devices()), 1),
          progress=False,
          tensorboard=False,
        ),
      ) as trainer,
    ):
      trainer.train(num_steps=1)  # compiles; the workers start
      summary = trainer.train(num_steps=1 + steps)
    shares[str(batch_size)] = summary["data_seconds"] / summary["wall_seconds"]
    rates[str(batch_size)] = summary["run_examples"] / summary["wall_seconds"]
  return shares, rates


def main(argv=None) -> dict:
  from simigrad_jax.data import default_num_workers  # pylint: disable=import-outside-toplevel

  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--quick", action="store_true", help="a small run (seconds), for tests")
  parser.add_argument("--num-images", type=int, default=None)
  parser.add_argument(
    "--timed-images", type=int, default=None, help="images timed per pipeline per round"
  )
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--window", type=int, default=None)
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--batch-sizes", type=int, nargs="+", default=None)
  parser.add_argument("--trainer-workers", type=int, default=None)
  common.add_out_flag(parser, "input")
  args = parser.parse_args(argv)
  args.out = common.out_path(args.out, "input", args.quick)
  preset = QUICK if args.quick else FULL
  common.apply_preset(
    args, preset, ["num_images", "timed_images", "window", "rounds", "steps", "batch_sizes"]
  )
  size = preset.get("crop", CROP)
  trainer_workers = default_num_workers() if args.trainer_workers is None else args.trainer_workers
  blobs = [photo_jpeg(i, preset["image_size"]) for i in range(args.num_images)]
  rates = decode_rates(blobs, preset["workers"], args.timed_images, args.window, size, args.rounds)
  single = float(np.median(rates.pop("single_thread")))
  workers = {w: {"images_per_second": float(np.median(r)), "rounds": r} for w, r in rates.items()}
  speedup = float(np.median(np.array(rates["2"]) / np.array(rates["1"])))
  shares, consumed = data_wait_shares(blobs, args.batch_sizes, args.steps, trainer_workers, size)
  results = {
    "image_size": list(preset["image_size"]),
    "crop": size,
    "cores": os.cpu_count(),
    "mean_jpeg_bytes": float(np.mean([len(b) for b in blobs])),
    "single_thread": {"images_per_second": single},
    "workers": workers,
    "speedup_2_over_1": speedup,
    "trainer_workers": trainer_workers,
    "data_wait_share_by_bucket": shares,
    "trainer_images_per_second_by_bucket": consumed,
    "goals": {
      "speedup_2_over_1": speedup >= GOAL_SPEEDUP,
      "data_wait_share": max(shares.values()) < GOAL_WAIT_SHARE,
    },
  }
  lines = [
    f"decode + random-resized crop to {size} + flip, JPEGs {preset['image_size']}, "
    f"{results['mean_jpeg_bytes'] / 1e3:.0f} KB each",
    f"{'pipeline':<22}{'images/s':>10}",
    f"{'single thread':<22}{single:>10.0f}",
  ]
  lines += [
    f"{'grain, ' + w + ' worker(s)':<22}{r['images_per_second']:>10.0f}" for w, r in workers.items()
  ]
  lines.append(
    f"2 workers / 1, median of {args.rounds} paired rounds: {speedup:.2f}x "
    f"(goal >= {GOAL_SPEEDUP}x): "
    f"{'PASS' if results['goals']['speedup_2_over_1'] else 'FAIL'}"
  )
  lines.append(
    f"{'batch size':<12}{'data wait share':>16}{'images/s':>10}  "
    f"(Trainer, {trainer_workers} worker(s))"
  )
  lines += [f"{b:<12}{s:>16.1%}{consumed[b]:>10.0f}" for b, s in shares.items()]
  lines.append(
    f"data wait < {GOAL_WAIT_SHARE:.0%} at every bucket: "
    f"{'PASS' if results['goals']['data_wait_share'] else 'FAIL'}"
  )
  return common.report(results, "\n".join(lines), args.out)


if __name__ == "__main__":
  main()
