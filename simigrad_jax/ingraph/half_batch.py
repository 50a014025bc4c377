"""In-graph: gradients of the two halves of one device's batch, for the local-halves split."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from simigrad_jax.ingraph.transform import HalfGrads


def _split_in_two(batch: Any) -> Any:
  leaves = jax.tree.leaves(batch)
  if not leaves:
    raise ValueError("value_and_half_grads needs a batch with at least one array")
  sizes = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
  if len(sizes) != 1 or None in sizes:
    raise ValueError(
        f"every array in the batch needs the same leading (example) axis; got sizes {sorted(map(str, sizes))}"
    )
  (size,) = sizes
  if size % 2:
    raise ValueError(
        f"the local batch has {size} examples; splitting it into two equal halves "
        "needs an even number (pad it with a zero-weight example)"
    )
  return jax.tree.map(lambda x: x.reshape((2, size // 2) + x.shape[1:]), batch)


def value_and_half_grads(
    loss_fn: Callable[..., Any], has_aux: bool = False
) -> Callable[..., tuple[Any, Any, HalfGrads]]:
  """Wraps ``loss_fn`` to return its value, its gradient and the two half-batch gradients.

  The batch (any pytree of arrays with a shared leading example axis) is cut
  into its first and second halves; ``loss_fn`` runs on each half (one
  vectorised pass, so the cost is that of one full-batch gradient), and the
  full gradient is the average of the two. Pass the result to
  :func:`simigrad_jax.transform` as ``half_grads`` to measure the similarity
  on one device, or on an odd number of devices.

  Args:
    loss_fn: ``loss_fn(params, batch, *args)`` returning a scalar loss that is a
      MEAN over the examples of ``batch`` (or ``(loss, aux)`` with
      ``has_aux``). The halves have equal size, so the average of the two half
      losses and gradients is exactly the full-batch loss and gradient.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

  Returns:
    A function ``(params, batch, *args) -> (value, grads, half_grads)``:
    ``value`` is the full-batch loss (with ``has_aux``: ``(loss, aux)`` where
    every leaf of ``aux`` has a leading axis of 2, one entry per half),
    ``grads`` the full-batch gradient, and ``half_grads`` a
    :class:`HalfGrads` of the two half gradients.

  Example:
    >>> import jax, jax.numpy as jnp, optax, simigrad_jax
    >>> loss = lambda p, x: jnp.mean((x - p) ** 2)
    >>> opt = optax.chain(simigrad_jax.transform("batch"), optax.sgd(0.1))
    >>> def step(p, state, x):
    ...   value, grads, halves = simigrad_jax.value_and_half_grads(loss)(p, x)
    ...   updates, state = opt.update(grads, state, p, half_grads=halves)
    ...   return optax.apply_updates(p, updates), state
    >>> p = jnp.zeros(()); s = opt.init(p)
    >>> p1, s1 = jax.pmap(step, axis_name="batch")(p[None], jax.tree.map(lambda a: a[None], s),
    ...                                            jnp.arange(4.0)[None])  # doctest: +SKIP

  Note:
    With BatchNorm in training mode each half is normalised with its own
    statistics, which is what makes the two halves independent.
  """
  value_and_grad = jax.value_and_grad(loss_fn, has_aux=has_aux)

  def wrapped(params, batch, *args):
    halves = _split_in_two(batch)
    in_axes = (None, 0) + (None,) * len(args)
    values, grads = jax.vmap(value_and_grad, in_axes=in_axes)(params, halves, *args)
    first = jax.tree.map(lambda g: g[0], grads)
    second = jax.tree.map(lambda g: g[1], grads)
    mean_grads = jax.tree.map(
        lambda a, b: ((a.astype(jnp.float32) + b.astype(jnp.float32)) / 2).astype(a.dtype),
        first, second,
    )
    if has_aux:
      loss, aux = values
      value = (jnp.mean(loss), aux)
    else:
      value = jnp.mean(values)
    return value, mean_grads, HalfGrads(first, second)

  return wrapped
