"""Every setting checked before the first step: in Python (TrainerConfig, Trainer) and on the CLI.

Each bad value is refused with one line naming it, what is valid, and the
setting as the user types it: ``learning_rate`` in Python, ``config.X`` for a
training script's config in Python, ``--config.X`` on the command line. The
command line's checks run in-process here (the same functions ``python -m
train`` calls); a few subprocesses check the whole path, each failing before
JAX compiles anything.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import simigrad_jax
from command_line import parse
from simigrad_jax.checkpoint import resume_checks
from simigrad_jax.ingraph import lr_scaling
from tiny_run import trainer_objects
from tiny_run import trainer_with
from train import config_checks
from train import run_settings
from train import train
from train.configs import default
from train.datasets import Datasets

pytestmark = [
  pytest.mark.reliability,
  # ml_collections loads config files with importlib's deprecated load_module().
  pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning"),
]

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for p in (ROOT / "train" / "configs").glob("*.py") if p.stem != "__init__")

# ------------------------------------------------------------------ Python: TrainerConfig


@pytest.mark.parametrize(
  "make, match",
  [
    (
      lambda: simigrad_jax.TrainerConfig(max_micro_batch_size=0),
      r"max_micro_batch_size must be an integer >= 1, got 0",
    ),
    (
      lambda: simigrad_jax.CompileConfig(steps_per_compile=math.nan),
      r"compile.steps_per_compile must be a number in \(0, inf\) \(finite\), got nan",
    ),
    (
      lambda: simigrad_jax.CheckpointConfig(every_seconds=math.inf),
      r"checkpoints.every_seconds must be a number in \(0, inf\) \(finite\), got inf",
    ),
    (
      lambda: simigrad_jax.LearningRateConfig(adjust_factor=-1.0),
      r"lr.adjust_factor must be a number in \[0, inf\), got -1.0",
    ),
  ],
)
def test_trainer_config_refuses_each_value_out_of_range(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_a_misspelt_trainer_config_name_suggests_the_right_one():
  with pytest.raises(TypeError) as refused:
    simigrad_jax.TrainerConfig(max_micro_batch=32)  # type: ignore[call-arg]
  assert "'max_micro_batch' (did you mean 'max_micro_batch_size'?)" in str(refused.value)
  assert "\n" not in str(refused.value)


# ------------------------------------------------------------------ Python: the Trainer


def _factor_first():
  return optax.chain(
    simigrad_jax.scale_by_lr_factor(), simigrad_jax.transform("batch"), optax.sgd(0.1)
  )


def _transform_in_the_middle():
  return optax.chain(
    optax.sgd(0.1), simigrad_jax.transform("batch"), simigrad_jax.scale_by_lr_factor()
  )


def _integer_loss(params, model_state, batch, weights, rng):
  del params, weights, rng
  return batch["y"], model_state  # the labels: an int32 "loss" per row


TRAINER_CASES = {
  "empty workdir": (dict(workdir=""), ValueError, r"workdir must be a non-empty path, got ''"),
  "NaN learning rate": (
    dict(
      optimizer=optax.chain(
        simigrad_jax.transform("batch"), optax.sgd(math.nan), simigrad_jax.scale_by_lr_factor()
      )
    ),
    ValueError,
    r"the optimizer's hyperparameter update\.update_fns\[1\]\S*step_size is nan",
  ),
  "negative injected learning rate": (
    dict(
      optimizer=optax.chain(
        simigrad_jax.transform("batch"),
        optax.inject_hyperparams(optax.sgd)(learning_rate=-0.1),
        simigrad_jax.scale_by_lr_factor(),
      )
    ),
    ValueError,
    r"the optimizer's learning rate is negative \(\S*\['learning_rate'\] = -0\.1\)",
  ),
  "NaN schedule": (
    dict(lr_schedule=lambda epochs: math.nan),
    ValueError,
    r"lr_schedule\(0\.0\) must be a number in \[0, inf\) \(finite\), got nan",
  ),
  "negative schedule": (
    dict(lr_schedule=lambda epochs: -1.0),
    ValueError,
    r"lr_schedule\(0\.0\) must be a number in \[0, inf\) \(finite\), got -1\.0",
  ),
  "bool schedule": (  # float(True) is 1.0: a schedule that answers a bool is a mistake
    dict(lr_schedule=lambda epochs: True),
    ValueError,
    r"lr_schedule\(0\.0\) must be a number in \[0, inf\) \(finite\), not a bool, got True",
  ),
  "factor first": (
    dict(optimizer=_factor_first()),
    lr_scaling.ChainOrderError,
    r"simigrad_jax\.scale_by_lr_factor\(\) must come last in the optimizer chain, but its "
    r"LrFactorState is opt_state\[0\] of 3; build optax\.chain\(simigrad_jax\.transform",
  ),
  "transform in the middle": (
    dict(optimizer=_transform_in_the_middle()),
    lr_scaling.ChainOrderError,
    r"simigrad_jax\.transform must come first in the optimizer chain, but its SimilarityState "
    r"is opt_state\[1\] of 3",
  ),
  "integer loss": (
    dict(loss_fn=_integer_loss),
    simigrad_jax.ingraph.LossContractError,
    r"loss_fn must return floating-point losses, got dtype int32",
  ),
}


@pytest.mark.parametrize("case", TRAINER_CASES)
def test_the_trainer_refuses_a_bad_setting_before_the_first_step(case, tmp_path, devices):
  changes, error, match = TRAINER_CASES[case]
  arguments = trainer_objects(tmp_path / "run") | {"devices": devices} | changes
  with pytest.raises(error, match=match) as refused:
    trainer_with(**arguments, max_micro_batch_size=4, seed=3, progress=False, tensorboard=False)
  assert "\n" not in str(refused.value)
  assert isinstance(refused.value, (simigrad_jax.SimiGradError, ValueError))
  assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained
  if case == "empty workdir":
    assert not (pathlib.Path.cwd() / "checkpoints").exists()


@pytest.mark.parametrize(
  "optimizer",
  [
    optax.chain(
      simigrad_jax.transform("batch"),
      optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(0.1, momentum=0.9)),
      simigrad_jax.scale_by_lr_factor(),
    ),
    optax.chain(
      optax.chain(simigrad_jax.transform("batch"), optax.adam(1e-3)),
      simigrad_jax.scale_by_lr_factor(),
    ),
    optax.MultiSteps(
      optax.chain(
        simigrad_jax.transform("batch"), optax.sgd(0.1), simigrad_jax.scale_by_lr_factor()
      ),
      every_k_schedule=2,
    ).gradient_transformation(),
  ],
  ids=["nested optimizer", "nested transform", "wrapped chain"],
)
def test_a_chain_in_order_is_accepted_nested_or_wrapped(optimizer):
  lr_scaling.check_chain_order(optimizer.init({"w": jnp.zeros(3)}))


def test_a_chain_with_a_link_after_the_factor_is_refused():
  optimizer = optax.chain(
    simigrad_jax.transform("batch"),
    optax.sgd(0.1),
    simigrad_jax.scale_by_lr_factor(),
    optax.clip(1.0),
  )
  with pytest.raises(lr_scaling.ChainOrderError, match=r"LrFactorState is opt_state\[2\] of 4"):
    lr_scaling.check_chain_order(optimizer.init({"w": jnp.zeros(3)}))


# ------------------------------------------------------------------ the training scripts' config


def test_every_numeric_option_has_a_range():
  config = default.get_config()
  numeric = {
    name
    for name, value in config.items()
    if name not in ("nesterov", "sync_batchnorm", "enable_adjust", "one_step_late")
    and not isinstance(value, (bool, str))
    and (
      isinstance(value, (int, float, tuple))
      or config.get_type(name) in (int, float)  # a placeholder (None by default)
    )
  }
  assert numeric == set(config_checks.INTEGERS) | set(config_checks.NUMBERS)
  assert not set(config_checks.INTEGERS) & set(config_checks.NUMBERS)
  assert set(config_checks.USED_ONLY) <= set(config) and config_checks.HARMLESS <= set(
    config_checks.USED_ONLY
  )


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_passes_its_checks(path):
  config, given = parse(path)
  config_checks.check_config(config)
  config_checks.check_given(config, given)


DOCS = "".join(p.read_text() for p in [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))])


def test_the_documented_commands_pass_the_checks():
  commands = [
    line.split("python -m train ", 1)[1]
    for block in re.findall(r"^```bash\n(.*?)^```", DOCS, re.S | re.M)
    for line in block.replace("\\\n", " ").splitlines()
    if "python -m train " in line
  ]
  assert commands
  for command in commands:
    args = shlex.split(command)
    overrides = [a for a in args if a.startswith("--config.")]
    config, given = parse(ROOT / args[args.index("--config") + 1], *overrides)
    config_checks.check_config(config)
    config_checks.check_given(config, given)


CONFIG_CASES = [
  (
    "--config.learning_rate=nan",
    r"config\.learning_rate must be a number in \[0, inf\) \(finite\), got nan",
  ),
  (
    "--config.learning_rate=inf",
    r"config\.learning_rate must be a number in \[0, inf\) \(finite\), got inf",
  ),
  (
    "--config.learning_rate=-0.1",
    r"config\.learning_rate must be a number in \[0, inf\) \(finite\), got -0\.1",
  ),
  ("--config.eval_batch_size=-1", r"config\.eval_batch_size must be an integer >= 1, got -1"),
  ("--config.eval_batch_size=0", r"config\.eval_batch_size must be an integer >= 1, got 0"),
  ("--config.num_epochs=0", r"config\.num_epochs must be a number in \(0, inf\) \(finite\), got 0"),
  ("--config.initial_batch_size=0", r"config\.initial_batch_size must be an integer >= 1, got 0"),
  ("--config.batch_size_upper_bound=-8", r"config\.batch_size_upper_bound must be an integer >= 1"),
  ("--config.max_checkpoints=0", r"config\.max_checkpoints must be an integer >= 1, got 0"),
  ("--config.mlp_hidden=(16, 0)", r"config\.mlp_hidden must be an integer >= 1, got 0"),
  ("--config.momentum=1.5", r"config\.momentum must be a number in \[0, 1\), got 1\.5"),
  (
    "--config.num_classes=5",
    r"config\.num_classes=5 contradicts the data: dataset 'digits' has 10",
  ),
]


@pytest.mark.parametrize("override, match", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_the_config_refuses_each_value_out_of_range(override, match):
  config, _ = parse(ROOT / "train/configs/digits_demo.py", override)
  with pytest.raises(ValueError, match=match):
    config_checks.check_config(config)


def test_a_negative_decay_epoch_is_refused():
  config, _ = parse(
    ROOT / "train/configs/digits_demo.py",
    "--config.lr_schedule=step",
    "--config.lr_decay_epochs=(2.0, -1.0)",
  )
  with pytest.raises(ValueError, match=r"config\.lr_decay_epochs must be a number in \[0, inf\)"):
    config_checks.check_config(config)


@pytest.mark.parametrize(
  "overrides, match",
  [
    (["--config.text_files=a.txt"], r"config\.text_files='a\.txt' is read only by datasets 'text'"),
    (
      ["--config.lr_decay_epochs=(3.0,)"],
      r"config\.lr_decay_epochs=\(3\.0,\) is read only by lr_sc",
    ),
    (
      ["--config.optimizer=adamw", "--config.momentum=0.5"],
      r"config\.momentum=0\.5 is read only by",
    ),
    (
      ["--config.controller=gns", "--config.similarity_target=0.2"],
      r"similarity_target=0\.2 is re",
    ),
  ],
)
def test_an_option_the_run_ignores_is_refused(overrides, match):
  config, given = parse(ROOT / "train/configs/digits_demo.py", *overrides)
  with pytest.raises(ValueError, match=match):
    config_checks.check_given(config, given)


def test_a_harmless_option_the_run_ignores_is_warned_about(caplog):
  config, given = parse(ROOT / "train/configs/digits_demo.py", "--config.local_data_dir=/data")
  with caplog.at_level(logging.WARNING):
    config_checks.check_given(config, given)
  assert "config.local_data_dir='/data' is read only by datasets 'mnist'" in caplog.text


def test_labels_out_of_range_are_refused():
  def datasets(labels):
    source = simigrad_jax.ArraySource({"image": np.zeros((4, 2), np.float32), "label": labels})
    return Datasets(train=source, eval=None, num_classes=10)

  config_checks.check_data_labels(datasets(np.array([0, 3, 9, 1])))
  with pytest.raises(ValueError, match=r"the training data hold label 10, outside \[0, 10\)"):
    config_checks.check_data_labels(datasets(np.array([0, 3, 10, 1])))
  with pytest.raises(ValueError, match=r"the training data hold label -1, outside \[0, 10\)"):
    config_checks.check_data_labels(datasets(np.array([0, -1, 9, 1])))


def test_an_empty_workdir_is_refused_by_the_training_scripts(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError, match=r"workdir must be a non-empty path, got ''"):
    train.train_and_evaluate(default.get_config(), "")
  assert list(tmp_path.iterdir()) == []


def test_the_suggestions_are_flags_the_command_line_takes():
  from train import __main__ as main  # pylint: disable=import-outside-toplevel

  # A resume with changed settings: the library's fix, spelt as a flag.
  line = main.command_line_spelling(
    f"simigrad: the checkpoint was made with other settings. {resume_checks.HOW_TO_ALLOW}",
    default.get_config().keys(),
  )
  assert "--config.allow_changed_settings=True" in line
  config, _ = parse(ROOT / "train/configs/digits_demo.py", "--config.allow_changed_settings=True")
  assert config.allow_changed_settings is True
  # A complete run's note: a cosine schedule records num_epochs, so more epochs need the flag too.
  cosine = default.get_config()
  cosine.lr_schedule = "cosine"
  assert "num_epochs" in run_settings.run_settings(cosine)
  assert run_settings.how_to_continue(cosine).startswith(
    "give more --config.num_epochs with --config.allow_changed_settings=True"
  )
  assert "num_epochs" not in run_settings.run_settings(default.get_config())
  assert run_settings.how_to_continue(default.get_config()) == "give more --config.num_epochs"


def test_a_cosine_run_continues_with_the_suggested_flags(tmp_path):
  """The complete run's note, followed: more epochs with allow_changed_settings train on."""
  config = default.get_config()
  settings = dict(
    lr_schedule="cosine",
    num_epochs=0.05,
    mode="pad",
    mlp_hidden=(8,),
    initial_batch_size=16,
    batch_size_lower_bound=8,
    batch_size_upper_bound=32,
    max_micro_batch_size=4,
    eval_examples=8,
    eval_batch_size=8,
    progress=False,
    tensorboard=False,
    plot=False,
    compilation_cache=False,
    platform="cpu",
  )
  config.update(settings)
  first = train.train_and_evaluate(config, tmp_path)
  config.num_epochs = 0.1
  with pytest.raises(simigrad_jax.checkpoint.CheckpointMismatchError, match="num_epochs"):
    train.train_and_evaluate(config, tmp_path)
  config.allow_changed_settings = True
  second = train.train_and_evaluate(config, tmp_path)
  assert second["steps"] > first["steps"]


