"""The training loop of every config: data, model, loss, optimizer and controller, run by ``simigrad_jax.Trainer``.

:func:`create_experiment` turns a config into everything the Trainer needs
(nothing is trained); :func:`train_and_evaluate` runs it in a workdir,
resuming from the newest checkpoint there, and writes the metrics, the plot
and the summary. The loss and evaluation of each task (image classification,
masked and causal language modelling) are in :mod:`train.tasks`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import re
import shutil
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

import simigrad_jax
from simigrad_jax import CheckpointConfig
from simigrad_jax import CompileConfig
from simigrad_jax import LearningRateConfig
from simigrad_jax import TrainerConfig
from simigrad_jax import files
from simigrad_jax import plot
from simigrad_jax import validation
from simigrad_jax.compile import enable_persistent_cache
from simigrad_jax.compile import persistent_cache
from simigrad_jax.controllers import OneStepLateController
from simigrad_jax.multihost import ProcessAgreement
from simigrad_jax.multihost import WorkdirLock
from simigrad_jax.multihost import open_workdir
from simigrad_jax.registry import controller_options
from simigrad_jax.shapes.layout import blocks_per_device
from simigrad_jax.trainer.config import MOVED_SETTINGS
from train import config_checks
from train import config_history
from train import failures
from train import input_pipeline
from train import mesh as mesh_setup
from train import models
from train import optimizers
from train import report
from train import run_settings
from train import tasks

PLATFORMS: tuple[str, ...] = ("default", "auto", "cpu")
DTYPES: dict[str, Any] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


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
      sets the compilation cache, :func:`compilation_cache_dir`).
    mesh, param_sharding: the mesh of ``config.mesh_shape`` (its data axis
      alone by default) and the parameters' specs (None: replicated).
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
  mesh: Any
  param_sharding: Any


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
    raise ValueError(
      "no devices to train on; --config.platform=cpu trains on the CPU's "
      "(--config.num_cpu_devices simulated) devices"
    )
  return list(devices)


# A TrainerConfig setting's path -> the config's option that sets it (the config keeps 0.2's
# flat names).
_CONFIG_OPTIONS = {path: name for name, path in MOVED_SETTINGS.items()} | {
  "compile.threads": "compile_threads"
}


@contextlib.contextmanager
def _named_as_config_options():
  """Names the setting of a library error about a Trainer setting as the config's option: the
  config's flat names are 0.2's (``compile.mode='fast'`` is ``config.mode='fast'``)."""
  try:
    yield
  except ValueError as error:
    message = str(error)
    path = re.match(r"[\w.]*", message).group()  # the setting's path in TrainerConfig
    option = _CONFIG_OPTIONS.get(path, path)
    raise ValueError(f"config.{option}{message[len(path) :]}") from error


def _given(**options: Any) -> dict[str, Any]:
  """The options that are not None (those None keep the library's default)."""
  return {name: value for name, value in options.items() if value is not None}


def create_trainer_config(config: ml_collections.ConfigDict) -> TrainerConfig:
  """The :class:`simigrad_jax.TrainerConfig` of ``config``'s Trainer settings.

  ``max_micro_batch_size`` is the configured one (:func:`create_trainer`
  fits it to the bounds) and there is no compilation cache yet
  (:func:`create_trainer` sets :func:`compilation_cache_dir`).

  Raises:
    ValueError: for a bad setting, named as the config's option (``config.mode=...``).
  """
  with _named_as_config_options():
    return TrainerConfig(
      max_micro_batch_size=config.max_micro_batch_size,
      seed=config.seed,
      halves=config.halves,
      measure_every=config.get("measure_every", 1),
      halves_passes=config.get("halves_passes", "sequential"),
      progress=config.progress,
      tensorboard=config.tensorboard,
      allow_shared_workdir=config.allow_shared_workdir,
      agreement_timeout_seconds=config.agreement_timeout_seconds,
      compile=CompileConfig(
        mode=config.mode,
        min_micro_batch_size=config.min_micro_batch_size,
        fallback=config.compile_fallback,
        shapes_per_octave=config.shapes_per_octave,
        whole_rows=config.whole_rows,
        threads=config.compile_threads,
        **_given(
          steps_per_compile=config.steps_per_compile, shapes_per_step=config.shapes_per_step
        ),
      ),
      checkpoints=CheckpointConfig(
        every_steps=config.checkpoint_every_steps,
        every_seconds=config.checkpoint_every_seconds,
        max_to_keep=config.max_checkpoints,
        allow_changed_settings=config.allow_changed_settings,
      ),
      lr=LearningRateConfig(rule=config.lr_rule, adjust_factor=config.lr_adjust_factor),
    )


# ------------------------------------------------------------------ controller


# The reference's options of "simigrad" and "fixed", each with the config option that sets it
# (two have names of their own in the config; the initial size and the bounds keep theirs).
_REFERENCE_OPTIONS = {
  "similarity_target": "similarity_target",
  "smooth_factor": "smooth_factor",
  "dead_band": "dead_band",
  "warmup_steps": "controller_warmup_steps",
  "ema_decay": "similarity_ema_decay",
  "batch_sizes_to_profile": "batch_sizes_to_profile",
  "profile_steps_per_size": "profile_steps_per_size",
  "verbose": "verbose",
}


def create_controller(
  config: ml_collections.ConfigDict,
  num_devices: int,
  halves: str = "device",
  tokens_per_example: int | None = None,
) -> Any:
  """The batch-size controller ``config.controller`` with the config's options.

  ``"simigrad"`` and ``"fixed"`` get every reference option (similarity
  target, bounds, smoothing, dead band, warm-up, profiling, verbose) and the
  model rule's ``ema_decay`` (``config.similarity_ema_decay``); any other
  registered controller (``simigrad_jax.controller_names()``) gets the initial
  size and the bounds. All get ``config.controller_options`` (a JSON object)
  on top, for the options the config has none of (an option the config sets,
  such as ``initial_batch_size``, is refused there). A missing lower bound
  becomes the number of devices (with the local split, twice that: one per
  half of a device), so that no device (half) ever holds only padding. ``"fixed"`` without a profile keeps its bounds at
  the initial size, so only the shapes it uses are compiled. A controller
  that counts tokens (the ramps of :mod:`simigrad_jax.ramps.token_schedules`,
  Seesaw) gets the data set's ``tokens_per_example`` (a language model's
  sequence length) unless ``config.controller_options`` sets it: its
  thresholds are then in tokens. With ``config.one_step_late`` the
  controller is wrapped in :class:`simigrad_jax.controllers.OneStepLateController`.

  Raises:
    ValueError: for an unknown controller, bad options or bad JSON.
  """
  lower = config.batch_size_lower_bound
  slots = num_devices * blocks_per_device(halves)
  options: dict[str, Any] = {
    "initial_batch_size": config.initial_batch_size,
    "batch_size_lower_bound": slots if lower is None else lower,
    "batch_size_upper_bound": config.batch_size_upper_bound,
  }
  profile = tuple(config.batch_sizes_to_profile) or None
  if config.controller in ("simigrad", "fixed"):
    options.update({option: config[name] for option, name in _REFERENCE_OPTIONS.items()})
    options["batch_sizes_to_profile"] = profile
    if config.controller == "simigrad":
      options["enable_adjust"] = config.enable_adjust
    elif profile is None:
      options["batch_size_lower_bound"] = options["batch_size_upper_bound"] = (
        config.initial_batch_size
      )
  if config.controller_options:
    try:
      extra = json.loads(config.controller_options)
    except ValueError as e:
      raise ValueError(
        f"config.controller_options must be a JSON object, got {config.controller_options!r}: {e}"
      ) from e
    if not isinstance(extra, dict):
      raise ValueError(
        f"config.controller_options must be a JSON object, got {config.controller_options!r}"
      )
    _refuse_options_the_config_sets(extra, options)
    options.update(extra)
  accepted = controller_options(config.controller) or ()
  if tokens_per_example is not None and "tokens_per_example" in accepted:
    options.setdefault("tokens_per_example", tokens_per_example)
  try:
    controller = simigrad_jax.make_controller(config.controller, **options)
  except TypeError as e:  # an option the controller does not take
    raise ValueError(
      f"controller {config.controller!r} refused its options {sorted(options)}: {e}"
    ) from e
  return OneStepLateController(controller) if config.one_step_late else controller


def _refuse_options_the_config_sets(extra: dict[str, Any], options: dict[str, Any]) -> None:
  """Refuses ``config.controller_options`` keys that an option of the config sets.

  The config's value is read elsewhere too (``initial_batch_size`` is the
  base of Adam's batch coupling and the start banner's), so a second value
  in ``controller_options`` would train with two different settings.
  """
  for key in sorted(set(extra) & set(options)):
    name = _REFERENCE_OPTIONS.get(key, key)
    raise ValueError(
      f"config.controller_options sets {key!r} ({extra[key]!r}), which config.{name} sets "
      f"({options[key]!r}): set it there instead (--config.{name}=...)"
    )


# ------------------------------------------------------------------ assembly


def create_experiment(
  config: ml_collections.ConfigDict, devices: list[jax.Device] | None = None
) -> Experiment:
  """Builds the data, model, loss, evaluation, optimizer and controller of ``config``.

  Args:
    config: the experiment config (``train/configs/``).
    devices: the devices to train on (default: :func:`training_devices`).

  Returns:
    An :class:`Experiment`; nothing is trained or compiled for training yet.

  Raises:
    ValueError: for a bad config value, with the option's name.
  """
  config_checks.check_config(config)
  if config.dtype not in DTYPES:
    raise ValueError(f"config.dtype={config.dtype!r} is not valid; choose one of {tuple(DTYPES)}")
  trainer_config = create_trainer_config(config)  # cheap checks first
  devices = training_devices(config) if devices is None else check_device_count(devices)
  mesh = mesh_setup.training_mesh(config, devices)
  num_data = mesh.shape[mesh_setup.DATA_AXIS]
  with _named_as_config_options():
    halves = trainer_config.halves_for(num_data)
  datasets = input_pipeline.create_datasets(config)
  config_checks.check_data_labels(datasets)
  controller = create_controller(config, num_data, halves, datasets.tokens_per_example)
  optimizer = optimizers.create_optimizer(config)
  lr_schedule = optimizers.create_lr_schedule(config, controller, len(datasets.train))
  model = models.create_model(
    config,
    num_classes=datasets.num_classes,
    vocab_size=datasets.vocab_size,
    dtype=DTYPES[config.dtype],
  )
  # The RBG generator compiles an initialisation in seconds where threefry takes
  # half a minute for a ResNet on a CPU; same seed, same backend: same parameters.
  key = jax.random.key(config.seed, impl="rbg")
  spec = datasets.train.element_spec
  if config.model in ("bert", "causal_lm"):
    needs = ("text", "tfds_text") if config.model == "bert" else ("chars",)
    if config.dataset not in needs:
      raise ValueError(
        f"model {config.model!r} needs the data set {' or '.join(map(repr, needs))}, "
        f"not {config.dataset!r}"
      )
    params = jax.jit(
      lambda k: model.init(k, jnp.zeros((1, config.seq_length), jnp.int32), train=False)["params"]
    )(key)
    model_state = None
    task_fns = tasks.mlm_fns if config.model == "bert" else tasks.causal_lm_fns
    loss_fn, predict, eval_step = task_fns(config, model, datasets)
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
    loss_fn, predict, eval_step = tasks.image_fns(config, model, datasets)
  params = jax.tree.map(np.asarray, params)
  evaluate = tasks.make_evaluate(config, datasets, eval_step, text=config.model == "bert")
  return Experiment(
    config,
    datasets,
    model,
    params,
    model_state,
    loss_fn,
    predict,
    evaluate,
    optimizer,
    lr_schedule,
    controller,
    list(devices),
    halves,
    trainer_config,
    mesh,
    mesh_setup.param_sharding(config, params),
  )


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


def compilation_cache_dir(config: ml_collections.ConfigDict) -> pathlib.Path | None:
  """Where a run of ``config`` keeps JAX's persistent compilation cache, shared by every workdir.

  Args:
    config: the experiment config.

  Returns:
    ``config.compilation_cache_dir`` when it is set (``~`` expanded), else
    the cache every run of this user shares
    (:func:`simigrad_jax.compile.persistent_cache.default_cache_dir`:
    ``$SIMIGRAD_JAX_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/simigrad_jax/compilation_cache``), as an absolute path;
    None when ``config.compilation_cache`` is False, or the directory is
    empty (``--config.compilation_cache_dir=''`` or ``SIMIGRAD_JAX_CACHE_DIR=''``).
  """
  if not config.compilation_cache:
    return None
  if config.compilation_cache_dir is None:
    default = persistent_cache.default_cache_dir()
    return None if default is None else pathlib.Path(default)
  if not config.compilation_cache_dir:
    return None
  return pathlib.Path(config.compilation_cache_dir).expanduser().absolute()


def create_trainer(
  experiment: Experiment,
  workdir: str | os.PathLike,
  eval_fn: Callable[[Any, Any], Mapping[str, float]] | None = None,
) -> simigrad_jax.Trainer:
  """The :class:`simigrad_jax.Trainer` of ``experiment`` in ``workdir`` (resumes from its newest checkpoint).

  Its checkpoints record the options that decide the run (:mod:`train.run_settings`).
  The Trainer turns on JAX's persistent compilation cache in
  :func:`compilation_cache_dir` unless the config turns it off: a
  process-wide setting (see ``simigrad_jax.compile.persistent_cache_settings``).
  """
  settings = experiment.trainer_config
  upper = simigrad_jax.controllers.batch_size_bounds(experiment.controller)[1] or len(
    experiment.datasets.train
  )
  return simigrad_jax.Trainer(
    loss_fn=experiment.loss_fn,
    params=experiment.params,
    optimizer=experiment.optimizer,
    source=experiment.datasets.train,
    controller=experiment.controller,
    workdir=workdir,
    model_state=experiment.model_state,
    eval_fn=eval_fn if eval_fn is not None else experiment.evaluate,
    lr_schedule=experiment.lr_schedule,
    mesh=experiment.mesh,
    param_sharding=experiment.param_sharding,
    run_settings=run_settings.run_settings(experiment.config, experiment.datasets.text_sha256),
    config=settings.replace(
      max_micro_batch_size=max_micro_batch_size(
        settings.max_micro_batch_size, upper, experiment.mesh.shape[mesh_setup.DATA_AXIS]
      ),
      compile=settings.compile.replace(cache_dir=compilation_cache_dir(experiment.config)),
    ),
  )


def train_and_evaluate(
  config: ml_collections.ConfigDict, workdir: str | os.PathLike, *, title: str | None = None
) -> dict[str, Any]:
  """Trains ``config`` in ``workdir`` and reports: per-epoch lines, a summary table, the plot.

  Re-running with the same workdir resumes from its newest checkpoint and
  appends to ``metrics.jsonl`` without repeating a step; a finished run trains
  nothing and reports again. One run per workdir: it is locked before
  anything in it is read or written, and a second run fails at once naming
  the first (:mod:`simigrad_jax.multihost.workdir`); it must belong to this
  user and be writable by no other, unless ``config.allow_shared_workdir``.
  A start refused before its first step (a bad config, a missing data
  folder, ...) in a workdir it created leaves nothing behind; any other
  failure appends its traceback to ``<workdir>/failure.log``
  (:mod:`train.failures`).
  JAX's persistent compilation cache is on before the first compile (in the
  directory every run of this user shares, :func:`compilation_cache_dir`,
  unless the config says otherwise), so a second run, in this workdir or
  another, or a resume loads its executables from disk. That changes
  process-wide ``jax.config`` settings: a caller that compiles other things
  afterwards can run this inside
  ``simigrad_jax.compile.persistent_cache_settings()``.

  Args:
    config: the experiment config.
    workdir: where checkpoints, ``metrics.jsonl``, TensorBoard events,
      ``config.json`` (every start's config: :mod:`train.config_history`) and
      ``metrics.png`` go (created ``0700`` if missing).
    title: the plot's title.

  Returns:
    The whole run's summary (resumed parts included): ``eval_accuracy``,
    ``steps``, ``examples_seen``, ``average_batch_size``,
    ``final_batch_size``, ``compiles``, ``seconds`` and the file paths.

  Raises:
    simigrad_jax.multihost.WorkdirLockedError: another run holds the workdir.
    simigrad_jax.files.UnsafePathError: another user could change the workdir or
      the cache, or ``config.json`` is a symlink.
    simigrad_jax.Preempted: a SIGTERM or SIGINT stopped the run after saving
      the checkpoint of its last step (nothing is reported).
  """
  start = time.perf_counter()
  validation.check_path("workdir", workdir)  # "" would be the current folder
  made = _missing_folders(workdir)
  try:
    with open_workdir(
      workdir,
      allow_shared=config.allow_shared_workdir,
      agreement=ProcessAgreement(config.agreement_timeout_seconds),
    ) as held:
      try:
        return _train_and_evaluate_in(config, held, start=start, title=title)
      except BaseException as error:
        if made and not _holds_a_run(held.path):
          shutil.rmtree(held.path, ignore_errors=True)  # a refused start leaves nothing behind
        elif (
          jax.process_index() == 0
          and isinstance(error, Exception)  # (not a stop on a signal before training)
          and not isinstance(error, simigrad_jax.Preempted)
        ):
          with contextlib.suppress(AttributeError):  # where __main__ says the traceback is
            error.failure_log = failures.log_failure(held.path, error)  # type: ignore[attr-defined]
        raise
  finally:
    for folder in made[1:]:  # the parents this start made, if nothing else went in
      with contextlib.suppress(OSError):
        folder.rmdir()


# The files a run writes once it has trained (the summary, the profile, the plot).
WRITTEN_AFTER_TRAINING = ("summary.json", "similarity_profile.json", "metrics.png")


def _refuse_what_would_fail_the_last_writes(workdir: pathlib.Path) -> None:
  """Refuses, before training, a folder or other non-file where a file written after it will go.

  Found only when the training is over, it failed the run's last writes: no
  summary, and exit status 1 after every step had trained.
  """
  for name in WRITTEN_AFTER_TRAINING:
    path = workdir / name
    if os.path.lexists(path) and not path.is_symlink() and not path.is_file():
      raise files.refuse_special(path)


def _missing_folders(workdir: str | os.PathLike) -> list[pathlib.Path]:
  """The workdir and its parents that do not exist yet, the workdir first."""
  path = pathlib.Path(workdir).absolute()
  return [p for p in (path, *path.parents) if not os.path.lexists(p)]


def _holds_a_run(workdir: pathlib.Path) -> bool:
  """Whether a start in ``workdir`` got as far as a step: its metrics or a checkpoint."""
  metrics = workdir / "metrics.jsonl"
  checkpoints = workdir / "checkpoints"
  return (metrics.is_file() and metrics.stat().st_size > 0) or (
    checkpoints.is_dir() and any(checkpoints.iterdir())
  )


def _train_and_evaluate_in(
  config: ml_collections.ConfigDict, held: WorkdirLock, *, start: float, title: str | None
) -> dict[str, Any]:
  """:func:`train_and_evaluate` in a workdir whose lock this process holds."""
  workdir = held.path
  is_main = jax.process_index() == 0
  if is_main:  # refused now, not after training, if it is not a history this run can extend
    config_history.read_starts(workdir)
    _refuse_what_would_fail_the_last_writes(workdir)
  cache_dir = compilation_cache_dir(config)
  if cache_dir is not None:  # before the model's first compile, so that it is cached too
    enable_persistent_cache(cache_dir, allow_shared=config.allow_shared_workdir)
  experiment = create_experiment(config)
  printer = report.EpochPrinter(
    experiment.evaluate,
    workdir,
    config.num_epochs,
    eval_name=experiment.datasets.eval_name,
    enabled=is_main,
    eval_examples=(
      len(experiment.datasets.eval)
      if config.progress and experiment.datasets.eval is not None
      else None
    ),
  )
  trainer = create_trainer(experiment, held, printer if experiment.evaluate else None)
  printer.trainer = trainer
  if is_main:
    config_history.append_start(
      workdir,
      json.loads(config.to_json()),
      resumed_at_step=trainer.step,
      devices=report.describe_devices(experiment.devices, experiment.halves, config.mesh_shape),
      processes=jax.process_count(),
    )
    report.print_start(experiment, trainer)
  setup_seconds = time.perf_counter() - start
  with trainer:
    run = trainer.train(num_epochs=config.num_epochs, num_steps=config.num_steps)
    if config.batch_sizes_to_profile and is_main and hasattr(trainer.controller, "save_profile"):
      trainer.controller.save_profile(workdir / "similarity_profile.json")
  summary = report.summarize(
    workdir,
    run,
    experiment.devices,
    time.perf_counter() - start,
    experiment.halves,
    setup_seconds=setup_seconds,
  )
  summary["eval_name"] = experiment.datasets.eval_name
  summary.update(report.token_counts(summary, run, experiment.datasets))
  if is_main:
    if config.plot and summary["steps"]:
      summary["plot"] = str(
        plot.plot_metrics(
          workdir / "metrics.jsonl",
          workdir / "metrics.png",
          title=title or f"SimiGrad: {experiment.datasets.description}, {config.model}",
        )
      )
    report.print_summary(summary, run_settings.how_to_continue(config))
    files.write_atomic(workdir / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
  return summary
