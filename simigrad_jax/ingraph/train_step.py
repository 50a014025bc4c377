"""In-graph: the data-parallel steps that the Trainer compiles, one set per shape.

All run inside ``jax.shard_map`` over the mesh's data axis with
``check_vma=False`` (the semantics of ``jax.pmap``: each device computes its
own gradient). The shard_map is manual over the data axis only: on a mesh
with model axes, the parameters keep their shardings over those axes and
XLA's partitioner lays out the model's computation over them
(:mod:`simigrad_jax.shapes.mesh_sharding`).

* :func:`make_fused_step`, for a step of one micro-batch: gradient, reduction
  and update in ONE program, so there is no accumulator to allocate or round
  trip through memory, and XLA can overlap the reduction with the backward
  pass.
* :func:`make_plain_step`, the fused step of a step that does not measure
  (``measure_every``): one gradient pass per device, the transform given
  ``measure=False``.
* :func:`make_micro_step` adds one micro-batch's gradient to each device's
  accumulator, and :func:`make_apply_step` then updates from the accumulated
  gradient, for a step of several micro-batches.

The loss is the weighted SUM over a device's rows times
``num_devices / total_weight``, so that averaging over devices gives exactly
the mean gradient over the step's real examples (padding rows have weight 0
and contribute nothing). The optimizer's :func:`simigrad_jax.transform`
averages the per-device gradients and measures the half-batch similarity.

The two halves are formed in one of two ways (``halves``):

* ``"device"``: each device computes one gradient over its rows, and the
  transform compares the even devices with the odd ones.
* ``"local"``: each device's rows arrive as two equal blocks, the first
  half's rows then the second half's (padded with zero-weight rows), and the
  device takes one gradient per block, by default in two passes, one after
  the other (as :func:`simigrad_jax.value_and_half_grads` does; ``passes``
  chooses another way). The per-half weighted sums
  are kept apart through the micro-steps; at the update they are normalised
  by each half's real-example count over the whole step and all devices
  (``first_half_weight`` and ``total_weight - first_half_weight``) and given
  to the transform as :class:`simigrad_jax.HalfGrads` with the first half's
  share, while the mean gradient is their sum over ``total_weight``, exactly
  the one the device split returns.

The step takes its scalars from the host as one :class:`StepScalars` (the
step's real examples, the learning-rate factor, half A's real examples) and
returns what it measured as one :class:`StepMeasurements` (the loss and the
transform's :class:`~simigrad_jax.ingraph.transform.SimilarityState`). The
learning-rate factor is written into the optimizer state in-graph, so the
host never rewrites the state between steps. A step that would write
something not finite (its gradient, its loss, its update or its new
parameters holds NaN or an infinity) keeps the parameters, the optimizer
state and the model state as they were, and says why in its
:class:`StepMeasurements` (``nonfinite_cause``, an index into
:data:`NONFINITE_CAUSES`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

from simigrad_jax.errors import SimiGradError
from simigrad_jax.ingraph import batch_coupling
from simigrad_jax.ingraph import half_batch
from simigrad_jax.ingraph import transform
from simigrad_jax.ingraph.device_halves_step import update_stacked
from simigrad_jax.ingraph.transform import HalfGrads
from simigrad_jax.ingraph.transform import HalvesContractError
from simigrad_jax.ingraph.transform import SimilarityState
from simigrad_jax.ingraph.transform import StackedGrads
from simigrad_jax.reductions import data_blocks

# loss_fn(params, model_state, batch, weights, rng) -> (per_example_losses, new_model_state)
PerExampleLossFn = Callable[[Any, Any, Any, jax.Array, jax.Array], tuple[jax.Array, Any]]

HALVES: tuple[str, ...] = ("device", "local")

# Why a step was skipped, in the order they are checked: StepMeasurements.nonfinite_cause is
# 0 for a step that wrote its results, else 1 + the index here of the first that was not finite.
NONFINITE_CAUSES: tuple[str, ...] = ("gradient", "loss", "update", "parameters")


class StepScalars(NamedTuple):
  """The scalars a step takes from the host beside its rows (float32, replicated).

  The host builds them as NumPy scalars and places them on the devices only
  when they change, so a new learning-rate factor or batch size costs no
  recompilation.
  """

  total_weight: ArrayLike  # float32: the step's real examples (its rows' total weight).
  lr_factor: ArrayLike  # float32: the learning-rate factor, written into the optimizer state.
  first_half_weight: ArrayLike  # float32: half A's real examples (read with halves="local").


class StepMeasurements(NamedTuple):
  """What a step measured, as its program returns it (replicated: identical on every device)."""

  loss: jax.Array  # float32: the mean loss over the step's real examples.
  similarity_state: SimilarityState  # the transform's statistics of the step's two halves.
  # int32: 0 when the step wrote its results, else 1 + the index in NONFINITE_CAUSES of why the
  # step was skipped (the first of gradient, loss, update, new parameters that was not finite).
  nonfinite_cause: Any = 0


class LossContractError(SimiGradError, ValueError):
  """``loss_fn`` returned something other than per-example losses and a model state."""


def checked_loss_fn(loss_fn: PerExampleLossFn, model_state: Any) -> PerExampleLossFn:
  """``loss_fn``, checked at trace time: one floating-point loss per row, and the model state's
  structure kept."""
  state_structure = jax.tree.structure(model_state)

  def checked(params, state, batch, weights, rng):
    out = loss_fn(params, state, batch, weights, rng)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
      raise LossContractError(
        "loss_fn(params, model_state, batch, weights, rng) must return the pair "
        f"(per_example_losses, new_model_state), got {_describe_returned(out)}; "
        f"return one loss per row, shape {weights.shape} (no mean: the Trainer weights the "
        "rows itself), with the model state, e.g. `return losses, model_state` for a model "
        "without state"
      )
    losses, new_state = out
    if jnp.shape(losses) != weights.shape:
      raise LossContractError(
        f"loss_fn must return one loss per row, shape {weights.shape}, got shape "
        f"{jnp.shape(losses)}: the Trainer weights the rows itself (padding rows have weight "
        "0), so a mean over the rows would count padding"
      )
    if not jnp.issubdtype(jnp.result_type(losses), jnp.floating):
      raise LossContractError(
        f"loss_fn must return floating-point losses, got dtype {jnp.result_type(losses)}: an "
        "integer loss has no gradient, so no step would train; compute the loss in float32 "
        "(e.g. `losses.astype(jnp.float32)` before any rounding)"
      )
    if jax.tree.structure(new_state) != state_structure:  # type: ignore[operator]  # PyTreeDef
      raise LossContractError(
        f"loss_fn must return a model state with the structure of model_state "
        f"({state_structure}), got {jax.tree.structure(new_state)}"
      )
    return losses, new_state

  return checked


def _describe_returned(value: Any) -> str:
  """What a loss function returned, for a message: an array by its shape, else by its type."""
  if isinstance(value, (tuple, list)):
    return f"a {type(value).__name__} of {len(value)}"
  shape = getattr(value, "shape", None)
  if shape is not None:
    return "a single scalar" if shape == () else f"a single array of shape {tuple(shape)}"
  return f"a {type(value).__name__}"


class Accumulator(NamedTuple):
  """Per-device running sums of one optimizer step (leading device axis, sharded)."""

  # Pytree like params (halves="device"), or a pair of them, the first and the second
  # half's sums (halves="local"); each leaf with a leading device axis.
  grads: Any
  loss: jax.Array  # float32[num_devices]: each device's share of the step's mean loss.


def _check_halves(halves: str) -> bool:
  """Whether ``halves`` is the local split; raises for a name that is neither."""
  if halves not in HALVES:
    raise ValueError(f"halves={halves!r} is not valid; choose one of {HALVES}")
  return halves == "local"


def abstract_accumulator(
  params: Any, mesh: Mesh, axis_name: str, halves: str = "device"
) -> Accumulator:
  """The :class:`Accumulator`'s shapes, dtypes and shardings, as placeholders (nothing allocated)."""
  num_devices = mesh.shape[axis_name]
  sharding = jax.sharding.NamedSharding(mesh, P(axis_name))
  grads = (params, params) if _check_halves(halves) else params

  def per_device(p):
    # A leaf sharded over model axes keeps them after the leading device axis (a leaf sharded
    # over the data axis is gathered for the step, and so is its gradient).
    spec = _model_spec(p, axis_name)
    return jax.ShapeDtypeStruct(
      (num_devices,) + jnp.shape(p),
      jnp.result_type(p),
      sharding=jax.sharding.NamedSharding(mesh, P(axis_name, *spec)),
    )

  return Accumulator(
    grads=jax.tree.map(per_device, grads),
    # Placeholders, as the grads are: the type checker reads the field as an array.
    loss=jax.ShapeDtypeStruct(
      (num_devices,),
      jnp.float32,  # type: ignore[arg-type]
      sharding=sharding,
    ),
  )


