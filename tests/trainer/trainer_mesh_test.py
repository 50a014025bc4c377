"""The Trainer on a 2-D mesh: tensor-parallel parameters give the data-parallel trajectory, and resume.

A tensor-parallel MLP (column- then row-parallel kernels over ``model``) on
a 4 x 2 mesh must train exactly as the same run data-parallel on 4 devices
with replicated parameters: same batch sizes, similarities and parameters;
so must a kernel stored sharded over the data axis too (FSDP) with
micro-batches, a 3 x 2 mesh (local halves) against 3 devices, a run
stopped data-parallel and resumed on the mesh, a run SIGKILLed and resumed
on the mesh, and two processes on a 4 x 2 mesh against one on 4 devices.
"""

import doctest

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from trainer_processes_test import run_driver
from trainer_processes_test import run_two_processes
from trainer_processes_test import step_records

import simigrad_jax
from simigrad_jax.shapes import mesh_sharding
from simigrad_jax.trainer import hooks
from tiny_run import trainer_with
from train import mesh as train_mesh

NUM_STEPS = 6
HALVINGS = simigrad_jax.CompileConfig(shapes_per_octave=1)  # the halving grid: few shapes
RESUME_AT = 3
TP_SPECS = {
  "Dense_0": {"kernel": P(None, "model"), "bias": P("model")},
  "Dense_1": {"kernel": P("model", None), "bias": None},
}
# Dense_1's kernel (16 x 3) stored sharded over both axes (8 rows of 2); Dense_0 by a prefix.
FSDP_SPECS = {"Dense_0": P(), "Dense_1": {"kernel": P(("model", "batch"), None), "bias": None}}
# Kernels in blocks over the data axis alone (Dense_0's columns, Dense_1's rows): kept in blocks
# through the step, the optimizer's state too; Dense_0's bias tensor parallel.
BLOCK_SPECS = {
  "Dense_0": {"kernel": P(None, "batch"), "bias": P("model")},
  "Dense_1": {"kernel": P("batch", None), "bias": None},
}


class WideMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    hidden = nn.tanh(nn.Dense(16, name="Dense_0")(x))
    return nn.Dense(3, name="Dense_1")(hidden)


def mlp_loss(params, model_state, batch, weights, rng):
  del weights, rng
  logits = WideMLP().apply({"params": params}, batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), model_state


def mesh_of(data, model=2):
  return Mesh(np.array(jax.devices()[: data * model]).reshape(data, model), ("batch", "model"))


def make_trainer(workdir, *, optimizer=None, nan_at=None, **kwargs):
  rng = np.random.default_rng(0)
  data = {
    "x": rng.normal(size=(120, 5)).astype(np.float32),
    "y": rng.integers(0, 3, size=120).astype(np.int32),
  }
  if nan_at is not None:
    data["x"][nan_at] = np.nan
  if optimizer is None:
    optimizer = optax.chain(
      simigrad_jax.transform("batch"),
      optax.sgd(0.1, momentum=0.9),
      simigrad_jax.scale_by_lr_factor(),
    )
  settings = dict(max_micro_batch_size=8, seed=3, progress=False, compile=HALVINGS)
  settings = settings | dict(tensorboard=False) | kwargs
  return trainer_with(
    loss_fn=mlp_loss,
    params=WideMLP().init(jax.random.key(0), data["x"][:1])["params"],
    optimizer=optimizer,
    source=simigrad_jax.ArraySource(data),
    controller=simigrad_jax.Controller(
      16, 0.5, batch_size_lower_bound=8, batch_size_upper_bound=64
    ),
    workdir=workdir,
    **settings,
  )


def train(workdir, num_steps, **kwargs):
  """Trains ``num_steps`` (resuming from ``workdir``); returns the params, their shardings and records."""
  with make_trainer(workdir, **kwargs) as trainer:
    trainer.train(num_steps=num_steps)
    params = trainer.state["params"]
    shardings = jax.tree.map(lambda x: x.sharding.spec, params)
    params, halves = jax.device_get(params), trainer.halves
  records = simigrad_jax.read_metrics(workdir / "metrics.jsonl")
  return params, shardings, [r for r in records if "batch_size" in r], halves


