"""The optimizer chain and learning-rate schedule of a config.

The chain is always ``simigrad_jax.transform`` (mean gradient + half-batch
similarity) -> the config's optimizer -> ``simigrad_jax.scale_by_lr_factor()``
(the learning rate follows the batch size). The schedule is a multiplier of
the base learning rate as a function of the (fractional) epochs trained, which
the Trainer writes into the optimizer state together with the batch-size
factor, so neither costs a recompilation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import optax

import simigrad_jax
from simigrad_jax.ramps import SeesawController

OPTIMIZERS: tuple[str, ...] = ("sgd", "adamw", "lamb")
SCHEDULES: tuple[str, ...] = ("constant", "step", "cosine")
# The Trainer needs a positive factor; a schedule that reaches zero is held here.
MIN_SCHEDULE_FACTOR = 1e-4


def _decay_mask(params: Any) -> Any:
  """True for weight matrices and kernels; False for biases, norm scales and offsets (ndim < 2)."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def create_optimizer(
  config: ml_collections.ConfigDict, then: optax.GradientTransformation | None = None
) -> optax.GradientTransformation:
  """Builds the optimizer chain of ``config``.

  * ``"sgd"``: SGD with ``momentum`` (and ``nesterov``); ``weight_decay`` is
    added to the gradient before the momentum, as PyTorch's SGD does (the
    reference's ResNet settings), on every parameter.
  * ``"adamw"``: ``optax.adamw`` with decoupled ``weight_decay`` on weight
    matrices only.
  * ``"lamb"``: ``optax.lamb`` with ``weight_decay`` on weight matrices only
    (biases and LayerNorm parameters excluded, as in BERT).

  With ``adam_coupling`` (``"beta2"``, ``"weight_decay"`` or both, comma
  separated), adamw's or lamb's ``b2`` and ``weight_decay`` follow the batch
  size (``simigrad_jax.couple_to_batch_size``): ``b2^(B / B_0)`` (Marek et al.
  2025) and ``weight_decay * (B / B_0) / lr_rule(B / B_0)`` (Power Lines).

  Args:
    config: the experiment config.
    then: a link to run on the optimizer's step before the learning-rate
      factor (e.g. ``optax.inject_hyperparams(optax.scale)(step_size=lr)``, a
      learning rate kept in the state), or None.

  Returns:
    ``transform -> optimizer [-> then] -> scale_by_lr_factor``.

  Raises:
    ValueError: for an unknown optimizer.
  """
  lr = config.learning_rate
  if config.optimizer not in ("adamw", "lamb") and adam_coupling(config):
    raise ValueError(
      f"config.adam_coupling={config.adam_coupling!r} couples Adam's b2 and weight decay: "
      f"it needs optimizer 'adamw' or 'lamb', not {config.optimizer!r}"
    )
  if config.optimizer == "sgd":
    base = optax.chain(
      optax.add_decayed_weights(config.weight_decay) if config.weight_decay else optax.identity(),
      optax.sgd(lr, momentum=config.momentum or None, nesterov=config.nesterov),
    )
  elif config.optimizer in ("adamw", "lamb"):
    factory = optax.adamw if config.optimizer == "adamw" else optax.lamb
    hyperparams = dict(
      learning_rate=lr,
      b1=config.b1,
      b2=config.b2,
      eps=config.eps,
      weight_decay=config.weight_decay,
      mask=_decay_mask,
    )
    coupled = adam_coupling(config)
    base = (
      simigrad_jax.couple_to_batch_size(
        factory,
        config.initial_batch_size,
        couple_beta2="beta2" in coupled,
        couple_weight_decay="weight_decay" in coupled,
        lr_rule=config.lr_rule,
        **hyperparams,
      )
      if coupled
      else factory(**hyperparams)
    )
  else:
    raise ValueError(f"unknown optimizer {config.optimizer!r}; choose one of {OPTIMIZERS}")
  if config.grad_clip_norm:
    base = optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), base)
  if then is not None:
    base = optax.chain(base, then)
  return optax.chain(
    simigrad_jax.transform("batch", reduction=config.reduction),
    base,
    simigrad_jax.scale_by_lr_factor(),
  )