def _model_spec(leaf: Any, axis_name: str) -> tuple:
  """The entries of ``leaf``'s ``PartitionSpec`` with the data axis dropped (none: replicated)."""
  sharding = getattr(leaf, "sharding", None)
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return ()
  without = lambda names: tuple(n for n in names if n != axis_name) or None
  return tuple(
    None if e is None else without((e,) if isinstance(e, str) else tuple(e)) for e in sharding.spec
  )


def manual_over(mesh: Mesh, axis_name: str, fn: Callable, in_specs: tuple, out_specs: Any) -> Any:
  """``fn`` as a ``jax.shard_map`` manual over ``axis_name`` only (the other axes: the partitioner)."""
  return jax.shard_map(
    fn,
    mesh=mesh,
    in_specs=in_specs,
    out_specs=out_specs,
    axis_names=frozenset({axis_name}),
    check_vma=False,
  )


def zeros_program(abstract: Accumulator) -> jax.stages.Wrapped:
  """A jitted function of no arguments returning a zero :class:`Accumulator` laid out as ``abstract``.

  Args:
    abstract: the accumulator's placeholders (:func:`abstract_accumulator`).

  Returns:
    The jitted function; each call allocates a zero accumulator on the
    placeholders' shardings.

  Example:
    >>> import numpy as np
    >>> from jax.sharding import Mesh
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    >>> abstract = abstract_accumulator({"w": jnp.ones(3)}, mesh, "batch")
    >>> zeros_program(abstract)().grads["w"].shape  # a row per device
    (1, 3)
  """
  return jax.jit(
    lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract),
    out_shardings=jax.tree.map(lambda a: a.sharding, abstract),
  )


