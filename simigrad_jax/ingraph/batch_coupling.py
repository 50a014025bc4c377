"""In-graph: Adam's beta2 and weight decay that follow the batch size, held in the optimizer state.

:func:`couple_to_batch_size` wraps an optax optimizer (``optax.adamw``,
``optax.lamb``, ``optax.adam``, ...) in ``optax.inject_hyperparams`` and, at
every update, sets its ``b2`` and ``weight_decay`` from the batch size held in
its state (:class:`BatchCouplingState`). The host writes the batch size
between steps (:func:`simigrad_jax.set_coupled_batch_size`), or
:class:`simigrad_jax.Trainer`'s step writes that step's size in-graph: a new
batch size is a new value, never a new program.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from simigrad_jax import validation

# The learning-rate rules whose batch-size part the weight decay divides out (as lr_factor's).
COUPLING_LR_RULES: tuple[str, ...] = ("sqrt", "linear", "none")


class BatchCouplingState(NamedTuple):
  """State of :func:`couple_to_batch_size`."""

  coupled_batch_size: jax.Array  # float32 scalar: the batch size B of the next update.
  inner_state: Any  # the wrapped optimizer's InjectHyperparamsState.


def _as_python_number(value: Any) -> Any:
  """``value`` as Python's int or float where it is a number, else as it is."""
  if not validation.is_real(value):
    return value
  return int(value) if validation.is_int(value) else float(value)


