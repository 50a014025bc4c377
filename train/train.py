"""The training loop of every config: data, model, loss, optimizer and controller, run by ``simigrad_jax.Trainer``.

:func:`create_experiment` turns a config into everything the Trainer needs
(nothing is trained); :func:`train_and_evaluate` runs it in a workdir,
resuming from the newest checkpoint there, and writes the metrics, the plot
and the summary. Two tasks share the loop:

* image classification (``mlp``, ``cnn``, ``resnet*``): softmax cross-entropy,
  in-graph augmentation, BatchNorm statistics as model state, evaluated for
  accuracy and loss on the evaluation split;
* masked language modelling (``bert``): BERT's 15% masking drawn in-graph,
  cross-entropy on the masked positions (averaged per example), evaluated for
  masked-token accuracy and loss with a fixed mask.

The loss functions run on one device's rows inside the Trainer's step and
return per-example losses; the Trainer weights them (padding rows 0) into the
exact mean over the global batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

import simigrad_jax
from simigrad_jax import TrainerConfig
from simigrad_jax import plot
from simigrad_jax.engine import layout
from train import input_pipeline
from train import models
from train import optimizers
from train import preprocess
from train import report

PLATFORMS: tuple[str, ...] = ("default", "auto", "cpu")
DTYPES: dict[str, Any] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
AUGMENTATIONS: tuple[str, ...] = ("none", "crop_flip", "inception")


@dataclasses.dataclass
class Experiment:
  """Everything one config trains, before any training.

  Attributes:
    config: the config.
    datasets: the training and evaluation sources.
    model: the flax module.
    params: the initial parameters.
    model_state: the initial non-trainable state (BatchNorm statistics), or None.
    loss_fn: ``loss_fn(params, model_state, batch, weights, rng) ->
      (per_example_losses, new_model_state)`` for the Trainer.
    predict: ``predict(variables, batch) -> logits`` in evaluation mode, the
      batch as the sources give it (uint8 images are normalised, ImageNet's
      center-cropped; BERT's tokens are not masked).
    evaluate: ``evaluate(params, model_state) -> {"accuracy", "loss"}`` on the
      evaluation split, or None when there is none.
    optimizer: the optax chain (transform -> optimizer -> lr factor).
    lr_schedule: the learning-rate multiplier against epochs.
    controller: the batch-size controller.
    devices: the devices to train on.
    halves: the split of each step into the two halves the similarity
      compares: ``"device"`` or ``"local"`` (``config.halves`` resolved for
      the devices by :meth:`TrainerConfig.halves_for`).
    trainer_config: the Trainer's settings from the config, checked
      (:func:`create_trainer` fits ``max_micro_batch_size`` to the bounds and
      sets the compilation cache of the workdir).
  """

  config: ml_collections.ConfigDict
  datasets: input_pipeline.Datasets
  model: Any
  params: Any
  model_state: Any
  loss_fn: Callable[..., Any]
  predict: Callable[[Any, Any], jax.Array]
  evaluate: Callable[[Any, Any], dict[str, float]] | None
  optimizer: optax.GradientTransformation
  lr_schedule: Callable[[float], float]
  controller: Any
  devices: list[jax.Device]
  halves: str
  trainer_config: TrainerConfig


# ------------------------------------------------------------------ devices


def training_devices(config: ml_collections.ConfigDict) -> list[jax.Device]:
  """The devices ``config.platform`` asks for (see the config's comment).

  ``"default"`` and ``"auto"``: the default backend's devices, i.e. every
  accelerator, however many (one included), or the CPU's (simulated) devices
  when there is none; ``"cpu"``: the CPU's devices.

  Raises:
    ValueError: for an unknown platform.
  """
  if config.platform not in PLATFORMS:
    raise ValueError(f"config.platform={config.platform!r} is not valid; choose one of {PLATFORMS}")
  return check_device_count(jax.devices("cpu") if config.platform == "cpu" else jax.devices())


def check_device_count(devices: list[jax.Device]) -> list[jax.Device]:
  """Returns ``devices`` as a list if there is at least one, else raises ValueError."""
  if not devices:
    raise ValueError("no devices to train on; --config.platform=cpu trains on the CPU's "
                     "(--config.num_cpu_devices simulated) devices")
  return list(devices)


@contextlib.contextmanager
def _named_as_config_options():
  """Names the setting of a library error about a Trainer setting as the config's option."""
  try:
    yield
  except ValueError as error:
    raise ValueError(f"config.{error}") from error


def create_trainer_config(config: ml_collections.ConfigDict) -> TrainerConfig:
  """The :class:`simigrad_jax.engine.config.TrainerConfig` of ``config``'s Trainer settings.

  ``max_micro_batch_size`` is the configured one (:func:`create_trainer`
  fits it to the bounds) and there is no compilation cache yet (it depends
  on the workdir: :func:`compilation_cache_dir`).

  Raises:
    ValueError: for a bad setting, named as the config's option (``config.mode=...``).
  """
  with _named_as_config_options():
    return TrainerConfig(
        max_micro_batch_size=config.max_micro_batch_size, mode=config.mode,
        min_micro_batch_size=config.min_micro_batch_size,
        compile_fallback=config.compile_fallback, lr_rule=config.lr_rule,
        lr_adjust_factor=config.lr_adjust_factor, seed=config.seed,
        checkpoint_every_steps=config.checkpoint_every_steps,
        max_checkpoints=config.max_checkpoints, tensorboard=config.tensorboard,
        progress=config.progress, halves=config.halves,
        agreement_timeout_seconds=config.agreement_timeout_seconds)


# ------------------------------------------------------------------ controller


def create_controller(config: ml_collections.ConfigDict, num_devices: int,
                      halves: str = "device") -> Any:
  """The batch-size controller ``config.controller`` with the config's options.

  ``"simigrad"`` and ``"fixed"`` get every reference option (similarity
  target, bounds, smoothing, dead band, warm-up, profiling, verbose) and the
  model rule's ``ema_decay`` (``config.similarity_ema_decay``); any other
  registered controller (``simigrad_jax.controller_names()``) gets the initial
  size and the bounds. All get ``config.controller_options`` (a JSON object)
  on top. A missing lower bound becomes the number of devices (with the local
  split, twice that: one per half of a device), so that no device (half)
  ever holds only padding. ``"fixed"`` without a profile keeps its bounds at
  the initial size, so only the shapes it uses are compiled.

  Raises:
    ValueError: for an unknown controller, bad options or bad JSON.
  """
  lower = config.batch_size_lower_bound
  slots = num_devices * layout.blocks_per_device(halves)
  options: dict[str, Any] = {
      "initial_batch_size": config.initial_batch_size,
      "batch_size_lower_bound": slots if lower is None else lower,
      "batch_size_upper_bound": config.batch_size_upper_bound,
  }
  profile = tuple(config.batch_sizes_to_profile) or None
  if config.controller in ("simigrad", "fixed"):
    options.update(
        similarity_target=config.similarity_target, smooth_factor=config.smooth_factor,
        dead_band=config.dead_band, warmup_steps=config.controller_warmup_steps,
        ema_decay=config.similarity_ema_decay,
        batch_sizes_to_profile=profile, profile_steps_per_size=config.profile_steps_per_size,
        verbose=config.verbose)
    if config.controller == "simigrad":
      options["enable_adjust"] = config.enable_adjust
    elif profile is None:
      options["batch_size_lower_bound"] = options["batch_size_upper_bound"] = (
          config.initial_batch_size)
  if config.controller_options:
    try:
      extra = json.loads(config.controller_options)
    except ValueError as e:
      raise ValueError(f"config.controller_options must be a JSON object, got "
                       f"{config.controller_options!r}: {e}") from e
    if not isinstance(extra, dict):
      raise ValueError(f"config.controller_options must be a JSON object, got "
                       f"{config.controller_options!r}")
    options.update(extra)
  try:
    return simigrad_jax.make_controller(config.controller, **options)
  except TypeError as e:  # an option the controller does not take
    raise ValueError(f"controller {config.controller!r} refused its options "
                     f"{sorted(options)}: {e}") from e


# ------------------------------------------------------------------ image classification


def _image_fns(config, model, datasets):
  """``(prepare(images, rng, train) -> float32 images, ...)`` for the config's augmentation."""
  if config.augment not in AUGMENTATIONS:
    raise ValueError(f"config.augment={config.augment!r} is not valid; "
                     f"choose one of {AUGMENTATIONS}")
  mean, std = datasets.image_mean, datasets.image_std

  def prepare(images, rng, train: bool):
    if config.augment == "crop_flip" and train:
      images = preprocess.random_crop_and_flip(rng, images, config.crop_padding)
    elif config.augment == "inception":
      images = (preprocess.random_resized_crop_and_flip(rng, images, config.image_size) if train
                else preprocess.center_crop(images, config.image_size))
    if images.dtype == jnp.uint8 or mean is not None:
      return preprocess.normalize(images, mean, std)
    return images.astype(jnp.float32)

  def loss_fn(params, model_state, batch, weights, rng):
    images = prepare(batch["image"], rng, True)
    variables = {"params": params, **(model_state or {})}
    mask = weights > 0
    if model_state:
      logits, new_state = model.apply(variables, images, train=True, mask=mask,
                                      mutable=list(model_state))
    else:
      logits, new_state = model.apply(variables, images, train=True, mask=mask), model_state
    labels = jax.nn.one_hot(batch["label"].astype(jnp.int32), datasets.num_classes)
    if config.label_smoothing:
      labels = optax.smooth_labels(labels, config.label_smoothing)
    return optax.softmax_cross_entropy(logits.astype(jnp.float32), labels), new_state

  def predict(variables, batch):
    return model.apply(variables, prepare(batch["image"], None, False), train=False)

  @jax.jit
  def eval_step(variables, batch, weights):
    logits = predict(variables, batch)
    labels = batch["label"].astype(jnp.int32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    return jnp.sum(correct * weights), jnp.sum(losses * weights), jnp.sum(weights)

  return loss_fn, predict, eval_step


# ------------------------------------------------------------------ masked language modelling


def mlm_fns(config: ml_collections.ConfigDict, model: Any, datasets: input_pipeline.Datasets
            ) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
  """BERT's masked-LM ``(loss_fn, predict, eval_step)``; ``eval_step`` sums correct, loss, masked.

  Used by :func:`create_experiment` and by ``benchmarks/pareto_mlm.py``.
  """
  mask_args = dict(mask_rate=config.mask_rate, mask_id=input_pipeline.MASK_ID,
                   pad_id=input_pipeline.PAD_ID, first_regular_id=input_pipeline.FIRST_BYTE_ID,
                   vocab_size=datasets.vocab_size)

  def masked_losses(params, tokens, rng, train: bool):
    mask_rng, dropout_rng = jax.random.split(rng)
    inputs, targets = preprocess.mask_tokens(mask_rng, tokens, **mask_args)
    logits = model.apply({"params": params}, inputs, train=train,
                         rngs={"dropout": dropout_rng} if train else None)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens)
    correct = jnp.argmax(logits, -1) == tokens
    return losses, correct, targets.astype(jnp.float32)

  def loss_fn(params, model_state, batch, weights, rng):
    del weights
    losses, _, targets = masked_losses(params, batch["tokens"], rng, True)
    per_example = jnp.sum(losses * targets, -1) / jnp.maximum(jnp.sum(targets, -1), 1.0)
    return per_example, model_state

  def predict(variables, batch):
    return model.apply({"params": variables["params"]}, batch["tokens"], train=False)

  @jax.jit
  def eval_step(variables, batch, weights, rng):
    losses, correct, targets = masked_losses(variables["params"], batch["tokens"], rng, False)
    targets = targets * weights[:, None]
    return (jnp.sum(correct * targets), jnp.sum(losses * targets), jnp.sum(targets))

  return loss_fn, predict, eval_step


def make_evaluate(config: ml_collections.ConfigDict, datasets: input_pipeline.Datasets,
                  eval_step: Callable[..., Any], text: bool
                  ) -> Callable[[Any, Any], dict[str, float]] | None:
  """``evaluate(params, model_state) -> {"accuracy", "loss"}`` over ``datasets.eval``.

  For text, each evaluation batch gets a fixed mask (from ``config.seed``), the
  same at every evaluation and for every run with that seed setting.
  """
  if datasets.eval is None:
    return None

  def evaluate(params, model_state):
    variables = jax.device_put({"params": params, **(model_state or {})}, jax.local_devices()[0])
    totals = np.zeros(3)
    for i, (batch, weights) in enumerate(input_pipeline.eval_batches(datasets.eval,
                                                                     config.eval_batch_size)):
      args = (variables, batch, weights)
      if text:  # a fixed mask per batch, the same at every evaluation
        args += (jax.random.fold_in(jax.random.key(config.seed + 1), i),)
      totals += np.array(jax.device_get(eval_step(*args)), np.float64)
    count = max(totals[2], 1.0)
    return {"accuracy": totals[0] / count, "loss": totals[1] / count}

  return evaluate


# ------------------------------------------------------------------ assembly


def create_experiment(config: ml_collections.ConfigDict,
                      devices: list[jax.Device] | None = None) -> Experiment:
  """Builds the data, model, loss, evaluation, optimizer and controller of ``config``.

  Args:
    config: the experiment config (``train/configs/``).
    devices: the devices to train on (default: :func:`training_devices`).

  Returns:
    An :class:`Experiment`; nothing is trained or compiled for training yet.

  Raises:
    ValueError: for a bad config value, with the option's name.
  """
  if config.dtype not in DTYPES:
    raise ValueError(f"config.dtype={config.dtype!r} is not valid; choose one of {tuple(DTYPES)}")
  trainer_config = create_trainer_config(config)  # cheap checks first
  devices = training_devices(config) if devices is None else check_device_count(devices)
  with _named_as_config_options():
    halves = trainer_config.halves_for(len(devices))
  controller = create_controller(config, len(devices), halves)
  optimizer = optimizers.create_optimizer(config)
  lr_schedule = optimizers.create_lr_schedule(config)
  datasets = input_pipeline.create_datasets(config)
  model = models.create_model(config, num_classes=datasets.num_classes,
                              vocab_size=datasets.vocab_size, dtype=DTYPES[config.dtype])
  # The RBG generator compiles an initialisation in seconds where threefry takes
  # half a minute for a ResNet on a CPU; same seed, same backend: same parameters.
  key = jax.random.key(config.seed, impl="rbg")
  spec = datasets.train.element_spec
  if config.model == "bert":
    if config.dataset not in ("text", "tfds_text"):
      raise ValueError(f"model 'bert' needs a text data set, not {config.dataset!r}")
    params = jax.jit(lambda k: model.init(k, jnp.zeros((1, config.seq_length), jnp.int32),
                                          train=False)["params"])(key)
    model_state = None
    loss_fn, predict, eval_step = mlm_fns(config, model, datasets)
  else:
    if "image" not in spec:
      raise ValueError(f"model {config.model!r} needs an image data set, not {config.dataset!r}")
    shape, dtype = spec["image"]
    if config.augment == "inception":
      shape = (config.image_size, config.image_size) + tuple(shape[2:])
    dummy = jnp.zeros((1,) + tuple(shape), jnp.float32)
    variables = jax.jit(lambda k: model.init(k, dummy, train=False))(key)
    variables = jax.tree.map(np.asarray, variables)
    params = variables.pop("params")
    model_state = variables or None
    loss_fn, predict, eval_step = _image_fns(config, model, datasets)
  params = jax.tree.map(np.asarray, params)
  evaluate = make_evaluate(config, datasets, eval_step, text=config.model == "bert")
  return Experiment(config, datasets, model, params, model_state, loss_fn, predict, evaluate,
                    optimizer, lr_schedule, controller, list(devices), halves, trainer_config)


def max_micro_batch_size(configured: int, upper: int, num_devices: int) -> int:
  """``configured``, halved while half of it still holds ``upper / num_devices`` rows.

  The Trainer compiles every shape of the grid ``max, max/2, ...`` down to the
  smallest one the bounds need; shapes larger than the upper bound can use
  are never run, so they are not put on the grid.
  """
  per_device = -(-upper // num_devices)
  size = configured
  while size % 2 == 0 and size // 2 >= per_device:
    size //= 2
  return size


def compilation_cache_dir(config: ml_collections.ConfigDict,
                          workdir: str | os.PathLike) -> pathlib.Path | None:
  """Where a run of ``config`` in ``workdir`` keeps JAX's persistent compilation cache.

  Args:
    config: the experiment config.
    workdir: the run's workdir.

  Returns:
    ``config.compilation_cache_dir`` when it is set (``~`` expanded), else
    ``<workdir>/compilation_cache``, as an absolute path; None when
    ``config.compilation_cache`` is False.

  Raises:
    ValueError: for an empty ``config.compilation_cache_dir``.
  """
  if not config.compilation_cache:
    return None
  if config.compilation_cache_dir is None:
    return pathlib.Path(workdir).absolute() / "compilation_cache"
  if not config.compilation_cache_dir:
    raise ValueError("config.compilation_cache_dir is empty; leave it unset for "
                     "<workdir>/compilation_cache, or set config.compilation_cache=False")
  return pathlib.Path(config.compilation_cache_dir).expanduser().absolute()


def create_trainer(experiment: Experiment, workdir: str | os.PathLike,
                   eval_fn: Callable[[Any, Any], Mapping[str, float]] | None = None
                   ) -> simigrad_jax.Trainer:
  """The :class:`simigrad_jax.Trainer` of ``experiment`` in ``workdir`` (resumes from its newest checkpoint).

  The Trainer turns on JAX's persistent compilation cache in
  :func:`compilation_cache_dir` unless the config turns it off: a
  process-wide setting (see ``simigrad_jax.persistent_cache_settings``).
  """
  settings = experiment.trainer_config
  upper = (experiment.controller.config.get("batch_size_upper_bound")
           or len(experiment.datasets.train))
  return simigrad_jax.Trainer(
      loss_fn=experiment.loss_fn, params=experiment.params, optimizer=experiment.optimizer,
      source=experiment.datasets.train, controller=experiment.controller, workdir=workdir,
      model_state=experiment.model_state,
      eval_fn=eval_fn if eval_fn is not None else experiment.evaluate,
      lr_schedule=experiment.lr_schedule, devices=experiment.devices,
      config=settings.replace(
          max_micro_batch_size=max_micro_batch_size(settings.max_micro_batch_size, upper,
                                                    len(experiment.devices)),
          compilation_cache_dir=compilation_cache_dir(experiment.config, workdir)))


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | os.PathLike,
                       *, title: str | None = None) -> dict[str, Any]:
  """Trains ``config`` in ``workdir`` and reports: per-epoch lines, a summary table, the plot.

  Re-running with the same workdir resumes from its newest checkpoint and
  appends to ``metrics.jsonl`` without repeating a step; a finished run trains
  nothing and reports again. JAX's persistent compilation cache is on before
  the first compile (in ``<workdir>/compilation_cache`` unless the config
  says otherwise), so a second run or a resume loads its executables from
  disk. That changes process-wide ``jax.config`` settings: a caller that
  compiles other things afterwards can run this inside
  ``simigrad_jax.persistent_cache_settings()``.

  Args:
    config: the experiment config.
    workdir: where checkpoints, ``metrics.jsonl``, TensorBoard events,
      ``config.json`` and ``metrics.png`` go (created if missing).
    title: the plot's title.

  Returns:
    The whole run's summary (resumed parts included): ``eval_accuracy``,
    ``steps``, ``examples_seen``, ``average_batch_size``,
    ``final_batch_size``, ``compiles``, ``seconds`` and the file paths.
  """
  start = time.perf_counter()
  workdir = pathlib.Path(workdir).absolute()
  workdir.mkdir(parents=True, exist_ok=True)
  cache_dir = compilation_cache_dir(config, workdir)
  if cache_dir is not None:  # before the model's first compile, so that it is cached too
    simigrad_jax.enable_persistent_cache(cache_dir)
  experiment = create_experiment(config)
  is_main = jax.process_index() == 0
  if is_main:
    (workdir / "config.json").write_text(config.to_json(indent=2) + "\n")
  printer = report.EpochPrinter(experiment.evaluate, workdir, config.num_epochs,
                                eval_name=experiment.datasets.eval_name, enabled=is_main)
  trainer = create_trainer(experiment, workdir, printer if experiment.evaluate else None)
  printer.trainer = trainer
  if is_main:
    report.print_start(experiment, trainer)
  with trainer:
    run = trainer.train(num_epochs=config.num_epochs, num_steps=config.num_steps)
    if config.batch_sizes_to_profile and is_main and hasattr(trainer.controller, "save_profile"):
      trainer.controller.save_profile(workdir / "similarity_profile.json")
  summary = report.summarize(workdir, run, experiment.devices, time.perf_counter() - start,
                             experiment.halves)
  summary["eval_name"] = experiment.datasets.eval_name
  if is_main:
    if config.plot and summary["steps"]:
      summary["plot"] = str(plot.plot_metrics(
          workdir / "metrics.jsonl", workdir / "metrics.png",
          title=title or f"SimiGrad: {experiment.datasets.description}, {config.model}"))
    report.print_summary(summary)
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
  return summary