def _device_gradient(
  loss_fn,
  num_devices,
  axis_name,
  seed,
  local,
  params,
  model_state,
  batch,
  weights,
  total_weight,
  counters,
  passes="sequential",
):
  """One device's share of the step's mean loss, its gradient and the new model state.

  With the local split the gradient is the pair of the two halves' (the
  first and the second block of rows) shares, taken as ``passes`` says
  (:data:`simigrad_jax.ingraph.half_batch.PASSES`), each half with its own
  random key; the new model state is the mean of the two halves'.
  """
  rng = jax.random.key(seed)
  for value in (counters[0], counters[1], lax.axis_index(axis_name)):
    rng = jax.random.fold_in(rng, value)
  scale = num_devices / total_weight

  def weighted_loss(p, rows, row_weights, key):
    losses, new_state = loss_fn(p, model_state, rows, row_weights, key)
    return jnp.sum(losses.astype(jnp.float32) * row_weights) * scale, new_state

  if not local:
    (loss, new_state), grads = jax.value_and_grad(weighted_loss, has_aux=True)(
      params, batch, weights, rng
    )
    return loss, grads, lax.pmean(new_state, axis_name)
  first, second = half_batch.split_in_two((batch, weights))
  pass_a, pass_b = half_batch.halves_passes(passes)(
    weighted_loss,
    True,
    params,
    (*first, jax.random.fold_in(rng, 0)),
    (*second, jax.random.fold_in(rng, 1)),
  )
  ((loss_a, state_a), grads_a), ((loss_b, state_b), grads_b) = pass_a, pass_b
  new_state = jax.tree.map(lambda a, b: ((a + b) / 2).astype(jnp.result_type(a)), state_a, state_b)
  return loss_a + loss_b, (grads_a, grads_b), lax.pmean(new_state, axis_name)


def _optimizer_inputs(optimizer, local, grads, scalars, param_specs, outputs):
  """The gradient and keyword arguments the optimizer's update takes.

  ``outputs``: ``record_outputs=`` or ``replay_outputs=`` (a
  :class:`~simigrad_jax.ingraph.transform.RecordedOutputs`), passed on with
  the others.

  Device split: the parameters' specs, for the transform's reduction to
  reduce each device's own shards over the model axes (both given where the
  optimizer's update takes extra keyword arguments to pass them on; else
  the leaves' types say, and the transform computes its outputs again).

  Local split: the mean is the sum of the two halves' shares, and each half
  is normalised by its own share of the step's real examples (a half with
  none gets a zero gradient, which the transform reports as not measured).
  """
  if not local:
    if not isinstance(optimizer, optax.GradientTransformationExtraArgs):
      return grads, {}
    return grads, ({} if param_specs is None else {"param_specs": param_specs}) | outputs
  first, second = grads
  share = scalars.first_half_weight / scalars.total_weight

  def rescale(tree, fraction):
    factor = jnp.where(fraction > 0, 1 / jnp.where(fraction > 0, fraction, 1), 0)
    return jax.tree.map(lambda g: (g.astype(jnp.float32) * factor).astype(g.dtype), tree)

  mean = jax.tree.map(lambda a, b: a + b, first, second)
  halves = HalfGrads(rescale(first, share), rescale(second, 1 - share), share)
  return mean, {"half_grads": halves, **outputs}


