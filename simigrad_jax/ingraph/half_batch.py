"""In-graph: the gradients of a batch's even- and odd-numbered examples, by one of three passes.

How the two halves' gradients are taken is a policy (``passes``), each
exact (the same halves, the same losses; the numbers agree to float
rounding):

* ``"sequential"`` (the default): two ``value_and_grad`` passes of half the
  batch, the second ordered after the first, so only one half's activations
  are alive at a time: about one full-batch gradient in time, at most one
  half's activations plus one extra gradient in temporary memory. The pass
  is one function called twice (:func:`traced_once`), so a program traces
  and lowers the loss once, as the other two do.
* ``"stacked"``: ONE pass, ``jax.vmap`` of ``value_and_grad`` over the two
  halves stacked on a leading axis of 2, the parameters shared: the forward
  pass and the backward pass through the activations run as one full-batch
  pass, and each weight's gradient becomes one batched contraction (a
  batched matmul for a dense layer, a grouped convolution for a
  convolution). Both halves' activations are alive at once, as in the plain
  step.
* ``"signed"``: one forward pass of both halves, then one backward pass of
  two cotangents at once, the halves' sum ``(1, 1)`` and their difference
  ``(1, -1)``: each weight's gradient is one contraction with twice the
  outputs (a plain matmul or convolution, never a grouped one), at the cost
  of a second backward pass through the activations; the halves are
  ``(sum + difference) / 2`` and ``(sum - difference) / 2``.

Which one is fastest depends on the device and the layers
(docs/own_step.md, "Choosing the passes").
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from simigrad_jax import validation
from simigrad_jax.errors import SimiGradError
from simigrad_jax.ingraph import half_layout
from simigrad_jax.ingraph.transform import HalfGrads


def _even_example_count(batch: Any) -> int:
  """The batch's number of examples (its leaves' shared leading size), checked to be even.

  Raises:
    ValueError: when the batch has no array, the leaves' leading sizes
      differ, or the size is odd.
  """
  leaves = jax.tree.leaves(batch)
  if not leaves:
    raise ValueError("value_and_half_grads needs a batch with at least one array")
  sizes = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
  size = next(iter(sizes))
  if len(sizes) != 1 or size is None:
    raise ValueError(
      "every array in the batch needs the same leading (example) axis; "
      f"got sizes {sorted(map(str, sizes))}"
    )
  if size == 0:
    raise ValueError(
      "the batch has 0 examples; value_and_half_grads needs an even number of examples, "
      "at least 2 (one in each half, per device inside pmap or shard_map)"
    )
  if size % 2:
    raise ValueError(
      f"the batch has {size} examples (per device inside pmap or shard_map); "
      "value_and_half_grads splits it into two equal halves, which needs an even "
      "number: give each device an even number of rows (under pmap or shard_map, "
      "a global batch that is a multiple of 2 x the device count), or drop one "
      "example; simigrad_jax.Trainer pads with a zero-weight row itself"
    )
  return size


def split_in_two(batch: Any) -> tuple[Any, Any]:
  """The first and second halves of ``batch`` along its leading (example) axis.

  Raises:
    ValueError: when the leaves' leading sizes differ, or the size is odd.
  """
  half = _even_example_count(batch) // 2
  return jax.tree.map(lambda x: x[:half], batch), jax.tree.map(lambda x: x[half:], batch)


def split_even_odd(batch: Any) -> tuple[Any, Any]:
  """The even-numbered (0, 2, 4, ...) and the odd-numbered (1, 3, 5, ...) examples of ``batch``.

  A strided slice of the leading axis. A batch sharded over a mesh's data
  axis (``P("data")``) lies in contiguous blocks of rows, one per device;
  when every block holds an even number of rows, its even-numbered rows are
  the batch's even-numbered examples, so XLA slices each block where it lies
  and no row moves between devices (cutting the batch into its first and
  second half would move rows).

  Raises:
    ValueError: when the leaves' leading sizes differ, or the size is odd.
  """
  _even_example_count(batch)
  return jax.tree.map(lambda x: x[0::2], batch), jax.tree.map(lambda x: x[1::2], batch)


def _is_inexact(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _after(tree: Any, grads: Any) -> tuple[Any, bool]:
  """``tree`` unchanged, but computed only once every leaf of ``grads`` is.

  XLA schedules independent work in any order, and on CPU it interleaves two
  independent passes layer by layer, which keeps both halves' activations
  alive. A data dependency orders them: ``zero`` is read from every gradient
  leaf (so it exists only when the whole first pass has finished), is exactly
  +0.0 even when a gradient is not finite, and ``x - (+0.0)`` is ``x`` bit for
  bit. XLA does not fold a floating-point ``y * 0`` (NaN semantics), so the
  dependency survives compilation. Only floating-point leaves can carry it.

  Returns:
    ``(tree, carried)``: the ordered tree, and whether any leaf carried the
    dependency.
  """
  totals = [
    jnp.sum(jnp.real(g), dtype=jnp.float32) for g in jax.tree.leaves(grads) if _is_inexact(g)
  ]
  if not totals or not any(_is_inexact(x) for x in jax.tree.leaves(tree)):
    return tree, False
  total = sum(totals[1:], totals[0])
  zero = jnp.abs(jnp.where(jnp.isfinite(total), total, 0.0) * 0.0)
  return jax.tree.map(lambda x: x - zero.astype(x.dtype) if _is_inexact(x) else x, tree), True


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, eq=False)
class _SameObject:
  """A call's argument that is not an array, kept out of the jitted function's arguments.

  Static in the pytree (part of the call's structure, not an argument of the
  program), and equal only to the wrapper of the same object, so that two
  calls share one trace only when they were given that very object.
  """

  value: Any

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _SameObject) and other.value is self.value

  def __hash__(self) -> int:
    return id(self.value)


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def traced_once(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
  """``fn`` as one function that a program traces and lowers once, however often it calls it.

  ``jax.jit`` of ``fn``, called inside a traced program: JAX keeps the
  jaxpr of a jitted function by the function and its arguments' types, and
  lowers it once per program, as one private function (named ``name``) that
  each call calls. XLA inlines the calls before it optimises, so the
  compiled program, its speed and its numbers are those of calling ``fn`` in
  place; only its trace and its lowering are done once rather than per call.

  The leaves of the arguments that are arrays become the jitted function's
  arguments; any other leaf (a Python number, a string, an object) reaches
  ``fn`` as it is, as in a call without ``jax.jit``, and two calls share the
  trace only when they pass the same objects there. Python code in ``fn``
  runs once for the calls that share a trace: ``fn`` must be a function of
  its arguments (as anything under ``jax.jit`` is).

  Args:
    fn: the function, called as ``fn(*args)``.
    name: the name of the function in the lowered program.

  Returns:
    A function ``(*args) -> fn(*args)``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> square = traced_once(lambda x: x * x, "square")
    >>> jaxpr = jax.make_jaxpr(lambda x, y: square(x) + square(y))(1.0, 2.0)
    >>> [e.params["jaxpr"] is jaxpr.eqns[0].params["jaxpr"] for e in jaxpr.eqns[:2]]
    [True, True]
  """
  is_kept = lambda x: isinstance(x, _SameObject)

  def on_arrays(*args: Any) -> Any:
    return fn(*jax.tree.map(lambda x: x.value if is_kept(x) else x, args, is_leaf=is_kept))

  on_arrays.__name__ = on_arrays.__qualname__ = name
  jitted = jax.jit(on_arrays)

  def call(*args: Any) -> Any:
    return jitted(*jax.tree.map(lambda x: x if _is_array(x) else _SameObject(x), args))

  return call


def value_and_grads_in_turn(
  value_and_grad: Callable[..., tuple[Any, Any]],
  params: Any,
  first_args: tuple[Any, ...],
  second_args: tuple[Any, ...],
) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
  """Two passes of ``value_and_grad``, the second ordered after the first's gradients.

  Only one pass's activations are alive at a time: the second pass's
  floating-point arguments (or, when they have none, the parameters) carry a
  zero-valued data dependency on every leaf of the first pass's gradient.

  Args:
    value_and_grad: ``value_and_grad(params, *args) -> (value, grads)``.
    params: the parameters, the same for both passes.
    first_args: the first pass's other arguments.
    second_args: the second pass's.

  Returns:
    ``((value_a, grads_a), (value_b, grads_b))``.
  """
  value_a, first = value_and_grad(params, *first_args)
  second_args, carried = _after(second_args, first)
  if not carried:
    params, _ = _after(params, first)
  value_b, second = value_and_grad(params, *second_args)
  return (value_a, first), (value_b, second)


class HalfBatchArgumentError(SimiGradError, ValueError):
  """``value_and_half_grads`` was given arguments or settings it cannot split into halves."""


def _identity(tree: Any) -> Any:
  return tree


def _stack(first: Any, second: Any) -> Any:
  """The two halves' pytrees as one, each leaf with a leading axis of 2."""
  return jax.tree.map(lambda a, b: jnp.stack([a, b]), first, second)


