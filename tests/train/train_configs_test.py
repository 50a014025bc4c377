"""Every config in train/configs builds and takes two real optimizer steps at a tiny size.

TFDS data sets come from ``tfds.testing.mock_data`` (random records of the
real shapes); the digits and the text configs use their real data. Each run
checks the model's output shapes, a finite loss, and that the controller moved
the batch size after the first step.
"""

import importlib
import math
import pathlib

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

import simigrad_jax
from train import config_checks
from train import train

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted(
  p.stem for p in (ROOT / "train" / "configs").glob("*.py") if p.stem not in ("__init__", "default")
)

# In-process runs: no persistent compilation cache, whose settings are process-wide.
COMMON = dict(
  num_steps=2,
  mode="pad",
  initial_batch_size=16,
  batch_size_lower_bound=8,
  batch_size_upper_bound=32,
  max_micro_batch_size=4,
  eval_examples=12,
  eval_batch_size=8,
  progress=False,
  tensorboard=False,
  plot=False,
  compilation_cache=False,
)
# Per config: the same recipe and building blocks at a size that compiles in seconds on a
# CPU (ResNets keep their block type and stem, with two one-block stages).
# The TFDS image sets decode in one grain worker process (the TFDS MNIST ones in this one).
TINY = {
  "cifar10_resnet18": dict(resnet_filters=4, resnet_stage_sizes=(1, 1), num_workers=1),
  "imagenet_resnet50": dict(
    resnet_filters=2,
    resnet_stage_sizes=(1, 1),
    num_workers=1,
    host_image_size=40,
    image_size=32,
    decode_threads=2,
  ),
  "bert_pretrain": dict(
    bert_layers=1, bert_hidden=16, bert_heads=2, bert_mlp=32, seq_length=32, records_per_example=2
  ),
  "bert_tiny": dict(bert_layers=1, bert_hidden=16, bert_heads=2, bert_mlp=32, seq_length=32),
  # tinyshakespeare from ../shared/data, else TFDS tiny_shakespeare's mock records.
  "shakespeare_lm": dict(bert_layers=1, bert_hidden=16, bert_heads=2, bert_mlp=32, seq_length=8),
  "mnist_mlp": dict(mnist_source="tfds", mlp_hidden=(16,), num_workers=0),
  "mnist_cnn": dict(mnist_source="tfds", cnn_features=(4, 8), cnn_dense=16, num_workers=0),
  "digits_demo": dict(cnn_features=(4, 8), cnn_dense=16),
}


def load_config(name):
  return importlib.import_module(f"train.configs.{name}").get_config()


def tiny_config(name, **extra):
  config = load_config(name)
  config.update(COMMON)
  config.update(TINY.get(name, {}))
  config.update(extra)
  return config


def test_every_config_has_a_tiny_setting_and_documents_its_hardware_and_runtime():
  assert set(CONFIGS) >= {
    "digits_demo",
    "mnist_mlp",
    "mnist_cnn",
    "cifar10_resnet18",
    "imagenet_resnet50",
    "bert_pretrain",
    "bert_tiny",
  }
  assert set(TINY) == set(CONFIGS)
  for name in CONFIGS:
    doc = importlib.import_module(f"train.configs.{name}").__doc__
    assert "Hardware:" in doc and "Runtime:" in doc, name


