"""Bad settings and inputs: each refused before any step, naming the value and what is valid.

A table of cases over the Trainer, its controller, data and checkpoints. For
every case the test also checks that nothing was trained: the workdir's
metrics file is unchanged (absent for a new run).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import simigrad_jax
from tiny_run import trainer_with

pytestmark = pytest.mark.reliability


class TinyMLP(nn.Module):
  hidden: int = 8

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.tanh(nn.Dense(self.hidden)(x)))


def dataset(num_examples=200, features=5):
  rng = np.random.default_rng(0)
  return {
    "x": rng.normal(size=(num_examples, features)).astype(np.float32),
    "y": rng.integers(0, 3, size=num_examples).astype(np.int32),
  }


def mlp_loss(params, model_state, batch, weights, rng):
  del weights, rng
  logits = TinyMLP().apply({"params": params}, batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), model_state


def optimizer(axis_name="batch", *, transform=True, lr_factor=True):
  parts = ([simigrad_jax.transform(axis_name)] if transform else []) + [
    optax.sgd(0.1, momentum=0.9)
  ]
  return optax.chain(*parts, *([simigrad_jax.scale_by_lr_factor()] if lr_factor else []))


def controller(**overrides):
  options = dict(
    initial_batch_size=24,
    similarity_target=0.3,
    batch_size_lower_bound=8,
    batch_size_upper_bound=64,
  )
  options.update(overrides)
  return simigrad_jax.Controller(
    options.pop("initial_batch_size"), options.pop("similarity_target"), **options
  )


CHECKPOINTS = simigrad_jax.CheckpointConfig(every_steps=2)  # the tiny run's


def trainer(workdir, *, hidden=8, data=None, **overrides):
  kwargs = dict(
    loss_fn=mlp_loss,
    params=TinyMLP(hidden).init(jax.random.key(0), np.zeros((1, 5), np.float32))["params"],
    optimizer=optimizer(),
    source=simigrad_jax.ArraySource(dataset() if data is None else data),
    controller=controller(),
    workdir=workdir,
    max_micro_batch_size=4,
    seed=3,
    progress=False,
    tensorboard=False,
    checkpoints=CHECKPOINTS,
  )
  kwargs.update(overrides)
  return trainer_with(**kwargs)


def without_extra_args(inner):
  """``inner`` behind an update that takes no keyword arguments (so no ``half_grads``)."""
  return optax.GradientTransformation(inner.init, lambda u, s, p=None: inner.update(u, s, p))


def dropping_extra_args(inner):
  """``inner`` behind an update that takes keyword arguments but does not pass them on."""
  return optax.GradientTransformationExtraArgs(
    inner.init, lambda u, s, p=None, **extra: inner.update(u, s, p)
  )


def nan_params():
  params = TinyMLP().init(jax.random.key(0), np.zeros((1, 5), np.float32))["params"]
  kernel = params["Dense_0"]["kernel"].at[0, 0].set(jnp.nan)
  return {**params, "Dense_0": {**params["Dense_0"], "kernel": kernel}}


def mean_loss(params, model_state, batch, weights, rng):
  losses, state = mlp_loss(params, model_state, batch, weights, rng)
  return jnp.mean(losses), state  # a common mistake: the mean, not one loss per row


def image_loss(params, model_state, batch, weights, rng):
  del weights, rng
  logits = TinyMLP().apply({"params": params}, batch["image"])  # the source has no "image"
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), model_state


def train_with(trainer_kwargs: dict, **train_kwargs):
  def run(workdir):
    with trainer(workdir, **trainer_kwargs) as t:
      t.train(**train_kwargs)

  return run


def resume_with(**overrides):
  """A second run in a workdir that holds a finished run's checkpoints (copied in by the test)."""
  return lambda workdir: trainer(workdir, **overrides)


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  run: Callable[[pathlib.Path], Any]
  error: type[Exception]
  match: str
  resume: bool = False  # the workdir starts with a finished 4-step run's checkpoints


def _path_file(workdir):
  workdir.parent.mkdir(parents=True, exist_ok=True)
  workdir.write_text("not a directory")
  return trainer(workdir)


