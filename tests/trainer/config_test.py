"""TrainerConfig: the Trainer's settings in groups, each checked when made; unknown and moved
names refused with where to look."""

import dataclasses
import doctest

import numpy as np
import pytest

import simigrad_jax
from simigrad_jax.checkpoint.checkpointer import Checkpointer
from simigrad_jax.trainer import config as config_module
from simigrad_jax.trainer.config import CheckpointConfig
from simigrad_jax.trainer.config import CompileConfig
from simigrad_jax.trainer.config import LearningRateConfig
from simigrad_jax.trainer.config import TrainerConfig
from tiny_run import make_trainer
from tiny_run import trainer_objects

# (setting's path, bad value, the message's start): each bad value is named in its error by its
# path in TrainerConfig.
BAD_SETTINGS = [
  ("max_micro_batch_size", 0, r"max_micro_batch_size must be an integer >= 1, got 0"),
  ("max_micro_batch_size", 2.5, r"max_micro_batch_size must be an integer >= 1, got 2.5 \(float\)"),
  (
    "compile.mode",
    "fast",
    r"compile.mode='fast' is not valid; choose one of \('recompile', 'pad'\)",
  ),
  (
    "compile.min_micro_batch_size",
    16,
    r"compile.min_micro_batch_size must be None or an integer in \[1, max_micro_batch_size=8\], "
    r"got 16",
  ),
  (
    "compile.min_micro_batch_size",
    0,
    r"compile.min_micro_batch_size must be None or an integer >= 1 \(and at most "
    r"max_micro_batch_size\), got 0",
  ),
  (
    "compile.shapes_per_octave",
    0,
    r"compile.shapes_per_octave must be an int in \[1, 16\] \(shapes per factor of two in the "
    r"micro-batch grid; 1 halves\), got 0",
  ),
  (
    "compile.shapes_per_octave",
    2.5,
    r"compile.shapes_per_octave must be an int in \[1, 16\].*got 2.5",
  ),
  (
    "compile.shapes_per_step",
    0,
    r"compile.shapes_per_step must be an int in \[1, 4\] \(the micro-steps that may hold the "
    r"rest of a batch; 1 plans a step on one shape\), got 0",
  ),
  (
    "lr.rule",
    "cube",
    r"lr.rule='cube' is not valid; choose one of \('sqrt', 'linear', 'none'\)",
  ),
  ("lr.coupling", "cap", r"lr.coupling='cap' is not valid; choose one of \('full', 'peak'\)"),
  ("lr.adjust_factor", -1.0, r"lr.adjust_factor must be a number in \[0, inf\), got -1.0"),
  ("seed", -1, r"seed must be an integer >= 0, got -1"),
  ("seed", 2**32 + 7, r"seed must be an integer in \[0, 4294967295\], got 4294967303: .* seed 7"),
  ("checkpoints.every_steps", 0, r"checkpoints.every_steps must be an integer >= 1, got 0"),
  (
    "checkpoints.every_seconds",
    0,
    r"checkpoints.every_seconds must be a number in \(0, inf\) \(finite\), got 0",
  ),
  ("checkpoints.max_to_keep", 0, r"checkpoints.max_to_keep must be an integer >= 1, got 0"),
  (
    "checkpoints.allow_changed_settings",
    "yes",
    r"checkpoints.allow_changed_settings must be True or False, got 'yes'",
  ),
  ("compile.whole_rows", 1, r"compile.whole_rows must be True or False, got 1 \(int\)"),
  ("compile.background", 1, r"compile.background must be True or False, got 1 \(int\)"),
  ("compile.threads", 0, r"compile.threads must be an integer >= 1, got 0"),
  ("compile.fallback", "yes", r"compile.fallback must be True or False, got 'yes'"),
  ("compile.timed_fallback", 1, r"compile.timed_fallback must be True or False, got 1"),
  (
    "compile.steps_per_compile",
    0,
    r"compile.steps_per_compile must be .*\(0, inf\) \(finite\), got 0",
  ),
  ("tensorboard", "yes", r"tensorboard must be True or False, got 'yes'"),
  ("progress", 0, r"progress must be True or False, got 0"),
  ("compile.cache_dir", 3, r"compile.cache_dir must be None or a path"),
  ("allow_shared_workdir", "no", r"allow_shared_workdir must be True or False, got 'no'"),
  ("axis_name", "", r"axis_name must be a non-empty string, got ''"),
  (
    "halves",
    "random",
    r"halves='random' is not valid; choose one of \('auto', 'device', 'local'\)",
  ),
  ("measure_every", 0, r"measure_every must be an integer >= 1, got 0"),
  (
    "halves_passes",
    "fast",
    r"halves_passes='fast' is not valid; choose one of \('sequential', 'stacked', 'signed'\)",
  ),
  (
    "agreement_timeout_seconds",
    0,
    r"agreement_timeout_seconds must be a number in \(0, inf\) \(finite\), got 0",
  ),
  ("agreement_timeout_seconds", float("inf"), r"agreement_timeout_seconds must be a number"),
  ("compile", {"mode": "pad"}, r"compile must be a simigrad_jax.CompileConfig, got \{'mode'"),
  ("checkpoints", None, r"checkpoints must be a simigrad_jax.CheckpointConfig, got None"),
  ("lr", "sqrt", r"lr must be a simigrad_jax.LearningRateConfig, got 'sqrt' \(str\)"),
]
GROUPS = {
  "compile": CompileConfig,
  "checkpoints": CheckpointConfig,
  "lr": LearningRateConfig,
}


