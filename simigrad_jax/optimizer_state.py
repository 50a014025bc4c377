"""Host: read the similarity from, and write the learning-rate factor and batch size into, an optax state.

The states are found by name anywhere inside a chained or wrapped optax state
(``optax.chain``, ``optax.inject_hyperparams``, ``optax.MultiSteps``, ...) with
``optax.tree_utils``. They may be replicated the ``jax.pmap`` way (a leading
device axis) or the ``jax.shard_map`` way (one global array); in both cases
the host reads the copy on this process's first device, which is enough since
every device holds the same value.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from simigrad_jax import validation
from simigrad_jax.ingraph.batch_coupling import BatchCouplingState
from simigrad_jax.ingraph.lr_scaling import LrFactorState
from simigrad_jax.ingraph.transform import SimilarityState

_State = TypeVar("_State")


def _find(opt_state: Any, state_type: type[_State], producer: str) -> _State:
  # A leaf walk with is_leaf runs in C++ (microseconds, where optax's search by
  # name takes about 0.1 ms): it runs on the host between steps, every step.
  def is_state(node: Any) -> bool:
    return isinstance(node, state_type)

  found = [node for node in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(node)]
  if len(found) == 1:
    return found[0]
  if not found:
    raise ValueError(
      f"no {state_type.__name__} in this optimizer state; chain {producer} into the optimizer"
    )
  with_paths = optax.tree_utils.tree_get_all_with_path(opt_state, state_type.__name__)
  paths = [jax.tree_util.keystr(tuple(path)) for path, _ in with_paths]
  raise ValueError(
    f"{len(with_paths)} {state_type.__name__}s in this optimizer state, at {paths}; expected one"
  )


def _first_copy(value: Any) -> Any:
  if isinstance(value, jax.Array):
    value = value.addressable_data(0)
  return value


def _read_scalars(values: Iterable[Any]) -> list[Any]:
  """The scalars ``values`` (device arrays, replicated) as NumPy scalars, from the first device."""
  host = jax.device_get([_first_copy(v) for v in values])
  return [np.asarray(v).reshape(-1)[0] for v in host]


def similarity_stats(opt_state: Any) -> dict[str, float | bool | int]:
  """Returns everything :func:`simigrad_jax.transform` measured at the last step, in one read.

  Args:
    opt_state: an optimizer state containing a :class:`SimilarityState`.

  Returns:
    A dict with ``similarity`` (NaN when the step gave no measurement),
    ``norm_a``, ``norm_b``, ``norm_mean`` (floats), ``measured`` and
    ``grads_finite`` (bools) and ``nonfinite_count`` (int).

  Example:
    >>> import jax.numpy as jnp, optax, simigrad_jax
    >>> state = optax.chain(simigrad_jax.transform("batch"), optax.sgd(0.1)).init(jnp.zeros(2))
    >>> simigrad_jax.similarity_stats(state)["measured"]
    False
  """
  state = _find(opt_state, SimilarityState, "simigrad_jax.transform")
  values = dict(zip(SimilarityState._fields, _read_scalars(state), strict=True))
  measured = bool(values["measured"])
  return {
    "similarity": float(values["similarity"]) if measured else math.nan,
    "norm_a": float(values["norm_a"]),
    "norm_b": float(values["norm_b"]),
    "norm_mean": float(values["norm_mean"]),
    "measured": measured,
    "grads_finite": bool(values["grads_finite"]),
    "nonfinite_count": int(values["nonfinite_count"]),
  }


def similarity(opt_state: Any) -> float:
  """Returns the last step's cosine similarity of the two half-batch gradients, NaN if none.

  NaN means the last step gave no measurement (non-finite gradients, a
  zero-norm half, or no step taken yet); :class:`simigrad_jax.Controller`
  leaves the batch size unchanged on NaN.

  Args:
    opt_state: an optimizer state containing a :class:`SimilarityState`
      (from :func:`simigrad_jax.transform`), at any depth.

  Returns:
    A Python float in [-1, 1], or NaN.
  """
  state = _find(opt_state, SimilarityState, "simigrad_jax.transform")
  value, measured = _read_scalars((state.similarity, state.measured))  # one wait, two transfers
  return float(value) if measured else math.nan


# How an nnx.Optimizer's state is set in place, for the fields the setters here write.
_NNX_SETTERS = {
  "lr_factor": "simigrad_jax.set_nnx_lr_factor(optimizer, factor)",
  "coupled_batch_size": (
    "nnx.update(optimizer.opt_state, nnx.state(simigrad_jax.set_coupled_batch_size("
    "nnx.as_pure(optimizer.opt_state), batch_size)))"
  ),
}


def _refuse_nnx_variable(old: Any, name: str) -> None:
  """Raises when ``old`` is a Flax NNX variable: the state is an ``nnx.Optimizer``'s.

  A new state built from it would hold plain arrays where the optimizer's
  variables were, and the next ``optimizer.update`` fails far from here
  ("Cannot set key ... on immutable node"); the NNX setter changes the
  variables in place.
  """
  if isinstance(old, (jax.Array, np.ndarray, np.generic, int, float)):
    return
  if type(old).__module__.startswith("flax."):
    raise ValueError(
      f"this optimizer state holds Flax NNX variables ({type(old).__name__}: an "
      f"nnx.Optimizer's opt_state), which a new state of arrays cannot replace; set its "
      f"{name} in place with {_NNX_SETTERS[name]}"
    )


def _with_scalar(opt_state: Any, old: Any, name: str, value: float) -> Any:
  """``opt_state`` with the field ``name`` (now ``old``) set to ``value``, keeping its dtype,
  shape and placement."""
  _refuse_nnx_variable(old, name)
  new_value: np.ndarray | jax.Array = np.full(
    np.shape(old), value, dtype=np.asarray(_first_copy(old)).dtype
  )
  if isinstance(old, jax.Array):
    # Keep the placement: committed arrays (pmap and shard_map layouts) stay
    # where they were; an uncommitted one stays free for jit to place.
    new_value = jax.device_put(new_value, old.sharding) if old.committed else jnp.asarray(new_value)
  return optax.tree_utils.tree_set(opt_state, **{name: new_value})


def set_lr_factor(opt_state: Any, factor: float) -> Any:
  """Returns ``opt_state`` with the learning-rate factor of :func:`scale_by_lr_factor` set to ``factor``.

  The new value has the old one's float32 dtype, shape and device placement,
  so a jitted, pmapped or shard_mapped step runs with it without recompiling.

  Args:
    opt_state: an optimizer state containing one :class:`LrFactorState`, of
      arrays (an ``nnx.Optimizer``'s state, of NNX variables, is refused:
      :func:`simigrad_jax.set_nnx_lr_factor` sets it in place).
    factor: the new factor, finite and > 0 (e.g. from :func:`lr_factor`).

  Returns:
    The new optimizer state (the input is not modified).
  """
  factor = validation.check_lr_factor(factor, "the learning-rate factor")
  old = _find(opt_state, LrFactorState, "simigrad_jax.scale_by_lr_factor()").lr_factor
  return _with_scalar(opt_state, old, "lr_factor", factor)


def set_coupled_batch_size(opt_state: Any, batch_size: int) -> Any:
  """Returns ``opt_state`` with the batch size of :func:`couple_to_batch_size` set to ``batch_size``.

  The next update sets Adam's ``b2`` and ``weight_decay`` from it. Like
  :func:`set_lr_factor`, the value keeps its dtype, shape and placement: no
  recompilation. :class:`simigrad_jax.Trainer` sets it itself, in its step.

  Args:
    opt_state: an optimizer state containing one :class:`BatchCouplingState`.
    batch_size: the global batch size of the next step (an integer >= 1).

  Returns:
    The new optimizer state (the input is not modified).
  """
  size = validation.check_int("batch_size", batch_size, 1)
  old = _find(
    opt_state, BatchCouplingState, "simigrad_jax.couple_to_batch_size(...)"
  ).coupled_batch_size
  return _with_scalar(opt_state, old, "coupled_batch_size", float(size))


def lr_factor_of(opt_state: Any) -> float:
  """Returns the learning-rate factor currently held in ``opt_state``."""
  old = _find(opt_state, LrFactorState, "simigrad_jax.scale_by_lr_factor()").lr_factor
  return float(np.asarray(jax.device_get(_first_copy(old))).reshape(-1)[0])