# ------------------------------------------------------------------ the command line, end to end


def run_train(workdir, *args):
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  env.pop("XLA_FLAGS", None)
  command = [sys.executable, "-m", "train", "--config", "train/configs/digits_demo.py"]
  command += ["--workdir", str(workdir), *args]
  return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
  "override, line",
  [
    (
      "--config.learning_rate=nan",
      "simigrad: --config.learning_rate must be a number in [0, inf) (finite), got nan",
    ),
    (
      "--config.text_files=a.txt",
      "simigrad: --config.text_files='a.txt' is read only by datasets 'text' and 'chars'; ",
    ),
  ],
)
def test_the_command_line_refuses_a_bad_option_in_its_own_spelling(tmp_path, override, line):
  result = run_train(tmp_path / "run", override)
  assert result.returncode == 1, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(line), result.stderr[-3000:]
  assert not (tmp_path / "run").exists()  # refused before the workdir was made


def test_the_command_line_refuses_an_empty_workdir(tmp_path):
  result = run_train("")
  assert result.returncode == 2
  assert result.stderr.strip() == (
    "simigrad: --workdir='' is empty; give a folder, or leave --workdir out for the default "
    "($XDG_CACHE_HOME/simigrad/<config name>)"
  )


def test_every_numeric_trainer_setting_is_refused_out_of_range():
  """Every numeric field of TrainerConfig and its groups is refused out of range (a guard for a
  field added later without a check)."""
  bad = {int: -1, float: math.nan}
  groups = [
    (simigrad_jax.TrainerConfig, dict(max_micro_batch_size=4)),
    (simigrad_jax.CompileConfig, {}),
    (simigrad_jax.CheckpointConfig, {}),
    (simigrad_jax.LearningRateConfig, {}),
  ]
  for group, required in groups:
    for field in dataclasses.fields(group):
      kind = next((k for k in (int, float) if k.__name__ in str(field.type).split(" | ")), None)
      if kind is None or field.type.startswith("bool"):
        continue
      with pytest.raises(ValueError, match=field.name):
        group(**(required | {field.name: bad[kind]}))