def config_with(path, value, **settings):
  """A TrainerConfig with the setting at ``path`` (``"compile.mode"`` or ``"seed"``) set."""
  group, _, name = path.rpartition(".")
  if group:
    return TrainerConfig(**settings | {group: GROUPS[group](**{name: value})})
  return TrainerConfig(**settings | {name: value})


@pytest.mark.parametrize(
  "path, value, message", BAD_SETTINGS, ids=[f"{n}={v!r}" for n, v, _ in BAD_SETTINGS]
)
def test_a_bad_value_names_itself(path, value, message):
  with pytest.raises(ValueError, match=f"^{message}"):
    config_with(path, value, max_micro_batch_size=8)


def test_every_setting_is_checked():
  paths = {f.name for f in dataclasses.fields(TrainerConfig)}
  paths |= {
    f"{group}.{f.name}" for group, settings in GROUPS.items() for f in dataclasses.fields(settings)
  }
  assert paths == {path for path, _, _ in BAD_SETTINGS}


def test_the_groups_are_the_fields_of_trainer_config_and_on_the_top_level():
  assert {
    f.name: type(f.default_factory()) for f in dataclasses.fields(TrainerConfig) if f.name in GROUPS
  } == GROUPS
  for settings in (TrainerConfig, *GROUPS.values()):
    assert getattr(simigrad_jax, settings.__name__) is settings
    assert getattr(simigrad_jax.trainer, settings.__name__) is settings


def test_values_are_kept_as_plain_python_and_the_config_is_frozen():
  config = TrainerConfig(
    max_micro_batch_size=np.int64(8),
    seed=np.int32(3),
    agreement_timeout_seconds=None,
    lr=LearningRateConfig(adjust_factor=1),
    checkpoints=CheckpointConfig(every_steps=np.int64(5)),
  )
  assert type(config.max_micro_batch_size) is int and type(config.seed) is int
  assert type(config.checkpoints.every_steps) is int
  assert config.agreement_timeout_seconds == 300.0 and config.lr.adjust_factor == 1.0
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.seed = 4  # type: ignore[misc]
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.compile.mode = "pad"  # type: ignore[misc]
  assert config.replace(seed=5).seed == 5 and config.seed == 3
  with pytest.raises(ValueError, match="seed must be"):
    config.replace(seed=-5)  # a changed copy is checked as well
  with pytest.raises(ValueError, match="compile.mode='fast'"):
    config.replace(compile=config.compile.replace(mode="fast"))


def test_a_nested_setting_is_replaced_through_its_group():
  config = TrainerConfig(max_micro_batch_size=8, compile=CompileConfig(fallback=False))
  padded = config.replace(compile=config.compile.replace(mode="pad"))
  assert padded.compile == CompileConfig(mode="pad", fallback=False)
  assert padded.replace(compile=config.compile) == config and config.compile.mode == "recompile"
  with pytest.raises(ValueError, match=r"compile.min_micro_batch_size .*max_micro_batch_size=8"):
    config.replace(compile=config.compile.replace(min_micro_batch_size=9))