@pytest.mark.parametrize("name", CONFIGS)
def test_config_takes_two_steps_and_the_batch_size_moves(name, tmp_path, devices):
  config = tiny_config(name)
  with tfds.testing.mock_data(num_examples=128):
    experiment = train.create_experiment(config, devices=devices)
    # Shapes: the model maps one evaluation batch to logits of the expected shape.
    batch = experiment.datasets.train.get_batch(np.arange(3))
    variables = {"params": experiment.params, **(experiment.model_state or {})}
    logits = jax.eval_shape(experiment.predict, variables, batch)
    if config.model == "bert":
      assert batch["tokens"].shape == (3, config.seq_length)
      assert logits.shape == (3, config.seq_length, experiment.datasets.vocab_size)
    elif config.model == "causal_lm":  # reads L tokens, predicts the next L
      assert batch["tokens"].shape == (3, config.seq_length + 1)
      assert logits.shape == (3, config.seq_length, experiment.datasets.vocab_size)
    else:
      image_shape = experiment.datasets.train.element_spec["image"][0]
      assert batch["image"].shape == (3,) + tuple(image_shape)
      assert logits.shape == (3, experiment.datasets.num_classes)
    if config.dataset in ("tfds", "tfds_resized") or config.get("mnist_source") == "tfds":
      assert isinstance(experiment.datasets.train, simigrad_jax.GrainSource)
      assert experiment.datasets.train.num_workers == config.num_workers
    trainer = train.create_trainer(experiment, tmp_path)
    with trainer:
      trainer.train(num_steps=config.num_steps)
    results = experiment.evaluate(experiment.params, experiment.model_state)
  assert 0.0 <= results["accuracy"] <= 1.0 and math.isfinite(results["loss"])
  records = [r for r in simigrad_jax.read_metrics(tmp_path / "metrics.jsonl") if "batch_size" in r]
  assert [r["step"] for r in records] == [1, 2]
  assert all(math.isfinite(r["loss"]) for r in records)
  assert all(r["grads_finite"] and -1 <= r["similarity"] <= 1 for r in records)
  assert records[0]["batch_size"] == 16
  assert records[0]["next_batch_size"] != 16 and records[0]["decision"] in ("grow", "shrink")
  assert records[1]["batch_size"] == records[0]["next_batch_size"]
  new_params = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), trainer.state["params"])
  assert jax.tree.map(np.shape, new_params) == jax.tree.map(np.shape, experiment.params)
  changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), new_params, experiment.params)
  assert any(jax.tree.leaves(changed))  # trained


def test_unknown_controller_and_bad_values_are_refused(devices):
  with pytest.raises(ValueError, match="unknown controller 'simigard'"):
    train.create_experiment(tiny_config("digits_demo", controller="simigard"), devices=devices)
  with pytest.raises(ValueError, match="similarity_target"):
    train.create_experiment(tiny_config("digits_demo", similarity_target=2.0), devices=devices)
  with pytest.raises(ValueError, match="unknown optimizer 'adam'"):
    train.create_experiment(tiny_config("digits_demo", optimizer="adam"), devices=devices)
  with pytest.raises(ValueError, match="config.platform='gpu' is not valid"):
    train.create_experiment(tiny_config("digits_demo", platform="gpu"), devices=None)
  with pytest.raises(
    ValueError,
    match=r"config.halves='device' compares the even devices with "
    r"the odd ones, which needs an even number of devices, got 3",
  ):
    train.create_experiment(tiny_config("digits_demo", halves="device"), devices=devices[:3])
  with pytest.raises(ValueError, match=r"config.halves='sideways' is not valid"):
    train.create_experiment(tiny_config("digits_demo", halves="sideways"), devices=devices)
  # The Trainer's settings are checked before the data loads, named as the config's options.
  with pytest.raises(ValueError, match=r"config.mode='fast' is not valid"):
    train.create_experiment(tiny_config("digits_demo", mode="fast"), devices=devices)
  with pytest.raises(ValueError, match=r"config.max_checkpoints must be an integer >= 1, got 0"):
    train.create_experiment(tiny_config("digits_demo", max_checkpoints=0), devices=devices)
  with pytest.raises(ValueError, match="must be a JSON object"):
    train.create_controller(tiny_config("digits_demo", controller_options="{multiple: 1}"), 8)
  with pytest.raises(ValueError, match="refused its options"):
    train.create_controller(tiny_config("digits_demo", controller_options='{"colour": 1}'), 8)


@pytest.mark.parametrize(
  "controller, given, option",
  [
    ("simigrad", '{"initial_batch_size": 64}', "initial_batch_size"),
    ("gns", '{"batch_size_upper_bound": 512}', "batch_size_upper_bound"),
    ("simigrad", '{"warmup_steps": 3}', "controller_warmup_steps"),
    ("fixed", '{"ema_decay": 0.5}', "similarity_ema_decay"),
  ],
)
def test_controller_options_refuse_what_a_config_option_sets(controller, given, option):
  # The Adam coupling's base and the banner read config.initial_batch_size: a second value in
  # controller_options would train the controller from one size and the optimizer from another.
  config = tiny_config("digits_demo", controller=controller, controller_options=given)
  with pytest.raises(ValueError, match=rf"which config\.{option} sets .*--config\.{option}="):
    train.create_controller(config, 8)
  # An option the config has none of is taken (gns's ema_decay is the controller's own).
  config = tiny_config("digits_demo", controller="gns", controller_options='{"ema_decay": 0.5}')
  assert train.create_controller(config, 8).config["ema_decay"] == 0.5