def _keep_if_nonfinite(finite: jax.Array, new: Any, old: Any) -> Any:
  """``new`` where the step wrote only finite numbers, else ``old``: the model's state
  (BatchNorm's statistics), which the gradient pass has made by the time the guard decides.

  One ``lax.cond`` chooses the whole tree, not a ``where`` per leaf. The
  parameters and the optimizer's state are written by :func:`_write_if_finite`.
  """
  if not jax.tree.leaves(new):
    return new
  return lax.cond(finite, lambda: new, lambda: old)


def _with_new_similarity(old: Any, new: Any) -> Any:
  """``old`` with the :class:`SimilarityState` of ``new`` (a skipped step records its event)."""
  is_similarity = lambda node: isinstance(node, SimilarityState)
  return jax.tree.map(lambda o, n: n if is_similarity(n) else o, old, new, is_leaf=is_similarity)


def _write_if_finite(
  finite: jax.Array,
  params: Any,
  opt_state: Any,
  given_state: Any,
  new_similarity: Any,
  optimizer_update: Callable[[Any, Any], tuple[Any, Any]],
) -> tuple[Any, Any]:
  """The new parameters and optimizer state where ``finite``, else the old ones, bit for bit.

  The guard's second pass. The first trace of ``optimizer_update`` only
  decided ``finite`` from the update and the new parameters (reductions
  that XLA fuses with the update's arithmetic, so nothing of it is written
  out); here the update is traced again inside a
  ``lax.cond`` whose kept branch returns the old values. The old state is
  donated and its buffers are the step's outputs, so the written branch
  computes the new moments and parameters in place, as a plain step does:
  neither the new state nor the update is held beside the old one, and
  nothing is copied. The two traces compute the same numbers from the same
  inputs (an ``optimization_barrier`` keeps XLA from sharing them: the first
  trace would then be written out for the second); the transforms in the
  update return their first outputs (``replay_outputs``, a
  :class:`~simigrad_jax.ingraph.transform.RecordedOutputs`), so the
  reduction over the devices and the measurement run once.

  Args:
    finite: whether the step writes (a bool scalar).
    params: the parameters.
    opt_state: the optimizer's state before the step (kept on a skipped step).
    given_state: ``opt_state`` as the update is given it (the step's
      learning-rate factor and batch size written in).
    new_similarity: the optimizer's new state of the first trace; its
      :class:`SimilarityState` is kept on a skipped step too.
    optimizer_update: ``(params, opt_state) -> (updates, new_opt_state)``,
      traced once already, its transforms' outputs recorded.

  Returns:
    ``(params, opt_state)``: the new ones, or the old ones with the new
    :class:`SimilarityState`.
  """
  params, opt_state, given_state, finite = lax.optimization_barrier(
    (params, opt_state, given_state, finite)
  )

  def write():
    updates, new_opt_state = optimizer_update(params, given_state)
    return optax.apply_updates(params, updates), new_opt_state

  def keep():
    return params, _with_new_similarity(opt_state, new_similarity)

  return lax.cond(finite, write, keep)


def _finite_update_and_params(updates: Any, new_params: Any) -> tuple[jax.Array, jax.Array]:
  """Whether every entry of the update is finite, and whether every new parameter is (bools).

  Each leaf's two answers come from one variadic reduction over its last
  axis, which reads the update and the new value where they are made: on
  XLA:CPU a reduction of one operand to a scalar goes to a library kernel
  (YNNPACK) that fuses nothing, so the ``isfinite`` it reduces would first
  be written out as an array of its own, one for the update and one for the
  parameters. A leaf of fewer than two axes (a bias) is reduced whole.
  A leaf whose update is None (optax's frozen parameters) keeps its value
  and counts as finite.
  """
  update_answers, param_answers = [], []

  def check(update, new):
    if update is None or not jnp.issubdtype(jnp.result_type(new), jnp.inexact):
      return
    not_finite = (~jnp.isfinite(update), ~jnp.isfinite(new))
    if jnp.ndim(new) >= 2:
      no = jnp.zeros((), jnp.bool_)
      not_finite = lax.reduce(not_finite, (no, no), _either, (jnp.ndim(new) - 1,))
    update_answers.append(jnp.any(not_finite[0]))
    param_answers.append(jnp.any(not_finite[1]))

  jax.tree.map(check, updates, new_params, is_leaf=lambda x: x is None)
  if not update_answers:
    return jnp.ones([], jnp.bool_), jnp.ones([], jnp.bool_)
  return ~jnp.any(jnp.stack(update_answers)), ~jnp.any(jnp.stack(param_answers))


