"""In-graph and host: SimiGrad for a Flax NNX model: its half-batch gradients, and the learning-rate factor.

* :func:`nnx_value_and_half_grads` (in-graph, inside ``nnx.jit``): the model's
  gradient and the gradients of the batch's even- and odd-numbered examples,
  as :func:`simigrad_jax.value_and_half_grads` gives them for a pure loss, with
  the model's other state kept: BatchNorm's running statistics (and any other
  floating-point variable the model changes) averaged over the two halves, and
  each half's dropout drawn from a key of its own.
* :func:`set_nnx_lr_factor` (host, between steps): the learning-rate factor of
  :func:`simigrad_jax.scale_by_lr_factor` set inside an ``nnx.Optimizer``.

Flax is an optional dependency (the ``train`` extra): it is imported when a
function is called, not with the package.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from simigrad_jax import optimizer_state
from simigrad_jax.errors import SimiGradError
from simigrad_jax.ingraph import half_batch
from simigrad_jax.ingraph.transform import HalfGrads

__all__ = [
  "NNXStateError",
  "SECOND_HALF_STREAM",
  "nnx_value_and_half_grads",
  "set_nnx_lr_factor",
]

# The second half's dropout (and every other random stream) draws from each stream's key
# folded with this number; the first half, and the model after the step, keep the key.
SECOND_HALF_STREAM = 1


def _flax_nnx() -> Any:
  try:
    from flax import nnx  # pylint: disable=import-outside-toplevel
  except ModuleNotFoundError as error:
    raise ModuleNotFoundError(
      "simigrad_jax's NNX helpers need flax: pip install 'simigrad-jax[train]' (or flax)"
    ) from error
  return nnx


class NNXStateError(SimiGradError, ValueError):
  """A loss changed NNX state from outside the gradient: a stream or variable it was not given."""


# The supported pattern, as flax's own examples write it: every layer owns its random stream.
_OWN_STREAMS_FIX = (
  "    self.dropout = nnx.Dropout(0.25, rngs=rngs)  # in __init__: the layer owns its stream\n"
  "    x = self.dropout(x)                           # in __call__: no rngs argument\n"
  "    grad_fn(model, batch)                         # in the step: no nnx.Rngs from outside"
)

# The attribute an nnx.Rngs passed to the gradient function is lent to the model under, for
# one call, so that it travels with the model's own streams (its own key for each half).
_LENT = "_simigrad_lent_streams"


@dataclasses.dataclass(frozen=True)
class _Lent:
  """Where an argument lent to the model was: a static placeholder, the stream's position."""

  position: int


jax.tree_util.register_static(_Lent)


