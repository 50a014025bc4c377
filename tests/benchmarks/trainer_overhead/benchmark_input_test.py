"""benchmarks/trainer_overhead/input.py: a quick run, its JSON layout, and its measurements."""

import json
import math

import numpy as np
import pytest


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
  """One ``--quick`` run: (the JSON written to --out, the dict main returned)."""
  from benchmarks.trainer_overhead import input as module  # pylint: disable=import-outside-toplevel

  out = tmp_path_factory.mktemp("input") / "input.json"
  returned = module.main(["--quick", "--trainer-workers", "1", "--out", str(out)])
  return json.loads(out.read_text()), returned, module


def test_layout_and_every_number_finite(quick_run):
  written, returned, module = quick_run
  assert set(written["workers"]) == {"1", "2"}
  rates = [written["single_thread"]["images_per_second"]] + [
    w["images_per_second"] for w in written["workers"].values()
  ]
  assert all(math.isfinite(r) and r > 0 for r in rates)
  shares = written["data_wait_share_by_bucket"]
  assert list(shares) == [str(b) for b in module.QUICK["batch_sizes"]]
  assert all(0 <= s <= 1 for s in shares.values())
  consumed = written["trainer_images_per_second_by_bucket"]
  assert list(consumed) == list(shares) and all(r > 0 for r in consumed.values())
  one, two = (written["workers"][w]["rounds"] for w in ("1", "2"))
  assert len(one) == len(two) == module.QUICK["rounds"]
  assert rates[1] == pytest.approx(float(np.median(one)))
  assert (
    written["speedup_2_over_1"]
    == pytest.approx(float(np.median(np.array(two) / np.array(one))))
    == pytest.approx(returned["speedup_2_over_1"])
  )
  assert set(written["goals"]) == {"speedup_2_over_1", "data_wait_share"}


def test_the_work_is_a_flipped_random_crop_of_a_photo_like_image(quick_run):
  import io  # pylint: disable=import-outside-toplevel

  import numpy as np  # pylint: disable=import-outside-toplevel
  from PIL import Image  # pylint: disable=import-outside-toplevel

  module = quick_run[2]
  blob = module.photo_jpeg(3, (120, 100))
  image = np.asarray(Image.open(io.BytesIO(blob)))
  assert image.shape == (100, 120, 3) and image.std() > 20  # not a constant colour
  work = module.DecodeCropFlip(32)
  crops = [
    work({"jpeg": blob, "label": 3}, np.random.default_rng([0, p]))["image"] for p in range(4)
  ]
  assert all(c.shape == (32, 32, 3) and c.dtype == np.uint8 for c in crops)
  assert len({c.tobytes() for c in crops}) == 4  # each position its own crop
  np.testing.assert_array_equal(
    crops[1], work({"jpeg": blob, "label": 3}, np.random.default_rng([0, 1]))["image"]
  )
