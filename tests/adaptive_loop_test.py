"""simigrad_jax.AdaptiveStep and docs/adaptive_loop.md, whose loop is built on it.

The page's block runs here in the test process (the 8 devices of
``conftest.py``); the tests read what it left: the sizes, the learning-rate
factor, the controller and the programs compiled. The step itself is checked
against a plain ``jax.jit`` step of ``value_and_half_grads`` on the same
batch (and, for a batch whose halves differ in size, against the two halves'
gradients taken one by one), on 8 devices (the device split) and on one (the
local split), and on the bad inputs it refuses.
"""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import simigrad_jax
from simigrad_jax.compile.step_functions import Program
from simigrad_jax.compile.step_functions import ProgramShape
from simigrad_jax.ingraph import AxisNameError
from simigrad_jax.ingraph import LossContractError
from simigrad_jax.shapes import batch_plan
from simigrad_jax.trainer import AdaptiveBatchError
from simigrad_jax.trainer import adaptive_step

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "adaptive_loop.md"
FEATURES, HIDDEN, MAX_BATCH = 6, 8, 64


def run_block() -> dict:
  (block,) = re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.S | re.M)
  scope: dict = {"__name__": "adaptive_loop_block"}
  exec(compile(block, str(PAGE), "exec"), scope)  # noqa: S102
  return scope


@pytest.fixture(scope="module")
def page():
  return run_block()


def test_the_pages_step_and_loop_are_at_most_15_lines():
  (block,) = re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.S | re.M)
  start = block.index("step = simigrad_jax.AdaptiveStep(")  # the step and the loop
  end = block.index("print(")
  lines = [line for line in block[start:end].splitlines() if line.strip()]
  assert len(lines) <= 15, lines
  prose = " ".join(PAGE.read_text().split())
  assert f"the {len(lines)} lines from `AdaptiveStep` to the `print`" in prose


def test_the_batch_moves_by_the_rules_ten_percent(page):
  sizes, lower, upper = page["sizes"], page["lower"], page["upper"]
  assert len(sizes) == 25 and len(set(sizes)) >= 10  # it adapts
  assert any(s & (s - 1) for s in sizes)  # sizes between the powers of two
  for before, after in zip(sizes, sizes[1:]):
    # Every size asked for is realised exactly: the rule's 10%, within the bounds.
    rule = {min(max(int(before * f), lower), upper) for f in (1.1, 0.9)} | {before}
    assert after in rule, (before, after)


def test_the_controller_and_the_learning_rate_follow_the_size(page):
  controller, step = page["controller"], page["step"]
  assert controller.step == 25
  assert page["factor"] == pytest.approx(simigrad_jax.lr_factor(page["sizes"][-1], 256))
  assert np.isfinite(simigrad_jax.similarity(page["opt_state"]))
  # One fused program per shape the batch visited, each compiled once.
  compiled = step.compiled
  assert compiled and all(key.program is Program.FUSED for key in compiled)
  shapes = {step.plan(size).micro_batch_size for size in page["sizes"]}
  assert sorted(key.micro for key in compiled) == sorted(shapes)
  assert len(compiled) <= 8


# The step against a plain jax.jit step of value_and_half_grads.


def row_losses(params, batch):
  hidden = jnp.tanh(batch["x"] @ params["w1"])
  return (hidden @ params["w2"] - batch["y"]) ** 2


def mean_loss(params, batch):
  return jnp.mean(row_losses(params, batch))


def optimizer(axis_name=None):
  return optax.chain(
    simigrad_jax.transform(axis_name), optax.sgd(0.1), simigrad_jax.scale_by_lr_factor()
  )


@pytest.fixture(scope="module")
def params():
  rng = np.random.default_rng(1)
  return {
    "w1": jnp.asarray(rng.normal(size=(FEATURES, HIDDEN)), jnp.float32) * 0.5,
    "w2": jnp.asarray(rng.normal(size=HIDDEN), jnp.float32) * 0.5,
  }


def batch_of(size: int, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(size, FEATURES)).astype(np.float32)
  return {"x": x, "y": (x.sum(1) + rng.normal(size=size)).astype(np.float32)}