def _unstack(tree: Any) -> tuple[Any, Any]:
  """The inverse of :func:`_stack`: entry 0 and entry 1 of every leaf's leading axis."""
  return jax.tree.map(lambda x: x[0], tree), jax.tree.map(lambda x: x[1], tree)


class HalvesCall(NamedTuple):
  """One call of a :class:`HalvesPasses`: the loss, the two halves' arguments and what finishes
  each half's gradient.

  Attributes:
    loss_fn: ``loss_fn(params, *half_args, *shared_args)``, the half's loss
      (or ``(loss, aux)`` with ``has_aux``).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    params: the parameters, the same for both halves.
    first_args: the first half's own arguments.
    second_args: the second half's (the same structure and shapes).
    shared_args: the arguments both halves take whole, after their own.
    finish: applied to each half's gradient as soon as it is taken.
  """

  loss_fn: Callable[..., Any]
  has_aux: bool
  params: Any
  first_args: tuple[Any, ...]
  second_args: tuple[Any, ...]
  shared_args: tuple[Any, ...]
  finish: Callable[[Any], Any]

  def half_loss(self, params: Any, half_args: tuple[Any, ...]) -> Any:
    """``loss_fn`` of one half's own arguments, given as one tuple, and the shared ones."""
    return self.loss_fn(params, *half_args, *self.shared_args)

  def stacked_halves(self) -> tuple[Any, ...]:
    """The two halves' own arguments as one, each leaf with a leading axis of 2."""
    return _stack(self.first_args, self.second_args)

  def finished(
    self, values: tuple[Any, Any], grads: tuple[Any, Any]
  ) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    """``((value_a, finish(grads_a)), (value_b, finish(grads_b)))``."""
    (value_a, value_b), (grads_a, grads_b) = values, grads
    return (value_a, self.finish(grads_a)), (value_b, self.finish(grads_b))


