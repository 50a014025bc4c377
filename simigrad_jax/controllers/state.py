"""Host: a controller's saved state, the plain JSON every controller here saves and restores.

Every state is a dict with ``"version"`` (:data:`STATE_VERSION`) and
``"controller"`` (the kind); :func:`check_state_header` checks both.
:class:`SavedState` gives
:class:`~simigrad_jax.controllers.base.BaseController` its
``state_dict`` and ``load_state_dict``: the counters every controller has,
its ``config`` (a state saved with other settings is refused), and what the
controller adds itself (:meth:`SavedState.extra_state`,
:meth:`SavedState.parse_extra_state`). The wrappers save theirs around the
wrapped controller's, with the same header.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from simigrad_jax import validation

# One version for every controller's saved state (and for saved profiles).
STATE_VERSION = 1
# Why an update kept or moved the size: "grow", "shrink" and "hold" by the direction of the
# rule's size, "clamped" when the bounds changed it, "warmup", "nonfinite" and "unmeasured" (no
# similarity, gradients finite) when the rule did not run; "disabled" and "profile" are
# SimiGrad's (adjustment off; visiting profiled sizes).
DECISIONS: tuple[str, ...] = (
  "grow",
  "shrink",
  "hold",
  "clamped",
  "warmup",
  "disabled",
  "profile",
  "nonfinite",
  "unmeasured",
)


def check_state_header(state: Any, kind: str) -> None:
  """Raises a ValueError unless ``state`` is a dict of :data:`STATE_VERSION` from a ``kind`` controller."""
  if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
    got = state.get("version") if isinstance(state, Mapping) else state
    raise ValueError(f"state version must be {STATE_VERSION}, got {got!r}")
  if state.get("controller") != kind:
    raise ValueError(
      f"the state is of a {state.get('controller')!r} controller, this one is {kind!r}"
    )


def parse_last_decision(value: Any) -> str | None:
  """A saved ``last_decision``: None or one of :data:`DECISIONS` (else ValueError)."""
  if value is not None and value not in DECISIONS:
    raise ValueError(f"last_decision must be one of {DECISIONS}, got {value!r}")
  return value


def saved_section(state: Mapping[str, Any], key: str, kind: type, *, optional: bool = False) -> Any:
  """``state[key]`` if it is a ``kind``: a dict (any mapping) or a list; or None if ``optional``.

  Raises a ValueError naming the key for any other value (a KeyError where
  it is missing, which :meth:`SavedState.load_state_dict` names).

  Example:
    >>> saved_section({"profile": []}, "profile", list)
    []
    >>> try:
    ...   saved_section({"profile": 3}, "profile", list)
    ... except ValueError as error:
    ...   print(error)
    malformed controller state: profile must be a list, got 3
  """
  value = state[key]
  if value is None and optional:
    return None
  ok = isinstance(value, Mapping) if kind is dict else isinstance(value, kind)
  if not ok:
    allowed = f"a {kind.__name__}" + (" or None" if optional else "")
    raise ValueError(f"malformed controller state: {key} must be {allowed}, got {value!r:.200}")
  return value


def check_finite_float(name: str, value: Any) -> float:
  """Returns ``float(value)`` for a finite real number, or raises ValueError naming it."""
  if not validation.is_real(value) or not math.isfinite(float(value)):
    raise ValueError(f"{name} must be a finite number, got {value!r}")
  return float(value)


class SavedState:
  """``state_dict`` and ``load_state_dict`` for a controller on the base, and the hooks it writes.

  The class provides ``KIND``, :attr:`config`, ``_check_size(name, value)``
  and the counters ``_batch_size``, ``_step``, ``_nonfinite``,
  ``_last_decision`` and ``_last_similarity``
  (:class:`~simigrad_jax.controllers.base.BaseController` does).

  Example:
    >>> import json
    >>> import simigrad_jax
    >>> c = simigrad_jax.Controller(64, 0.1, batch_size_upper_bound=256)
    >>> c.update(0.05)
    70
    >>> resumed = simigrad_jax.Controller(64, 0.1, batch_size_upper_bound=256)
    >>> resumed.load_state_dict(json.loads(json.dumps(c.state_dict())))
    >>> resumed.batch_size, resumed.step, resumed.last_decision
    (70, 1, 'grow')
  """

  KIND: str
  _batch_size: int
  _step: int
  _nonfinite: int
  _last_decision: str | None
  _last_similarity: float | None

  if TYPE_CHECKING:  # What the class provides, declared for the type checker only.

    def _check_size(self, name: str, value: Any) -> int: ...

    @property
    def config(self) -> dict[str, Any]: ...

  def extra_state(self) -> dict[str, Any]:
    """The controller's own dynamic state, as plain JSON data, added to :meth:`state_dict`."""
    return {}

  def parse_extra_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
    """Checks the controller's part of a saved ``state``; returns ``{attribute: value}`` to set.

    Raise ValueError (or let a KeyError or TypeError through) for a malformed
    value; the attributes are set only once the whole state is checked, so a
    refused state changes nothing.
    """
    del state
    return {}

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
      **self.extra_state(),
    }

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restores a state from :meth:`state_dict` (e.g. after ``json.loads``).

    All dynamic state is replaced. Nothing changes if the state is refused.

    Args:
      state: the dict :meth:`state_dict` returned.

    Raises:
      ValueError: for an unknown version, another kind of controller, a
        ``config`` section that differs from this controller's settings (the
        message names the keys; drop the section to load anyway), or a
        malformed or out-of-bounds state.
    """
    if isinstance(state, Mapping):
      state = self._complete_old_state(state)
    check_state_header(state, self.KIND)
    if state.get("config") is not None:
      self._check_saved_config(saved_section(state, "config", dict))
    try:
      batch_size = self._check_size("batch_size", state["batch_size"])
      step = validation.check_int("step", state["step"], 0)
      nonfinite = validation.check_int("nonfinite_count", state["nonfinite_count"], 0)
      decision = parse_last_decision(state["last_decision"])
      extra = self.parse_extra_state(state)
    except (KeyError, TypeError) as e:
      raise ValueError(f"malformed controller state: {e!r}") from e
    self._batch_size, self._step, self._nonfinite = batch_size, step, nonfinite
    self._last_decision, self._last_similarity = decision, None
    for name, value in extra.items():
      setattr(self, name, value)

  def _check_saved_config(self, saved: Mapping[str, Any]) -> None:
    """Raises a ValueError naming every setting in which a saved ``config`` differs from ours."""
    ours = self.config
    differing = [k for k in ours if saved.get(k, "<missing>") != ours[k]]
    if differing:
      details = ", ".join(
        f"{k} (saved {saved.get(k, '<missing>')!r}, here {ours[k]!r})" for k in differing
      )
      raise ValueError(f"state config differs from this controller's in: {details}")

  def _complete_old_state(self, state: Mapping[str, Any]) -> Mapping[str, Any]:
    """A saved state with what older states of the same version lack filled in (none here)."""
    return state
