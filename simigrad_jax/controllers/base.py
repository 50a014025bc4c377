"""Host: what every batch-size controller of :mod:`simigrad_jax.controllers.registry` shares.

:class:`BaseController` counts steps, holds the size on non-finite steps,
applies the bounds, logs decisions and saves its state as plain JSON; the
controllers (schedules, loss plateau, noise scale) supply only their rule.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from simigrad_jax import validation
from simigrad_jax.controllers.simigrad import BoundedBatchSize

logger = logging.getLogger("simigrad_jax")

STATE_VERSION = 1
DECISIONS: tuple[str, ...] = ("grow", "shrink", "hold", "clamped", "warmup", "nonfinite")


class BaseController(BoundedBatchSize):
  """Step counting, non-finite handling, bounds, logging and JSON state of a controller.

  Subclasses set ``KIND`` and ``REQUIRED_STATS`` (the keys of ``stats`` that
  :meth:`update` needs; checked before anything changes), call ``_init_base``
  and implement ``_observe`` (take a step's measurements; say whether the step
  counts as finite), ``_decide`` (return the next size and the decision; the
  bounds are applied afterwards), ``_settings`` (their config entries) and
  ``_dynamic_state`` / ``_parse_dynamic_state`` (their part of the JSON state).
  """

  KIND = "base"
  REQUIRED_STATS: tuple[str, ...] = ()

  def _init_base(self, initial_batch_size: Any, lower: Any, upper: Any,
                 warmup_steps: Any = 0, verbose: Any = False) -> None:
    self._init_bounded_batch_size(initial_batch_size, lower, upper)
    self._warmup = validation.check_int("warmup_steps", warmup_steps, 0)
    self._verbose = validation.check_bool("verbose", verbose)

  # ---------------------------------------------------------------- read-only

  @property
  def config(self) -> dict[str, Any]:
    """The settings that determine future sizes (plain JSON data)."""
    return {
        "controller": self.KIND,
        "initial_batch_size": self._initial,
        "similarity_target": None,
        "batch_size_lower_bound": self._lower,
        "batch_size_upper_bound": self._upper,
        **self._settings(),
    }

  # ------------------------------------------------------------------ actions

  def update(self, similarity: float, stats: Mapping[str, Any] | None = None) -> int:
    """Takes this step's measurements; returns the next batch size.

    Call once after every optimizer step. A non-finite similarity, or a step
    whose ``stats`` say ``grads_finite`` is False, keeps the size and is
    counted in :attr:`nonfinite_count`; so is a non-finite value among the
    stats the controller reads.

    Args:
      similarity: the cosine similarity of the two half-batch gradients
        (anything ``float()`` accepts).
      stats: the step's measurements as :class:`simigrad_jax.Trainer` passes
        them (``loss``, ``norm_a``, ``norm_b``, ``norm_mean``, ``batch_size``,
        ``examples_seen``, ``epochs``, ``epoch_end``, ``grads_finite``);
        which keys a controller needs is in its docstring.

    Returns:
      The batch size for the next step (also :attr:`batch_size`).
    """
    if self.REQUIRED_STATS:
      require_stats(self.KIND, stats, self.REQUIRED_STATS)
    s = float(similarity)
    self._step += 1
    self._last_similarity = s
    before = self._batch_size
    bad_step = stats is not None and validation.is_bool(stats.get("grads_finite")) and not stats["grads_finite"]
    finite = self._observe(s, stats, math.isfinite(s) and not bad_step)
    if not finite:
      self._nonfinite += 1
      decision = "nonfinite"
    elif self._step <= self._warmup:
      decision = "warmup"
    else:
      new, decision = self._decide()
      clamped = self._clamp(new)
      if clamped != new:
        decision = "clamped"
      self._batch_size = clamped
    self._last_decision = decision
    if self._verbose:
      logger.info("%s step %d: %s, batch size %d -> %d%s", self.KIND, self._step, decision,
                  before, self._batch_size, self._log_details())
    return self._batch_size

  # -------------------------------------------------------------- checkpoints

  def state_dict(self) -> dict[str, Any]:
    """Returns the controller's state as plain JSON data.

    Loading it into a controller built with the same settings continues the
    run exactly: same sizes, same decisions.
    """
    return {
        "version": STATE_VERSION,
        "controller": self.KIND,
        "config": self.config,
        "batch_size": self._batch_size,
        "step": self._step,
        "nonfinite_count": self._nonfinite,
        "last_decision": self._last_decision,
        **self._dynamic_state(),
    }

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restores a state from :meth:`state_dict` (e.g. after ``json.loads``).

    Nothing changes if the state is refused.

    Args:
      state: the dict :meth:`state_dict` returned.

    Raises:
      ValueError: for an unknown version, another kind of controller, a
        ``config`` section that differs from this controller's settings (the
        message names the keys; drop the section to load anyway), or a
        malformed or out-of-bounds state.
    """
    if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
      got = state.get("version") if isinstance(state, Mapping) else state
      raise ValueError(f"state version must be {STATE_VERSION}, got {got!r}")
    if state.get("controller") != self.KIND:
      raise ValueError(f"the state is of a {state.get('controller')!r} controller, "
                       f"this one is {self.KIND!r}")
    if state.get("config") is not None:
      self._check_saved_config(state["config"])
    try:
      batch_size, step, nonfinite, decision = self._parse_counters(state, DECISIONS)
      dynamic = self._parse_dynamic_state(state)
    except (KeyError, TypeError) as e:
      raise ValueError(f"malformed controller state: {e!r}") from e
    self._batch_size, self._step, self._nonfinite = batch_size, step, nonfinite
    self._last_decision, self._last_similarity = decision, None
    for name, value in dynamic.items():
      setattr(self, name, value)

  # ---------------------------------------------------------------- internals

  def _clamp(self, size: int) -> int:
    if self._upper is not None:
      size = min(size, self._upper)
    if self._lower is not None:
      size = max(size, self._lower)
    return max(size, 1)

  def _direction(self, new: int) -> str:
    b = self._batch_size
    return "grow" if new > b else "shrink" if new < b else "hold"

  def _observe(self, similarity: float, stats: Mapping[str, Any] | None, finite: bool) -> bool:
    """Takes a step's measurements; returns whether the step counts as finite.

    ``finite`` is False for a non-finite similarity or a non-finite step; a
    controller then learns nothing from the step (unless it must, e.g. to
    close an epoch) and returns False.
    """
    del similarity, stats
    return finite

  def _decide(self) -> tuple[int, str]:
    raise NotImplementedError

  def _settings(self) -> dict[str, Any]:
    return {}

  def _dynamic_state(self) -> dict[str, Any]:
    return {}

  def _parse_dynamic_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
    """Checks the subclass's part of ``state``; returns ``{attribute: value}`` to set."""
    del state
    return {}

  def _log_details(self) -> str:
    return ""


def require_stats(kind: str, stats: Mapping[str, Any] | None, keys: tuple[str, ...]) -> None:
  if stats is None or any(k not in stats for k in keys):
    have = None if stats is None else sorted(stats)
    raise ValueError(f"the {kind!r} controller needs update(similarity, stats=...) with the keys "
                     f"{list(keys)} (simigrad_jax.Trainer passes them); got {have}")


def check_finite_float(name: str, value: Any) -> float:
  if not validation.is_real(value) or not math.isfinite(float(value)):
    raise ValueError(f"{name} must be a finite number, got {value!r}")
  return float(value)
