"""In-graph: scale the optimizer's updates by a learning-rate factor the host sets between steps.

:func:`scale_by_lr_factor` comes last in the optimizer chain, after
:func:`simigrad_jax.transform` and the optimizer; :func:`check_chain_order`
refuses an initialised chain that has them in another order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from simigrad_jax import validation
from simigrad_jax.errors import SimiGradError
from simigrad_jax.ingraph.transform import SimilarityState

CHAIN = (
  "optax.chain(simigrad_jax.transform(...), <the optimizer>, simigrad_jax.scale_by_lr_factor())"
)
"""The order of the optimizer chain that SimiGrad needs, as the fix of :class:`ChainOrderError`."""


class ChainOrderError(SimiGradError, ValueError):
  """An optimizer chain without :func:`simigrad_jax.transform` first and
  :func:`scale_by_lr_factor` last (see :func:`check_chain_order`)."""


class LrFactorState(NamedTuple):
  """State of :func:`scale_by_lr_factor`."""

  lr_factor: jax.Array  # float32 scalar multiplying every update; set by the host.


def scale_by_lr_factor(initial_lr_factor: float = 1.0) -> optax.GradientTransformation:
  """Multiplies the updates by a factor held in the state, so the host can change it without recompiling.

  Put it LAST in the chain: scaling the final update of an optax optimizer is the
  same as scaling its learning rate for that step (SGD with momentum, Adam,
  LAMB, decoupled weight decay alike), which is how SimiGrad makes the learning
  rate follow the batch size. The host writes a new factor with
  :func:`simigrad_jax.set_lr_factor`; the value keeps its float32 dtype, shape
  and placement, so the compiled step is reused.

  Args:
    initial_lr_factor: the factor before the host sets one (1.0: the base
      learning rate).

  Returns:
    An ``optax.GradientTransformation`` whose state is :class:`LrFactorState`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, simigrad_jax
    >>> opt = optax.chain(optax.sgd(0.1), simigrad_jax.scale_by_lr_factor())
    >>> params = jnp.ones(2)
    >>> state = opt.init(params)
    >>> update = jax.jit(opt.update)
    >>> state = simigrad_jax.set_lr_factor(state, simigrad_jax.lr_factor(512, 128))
    >>> updates, _ = update(jnp.ones(2), state)
    >>> print(updates)
    [-0.2 -0.2]
  """

  finite_and_positive = (
    validation.is_real(initial_lr_factor) and 0.0 < float(initial_lr_factor) < math.inf
  )  # NaN fails too
  if not finite_and_positive:
    raise ValueError(
      f"initial_lr_factor must be a finite number > 0 (a negative one is an ascent), got "
      f"{initial_lr_factor!r}"
    )

  def init_fn(params: optax.Params) -> LrFactorState:
    del params
    return LrFactorState(lr_factor=jnp.asarray(initial_lr_factor, jnp.float32))

  def update_fn(
    updates: optax.Updates, state: LrFactorState, params: optax.Params | None = None
  ) -> tuple[optax.Updates, LrFactorState]:
    del params
    scaled = jax.tree.map(lambda u: (u * state.lr_factor).astype(u.dtype), updates)
    return scaled, state

  return optax.GradientTransformation(init_fn, update_fn)


def check_chain_order(opt_state: Any) -> None:
  """Refuses an optimizer state whose chain does not start with the transform and end with the factor.

  An optax chain is two opaque functions, but its state is a tuple holding
  each link's state in the chain's order, so the initialised state shows the
  order: :class:`~simigrad_jax.ingraph.transform.SimilarityState` must be the
  first link's state and :class:`LrFactorState` the last one's, at every
  level of nested chains. A wrapper around the whole chain
  (``optax.inject_hyperparams``, ``optax.MultiSteps``, a dict of chains) keeps
  the position of what it wraps. The order matters: the transform must see
  the half-batch gradients before anything changes them, and a factor
  before the optimizer would scale its gradients, not its step (Adam undoes
  that), so that the learning rate would no longer follow the batch size.

  Args:
    opt_state: the optimizer's state (``optimizer.init(params)``).

  Raises:
    ChainOrderError: naming the misplaced state's position and the chain to build.

  Example:
    >>> import jax.numpy as jnp, optax, simigrad_jax
    >>> from simigrad_jax.ingraph import lr_scaling
    >>> good = optax.chain(simigrad_jax.transform(), optax.sgd(0.1), simigrad_jax.scale_by_lr_factor())
    >>> lr_scaling.check_chain_order(good.init(jnp.zeros(2)))
    >>> bad = optax.chain(simigrad_jax.transform(), simigrad_jax.scale_by_lr_factor(), optax.sgd(0.1))
    >>> try:
    ...   lr_scaling.check_chain_order(bad.init(jnp.zeros(2)))
    ... except lr_scaling.ChainOrderError as error:
    ...   print(str(error).split(";")[0])
    simigrad_jax.scale_by_lr_factor() must come last in the optimizer chain, but its LrFactorState is opt_state[1] of 3
  """
  misplaced = _chain_positions(opt_state)
  if misplaced:
    state_type, name, place, path, length = misplaced[0]
    raise ChainOrderError(
      f"{name} must come {place} in the optimizer chain, but its {state_type.__name__} is "
      f"opt_state{path}{length}; build {CHAIN}"
    )


def _chain_positions(
  node: Any, path: str = "", first: bool = True, last: bool = True, length: str = ""
) -> list[tuple[type, str, str, str, str]]:
  """The SimiGrad states under ``node`` out of place: ``(state type, its producer, "first" or
  "last", its path, " of N" for the chain holding it)``. ``first`` and ``last``: whether
  ``node`` is the first and the last link of every chain above it."""
  if isinstance(node, SimilarityState):
    return [] if first else [(SimilarityState, "simigrad_jax.transform", "first", path, length)]
  if isinstance(node, LrFactorState):
    return (
      [] if last else [(LrFactorState, "simigrad_jax.scale_by_lr_factor()", "last", path, length)]
    )
  misplaced = []
  if type(node) in (tuple, list):  # a chain's state: its links' states in order
    for i, link in enumerate(node):
      at_first, at_last = first and i == 0, last and i == len(node) - 1
      misplaced += _chain_positions(link, f"{path}[{i}]", at_first, at_last, f" of {len(node)}")
  elif isinstance(node, tuple) and hasattr(node, "_fields"):  # a wrapper's state (NamedTuple)
    for field in node._fields:
      misplaced += _chain_positions(getattr(node, field), f"{path}.{field}", first, last, length)
  elif isinstance(node, Mapping):  # e.g. optax.multi_transform's chain for each label
    for key, value in node.items():
      misplaced += _chain_positions(value, f"{path}[{key!r}]", first, last, length)
  return misplaced
