"""An honest resume: a run is recorded in its checkpoints, and a changed run is refused or recorded.

A finished 4-step run (checkpoints at steps 2 and 4) is resumed with a
changed learning rate, data set, model or device count, and from a
checkpoint written before runs were recorded. A changed setting is refused
with the differences listed unless ``checkpoints.allow_changed_settings=True``,
which resumes and keeps the change in the history every later checkpoint
carries; fewer devices resume exactly and are recorded. Also: the caller's parameters
are not donated, so they can start a second Trainer.
"""

from __future__ import annotations

import logging
import pathlib
import re
import shutil

import jax
import numpy as np
import optax
import pytest
from reliability_bad_input_test import CHECKPOINTS
from reliability_bad_input_test import TinyMLP
from reliability_bad_input_test import controller
from reliability_bad_input_test import dataset
from reliability_bad_input_test import trainer

import simigrad_jax
from simigrad_jax.checkpoint.checkpointer import Checkpointer

pytestmark = pytest.mark.reliability

# The run's record lists the learning rate of optax.sgd as the step size of its last part.
STEP_SIZE = r"optimizer.hyperparameters.update.update_fns\[1\].update_fns\[1\].tx.update.step_size"
ALLOWING_CHANGES = CHECKPOINTS.replace(allow_changed_settings=True)


def sgd(learning_rate):
  return optax.chain(
    simigrad_jax.transform("batch"),
    optax.sgd(learning_rate, momentum=0.9),
    simigrad_jax.scale_by_lr_factor(),
  )


def records(workdir):
  return [
    r for r in simigrad_jax.read_metrics(pathlib.Path(workdir) / "metrics.jsonl") if "loss" in r
  ]


def saved_host(workdir, like):
  """The host record of the workdir's newest checkpoint."""
  checkpointer = Checkpointer(pathlib.Path(workdir) / "checkpoints")
  try:
    return checkpointer.restore(like)[1]
  finally:
    checkpointer.close()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """A 4-step run on 8 devices, checkpointed at steps 2 and 4: its workdir and its last state."""
  workdir = tmp_path_factory.mktemp("recorded")
  with trainer(workdir, run_settings={"learning_rate": 0.1}) as t:
    t.train(num_steps=4)
  return workdir, t.state


@pytest.fixture
def workdir(finished_run, tmp_path):
  copy = tmp_path / "run"
  shutil.copytree(finished_run[0], copy)
  return copy


def test_a_changed_learning_rate_and_data_set_are_refused_then_allowed_and_recorded(
  workdir, caplog
):
  changed = dict(
    optimizer=sgd(2.0), data=dataset(num_examples=180), run_settings={"learning_rate": 2.0}
  )
  before = (workdir / "metrics.jsonl").read_bytes()
  with pytest.raises(simigrad_jax.checkpoint.CheckpointMismatchError) as refused:
    trainer(workdir, **changed)
  message = str(refused.value)
  for difference in (
    rf"{STEP_SIZE}: -0.1 there, -2.0 here",
    r"settings.learning_rate: 0.1 there, "
    r"2.0 here",
    r"data.num_examples: 200 there, 180 here",
  ):
    assert any(re.fullmatch(rf"  - {difference}", line) for line in message.splitlines()), (
      difference,
      message,
    )
  assert "allow_changed_settings=True" in message
  assert isinstance(refused.value, ValueError)
  assert (workdir / "metrics.jsonl").read_bytes() == before  # nothing ran

  with caplog.at_level(logging.WARNING, logger="simigrad_jax"):
    resumed = trainer(workdir, checkpoints=ALLOWING_CHANGES, **changed)
  assert resumed.step == 4 and resumed.sampler.num_examples == 180
  assert "made by a run with other settings" in caplog.text and "-2.0 here" in caplog.text
  with resumed:
    resumed.train(num_steps=6)
  host = saved_host(workdir, resumed.state)
  assert host["step"] == 6
  [change] = host["run_changes"]
  assert change["step"] == 4 and change["environment"] == []
  assert "data.num_examples: 200 there, 180 here" in change["settings"]
  assert "settings.learning_rate: 0.1 there, 2.0 here" in change["settings"]
  assert host["run"]["settings"] == {"learning_rate": 2.0}  # the run is now this one
  assert [r["step"] for r in records(workdir)] == list(range(1, 7))
  # The next resume, with the same settings, finds nothing to record.
  with trainer(workdir, **changed) as again:
    again.train(num_steps=7)
  assert len(saved_host(workdir, again.state)["run_changes"]) == 1


