"""Every option of a config checked before anything is built: its range, and whether the run uses it.

:func:`check_config` runs first in :func:`train.train.create_experiment`, so
that ``python -m train`` refuses a bad value within the seconds JAX takes to
import, before any data is read or anything compiled:

* every numeric option has a range (:data:`INTEGERS`, :data:`NUMBERS`): a
  NaN or infinite learning rate, a negative one, a size of zero or below, a
  negative ``lr_decay_epochs`` entry are refused with the option, the value
  and what is valid; an option of a few names (:data:`CHOICES`) one of them;
* an option given on the command line that the chosen data set, model,
  optimizer, schedule or controller never reads (:data:`USED_ONLY`;
  :func:`check_given`, which ``python -m train`` runs before it imports JAX)
  is refused when it would change what is trained had it been read
  (``text_files`` with the digits: the run would train on the digits), and
  only warned about when it says where the data is read from or how fast,
  or how the steps compile (:data:`HARMLESS`: ``local_data_dir`` with the
  digits);
* ``num_classes`` must be the data set's where the data set fixes it (the
  digits and MNIST have 10), and the labels of data held in memory must lie
  in ``[0, num_classes)`` (:func:`check_labels`).

Errors name the option as Python code reads it (``config.learning_rate``);
``python -m train`` prints it as the flag is typed (``--config.learning_rate``).

Example:
  >>> from train.configs import default
  >>> config = default.get_config()
  >>> config.learning_rate = float("nan")
  >>> try:
  ...   check_config(config)
  ... except ValueError as error:
  ...   print(error)
  config.learning_rate must be a number in [0, inf) (finite), got nan
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from typing import Any, NamedTuple

import ml_collections
import numpy as np
from absl import logging

from simigrad_jax import validation
from simigrad_jax.data import ArraySource
from simigrad_jax.ingraph import half_batch


class Interval(NamedTuple):
  """A range of real numbers (:func:`simigrad_jax.validation.check_interval`)."""

  low: float = -math.inf
  high: float = math.inf
  low_open: bool = False
  high_open: bool = False


# Each option an integer >= this (a tuple option: each of its entries); None where the option
# may be None (its default is a placeholder).
INTEGERS: Mapping[str, int] = {
  "seed": 0,
  "num_steps": 1,
  "num_cpu_devices": 1,
  "data_seed": 0,
  "num_classes": 2,
  "host_image_size": 1,
  "num_workers": 0,
  "decode_threads": 1,
  "records_per_example": 1,
  "eval_examples": 1,
  "eval_batch_size": 1,
  "crop_padding": 0,
  "image_size": 1,
  "mlp_hidden": 1,
  "cnn_features": 1,
  "cnn_dense": 1,
  "resnet_filters": 1,
  "resnet_stage_sizes": 1,
  "seq_length": 1,
  "bert_hidden": 1,
  "bert_layers": 1,
  "bert_heads": 1,
  "bert_mlp": 1,
  "initial_batch_size": 1,
  "batch_size_lower_bound": 1,
  "batch_size_upper_bound": 1,
  "controller_warmup_steps": 0,
  "batch_sizes_to_profile": 1,
  "profile_steps_per_size": 1,
  "max_micro_batch_size": 1,
  "min_micro_batch_size": 1,
  "checkpoint_every_steps": 1,
  "max_checkpoints": 1,
  "measure_every": 1,
  "shapes_per_octave": 1,
  "shapes_per_step": 1,
  "compile_threads": 1,
}

_POSITIVE = Interval(0, low_open=True)
_NON_NEGATIVE = Interval(0)
_FRACTION = Interval(0, 1, high_open=True)  # [0, 1)

# Each option a finite number in its interval (a tuple option: each of its entries).
NUMBERS: Mapping[str, Interval] = {
  "num_epochs": _POSITIVE,
  "image_mean": Interval(0, 255),  # per channel, on the 0-255 scale
  "image_std": _POSITIVE,
  "eval_fraction": _FRACTION,
  "bn_momentum": Interval(0, 1),
  "label_smoothing": _FRACTION,
  "dropout": _FRACTION,
  "mask_rate": Interval(0, 1, low_open=True),
  "learning_rate": _NON_NEGATIVE,
  "momentum": _FRACTION,
  "weight_decay": _NON_NEGATIVE,
  "b1": _FRACTION,
  "b2": _FRACTION,
  "eps": _NON_NEGATIVE,
  "grad_clip_norm": _NON_NEGATIVE,
  "lr_decay_epochs": _NON_NEGATIVE,
  "lr_decay_factor": _POSITIVE,
  "warmup_epochs": _NON_NEGATIVE,
  "similarity_target": Interval(-1, 1),
  "smooth_factor": _FRACTION,
  "dead_band": _NON_NEGATIVE,
  "similarity_ema_decay": _FRACTION,
  "lr_adjust_factor": _NON_NEGATIVE,
  "checkpoint_every_seconds": _POSITIVE,
  "agreement_timeout_seconds": _POSITIVE,
  "steps_per_compile": _POSITIVE,
}

# Each option one of these names.
CHOICES: Mapping[str, tuple[str, ...]] = {
  "halves_passes": tuple(half_batch.PASSES),  # how the local split takes its halves' gradients
}

_IMAGE_MODELS = ("mlp", "cnn", "resnet18", "resnet34", "resnet50", "resnet101")
_TFDS = ("tfds", "tfds_resized", "tfds_text")


def _data(*names: str) -> Callable[[Any], bool]:
  return lambda config: config.dataset in names


def _model(*names: str) -> Callable[[Any], bool]:
  return lambda config: config.model in names


def _optimizer(*names: str) -> Callable[[Any], bool]:
  return lambda config: config.optimizer in names


def _reference_controller(config: Any) -> bool:
  return config.controller in ("simigrad", "fixed")


# Each option that only some runs read: when it is read, in words and as a test of the config.
USED_ONLY: Mapping[str, tuple[str, Callable[[Any], bool]]] = {
  "data_seed": ("dataset 'digits'", _data("digits")),
  "tfds_name": ("the TFDS data sets", _data(*_TFDS)),
  "train_split": ("the TFDS data sets and MNIST", _data("mnist", *_TFDS)),
  "eval_split": ("the TFDS data sets and MNIST", _data("mnist", *_TFDS)),
  "data_dir": ("the TFDS data sets, MNIST and 'chars'", _data("mnist", "chars", *_TFDS)),
  "download": ("the TFDS data sets, MNIST and 'chars'", _data("mnist", "chars", *_TFDS)),
  "num_classes": ("datasets 'tfds' and 'tfds_resized'", _data("tfds", "tfds_resized")),
  "image_mean": ("datasets 'tfds' and 'tfds_resized'", _data("tfds", "tfds_resized")),
  "image_std": ("datasets 'tfds' and 'tfds_resized'", _data("tfds", "tfds_resized")),
  "host_image_size": ("dataset 'tfds_resized'", _data("tfds_resized")),
  "num_workers": ("the TFDS image sets and MNIST", _data("mnist", "tfds", "tfds_resized")),
  "decode_threads": ("the TFDS image sets and MNIST", _data("mnist", "tfds", "tfds_resized")),
  "on_bad_record": ("the TFDS image sets and MNIST", _data("mnist", "tfds", "tfds_resized")),
  "local_data_dir": ("datasets 'mnist', 'text' and 'chars'", _data("mnist", "text", "chars")),
  "mnist_source": ("dataset 'mnist'", _data("mnist")),
  "text_files": ("datasets 'text' and 'chars'", _data("text", "chars")),
  "text_source": ("dataset 'chars'", _data("chars")),
  "eval_fraction": ("datasets 'text' and 'chars'", _data("text", "chars")),
  "text_feature": ("dataset 'tfds_text'", _data("tfds_text")),
  "records_per_example": ("dataset 'tfds_text'", _data("tfds_text")),
  "augment": ("the image models", _model(*_IMAGE_MODELS)),
  "crop_padding": ("augment 'crop_flip'", lambda config: config.augment == "crop_flip"),
  "image_size": ("augment 'inception'", lambda config: config.augment == "inception"),
  "label_smoothing": ("the image models", _model(*_IMAGE_MODELS)),
  "mlp_hidden": ("model 'mlp'", _model("mlp")),
  "cnn_features": ("model 'cnn'", _model("cnn")),
  "cnn_dense": ("model 'cnn'", _model("cnn")),
  "resnet_filters": ("the ResNets", _model(*_IMAGE_MODELS[2:])),
  "resnet_stage_sizes": ("the ResNets", _model(*_IMAGE_MODELS[2:])),
  "resnet_stem": ("the ResNets", _model(*_IMAGE_MODELS[2:])),
  "sync_batchnorm": ("the ResNets", _model(*_IMAGE_MODELS[2:])),
  "bn_momentum": ("the ResNets", _model(*_IMAGE_MODELS[2:])),
  "seq_length": ("the text data sets and models", _data("text", "tfds_text", "chars")),
  "bert_hidden": ("models 'bert' and 'causal_lm'", _model("bert", "causal_lm")),
  "bert_layers": ("models 'bert' and 'causal_lm'", _model("bert", "causal_lm")),
  "bert_heads": ("models 'bert' and 'causal_lm'", _model("bert", "causal_lm")),
  "bert_mlp": ("models 'bert' and 'causal_lm'", _model("bert", "causal_lm")),
  "dropout": ("models 'bert' and 'causal_lm'", _model("bert", "causal_lm")),
  "mask_rate": ("model 'bert'", _model("bert")),
  "momentum": ("optimizer 'sgd'", _optimizer("sgd")),
  "nesterov": ("optimizer 'sgd'", _optimizer("sgd")),
  "b1": ("optimizers 'adamw' and 'lamb'", _optimizer("adamw", "lamb")),
  "b2": ("optimizers 'adamw' and 'lamb'", _optimizer("adamw", "lamb")),
  "eps": ("optimizers 'adamw' and 'lamb'", _optimizer("adamw", "lamb")),
  "lr_decay_epochs": ("lr_schedule 'step'", lambda config: config.lr_schedule == "step"),
  "lr_decay_factor": ("lr_schedule 'step'", lambda config: config.lr_schedule == "step"),
  "similarity_target": ("controllers 'simigrad' and 'fixed'", _reference_controller),
  "enable_adjust": ("controller 'simigrad'", lambda config: config.controller == "simigrad"),
  "smooth_factor": ("controllers 'simigrad' and 'fixed'", _reference_controller),
  "dead_band": ("controllers 'simigrad' and 'fixed'", _reference_controller),
  "similarity_ema_decay": ("controllers 'simigrad' and 'fixed'", _reference_controller),
  "controller_warmup_steps": ("controllers 'simigrad' and 'fixed'", _reference_controller),
  "batch_sizes_to_profile": ("controllers 'simigrad' and 'fixed'", _reference_controller),
  "profile_steps_per_size": ("controllers 'simigrad' and 'fixed'", _reference_controller),
  "min_micro_batch_size": ("mode 'recompile'", lambda config: config.mode == "recompile"),
  "compile_fallback": ("mode 'recompile'", lambda config: config.mode == "recompile"),
  "compilation_cache_dir": ("compilation_cache=True", lambda config: config.compilation_cache),
}

# The options of USED_ONLY that say where the data is read from and how fast, how the steps
# compile or where the cache lies, not what is trained: given where they are not read, they are
# warned about, not refused (a shell alias or a script may give them to every run).
HARMLESS: frozenset[str] = frozenset(
  {
    "data_dir",
    "download",
    "local_data_dir",
    "num_workers",
    "decode_threads",
    "on_bad_record",
    "eval_split",
    "min_micro_batch_size",
    "compile_fallback",
    "compilation_cache_dir",
  }
)

# The data sets that fix their number of classes.
FIXED_CLASSES: Mapping[str, int] = {"digits": 10, "mnist": 10}


def check_config(config: ml_collections.ConfigDict) -> None:
  """Refuses a config with a value out of its range, or a ``num_classes`` its data contradicts.

  Args:
    config: the experiment config (``train/configs/``), overrides applied.

  Raises:
    ValueError: naming the first bad option (``config.eval_batch_size``),
      its value and what is valid.
  """
  for name, minimum in INTEGERS.items():
    for value in _values(config, name):
      validation.check_int(f"config.{name}", value, minimum)
  if "seed" in config:  # the random keys' seed (data_seed shuffles with NumPy, which takes any)
    validation.check_seed(config.seed, "config.seed")
  for name, interval in NUMBERS.items():
    for value in _values(config, name):
      validation.check_interval(
        f"config.{name}",
        value,
        interval.low,
        interval.high,
        low_open=interval.low_open,
        high_open=interval.high_open,
      )
  for name, choices in CHOICES.items():
    if name in config and config[name] not in choices:
      raise ValueError(f"config.{name}={config[name]!r} is not valid; choose one of {choices}")
  fixed = FIXED_CLASSES.get(config.dataset)
  if fixed is not None and config.num_classes != fixed:
    raise ValueError(
      f"config.num_classes={config.num_classes} contradicts the data: dataset "
      f"{config.dataset!r} has {fixed} classes (labels 0-{fixed - 1}); leave "
      f"config.num_classes at {fixed}"
    )


def check_given(config: ml_collections.ConfigDict, given: Collection[str]) -> None:
  """Refuses an option given for a run that ignores it; warns about a harmless one.

  Only the options the user gave count: a config file may build on another
  (``mnist_cnn`` on ``mnist_mlp``, whose ``mlp_hidden`` it keeps unread), and
  its own values are not the user's mistake. ``python -m train`` passes the
  options of its ``--config.KEY=VALUE`` flags.

  Args:
    config: the experiment config, overrides applied.
    given: the names of the options the user gave.

  Raises:
    ValueError: naming the first ignored option that would change what is
      trained had it been read (:data:`USED_ONLY` but not :data:`HARMLESS`),
      what reads it, and this run's choices.
  """
  for name in given:
    if name not in USED_ONLY or USED_ONLY[name][1](config):
      continue
    message = (
      f"config.{name}={config.get(name)!r} is read only by {USED_ONLY[name][0]}; this run "
      f"(dataset {config.dataset!r}, model {config.model!r}, optimizer {config.optimizer!r}, "
      f"lr_schedule {config.lr_schedule!r}, controller {config.controller!r}, mode "
      f"{config.mode!r}) ignores it"
    )
    if name in HARMLESS:
      logging.warning("%s", message)
    else:
      raise ValueError(f"{message}; leave it out, or choose the run that reads it")


def check_labels(labels: Any, num_classes: int, where: str) -> None:
  """Refuses class labels outside ``[0, num_classes)``: a loss of NaN at every step.

  Args:
    labels: the labels of a data set held in memory.
    num_classes: the model's number of classes.
    where: names the data set in the message.

  Raises:
    ValueError: naming the smallest or largest label and the valid range.

  Example:
    >>> check_labels(np.array([0, 9]), 10, "the digits")
    >>> try:
    ...   check_labels(np.array([0, 10]), 10, "the digits")
    ... except ValueError as error:
    ...   print(error)
    the digits hold label 10, outside [0, 10) for num_classes=10; give config.num_classes above the largest label
  """
  labels = np.asarray(labels)
  if labels.size == 0:
    return
  low, high = int(labels.min()), int(labels.max())
  if low < 0:
    raise ValueError(
      f"{where} hold label {low}, outside [0, {num_classes}) for num_classes={num_classes}; "
      "labels must be class indices from 0"
    )
  if high >= num_classes:
    raise ValueError(
      f"{where} hold label {high}, outside [0, {num_classes}) for num_classes={num_classes}; "
      "give config.num_classes above the largest label"
    )


def check_data_labels(datasets: Any) -> None:
  """Refuses a classification set held in memory whose labels :func:`check_labels` refuses.

  Data read from files as the run goes (TFDS) is not read ahead for this.

  Args:
    datasets: the run's :class:`train.datasets.Datasets`.
  """
  if not datasets.num_classes:
    return
  for name, source in (("training", datasets.train), (datasets.eval_name, datasets.eval)):
    if isinstance(source, ArraySource) and "label" in source.element_spec:
      labels = source.get_batch(np.arange(len(source)))["label"]
      check_labels(labels, datasets.num_classes, f"the {name} data")


def _values(config: ml_collections.ConfigDict, name: str) -> list[Any]:
  """The value of option ``name`` as a list: a tuple's entries, nothing for None."""
  value = config.get(name)
  if value is None:
    return []
  return list(value) if isinstance(value, (tuple, list)) else [value]