def trajectory(records):
  return [(r["step"], r["batch_size"], r["similarity"], r["loss"]) for r in records]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("mesh")
  # The mesh runs share their compiled programs through the persistent cache.
  on_mesh = dict(mesh=mesh_of(4), compile=HALVINGS.replace(cache_dir=root / "cache"))
  with simigrad_jax.compile.persistent_cache_settings():
    return {
      "dp": train(root / "dp", NUM_STEPS, devices=jax.devices()[:4]),
      "tp": train(root / "tp", NUM_STEPS, param_sharding=TP_SPECS, **on_mesh),
      "fsdp": train(
        root / "fsdp", NUM_STEPS, param_sharding=FSDP_SPECS, max_micro_batch_size=2, **on_mesh
      ),
      # One micro-batch a step (the fused step), and several (micro-steps, then the update).
      "blocks_fused": train(
        root / "blocks_fused",
        NUM_STEPS,
        param_sharding=BLOCK_SPECS,
        max_micro_batch_size=16,
        **on_mesh,
      ),
      "blocks_micro": train(
        root / "blocks_micro",
        NUM_STEPS,
        param_sharding=BLOCK_SPECS,
        max_micro_batch_size=2,
        **on_mesh,
      ),
      # Stopped data-parallel, resumed on the mesh.
      "moved_stopped": train(root / "moved", RESUME_AT, devices=jax.devices()[:4]),
      "moved": train(root / "moved", NUM_STEPS, param_sharding=TP_SPECS, **on_mesh),
    }


def assert_same_run(a, b, atol=1e-5):
  (params_a, _, records_a, _), (params_b, _, records_b, _) = a, b
  assert [r[:2] for r in trajectory(records_a)] == [r[:2] for r in trajectory(records_b)]
  np.testing.assert_allclose(
    [r[2:] for r in trajectory(records_a)], [r[2:] for r in trajectory(records_b)], atol=atol
  )
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=atol), params_a, params_b)


def test_tensor_parallel_trains_as_data_parallel(runs):
  assert len(runs["tp"][2]) == NUM_STEPS
  assert len({r["batch_size"] for r in runs["tp"][2]}) > 1  # the batch size moved
  assert_same_run(runs["dp"], runs["tp"])


def test_parameters_keep_their_shardings(runs):
  for name in ("tp", "moved"):
    specs = runs[name][1]
    assert specs["Dense_0"]["kernel"] == P(None, "model")
    assert specs["Dense_0"]["bias"] == P("model")
    assert specs["Dense_1"]["kernel"] == P("model", None)
    assert specs["Dense_1"]["bias"] == P()


def test_a_data_parallel_run_resumes_on_the_mesh(runs):
  assert len(runs["moved_stopped"][2]) == RESUME_AT
  assert runs["moved"][1]["Dense_0"]["kernel"] == P(None, "model")
  assert_same_run(runs["dp"], runs["moved"])


def test_fsdp_with_micro_batches_trains_as_data_parallel(runs):
  _, specs, records, _ = runs["fsdp"]
  assert specs["Dense_1"]["kernel"] == P(("model", "batch"), None)
  assert max(r["accumulation_steps"] for r in records) > 1
  assert_same_run(runs["dp"], runs["fsdp"])


def test_fsdp_blocks_train_as_data_parallel_and_stay_blocks(runs):
  steps = set()
  for name in ("blocks_fused", "blocks_micro"):
    _, specs, records, _ = runs[name]
    assert specs == BLOCK_SPECS | {"Dense_1": {"kernel": P("batch", None), "bias": P()}}
    steps |= {r["accumulation_steps"] for r in records}
    assert_same_run(runs["dp"], runs[name])
  # Both programs ran: the fused step, and micro-steps with the update after them.
  assert 1 in steps and max(steps) > 1