def test_a_changed_model_is_refused_even_when_changes_are_allowed(workdir):
  with pytest.raises(
    simigrad_jax.checkpoint.CheckpointMismatchError,
    match=r"(?s)the runs differ in:\n.*  - model.params\['Dense_0'\]\['kernel'\]: "
    r"'float32\[8, 3\]' there, 'float32\[16, 3\]' here.*allowed or not",
  ):
    trainer(workdir, hidden=16, checkpoints=ALLOWING_CHANGES)


def test_a_changed_injected_learning_rate_takes_effect_when_allowed(tmp_path):
  """``inject_hyperparams`` keeps the learning rate in the state: the checkpoint's value would
  silently win over the new one if the resume did not put the new one in."""

  def injected(learning_rate):
    return optax.chain(
      simigrad_jax.transform("batch"),
      optax.inject_hyperparams(optax.sgd)(learning_rate=learning_rate),
      simigrad_jax.scale_by_lr_factor(),
    )

  with trainer(tmp_path, optimizer=injected(0.1)) as first:
    first.train(num_steps=2)
  with pytest.raises(
    simigrad_jax.checkpoint.CheckpointMismatchError,
    match=r"optimizer.injected\['opt_state'\]\[1\].hyperparams"
    r"\['learning_rate'\]: 0.1 there, 0.05 here",
  ):
    trainer(tmp_path, optimizer=injected(0.05))
  with trainer(tmp_path, optimizer=injected(0.05), checkpoints=ALLOWING_CHANGES) as resumed:
    assert resumed.step == 2
    learning_rate = resumed.state["opt_state"][1].hyperparams["learning_rate"]
    assert float(np.asarray(learning_rate.addressable_data(0))) == pytest.approx(0.05)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
  """The same run as ``finished_run``, 8 steps on 8 devices without a break."""
  workdir = tmp_path_factory.mktemp("straight")
  with trainer(workdir, run_settings={"learning_rate": 0.1}) as t:
    t.train(num_steps=8)
  return records(workdir)


def test_a_resume_on_fewer_devices_is_exact_and_recorded(workdir, straight_run, caplog):
  with caplog.at_level(logging.WARNING, logger="simigrad_jax"):
    resumed = trainer(workdir, devices=jax.devices()[:4], run_settings={"learning_rate": 0.1})
  assert resumed.step == 4 and resumed.num_devices == 4
  assert "devices.num_devices: 8 there, 4 here" in caplog.text
  with resumed:
    resumed.train(num_steps=8)
  got = records(workdir)
  assert [r["step"] for r in got] == list(range(1, 9))
  for key in ("batch_size", "examples_seen", "lr_factor", "next_batch_size", "decision"):
    assert [r[key] for r in got] == [r[key] for r in straight_run], key
  np.testing.assert_allclose(
    [r["loss"] for r in got], [r["loss"] for r in straight_run], rtol=0, atol=1e-5
  )
  [change] = saved_host(workdir, resumed.state)["run_changes"]
  assert change == {
    "step": 4,
    "settings": [],
    "environment": ["devices.num_devices: 8 there, 4 here"],
  }


def test_a_checkpoint_written_before_runs_were_recorded_still_resumes(
  workdir, finished_run, caplog
):
  """An older simigrad_jax saved no record: the checkpoint resumes with a warning, and the
  next checkpoint holds the record."""
  checkpoints = workdir / "checkpoints"
  checkpointer = Checkpointer(checkpoints)
  state, host, step = checkpointer.restore(finished_run[1])
  for old in checkpointer.all_steps():
    shutil.rmtree(checkpoints / str(old))
  checkpointer.close()
  checkpointer = Checkpointer(checkpoints)
  checkpointer.save(step, state, {k: v for k, v in host.items() if not k.startswith("run")})
  checkpointer.close()

  with caplog.at_level(logging.WARNING, logger="simigrad_jax"):
    resumed = trainer(workdir, run_settings={"learning_rate": 0.1})
  assert resumed.step == 4
  assert "written before simigrad_jax recorded a run's settings" in caplog.text
  with resumed:
    resumed.train(num_steps=6)
  host = saved_host(workdir, resumed.state)
  assert host["step"] == 6 and host["run"]["settings"] == {"learning_rate": 0.1}
  assert host["run_changes"] == []


def test_the_same_parameters_start_two_trainers(tmp_path):
  """The Trainer donates its state's buffers to the step: it copies the caller's arrays first."""
  params = TinyMLP().init(jax.random.key(0), np.zeros((1, 5), np.float32))["params"]
  summaries = []
  for name in ("first", "second"):  # one batch size: one compiled shape
    with trainer(
      tmp_path / name,
      params=params,
      controller=controller(
        enable_adjust=False, batch_size_lower_bound=24, batch_size_upper_bound=24
      ),
    ) as t:
      summaries.append(t.train(num_steps=1))
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(params))
  assert summaries[0]["loss"] == summaries[1]["loss"]  # the same start, the same run