ADAM_COUPLINGS: tuple[str, ...] = ("beta2", "weight_decay")


def adam_coupling(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The hyperparameters ``config.adam_coupling`` couples to the batch size (``()``: none).

  Raises:
    ValueError: for a name not in :data:`ADAM_COUPLINGS`.
  """
  names = tuple(n.strip() for n in str(config.get("adam_coupling", "")).split(",") if n.strip())
  unknown = [n for n in names if n not in ADAM_COUPLINGS]
  if unknown:
    raise ValueError(
      f"config.adam_coupling={config.adam_coupling!r} names {unknown}; use a comma-separated "
      f"subset of {ADAM_COUPLINGS}, or '' for none"
    )
  return names


def create_lr_schedule(
  config: ml_collections.ConfigDict, controller: Any = None, num_examples: int | None = None
) -> Callable[[float], float]:
  """The learning-rate multiplier as a function of epochs trained (fractional).

  A linear warm-up from 0 to 1 over the first ``warmup_epochs`` (none if 0),
  times one of:

  * ``"constant"``: 1;
  * ``"step"``: ``lr_decay_factor ** (number of lr_decay_epochs passed)``,
    e.g. x0.1 at epochs 80 and 120 for the CIFAR-10 reference;
  * ``"cosine"``: half a cosine from 1 at the end of the warm-up to 0 at
    ``num_epochs``.

  The result is never below ``MIN_SCHEDULE_FACTOR`` (the Trainer refuses a
  zero learning rate). With the ``"seesaw"`` controller, the decay is
  Seesaw's (``SeesawController.lr_schedule``: the rate falls at its halving
  points) times the warm-up; the config's ``lr_schedule`` must then be
  ``"constant"``.

  Args:
    config: the experiment config.
    controller: the run's batch-size controller (optional).
    num_examples: the examples in one epoch (needed with ``"seesaw"``).

  Returns:
    ``schedule(epochs) -> float``.

  Raises:
    ValueError: for an unknown schedule, negative epochs, a warm-up as long
      as the run or longer, or a decay given twice (``"seesaw"`` with a
      ``"step"`` or ``"cosine"`` schedule).
  """
  kind, warmup = config.lr_schedule, float(config.warmup_epochs)
  if kind not in SCHEDULES:
    raise ValueError(f"unknown lr_schedule {kind!r}; choose one of {SCHEDULES}")
  if warmup < 0:
    raise ValueError(f"warmup_epochs must be >= 0, got {warmup}")
  boundaries = sorted(float(e) for e in config.lr_decay_epochs)
  factor, total = float(config.lr_decay_factor), float(config.num_epochs)
  if warmup > 0 and warmup >= total:
    raise ValueError(
      f"config.warmup_epochs={warmup:g} is not below config.num_epochs={total:g}: the learning "
      f"rate would never reach its peak"
      + (" and the cosine would never start" if kind == "cosine" else "")
      + "; give a warm-up shorter than the run"
    )

  def schedule(epochs: float) -> float:
    value = 1.0
    if warmup > 0 and epochs < warmup:
      value = max(epochs / warmup, MIN_SCHEDULE_FACTOR)
    if kind == "step":
      value *= factor ** sum(epochs >= b for b in boundaries)
    elif kind == "cosine":
      progress = min(max((epochs - warmup) / max(total - warmup, 1e-9), 0.0), 1.0)
      value *= 0.5 * (1.0 + math.cos(math.pi * progress))
    return max(value, MIN_SCHEDULE_FACTOR)

  if isinstance(controller, SeesawController):
    if kind != "constant":
      raise ValueError(
        f"the seesaw controller decays the learning rate at its halving points; "
        f"config.lr_schedule={kind!r} would decay it twice: use 'constant' "
        "(config.warmup_epochs still applies)"
      )
    if num_examples is None:
      raise ValueError("the seesaw controller's learning rate needs num_examples (epoch size)")
    return controller.lr_schedule(
      num_examples,
      lr_rule=config.lr_rule,
      lr_adjust_factor=config.lr_adjust_factor,
      base_schedule=schedule,
    )
  return schedule
