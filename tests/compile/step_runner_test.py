"""StepRunner: a step's plan run on its compiled programs, against a plain-JAX reference.

A plan of several micro-batches updates as one fused step does, padding rows
change nothing, and the step's measurements come back named.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import simigrad_jax
import tiny_run
from simigrad_jax.compile.program_compiler import StepProgramCompiler
from simigrad_jax.compile.step_functions import StepFunctions
from simigrad_jax.compile.step_runner import StepRunner
from simigrad_jax.data.data_loader import StepBatch
from simigrad_jax.ingraph import train_step
from simigrad_jax.ingraph.transform import SimilarityState
from simigrad_jax.shapes import batch_plan
from simigrad_jax.shapes.layout import StepLayout

AXIS = "batch"
LEARNING_RATE = 0.1
FEATURES = 5
ELEMENT_SPEC = {"x": ((FEATURES,), np.dtype("float32")), "y": ((), np.dtype("int32"))}
ROWS_PER_SLOT = {"device": 4, "local": 2}  # a fused step's rows per slot: 32 rows on 8 devices


class Runner:
  """A StepRunner on 8 devices, the state it starts from, and the rows of each slot."""

  def __init__(self, devices, halves):
    self.halves = halves
    self.mesh = Mesh(np.array(devices), (AXIS,))
    self.replicated = NamedSharding(self.mesh, P())
    self.sharded = NamedSharding(self.mesh, P(AXIS))
    self.optimizer = optax.chain(
      simigrad_jax.transform(AXIS), optax.sgd(LEARNING_RATE), simigrad_jax.scale_by_lr_factor()
    )
    model_input = np.zeros((1, FEATURES), np.float32)
    params = tiny_run.TinyMLP().init(jax.random.key(0), model_input)["params"]
    self.params = jax.tree.map(np.asarray, params)  # on the host: a step donates its state
    self.layout = StepLayout.create(
      halves, len(devices), mode="recompile", max_micro=8, min_micro=1, lower=8, upper=64
    )
    functions = StepFunctions(
      loss_fn=train_step.checked_loss_fn(tiny_run.mlp_loss, {}),
      optimizer=self.optimizer,
      mesh=self.mesh,
      axis_name=AXIS,
      layout=self.layout,
      seed=0,
      state=self.state(),
      element_spec=ELEMENT_SPEC,
    )
    self.compiler = StepProgramCompiler(functions, self.layout, background=False)
    self.runner = StepRunner(self.compiler)

  def state(self, params=None):
    """A fresh state on the devices (a step donates the one it runs on)."""
    params = self.params if params is None else params
    return jax.device_put(
      {"params": params, "opt_state": self.optimizer.init(params), "model_state": {}},
      self.replicated,
    )

  def batch(self, rows, micro, step=0):
    """The step's rows, ``micro`` rows a slot per micro-step (or a tuple: each micro-step's):
    micro-step ``j`` takes the next rows of every slot (``rows``: features, labels and weights,
    slot by slot)."""
    x, y, w = rows
    slots, per_slot = w.shape
    shapes = micro if isinstance(micro, tuple) else (micro,) * (per_slot // micro)
    accumulation = len(shapes)
    real = int(w.sum())
    plan = batch_plan.BatchPlan(
      requested_batch_size=real,
      global_batch_size=real,
      num_devices=slots,
      micro_batch_size=shapes[0],
      accumulation_steps=accumulation,
      padded_examples=w.size - real,
      micro_batch_sizes=shapes,
    )
    starts = np.cumsum((0,) + shapes)
    cut = lambda a, j: a[:, starts[j] : starts[j + 1]].reshape(-1, *a.shape[2:])  # noqa: E731
    micro_batches = [
      jax.device_put(({"x": cut(x, j), "y": cut(y, j)}, cut(w, j)), self.sharded)
      for j in range(accumulation)
    ]
    counters = [
      jax.device_put(np.array([step, j], np.int32), self.replicated) for j in range(accumulation)
    ]
    return StepBatch(plan=plan, micro_batches=micro_batches, counters=counters)

  def scalars(self, rows, lr_factor=1.0):
    """The step's scalars on the devices: its real examples, ``lr_factor``, half A's examples."""
    _, _, w = rows
    return jax.device_put(
      train_step.StepScalars(
        total_weight=np.float32(w.sum()),
        lr_factor=np.float32(lr_factor),
        first_half_weight=np.float32(w[0::2].sum()),
      ),
      self.replicated,
    )

  def run(self, rows, micro, lr_factor=1.0, state=None, step=0):
    """One step of ``rows`` at ``micro`` rows a slot: the new state and the measurements."""
    return self.runner.run(
      self.state() if state is None else state,
      self.batch(rows, micro, step),
      self.scalars(rows, lr_factor),
    )


@pytest.fixture(scope="module", params=["device", "local"])
def runner(devices, request):
  """A runner of each split, shared by the module's tests (its programs compiled once)."""
  made = Runner(devices, request.param)
  yield made
  made.compiler.close()


