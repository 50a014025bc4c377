"""simigrad_jax.transform handed the devices' gradients stacked, said in the call
(``stacked_grads=StackedGrads(axis_name, mesh)``, ``param_specs=``): a user's own step gives
the Trainer's result and the float64 NumPy mean and similarity, FSDP blocks kept, on a 4 x 2
mesh with Auto and Explicit axes; the argument misused fails with our own error; and the
update depends on its arguments and state alone (the trace-time context only refuses)."""

import contextlib
import pathlib
import re

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import simigrad_jax
from benchmarks.step_cost import hlo_collectives
from simigrad_jax.ingraph import train_step
from simigrad_jax.ingraph import transform as transform_module
from simigrad_jax.ingraph.transform import StackedGrads
from simigrad_jax.reductions import data_blocks

AXIS = "data"
DATA, MODEL = 4, 2
LEARNING_RATE = 0.5
# Each leaf's shape and its parameter's spec on the 4 x 2 ("data", "model") mesh.
LEAVES = {
  "rows_in_blocks": ((8, 6), P("data", None)),  # FSDP: 2 rows a data position
  "columns_in_blocks_tp": ((6, 8), P("model", "data")),  # FSDP columns, tensor-parallel rows
  "tensor_parallel": ((5, 4), P(None, "model")),
  "rows_over_both": ((8, 3), P(("model", "data"), None)),  # not in blocks: gathered for the step
  "bias": ((3,), P()),
}
SPECS = {name: spec for name, (_, spec) in LEAVES.items()}
# The device halves: the even data positions against the odd ones.
EVEN, ODD = slice(0, None, 2), slice(1, None, 2)


def _mesh(axes):
  kind = AxisType.Explicit if axes == "explicit" else AxisType.Auto
  return jax.make_mesh(
    (DATA, MODEL), (AXIS, "model"), axis_types=(kind, kind), devices=jax.devices()[: DATA * MODEL]
  )


def _host_values(seed=0):
  """Parameters, and each data position's gradient stacked (a shared signal plus noise)."""
  rng = np.random.default_rng(seed)
  params = {n: rng.normal(size=shape).astype(np.float32) for n, (shape, _) in LEAVES.items()}
  stacked = {
    n: (rng.normal(size=shape) + 0.8 * rng.normal(size=(DATA,) + shape)).astype(np.float32)
    for n, (shape, _) in LEAVES.items()
  }
  return params, stacked


def _placed(mesh, params, stacked):
  """The parameters in their specs, the stacked gradient over the data axis (model axes kept)."""
  placed_params = {n: jax.device_put(v, NamedSharding(mesh, SPECS[n])) for n, v in params.items()}
  placed_stacked = {
    n: jax.device_put(v, NamedSharding(mesh, P(AXIS, *data_blocks.without_axis(SPECS[n], AXIS))))
    for n, v in stacked.items()
  }
  return placed_params, placed_stacked


def _reference(params, stacked):
  """float64: the new parameters after SGD on the devices' mean, ``cos(g_A, g_B)``, the norms."""
  as64 = {n: np.asarray(v, np.float64) for n, v in stacked.items()}
  flat = lambda rows: np.concatenate([v[rows].mean(0).ravel() for v in as64.values()])
  g_a, g_b = flat(EVEN), flat(ODD)
  new_params = {n: params[n] - LEARNING_RATE * as64[n].mean(0) for n in params}
  cos = g_a @ g_b / (np.linalg.norm(g_a) * np.linalg.norm(g_b))
  return new_params, cos, np.linalg.norm(g_a), np.linalg.norm(g_b)


def _optimizer():
  return optax.chain(
    simigrad_jax.transform(AXIS), optax.sgd(LEARNING_RATE), simigrad_jax.scale_by_lr_factor()
  )


def _users_step(optimizer, stacked_grads, param_specs):
  """A user's own step: the optimizer on global arrays, told the gradient is stacked."""

  def step(params, opt_state, stacked):
    updates, opt_state = optimizer.update(
      stacked, opt_state, params, stacked_grads=stacked_grads, param_specs=param_specs
    )
    return optax.apply_updates(params, updates), opt_state, updates

  return jax.jit(step)


def _similarity_state(opt_state):
  return optax.tree_utils.tree_get(opt_state, "SimilarityState")


