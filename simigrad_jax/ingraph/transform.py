"""In-graph: the SimiGrad gradient transformation (mean gradient + half similarity)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import AxisType

from simigrad_jax.errors import SimiGradError
from simigrad_jax.reductions import data_blocks
from simigrad_jax.reductions import group_reduction
from simigrad_jax.reductions import half_statistics
from simigrad_jax.reductions import halves_reduction

NonFinitePolicy = Literal["zero", "propagate"]
_NONFINITE_POLICIES = ("zero", "propagate")


class SimilarityState(NamedTuple):
  """State of :func:`transform`: what the last step measured (identical on all devices).

  No field is ever NaN or infinite; ``measured`` and ``grads_finite`` say whether
  the numbers are a measurement. After a step that does not measure
  (``update(..., measure=False)``) the similarity and the half norms are the
  last measuring step's, and ``measured`` is False.
  """

  similarity: jax.Array  # float32 cos(g_A, g_B) of the last step; 0 where not measured.
  norm_a: jax.Array  # float32 |g_A|, the first half's mean-gradient norm; 0 if non-finite.
  norm_b: jax.Array  # float32 |g_B|, the second half's mean-gradient norm; 0 if non-finite.
  norm_mean: (
    jax.Array
  )  # float32 |M|, M the mean gradient (before rounding to a bf16 dtype); 0 if non-finite.
  measured: jax.Array  # bool: gradients finite and both half norms positive.
  grads_finite: jax.Array  # bool: every entry of the reduced gradients was finite.
  nonfinite_count: jax.Array  # int32: steps so far whose gradients were not finite.


class HalfGrads(NamedTuple):
  """The two gradients of one device's batch split into halves (see :func:`value_and_half_grads`).

  Averaged over the devices, ``first`` and ``second`` are the mean gradients
  ``g_A`` and ``g_B`` of the two halves. The gradient passed to the transform
  with them must average to ``M = share * g_A + (1 - share) * g_B``, the mean
  gradient over the examples of both halves.
  """

  first: Any  # gradient pytree of the first half (the even-numbered examples of the batch).
  second: Any  # gradient pytree of the second half (the odd-numbered examples).
  # The first half's fraction of the examples, a scalar in [0, 1] (may be traced);
  # None: the halves are equal (0.5).
  share: Any = None


class StackedGrads(NamedTuple):
  """Says that the gradient handed to :func:`transform` is every device's own, stacked.

  For a plain ``jax.jit`` step that takes each device's gradient inside a
  ``jax.shard_map`` manual over the mesh axis ``axis_name`` and runs the
  optimizer on global arrays outside it (:func:`simigrad_jax.device_halves_step`
  does, and so do the Trainer's steps with parameters in blocks over the data
  axis): every leaf of the gradient has a leading dimension of the axis's
  size, sharded over it, device ``i``'s gradient at index ``i`` (the
  ``out_specs=P(axis_name)`` of ``g[None]``). The step passes it in the call,
  ``optimizer.update(stacked, state, params, stacked_grads=StackedGrads("data"))``,
  and the transform reduces the devices' gradients (even devices against odd
  ones) into the parameters' layout.
  """

  axis_name: str  # the mesh axis the gradients are stacked over: the transform's axis name.
  # The mesh that axis belongs to; None: the one set with jax.set_mesh.
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None


class HalvesContractError(SimiGradError, ValueError):
  """The optimizer does not pass ``half_grads`` on to :func:`transform`."""


# Trace time only: True while a caller that passes half_grads runs the optimizer's update.
# It only refuses (a transform reached without half_grads raises); it never changes what the
# transform computes, which depends on its arguments and its state alone.
_EXPECTING_HALF_GRADS = contextvars.ContextVar("simigrad_jax_expecting_half_grads", default=False)


@contextlib.contextmanager
def expecting_half_grads() -> Iterator[None]:
  """While tracing the block, a :func:`transform` reached without ``half_grads`` raises.

  A wrapper around the transform that takes extra keyword arguments but does
  not pass them on would make the transform measure the device split where
  the caller asked for the local one; a caller that passes ``half_grads`` to
  ``optimizer.update`` runs it inside this block to refuse that. The block
  only refuses: a transform that runs inside it computes what it computes
  outside it.
  """
  token = _EXPECTING_HALF_GRADS.set(True)
  try:
    yield
  finally:
    _EXPECTING_HALF_GRADS.reset(token)


class RecordedOutputs:
  """What every :func:`transform` in one optimizer update returned, in call order (trace time).

  For a caller that traces the same optimizer update twice in one program:
  first to decide (the Trainer's non-finite guard checks the update before
  anything is written), then inside a ``lax.cond`` that writes the new state
  in place of the donated old one. The first trace's update is given
  ``record_outputs=recorded``, and each transform it reaches records its
  output; the second is given ``replay_outputs=recorded``, and each transform
  returns what it recorded instead of reducing over the devices and
  measuring the halves a second time. ``optax.chain`` passes both keywords
  on; an update that drops them leaves the transforms to compute their
  outputs again, the same numbers.

  Args:
    remake_unreduced_means: whether a mean that involves no reduction (one
      device, or a plain ``jax.jit`` step) is made again from what the second
      trace gives (True), so that nothing of the first trace's mean is held
      for the second, or handed back as recorded (False: where what the
      second trace would make it from costs more to hold, such as two halves
      sliced from one array).

  Example:

    >>> import jax.numpy as jnp, optax, simigrad_jax
    >>> from simigrad_jax.ingraph import transform
    >>> opt = optax.chain(simigrad_jax.transform(), optax.sgd(0.1))
    >>> params = {"w": jnp.ones(3)}
    >>> half = simigrad_jax.HalfGrads({"w": jnp.ones(3)}, {"w": jnp.ones(3)})
    >>> recorded = transform.RecordedOutputs()
    >>> first = opt.update(params, opt.init(params), params, half_grads=half,
    ...                    record_outputs=recorded)
    >>> again = opt.update(params, opt.init(params), params, half_grads=half,
    ...                    replay_outputs=recorded)
    >>> recorded.check_all_replayed()
    >>> bool(jnp.all(first[0]["w"] == again[0]["w"]))
    True
  """

  def __init__(self, remake_unreduced_means: bool = True) -> None:
    self._remake = remake_unreduced_means
    self._calls: list[tuple[optax.Updates, SimilarityState, Callable | None]] = []
    self._replayed = 0

  def record(
    self,
    mean: optax.Updates,
    state: SimilarityState,
    remake: Callable[[optax.Updates], optax.Updates] | None,
  ) -> None:
    """One transform's output; ``remake(given)`` makes its mean again from what a second trace
    gives it, where the mean involves no reduction (None: the recorded mean is the one)."""
    self._calls.append((mean, state, remake))

  def replay(self, given: optax.Updates) -> tuple[optax.Updates, SimilarityState]:
    """The next recorded output, for a transform given ``given`` this time.

    A mean that involves no reduction over the devices (one device, or a
    plain ``jax.jit`` step) is made again from ``given`` unless told
    otherwise, so that the second trace computes it where it uses it rather
    than holding the first's; any other mean, and the state, is the recorded
    one.
    """
    if self._replayed >= len(self._calls):
      self._refuse(self._replayed + 1)
    mean, state, remake = self._calls[self._replayed]
    self._replayed += 1
    return (mean if remake is None or not self._remake else remake(given)), state

  def check_all_replayed(self) -> None:
    """Raises where the second trace reached fewer transforms than the first."""
    if self._replayed != len(self._calls):
      self._refuse(self._replayed)

  def _refuse(self, reached: int) -> None:
    raise RuntimeError(
      f"the optimizer's second update reached simigrad_jax.transform {reached} time(s), its "
      f"first {len(self._calls)}: an update must reach the same transforms each time it is "
      "traced"
    )


class AxisNameError(SimiGradError, ValueError):
  """:func:`transform`'s axis name is not the axis its step is mapped over."""

  def __init__(self, message: str, axis_name: str | None, step_axis: str) -> None:
    super().__init__(message)
    self.axis_name = axis_name  # the transform's axis name (None: none given).
    self.step_axis = step_axis  # the axis the step is mapped over.