def slot_rows(layout, per_slot, seed=0, padding=0):
  """Features, labels and weights of each slot, ``per_slot`` rows each, the last ``padding`` of
  every slot zero-weight rows (with features and labels of their own)."""
  rng = np.random.default_rng(seed)
  shape = (layout.num_slots, per_slot)
  x = rng.normal(size=(*shape, FEATURES)).astype(np.float32)
  y = rng.integers(0, 3, size=shape).astype(np.int32)
  w = np.ones(shape, np.float32)
  w[:, per_slot - padding :] = 0.0
  return x, y, w


def with_other_padding(rows, seed):
  """``rows`` with new features and labels in their zero-weight rows."""
  x, y, w = rows
  rng = np.random.default_rng(seed)
  pad = w == 0
  x, y = x.copy(), y.copy()
  x[pad] = 100 * rng.normal(size=(int(pad.sum()), FEATURES))
  y[pad] = rng.integers(0, 3, size=int(pad.sum()))
  return x, y, w


def reference(params, rows, lr_factor=1.0):
  """Plain JAX on one device: the SGD step over the real rows, its mean loss and the two halves'
  statistics (half A: the rows of the even slots)."""
  x, y, w = rows

  def mean_loss(p, keep):
    losses, _ = tiny_run.mlp_loss(p, {}, {"x": x[keep], "y": y[keep]}, None, None)
    return jnp.mean(losses)

  real = w > 0
  even = np.zeros_like(real)
  even[0::2] = True
  loss, grads = jax.value_and_grad(mean_loss)(params, real)
  g, _ = ravel_pytree(grads)
  g_a, _ = ravel_pytree(jax.grad(mean_loss)(params, real & even))
  g_b, _ = ravel_pytree(jax.grad(mean_loss)(params, real & ~even))
  new_params = jax.tree.map(lambda p, d: p - LEARNING_RATE * lr_factor * d, params, grads)
  norm_a, norm_b = jnp.linalg.norm(g_a), jnp.linalg.norm(g_b)
  return new_params, {
    "loss": loss,
    "similarity": jnp.dot(g_a, g_b) / (norm_a * norm_b),
    "norm_a": norm_a,
    "norm_b": norm_b,
    "norm_mean": jnp.linalg.norm(g),
  }


def assert_trees_close(actual, expected):
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(np.asarray(a, float), np.asarray(e, float), rtol=1e-5, atol=1e-6)


def assert_measured(measurements, expected):
  similarity = measurements.similarity_state
  for name, value in expected.items():
    got = measurements.loss if name == "loss" else getattr(similarity, name)
    np.testing.assert_allclose(float(got), float(value), rtol=1e-5, atol=1e-6, err_msg=name)
  assert bool(similarity.measured) and bool(similarity.grads_finite)
  assert int(similarity.nonfinite_count) == 0


