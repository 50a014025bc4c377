"""StepInputs: a step's scalars on the devices, placed ahead for the likely next sizes."""

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import simigrad_jax
from simigrad_jax.trainer.step_inputs import StepInputs
from tests import tiny_run


def make_inputs(lr_schedule=None):
  replicated = NamedSharding(Mesh(np.array(jax.devices()), ("batch",)), P())
  return StepInputs(
    base_batch_size=100,
    lr_rule="sqrt",
    lr_adjust_factor=None,
    lr_schedule=lr_schedule,
    lr_factor=1.0,
    replicated=replicated,
  )


def test_scalars_placed_ahead_are_those_of_the_decided_size():
  inputs = make_inputs(lambda epochs: 0.5 if epochs >= 1 else 1.0)
  inputs.place_ahead([121, 99, 110], epochs=1.0, remaining=115)  # the run ends in 115 examples
  placed = dict(inputs._ahead)
  inputs.set_lr_factor(inputs.lr_factors(121, 1.0))  # the controller decided 121
  on_devices = inputs.on_devices(115)  # the last step takes what is left
  assert any(on_devices is array for array in placed.values())  # no transfer now
  np.testing.assert_allclose(np.asarray(on_devices), [115, 0.5 * 1.1, 58], rtol=1e-6)
  inputs.set_lr_factor(inputs.lr_factors(90, 1.0))  # not placed ahead: placed now
  np.testing.assert_allclose(np.asarray(inputs.on_devices(90)), [90, 0.5 * 0.9**0.5, 45], rtol=1e-6)


def test_a_failing_schedule_is_left_to_the_decision():
  inputs = make_inputs(lambda epochs: float("nan"))
  inputs.place_ahead([110, 90], epochs=0.5, remaining=float("inf"))
  assert inputs._ahead == {}


def test_the_trainer_couples_the_factor_to_the_schedules_peak_when_asked(tmp_path):
  schedule = lambda epochs: max(0.05, 1.0 - epochs / 2)  # noqa: E731  (decays over 2 epochs)
  objects = tiny_run.trainer_objects(tmp_path)
  objects["controller"] = simigrad_jax.make_controller(
    "linear", initial_batch_size=16, final_batch_size=64, ramp_epochs=2.0
  )
  with tiny_run.trainer_with(
    **objects,
    lr_schedule=schedule,
    lr=simigrad_jax.LearningRateConfig(coupling="peak"),
    max_micro_batch_size=8,
    progress=False,
    tensorboard=False,
  ) as trainer:
    trainer.train(num_epochs=2)
  records = [r for r in simigrad_jax.read_metrics(tmp_path / "metrics.jsonl") if "batch_size" in r]
  assert records[-1]["batch_size"] > 32  # the batch grew while the schedule decayed
  for r in records[:-1]:  # (the last step, cut short to the budget, runs the decided size's)
    s, grown = r["schedule_factor"], (r["batch_size"] / 16) ** 0.5
    np.testing.assert_allclose(r["lr_factor"], s * (1 + (grown - 1) * s), rtol=1e-6)
