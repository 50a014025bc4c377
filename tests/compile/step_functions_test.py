"""The step's jitted functions: lowered on placeholders of any shape, traced once, and a loss
that does not fit the data named in the error."""

import doctest

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import compiles
import simigrad_jax
import tiny_run
from simigrad_jax.compile import step_functions
from simigrad_jax.compile.step_functions import APPLY
from simigrad_jax.compile.step_functions import Program
from simigrad_jax.compile.step_functions import StepFunctions
from simigrad_jax.ingraph import train_step
from simigrad_jax.shapes.layout import StepLayout

NOTHING_MORE = optax.identity()
ELEMENT_SPEC = {"x": ((5,), np.dtype("float32")), "y": ((), np.dtype("int32"))}


def functions(
  devices,
  halves="device",
  loss_fn=tiny_run.mlp_loss,
  axis_name="batch",
  passes="sequential",
  extra=NOTHING_MORE,
):
  mesh = Mesh(np.array(devices), ("batch",))
  optimizer = optax.chain(
    simigrad_jax.transform(axis_name), optax.sgd(0.1), extra, simigrad_jax.scale_by_lr_factor()
  )
  params = tiny_run.TinyMLP().init(jax.random.key(0), np.zeros((1, 5), np.float32))["params"]
  params = jax.device_put(params, NamedSharding(mesh, P()))
  opt_state = jax.device_put(optimizer.init(params), NamedSharding(mesh, P()))
  state = {"params": params, "opt_state": opt_state, "model_state": {}}
  layout = StepLayout.create(
    halves, len(devices), mode="recompile", max_micro=8, min_micro=2, lower=16, upper=64
  )
  return StepFunctions(
    loss_fn=train_step.checked_loss_fn(loss_fn, {}),
    optimizer=optimizer,
    mesh=mesh,
    axis_name="batch",
    layout=layout,
    seed=0,
    state=state,
    element_spec=ELEMENT_SPEC,
    passes=passes,
  )


def batch_rows(lowered):
  """The rows of the lowered step's batch (its fourth argument, after the state)."""
  args, _ = lowered.in_avals
  return args[3]["x"].shape[0]


def test_doctests():
  result = doctest.testmod(step_functions)
  assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("halves, slots", [("device", 8), ("local", 16)])
def test_each_shape_lowers_on_placeholders_of_its_rows(devices, halves, slots):
  steps = functions(devices, halves)
  assert batch_rows(steps.lower_fused(2)) == 2 * slots
  assert batch_rows(steps.lower_micro(4)) == 4 * slots
  assert isinstance(steps.lower_apply(), jax.stages.Lowered)


@pytest.mark.parametrize("halves", ["device", "local"])
def test_the_first_zero_accumulator_compiles_with_the_update_not_in_the_step(devices, halves):
  """The step that first accumulates compiles nothing of its own: the update's lowering (in the
  compiler's thread) compiles the zero accumulator's program too. Without it, the accumulator's
  first call compiles."""
  steps = functions(devices, halves)
  with compiles.compiled_in_this_thread() as unprepared:
    steps.zero_accumulator()
  assert len(unprepared) == 1

  steps = functions(devices, halves)
  (_, _, update_takes, *_), _ = steps.lower_apply().in_avals
  with compiles.compiled_in_this_thread() as compiled_in_step:
    acc = steps.zero_accumulator()
  assert compiled_in_step == []
  layout = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)
  assert layout(acc) == layout(update_takes)  # the update's accumulator, zeros
  assert all(not np.any(np.asarray(leaf)) for leaf in jax.tree.leaves(acc))