def _either(x: tuple, y: tuple) -> tuple:
  return tuple(p | q for p, q in zip(x, y, strict=True))


def _nonfinite_cause(
  grads_finite: jax.Array, loss: jax.Array, updates: Any, new_params: Any
) -> jax.Array:
  """The step's :attr:`StepMeasurements.nonfinite_cause`: 0 when all it writes is finite.

  The parameters going in are finite (the Trainer checks the initial ones,
  and a step writes only finite ones), so new parameters that are not finite
  come from an update that is not (cause ``"update"``) or from an overflow of
  their dtype (``"parameters"``); :func:`_finite_update_and_params` answers
  both in one reduction per leaf.
  """
  code = {name: jnp.int32(i + 1) for i, name in enumerate(NONFINITE_CAUSES)}
  update_finite, params_finite = _finite_update_and_params(updates, new_params)
  not_written = jnp.where(update_finite, code["parameters"], code["update"])
  written = jnp.where(params_finite, jnp.zeros([], jnp.int32), not_written)
  with_loss = jnp.where(jnp.isfinite(loss), written, code["loss"])
  return jnp.where(grads_finite, with_loss, code["gradient"]).astype(jnp.int32)


def _update_in_step(
  optimizer, local, params, opt_state, grads, scalars, param_specs, measure=True, **outputs
):
  """``optimizer.update`` inside the step mapped over the data axis: ``(updates, new_state)``.

  ``measure=False``: a plain step's gradient, handed to the transform with ``measure=False``.
  ``outputs``: as :func:`_optimizer_inputs` takes them.
  """
  grads, extra = _optimizer_inputs(optimizer, local, grads, scalars, param_specs, outputs)
  if not measure:
    extra = {**extra, "measure": False}
  expecting = "half_grads" in extra
  try:
    with transform.expecting_half_grads() if expecting else contextlib.nullcontext():
      return optimizer.update(grads, opt_state, params, **extra)
  except TypeError as error:
    if not expecting:
      raise
    raise HalvesContractError(
      f"with halves='local' the optimizer's update must take half_grads=... and pass it on to "
      f"simigrad_jax.transform (optax.chain does): {error}"
    ) from error


def _remakes_the_mean(local: bool, measure: bool, passes: str) -> bool:
  """Whether the guard's second trace makes a mean that involves no reduction again (from the
  gradients it is given) rather than hold the first trace's.

  Made again where the gradients are one array per leaf or the two halves
  of separate passes: they are held for the statistics anyway, and the mean,
  made inside the update's pass, is never written out. Held where the halves
  come from one pass over both (``"stacked"``, ``"signed"``): holding them
  for the second trace costs more temporary memory than the mean does
  (docs/results.md, "Measuring every k-th step", has the counts).
  """
  return not (local and measure) or passes == "sequential"


