"""``python -m train`` on a mesh: ``mesh_shape`` and ``param_sharding``, and the digits demo on 4 x 2."""

import jax
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import simigrad_jax
from train import mesh as mesh_setup
from train import report
from train import train
from train.configs import digits_demo

COLUMN, ROW = P(None, "model"), P("model", None)


def demo_config(**options):
  config = digits_demo.get_config()
  # One compiled shape (pad mode), so that the test compiles little.
  config.update(progress=False, tensorboard=False, plot=False, mode="pad", max_micro_batch_size=16)
  config.compile_fallback = False
  config.update(options)
  return config


def test_the_digits_demo_trains_on_a_4x2_mesh_as_on_4_devices(tmp_path):
  results = {}
  for name, options, devices in (
    ("mesh", dict(mesh_shape="4x2", param_sharding="megatron"), None),
    ("blocks", dict(mesh_shape="4x2", param_sharding="megatron+fsdp"), None),
    ("data_parallel", {}, jax.devices()[:4]),
  ):
    experiment = train.create_experiment(demo_config(**options), devices=devices)
    with simigrad_jax.compile.persistent_cache_settings():
      with train.create_trainer(experiment, tmp_path / name) as trainer:
        trainer.train(num_steps=3)
        params = trainer.state["params"]
        specs = jax.tree.map(lambda x: x.sharding.spec, params)
        results[name] = (jax.device_get(params), specs)
    records = simigrad_jax.read_metrics(tmp_path / name / "metrics.jsonl")
    results[name] += ([(r["batch_size"], r["similarity"]) for r in records if "batch_size" in r],)
  (mesh_params, specs, mesh_records), (dp_params, _, dp_records) = (
    results["mesh"],
    results["data_parallel"],
  )
  assert specs["Dense_0"] == {"kernel": COLUMN, "bias": P("model")}
  assert specs["Dense_1"] == {"kernel": ROW, "bias": P()}
  assert specs["Conv_0"]["kernel"] == P()
  assert len(mesh_records) == 3
  assert [b for b, _ in mesh_records] == [b for b, _ in dp_records]
  np.testing.assert_allclose([s for _, s in mesh_records], [s for _, s in dp_records], atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), mesh_params, dp_params)
  # With the kernels' other dimension in blocks over the data axis too: the same run.
  block_params, block_specs, block_records = results["blocks"]
  assert block_specs["Dense_0"]["kernel"] == P("batch", "model")
  assert block_specs["Dense_1"]["kernel"] == ROW  # 10 columns: no blocks of 4
  assert block_specs["Conv_1"]["kernel"] == P(None, None, "batch", None)
  assert [b for b, _ in block_records] == [b for b, _ in dp_records]
  np.testing.assert_allclose([s for _, s in block_records], [s for _, s in dp_records], atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), block_params, dp_params)


def test_fsdp_presets_put_a_free_dimension_in_blocks_over_the_data_axis():
  params = {
    "Dense_0": {"kernel": np.zeros((4, 8)), "bias": np.zeros(8)},
    "Dense_1": {"kernel": np.zeros((8, 3)), "bias": np.zeros(3)},
    "Conv_0": {"kernel": np.zeros((3, 3, 1, 4))},
  }
  fsdp = mesh_setup.param_sharding(
    ml_collections.ConfigDict({"mesh_shape": "4x2", "param_sharding": "fsdp"}), params
  )
  assert fsdp == {
    "Conv_0": {"kernel": P(None, None, None, "batch")},  # the first dimension 4 divides
    "Dense_0": {"bias": P(), "kernel": P("batch", None)},
    "Dense_1": {"bias": P(), "kernel": P("batch", None)},
  }
  both = mesh_setup.param_sharding(
    ml_collections.ConfigDict({"mesh_shape": "4x2", "param_sharding": "megatron+fsdp"}), params
  )
  assert both["Dense_0"] == {"bias": P("model"), "kernel": P("batch", "model")}
  assert both["Dense_1"] == {"bias": P(), "kernel": ROW}  # 3 columns: no blocks of 4
  assert both["Conv_0"] == {"kernel": P(None, None, None, "batch")}


def test_param_sharding_rules_match_the_path():
  config = ml_collections.ConfigDict(
    {"mesh_shape": "4x2", "param_sharding": "Dense_0/kernel=None,model; bias$=model"}
  )
  params = {
    "Dense_0": {"kernel": np.zeros((4, 8)), "bias": np.zeros(8)},
    "Conv_0": {"kernel": np.zeros((3, 3, 1, 4))},
  }
  assert mesh_setup.param_sharding(config, params) == {
    "Conv_0": {"kernel": P()},
    "Dense_0": {"bias": P("model"), "kernel": COLUMN},
  }


def test_megatron_alternates_in_the_natural_order_of_the_layers():
  config = ml_collections.ConfigDict({"mesh_shape": "4x2", "param_sharding": "megatron"})
  params = {f"Dense_{i}": {"kernel": np.zeros((8, 8)), "bias": np.zeros(8)} for i in (0, 1, 2, 10)}
  specs = mesh_setup.param_sharding(config, params)
  assert [specs[f"Dense_{i}"]["kernel"] for i in (0, 1, 2, 10)] == [COLUMN, ROW, COLUMN, ROW]
  # A head over 65 characters: the model axis (2) does not divide it, so it stays replicated.
  params["head"] = {"kernel": np.zeros((8, 65)), "bias": np.zeros(65)}
  assert mesh_setup.param_sharding(config, params)["head"] == {"bias": P(), "kernel": P()}


@pytest.mark.parametrize(
  "options, message",
  [
    (dict(mesh_shape="4by2"), "mesh_shape='4by2' is not valid; give DATAxMODEL"),
    (dict(mesh_shape="3x2"), "holds 6 devices, but there are 8"),
    (dict(param_sharding="megatron"), "set config.mesh_shape too"),
    (dict(mesh_shape="4x2", param_sharding="kernel"), "rule 'kernel' is not valid"),
    (dict(mesh_shape="4x2", param_sharding="ker(nel=model"), "is not valid"),
  ],
)
def test_bad_mesh_options_name_the_option(options, message):
  config = ml_collections.ConfigDict({"mesh_shape": "", "param_sharding": ""} | options)
  with pytest.raises(ValueError, match=message):
    mesh_setup.training_mesh(config, jax.devices())
    mesh_setup.param_sharding(config, {"kernel": np.zeros((4, 8))})


def test_the_padding_line_says_how_much_the_steps_on_their_own_shape_padded():
  # A loaded 4x2 mesh run: most padding on the steps that ran a larger compiled shape.
  records = [
    {"step": 1, "batch_size": 95, "padded_examples": 1, "compile_fallback": False},
    {"step": 2, "batch_size": 156, "padded_examples": 124, "compile_fallback": True},
    {"step": 3, "batch_size": 99, "padded_examples": 5, "compile_fallback": False},
  ]
  own = report._own_shape_padding(records)
  assert own == {"own_shape_steps": 2, "own_shape_padding_fraction": 6 / 200}
  summary = {"padding_fraction": 130 / 480, "compile_fallback_steps": 1, **own}
  assert report._padding_row(summary) == (
    "27.1% of the rows computed (this run's steps): 3.0% on the 2 steps that ran their own "
    "shape, the rest on the 1 that ran other programs while theirs compiled (the compile "
    "schedule's fallback steps, the same in every run of this config)"
  )
  no_fallback = {**summary, "compile_fallback_steps": 0}
  assert report._padding_row(no_fallback) == "27.1% of the rows computed (this run's steps)"