class HalvesPasses(abc.ABC):
  """How the two halves' values and gradients are taken (one policy per name in :data:`PASSES`).

  Called as ``passes(loss_fn, has_aux, params, first_args, second_args,
  shared_args, finish)``: ``loss_fn(params, *half_args, *shared_args)``
  returns the half's loss (or ``(loss, aux)`` with ``has_aux``);
  ``first_args`` and ``second_args`` are the two halves' own arguments (the
  same structure and shapes), ``shared_args`` go whole to both, and
  ``finish`` is applied to each half's gradient as soon as it is taken.
  Returns ``((value_a, grads_a), (value_b, grads_b))``, as
  ``jax.value_and_grad(loss_fn, has_aux=has_aux)`` on each half would.
  A policy takes the call's arguments as one :class:`HalvesCall`
  (:meth:`take`).
  """

  name: ClassVar[str]

  def __call__(
    self,
    loss_fn: Callable[..., Any],
    has_aux: bool,
    params: Any,
    first_args: tuple[Any, ...],
    second_args: tuple[Any, ...],
    shared_args: tuple[Any, ...] = (),
    finish: Callable[[Any], Any] = _identity,
  ) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    return self.take(
      HalvesCall(loss_fn, has_aux, params, first_args, second_args, shared_args, finish)
    )

  @abc.abstractmethod
  def take(self, call: HalvesCall) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    """``((value_a, grads_a), (value_b, grads_b))`` of ``call``, each gradient finished."""


class SequentialPasses(HalvesPasses):
  """Two passes of half the batch, the second after the first (:func:`value_and_grads_in_turn`).

  The pass is one function called twice (:func:`traced_once`): a program
  traces and lowers the loss's forward and backward pass once, not once per
  half.
  """

  name = "sequential"

  def take(self, call: HalvesCall) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    value_and_grad = jax.value_and_grad(call.loss_fn, has_aux=call.has_aux)

    def half_pass(params: Any, *args: Any) -> tuple[Any, Any]:
      value, grads = value_and_grad(params, *args)
      return value, call.finish(grads)

    return value_and_grads_in_turn(
      traced_once(half_pass, "half_pass"),
      call.params,
      (*call.first_args, *call.shared_args),
      (*call.second_args, *call.shared_args),
    )