def _update(
  optimizer,
  local,
  params,
  opt_state,
  grads,
  mean_loss,
  scalars,
  param_specs,
  stacked=None,
  measure=True,
  passes="sequential",
):
  """The optimizer step from per-device gradients: new params and state, and the measurements.

  ``mean_loss`` is the step's loss, averaged over the devices. ``stacked``:
  None inside the step mapped over the data axis; else the
  :class:`StackedGrads` that says ``grads`` are every device's gradient,
  stacked, for the update on global arrays. ``passes``: how a local split's
  halves were taken, which decides how the guard's second trace gets the
  mean (:func:`_remakes_the_mean`).
  """
  with_lr = optax.tree_utils.tree_set(opt_state, lr_factor=scalars.lr_factor)
  with_lr = batch_coupling.with_batch_size(with_lr, scalars.total_weight)  # Adam's b2, weight decay
  if stacked is None:

    def optimizer_update(params, state, **outputs):
      return _update_in_step(
        optimizer, local, params, state, grads, scalars, param_specs, measure, **outputs
      )
  else:

    def optimizer_update(params, state, **outputs):
      return update_stacked(
        optimizer, grads, state, params, stacked, param_specs, "the Trainer", **outputs
      )

  recorded = transform.RecordedOutputs(_remakes_the_mean(local, measure, passes))
  updates, new_opt_state = optimizer_update(params, with_lr, record_outputs=recorded)
  similarity_state = optax.tree_utils.tree_get(new_opt_state, SimilarityState.__name__)
  cause = _nonfinite_cause(
    similarity_state.grads_finite, mean_loss, updates, optax.apply_updates(params, updates)
  )
  finite = cause == 0

  def update_again(params, state):
    written = optimizer_update(params, state, replay_outputs=recorded)
    recorded.check_all_replayed()
    return written

  new_params, written_state = _write_if_finite(
    finite, params, opt_state, with_lr, new_opt_state, update_again
  )
  return (
    new_params,
    written_state,
    finite,
    StepMeasurements(loss=mean_loss, similarity_state=similarity_state, nonfinite_cause=cause),
  )


def make_fused_step(
  loss_fn: PerExampleLossFn,
  optimizer: optax.GradientTransformation,
  mesh: Mesh,
  axis_name: str,
  seed: int = 0,
  halves: str = "device",
  param_specs: Any = None,
  passes: str = "sequential",
  measure: bool = True,
) -> Callable[..., tuple[Any, Any, Any, StepMeasurements]]:
  """Returns ``step(params, opt_state, model_state, batch, weights, scalars, counters)``.

  One optimizer step over one micro-batch per device, in one program.

  Args:
    loss_fn: ``loss_fn(params, model_state, batch, weights, rng) ->
      (per_example_losses, new_model_state)`` on one device's rows; models with
      BatchNorm should use ``weights`` as the normalisation mask.
    optimizer: an optax optimizer whose chain contains
      :func:`simigrad_jax.transform` over ``axis_name`` (it does the averaging)
      and :func:`simigrad_jax.scale_by_lr_factor`.
    mesh: the mesh; its axis ``axis_name`` holds the data-parallel devices.
    axis_name: the mesh axis name.
    seed: the run's seed; the key handed to ``loss_fn`` is derived from it,
      the optimizer step, the micro-step and the device, so a resumed run draws
      the same numbers.
    halves: ``"device"`` (the even devices against the odd ones) or
      ``"local"`` (each device's first block of rows against its second; the
      rows per device must be even).
    param_specs: the parameters' ``PartitionSpec``s on ``mesh`` (a pytree
      like them; None: replicated). Each device reduces its own shards over
      the model axes; with the device split a parameter in blocks over the
      data axis (FSDP, :mod:`simigrad_jax.reductions.data_blocks`) enters as
      its block, is gathered for the gradient, and the optimizer then runs
      on global arrays, its mean gradient and state in the same blocks.
    passes: with ``halves="local"``, how each device takes its two halves'
      gradients: a name in :data:`simigrad_jax.ingraph.half_batch.PASSES`
      (the same numbers to float rounding; docs/own_step.md says which is
      fastest where).
    measure: False: a step that does not measure (:func:`make_plain_step`,
      with the device split's one gradient pass per device).

  Returns:
    A function (to be jitted) from replicated ``params``, ``opt_state`` and
    ``model_state``, a batch and weights sharded on their leading axis, the
    replicated :class:`StepScalars` and ``counters`` (int32
    ``[optimizer_step, micro_step]``), to the new params, optimizer state and
    model state and the step's :class:`StepMeasurements` (identical on every
    device).
  """
  num_devices = mesh.shape[axis_name]
  local = _check_halves(halves)
  gradient = functools.partial(
    _device_gradient, loss_fn, num_devices, axis_name, seed, local, passes=passes
  )

  def per_device(params, opt_state, model_state, batch, weights, scalars, counters):
    loss, grads, new_model_state = gradient(
      params, model_state, batch, weights, scalars.total_weight, counters
    )
    params, opt_state, finite, measurements = _update(
      optimizer,
      local,
      params,
      opt_state,
      grads,
      lax.pmean(loss, axis_name),
      scalars,
      param_specs,
      measure=measure,
      passes=passes,
    )
    model_state = _keep_if_nonfinite(finite, new_model_state, model_state)
    return params, opt_state, model_state, measurements

  def step(params, opt_state, model_state, batch, weights, scalars, counters):
    blocks = data_blocks.DataBlocks(params, param_specs, axis_name)
    if blocks.any and not measure:
      raise ValueError(
        "a step that does not measure (measure_every > 1) runs with every parameter whole "
        f"over the data axis {axis_name!r}; parameters in blocks over it (FSDP) measure every "
        "step: measure_every=1"
      )
    if local or not blocks.any:
      return manual_over(
        mesh,
        axis_name,
        per_device,
        in_specs=(P(), P(), P(), P(axis_name), P(axis_name), P(), P()),
        out_specs=(P(), P(), P(), P()),
      )(params, opt_state, model_state, batch, weights, scalars, counters)
    # FSDP: the gradient per device, then the optimizer on the parameters' blocks.
    stacked, losses, new_model_state = manual_over(
      mesh,
      axis_name,
      lambda p, *rest: _stacked(gradient(blocks.gather(p), *rest)),
      in_specs=(blocks.entry, P(), P(axis_name), P(axis_name), P(), P()),
      out_specs=(P(axis_name), P(axis_name), P()),
    )(params, model_state, batch, weights, scalars.total_weight, counters)
    params, opt_state, finite, measurements = _update_blocks(
      optimizer, blocks, mesh, params, opt_state, stacked, losses, scalars
    )
    model_state = _keep_if_nonfinite(finite, new_model_state, model_state)
    return params, opt_state, model_state, measurements

  return step


