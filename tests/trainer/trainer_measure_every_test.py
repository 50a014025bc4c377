"""TrainerConfig(measure_every=k): the similarity measured on every k-th step, plain steps between.

Which steps measure depends on the step number alone, so a run resumed on a
plain step takes the same steps as one that was never stopped; the
controller is updated on the measuring steps only and holds its batch size
between them; the checkpoints record ``k``, and a resume with another is
refused.
"""

from unittest import mock

import jax
import numpy as np
import pytest

import simigrad_jax
from simigrad_jax.checkpoint import CheckpointMismatchError
from simigrad_jax.controllers import interface as controller_interface
from tests import tiny_run

EVERY_3 = simigrad_jax.CheckpointConfig(every_steps=3)


def records(workdir):
  return simigrad_jax.read_metrics(str(workdir / "metrics.jsonl"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """Six steps of measure_every=2, never stopped: (the records, the parameters)."""
  workdir = tmp_path_factory.mktemp("straight")
  trainer = tiny_run.make_trainer(workdir, measure_every=2, checkpoints=EVERY_3)
  trainer.train(num_steps=6)
  return records(workdir), jax.device_get(trainer.state["params"])


def test_every_other_step_measures_and_the_batch_holds_between(straight):
  steps, _ = straight
  assert len(steps) == 6
  measured = [record["similarity"] is not None for record in steps]  # None: not measured
  assert measured == [True, False] * 3
  sizes = [record["batch_size"] for record in steps]
  assert sizes[1] == sizes[2] and sizes[3] == sizes[4]  # decided after steps 0 and 2 only
  assert len(set(sizes)) > 1  # the measurements moved it


def test_a_resume_on_a_plain_step_is_exact(straight, tmp_path):
  expected, params = straight
  tiny_run.make_trainer(tmp_path, measure_every=2, checkpoints=EVERY_3).train(num_steps=3)
  resumed = tiny_run.make_trainer(tmp_path, measure_every=2, checkpoints=EVERY_3)
  resumed.train(num_steps=6)  # from step 3, a plain step
  got = records(tmp_path)
  for key in ("batch_size", "loss", "similarity"):
    np.testing.assert_array_equal([r[key] for r in got], [r[key] for r in expected], key)
  for a, b in zip(jax.tree.leaves(resumed.state["params"]), jax.tree.leaves(params), strict=True):
    np.testing.assert_array_equal(np.asarray(jax.device_get(a)), b)


def test_a_resume_with_another_k_is_refused(tmp_path):
  tiny_run.make_trainer(tmp_path, measure_every=2, checkpoints=EVERY_3).train(num_steps=3)
  with pytest.raises(CheckpointMismatchError, match="measure_every"):
    tiny_run.make_trainer(tmp_path, measure_every=3, checkpoints=EVERY_3).train(num_steps=6)


def test_measure_every_must_be_a_positive_int():
  with pytest.raises(ValueError, match="measure_every must be an integer >= 1"):
    simigrad_jax.TrainerConfig(max_micro_batch_size=4, measure_every=0)


def test_a_controller_of_k_steps_per_update_moves_at_its_rate_per_step(tmp_path):
  """steps_per_update=4 with measure_every=4: each block of 4 steps runs the size that 4 updates
  with its measuring step's similarity decide; a step of several micro-batches between measures
  (recorded) but is not read."""
  spaced = simigrad_jax.Controller(
    20, 0.5, batch_size_lower_bound=8, batch_size_upper_bound=64, steps_per_update=4
  )
  objects = {**tiny_run.trainer_objects(tmp_path), "controller": spaced}
  settings = dict(max_micro_batch_size=4, seed=3, progress=False, tensorboard=False)
  check = mock.patch.object(
    controller_interface, "steps_per_update", wraps=controller_interface.steps_per_update
  )
  with check as checked:
    tiny_run.trainer_with(**objects, **settings, measure_every=4).train(num_steps=12)
  checked.assert_called_once_with(spaced, 4)  # read once, before anything is created
  steps = records(tmp_path)
  assert len(steps) == 12 and spaced.step == 3  # updated on steps 0, 4 and 8 only
  single = simigrad_jax.Controller(20, 0.5, batch_size_lower_bound=8, batch_size_upper_bound=64)
  for start in (0, 4, 8):  # a measuring step runs the size the last one decided
    assert steps[start]["batch_size"] == single.batch_size
    for _ in range(4):  # the four updates the measurement stands for
      single.update(steps[start]["similarity"])
    assert [r["decision"] for r in steps[start + 1 : start + 4]] == [None] * 3
    assert {r["batch_size"] for r in steps[start + 1 : start + 5]} == {single.batch_size}
  assert spaced.batch_size == single.batch_size
  assert len({r["batch_size"] for r in steps}) > 2  # it moved after the measurements
  assert any(r["similarity"] is not None for i, r in enumerate(steps) if i % 4)  # 2 micro-steps


def test_steps_per_update_other_than_1_or_measure_every_is_refused(tmp_path):
  spaced = simigrad_jax.Controller(
    20, 0.5, batch_size_lower_bound=8, batch_size_upper_bound=64, steps_per_update=4
  )
  objects = {**tiny_run.trainer_objects(tmp_path), "controller": spaced}
  with pytest.raises(ValueError, match=r"steps_per_update'\] must be 1 .* \(2: .*got 4"):
    tiny_run.trainer_with(**objects, max_micro_batch_size=4, progress=False, measure_every=2)
  assert not list(tmp_path.iterdir())  # refused before anything was written


def test_a_resume_with_another_steps_per_update_is_refused(tmp_path):
  def run(steps_per_update):
    controller = simigrad_jax.Controller(
      20,
      0.5,
      batch_size_lower_bound=8,
      batch_size_upper_bound=64,
      steps_per_update=steps_per_update,
    )
    objects = {**tiny_run.trainer_objects(tmp_path), "controller": controller}
    settings = dict(max_micro_batch_size=4, seed=3, progress=False, tensorboard=False)
    return tiny_run.trainer_with(**objects, **settings, measure_every=2, checkpoints=EVERY_3)

  run(2).train(num_steps=3)
  with pytest.raises(CheckpointMismatchError, match="steps_per_update"):
    run(1).train(num_steps=6)