# Trace time only: the axis a caller maps its step over, which the transform must name.
# It only refuses (a transform named otherwise raises); it never changes what the transform
# computes, which depends on its arguments and its state alone.
_STEP_AXIS = contextvars.ContextVar[str | None]("simigrad_jax_step_axis", default=None)


@contextlib.contextmanager
def step_mapped_over(axis_name: str) -> Iterator[None]:
  """While tracing the block, a :func:`transform` not named ``axis_name`` raises :class:`AxisNameError`.

  Without the axis name the transform never averages the devices' gradients
  (with ``half_grads`` it measures each device's own rows): the replicas would
  drift apart without an error. A caller that maps its step over an axis
  traces it inside this block to refuse that. The block only refuses: a
  transform named ``axis_name`` computes inside it what it computes outside.
  """
  token = _STEP_AXIS.set(axis_name)
  try:
    yield
  finally:
    _STEP_AXIS.reset(token)


def _check_step_axis(axis_name: str | None) -> None:
  step_axis = _STEP_AXIS.get()
  if step_axis is not None and axis_name != step_axis:
    raise AxisNameError(
      f"simigrad_jax.transform(axis_name={axis_name!r}) runs in a step mapped over the axis "
      f"{step_axis!r}: without that name the devices' gradients are never averaged; use "
      f"simigrad_jax.transform(axis_name={step_axis!r})",
      axis_name,
      step_axis,
    )