@pytest.mark.parametrize(
  "seed, message",
  [
    (2**32, "would give the key of seed 0"),
    (10**20, "no seed beyond int64"),
    (-1, r"must be an integer >= 0, got -1"),
  ],
)
def test_a_seed_jax_would_wrap_or_refuse_is_refused(seed, message):
  with pytest.raises(ValueError, match=rf"config\.seed .*{message}"):
    config_checks.check_config(tiny_config("digits_demo", seed=seed))
  config_checks.check_config(tiny_config("digits_demo", seed=2**32 - 1))  # the largest


def test_token_ramps_count_the_data_sets_tokens_unless_told_otherwise():
  thresholds = '{"thresholds": "0:16,2k:32"}'
  config = tiny_config("digits_demo", controller="step_schedule", controller_options=thresholds)
  in_tokens = train.create_controller(config, 8, tokens_per_example=64)
  assert in_tokens.config["tokens_per_example"] == 64
  in_tokens.update(0.5, stats={"examples_seen": 31})  # 1,984 tokens: below 2k
  assert in_tokens.batch_size == 16
  in_tokens.update(0.5, stats={"examples_seen": 32})  # 2,048 tokens
  assert in_tokens.batch_size == 32
  counted = '{"thresholds": "0:16,2k:32", "tokens_per_example": null}'
  config = tiny_config("digits_demo", controller="step_schedule", controller_options=counted)
  assert (
    train.create_controller(config, 8, tokens_per_example=64).config["tokens_per_example"] is None
  )
  # A controller without token counts (SimiGrad) is given none.
  assert (
    "tokens_per_example" not in train.create_controller(tiny_config("digits_demo"), 8, 64).config
  )


def test_similarity_ema_decay_turns_on_the_model_rule():
  assert train.create_controller(tiny_config("digits_demo"), 8).config["ema_decay"] is None
  controller = train.create_controller(tiny_config("digits_demo", similarity_ema_decay=0.9), 8)
  assert controller.config["ema_decay"] == 0.9
  controller.update(0.05)  # feeds the model: a noise scale, and a step towards its target size
  assert controller.noise_scale == pytest.approx(16 * 0.95 / 0.1)
  with pytest.raises(ValueError, match=r"ema_decay must be a number in \[0, 1\), got 1.5"):
    train.create_controller(tiny_config("digits_demo", similarity_ema_decay=1.5), 8)


def test_one_step_late_wraps_the_controller():
  plain = train.create_controller(tiny_config("digits_demo"), 8)
  late = train.create_controller(tiny_config("digits_demo", one_step_late=True), 8)
  assert isinstance(late, simigrad_jax.controllers.OneStepLateController)
  assert not isinstance(plain, simigrad_jax.controllers.OneStepLateController)
  assert late.config == {**plain.config, "one_step_late": True}
  assert [late.update(0.0), late.update(0.0)] == [plain.batch_size, plain.update(0.0)]
  with pytest.raises(ValueError, match=r"similarity profile of \[16, 32\]"):
    train.create_controller(
      tiny_config("digits_demo", one_step_late=True, batch_sizes_to_profile=(16, 32)), 8
    )


@pytest.mark.skipif("gns" not in simigrad_jax.controller_names(), reason="no 'gns' controller")
def test_other_registered_controllers_take_their_options_as_json():
  config = tiny_config("digits_demo", controller="gns", controller_options='{"multiple": 0.5}')
  controller = train.create_controller(config, 8)
  assert controller.config["multiple"] == 0.5
  assert (controller.batch_size, controller.config["batch_size_upper_bound"]) == (16, 32)


@pytest.mark.parametrize("num_devices, halves", [(1, "auto"), (3, "auto"), (8, "local")])
def test_any_device_count_trains_with_the_local_split(num_devices, halves, tmp_path, devices):
  config = tiny_config("digits_demo", halves=halves, batch_size_lower_bound=None)
  experiment = train.create_experiment(config, devices=devices[:num_devices])
  assert experiment.halves == "local"
  # No lower bound given: one example per half of every device.
  assert experiment.controller.config["batch_size_lower_bound"] == 2 * num_devices
  with train.create_trainer(experiment, tmp_path) as trainer:
    trainer.train(num_steps=2)
  records = [r for r in simigrad_jax.read_metrics(tmp_path / "metrics.jsonl") if "batch_size" in r]
  assert trainer.halves == "local" and len(records) == 2
  assert all(math.isfinite(r["loss"]) and -1 <= r["similarity"] <= 1 for r in records)
  assert all(r["micro_batch_size"] % 2 == 0 for r in records)  # two blocks of rows per device


