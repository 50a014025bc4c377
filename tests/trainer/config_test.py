"""TrainerConfig: the Trainer's settings, checked in one place, a misspelt one named."""

import dataclasses
import doctest

import numpy as np
import pytest

import simigrad_jax
from simigrad_jax.trainer import config as config_module
from simigrad_jax.trainer.config import TrainerConfig
from tiny_run import trainer_objects

# (setting, bad value, the message's start): each bad value is named in its error.
BAD_SETTINGS = [
  ("max_micro_batch_size", 0, r"max_micro_batch_size must be an integer >= 1, got 0"),
  ("max_micro_batch_size", 2.5, r"max_micro_batch_size must be an integer >= 1, got 2.5 \(float\)"),
  ("mode", "fast", r"mode='fast' is not valid; choose one of \('recompile', 'pad'\)"),
  (
    "min_micro_batch_size",
    16,
    r"min_micro_batch_size must be None or an integer in \[1, max_micro_batch_size=8\], got 16",
  ),
  (
    "shapes_per_octave",
    0,
    r"shapes_per_octave must be an int in \[1, 16\] \(shapes per factor of two in the "
    r"micro-batch grid; 1 halves\), got 0",
  ),
  ("shapes_per_octave", 2.5, r"shapes_per_octave must be an int in \[1, 16\].*got 2.5"),
  ("lr_rule", "cube", r"lr_rule='cube' is not valid; choose one of \('sqrt', 'linear', 'none'\)"),
  (
    "lr_coupling",
    "cap",
    r"lr_coupling='cap' is not valid; choose one of \('full', 'peak'\)",
  ),
  ("lr_adjust_factor", -1.0, r"lr_adjust_factor must be a number in \[0, inf\), got -1.0"),
  ("seed", -1, r"seed must be an integer >= 0, got -1"),
  ("checkpoint_every_steps", 0, r"checkpoint_every_steps must be an integer >= 1, got 0"),
  (
    "checkpoint_every_seconds",
    0,
    r"checkpoint_every_seconds must be a number in \(0, inf\) \(finite\), got 0",
  ),
  ("max_checkpoints", 0, r"max_checkpoints must be an integer >= 1, got 0"),
  ("allow_changed_settings", "yes", r"allow_changed_settings must be True or False, got 'yes'"),
  ("background_compile", 1, r"background_compile must be True or False, got 1 \(int\)"),
  ("compile_fallback", "yes", r"compile_fallback must be True or False, got 'yes'"),
  ("timed_fallback", 1, r"timed_fallback must be True or False, got 1"),
  ("steps_per_compile", 0, r"steps_per_compile must be .*\(0, inf\) \(finite\), got 0"),
  ("tensorboard", "yes", r"tensorboard must be True or False, got 'yes'"),
  ("progress", 0, r"progress must be True or False, got 0"),
  ("compilation_cache_dir", 3, r"compilation_cache_dir must be None or a path"),
  ("allow_shared_workdir", "no", r"allow_shared_workdir must be True or False, got 'no'"),
  ("axis_name", "", r"axis_name must be a non-empty string, got ''"),
  (
    "halves",
    "random",
    r"halves='random' is not valid; choose one of \('auto', 'device', 'local'\)",
  ),
  (
    "agreement_timeout_seconds",
    0,
    r"agreement_timeout_seconds must be a number in \(0, inf\) \(finite\), got 0",
  ),
  ("agreement_timeout_seconds", float("inf"), r"agreement_timeout_seconds must be a number"),
]


@pytest.mark.parametrize(
  "name, value, message", BAD_SETTINGS, ids=[f"{n}={v!r}" for n, v, _ in BAD_SETTINGS]
)
def test_a_bad_value_names_itself(name, value, message):
  with pytest.raises(ValueError, match=f"^{message}"):
    TrainerConfig(**{"max_micro_batch_size": 8, name: value})