CASES = [
  # The controller's own settings.
  Case(
    "similarity target above 1",
    lambda w: controller(similarity_target=1.5),
    ValueError,
    r"similarity_target must be a number in \[-1, 1\], got 1.5",
  ),
  Case(
    "similarity target NaN",
    lambda w: controller(similarity_target=math.nan),
    ValueError,
    r"similarity_target must be a number in \[-1, 1\], got nan",
  ),
  Case(
    "inverted bounds",
    lambda w: controller(batch_size_lower_bound=64, batch_size_upper_bound=32),
    ValueError,
    r"batch_size_lower_bound \(64\) must not exceed batch_size_upper_bound \(32\)",
  ),
  Case(
    "initial batch outside the bounds",
    lambda w: controller(initial_batch_size=4),
    ValueError,
    r"initial_batch_size must lie within \[batch_size_lower_bound, batch_size_upper_bound\] = "
    r"\[8, 64\], got 4",
  ),
  Case(
    "smooth factor 1",
    lambda w: controller(smooth_factor=1.0),
    ValueError,
    r"smooth_factor must be a number in \[0, 1\), got 1.0",
  ),
  Case(
    "unknown controller name",
    lambda w: simigrad_jax.make_controller("adaptive", initial_batch_size=8),
    ValueError,
    r"unknown controller 'adaptive'; choose one of \(.*'simigrad'",
  ),
  Case(
    "misspelt controller option",
    lambda w: simigrad_jax.make_controller("simigrad", initial_batch_size=24, similarity_targt=0.3),
    TypeError,
    r"similarity_targt",
  ),
  Case(
    "controller given by name to the Trainer",
    lambda w: trainer(w, controller="simigrad"),
    ValueError,
    r"controller must be a controller object, got 'simigrad'; build one with "
    r"simigrad_jax.make_controller",
  ),
  # The Trainer's settings.
  Case(
    "max micro-batch 0",
    lambda w: trainer(w, max_micro_batch_size=0),
    ValueError,
    r"max_micro_batch_size must be an integer >= 1, got 0",
  ),
  Case(
    "max micro-batch 2.5",
    lambda w: trainer(w, max_micro_batch_size=2.5),
    ValueError,
    r"max_micro_batch_size must be an integer >= 1, got 2.5 \(float\)",
  ),
  Case(
    "min micro-batch above max",
    lambda w: trainer(w, compile=simigrad_jax.CompileConfig(min_micro_batch_size=8)),
    ValueError,
    r"compile.min_micro_batch_size must be None or an integer in \[1, max_micro_batch_size=4\], got 8",
  ),
  Case(
    "unknown mode",
    lambda w: trainer(w, compile=simigrad_jax.CompileConfig(mode="fast")),
    ValueError,
    r"compile.mode='fast' is not valid; choose one of \('recompile', 'pad'\)",
  ),
  Case(
    "unknown lr rule",
    lambda w: trainer(w, lr=simigrad_jax.LearningRateConfig(rule="cube")),
    ValueError,
    r"lr.rule='cube' is not valid; choose one of \('sqrt', 'linear', 'none'\)",
  ),
  Case(
    "negative lr adjust factor",
    lambda w: trainer(w, lr=simigrad_jax.LearningRateConfig(adjust_factor=-1.0)),
    ValueError,
    r"lr.adjust_factor must be a number in \[0, inf\), got -1.0",
  ),
  Case(
    "lr adjust factor that turns the lr negative",
    lambda w: trainer(w, lr=simigrad_jax.LearningRateConfig(adjust_factor=3.0)),
    ValueError,
    r"lr_factor would be -0.26.* at batch_size=8, base_batch_size=24",
  ),
  Case(
    "checkpoint every 0 steps",
    lambda w: trainer(w, checkpoints=CHECKPOINTS.replace(every_steps=0)),
    ValueError,
    r"checkpoints.every_steps must be an integer >= 1, got 0",
  ),
  Case(
    "keep 0 checkpoints",
    lambda w: trainer(w, checkpoints=CHECKPOINTS.replace(max_to_keep=0)),
    ValueError,
    r"checkpoints.max_to_keep must be an integer >= 1, got 0",
  ),
  Case(
    "negative seed",
    lambda w: trainer(w, seed=-1),
    ValueError,
    r"seed must be an integer >= 0, got -1",
  ),
  Case(
    "agreement timeout 0",
    lambda w: trainer(w, agreement_timeout_seconds=0),
    ValueError,
    r"agreement_timeout_seconds must be a number in \(0, inf\) \(finite\), got 0",
  ),
  Case(
    "workdir parent missing",
    lambda w: trainer(w / "no" / "such" / "run"),
    ValueError,
    r"the workdir's parent '.*/no/such' does not exist",
  ),
  Case(
    "workdir is a file",
    lambda w: _path_file(w / "file"),
    ValueError,
    r"workdir '.*/file' exists and is not a directory",
  ),
  # Batch sizes the data and the devices cannot serve.
  Case(
    "data set smaller than one batch",
    lambda w: trainer(w, controller=simigrad_jax.make_controller("fixed", initial_batch_size=500)),
    ValueError,
    r"the data set has 200 examples, fewer than the largest batch size 500",
  ),
  Case(
    "upper bound above the data set",
    lambda w: trainer(w, controller=controller(batch_size_upper_bound=500)),
    ValueError,
    r"the data set has 200 examples, fewer than the largest batch size 500 \(batch_size_upper_bound\)",
  ),
  Case(
    "adaptive controller without an upper bound",
    lambda w: trainer(w, controller=controller(batch_size_upper_bound=None)),
    ValueError,
    r"batch_size_upper_bound=None lets the controller grow the global batch without limit, past "
    r"the data set's 200 examples .*set batch_size_upper_bound to at most 200",
  ),
  Case(
    "lower bound that leaves a device half empty",
    lambda w: trainer(w, controller=controller(batch_size_lower_bound=1)),
    ValueError,
    r"batch_size_lower_bound=1 lets the global batch shrink to 1, but a batch below 2 "
    r"leaves the odd devices .*set batch_size_lower_bound >= 2",
  ),
  Case(
    "profiled size that leaves a device half empty",
    lambda w: trainer(
      w,
      controller=simigrad_jax.Controller(
        24,
        0.3,
        enable_adjust=False,
        batch_size_lower_bound=1,
        batch_size_upper_bound=64,
        batch_sizes_to_profile=[1, 32],
      ),
    ),
    ValueError,
    r"batch_sizes_to_profile holds 1, but a batch below 2",
  ),
  Case(
    "device split on an odd number of devices",
    lambda w: trainer(w, devices=jax.devices()[:3], halves="device"),
    ValueError,
    r"halves='device' compares the even devices with the odd ones, which needs an even number "
    r"of devices, got 3; use halves='local'",
  ),
  Case(
    "unknown split",
    lambda w: trainer(w, halves="random"),
    ValueError,
    r"halves='random' is not valid; choose one of \('auto', 'device', 'local'\)",
  ),
  Case(
    "no devices",
    lambda w: trainer(w, devices=[]),
    ValueError,
    r"devices is empty: give at least one jax.Device",
  ),
  Case(
    "lower bound that leaves the local split's second half empty",
    lambda w: trainer(
      w, devices=jax.devices()[:1], controller=controller(batch_size_lower_bound=1)
    ),
    ValueError,
    r"a batch below 2 leaves the second half \(the step's odd-numbered examples\) without an "
    r"example",
  ),
  Case(
    "batch the devices cannot divide without padding",
    lambda w: simigrad_jax.shapes.plan_batch(
      13, 8, simigrad_jax.shapes.BucketPolicy(4, 4, padding=False), lower=10, upper=15
    ),
    ValueError,
    r"no batch size in \[lower=10, upper=15\] is realisable without padding on 8 devices with "
    r"micro-batch sizes \(4,\)",
  ),
  # The model, the loss and the data.
  Case(
    "optimizer without the transform",
    lambda w: trainer(w, optimizer=optimizer(transform=False)),
    ValueError,
    r"the optimizer has no SimilarityState: chain simigrad_jax.transform into it",
  ),
  Case(
    "optimizer without the lr factor",
    lambda w: trainer(w, optimizer=optimizer(lr_factor=False)),
    ValueError,
    r"no LrFactorState: chain simigrad_jax.scale_by_lr_factor\(\) into it",
  ),
  Case(
    "local split with an optimizer that cannot take half_grads",
    lambda w: trainer(w, devices=jax.devices()[:3], optimizer=without_extra_args(optimizer())),
    ValueError,
    r"with halves='local' the optimizer's update must take half_grads=\.\.\. and pass it on "
    r"to simigrad_jax.transform",
  ),
  # On 8 devices the transform could measure the device halves instead: refused too.
  Case(
    "local split on 8 devices with an optimizer that drops half_grads",
    lambda w: trainer(w, halves="local", optimizer=dropping_extra_args(optimizer())),
    simigrad_jax.ingraph.HalvesContractError,
    r"the optimizer's update was given half_grads=\.\.\., but simigrad_jax.transform did "
    r"not receive them, so it would compare the device halves instead",
  ),
  Case(
    "local split with an optimizer that drops half_grads",
    lambda w: trainer(w, devices=jax.devices()[:3], optimizer=dropping_extra_args(optimizer())),
    simigrad_jax.ingraph.HalvesContractError,
    r"the optimizer's update was given half_grads=\.\.\., but simigrad_jax.transform did "
    r"not receive them, so it would compare the device halves instead",
  ),
  Case(
    "transform on another axis name",
    lambda w: trainer(w, optimizer=optimizer("data")),
    ValueError,
    r"the optimizer's simigrad_jax.transform must use the Trainer's axis_name='batch'",
  ),
  # transform() without an axis name: the device split would fail in the transform, and the
  # local split would never average the devices' gradients (the replicas would drift apart).
  Case(
    "transform without an axis name, device split",
    lambda w: trainer(w, optimizer=optimizer(None)),
    simigrad_jax.ingraph.AxisNameError,
    r"the optimizer's simigrad_jax.transform must use the Trainer's axis_name='batch', got "
    r"axis_name=None: build it with simigrad_jax.transform\(axis_name='batch'\)",
  ),
  Case(
    "transform without an axis name, local split",
    lambda w: trainer(w, devices=jax.devices()[:3], optimizer=optimizer(None)),
    simigrad_jax.ingraph.AxisNameError,
    r"the optimizer's simigrad_jax.transform must use the Trainer's axis_name='batch', got "
    r"axis_name=None",
  ),
  Case(
    "NaN in the initial parameters",
    lambda w: trainer(w, params=nan_params()),
    ValueError,
    r"params\['Dense_0'\]\['kernel'\] holds NaN or infinite values",
  ),
  Case(
    "loss returns the batch mean",
    lambda w: trainer(w, loss_fn=mean_loss),
    ValueError,
    # The first step's rows per device: 3 of the grid (1, 2, 3, 4), its batch of 24 on 8 devices.
    r"loss_fn must return one loss per row, shape \(3,\), got shape \(\)",
  ),
  Case(
    "loss reads a feature the source lacks",
    lambda w: trainer(w, loss_fn=image_loss),
    ValueError,
    r"loss_fn fails on one device's rows of this source \(features .*'x'.*'y'.*\): KeyError: 'image'",
  ),
  Case(
    "source rows that do not fit the model",
    lambda w: trainer(w, data=dataset(features=6)),
    ValueError,
    r"loss_fn fails on one device's rows of this source .*'x': \(\(6,\), 'float32'\)",
  ),
  Case(
    "arrays of unequal length",
    lambda w: simigrad_jax.ArraySource({"x": np.zeros((5, 2)), "y": np.zeros(4)}),
    ValueError,
    r"arrays must have equal lengths, got \{'x': 5, 'y': 4\}",
  ),
  Case(
    "zero epochs",
    train_with({}, num_epochs=0),
    ValueError,
    r"num_epochs must be a number in \(0, inf\) \(finite\), got 0",
  ),
  Case(
    "negative steps",
    train_with({}, num_steps=-1),
    ValueError,
    r"num_steps must be an integer >= 0, got -1",
  ),
  Case(
    "lr schedule returning 0",
    train_with({"lr_schedule": lambda epochs: 0.0}, num_steps=3),
    ValueError,
    r"the learning-rate factor at epoch 0.000 would be 0.0 \(lr_schedule returned 0.0\); "
    r"it must be finite and > 0",
  ),
  # Checkpoints that belong to another run.
  Case(
    "checkpoint from a different model",
    resume_with(hidden=16),
    simigrad_jax.checkpoint.CheckpointMismatchError,
    r"(?s)holds checkpoints of another run, whose arrays do not fit this one's; the runs differ "
    r"in:\n.*  - model.params\['Dense_1'\]\['kernel'\]: 'float32\[5, 8\]' there, "
    r"'float32\[5, 16\]' here\n.*cannot be resumed, allowed or not",
    resume=True,
  ),
  Case(
    "checkpoint with another similarity target",
    resume_with(controller=controller(similarity_target=0.5)),
    simigrad_jax.checkpoint.CheckpointMismatchError,
    r"the checkpoint at step 4 .* was made by a run with other settings:\n"
    r"  - controller.similarity_target: 0.3 there, 0.5 here\n.*allow_changed_settings=True",
    resume=True,
  ),
  Case(
    "checkpoint with another seed",
    resume_with(seed=4),
    simigrad_jax.checkpoint.CheckpointMismatchError,
    r"the checkpoint at step 4 .* was made with seed=3, this run has seed=4",
    resume=True,
  ),
  Case(
    "checkpoint of a different data set",
    resume_with(data=dataset(num_examples=180)),
    simigrad_jax.checkpoint.CheckpointMismatchError,
    r"was made by a run with other settings:\n  - data.num_examples: 200 there, 180 here\n",
    resume=True,
  ),
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("finished")
  with trainer(workdir) as t:
    t.train(num_steps=4)
  return workdir


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_refused_before_any_step(case, tmp_path, request):
  workdir = tmp_path / "run"
  if case.resume:  # only these need the finished run (built once per worker)
    shutil.copytree(request.getfixturevalue("finished_run"), workdir)
  metrics = workdir / "metrics.jsonl"
  before = metrics.read_bytes() if metrics.exists() else b""
  with pytest.raises(case.error, match=case.match):
    case.run(workdir)
  after = metrics.read_bytes() if metrics.exists() else b""
  assert after == before  # not a single step was trained (or logged)


def test_the_table_is_long_enough():
  assert len(CASES) >= 20