def test_the_passes_reach_the_local_split_s_programs_only(devices):
  """``passes`` changes the fused step and the micro-step of the local split (each the program
  of its own passes), and neither the plain step nor the device split's programs."""
  lowered = {
    (halves, passes): functions(devices, halves, passes=passes)
    for halves in ("device", "local")
    for passes in ("sequential", "stacked")
  }
  text = lambda halves, passes, lower: lower(lowered[halves, passes]).as_text()
  for lower in (lambda f: f.lower_fused(2), lambda f: f.lower_micro(2)):
    assert text("local", "sequential", lower) != text("local", "stacked", lower)
    assert text("device", "sequential", lower) == text("device", "stacked", lower)
  plain = lambda f: f.lower_plain(2)
  assert text("local", "sequential", plain) == text("local", "stacked", plain)


def test_a_trace_is_lowered_once(devices):
  steps = functions(devices)
  steps.trace(2)
  assert list(steps._traced) == [(Program.FUSED, 2)]
  from_trace = steps.lower_fused(2)
  assert steps._traced == {}  # kept no longer than its lowering
  assert from_trace.as_text() == steps.lower_fused(2).as_text()


def test_the_micro_step_and_the_update_trace_ahead_and_lower_from_their_traces(devices):
  steps = functions(devices)
  steps.trace(2, Program.MICRO)
  steps.trace(7, Program.APPLY)  # (one update for every shape)
  assert list(steps._traced) == [(Program.MICRO, 2), APPLY]
  micro, update = steps.lower_micro(2), steps.lower_apply()
  assert steps._traced == {}
  assert micro.as_text() == steps.lower_micro(2).as_text()
  assert update.as_text() == steps.lower_apply().as_text()
  with pytest.raises(KeyError):
    steps.trace(2, Program.PLAIN)  # only the programs a first step runs trace ahead


@pytest.mark.parametrize("halves", ["device", "local"])
def test_each_program_traces_the_loss_once(devices, halves):
  """The local split's two passes call one traced pass (half_batch.traced_once): a program
  traces the model's forward and backward pass once, counted as the loss's Python calls."""
  calls = []

  def counting_loss(*args):
    calls.append(len(args))
    return tiny_run.mlp_loss(*args)

  steps = functions(devices, halves, loss_fn=counting_loss)
  for lower in (steps.lower_fused, steps.lower_micro, steps.lower_plain):
    calls.clear()
    lower(2)
    assert len(calls) == 1, lower.__name__
  calls.clear()
  steps.lower_apply()
  assert calls == []


def test_a_loss_that_does_not_fit_the_data_names_the_features_and_rows(devices):
  def wrong_feature(params, model_state, batch, weights, rng):
    return tiny_run.mlp_loss(params, model_state, {"x": batch["image"], **batch}, weights, rng)

  steps = functions(devices, "local", loss_fn=wrong_feature)
  with pytest.raises(
    ValueError, match=r"features .*'x': \(\(5,\), 'float32'\).* 4 rows\): KeyError"
  ):
    steps.trace(2)  # 2 rows a slot: 4 a device with the local split


def test_the_loss_contract_error_is_raised_as_it_is(devices):
  def mean_loss(params, model_state, batch, weights, rng):
    losses, state = tiny_run.mlp_loss(params, model_state, batch, weights, rng)
    return losses.mean(), state

  with pytest.raises(train_step.LossContractError, match="one loss per row"):
    functions(devices, loss_fn=mean_loss).trace(2)


@pytest.mark.parametrize("program", [Program.FUSED, Program.APPLY])
def test_an_optimizer_over_another_axis_is_named(devices, program):
  with pytest.raises(ValueError, match="must use the Trainer's axis_name='batch'"):
    functions(devices, axis_name="data").trace(2, program)


def test_an_optimizer_that_fails_on_the_gradients_is_named_by_the_updates_trace(devices):
  def failing(updates, state, params=None):
    raise TypeError("no update for these leaves")

  steps = functions(devices, extra=optax.GradientTransformation(optax.init_empty_state, failing))
  with pytest.raises(
    ValueError, match="the optimizer fails on the parameters' gradients: TypeError"
  ):
    steps.trace(2, Program.APPLY)