def _check_not_already_reduced(leaves: list[jax.Array], axis_name: str) -> None:
  """Raises if shard_map's type system says a gradient is already summed over the axis.

  Inside ``jax.shard_map`` with ``check_vma=True``, ``jax.grad`` of replicated
  (``P()``) parameters returns a gradient that is already summed over devices;
  both halves are then identical and the similarity reads exactly 1. The types
  record this (the gradient is not "varying" along the axis), so the mistake is
  caught at trace time. Under ``jax.pmap`` and ``check_vma=False`` nothing is
  recorded and nothing is checked.
  """
  if not halves_reduction.tracks_varying(axis_name):
    return
  for leaf in leaves:
    leaf_type = getattr(jax.typeof(leaf), "manual_axis_type", None)
    if leaf_type is not None and axis_name not in leaf_type.varying:
      raise ValueError(
        f"simigrad_jax.transform received a gradient that is not varying over "
        f"axis {axis_name!r} ({jax.typeof(leaf).str_short()}): under "
        "jax.shard_map with check_vma=True, jax.grad of parameters passed "
        "replicated (P()) returns the gradient ALREADY summed over devices, so "
        "both halves would be identical. Take the gradient with respect to "
        f"jax.lax.pcast(params, {axis_name!r}, to='varying'), or use "
        "check_vma=False."
      )


def _axis_is_bound(axis_name: str) -> bool:
  """Whether a ``jax.pmap``, ``jax.shard_map`` or ``jax.vmap`` binds ``axis_name`` here."""
  try:
    lax.axis_size(axis_name)
  except NameError:
    return False
  return True


def _one_untracked_device(axis_name: str) -> bool:
  """Whether the axis has one device and no type tracks what varies over it (pmap, or
  ``check_vma=False``): its halves are then the step's own, and the buckets of a reduction
  would only copy both gradients. (With ``check_vma=True`` only a collective marks the
  result replicated, so the reduction stays.)"""
  return lax.axis_size(axis_name) == 1 and not halves_reduction.tracks_varying(axis_name)


def _bound_axis_names() -> tuple[str, ...]:
  """The axis names the enclosing ``jax.pmap``, ``jax.shard_map`` or ``jax.vmap`` bind here."""
  try:
    from jax._src import core as jax_core  # pylint: disable=import-outside-toplevel

    return tuple(str(name) for name in jax_core.unsafe_get_axis_names())
  except (ImportError, AttributeError):  # a JAX without it: the message names no axis
    return ()


def _check_axis_is_bound(axis_name: str) -> None:
  """Raises, naming the fix, when no ``jax.pmap``, ``jax.shard_map`` or ``jax.vmap`` binds it."""
  try:
    lax.axis_size(axis_name)
  except NameError as error:
    bound = _bound_axis_names()
    if bound:
      raise AxisNameError(
        f"simigrad_jax.transform(axis_name={axis_name!r}) runs in a step mapped over the "
        f"{'axis' if len(bound) == 1 else 'axes'} {', '.join(map(repr, bound))} (jax.pmap, "
        f"jax.shard_map or jax.vmap), none named {axis_name!r}: name the data-parallel axis "
        f"the step is mapped over, e.g. simigrad_jax.transform(axis_name={bound[-1]!r}), or "
        f"map the step with axis_name={axis_name!r}",
        axis_name,
        bound[-1],
      ) from error
    raise ValueError(
      f"simigrad_jax.transform({axis_name!r}) runs outside a step mapped over an axis "
      f"{axis_name!r} (JAX: {error}). The axis name is for a step under jax.pmap(..., "
      f"axis_name={axis_name!r}) or jax.shard_map over a mesh axis {axis_name!r}. In a "
      "plain jax.jit step over arrays sharded on a mesh, use simigrad_jax.transform() "
      "without an axis name and pass half_grads=... from "
      "simigrad_jax.value_and_half_grads; or, where the step hands the optimizer each "
      f"device's gradient stacked along a leading {axis_name!r} dimension, pass "
      f"stacked_grads=StackedGrads({axis_name!r}) to its update (an optimizer wrapper that "
      "does not pass extra keyword arguments on loses it; optax.chain passes them)"
    ) from error


