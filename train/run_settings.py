"""Which of a config's options decide a run, recorded in its checkpoints and checked on resume.

The Trainer records the optimizer's hyperparameters, the controller's
settings, the data, the model, the devices and the versions itself; the
config adds what it cannot see (the model's definition, the augmentation,
the schedule, ...). A resume whose config differs in one of these options is
refused with the differences listed, unless ``--config.allow_changed_settings``
(then the change is logged and recorded in the checkpoints' history).

The options listed in :data:`NOT_DECIDING` change how a run is carried out,
watched or stored, not what it computes: they may change between a run and
its resume freely.
"""

from __future__ import annotations

import json
from typing import Any

import ml_collections

NOT_DECIDING: frozenset[str] = frozenset(
  {
    # How long: a resume that goes on for more epochs or steps is the same run (but see
    # "cosine", whose schedule spans num_epochs).
    "num_epochs",
    "num_steps",
    # Where it runs and how the steps are laid out (the Trainer records these itself).
    "platform",
    "num_cpu_devices",
    "halves",
    "mesh_shape",
    "param_sharding",
    "max_micro_batch_size",
    "min_micro_batch_size",
    "mode",
    "compile_fallback",
    "shapes_per_octave",
    "shapes_per_step",
    "steps_per_compile",
    "compile_threads",
    # Where the data is read from and how fast; what the evaluation reads.
    "data_dir",
    "download",
    "local_data_dir",
    "num_workers",
    "decode_threads",
    "eval_split",
    "eval_examples",
    "eval_batch_size",
    # What is shown, saved and cached, and how long hosts wait for each other.
    "verbose",
    "progress",
    "tensorboard",
    "plot",
    "checkpoint_every_steps",
    "max_checkpoints",
    "compilation_cache",
    "compilation_cache_dir",
    "agreement_timeout_seconds",
    "allow_changed_settings",
    "allow_shared_workdir",
    "checkpoint_every_seconds",
  }
)


def run_settings(
  config: ml_collections.ConfigDict, text_sha256: str | None = None
) -> dict[str, Any]:
  """The options of ``config`` that decide the run, as JSON data (the Trainer's ``run_settings``).

  Args:
    config: the experiment config.
    text_sha256: the digest of the text trained on, for data read from text
      files (:attr:`train.datasets.Datasets.text_sha256`): where the text
      comes from (``text_files``, ``local_data_dir``) may change between a
      run and its resume, the text may not.

  Returns:
    Every option but those in :data:`NOT_DECIDING`; ``num_epochs`` too with
    the ``"cosine"`` schedule, which it stretches; ``text_sha256`` where
    given.

  Example:
    >>> from train.configs import default
    >>> settings = run_settings(default.get_config())
    >>> settings["learning_rate"], "progress" in settings, "num_epochs" in settings
    (0.05, False, False)
  """
  options = json.loads(config.to_json())
  kept = {name: value for name, value in options.items() if name not in NOT_DECIDING}
  if options.get("lr_schedule") == "cosine":
    kept["num_epochs"] = options["num_epochs"]
  if text_sha256 is not None:
    kept["text_sha256"] = text_sha256
  return kept


def how_to_continue(config: ml_collections.ConfigDict) -> str:
  """The flags that continue a run of ``config`` that is complete, for its note.

  More epochs continue it; with the ``"cosine"`` schedule, which spans
  ``num_epochs`` (:func:`run_settings` records it), a resume with more is a
  changed setting that must be allowed, and the schedule then stretches to
  the new length.

  Example:
    >>> from train.configs import default
    >>> config = default.get_config()
    >>> how_to_continue(config)
    'give more --config.num_epochs'
    >>> config.lr_schedule = "cosine"
    >>> how_to_continue(config)  # doctest: +ELLIPSIS
    'give more --config.num_epochs with --config.allow_changed_settings=True (the cosine ...'
  """
  if config.lr_schedule != "cosine":
    return "give more --config.num_epochs"
  return (
    "give more --config.num_epochs with --config.allow_changed_settings=True (the cosine "
    "schedule spans num_epochs: it stretches to the new length, so the learning rate rises "
    "again)"
  )