class StackedPasses(HalvesPasses):
  """One pass: ``jax.vmap`` of ``value_and_grad`` over the halves stacked on a leading axis of 2.

  The parameters are not mapped, so the forward pass and the backward pass
  through the activations are the full batch's; only the contractions that
  make each weight's gradient keep the halves apart (batched).
  """

  name = "stacked"

  def take(self, call: HalvesCall) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    value_and_grad = jax.value_and_grad(call.half_loss, has_aux=call.has_aux)
    values, grads = jax.vmap(value_and_grad, in_axes=(None, 0))(call.params, call.stacked_halves())
    return call.finished(_unstack(values), _unstack(grads))


class SignedPasses(HalvesPasses):
  """One forward pass of both halves, and one backward pass of their sum and their difference.

  ``jax.vjp`` of the two halves' losses (``jax.vmap`` over the stacked
  halves, the parameters shared), its pullback mapped over the cotangents
  ``(1, 1)`` and ``(1, -1)``: the sum ``g_A + g_B`` and the difference
  ``g_A - g_B`` of the halves' gradients, each weight's as one contraction
  over the whole batch with twice the outputs. The halves are then ``(sum +
  difference) / 2`` and ``(sum - difference) / 2``, computed in at least
  float32.
  """

  name = "signed"

  def take(self, call: HalvesCall) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    halves = call.stacked_halves()
    both = jax.vmap(call.half_loss, in_axes=(None, 0))
    if call.has_aux:
      losses, pullback, aux = jax.vjp(lambda p: both(p, halves), call.params, has_aux=True)
    else:
      losses, pullback = jax.vjp(lambda p: both(p, halves), call.params)
    signs = jnp.array([[1.0, 1.0], [1.0, -1.0]], losses.dtype)
    (sum_and_difference,) = jax.vmap(pullback)(signs)
    total, difference = _unstack(sum_and_difference)
    grads_a = jax.tree.map(average_in_float32, total, difference)
    grads_b = jax.tree.map(lambda t, d: average_in_float32(t, -d), total, difference)
    return call.finished(_unstack((losses, aux) if call.has_aux else losses), (grads_a, grads_b))


PASSES: dict[str, HalvesPasses] = {
  passes.name: passes for passes in (SequentialPasses(), StackedPasses(), SignedPasses())
}


def halves_passes(name: str) -> HalvesPasses:
  """The :class:`HalvesPasses` named ``name``; raises :class:`HalfBatchArgumentError` for others."""
  if name not in PASSES:
    raise HalfBatchArgumentError(
      f"passes={name!r} is not valid; choose one of {tuple(PASSES)} (docs/own_step.md, "
      "Choosing the passes)"
    )
  return PASSES[name]


def halves_and_mean(
  loss_fn: Callable[..., Any],
  has_aux: bool,
  params: Any,
  batch: Any,
  first_rest: tuple[Any, ...] = (),
  second_rest: tuple[Any, ...] = (),
  param_specs: Any = None,
  *,
  shared_rest: tuple[Any, ...] = (),
  passes: str = "sequential",
) -> tuple[tuple[Any, Any], tuple[Any, Any], Any]:
  """The even- and odd-numbered examples' values and gradients, and the mean gradient.

  The batch is split by :func:`split_even_odd` and the halves' gradients
  are taken by ``passes`` (:data:`PASSES`). On a data-parallel mesh
  (:class:`simigrad_jax.ingraph.half_layout.HalvesLayout`) each half's
  gradient is kept in blocks over the data axis as soon as it is taken, and
  the mean, averaged on the blocks, lies where the parameters need it; where
  the mesh's ``Explicit`` axes are the data axis alone, the split and the
  passes run with that axis ``Auto``, so that a replicated parameter's
  gradient is not all-reduced whole first. Elsewhere the gradients lie where
  XLA puts them.

  Args:
    loss_fn: ``loss_fn(params, half, *rest, *shared_rest)``, a scalar loss (or
      ``(loss, aux)`` with ``has_aux``).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    params: the parameters.
    batch: the whole batch (its layout names the data axis).
    first_rest: the first half's own arguments after its half of the batch.
    second_rest: the second half's.
    param_specs: under ``Auto`` axes, the parameters' ``PartitionSpec``s, or
      None (replicated).
    shared_rest: the arguments both halves take whole, after their own.
    passes: a name in :data:`PASSES`.

  Returns:
    ``((value_a, grads_a), (value_b, grads_b), mean)``, the mean computed in
    at least float32.

  Raises:
    ValueError: when the batch's leaves differ in leading size, or it is odd.
  """
  _even_example_count(batch)
  take_halves = halves_passes(passes)
  # A convolutional model: a dense kernel in blocks over its inputs shards the pooled
  # activations' channels and reshards the batch; its gradients stay where XLA puts them.
  dense = all(jnp.ndim(leaf) <= 2 for leaf in jax.tree.leaves(params))
  layout = half_layout.HalvesLayout(
    half_layout.data_layout(batch), params, blocks=dense, param_specs=param_specs
  )

  def run(params: Any, batch: Any, first_rest: tuple, second_rest: tuple, shared: tuple) -> Any:
    first_half, second_half = split_even_odd(batch)
    (value_a, first), (value_b, second) = take_halves(
      loss_fn,
      has_aux,
      params,
      (first_half, *first_rest),
      (second_half, *second_rest),
      shared,
      layout.halves,
    )
    mean = layout.mean(jax.tree.map(average_in_float32, first, second))
    return (value_a, first), (value_b, second), mean

  return layout.run(run, params, batch, first_rest, second_rest, shared_rest)