def _check_stacked(
  updates: Any, stacked_grads: Any, axis_name: str | None, half_grads: Any
) -> jax.sharding.Mesh | jax.sharding.AbstractMesh:
  """Refuses ``stacked_grads`` that do not describe ``updates``; returns the mesh."""
  if not isinstance(stacked_grads, StackedGrads):
    raise ValueError(
      "stacked_grads must be a simigrad_jax.ingraph.transform.StackedGrads(axis_name, mesh), "
      f"got {type(stacked_grads).__name__}"
    )
  stacked_axis = stacked_grads.axis_name
  if axis_name != stacked_axis:
    raise AxisNameError(
      f"simigrad_jax.transform(axis_name={axis_name!r}) was handed the devices' gradients "
      f"stacked over the mesh axis {stacked_axis!r} (stacked_grads=...): it reduces them "
      f"over its own axis; use simigrad_jax.transform(axis_name={stacked_axis!r})",
      axis_name,
      stacked_axis,
    )
  if half_grads is not None:
    raise ValueError(
      "simigrad_jax.transform received half_grads=... in a step whose halves are the "
      "data axis's even and odd devices (stacked_grads=..., as in "
      "simigrad_jax.device_halves_step): leave half_grads out there"
    )
  if _axis_is_bound(stacked_axis):
    raise ValueError(
      f"simigrad_jax.transform({stacked_axis!r}) was given stacked_grads=... inside a step "
      f"mapped over the axis {stacked_axis!r} (jax.pmap or jax.shard_map): stacked_grads "
      "says that the optimizer runs on global arrays outside the step's shard_map, on every "
      "device's gradient stacked; inside the mapped step pass each device's own gradient "
      "without it"
    )
  mesh = jax.sharding.get_abstract_mesh() if stacked_grads.mesh is None else stacked_grads.mesh
  if mesh.empty or stacked_axis not in mesh.axis_names:
    found = "no mesh" if mesh.empty else f"a mesh with the axes {tuple(mesh.axis_names)}"
    raise ValueError(
      f"stacked_grads=StackedGrads({stacked_axis!r}) stacks the devices' gradients over the "
      f"mesh axis {stacked_axis!r}, and found {found}: give StackedGrads(axis_name, mesh) "
      f"or run the step inside `with jax.set_mesh(mesh):`, mesh having an axis "
      f"{stacked_axis!r}"
    )
  size = mesh.shape[stacked_axis]
  for path, leaf in jax.tree_util.tree_flatten_with_path(updates)[0]:
    shape = jnp.shape(leaf)
    if not shape or shape[0] != size:
      raise ValueError(
        f"with stacked_grads=StackedGrads({stacked_axis!r}) every gradient leaf is each "
        f"device's gradient stacked along a leading dimension of the axis's size {size}; "
        f"the gradient{jax.tree_util.keystr(path)} has shape {shape}. Return g[None] from "
        f"the jax.shard_map with out_specs=P({stacked_axis!r}), or leave stacked_grads out "
        "for a gradient that is not stacked"
      )
  return mesh


def _check_matches_params(updates: Any, params: Any) -> None:
  """Refuses a gradient whose leaves are not the parameters' (one more, one fewer, another name).

  A gradient with an extra leaf would be averaged and measured with it (the
  similarity then counts an entry no parameter has), and the update fails
  later, or never, where it is applied.
  """
  if params is None:
    return
  grad_paths = [
    jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(updates)[0]
  ]
  param_paths = [
    jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
  ]
  if grad_paths == param_paths:
    return
  extra = sorted(set(grad_paths) - set(param_paths))
  missing = sorted(set(param_paths) - set(grad_paths))
  found = (
    "; ".join(
      part
      for part in (
        f"leaves the parameters lack: {extra[:5]}" if extra else "",
        f"parameters it lacks: {missing[:5]}" if missing else "",
      )
      if part
    )
    or f"the same names in another order or count ({len(grad_paths)} vs {len(param_paths)})"
  )
  raise ValueError(
    f"simigrad_jax.transform was given a gradient of {len(grad_paths)} leaves for "
    f"{len(param_paths)} parameters ({found}): the gradient must have the parameters' tree, "
    "leaf for leaf; take it with respect to exactly the parameters passed to the update"
  )


def _concrete_value(scalar: Any) -> float | None:
  """A scalar's value where it is known when the step is traced (a number, a NumPy or a
  concrete JAX scalar), else None (a traced value is checked by no one but its maker)."""
  if scalar is None:
    return None
  try:
    return float(scalar)
  except (jax.errors.ConcretizationTypeError, TypeError):
    return None


def _check_half_grads(updates: Any, half_grads: Any) -> None:
  """Refuses half gradients whose structure or shapes differ from the gradient's."""
  if not isinstance(half_grads, HalfGrads):
    raise ValueError(
      f"half_grads must be a simigrad_jax.HalfGrads(first, second), got {type(half_grads).__name__}"
    )
  share = half_grads.share
  if share is not None and jnp.shape(share) != ():
    raise ValueError(
      f"half_grads.share must be a scalar (the first half's fraction of the "
      f"examples), got shape {jnp.shape(share)}"
    )
  value = _concrete_value(share)
  if value is not None and not 0 <= value <= 1:  # NaN fails too
    raise ValueError(
      f"half_grads.share must lie in [0, 1] (the first half's fraction of the "
      f"examples), got {share!r}"
    )
  expected = jax.tree.structure(updates)
  for name, half in (("first", half_grads.first), ("second", half_grads.second)):
    if jax.tree.structure(half) != expected:  # type: ignore[operator]  # PyTreeDef: no stub
      raise ValueError(
        f"half_grads.{name} has the tree structure {jax.tree.structure(half)}, "
        f"the gradient {expected}: compute both from the same parameters"
      )
    for (path, g), h in zip(
      jax.tree_util.tree_flatten_with_path(updates)[0], jax.tree.leaves(half), strict=True
    ):
      if jnp.shape(g) != jnp.shape(h):
        raise ValueError(
          f"half_grads.{name}{jax.tree_util.keystr(path)} has shape "
          f"{jnp.shape(h)}, the gradient {jnp.shape(g)}"
        )