def test_every_setting_is_checked():
  fields = {f.name for f in dataclasses.fields(TrainerConfig)}
  assert fields == {name for name, _, _ in BAD_SETTINGS}


def test_values_are_kept_as_plain_python_and_the_config_is_frozen():
  config = TrainerConfig(
    max_micro_batch_size=np.int64(8),
    seed=np.int32(3),
    agreement_timeout_seconds=None,
    lr_adjust_factor=1,
  )
  assert type(config.max_micro_batch_size) is int and type(config.seed) is int
  assert config.agreement_timeout_seconds == 300.0 and config.lr_adjust_factor == 1.0
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.seed = 4  # type: ignore[misc]
  assert config.replace(seed=5).seed == 5 and config.seed == 3
  with pytest.raises(ValueError, match="seed must be"):
    config.replace(seed=-5)  # a changed copy is checked as well


def test_the_split_and_the_fallback_follow_the_settings():
  config = TrainerConfig(max_micro_batch_size=8)
  assert [config.halves_for(n) for n in (1, 2, 3, 8)] == ["local", "device", "local", "device"]
  with pytest.raises(ValueError, match="halves='device' compares the even devices"):
    config.replace(halves="device").halves_for(3)
  assert config.uses_compile_fallback
  assert not config.replace(mode="pad").uses_compile_fallback
  assert not config.replace(background_compile=False).uses_compile_fallback


def test_a_misspelt_setting_is_refused_with_the_field_it_resembles():
  with pytest.raises(
    TypeError,
    match=r"TrainerConfig\(\) got unexpected keyword argument\(s\) \['max_micro_batch'\]: "
    r"'max_micro_batch' \(did you mean 'max_micro_batch_size'\?\)",
  ):
    TrainerConfig(max_micro_batch=32)  # type: ignore[call-arg]
  with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['sed'\]"):
    TrainerConfig(max_micro_batch_size=8, sed=3)  # type: ignore[call-arg]
  with pytest.raises(TypeError, match="max_micro_batch_size"):
    TrainerConfig(seed=3)  # type: ignore[call-arg]
  with pytest.raises(TypeError, match=r"'colour'; the settings are the fields of TrainerConfig"):
    TrainerConfig(max_micro_batch_size=8).replace(colour=1)


def test_the_trainer_takes_its_settings_as_a_config(tmp_path):
  settings = dict(
    max_micro_batch_size=4,
    mode="pad",
    seed=3,
    progress=False,
    tensorboard=False,
    background_compile=False,
    halves="local",
    agreement_timeout_seconds=60.0,
  )
  config = TrainerConfig(**settings)
  with simigrad_jax.Trainer(**trainer_objects(tmp_path / "config"), config=config) as by_config:
    assert by_config.config is config and by_config.halves == "local"


def test_a_trainer_without_a_config_or_with_settings_as_keywords_is_refused(tmp_path):
  with pytest.raises(TypeError, match=r"config=simigrad_jax\.TrainerConfig\(max_micro_batch_size="):
    simigrad_jax.Trainer(**trainer_objects(tmp_path / "none"))
  with pytest.raises(ValueError, match=r"config must be a simigrad_jax.TrainerConfig, got \{"):
    simigrad_jax.Trainer(**trainer_objects(tmp_path / "dict"), config={"max_micro_batch_size": 4})
  with pytest.raises(TypeError, match="max_micro_batch"):
    simigrad_jax.Trainer(**trainer_objects(tmp_path / "keywords"), max_micro_batch_size=4)
  assert not any((tmp_path / name).exists() for name in ("none", "dict", "keywords"))


def test_doctests():
  assert doctest.testmod(config_module).failed == 0


def test_tensorboard_defaults_to_when_tensorboardx_is_installed():
  assert simigrad_jax.TrainerConfig(max_micro_batch_size=4).tensorboard is None
  assert simigrad_jax.TrainerConfig(max_micro_batch_size=4, tensorboard=False).tensorboard is False