def _assert_matches_reference(new_params, state, reference):
  ref_params, ref_cos, ref_norm_a, ref_norm_b = reference
  for name, want in ref_params.items():
    np.testing.assert_allclose(np.asarray(new_params[name], np.float64), want, atol=2e-6)
  assert 0.05 < ref_cos < 0.95  # the halves differ, and are not unrelated
  np.testing.assert_allclose(float(state.similarity), ref_cos, atol=2e-6)
  np.testing.assert_allclose(float(state.norm_a), ref_norm_a, rtol=2e-6)
  np.testing.assert_allclose(float(state.norm_b), ref_norm_b, rtol=2e-6)
  assert bool(state.measured) and bool(state.grads_finite)


def test_a_users_step_gives_the_trainers_result_and_the_float64_one(devices):
  """Auto axes: the mesh and the parameters' specs in the call, as the Trainer passes them."""
  del devices
  mesh = _mesh("auto")
  host_params, host_stacked = _host_values()
  params, stacked = _placed(mesh, host_params, host_stacked)
  optimizer = _optimizer()
  step = _users_step(optimizer, StackedGrads(AXIS, mesh), SPECS)
  new_params, opt_state, updates = step(params, optimizer.init(params), stacked)
  state = _similarity_state(opt_state)
  _assert_matches_reference(new_params, state, _reference(host_params, host_stacked))
  # The mean comes back laid out as the parameters are: FSDP blocks stay blocks.
  for name, update in updates.items():
    assert update.sharding.is_equivalent_to(params[name].sharding, update.ndim), name

  # The Trainer's update from an accumulator of the same stacked gradients (its FSDP path).
  apply_step = jax.jit(train_step.make_apply_step(optimizer, mesh, AXIS, "device", SPECS))
  acc = train_step.Accumulator(
    grads=stacked, loss=jax.device_put(np.zeros(DATA, np.float32), NamedSharding(mesh, P(AXIS)))
  )
  scalars = train_step.StepScalars(
    total_weight=np.float32(DATA), lr_factor=np.float32(1.0), first_half_weight=np.float32(0.0)
  )  # (the first half's weight is read with halves="local" only)
  trainer_params, trainer_state, _, _, measurements = apply_step(
    params, optimizer.init(params), acc, {}, {}, scalars
  )
  for name, value in trainer_params.items():
    np.testing.assert_allclose(np.asarray(value), np.asarray(new_params[name]), atol=1e-7)
  trainer_similarity = _similarity_state(trainer_state)
  for field in ("similarity", "norm_a", "norm_b", "norm_mean"):
    assert float(getattr(trainer_similarity, field)) == pytest.approx(
      float(getattr(state, field)), abs=1e-7
    ), field
  assert float(measurements.similarity_state.similarity) == pytest.approx(
    float(state.similarity), abs=1e-7
  )


def test_under_explicit_axes_the_mesh_set_for_the_step_is_enough(devices):
  del devices
  mesh = _mesh("explicit")
  host_params, host_stacked = _host_values(seed=1)
  params, stacked = _placed(mesh, host_params, host_stacked)
  optimizer = _optimizer()
  step = _users_step(optimizer, StackedGrads(AXIS), SPECS)
  with jax.set_mesh(mesh):
    new_params, opt_state, updates = step(params, optimizer.init(params), stacked)
  _assert_matches_reference(
    new_params, _similarity_state(opt_state), _reference(host_params, host_stacked)
  )
  for name, update in updates.items():
    assert update.sharding.is_equivalent_to(params[name].sharding, update.ndim), name


def test_without_param_specs_the_numbers_are_the_same(devices):
  """The specs say where the mean lies (FSDP blocks) and which shards each device sums; the
  numbers are the same up to float32 rounding of the statistics' sums."""
  del devices
  mesh = _mesh("auto")
  host_params, host_stacked = _host_values(seed=2)
  params, stacked = _placed(mesh, host_params, host_stacked)
  optimizer = _optimizer()
  with_specs = _users_step(optimizer, StackedGrads(AXIS, mesh), SPECS)
  without = _users_step(optimizer, StackedGrads(AXIS, mesh), None)
  a_params, a_state, _ = with_specs(params, optimizer.init(params), stacked)
  b_params, b_state, _ = without(params, optimizer.init(params), stacked)
  for name in LEAVES:
    np.testing.assert_allclose(np.asarray(a_params[name]), np.asarray(b_params[name]), atol=1e-7)
  assert float(_similarity_state(a_state).similarity) == pytest.approx(
    float(_similarity_state(b_state).similarity), abs=1e-6
  )