def average_in_float32(a: jax.Array, b: jax.Array) -> jax.Array:
  """``(a + b) / 2`` computed in at least float32, returned in ``a``'s dtype."""
  dtype = jnp.promote_types(a.dtype, jnp.float32)
  return ((a.astype(dtype) + b.astype(dtype)) / 2).astype(a.dtype)


def checked_scalar_loss(
  loss_fn: Callable[..., Any], has_aux: bool, caller: str = "value_and_half_grads"
) -> Callable[..., Any]:
  """``loss_fn``, refusing at trace time a value that is not what ``has_aux`` says.

  Without ``has_aux`` a loss that returns ``(loss, aux)`` would fail in JAX
  with "Gradient only defined for scalar-output functions", which does not say
  what to change; with it, a loss that returns one array fails on unpacking.
  """

  def checked(*args):
    value = loss_fn(*args)
    is_pair = isinstance(value, (tuple, list)) and len(value) == 2
    if not has_aux and isinstance(value, (tuple, list)):
      raise ValueError(
        f"loss_fn returned a {type(value).__name__} of {len(value)} values where "
        f"{caller} expects one scalar loss: a loss that returns "
        f"(loss, aux) needs simigrad_jax.{caller}(loss_fn, has_aux=True)"
      )
    if has_aux and not is_pair:
      raise ValueError(
        f"{caller}(loss_fn, has_aux=True) expects loss_fn to return "
        f"(loss, aux), got {_describe(value)}: return the pair, or leave has_aux out"
      )
    loss = value[0] if has_aux else value
    if jnp.ndim(loss):
      raise ValueError(
        f"loss_fn returned {_describe(loss)} as its loss where {caller} needs a scalar: "
        "the MEAN of the per-example losses over the examples it is given (each half's "
        "gradient is then that half's mean gradient); return jnp.mean(losses)"
      )
    return value

  return checked


def explaining_explicit_axes(grad_fn: Callable[..., Any], caller: str) -> Callable[..., Any]:
  """``grad_fn``, with JAX's refusal of an operation on Explicit mesh axes explained.

  ``jax.make_mesh`` makes Explicit axes by default; there an operation
  without a sharding rule for its operands (a convolution: ``nn.Conv``,
  ``nnx.Conv``, whose gradient fails the same way in a plain ``jax.grad``
  step) raises JAX's ``ShardingTypeError`` asking for an ``out_sharding``,
  which does not say what to change in a training step. This raises a
  ValueError that does; every other error is raised as it is.
  """

  def call(*args: Any, **kwargs: Any) -> Any:
    try:
      return grad_fn(*args, **kwargs)
    except Exception as error:
      if type(error).__name__ != "ShardingTypeError":  # JAX's class is not public
        raise
      mesh = jax.sharding.get_abstract_mesh()
      explicit = [
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if kind == jax.sharding.AxisType.Explicit
      ]
      if not explicit:
        raise
      raise ValueError(
        f"simigrad_jax.{caller} on a mesh with Explicit axes {explicit}: "
        f"{str(error).splitlines()[0]}. jax.make_mesh makes Explicit axes by default, where "
        "an operation without a sharding rule, such as a convolution (nn.Conv, nnx.Conv), "
        "fails (a plain jax.grad step too). Either make the mesh with Auto axes, "
        "jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names)), or run the "
        f"model's forward pass under Auto axes, jax.sharding.auto_axes(apply, "
        f"out_sharding=P({explicit[0]!r})) (docs/own_step.md, Explicit mesh axes); "
        "simigrad_jax.device_halves_step needs neither"
      ) from error

  return call