def test_a_fused_step_updates_as_the_reference_and_measures_its_halves(runner):
  rows = slot_rows(runner.layout, ROWS_PER_SLOT[runner.halves])
  state, measurements = runner.run(rows, micro=rows[2].shape[1], lr_factor=0.5)
  new_params, expected = reference(runner.params, rows, lr_factor=0.5)
  assert_trees_close(state["params"], new_params)
  assert_measured(measurements, expected)


def test_a_plan_of_several_micro_batches_updates_as_one_fused_step(runner):
  rows = slot_rows(runner.layout, ROWS_PER_SLOT[runner.halves])
  per_slot = rows[2].shape[1]
  fused_state, fused = runner.run(rows, micro=per_slot)
  accumulated_state, accumulated = runner.run(rows, micro=per_slot // 2)
  assert per_slot // 2 in runner.compiler.view()["micro"]  # (it accumulated)
  assert_trees_close(accumulated_state, fused_state)
  assert_trees_close(accumulated, fused)
  new_params, expected = reference(runner.params, rows)
  assert_trees_close(accumulated_state["params"], new_params)
  assert_measured(accumulated, expected)


def test_a_plan_of_micro_batches_of_several_shapes_updates_as_the_reference(runner):
  rows = slot_rows(runner.layout, 7, padding=1)  # 6 real rows a slot on 4 + 2 + 1
  state, measurements = runner.run(rows, micro=(4, 2, 1))
  assert {4, 2, 1} <= runner.compiler.view()["micro"]  # each micro-batch on its own shape
  new_params, expected = reference(runner.params, rows)
  assert_trees_close(state["params"], new_params)
  assert_measured(measurements, expected)


def test_the_accumulator_starts_every_step_from_zero(runner):
  per_slot = ROWS_PER_SLOT[runner.halves]
  first, second = (slot_rows(runner.layout, per_slot, seed) for seed in (1, 2))
  state, _ = runner.run(first, micro=per_slot // 2)
  state, measurements = runner.run(second, micro=per_slot // 2, state=state, step=1)
  params, _ = reference(runner.params, first)
  params, expected = reference(params, second)
  assert_trees_close(state["params"], params)
  assert_measured(measurements, expected)


@pytest.mark.parametrize("micro_steps", [1, 2])
def test_padding_rows_change_nothing(runner, micro_steps):
  per_slot = 2 * ROWS_PER_SLOT[runner.halves]
  rows = slot_rows(runner.layout, per_slot, padding=per_slot // 4)
  micro = per_slot // micro_steps
  state, measurements = runner.run(rows, micro)
  other_state, other = runner.run(with_other_padding(rows, seed=5), micro)
  for a, b in zip(
    jax.tree.leaves((state, measurements)), jax.tree.leaves((other_state, other)), strict=True
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bit for bit
  new_params, expected = reference(runner.params, rows)
  assert_trees_close(state["params"], new_params)
  assert_measured(measurements, expected)


def test_the_measurements_come_back_named_and_replicated(runner):
  rows = slot_rows(runner.layout, ROWS_PER_SLOT[runner.halves])
  _, measurements = runner.run(rows, micro=rows[2].shape[1])
  assert isinstance(measurements, train_step.StepMeasurements)
  assert isinstance(measurements.similarity_state, SimilarityState)
  dtypes = {
    "loss": jnp.float32,
    "similarity": jnp.float32,
    "norm_a": jnp.float32,
    "norm_b": jnp.float32,
    "norm_mean": jnp.float32,
    "measured": jnp.bool_,
    "grads_finite": jnp.bool_,
    "nonfinite_count": jnp.int32,
  }
  leaves = {"loss": measurements.loss, **measurements.similarity_state._asdict()}
  assert list(leaves) == list(dtypes)
  for name, leaf in leaves.items():
    assert leaf.shape == () and leaf.dtype == dtypes[name], name
    assert leaf.sharding.is_fully_replicated, name