def test_in_the_mapped_step_param_specs_keep_a_tensor_parallel_gradient_in_its_shards(devices):
  """The Trainer's step mapped over the data axis (the model axis left to XLA, Auto axes):
  given the specs in the call, each device reduces its own shard of the kernel; without them
  the kernel is gathered whole over the model axis. The numbers are the same."""
  del devices
  mesh = _mesh("auto")
  rng = np.random.default_rng(5)
  host = {
    "kernel": rng.normal(size=(DATA, 64, 64)).astype(np.float32),
    "bias": rng.normal(size=(DATA, 64)).astype(np.float32),
  }
  specs = {"kernel": P(None, "model"), "bias": P("model")}
  stacked = {
    name: jax.device_put(value, NamedSharding(mesh, P(AXIS, *specs[name])))
    for name, value in host.items()
  }
  tx = simigrad_jax.transform(AXIS)

  def step(param_specs):
    def per_device(local):
      grads = jax.tree.map(lambda g: g[0], local)
      mean, state = tx.update(grads, tx.init(grads), param_specs=param_specs)
      return mean, state.similarity

    return jax.jit(
      jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=P(AXIS),
        out_specs=(P(), P()),
        axis_names={AXIS},
        check_vma=False,
      )
    )

  largest, results = {}, {}
  for name, param_specs in (("given", specs), ("not given", None)):
    compiled = step(param_specs).lower(stacked).compile()
    found = hlo_collectives.parse_collectives(compiled.as_text(), jax.device_count())
    largest[name] = max(c.payload_bytes for c in found)
    results[name] = compiled(stacked)
  kernel_bytes = 64 * 64 * 4
  assert largest["given"] < kernel_bytes <= largest["not given"], largest
  (mean, similarity), (whole_mean, whole_similarity) = results["given"], results["not given"]
  as64 = {name: value.astype(np.float64) for name, value in host.items()}
  for name in host:
    np.testing.assert_allclose(np.asarray(mean[name]), as64[name].mean(0), atol=2e-6)
    np.testing.assert_allclose(np.asarray(mean[name]), np.asarray(whole_mean[name]), atol=1e-7)
  flat = lambda rows: np.concatenate([v[rows].mean(0).ravel() for v in as64.values()])
  g_a, g_b = flat(EVEN), flat(ODD)
  cos = g_a @ g_b / (np.linalg.norm(g_a) * np.linalg.norm(g_b))
  np.testing.assert_allclose(float(similarity), cos, atol=2e-6)
  np.testing.assert_allclose(float(similarity), float(whole_similarity), atol=1e-6)


def _update(tx, stacked, **kwargs):
  return tx.update(stacked, tx.init(stacked), **kwargs)


def test_the_argument_misused_fails_with_our_own_error(devices):
  del devices
  mesh = _mesh("auto")
  host_params, host_stacked = _host_values()
  params, stacked = _placed(mesh, host_params, host_stacked)
  tx = simigrad_jax.transform(AXIS)
  run = lambda fn, *args: jax.jit(fn)(*args)

  # Inside the step mapped over the axis each device holds its own gradient: nothing stacked.
  def inside(stacked):
    def per_device(local):
      _update(tx, local, stacked_grads=StackedGrads(AXIS))
      return local

    return jax.shard_map(
      per_device, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), axis_names={AXIS}
    )(stacked)

  with pytest.raises(ValueError, match="inside a step mapped over the axis 'data'"):
    run(inside, stacked)
  # A transform named for another axis, or for none.
  for name in ("batch", None):
    named = simigrad_jax.transform(name)
    with pytest.raises(simigrad_jax.ingraph.AxisNameError, match="axis_name='data'") as raised:
      run(lambda s, tx=named: _update(tx, s, stacked_grads=StackedGrads(AXIS, mesh)), stacked)
    assert raised.value.axis_name == name and raised.value.step_axis == AXIS
  # No mesh to find the axis on, or a mesh without it.
  with pytest.raises(ValueError, match="found no mesh"):
    run(lambda s: _update(tx, s, stacked_grads=StackedGrads(AXIS)), stacked)
  other = jax.make_mesh((8,), ("batch",), axis_types=(AxisType.Auto,))
  with pytest.raises(ValueError, match=r"found a mesh with the axes \('batch',\)"):
    run(lambda s: _update(tx, s, stacked_grads=StackedGrads(AXIS, other)), stacked)
  # A gradient that is not stacked: the parameters' shapes.
  with pytest.raises(ValueError, match=r"leading dimension of the axis's size 4; the gradient"):
    run(lambda p: _update(tx, p, stacked_grads=StackedGrads(AXIS, mesh)), params)
  # Specs of another structure than the gradient's.
  wrong_specs = {name: SPECS[name] for name in list(SPECS)[:-1]}
  with pytest.raises(ValueError, match="param_specs must be a PartitionSpec for each leaf"):
    run(
      lambda s: _update(tx, s, stacked_grads=StackedGrads(AXIS, mesh), param_specs=wrong_specs),
      stacked,
    )
  # Not a StackedGrads; and half gradients as well.
  with pytest.raises(ValueError, match="stacked_grads must be a .*StackedGrads"):
    run(lambda s: _update(tx, s, stacked_grads=AXIS), stacked)
  halves = simigrad_jax.HalfGrads(stacked, stacked)
  with pytest.raises(ValueError, match="leave half_grads out there"):
    run(
      lambda s: _update(tx, s, stacked_grads=StackedGrads(AXIS, mesh), half_grads=halves), stacked
    )