def _describe(value: Any) -> str:
  if isinstance(value, (tuple, list)):
    return f"a {type(value).__name__} of {len(value)} values"
  if hasattr(value, "shape"):
    return f"an array of shape {tuple(value.shape)}"
  return f"a {type(value).__name__}"


def value_and_half_grads(
  loss_fn: Callable[..., Any],
  has_aux: bool = False,
  *,
  batch_argnums: int | Sequence[int] | None = None,
  passes: str = "sequential",
  param_specs: Any = None,
) -> Callable[..., tuple[Any, Any, HalfGrads]]:
  """Wraps ``loss_fn`` to return its value, its gradient and the two half-batch gradients.

  The batch (the argument after the parameters, or every argument
  ``batch_argnums`` names: any pytrees of arrays with a shared leading
  example axis) is split into its even-numbered examples (rows 0, 2, 4, ...: the first half,
  ``g_A``) and its odd-numbered ones (rows 1, 3, 5, ...: the second half,
  ``g_B``), the halves the :class:`simigrad_jax.Trainer` compares too, and
  the two halves' gradients are taken as ``passes`` says. By default
  (``"sequential"``) ``jax.value_and_grad(loss_fn)`` runs on each half in
  turn: the second pass is ordered after the first (by a zero-valued data
  dependency of the second half's floating-point inputs, or of the
  parameters when the batch has none), so only one half's activations are
  alive at a time; the cost is about that of one full-batch gradient. The
  pass is one function called twice (:func:`traced_once`): the program
  traces and lowers the model once, but XLA inlines both calls, so the
  compiled program holds the model twice and compiles in about twice the
  time. ``"stacked"`` and ``"signed"`` take both halves in one pass
  (:data:`PASSES`; docs/own_step.md says which is fastest where). The full
  gradient is the average of the two half gradients, computed in at least
  float32. Pass the result to :func:`simigrad_jax.transform` as
  ``half_grads``.

  In a plain ``jax.jit`` step over a batch sharded on a mesh's data axis,
  every device takes the even and the odd rows of its own block: when each
  device holds an even number of rows, no row moves between devices. Inside
  ``jax.pmap`` or ``jax.shard_map`` the split is of each device's own rows,
  which are the batch's even- and odd-numbered examples when each device
  holds an even number of consecutive ones.

  On a data-parallel mesh each half's gradient is kept in blocks over the
  data axis (``simigrad_jax/ingraph/half_layout.py``). Where the mesh's
  ``Explicit`` axes are the data axis alone (``jax.make_mesh((n,),
  ("data",))``), the split and both passes run with that axis ``Auto``
  (``jax.sharding.auto_axes``), as cheap as on ``Auto`` axes: the values
  come back replicated, the mean as the parameters lie. A loss that names
  the data axis in a sharding (``out_sharding=P("data")``) cannot run there
  and runs as written, with a warning.

  Args:
    loss_fn: ``loss_fn(params, batch, *args)`` returning a scalar loss that is a
      MEAN over the examples it is given (or ``(loss, aux)`` with
      ``has_aux``). The halves have equal size, so the average of the two half
      losses and gradients is exactly the full-batch loss and gradient.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    batch_argnums: the positions of ``loss_fn``'s arguments that hold one
      entry per example and are split into halves with the batch (as
      ``jax.grad``'s ``argnums`` count them: the parameters are 0), e.g.
      ``batch_argnums=(1, 2)`` for ``loss_fn(params, x, y)``; every other
      argument goes whole to both halves. None (the default): the argument
      after the parameters alone, and an argument after it with the batch's
      number of rows is refused (it would go whole to both halves), naming
      the setting that splits it.
    passes: how the halves' gradients are taken: ``"sequential"`` (two
      passes of half the batch, one after the other: the least memory),
      ``"stacked"`` (one pass, ``jax.vmap`` over the halves: batched
      weight-gradient contractions) or ``"signed"`` (one forward pass and one
      backward pass of the halves' sum and difference: plain contractions
      with twice the outputs). Every choice gives the same numbers to float
      rounding.
    param_specs: under ``Auto`` mesh axes, the parameters' ``PartitionSpec``s
      (a pytree like the parameters), whose types do not say it there: a
      parameter sharded over the data axis (FSDP) keeps its blocks, and the
      mean gradient comes back in each parameter's layout. None (the
      default): the parameters are taken as replicated. Under ``Explicit``
      axes their types say it, and this is not needed.

  Returns:
    A function ``(params, batch, *args) -> (value, grads, half_grads)``:
    ``value`` is the full-batch loss (with ``has_aux``: ``(loss, aux)`` where
    every leaf of ``aux`` has a leading axis of 2, one entry per half),
    ``grads`` the full-batch gradient, and ``half_grads`` a
    :class:`HalfGrads` of the two half gradients. Calling it raises
    ``ValueError`` when the batch has an odd number of examples or leaves of
    different leading sizes, when ``loss_fn`` returns a pair without
    ``has_aux`` (or no pair with it), and :class:`HalfBatchArgumentError`
    for a ``batch_argnums`` that names no argument or leaves a per-row one
    whole (see above).

  Example:
    >>> import jax, jax.numpy as jnp, optax, simigrad_jax
    >>> loss = lambda p, x: jnp.mean((x - p) ** 2)
    >>> opt = optax.chain(simigrad_jax.transform(), optax.sgd(0.1))
    >>> @jax.jit
    ... def step(p, state, x):
    ...   value, grads, halves = simigrad_jax.value_and_half_grads(loss)(p, x)
    ...   updates, state = opt.update(grads, state, p, half_grads=halves)
    ...   return optax.apply_updates(p, updates), state
    >>> x = jnp.arange(8.0).reshape(4, 2)  # rows 0 and 2 form the first half, 1 and 3 the second
    >>> p = jnp.zeros(2); p, state = step(p, opt.init(p), x)
    >>> round(simigrad_jax.similarity(state), 4)  # cos([-4, -6], [-8, -10])
    0.9962

  Note:
    Every ``passes`` traces ``loss_fn`` once for both halves: Python code in
    it (a print, a counter) runs once per traced program, not once per half.

    With BatchNorm in training mode each half is normalised with its own
    statistics, which is what makes the two halves independent; the average of
    the half gradients is then the gradient of the average of the two
    half-batch losses (not of one loss normalised over the whole batch).
  """
  checked_loss = checked_scalar_loss(loss_fn, has_aux)
  halves_passes(passes)  # refuses a bad name where the step is written
  chosen = checked_batch_argnums(batch_argnums)

  def wrapped(params, *args):
    split = split_arguments(chosen, args)

    def ordered_loss(params: Any, rows: tuple, *shared: Any) -> Any:
      return checked_loss(params, *split.in_call_order(rows, shared))

    (value_a, first), (value_b, second), mean_grads = halves_and_mean(
      ordered_loss,
      has_aux,
      params,
      split.rows(args),
      param_specs=param_specs,
      shared_rest=split.shared(args),
      passes=passes,
    )
    value: jax.Array | tuple[jax.Array, Any]  # the loss, and the aux of both halves if has_aux
    if has_aux:
      (loss_a, aux_a), (loss_b, aux_b) = value_a, value_b
      aux = jax.tree.map(lambda a, b: jnp.stack([a, b]), aux_a, aux_b)
      value = (jnp.mean(jnp.stack([loss_a, loss_b])), aux)
    else:
      value = jnp.mean(jnp.stack([value_a, value_b]))
    return value, mean_grads, HalfGrads(first, second)

  return explaining_explicit_axes(wrapped, "value_and_half_grads")