def _taking_lent_streams(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
  """``loss_fn`` given back its ``nnx.Rngs`` arguments, and flax's TraceContextError explained."""
  from flax import errors  # pylint: disable=import-outside-toplevel

  def loss(model, batch, *args):
    if any(isinstance(a, _Lent) for a in args):
      lent = getattr(model, _LENT)
      args = tuple(lent[a.position] if isinstance(a, _Lent) else a for a in args)
    try:
      return loss_fn(model, batch, *args)
    except errors.TraceContextError as error:
      raise NNXStateError(
        "nnx_value_and_half_grads runs the loss inside jax.grad, on a copy of the model, and "
        f"the loss changed an NNX object that is neither the model's nor an argument ({error}). "
        "An nnx.Rngs passed as an argument, grad_fn(model, batch, rngs), works; one the loss "
        "reaches otherwise (a closure, a global) does not. Or let each layer own its stream:\n"
        + _OWN_STREAMS_FIX
      ) from error

  return loss


def _lending_streams(nnx: Any, grad_fn: Callable[..., Any]) -> Callable[..., Any]:
  """``grad_fn`` with its ``nnx.Rngs`` arguments lent to the model for the call.

  Passed as they are, they would be changed inside ``jax.grad`` (each call
  of a stream counts), which NNX refuses with a ``TraceContextError``. Lent to
  the model, they are split and merged with the model's own streams: each
  half draws from its own key, and the streams' counts move on after the step.
  """

  def call(model, batch, *args):
    streams = [a for a in args if isinstance(a, (nnx.Rngs, nnx.RngStream))]
    if not streams or not isinstance(model, nnx.Module) or hasattr(model, _LENT):
      return grad_fn(model, batch, *args)
    positions = iter(range(len(streams)))
    placed = tuple(
      _Lent(next(positions)) if isinstance(a, (nnx.Rngs, nnx.RngStream)) else a for a in args
    )
    setattr(model, _LENT, nnx.data(streams))
    try:
      return grad_fn(model, batch, *placed)
    finally:
      delattr(model, _LENT)

  return call


def _average_halves(first: jax.Array, second: jax.Array) -> jax.Array:
  """The two halves' new values of a model variable: averaged where floating, else the first's."""
  if not jnp.issubdtype(first.dtype, jnp.floating):
    return first  # counters (such as the random streams' counts) and keys
  return half_batch.average_in_float32(first, second)


def nnx_value_and_half_grads(
  loss_fn: Callable[..., Any],
  has_aux: bool = False,
  *,
  batch_argnums: int | Sequence[int] | None = None,
) -> Callable[..., tuple[Any, Any, HalfGrads]]:
  """Wraps an NNX ``loss_fn(model, batch, *args)`` to return its value, its gradient and the half gradients.

  The batch (the argument after the model, or every argument
  ``batch_argnums`` names) is split into its even- and its odd-numbered
  examples (the halves every SimiGrad path compares) and the loss runs on
  each in turn, on a copy
  of the model, as :func:`simigrad_jax.value_and_half_grads` does; the
  gradients are taken with respect to the model's ``nnx.Param`` variables.
  The model's other variables are then updated in place: each floating-point
  one (BatchNorm's running mean and variance) to the average of the two
  halves' new values, which for BatchNorm is its update with the mean of the
  two halves' batch statistics; the others (the random streams' counts) to
  the first half's. Each half draws its own random numbers: the second half
  from every stream's key folded with :data:`SECOND_HALF_STREAM`, so the two
  halves' dropout masks differ. The layers may draw from the streams they
  were built with (``nnx.Dropout(rate, rngs=rngs)``) or, as flax's MNIST
  tutorial writes it, from an ``nnx.Rngs`` passed in ``*args`` to the model's
  ``__call__``: such an argument is lent to the model for the call, so that
  it draws like the model's own streams (a key for each half) and moves on
  after the step. A stream the loss reaches otherwise (a closure) cannot be
  changed inside ``jax.grad``: :class:`NNXStateError` names the fix.

  Args:
    loss_fn: ``loss_fn(model, batch, *args)`` returning a scalar loss that is
      a mean over the examples of ``batch`` (or ``(loss, aux)`` with
      ``has_aux``), with the model in training mode; ``args`` may hold
      ``nnx.Rngs`` (or ``nnx.RngStream``) objects.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    batch_argnums: the positions of ``loss_fn``'s arguments that hold one
      entry per example and are split into halves with the batch (the model
      is 0), e.g. ``batch_argnums=(1, 2)`` for ``loss_fn(model, x, y)``; every
      other argument goes whole to both halves. None (the default): the
      argument after the model alone, and an argument after it with the
      batch's number of rows is refused with
      :class:`~simigrad_jax.ingraph.half_batch.HalfBatchArgumentError` (it
      would go whole to both halves), naming the setting that splits it, as
      :func:`simigrad_jax.value_and_half_grads` does.

  Returns:
    A function ``(model, batch, *args) -> (value, grads, half_grads)``, to
    call inside ``nnx.jit``: ``value`` the batch's loss (with ``has_aux``:
    ``(loss, aux)``, every leaf of ``aux`` with a leading axis of 2, one entry
    per half), ``grads`` the ``nnx.Param`` gradient as an ``nnx.State``, and
    ``half_grads`` the two halves' gradients, for
    ``optimizer.update(model, grads, half_grads=half_grads)``.

  Example:
    >>> import jax.numpy as jnp, optax, simigrad_jax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> tx = optax.chain(simigrad_jax.transform(), optax.sgd(0.1))
    >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    >>> @nnx.jit
    ... def step(model, optimizer, x):
    ...   loss_fn = lambda model, x: jnp.mean((model(x) - 1.0) ** 2)
    ...   loss, grads, halves = simigrad_jax.nnx_value_and_half_grads(loss_fn)(model, x)
    ...   optimizer.update(model, grads, half_grads=halves)
    ...   return loss
    >>> loss = step(model, optimizer, jnp.arange(8.0).reshape(4, 2))
    >>> -1.0 <= simigrad_jax.similarity(optimizer.opt_state) <= 1.0
    True
  """
  nnx = _flax_nnx()
  loss_fn = _taking_lent_streams(loss_fn)
  caller = "nnx_value_and_half_grads"
  checked_loss = half_batch.checked_scalar_loss(loss_fn, has_aux, caller)
  chosen = half_batch.checked_batch_argnums(batch_argnums, caller, first="model")

  def wrapped(model, *args):
    if not isinstance(model, nnx.Module):
      raise ValueError(
        f"nnx_value_and_half_grads takes an nnx.Module first, got {type(model).__name__}; "
        "for a pytree of parameters use simigrad_jax.value_and_half_grads"
      )
    split = half_batch.split_arguments(chosen, args, caller, first="model")

    def pure_loss(params, rows, keys, rest, graphdef, *shared):
      model = nnx.merge(graphdef, params, keys, rest, copy=True)
      value = checked_loss(model, *split.in_call_order(rows, shared))
      loss, aux = value if has_aux else (value, None)
      return loss, (aux, nnx.state(model, nnx.Not(nnx.Param)))

    graphdef, params, keys, rest = nnx.split(model, nnx.Param, nnx.RngKey, ...)
    second_keys = jax.tree.map(lambda k: jax.random.fold_in(k, SECOND_HALF_STREAM), keys)
    ((loss_a, (aux_a, state_a)), first), ((loss_b, (aux_b, state_b)), second), grads = (
      half_batch.halves_and_mean(
        pure_loss,
        True,
        params,
        split.rows(args),
        (keys, rest, graphdef),
        (second_keys, rest, graphdef),
        shared_rest=split.shared(args),
      )
    )
    # The streams' keys stay the model's own: only their counts move.
    new_state = jax.tree.map(_average_halves, state_a, state_b)
    nnx.update(model, nnx.filter_state(new_state, nnx.Not(nnx.RngKey)))
    loss = jnp.mean(jnp.stack([loss_a, loss_b]))
    value = (loss, jax.tree.map(lambda a, b: jnp.stack([a, b]), aux_a, aux_b)) if has_aux else loss
    return value, grads, HalfGrads(first, second)

  return half_batch.explaining_explicit_axes(
    _lending_streams(nnx, wrapped), "nnx_value_and_half_grads"
  )


def set_nnx_lr_factor(optimizer: Any, factor: float) -> None:
  """Sets the learning-rate factor of :func:`simigrad_jax.scale_by_lr_factor` inside an ``nnx.Optimizer``.

  ``nnx.Optimizer`` keeps its state in variables, which
  :func:`simigrad_jax.set_lr_factor` (a new state, the old one unchanged)
  cannot set; this sets the factor in place, with its dtype, shape and
  placement kept, so the ``nnx.jit`` step is not compiled again.

  Args:
    optimizer: an ``nnx.Optimizer`` whose transformation chains
      :func:`simigrad_jax.scale_by_lr_factor`.
    factor: the new factor, finite and > 0 (e.g. from
      :func:`simigrad_jax.lr_factor`).

  Example:
    >>> import optax, simigrad_jax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> tx = optax.chain(simigrad_jax.transform(), optax.sgd(0.1), simigrad_jax.scale_by_lr_factor())
    >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    >>> simigrad_jax.set_nnx_lr_factor(optimizer, 2.0)
    >>> simigrad_jax.lr_factor_of(optimizer.opt_state)
    2.0
  """
  nnx = _flax_nnx()
  if not isinstance(optimizer, nnx.Optimizer):
    raise ValueError(
      f"set_nnx_lr_factor takes an nnx.Optimizer, got {type(optimizer).__name__}; for an "
      "optax state use simigrad_jax.set_lr_factor(opt_state, factor), which returns a new one"
    )
  new_state = optimizer_state.set_lr_factor(nnx.as_pure(optimizer.opt_state), factor)
  nnx.update(optimizer.opt_state, nnx.state(new_state))