def test_platform_auto_takes_every_device_of_the_default_backend():
  """No parity filter any more: "auto" and "default" take the accelerators, however many (here,
  with none, the 8 simulated CPU devices); "cpu" the CPU's."""
  for platform in ("auto", "default"):
    assert train.training_devices(tiny_config("digits_demo", platform=platform)) == jax.devices()
  assert train.training_devices(tiny_config("digits_demo", platform="cpu")) == jax.devices("cpu")


def test_fixed_controller_keeps_the_batch_size(tmp_path, devices):
  config = tiny_config("digits_demo", controller="fixed")
  experiment = train.create_experiment(config, devices=devices)
  with train.create_trainer(experiment, tmp_path) as trainer:
    trainer.train(num_steps=2)
  records = [r for r in simigrad_jax.read_metrics(tmp_path / "metrics.jsonl") if "batch_size" in r]
  assert [r["batch_size"] for r in records] == [16, 16]
  assert all(r["similarity"] is not None for r in records)  # still measured and logged


def test_the_compilation_cache_is_the_users_shared_one_unless_the_config_says_otherwise(
  tmp_path, monkeypatch
):
  config = load_config("digits_demo")
  monkeypatch.delenv("SIMIGRAD_JAX_CACHE_DIR")  # (the suite's: none)
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  shared = tmp_path / "xdg" / "simigrad_jax" / "compilation_cache"
  assert train.compilation_cache_dir(config) == shared  # whatever the workdir
  monkeypatch.setenv("SIMIGRAD_JAX_CACHE_DIR", str(tmp_path / "moved"))
  assert train.compilation_cache_dir(config) == tmp_path / "moved"
  monkeypatch.setenv("SIMIGRAD_JAX_CACHE_DIR", "")
  assert train.compilation_cache_dir(config) is None
  config.compilation_cache_dir = str(tmp_path / "shared")
  assert train.compilation_cache_dir(config) == tmp_path / "shared"
  config.compilation_cache_dir = "~/jax_cache"
  assert train.compilation_cache_dir(config) == pathlib.Path.home() / "jax_cache"
  config.compilation_cache = False
  assert train.compilation_cache_dir(config) is None
  config.compilation_cache, config.compilation_cache_dir = True, ""
  assert train.compilation_cache_dir(config) is None


def test_every_option_of_the_default_config_is_in_the_docs_table():
  import re  # pylint: disable=import-outside-toplevel

  page = (ROOT / "docs" / "training_scripts.md").read_text()
  table = page[page.index("## Every config option") : page.index("## Files a run leaves")]
  documented = set(re.findall(r"`(\w+)`", table))
  assert not set(load_config("default").keys()) - documented


def test_a_resume_with_another_learning_rate_is_refused_unless_the_config_allows_it(
  tmp_path, devices
):
  """The options that decide a run are recorded in its checkpoints (train/run_settings.py);
  how long it runs and what it shows are not."""
  with train.create_trainer(
    train.create_experiment(tiny_config("digits_demo"), devices=devices), tmp_path
  ) as trainer:
    trainer.train(num_steps=2)
  changed = tiny_config("digits_demo", learning_rate=0.2, num_steps=3, verbose=True)
  with pytest.raises(
    simigrad_jax.checkpoint.CheckpointMismatchError,
    match=r"\n  - settings.learning_rate: 0.1 there, 0.2 here\n",
  ):
    train.create_trainer(train.create_experiment(changed, devices=devices), tmp_path)
  changed.allow_changed_settings = True
  with train.create_trainer(train.create_experiment(changed, devices=devices), tmp_path) as trainer:
    assert trainer.step == 2
    trainer.train(num_steps=3)
  records = [r for r in simigrad_jax.read_metrics(tmp_path / "metrics.jsonl") if "batch_size" in r]
  assert [r["step"] for r in records] == [1, 2, 3]


def test_how_often_and_where_a_run_saves_does_not_decide_the_run():
  """A resume may change the checkpoint interval or the shared-workdir check: not recorded as settings."""
  from train import run_settings  # pylint: disable=import-outside-toplevel
  from train.configs import default  # pylint: disable=import-outside-toplevel

  settings = run_settings.run_settings(default.get_config())
  for name in (
    "checkpoint_every_seconds",
    "checkpoint_every_steps",
    "allow_shared_workdir",
    "allow_changed_settings",
  ):
    assert name not in settings
  assert "learning_rate" in settings