def checked_batch_argnums(
  batch_argnums: int | Sequence[int] | None,
  caller: str = "value_and_half_grads",
  first: str = "params",
) -> tuple[int, ...] | None:
  """``batch_argnums`` as a sorted tuple of positions (None kept: the default), each >= 1.

  A position is an integer (NumPy's integers are taken as Python's); a bool
  is not one (``True`` would be taken as position 1).

  Args:
    batch_argnums: the setting as the user gave it.
    caller: the function that takes it, for the message.
    first: what ``loss_fn``'s argument 0 is (``"params"``, ``"model"``), for the message.

  Raises:
    HalfBatchArgumentError: an empty or repeated position, one below 1, or
      one that is not an integer (a bool, a float, an array).
  """
  if batch_argnums is None:
    return None

  def position(i: Any) -> bool:  # NumPy's integers count as Python's; a bool is no position
    return validation.is_int(i) and int(i) >= 1

  if position(batch_argnums):
    chosen: tuple[Any, ...] = (batch_argnums,)
  elif isinstance(batch_argnums, Sequence) and not isinstance(batch_argnums, str):
    chosen = tuple(batch_argnums)
  else:
    chosen = ()
  if (
    not chosen or not all(position(i) for i in chosen) or len(set(map(int, chosen))) != len(chosen)
  ):
    raise HalfBatchArgumentError(
      f"{caller}: batch_argnums={batch_argnums!r} is not valid: "
      f"give an integer or a tuple of distinct integers, the positions (1 or more; 0 is the "
      f"{first}) of loss_fn's arguments that hold one entry per example, e.g. batch_argnums=(1, 2) "
      f"for loss_fn({first}, x, y)"
    )
  return tuple(sorted(int(i) for i in chosen))