def test_fsdp_blocks_keep_the_optimizer_state_in_blocks(tmp_path):
  with make_trainer(tmp_path, mesh=mesh_of(4), param_sharding=BLOCK_SPECS) as trainer:
    trainer.train(num_steps=2)
    params = trainer.state["params"]
    momentum = optax.tree_utils.tree_get(trainer.state["opt_state"], "trace")
    for layer in ("Dense_0", "Dense_1"):
      kernel = momentum[layer]["kernel"]
      assert kernel.sharding.spec == params[layer]["kernel"].sharding.spec
      # A quarter of the kernel per device: its block over the 4 data positions.
      assert kernel.addressable_shards[0].data.size * 4 == kernel.size


@pytest.mark.parametrize("max_micro_batch_size", [16, 2], ids=["fused", "accumulated"])
def test_a_nonfinite_step_in_blocks_keeps_the_state(tmp_path, max_micro_batch_size):
  """The update on blocks (outside the gradient's shard_map) skips a NaN step as the others do."""
  with make_trainer(
    tmp_path,
    mesh=mesh_of(4),
    param_sharding=BLOCK_SPECS,
    nan_at=50,
    max_micro_batch_size=max_micro_batch_size,
  ) as trainer:
    trainer.train(num_epochs=1)
    state = trainer.state
    floating = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert all(np.all(np.isfinite(np.asarray(jax.device_get(x)))) for x in floating)
  records = [r for r in simigrad_jax.read_metrics(tmp_path / "metrics.jsonl") if "batch_size" in r]
  bad = [r for r in records if not r["grads_finite"]]
  assert len(bad) == 1 and bad[0]["decision"] == "nonfinite"
  assert records[-1]["nonfinite_steps"] == 1


def test_local_halves_on_an_odd_data_axis(tmp_path):
  padded = HALVINGS.replace(mode="pad")
  data_parallel = train(tmp_path / "dp", 3, devices=jax.devices()[:3], compile=padded)
  on_mesh = train(tmp_path / "tp", 3, mesh=mesh_of(3), param_sharding=TP_SPECS, compile=padded)
  assert on_mesh[3] == data_parallel[3] == "local"
  assert_same_run(data_parallel, on_mesh)


@pytest.mark.parametrize(
  "settings, message",
  [
    (
      dict(mesh=Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))),
      "lack the data axis 'batch'",
    ),
    (dict(mesh=mesh_of(4), devices=jax.devices()[:8]), "either mesh or devices"),
    (dict(mesh="4x2"), "must be a jax.sharding.Mesh"),
    (dict(mesh=jax.make_mesh((4, 2), ("batch", "model"))), "not Auto axes"),
    (
      dict(
        mesh=mesh_of(4),
        param_sharding={"Dense_0": {"kernel": P(None, "tensor"), "bias": None}, "Dense_1": None},
      ),
      "axis 'tensor' is not one of",
    ),
    (
      dict(mesh=mesh_of(4), param_sharding={"Dense_0": None, "Dense_1": P("model")}),
      r"\['Dense_1'\]\['bias'\] of shape \(3,\).*not divisible by the 2 devices",
    ),
    (dict(mesh=mesh_of(4), param_sharding={"Dense_0": None}), "does not match params"),
    (dict(mesh=mesh_of(4), param_sharding=P(None, None, "model")), "at most 1"),
    (
      dict(mesh=mesh_of(4), param_sharding=lambda path, leaf: "model"),
      "give a jax.sharding.PartitionSpec",
    ),
  ],
  ids=[
    "no-data-axis",
    "devices-and-mesh",
    "not-a-mesh",
    "explicit-axes",
    "unknown-axis",
    "indivisible",
    "tree-mismatch",
    "spec-too-long",
    "not-a-spec",
  ],
)
def test_bad_mesh_input_is_refused_before_any_step(tmp_path, settings, message):
  with pytest.raises(ValueError, match=message):
    make_trainer(tmp_path, **settings)
  assert not (tmp_path / "checkpoints").exists()


