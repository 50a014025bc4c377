"""In-graph: scale the optimizer's updates by a learning-rate factor the host sets between steps."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


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
