"""Data for tests/grain_source_test.py that grain's spawned worker processes can import."""

import io
import os
import time

import numpy as np


def jpeg_bytes(index: int, size: tuple[int, int] = (12, 10)) -> bytes:
  """A small photo-like JPEG (a gradient and noise, seeded by ``index``)."""
  from PIL import Image  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(index)
  height, width = size
  ramp = np.linspace(0, 200, width)[None, :, None] + np.linspace(0, 50, height)[:, None, None]
  pixels = np.clip(ramp + rng.normal(0, 20, (height, width, 3)), 0, 255).astype(np.uint8)
  out = io.BytesIO()
  Image.fromarray(pixels).save(out, format="JPEG", quality=90)
  return out.getvalue()


class JpegRecords:
  """Record ``i``: a decoded JPEG and its label; the records in ``corrupt`` are truncated.

  Args:
    num_records: how many.
    corrupt: indices whose JPEG bytes are cut to their first 100 bytes.
    die_at: a record whose read ends the worker process (os._exit).
  """

  def __init__(self, num_records: int, corrupt: tuple[int, ...] = (), die_at: int | None = None):
    self.blobs = [jpeg_bytes(i) for i in range(num_records)]
    for i in corrupt:
      self.blobs[i] = self.blobs[i][:100]
    self.die_at = die_at
    self.parent = os.getpid()

  def __len__(self) -> int:
    return len(self.blobs)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    from PIL import Image  # pylint: disable=import-outside-toplevel

    if index == self.die_at and os.getpid() != self.parent:
      time.sleep(0.2)
      os._exit(3)  # pylint: disable=protected-access
    image = np.asarray(Image.open(io.BytesIO(self.blobs[index])).convert("RGB"))
    return {"image": image, "label": np.int32(index % 10), "index": np.int32(index)}


def flip(example: dict, rng: np.random.Generator) -> dict:
  """Flips the image half of the time (host-side augmentation, seeded per stream position)."""
  return {**example, "image": example["image"][:, ::-1] if rng.random() < 0.5 else example["image"]}