def test_param_sharding_as_a_rule_of_the_path():
  rule = lambda path, leaf: (
    P(None, "model")
    if jax.tree_util.keystr(path).endswith("['kernel']") and leaf.shape[1] % 2 == 0
    else None
  )
  params = WideMLP().init(jax.random.key(0), np.zeros((1, 5), np.float32))["params"]
  specs = mesh_sharding.param_specs(rule, params, mesh_of(4))
  assert specs == {
    "Dense_0": {"bias": P(), "kernel": P(None, "model")},
    "Dense_1": {"bias": P(), "kernel": P()},
  }


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory):
  """The driver's run data-parallel on 4 devices, one process."""
  workdir = tmp_path_factory.mktemp("single")
  result = run_driver(workdir, "--steps", "6", "--devices", "4")
  assert result.returncode == 0, result.stderr[-3000:]
  return step_records(workdir)


def assert_same_records(records, expected):
  assert [r["step"] for r in records] == list(range(1, 7))
  assert [r["batch_size"] for r in records] == [r["batch_size"] for r in expected]
  for key in ("loss", "similarity"):
    np.testing.assert_allclose([r[key] for r in records], [r[key] for r in expected], atol=1e-5)


def test_two_processes_on_a_4x2_mesh_train_as_one_on_4_devices(single_process_run, tmp_path):
  """Two processes of 4 devices, each holding 2 positions of the data axis, tensor-parallel."""
  run_two_processes(tmp_path, "--steps", "6", "--mesh-model", "2")
  assert_same_records(step_records(tmp_path), single_process_run)


def test_two_processes_with_fsdp_blocks_train_as_one_on_4_devices(single_process_run, tmp_path):
  """As above, with every kernel also in blocks over the data axis, which spans both processes."""
  run_two_processes(tmp_path, "--steps", "6", "--mesh-model", "2", "--fsdp")
  assert_same_records(step_records(tmp_path), single_process_run)


def test_sigkill_and_resume_on_a_4x2_mesh(single_process_run, tmp_path):
  """Killed after step 4 (its checkpoint is step 3's), resumed: no step lost or repeated."""
  killed = run_driver(tmp_path, "--steps", "6", "--mesh-model", "2", "--kill-at", "4")
  assert killed.returncode == -9
  resumed = run_driver(tmp_path, "--steps", "6", "--mesh-model", "2")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert_same_records(step_records(tmp_path), single_process_run)


def test_evaluation_gets_sharded_parameters_whole():
  whole = np.arange(16.0).reshape(2, 8)
  sharded = jax.device_put(whole, NamedSharding(mesh_of(4), P(None, "model")))
  copy = hooks.host_copy({"kernel": sharded, "scale": jax.device_put(np.float32(2.0))})
  np.testing.assert_array_equal(copy["kernel"], whole)
  assert copy["scale"] == 2.0


@pytest.mark.parametrize(
  "optimizer",
  [
    optax.chain(
      simigrad_jax.transform("batch"), optax.adam(1e-3), simigrad_jax.scale_by_lr_factor()
    ),
    # optax.tree_map_params cannot map a masked state: the leaves shaped like one parameter.
    optax.masked(optax.adam(1e-3), {"kernel": True, "bias": False}),
  ],
  ids=["chain", "masked"],
)
def test_the_optimizer_state_follows_the_parameters_specs(optimizer):
  mesh = mesh_of(4)
  params = {"kernel": np.zeros((4, 8), np.float32), "bias": np.zeros(8, np.float32)}
  specs = mesh_sharding.param_specs({"kernel": P(None, "model"), "bias": None}, params, mesh)
  state = {"params": params, "opt_state": optimizer.init(params), "model_state": None}
  shardings = mesh_sharding.state_shardings(optimizer, state, specs, mesh)
  mu = optax.tree_utils.tree_get(shardings["opt_state"], "mu")
  assert mu["kernel"].spec == P(None, "model")
  assert {s.spec for s in jax.tree.leaves(shardings["opt_state"])} == {P(), P(None, "model")}


def test_the_examples_in_the_docstrings_run():
  assert doctest.testmod(mesh_sharding).failed == 0
  assert doctest.testmod(train_mesh).failed == 0