def transform(
  axis_name: str | None = None,
  *,
  reduction: halves_reduction.Reduction = "hierarchical",
  nonfinite: NonFinitePolicy = "zero",
) -> optax.GradientTransformationExtraArgs:
  """Averages per-device gradients and measures the cosine similarity of two half-batch means.

  Use it in place of ``lax.pmean(grads, axis_name)`` inside a step mapped over
  ``axis_name`` (``jax.pmap`` or ``jax.shard_map``): it receives each device's
  OWN gradient, returns the mean gradient over the axis, and stores in its
  state ``cos(g_A, g_B)``, where ``g_A`` is the mean gradient of the devices
  with an even index on the axis (0, 2, 4, ...) and ``g_B`` that of the odd
  ones (1, 3, 5, ...), as the reference implementation splits its ranks,
  taken over all leaves as one vector and accumulated in float32. The host reads it with
  :func:`simigrad_jax.similarity` and feeds it to :class:`simigrad_jax.Controller`.

  Inside a ``jax.shard_map`` manual over ``axis_name`` only, with model
  axes left to XLA's partitioner, each device reduces its own shard of
  every leaf, so a tensor-parallel gradient is not gathered; under ``Auto``
  mesh axes the leaves' types do not say how they lie, and the step passes
  the parameters' specs as ``param_specs``.

  A step may also run the optimizer on global arrays outside its
  ``shard_map`` and hand the transform each device's gradient stacked along
  the data axis, saying so with ``stacked_grads``
  (:func:`simigrad_jax.device_halves_step` does, and so do the Trainer's
  steps with parameters in blocks over the data axis): the transform then
  reduces them in a ``shard_map`` of its own, and the mean comes back laid
  out as the parameters are (a leaf in blocks over the data axis, FSDP, in
  its blocks, given ``param_specs``), for the rest of the chain to run on
  global arrays.

  The step says in the call what it hands over (``half_grads``,
  ``stacked_grads``, ``param_specs``): no context set around the call
  changes what the update computes.

  With one device or an odd number of devices the device halves do not exist;
  then split each device's own batch in two and pass the two half gradients
  as ``half_grads`` (the helper :func:`simigrad_jax.value_and_half_grads`
  computes them in one pass). The halves are then the even-numbered rows of
  every device's batch and its odd-numbered rows, an equally unbiased split,
  and ``half_grads`` may be used with any device count.

  Halves of different sizes (an odd number of examples, or padding) are
  exact too: give ``HalfGrads(first, second, share)`` with ``share`` the first
  half's fraction of the examples and a gradient that averages to
  ``share * g_A + (1 - share) * g_B``; the transform returns that mean and
  measures ``g_A`` against ``g_B``. A half with no example has a zero
  gradient: its similarity is not measured, and the mean stays exact.

  In a plain ``jax.jit`` step over a batch sharded on a mesh (no pmap, no
  shard_map), leave ``axis_name`` out and pass ``half_grads``: the gradients
  are then global arrays, sharded in any way (replicated, FSDP over the data
  axis, tensor parallel over model axes, both; ``Auto`` or ``Explicit``
  axes). Each leaf's dot product and norms are sums over the leaf as it
  lies, which XLA's partitioner computes on each shard and adds in a small
  collective (scalars, or each row's partial sums): nothing is gathered or
  flattened, and the mean keeps each leaf's sharding. The halves are the
  batch's even- and odd-numbered examples as ``value_and_half_grads`` splits
  them. Called with an axis name outside ``jax.pmap`` or ``jax.shard_map``
  and without ``stacked_grads``, the update raises an error that says to
  leave the name out.

  Args:
    axis_name: the name of the mapped data-parallel axis, or None in a plain
      ``jax.jit`` step (then ``half_grads`` is required).
    reduction: ``"hierarchical"`` (default: reduce-scatter within each half,
      a swap of pieces between partner devices, dot products on the pieces,
      one all-gather; exactly the bytes of one all-reduce, and no copy of
      the whole gradient), or, for comparison, ``"scatter"`` (1.5x the
      bytes) or ``"stacked"`` (2x). With ``half_grads`` the two halves must
      both be reduced: 1.5x.
    nonfinite: what the update is when any device's gradient has a NaN or
      infinity: ``"zero"`` (default) returns zeros; ``"propagate"`` returns the
      non-finite mean, identical on every device, for a following
      ``optax.apply_if_finite`` to skip the whole step consistently. The state
      stays finite either way and counts the event.
    half_grads: (an argument of the update, ``update(updates, state, params,
      half_grads=...)``, as are the two below) a :class:`simigrad_jax.HalfGrads`,
      the two halves of each device's batch (the local split), ``updates``
      then their mean; None: the halves are the even and odd devices of
      ``axis_name``.
    stacked_grads: (update) a :class:`StackedGrads`, ``StackedGrads(axis_name,
      mesh=None)`` with the transform's own axis name, when ``updates`` are
      every device's gradient stacked along a leading dimension sharded over
      that mesh axis and the optimizer runs on global arrays outside the
      step's ``shard_map``: the update reduces them and returns the mean laid
      out as the parameters are. None: ``updates`` are this device's own
      gradient (inside the mapped step) or, with ``half_grads``, the global
      one. Not with ``half_grads``, and not inside a step mapped over the axis.
    measure: (update) True (default): the step measures the similarity.
      False: a step between two measuring ones (``measure_every``): ``updates``
      is the plain gradient of the whole batch (one ``jax.grad`` pass, no
      halves, neither ``half_grads`` nor ``stacked_grads``), the update returns
      its mean over ``axis_name`` (in a plain ``jax.jit`` step, the gradient
      as it is), and the state keeps the last measuring step's similarity and
      half norms, with ``measured`` False, ``norm_mean`` this gradient's
      norm, ``grads_finite`` and ``nonfinite_count`` this step's. A Python
      bool: each value is its own compiled program.
    param_specs: (update) None, or the parameters' ``PartitionSpec``s on the
      mesh (a pytree like ``updates``, one spec per leaf) for the device
      split and for a step that does not measure inside the mapped step,
      where the leaves' types do not carry them (``Auto`` mesh axes):
      each device then reduces its own shard of a tensor-parallel leaf
      instead of the leaf gathered whole, and with ``stacked_grads`` a leaf
      in blocks over the data axis alone (FSDP) gets its mean in the same
      blocks. They decide where the mean lies and which shard each device
      adds up (the statistics' float32 sums in another order), not what the
      mean is. None: the leaves' types give their layout over the model axes
      (``P()`` where they say nothing), and with ``stacked_grads`` every
      leaf's mean comes back whole over the data axis. The local split does
      not use them.
    record_outputs: (update) a :class:`RecordedOutputs` to which the update
      adds what it returns, for a second trace of the same optimizer update
      in the same program (the Trainer's non-finite guard: one trace to
      decide, one to write in place).
    replay_outputs: (update) the :class:`RecordedOutputs` of the first trace:
      the update returns what it recorded there, and reduces and measures
      nothing again (a mean that involves no reduction, over one device or
      in a plain ``jax.jit`` step, is made again from ``updates``).

  Returns:
    An ``optax.GradientTransformationExtraArgs``. Its ``update(updates, state,
    params=None, *, half_grads=None, stacked_grads=None, param_specs=None,
    measure=True, record_outputs=None, replay_outputs=None)``
    returns ``(mean_updates, new_state)``, ``mean_updates`` the mean of the
    devices' gradients; ``optax.chain`` passes the keyword arguments of its
    own update on to it. What the update computes depends on these arguments
    and its state alone.

  Example:
    >>> import jax, jax.numpy as jnp, optax, simigrad_jax
    >>> opt = optax.chain(simigrad_jax.transform("batch"), optax.sgd(0.1))
    >>> params = {"w": jnp.zeros(3)}
    >>> def step(params, opt_state, x):
    ...   grads = jax.grad(lambda p: jnp.sum((x - p["w"]) ** 2))(params)
    ...   updates, opt_state = opt.update(grads, opt_state, params)
    ...   return optax.apply_updates(params, updates), opt_state
    >>> n = jax.local_device_count()
    >>> stacked = lambda t: jax.tree.map(lambda a: jnp.stack([a] * n), t)
    >>> p, s = jax.pmap(step, axis_name="batch")(
    ...     stacked(params), stacked(opt.init(params)), jnp.ones((n, 3)))

  Note:
    Nothing is ever NaN in the state: when either half's mean gradient has a
    non-finite entry (detected from the float32 norms, so a gradient whose
    squared norm overflows float32, above about 1.8e19, counts as non-finite
    too), ``grads_finite`` is False, ``measured`` is False and the norms read
    0; when a half's mean gradient is exactly zero the similarity is
    undefined and ``measured`` is False. With cross-device BatchNorm
    (``axis_name`` on the norm layer) each device's gradient also flows
    through the shared batch statistics, so the halves are not purely from
    their own data; the mean is still exact.
  """
  if axis_name is not None and (not isinstance(axis_name, str) or not axis_name):
    raise ValueError(
      f"axis_name={axis_name!r} is not valid: give the name of the mapped data-parallel axis "
      "(a non-empty string, as in jax.pmap(..., axis_name='batch')) or None for a plain "
      "jax.jit step, which then passes half_grads"
    )
  if reduction not in halves_reduction.REDUCTIONS:
    raise ValueError(
      f"reduction={reduction!r} is not valid; choose one of {halves_reduction.REDUCTIONS}"
    )
  if nonfinite not in _NONFINITE_POLICIES:
    raise ValueError(f"nonfinite={nonfinite!r} is not valid; choose one of {_NONFINITE_POLICIES}")

  def init_fn(params: optax.Params) -> SimilarityState:
    del params
    return SimilarityState(
      similarity=jnp.zeros([], jnp.float32),
      norm_a=jnp.zeros([], jnp.float32),
      norm_b=jnp.zeros([], jnp.float32),
      norm_mean=jnp.zeros([], jnp.float32),
      measured=jnp.zeros([], jnp.bool_),
      grads_finite=jnp.ones([], jnp.bool_),
      nonfinite_count=jnp.zeros([], jnp.int32),
    )

  def reduce_in_step(
    updates: optax.Updates, half_grads: HalfGrads | None, param_specs: Any
  ) -> tuple[optax.Updates, half_statistics.HalfStatistics, bool]:
    """The mean and the statistics, in a mapped step or a plain ``jax.jit`` one, and whether the
    mean is ``updates`` as given (zeroed where not finite, as the policy says): no reduction."""
    if axis_name is not None:
      _check_axis_is_bound(axis_name)
      _check_not_already_reduced(jax.tree.leaves(updates), axis_name)
    zero_nonfinite = nonfinite == "zero"
    if half_grads is None:
      if axis_name is None:
        raise ValueError(
          "simigrad_jax.transform() without an axis name runs in a plain jax.jit step, where "
          "there are no device halves to compare: pass half_grads=... from "
          "simigrad_jax.value_and_half_grads, or give the mapped axis name"
        )
      mean, stats = halves_reduction.reduce_device_halves(
        updates, axis_name, reduction, zero_nonfinite=zero_nonfinite, specs=param_specs
      )
      return mean, stats, False
    _check_half_grads(updates, half_grads)
    share = 0.5 if half_grads.share is None else half_grads.share
    if axis_name is None or _one_untracked_device(axis_name):
      mean, stats = half_statistics.global_halves(
        updates, half_grads.first, half_grads.second, zero_nonfinite=zero_nonfinite, share=share
      )
      return mean, stats, True
    diff_shares = jax.tree.map(
      lambda g, a, b: ((a.astype(jnp.float32) - b.astype(jnp.float32)) / 2).astype(g.dtype),
      updates,
      half_grads.first,
      half_grads.second,
    )
    mean, stats = halves_reduction.reduce_local_halves(
      updates, diff_shares, axis_name, reduction, zero_nonfinite=zero_nonfinite, share=share
    )
    return mean, stats, False

  def reduce_stacked(
    updates: optax.Updates, stacked_grads: StackedGrads, half_grads: Any, param_specs: Any
  ) -> tuple[optax.Updates, half_statistics.HalfStatistics]:
    """The mean, laid out as the parameters are, and the statistics, from stacked gradients."""
    mesh = _check_stacked(updates, stacked_grads, axis_name, half_grads)
    stacked_axis = stacked_grads.axis_name
    explicit_axes = (
      tuple(name for name in mesh.axis_names if name != stacked_axis)
      if AxisType.Explicit in mesh.axis_types
      else ()
    )
    blocks = data_blocks.DataBlocks(updates, param_specs, stacked_axis)
    return blocks.reduce_devices(
      updates,
      reduction,
      nonfinite == "zero",
      mesh=stacked_grads.mesh,
      explicit_axes=explicit_axes,
    )

  def plain_update(
    updates: optax.Updates,
    state: SimilarityState,
    half_grads: Any,
    stacked_grads: Any,
    param_specs: Any,
  ) -> tuple[optax.Updates, SimilarityState, bool]:
    """A step that does not measure: the mean gradient, the last measurement kept in the state,
    and whether the mean is ``updates`` as given (one device: nothing to reduce)."""
    if half_grads is not None or stacked_grads is not None:
      given = "half_grads" if half_grads is not None else "stacked_grads"
      raise ValueError(
        f"simigrad_jax.transform's update(..., measure=False) was given {given}=...: a step "
        "that does not measure takes the plain gradient of its whole batch (one pass, "
        f"jax.grad), with neither half_grads nor stacked_grads; leave {given} out"
      )
    if axis_name is not None:
      _check_axis_is_bound(axis_name)
      _check_not_already_reduced(jax.tree.leaves(updates), axis_name)
    if axis_name is None or _one_untracked_device(axis_name):  # a mean over one would copy it
      sq_norm = sum(
        (jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(updates)),
        jnp.zeros([], jnp.float32),
      )
      finite = jnp.isfinite(sq_norm)
      updates = as_policy_says(finite, updates)
      unreduced = True
    else:
      group_reduction.given_specs(updates, param_specs, "param_specs")
      updates, sq_norm = halves_reduction.reduce_mean(
        updates, axis_name, zero_nonfinite=nonfinite == "zero", specs=param_specs
      )
      finite = jnp.isfinite(sq_norm)
      unreduced = False
    new_state = state._replace(
      norm_mean=jnp.where(finite, jnp.sqrt(jnp.where(finite, sq_norm, 0.0)), 0.0),
      measured=jnp.zeros([], jnp.bool_),
      grads_finite=finite,
      nonfinite_count=state.nonfinite_count + (~finite).astype(jnp.int32),
    )
    return updates, new_state, unreduced

  def update_fn(
    updates: optax.Updates,
    state: SimilarityState,
    params: optax.Params | None = None,
    *,
    half_grads: HalfGrads | None = None,
    stacked_grads: StackedGrads | None = None,
    param_specs: Any = None,
    measure: bool = True,
    record_outputs: RecordedOutputs | None = None,
    replay_outputs: RecordedOutputs | None = None,
    **extra: Any,
  ) -> tuple[optax.Updates, SimilarityState]:
    del extra
    if replay_outputs is not None:
      return replay_outputs.replay(updates)
    mean, new_state, unreduced = mean_and_measurement(
      updates, state, params, half_grads, stacked_grads, param_specs, measure
    )
    if record_outputs is not None:
      remake = functools.partial(as_policy_says, new_state.grads_finite) if unreduced else None
      record_outputs.record(mean, new_state, remake)
    return mean, new_state

  def as_policy_says(finite: jax.Array, updates: optax.Updates) -> optax.Updates:
    """``updates``, zeroed where ``finite`` is False with ``nonfinite="zero"``."""
    if nonfinite != "zero":
      return updates
    return half_statistics.zeros_unless(finite, updates)

  def mean_and_measurement(
    updates: optax.Updates,
    state: SimilarityState,
    params: optax.Params | None,
    half_grads: HalfGrads | None,
    stacked_grads: StackedGrads | None,
    param_specs: Any,
    measure: bool,
  ) -> tuple[optax.Updates, SimilarityState, bool]:
    """The update's ``(mean, new_state)`` and ``unreduced``: whether the mean is ``updates`` as
    given, zeroed as the policy says (no reduction over the devices: one device, or none)."""
    _check_matches_params(updates, params)
    if not isinstance(measure, bool):
      raise ValueError(
        f"measure must be True (the step measures the similarity) or False (a plain step: "
        f"the mean gradient alone), got {measure!r}"
      )
    if not measure:
      _check_step_axis(axis_name)
      return plain_update(updates, state, half_grads, stacked_grads, param_specs)
    if half_grads is None and _EXPECTING_HALF_GRADS.get():
      raise HalvesContractError(
        "the optimizer's update was given half_grads=..., but simigrad_jax.transform did not "
        "receive them, so it would compare the device halves instead: a wrapper in the "
        "optimizer takes extra keyword arguments and does not pass them on (optax.chain does)"
      )
    _check_step_axis(axis_name)
    group_reduction.given_specs(updates, param_specs, "param_specs")
    if stacked_grads is None:
      mean, stats, unreduced = reduce_in_step(updates, half_grads, param_specs)
    else:
      mean, stats = reduce_stacked(updates, stacked_grads, half_grads, param_specs)
      unreduced = False

    grads_finite = stats.finite
    positive = (stats.sq_norm_a > 0) & (stats.sq_norm_b > 0)
    measured = grads_finite & positive
    safe_denominator = jnp.where(
      measured, jnp.sqrt(stats.sq_norm_a) * jnp.sqrt(stats.sq_norm_b), 1.0
    )
    similarity = jnp.where(measured, jnp.clip(stats.dot_ab / safe_denominator, -1.0, 1.0), 0.0)

    def finite_norm(sq_norm: jax.Array) -> jax.Array:
      return jnp.where(grads_finite, jnp.sqrt(jnp.where(grads_finite, sq_norm, 0.0)), 0.0)

    new_state = SimilarityState(
      similarity=similarity,
      norm_a=finite_norm(stats.sq_norm_a),
      norm_b=finite_norm(stats.sq_norm_b),
      norm_mean=finite_norm(stats.sq_norm_mean),
      measured=measured,
      grads_finite=grads_finite,
      nonfinite_count=state.nonfinite_count + (~grads_finite).astype(jnp.int32),
    )
    return mean, new_state, unreduced

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
