"""Tests for simigrad_jax.GrainSource and its StreamReader: order, resume, bad input, workers."""

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import simigrad_jax
from grain_records import JpegRecords
from grain_records import flip
from simigrad_jax.data.sampler import EpochSampler

N = 24


def stream(sampler, start, count):
  """The sampler's indices at positions ``[start, start + count)`` (any count)."""
  return np.array([sampler.indices_at(p, 1)[0] for p in range(start, start + count)])


def test_get_batch_decodes_records_and_pads():
  source = simigrad_jax.GrainSource(JpegRecords(N), num_workers=0)
  assert len(source) == N
  assert source.element_spec == {
    "image": ((12, 10, 3), np.dtype(np.uint8)),
    "label": ((), np.dtype(np.int32)),
    "index": ((), np.dtype(np.int32)),
  }
  batch = source.get_batch(np.array([[5, -1], [0, 23]]))
  assert batch["index"].tolist() == [[5, 0], [0, 23]] and batch["image"].shape == (2, 2, 12, 10, 3)
  assert not batch["image"][0, 1].any() and batch["image"][0, 0].std() > 5  # decoded, not flat
  with pytest.raises(IndexError, match=r"\[0, 24\)"):
    source.get_batch(np.array([24]))


@pytest.mark.parametrize(
  "bad,match",
  [
    (dict(num_workers=-1), "num_workers must be an integer >= 0"),
    (dict(on_bad_record="ignore"), "on_bad_record='ignore' is not valid"),
    (dict(buffer_size=0), "buffer_size must be an integer >= 1"),
  ],
)
def test_bad_settings_are_refused(bad, match):
  with pytest.raises(ValueError, match=match):
    simigrad_jax.GrainSource(JpegRecords(2), **bad)


def test_workers_serve_the_sampler_order_across_windows_seeks_and_epochs():
  sampler = EpochSampler(N, seed=3)
  source = simigrad_jax.GrainSource(JpegRecords(N), num_workers=2, buffer_size=4, augment=flip)
  reference = simigrad_jax.GrainSource(JpegRecords(N), num_workers=0, augment=flip)
  # Windows as the Trainer asks for them: overlapping by the speculative rows, growing and
  # shrinking, crossing epochs; then a seek back (a resume) and one far ahead.
  windows = [(0, 7), (5, 12), (15, 22), (37, 3), (40, 20), (10, 5), (6000, 6)]
  with source.reader(sampler) as reader, reference.reader(sampler) as expected:
    for start, count in windows:
      positions = np.arange(start, start + count)
      got = reader.read(positions)
      assert got["index"].tolist() == stream(sampler, start, count).tolist()
      np.testing.assert_array_equal(got["image"], expected.read(positions)["image"])
    # Only this process's rows of a window (every other one).
    got = reader.read(np.arange(6001, 6012, 2))
    assert got["index"].tolist() == stream(sampler, 6001, 11)[::2].tolist()
  assert reader.restarts == 3  # the first window, the seek back, the jump ahead


def test_a_corrupt_record_raises_naming_its_index():
  source = simigrad_jax.GrainSource(JpegRecords(N, corrupt=(7,)), num_workers=1, buffer_size=2)
  sampler = EpochSampler(N, seed=0, shuffle=False)
  with source.reader(sampler) as reader:
    assert reader.read(np.arange(5))["index"].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(
      simigrad_jax.data.BadRecordError, match="record 7 could not be read"
    ) as info:
      reader.read(np.arange(5, 10))
  assert info.value.index == 7
  with pytest.raises(simigrad_jax.data.BadRecordError, match="record 7"):
    source.get_batch(np.array([7]))


def test_skip_takes_the_next_record_and_counts_and_logs_the_bad_ones(caplog):
  source = simigrad_jax.GrainSource(
    JpegRecords(N, corrupt=(3, 4, 9)), num_workers=1, on_bad_record="skip"
  )
  sampler = EpochSampler(N, seed=0, shuffle=False)
  with source.reader(sampler) as reader:
    index = reader.read(np.arange(12))["index"].tolist()
  assert index == [0, 1, 2, 5, 5, 5, 6, 7, 8, 10, 10, 11]
  assert source.bad_records == [3, 4, 4, 9]  # record 3's row tried 3 then 4
  assert "skipped bad record 9" in caplog.text


def test_a_dead_worker_raises_within_seconds():
  source = simigrad_jax.GrainSource(JpegRecords(N, die_at=6), num_workers=1, buffer_size=2)
  sampler = EpochSampler(N, seed=0, shuffle=False)
  with source.reader(sampler) as reader:
    reader.read(np.arange(3))
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="terminated unexpectedly"):
      reader.read(np.arange(3, 20))
    assert time.monotonic() - began < 10


def test_a_script_that_does_not_close_its_reader_exits_cleanly(tmp_path):
  """No traceback and no leaked shared memory at exit, closed or not (the atexit hook)."""
  script = tmp_path / "script.py"
  script.write_text(
    textwrap.dedent("""
      import numpy as np
      import simigrad_jax
      from grain_records import JpegRecords
      from simigrad_jax.data.sampler import EpochSampler

      if __name__ == "__main__":
        source = simigrad_jax.GrainSource(JpegRecords(8), num_workers=1)
        reader = source.reader(EpochSampler(8, seed=0))
        batch = reader.read(np.arange(6))
        print("read", batch["image"].shape)
      """)
  )
  tests = str(__import__("pathlib").Path(__file__).parent.parent)
  result = subprocess.run(
    [sys.executable, str(script)],
    capture_output=True,
    text=True,
    timeout=120,
    env={**__import__("os").environ, "PYTHONPATH": tests},
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert "read (6, 12, 10, 3)" in result.stdout
  assert "Traceback" not in result.stderr and "leaked" not in result.stderr, result.stderr[-2000:]


def test_the_trainer_takes_grain_style_data(tmp_path):
  """A list of dicts (or a grain.MapDataset) goes to the Trainer as it is."""
  import grain  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(0)
  rows = [{"x": rng.normal(size=3).astype(np.float32), "y": np.int32(i % 2)} for i in range(40)]
  data = grain.MapDataset.source(rows).map(lambda r: {**r, "x": r["x"] * 2})

  def loss_fn(params, state, batch, weights, key):
    del weights, key
    logits = batch["x"] @ params["w"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), state

  optimizer = optax.chain(
    simigrad_jax.transform("batch"), optax.sgd(0.1), simigrad_jax.scale_by_lr_factor()
  )
  with simigrad_jax.Trainer(
    loss_fn=loss_fn,
    params={"w": np.zeros((3, 2), np.float32)},
    optimizer=optimizer,
    source=data,
    controller=simigrad_jax.Controller(8, 0.3, batch_size_lower_bound=4, batch_size_upper_bound=16),
    workdir=tmp_path / "run",
    config=simigrad_jax.TrainerConfig(max_micro_batch_size=4, progress=False, tensorboard=False),
  ) as trainer:
    assert isinstance(trainer.source, simigrad_jax.GrainSource)
    summary = trainer.train(num_steps=3)
  assert summary["steps"] == 3 and np.isfinite(summary["loss"])