def make_plain_step(
  loss_fn: PerExampleLossFn,
  optimizer: optax.GradientTransformation,
  mesh: Mesh,
  axis_name: str,
  seed: int = 0,
  param_specs: Any = None,
) -> Callable[..., tuple[Any, Any, Any, StepMeasurements]]:
  """Returns the fused step of a step that does not measure: :func:`make_fused_step`'s
  ``step(params, opt_state, model_state, batch, weights, scalars, counters)``.

  The plain step between two measuring ones (``measure_every``): each device
  takes one gradient over all its rows, in one pass, whichever split the
  measuring steps use (the rows lie as theirs do: the same batch and weights),
  and the optimizer's transform, given ``measure=False``, averages it over
  the devices and keeps the last measuring step's similarity in its state
  (``measured`` False). The loss, the update, the learning-rate factor and a
  non-finite gradient's skip are the measuring step's.

  Args:
    loss_fn: as for :func:`make_fused_step`.
    optimizer: as for :func:`make_fused_step`.
    mesh: the mesh; its axis ``axis_name`` holds the data-parallel devices.
    axis_name: the mesh axis name.
    seed: as for :func:`make_fused_step` (a plain step's keys are those of
      the device split's pass).
    param_specs: the parameters' ``PartitionSpec``s over the model axes;
      none in blocks over the data axis (a run with FSDP blocks measures
      every step).

  Returns:
    A function (to be jitted) with :func:`make_fused_step`'s arguments and
    results; the measurements' ``SimilarityState`` has ``measured`` False.

  Raises:
    ValueError: when traced with parameters in blocks over the data axis.
  """
  return make_fused_step(
    loss_fn, optimizer, mesh, axis_name, seed, "device", param_specs, measure=False
  )


def _stacked(device_gradient: tuple[jax.Array, Any, Any]) -> tuple[Any, jax.Array, Any]:
  """A device's loss and gradient with a leading data dimension (for out_specs P(axis))."""
  loss, grads, new_model_state = device_gradient
  return jax.tree.map(lambda g: g[None], grads), loss[None], new_model_state


def _update_blocks(optimizer, blocks, mesh, params, opt_state, stacked, losses, scalars):
  """:func:`_update` on global arrays, the transform reducing the devices' stacked gradients
  into the parameters' layout (FSDP blocks stay blocks)."""
  return _update(
    optimizer,
    False,
    params,
    opt_state,
    stacked,
    jnp.mean(losses),
    scalars,
    blocks.specs,
    StackedGrads(blocks.axis_name, mesh),
  )