def reference(params, batch, lr_factor=1.0):
  """The plain step's new parameters and similarity: even rows against odd rows, each half's
  mean gradient weighed by its share of the examples."""
  count = len(batch["y"])
  if count % 2 == 0:
    plain = optimizer()

    @jax.jit
    def step(p, s, b):
      _, grads, halves = simigrad_jax.value_and_half_grads(mean_loss)(p, b)
      updates, s = plain.update(grads, s, p, half_grads=halves)
      return optax.apply_updates(p, updates), s

    state = simigrad_jax.set_lr_factor(plain.init(params), lr_factor)
    new, state = step(params, state, batch)
    return new, simigrad_jax.similarity(state)
  first = jax.grad(mean_loss)(params, jax.tree.map(lambda a: a[0::2], batch))
  second = jax.grad(mean_loss)(params, jax.tree.map(lambda a: a[1::2], batch))
  share = ((count + 1) // 2) / count
  mean = jax.tree.map(lambda a, b: share * a + (1 - share) * b, first, second)
  flat = lambda tree: jnp.concatenate([leaf.ravel() for leaf in jax.tree.leaves(tree)])
  cos = jnp.dot(flat(first), flat(second)) / jnp.linalg.norm(flat(first))
  cos = cos / jnp.linalg.norm(flat(second))
  new = jax.tree.map(lambda p, g: p - 0.1 * lr_factor * g, params, mean)
  return new, float(cos)


@pytest.fixture(scope="module", params=[8, 1], ids=["8 devices", "1 device"])
def adaptive(request, devices):
  """An AdaptiveStep on 8 devices (the device split) or on one (the local split)."""
  mesh = jax.make_mesh(
    (request.param,),
    ("batch",),
    (jax.sharding.AxisType.Auto,),
    devices=devices[: request.param],
  )
  return simigrad_jax.AdaptiveStep(
    row_losses, optimizer("batch"), max_batch_size=MAX_BATCH, min_batch_size=8, mesh=mesh
  )


@pytest.mark.parametrize(
  "size, lr_factor",
  [(40, 1.5), (13, 1.0), (150, 1.0)],
  ids=["a shape's batch, a factor", "odd, padded", "accumulated"],
)
def test_the_step_is_the_plain_steps(adaptive, params, size, lr_factor):
  batch = batch_of(size, seed=size)
  expected, similarity = reference(params, batch, lr_factor)
  new, opt_state, measured = adaptive(*adaptive.init(params), batch, lr_factor=lr_factor)
  for got, want in zip(jax.tree.leaves(new), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
  assert simigrad_jax.similarity(opt_state) == pytest.approx(similarity, abs=1e-5)
  assert float(measured.loss) == pytest.approx(float(mean_loss(params, batch)), rel=1e-5)
  plan = adaptive.plan(size)
  assert plan.global_batch_size == size and (plan.accumulation_steps > 1) == (size > MAX_BATCH)


def test_the_halves_follow_the_device_count(adaptive):
  num_devices = adaptive.batch_shapes[-1] // adaptive.plan(MAX_BATCH).micro_batch_size
  assert adaptive.halves == ("device" if num_devices == 8 else "local")


def test_a_moving_batch_compiles_only_the_few_shapes(params, devices):
  mesh = jax.make_mesh((8,), ("batch",), (jax.sharding.AxisType.Auto,), devices=devices)
  step = simigrad_jax.AdaptiveStep(
    row_losses, optimizer("batch"), max_batch_size=MAX_BATCH, min_batch_size=32, mesh=mesh
  )
  assert step.batch_shapes == (32, 40, 48, 56, 64)  # 4 per octave on 8 devices
  state = step.init(params)
  sizes = [32, 35, 38, 42, 46, 51, 56, 62, 56, 51, 46, 42, 38, 35, 32]
  for size in sizes:
    *state, _ = step(*state, batch_of(size))
  compiled = step.compiled
  assert [key.micro for key in compiled] == [4, 5, 6, 7, 8]  # rows per device, in visiting order
  for size in sizes:  # the same sizes again compile nothing
    *state, _ = step(*state, batch_of(size))
  assert step.compiled == compiled


@pytest.mark.parametrize(
  "batch, message",
  [
    (batch_of(1), "at least 2"),
    ({"x": np.ones((4, FEATURES), np.float32), "y": np.ones(5, np.float32)}, "same leading"),
    ([np.ones(4)], "dict of arrays"),
    ({"x": np.ones((4, FEATURES + 1), np.float32), "y": np.ones(4, np.float32)}, "first batch"),
  ],
  ids=["one example", "rows of different counts", "not a dict", "other features"],
)
def test_a_batch_it_cannot_run_is_refused(adaptive, params, batch, message):
  state = adaptive.init(params)
  *state, _ = adaptive(*state, batch_of(16))  # the first batch sets the examples' shapes
  with pytest.raises(AdaptiveBatchError, match=message):
    adaptive(*state, batch)


def test_bad_settings_are_refused(params):
  with pytest.raises(ValueError, match="min_batch_size"):
    simigrad_jax.AdaptiveStep(row_losses, optimizer("batch"), max_batch_size=8, min_batch_size=16)
  with pytest.raises(ValueError, match="max_batch_size"):
    simigrad_jax.AdaptiveStep(row_losses, optimizer("batch"), max_batch_size=0)
  with pytest.raises(ValueError, match="shapes_per_octave"):
    simigrad_jax.AdaptiveStep(row_losses, optimizer("batch"), max_batch_size=8, shapes_per_octave=0)
  with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 4294967295\]"):
    simigrad_jax.AdaptiveStep(row_losses, optimizer("batch"), max_batch_size=8, seed=2**32)
  with pytest.raises(ValueError, match="data axis 'batch'"):
    mesh = jax.make_mesh((8,), ("data",), (jax.sharding.AxisType.Auto,))
    simigrad_jax.AdaptiveStep(row_losses, optimizer("batch"), max_batch_size=8, mesh=mesh)
  no_factor = optax.chain(simigrad_jax.transform("batch"), optax.sgd(0.1))
  step = simigrad_jax.AdaptiveStep(row_losses, no_factor, max_batch_size=8)
  with pytest.raises(ValueError, match="scale_by_lr_factor"):
    step.init(params)


def test_a_loss_or_transform_that_does_not_fit_is_named(params):
  mean = simigrad_jax.AdaptiveStep(mean_loss, optimizer("batch"), max_batch_size=16)
  with pytest.raises(LossContractError, match="one loss per row"):
    mean(*mean.init(params), batch_of(16))
  other_axis = simigrad_jax.AdaptiveStep(row_losses, optimizer("data"), max_batch_size=16)
  with pytest.raises(AxisNameError, match="axis_name='batch'"):
    other_axis(*other_axis.init(params), batch_of(16))
  step = simigrad_jax.AdaptiveStep(row_losses, optimizer("batch"), max_batch_size=16)
  with pytest.raises(ValueError, match="lr_factor"):
    step(*step.init(params), batch_of(16), lr_factor=0.0)


@pytest.mark.parametrize(
  "lr_factor", [0.0, -1.0, float("nan"), float("inf"), 1e39, "fast", "2", True, None]
)
def test_a_learning_rate_factor_that_is_not_a_finite_positive_number_is_refused(params, lr_factor):
  step = simigrad_jax.AdaptiveStep(row_losses, optimizer("batch"), max_batch_size=16)
  with pytest.raises(ValueError, match=r"lr_factor must be a finite number > 0.*, got"):
    step(*step.init(params), batch_of(16), lr_factor=lr_factor)  # 1e39: not a float32


# The host's share of a step.


def test_a_size_seen_before_places_nothing_on_the_devices(adaptive, params, monkeypatch):
  """A step at a size it has run before reuses its row weights and scalars on the devices and
  hands its rows to the program as host arrays: no jax.device_put of its own, whatever the
  learning-rate factor."""
  state = adaptive.init(params)
  placed = []
  device_put = jax.device_put
  monkeypatch.setattr(jax, "device_put", lambda *a, **k: placed.append(a) or device_put(*a, **k))
  sizes = [22, 21, 22, 21, 22]  # one shape; sizes the other tests do not run
  assert len({adaptive.plan(size).micro_batch_size for size in sizes}) == 1
  for n, size in enumerate(sizes):
    before = len(placed)
    *state, _ = adaptive(*state, batch_of(size, seed=n), lr_factor=1.0 + n / 4)
    assert (len(placed) > before) == (size not in sizes[:n]), (n, size)  # a new size places
  assert np.isfinite(simigrad_jax.similarity(state[1]))


def test_the_rows_of_a_plan_of_several_shapes_are_laid_out_micro_step_by_micro_step():
  """Micro-step ``j`` takes the first ``plan.shapes[j]`` rows of each slot, as the Trainer's
  data loader lays them out, padding rows zero."""
  plan = batch_plan.plan_on_shapes(21, 21, 2, (8, 3))  # 2 slots: 8 + 3 rows each, 1 padding
  mesh = jax.make_mesh((1,), ("batch",), (jax.sharding.AxisType.Auto,))
  sharded, replicated = (jax.NamedSharding(mesh, spec) for spec in (P("batch"), P()))
  placed = adaptive_step._PlacedPlan.create(plan, sharded, replicated)
  rows = {"x": np.arange(1.0, 22.0, dtype=np.float32)[:, None] * np.ones(2, np.float32)}
  micro_batches = placed.laid_out(rows)
  layout = plan.example_layout()
  assert [len(m["x"]) for m in micro_batches] == [16, 6]
  for j, size in enumerate(plan.shapes):
    examples = layout[j, :, :size].reshape(-1)
    want = np.where(examples[:, None] >= 0, rows["x"][np.maximum(examples, 0)], 0.0)
    np.testing.assert_array_equal(micro_batches[j]["x"], want)
    np.testing.assert_array_equal(np.asarray(placed.weights[j]), examples >= 0)
  assert np.asarray(placed.scalars.total_weight) == 21
  assert np.asarray(placed.scalars.first_half_weight) == 11


# measure_every: the similarity measured on every k-th step, plain steps between.


def plain_reference_step(params, opt_state, batch):
  """A plain jax.jit step of the whole batch's mean gradient: what a step that does not measure
  computes."""
  sgd = optax.sgd(0.1)
  grads = jax.grad(mean_loss)(params, batch)
  updates, opt_state = sgd.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def test_every_kth_step_measures_and_the_others_are_plain_steps(adaptive, params):
  """k = 2: the measuring steps are the two-half step's, the others a plain step's, and
  the parameters follow a plain jax.jit loop's step for step."""
  mesh = adaptive._mesh  # pylint: disable=protected-access
  step = simigrad_jax.AdaptiveStep(
    row_losses, optimizer("batch"), max_batch_size=MAX_BATCH, measure_every=2, mesh=mesh
  )
  assert [n for n in range(7) if step.measuring(n)] == [0, 2, 4, 6]
  state = step.init(params)
  expected, sgd_state = params, optax.sgd(0.1).init(params)
  plain = jax.jit(plain_reference_step)
  for n, size in enumerate([40, 40, 38, 40]):
    batch = batch_of(size, seed=n)
    assert step.steps == n
    *state, measured = step(*state, batch)
    expected, sgd_state = plain(expected, sgd_state, batch)
    for got, want in zip(jax.tree.leaves(state[0]), jax.tree.leaves(expected), strict=True):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert bool(measured.similarity_state.measured) == step.measuring(n)
    assert np.isfinite(simigrad_jax.similarity(state[1])) == step.measuring(n)
  assert {key.program for key in step.compiled} == {Program.FUSED, Program.PLAIN}
  assert {key.micro for key in step.compiled} == {step.plan(40).micro_batch_size}
  fused, plain_program = (step.program(key) for key in step.compiled)
  assert fused.as_text() != plain_program.as_text()  # one gradient pass, not two
  assert plain_program.memory_analysis().temp_size_in_bytes > 0
  with pytest.raises(KeyError, match=r"compiled so far: \[ProgramShape"):
    step.program(ProgramShape(Program.MICRO, 4))


def test_on_8_devices_the_plain_program_is_no_heavier_than_the_measuring_one(devices):
  """By the compiler's counts (no timing): the plain step reduces its gradient as the measuring
  step does (reduce-scatter, the norm on each device's piece, all-gather), so it accesses no
  more bytes and holds no more temporaries, and all-reduces nothing but scalars."""
  rng = np.random.default_rng(2)
  features = 128  # a kernel of 65536 entries: a bucket of its own, as a real model's
  wide = {
    "w1": jnp.asarray(rng.normal(size=(features, 512)) / features, jnp.float32),
    "w2": jnp.asarray(rng.normal(size=512), jnp.float32),
  }
  x = rng.normal(size=(MAX_BATCH, features)).astype(np.float32)
  batch = {"x": x, "y": x.sum(1)}
  mesh = jax.make_mesh((8,), ("batch",), (jax.sharding.AxisType.Auto,), devices=devices)
  step = simigrad_jax.AdaptiveStep(
    row_losses, optimizer("batch"), max_batch_size=MAX_BATCH, measure_every=2, mesh=mesh
  )
  state = step.init(wide)
  for _ in range(2):
    *state, _ = step(*state, batch)
  programs = {key.program: step.program(key) for key in step.compiled}
  fused, plain = programs[Program.FUSED], programs[Program.PLAIN]
  cost = lambda program: program.cost_analysis()["bytes accessed"]
  temp = lambda program: program.memory_analysis().temp_size_in_bytes
  assert cost(plain) <= cost(fused)
  assert temp(plain) <= temp(fused)
  all_reduced = re.findall(r"= \(?([^=]*?)\)? all-reduce\(", plain.as_text())
  assert all_reduced and all(re.fullmatch(r"(f32\[\], )*f32\[\]", s) for s in all_reduced), (
    all_reduced
  )


def test_the_controller_reads_every_kth_step_and_holds_the_batch_between(devices, params):
  """The controller updates on the measuring steps only: its rule's 10% then moves the batch
  every k steps, and it counts the measurements, not the steps."""
  mesh = jax.make_mesh((8,), ("batch",), (jax.sharding.AxisType.Auto,), devices=devices)
  step = simigrad_jax.AdaptiveStep(
    row_losses, optimizer("batch"), max_batch_size=MAX_BATCH, measure_every=3, mesh=mesh
  )
  controller = simigrad_jax.Controller(
    32, 0.99, batch_size_lower_bound=16, batch_size_upper_bound=MAX_BATCH
  )
  state, sizes = step.init(params), []
  for n in range(7):
    size = controller.batch_size
    *state, _ = step(*state, batch_of(size, seed=n))
    if step.measuring(n):
      controller.update(simigrad_jax.similarity(state[1]))
    sizes.append(size)
  assert controller.step == 3  # steps 0, 3 and 6 measured
  # A decision after steps 0 and 3 sets the size of the next 3 steps.
  assert sizes[1] == sizes[2] == sizes[3] and sizes[4] == sizes[5] == sizes[6]
  assert sizes[0] != sizes[1] != sizes[4]  # each measurement moved it


@pytest.mark.parametrize("step_number", [True, -3, 2.5, float("nan"), jnp.int32(4)])
def test_measuring_refuses_a_step_number_that_is_no_step(step_number):
  step = simigrad_jax.AdaptiveStep(
    row_losses, optimizer("batch"), max_batch_size=8, measure_every=2
  )
  with pytest.raises(ValueError, match=r"step must be an integer >= 0, got"):
    step.measuring(step_number)


def test_measuring_answers_a_python_bool_for_a_numpy_step():
  step = simigrad_jax.AdaptiveStep(
    row_losses, optimizer("batch"), max_batch_size=8, measure_every=2
  )
  assert step.measuring(np.int64(4)) is True and step.measuring(np.int32(3)) is False


@pytest.mark.parametrize("batch_size", [20.0, np.array(20), True])
def test_plan_refuses_a_batch_size_that_is_not_an_integer(batch_size):
  step = simigrad_jax.AdaptiveStep(row_losses, optimizer("batch"), max_batch_size=8)
  with pytest.raises(AdaptiveBatchError, match=r"batch_size must be an integer >= 2, got"):
    step.plan(batch_size)
  assert step.plan(np.int64(20)) == step.plan(20)


def test_measure_every_must_be_a_positive_int():
  with pytest.raises(ValueError, match="measure_every"):
    simigrad_jax.AdaptiveStep(row_losses, optimizer("batch"), max_batch_size=8, measure_every=0)