def couple_to_batch_size(
  optimizer: Callable[..., optax.GradientTransformation],
  base_batch_size: int,
  *,
  couple_beta2: bool = True,
  couple_weight_decay: bool = True,
  lr_rule: str = "sqrt",
  **hyperparams: Any,
) -> optax.GradientTransformation:
  """Makes Adam's ``b2`` and ``weight_decay`` follow the batch size, with no recompilation.

  With ``r = B / B_0`` (B the batch size held in the state, ``B_0 =
  base_batch_size`` the size the hyperparameters are tuned for):

  * ``couple_beta2``: ``b2' = b2^r``. Marek et al. 2025 (arXiv 2507.07101)
    keep the half-life of Adam's second-moment average fixed in tokens:
    ``b2`` averages over ``ln(1/2) / ln(b2)`` steps, i.e. ``B ln(1/2) / ln(b2)``
    examples, which ``b2^r`` holds fixed when the batch becomes ``B``.
  * ``couple_weight_decay``: ``weight_decay' = weight_decay * r / rule(r)``,
    ``rule`` the learning-rate rule (``sqrt(r)``, ``r`` or 1). Power Lines
    (Bergsma et al. 2025, arXiv 2505.13738) find the best AdamW timescale
    ``tau = B / (eta * lambda * D)`` (in epochs of the D training tokens)
    nearly constant; with ``eta = eta_0 * rule(r)`` set by the Trainer, this
    keeps ``eta * lambda`` proportional to ``B``, so ``tau`` stays fixed as the
    batch changes: ``lambda * sqrt(r)`` under the sqrt rule, ``lambda``
    under the linear rule.

  Put it where the optimizer would go, before
  :func:`simigrad_jax.scale_by_lr_factor` (which scales the whole update,
  decay included, so the Trainer's learning-rate factor is ``eta``'s
  batch-size part above).

  Args:
    optimizer: an optax optimizer factory taking ``b2`` and/or
      ``weight_decay`` (``optax.adamw``, ``optax.lamb``, ...).
    base_batch_size: ``B_0`` (integer >= 1): the Trainer's controller's
      ``initial_batch_size``.
    couple_beta2: scale ``b2`` as above.
    couple_weight_decay: scale ``weight_decay`` as above.
    lr_rule: the learning-rate rule the Trainer applies (``"sqrt"``,
      ``"linear"``, ``"none"``).
    **hyperparams: the optimizer's arguments (``learning_rate``, ``b2``,
      ``weight_decay``, ``mask``, ...): numbers become float32 values in the
      state (``optax.inject_hyperparams``), anything else (a ``mask``
      function) stays a static argument.

  Returns:
    An ``optax.GradientTransformation`` whose state is :class:`BatchCouplingState`.
    The Adam bias correction uses the current ``b2`` (as with any injected
    ``b2``).

  Example:
    >>> import jax.numpy as jnp, optax, simigrad_jax
    >>> opt = simigrad_jax.couple_to_batch_size(
    ...     optax.adamw, 64, learning_rate=1e-3, b2=0.99, weight_decay=0.1)
    >>> state = simigrad_jax.set_coupled_batch_size(opt.init(jnp.zeros(3)), 256)
    >>> _, state = opt.update(jnp.ones(3), state, jnp.zeros(3))
    >>> hp = state.inner_state.hyperparams
    >>> print(f"{float(hp['b2']):.6f} {float(hp['weight_decay']):.3f}")  # 0.99^4, 0.1 * sqrt(4)
    0.960596 0.200
  """
  if not (validation.is_int(base_batch_size) and base_batch_size >= 1):
    raise ValueError(f"base_batch_size must be an integer >= 1, got {base_batch_size!r}")
  if lr_rule not in COUPLING_LR_RULES:
    raise ValueError(f"lr_rule={lr_rule!r} is not valid; choose one of {COUPLING_LR_RULES}")
  coupled = {"b2": couple_beta2, "weight_decay": couple_weight_decay}
  for name, on in coupled.items():
    value = hyperparams.get(name)
    if on and not validation.is_real(value):
      raise ValueError(
        f"coupling {name} needs {name}=<a number> among the optimizer's hyperparameters, "
        f"got {value!r} (or pass couple_{'beta2' if name == 'b2' else name}=False)"
      )
  # The coupled values are powers and multiples of these: a NaN would train on NaN, a b2 of 1
  # or more would never forget (b2^r >= 1), a negative decay would grow the weights.
  if couple_beta2 and not 0 <= hyperparams["b2"] < 1:
    raise ValueError(f"coupling b2 needs b2 in [0, 1), got {hyperparams['b2']!r}")
  if couple_weight_decay and not 0 <= hyperparams["weight_decay"] < math.inf:
    raise ValueError(
      f"coupling weight_decay needs a finite weight_decay >= 0, got {hyperparams['weight_decay']!r}"
    )
  # Numbers go into the state as Python's (optax takes NumPy's scalars for static arguments);
  # anything else (a mask function, a flag) stays a static argument.
  hyperparams = {name: _as_python_number(value) for name, value in hyperparams.items()}
  static = tuple(name for name, value in hyperparams.items() if not validation.is_real(value))
  inner = optax.inject_hyperparams(optimizer, static_args=static)(**hyperparams)
  base = {name: float(hyperparams[name]) for name, on in coupled.items() if on}
  base_batch_size = int(base_batch_size)

  def coupled_values(batch_size: jax.Array) -> dict[str, jax.Array]:
    ratio = batch_size / base_batch_size
    rule = {"sqrt": jnp.sqrt(ratio), "linear": ratio, "none": jnp.ones_like(ratio)}[lr_rule]
    values = {}
    if "b2" in base:
      values["b2"] = jnp.power(jnp.float32(base["b2"]), ratio)
    if "weight_decay" in base:
      values["weight_decay"] = base["weight_decay"] * ratio / rule
    return values

  def init_fn(params: optax.Params) -> BatchCouplingState:
    return BatchCouplingState(jnp.asarray(base_batch_size, jnp.float32), inner.init(params))

  def update_fn(
    updates: optax.Updates,
    state: BatchCouplingState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, BatchCouplingState]:
    old = state.inner_state.hyperparams
    values = coupled_values(state.coupled_batch_size)
    hyper = {**old, **{k: v.astype(jnp.result_type(old[k])) for k, v in values.items()}}
    inner_state = state.inner_state._replace(hyperparams=hyper)
    updates, inner_state = inner.update(updates, inner_state, params, **extra_args)
    return updates, BatchCouplingState(state.coupled_batch_size, inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def with_batch_size(opt_state: Any, batch_size: jax.Array) -> Any:
  """``opt_state`` with every :class:`BatchCouplingState`'s batch size set to ``batch_size`` (in-graph).

  A state without one is returned as it is. The Trainer's step calls it
  with the step's number of real examples.
  """

  def is_coupling(node: Any) -> bool:
    return isinstance(node, BatchCouplingState)

  def set_size(node: Any) -> Any:
    if not is_coupling(node):
      return node
    size = jnp.asarray(batch_size, node.coupled_batch_size.dtype)
    return node._replace(coupled_batch_size=jnp.broadcast_to(size, node.coupled_batch_size.shape))

  return jax.tree.map(set_size, opt_state, is_leaf=is_coupling)