def test_an_unknown_keyword_in_any_group_suggests_the_name_it_resembles():
  with pytest.raises(TypeError, match=r"\['sed'\]: 'sed' \(did you mean 'seed'\?\)"):
    TrainerConfig(max_micro_batch_size=8, sed=3)
  for group, typo, meant in (
    (CompileConfig, "fallbak", "fallback"),
    (CheckpointConfig, "every_step", "every_steps"),
    (LearningRateConfig, "rules", "rule"),
  ):
    with pytest.raises(
      TypeError,
      match=rf"\['{typo}'\]: '{typo}' \(did you mean '{meant}'\?\); the settings are the "
      rf"fields of {group.__name__}: \[",
    ):
      group(**{typo: 1})
    with pytest.raises(TypeError, match=rf"did you mean '{meant}'"):
      group().replace(**{typo: 1})


def test_a_flat_setting_of_0_2_names_its_new_place():
  with pytest.raises(
    TypeError,
    match=r"^TrainerConfig\(lr_rule=\.\.\.\): this setting moved into a group in 0.3; "
    r"give lr=LearningRateConfig\(rule='linear'\)$",
  ):
    TrainerConfig(max_micro_batch_size=8, lr_rule="linear")
  with pytest.raises(
    TypeError,
    match=r"^TrainerConfig\(mode=\.\.\., max_checkpoints=\.\.\., background_compile=\.\.\.\): "
    r"these settings moved into a group in 0.3; give compile=CompileConfig\(mode='pad', "
    r"background=False\), checkpoints=CheckpointConfig\(max_to_keep=1\)$",
  ):
    TrainerConfig(max_micro_batch_size=8, mode="pad", max_checkpoints=1, background_compile=False)
  config = TrainerConfig(max_micro_batch_size=8)
  with pytest.raises(
    TypeError,
    match=r"^config.replace\(compilation_cache_dir=\.\.\.\): this setting moved into a group in "
    r"0.3; give compile=config.compile.replace\(cache_dir='/tmp/cache'\)$",
  ):
    config.replace(compilation_cache_dir="/tmp/cache")
  for name, path in config_module.MOVED_SETTINGS.items():
    group, field = path.split(".")
    assert field in {f.name for f in dataclasses.fields(GROUPS[group])}, name


def test_the_split_and_the_fallback_follow_the_settings():
  config = TrainerConfig(max_micro_batch_size=8)
  assert [config.halves_for(n) for n in (1, 2, 3, 8)] == ["local", "device", "local", "device"]
  with pytest.raises(ValueError, match="halves='device' compares the even devices"):
    config.replace(halves="device").halves_for(3)
  assert config.compile.uses_fallback
  assert not config.compile.replace(mode="pad").uses_fallback
  assert not config.compile.replace(background=False).uses_fallback


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
    seed=3,
    progress=False,
    tensorboard=False,
    halves="local",
    agreement_timeout_seconds=60.0,
    compile=CompileConfig(mode="pad", background=False),
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


def test_the_run_record_names_the_settings_as_0_2_did(tmp_path):
  """A checkpoint records the settings by 0.2's flat names, so that a run checkpointed by 0.2
  compares the same on resume."""
  with make_trainer(
    tmp_path,
    compile=CompileConfig(mode="pad"),
    lr=LearningRateConfig(rule="linear", adjust_factor=0.5, coupling="peak"),
  ) as trainer:
    trainer.train(num_steps=1)  # ends with a checkpoint
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    try:
      record = checkpointer.restore(trainer.state)[1]["run"]
    finally:
      checkpointer.close()
  assert record["trainer"] == {"lr_rule": "linear", "lr_adjust_factor": 0.5, "lr_coupling": "peak"}
  assert {k: record["layout"][k] for k in ("mode", "min_micro_batch_size", "compile_fallback")} == {
    "mode": "pad",
    "min_micro_batch_size": None,
    "compile_fallback": False,
  }


def test_doctests():
  assert doctest.testmod(config_module).failed == 0


def test_tensorboard_defaults_to_when_tensorboardx_is_installed():
  assert simigrad_jax.TrainerConfig(max_micro_batch_size=4).tensorboard is None
  assert simigrad_jax.TrainerConfig(max_micro_batch_size=4, tensorboard=False).tensorboard is False