def test_an_optimizer_that_drops_the_argument_is_refused_naming_it(devices):
  del devices
  mesh = _mesh("auto")
  params, stacked = _placed(mesh, *_host_values())
  inner = _optimizer()
  dropping = optax.GradientTransformationExtraArgs(
    inner.init, lambda u, s, p=None, **extra: inner.update(u, s, p)
  )
  step = _users_step(dropping, StackedGrads(AXIS, mesh), SPECS)
  with pytest.raises(ValueError, match=r"pass stacked_grads=StackedGrads\('data'\) to its update"):
    step(params, dropping.init(params), stacked)
  # The Trainer's FSDP update refuses an optimizer that never reached the transform.
  plain = optax.chain(optax.sgd(0.1), simigrad_jax.scale_by_lr_factor())
  with pytest.raises(
    ValueError, match=r"the Trainer's optimizer never reached .*transform\('data'\)"
  ):
    train_step._update(
      plain,
      False,
      params,
      plain.init(params),
      stacked,
      0.0,
      train_step.StepScalars(total_weight=1.0, lr_factor=1.0, first_half_weight=1.0),
      SPECS,
      StackedGrads(AXIS, mesh),
    )


def test_only_refusing_context_variables_remain_in_the_package():
  """The trace-time context may refuse misuse; none may change what is computed."""
  package = pathlib.Path(simigrad_jax.__file__).parent
  found = {
    (path.relative_to(package).as_posix(), name)
    for path in package.rglob("*.py")
    for name in re.findall(r"^(\w+)\s*=\s*contextvars\.ContextVar", path.read_text(), re.M)
  }
  assert found == {
    ("ingraph/transform.py", "_EXPECTING_HALF_GRADS"),
    ("ingraph/transform.py", "_STEP_AXIS"),
  }


def test_the_refusing_contexts_leave_the_result_as_it_is(devices):
  n = len(devices)
  rng = np.random.default_rng(4)
  grads = {"w": rng.normal(size=(n, 6, 5)).astype(np.float32), "b": rng.normal(size=(n, 5))}
  first = jax.tree.map(lambda g: g + 0.3, grads)
  second = jax.tree.map(lambda g: g - 0.3, grads)
  tx = simigrad_jax.transform("batch")

  def run(refusing):
    def contexts(half_grads):
      stack = contextlib.ExitStack()
      if refusing:
        stack.enter_context(transform_module.step_mapped_over("batch"))
        if half_grads:
          stack.enter_context(transform_module.expecting_half_grads())
      return stack

    def step(g, a, b):
      with contexts(half_grads=False):
        device = tx.update(g, tx.init(g))
      with contexts(half_grads=True):
        local = tx.update(g, tx.init(g), half_grads=simigrad_jax.HalfGrads(a, b))
      return device, local

    return jax.pmap(step, axis_name="batch")(grads, first, second)

  for got, want in zip(jax.tree.leaves(run(True)), jax.tree.leaves(run(False)), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
