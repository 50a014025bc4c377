"""CompileConfig(whole_rows=True): the controller's decisions rounded to whole rows per device, in
the direction of the change, and adopted by the controller; recorded in the checkpoints (a resume
with another value is refused); refused where it cannot round."""

import pytest

import simigrad_jax
from simigrad_jax.checkpoint import CheckpointMismatchError
from simigrad_jax.controllers import OneStepLateController
from tests import tiny_run

EVERY_3 = simigrad_jax.CheckpointConfig(every_steps=3)
WHOLE_ROWS = simigrad_jax.CompileConfig(whole_rows=True)


def records(workdir):
  return simigrad_jax.read_metrics(str(workdir / "metrics.jsonl"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """Six steps with whole_rows, never stopped: (the records, the controller's size after)."""
  workdir = tmp_path_factory.mktemp("straight")
  trainer = tiny_run.make_trainer(workdir, compile=WHOLE_ROWS, checkpoints=EVERY_3)
  trainer.train(num_steps=6)
  return records(workdir), trainer.controller.batch_size


def test_decided_sizes_are_whole_rows_per_device_and_the_controller_adopts_them(straight):
  # The tiny run starts at 20 on 8 devices (bounds [8, 64]); the reference rule's grow and shrink
  # from a multiple of 8 in the bounds (max(B + 1, int(1.1 B)), min(B - 1, int(0.9 B))) is never
  # one, so every decision that moved the size was rounded.
  rows, adopted = straight
  moved = [r for r in rows if r["decision"] in ("grow", "shrink")]
  assert len(moved) >= 2
  assert rows[0]["batch_size"] == 20  # the first size is the controller's, as given
  assert all(r["next_batch_size"] % 8 == 0 for r in moved)
  assert [r["batch_size"] for r in rows[1:]] == [r["next_batch_size"] for r in rows[:-1]]
  assert adopted == rows[-1]["next_batch_size"]  # the controller holds the rounded size
  for r in moved:  # in the direction of the change, within the bounds
    grew = r["next_batch_size"] > r["batch_size"]
    assert grew if r["decision"] == "grow" else (not grew or r["batch_size"] == 8)


def test_a_resume_with_whole_rows_goes_on_as_a_run_never_stopped(tmp_path, straight):
  rows, _ = straight
  tiny_run.make_trainer(tmp_path, compile=WHOLE_ROWS, checkpoints=EVERY_3).train(num_steps=3)
  with pytest.raises(CheckpointMismatchError, match="whole_rows"):  # recorded, checked
    tiny_run.make_trainer(tmp_path, checkpoints=EVERY_3).train(num_steps=6)
  tiny_run.make_trainer(tmp_path, compile=WHOLE_ROWS, checkpoints=EVERY_3).train(num_steps=6)
  sizes = [(r["batch_size"], r["next_batch_size"]) for r in rows]
  assert [(r["batch_size"], r["next_batch_size"]) for r in records(tmp_path)] == sizes


def test_whole_rows_is_refused_where_it_cannot_round(tmp_path):
  objects = tiny_run.trainer_objects(tmp_path / "late")
  objects["controller"] = OneStepLateController(objects["controller"])
  with pytest.raises(ValueError, match=r"compile.whole_rows=True .* decides a step late"):
    tiny_run.trainer_with(**objects, max_micro_batch_size=4, progress=False, compile=WHOLE_ROWS)
  objects = tiny_run.trainer_objects(tmp_path / "bounds")
  objects["controller"] = simigrad_jax.Controller(
    10, 0.5, batch_size_lower_bound=9, batch_size_upper_bound=15
  )
  with pytest.raises(ValueError, match=r"multiples of the 8 data-parallel .* \[9, 15\] hold none"):
    tiny_run.trainer_with(**objects, max_micro_batch_size=4, progress=False, compile=WHOLE_ROWS)