def make_micro_step(
  loss_fn: PerExampleLossFn,
  mesh: Mesh,
  axis_name: str,
  seed: int = 0,
  halves: str = "device",
  param_specs: Any = None,
  passes: str = "sequential",
) -> Callable[..., tuple[Accumulator, Any]]:
  """Returns ``micro_step(params, model_state, acc, batch, weights, scalars, counters)``.

  Args:
    loss_fn: as for :func:`make_fused_step`.
    mesh: the mesh; its axis ``axis_name`` holds the data-parallel devices.
    axis_name: the mesh axis name.
    seed: as for :func:`make_fused_step`.
    halves: as for :func:`make_fused_step`; the accumulator must be made with
      the same value.
    param_specs: as for :func:`make_fused_step` (a parameter in blocks
      enters as its block and is gathered for the gradient).
    passes: as for :func:`make_fused_step`.

  Returns:
    A function (to be jitted) from replicated ``params`` and ``model_state``,
    the device-sharded :class:`Accumulator`, a batch and weights sharded on
    their leading axis, the replicated :class:`StepScalars` and ``counters``
    (int32 ``[optimizer_step, micro_step]``), to the new accumulator and the
    new model state (averaged over devices).
  """
  num_devices = mesh.shape[axis_name]
  local = _check_halves(halves)

  def per_device(params, model_state, acc, batch, weights, scalars, counters, blocks):
    loss, grads, new_state = _device_gradient(
      loss_fn,
      num_devices,
      axis_name,
      seed,
      local,
      blocks.gather(params),
      model_state,
      batch,
      weights,
      scalars.total_weight,
      counters,
      passes,
    )
    grads = jax.tree.map(lambda a, g: a + g[None].astype(a.dtype), acc.grads, grads)
    return Accumulator(grads=grads, loss=acc.loss + loss[None]), new_state

  def micro_step(params, model_state, acc, batch, weights, scalars, counters):
    blocks = data_blocks.DataBlocks(params, None if local else param_specs, axis_name)
    return manual_over(
      mesh,
      axis_name,
      functools.partial(per_device, blocks=blocks),
      in_specs=(blocks.entry, P(), P(axis_name), P(axis_name), P(axis_name), P(), P()),
      out_specs=(P(axis_name), P()),
    )(params, model_state, acc, batch, weights, scalars, counters)

  return micro_step


def make_apply_step(
  optimizer: optax.GradientTransformation,
  mesh: Mesh,
  axis_name: str,
  halves: str = "device",
  param_specs: Any = None,
) -> Callable[..., tuple[Any, Any, Accumulator, Any, StepMeasurements]]:
  """Returns ``apply_step(params, opt_state, acc, model_state_before, model_state, scalars)``.

  Args:
    optimizer: an optax optimizer whose chain contains
      :func:`simigrad_jax.transform` over ``axis_name`` (it does the averaging)
      and :func:`simigrad_jax.scale_by_lr_factor`.
    mesh: the mesh; its axis ``axis_name`` holds the data-parallel devices.
    axis_name: the mesh axis name.
    halves: as for :func:`make_fused_step`.
    param_specs: as for :func:`make_fused_step`.

  Returns:
    A function (to be jitted) returning the new replicated params and
    optimizer state, the cleared accumulator, the model state (the one from
    the micro-steps, or ``model_state_before`` when the step was skipped as
    not finite) and the step's :class:`StepMeasurements` (identical on every
    device).
  """
  local = _check_halves(halves)

  def per_device(params, opt_state, acc, model_state_before, model_state, scalars):
    grads = jax.tree.map(lambda g: g[0], acc.grads)
    params, opt_state, finite, measurements = _update(
      optimizer,
      local,
      params,
      opt_state,
      grads,
      lax.pmean(acc.loss[0], axis_name),
      scalars,
      param_specs,
    )
    cleared = jax.tree.map(jnp.zeros_like, acc)
    model_state = _keep_if_nonfinite(finite, model_state, model_state_before)
    return params, opt_state, cleared, model_state, measurements

  def apply_step(params, opt_state, acc, model_state_before, model_state, scalars):
    blocks = data_blocks.DataBlocks(params, param_specs, axis_name)
    if local or not blocks.any:
      return manual_over(
        mesh,
        axis_name,
        per_device,
        in_specs=(P(), P(), P(axis_name), P(), P(), P()),
        out_specs=(P(), P(), P(axis_name), P(), P()),
      )(params, opt_state, acc, model_state_before, model_state, scalars)
    # FSDP: the accumulator holds each device's gradient, stacked; the update is on blocks.
    params, opt_state, finite, measurements = _update_blocks(
      optimizer, blocks, mesh, params, opt_state, acc.grads, acc.loss, scalars
    )
    cleared = jax.tree.map(jnp.zeros_like, acc)
    model_state = _keep_if_nonfinite(finite, model_state, model_state_before)
    return params, opt_state, cleared, model_state, measurements

  return apply_step