def _leading_sizes(tree: Any) -> set[int | None]:
  """The leading sizes of ``tree``'s leaves (None for a scalar or a non-array leaf)."""
  shapes = [jnp.shape(leaf) if hasattr(leaf, "shape") else () for leaf in jax.tree.leaves(tree)]
  return {shape[0] if shape else None for shape in shapes}


@dataclasses.dataclass(frozen=True)
class SplitArguments:
  """Which of ``loss_fn``'s arguments after argument 0 are split into halves, which go whole.

  Attributes:
    rows_at: the indices (into the arguments after argument 0) split with the batch.
    shared_at: the others, which both halves take whole.
  """

  rows_at: tuple[int, ...]
  shared_at: tuple[int, ...]

  def rows(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The arguments split into halves, in order."""
    return tuple(args[i] for i in self.rows_at)

  def shared(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The arguments both halves take whole, in order."""
    return tuple(args[i] for i in self.shared_at)

  def in_call_order(self, rows: tuple[Any, ...], shared: tuple[Any, ...]) -> tuple[Any, ...]:
    """A half's rows and the shared arguments put back in ``loss_fn``'s order."""
    placed = dict(zip(self.rows_at, rows, strict=True))
    placed |= dict(zip(self.shared_at, shared, strict=True))
    return tuple(placed[i] for i in range(len(placed)))


def split_arguments(
  chosen: tuple[int, ...] | None,
  args: tuple[Any, ...],
  caller: str = "value_and_half_grads",
  first: str = "params",
) -> SplitArguments:
  """Which of ``args`` (``loss_fn``'s arguments after argument 0) are split into halves.

  Args:
    chosen: :func:`checked_batch_argnums`'s result.
    args: the arguments after argument 0, as the call gives them.
    caller: the function that splits them, for the message.
    first: what argument 0 is (``"params"``, ``"model"``), for the message.

  Raises:
    HalfBatchArgumentError: for a position past the last argument, or (the
      default, ``chosen`` None) an argument after the batch whose every leaf
      has the batch's leading size: one entry per example, which would go
      whole to both halves.
  """
  if not args:
    raise HalfBatchArgumentError(
      f"{caller}'s function takes ({first}, batch, *args): it was called with the "
      f"{first} alone, and there is no batch to split"
    )
  if chosen is not None:
    if chosen[-1] > len(args):
      raise HalfBatchArgumentError(
        f"batch_argnums={chosen} names argument {chosen[-1]}, but loss_fn was called with "
        f"{len(args) + 1} arguments (0 to {len(args)}, the {first} 0)"
      )
    rows_at = tuple(i - 1 for i in chosen)
  else:
    rows = _leading_sizes(args[0])
    for position, arg in enumerate(args[1:], start=2):
      sizes = _leading_sizes(arg)
      if len(rows) == 1 and None not in rows and sizes == rows:
        raise HalfBatchArgumentError(
          f"argument {position} of loss_fn has the batch's {next(iter(rows))} rows but would go "
          f"whole to both halves: pass {caller}(loss_fn, batch_argnums=(1, {position})) to split "
          f"it with the batch (or batch_argnums=1 to keep it whole)"
        )
    rows_at = (0,)
  return SplitArguments(rows_at, tuple(i for i in range(len(args)) if i not in rows_at))
