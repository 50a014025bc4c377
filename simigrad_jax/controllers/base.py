"""Host: the base class every controller here derives from.

:class:`~simigrad_jax.controllers.interface.BatchSizeController` is what
:class:`simigrad_jax.Trainer` reads from a controller, the whole interface
(:mod:`simigrad_jax.controllers.interface`). :class:`BaseController` provides
all of it and leaves a new controller its rule:
:meth:`~BaseController.decide` (the next size) and, where it reads more than
the similarity, :meth:`~BaseController.observe` (take a step's
measurements). The base validates the bounds, counts steps, holds the size on
non-finite steps and during the warm-up, clamps to the bounds, names and logs
each decision, and saves and restores its state as plain JSON.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from simigrad_jax import validation

# (Also importable from here, where it was first.)
from simigrad_jax.controllers.interface import BatchSizeController as BatchSizeController

logger = logging.getLogger("simigrad_jax")

# One version for every controller's saved state (and for saved profiles).
STATE_VERSION = 1
# Why an update kept or moved the size: "grow", "shrink" and "hold" by the direction of the
# rule's size, "clamped" when the bounds changed it, "warmup" and "nonfinite" when the rule did
# not run; "disabled" and "profile" are SimiGrad's (adjustment off; visiting profiled sizes).
DECISIONS: tuple[str, ...] = (
  "grow",
  "shrink",
  "hold",
  "clamped",
  "warmup",
  "disabled",
  "profile",
  "nonfinite",
)


def check_batch_size(name: str, value: Any, lower: int | None, upper: int | None) -> int:
  """Returns ``value`` as an int in ``[lower, upper]`` (None: 1, unbounded), or raises ValueError."""
  size = validation.check_int(name, value, 1)
  low = 1 if lower is None else lower
  high = math.inf if upper is None else upper
  if not low <= size <= high:
    raise ValueError(
      f"{name} must lie within [batch_size_lower_bound, batch_size_upper_bound] = "
      f"[{low}, {high}], got {size}"
    )
  return size


def step_is_finite(similarity: float, stats: Mapping[str, Any] | None) -> bool:
  """False for a non-finite similarity or a step whose ``stats`` say ``grads_finite`` is False."""
  bad_step = (
    stats is not None
    and validation.is_bool(stats.get("grads_finite"))
    and not stats["grads_finite"]
  )
  return math.isfinite(similarity) and not bad_step


class BaseController:
  """A batch size within bounds, moved by a rule its subclass writes.

  A controller on this base writes:

  * :meth:`decide` (required): the next batch size, from what the controller
    has observed (:attr:`last_similarity` and anything :meth:`observe` kept).
  * :meth:`observe` (optional): take one step's measurements (``stats``);
    say whether the step counts as finite.
  * :meth:`settings` (optional): its own settings, for :attr:`config` (which
    a saved state must match) and, if it keeps state across steps,
    :meth:`extra_state` and :meth:`parse_extra_state` to save and restore it.

  The class attribute ``KIND`` names the controller in :attr:`config` and in
  saved states (default: the class name); ``REQUIRED_STATS`` lists the keys
  of ``stats`` that :meth:`update` needs (checked before anything changes).

  Each :meth:`update` counts the step, calls :meth:`observe`, and then holds
  the size on a non-finite step (decision ``"nonfinite"``) or during the first
  ``warmup_steps`` updates (``"warmup"``); otherwise it calls :meth:`decide`,
  clamps the size to the bounds and names the decision (``"grow"``,
  ``"shrink"``, ``"hold"``, or ``"clamped"`` when the bounds changed it).

  Args:
    initial_batch_size: B_0, the size of the first step (integer >= 1, within
      the bounds).
    batch_size_lower_bound: optional smallest batch size (integer >= 1).
    batch_size_upper_bound: optional largest batch size (integer >= lower).
    warmup_steps: the first this many updates never change the size
      (:meth:`observe` still sees them).
    verbose: log each decision (logger ``"simigrad_jax"``, level INFO).

  Example:
    >>> from simigrad_jax.controllers import BaseController
    >>> class Doubling(BaseController):
    ...   def decide(self):  # double below a similarity of 0.5, else keep
    ...     return 2 * self.batch_size if self.last_similarity < 0.5 else self.batch_size
    >>> c = Doubling(16, batch_size_upper_bound=48)
    >>> [c.update(s) for s in (0.1, 0.9, 0.1)], c.last_decision
    ([32, 32, 48], 'clamped')
  """

  KIND: str = ""
  REQUIRED_STATS: tuple[str, ...] = ()

  def __init__(
    self,
    initial_batch_size: int,
    *,
    batch_size_lower_bound: int | None = None,
    batch_size_upper_bound: int | None = None,
    warmup_steps: int = 0,
    verbose: bool = False,
  ):
    if not self.KIND:
      self.KIND = type(self).__name__
    self._lower = (
      None
      if batch_size_lower_bound is None
      else validation.check_int("batch_size_lower_bound", batch_size_lower_bound, 1)
    )
    self._upper = (
      None
      if batch_size_upper_bound is None
      else validation.check_int("batch_size_upper_bound", batch_size_upper_bound, 1)
    )
    if self._lower is not None and self._upper is not None and self._lower > self._upper:
      raise ValueError(
        f"batch_size_lower_bound ({self._lower}) must not exceed "
        f"batch_size_upper_bound ({self._upper})"
      )
    self._initial = self._check_size("initial_batch_size", initial_batch_size)
    self._warmup = validation.check_int("warmup_steps", warmup_steps, 0)
    self._verbose = validation.check_bool("verbose", verbose)
    self._batch_size = self._initial
    self._step = 0
    self._nonfinite = 0
    self._last_decision: str | None = None
    self._last_similarity: float | None = None

  # ------------------------------------------------------ what a subclass writes

  def decide(self) -> int | tuple[int, str]:
    """The rule: returns the next batch size (the bounds are applied afterwards).

    Called by :meth:`update` after :meth:`observe`, on finite steps past the
    warm-up. :attr:`batch_size` is still the size that ran and
    :attr:`last_similarity` its similarity. The decision is named by the
    direction of the change (``"grow"``, ``"shrink"``, ``"hold"``); a rule
    with decisions of its own returns ``(size, decision)``, the decision one
    of :data:`DECISIONS`.

    Returns:
      The next batch size, an integer (or ``(size, decision)``).
    """
    raise NotImplementedError(f"{type(self).__name__} must implement decide()")

  def observe(
    self, similarity: float, stats: Mapping[str, Any] | None, finite: bool
  ) -> bool | None:
    """Takes one step's measurements; returns whether the step counts as finite.

    Called by :meth:`update` on every step, before :meth:`decide`. A step that
    does not count keeps the size and is counted in :attr:`nonfinite_count`.
    The default keeps nothing and returns ``finite``.

    Args:
      similarity: the step's similarity, a float.
      stats: the step's other measurements (see
        :meth:`BatchSizeController.update`), or None.
      finite: False for a non-finite similarity or a step whose
        ``stats["grads_finite"]`` is False; learn nothing from such a step
        (unless you must, e.g. to close an epoch).

    Returns:
      Whether the step counts as finite: usually ``finite``, False where a
      value the rule reads is not finite. None means ``finite``.
    """
    del similarity, stats
    return finite

  def likely_batch_sizes(self, examples_seen: int, epochs: float) -> Sequence[int] | None:
    """The sizes the rule may decide for the step after ``examples_seen`` examples, likeliest first.

    Called before the current step's :meth:`update`, to place the next
    step's rows ahead (:class:`~simigrad_jax.controllers.interface.
    AnticipatesBatchSizes`). The default, None, leaves the guess to the
    Trainer: SimiGrad's grow and shrink of the current size. A rule that
    knows better (a schedule, a held size) returns its sizes.

    Args:
      examples_seen: the examples served once the current step has run.
      epochs: the same in epochs.

    Returns:
      Batch sizes within the bounds, or None.
    """
    del examples_seen, epochs
    return None

  def settings(self) -> dict[str, Any]:
    """The controller's own settings, as plain JSON data, added to :attr:`config`.

    A saved state whose config differs from this one is refused, so list
    every setting that changes the sizes the controller chooses.
    """
    return {}

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

  # ------------------------------------------------------------------ read-only

  @property
  def batch_size(self) -> int:
    """The global batch size to use for the next optimizer step."""
    return self._batch_size

  @property
  def initial_batch_size(self) -> int:
    """B_0, the size the learning rate is tuned for."""
    return self._initial

  @property
  def step(self) -> int:
    """The number of :meth:`update` calls so far."""
    return self._step

  @property
  def nonfinite_count(self) -> int:
    """How many updates were non-finite (and kept the size)."""
    return self._nonfinite

  @property
  def last_decision(self) -> str | None:
    """Why the last update kept or moved the size (one of :data:`DECISIONS`)."""
    return self._last_decision

  @property
  def last_similarity(self) -> float | None:
    """The similarity passed to the last update (None before the first)."""
    return self._last_similarity

  @property
  def config(self) -> dict[str, Any]:
    """The settings that determine future sizes (plain JSON data)."""
    return {
      "controller": self.KIND,
      "initial_batch_size": self._initial,
      "similarity_target": None,
      "batch_size_lower_bound": self._lower,
      "batch_size_upper_bound": self._upper,
      **self.settings(),
    }

  # -------------------------------------------------------------------- actions

  def update(self, similarity: float, stats: Mapping[str, Any] | None = None) -> int:
    """Takes this step's measurements; returns the next batch size.

    Call once after every optimizer step. A non-finite similarity, or a step
    whose ``stats`` say ``grads_finite`` is False, keeps the size and is
    counted in :attr:`nonfinite_count` (a controller may count more steps as
    non-finite, see :meth:`observe`).

    Args:
      similarity: the cosine similarity of the two half-batch gradients
        (anything ``float()`` accepts: Python, NumPy or 0-d JAX scalars).
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
    finite = step_is_finite(s, stats)
    counted = self.observe(s, stats, finite)
    decision: str | None  # None until the rule's own word or the size's move names it
    if not (finite if counted is None else counted):
      self._nonfinite += 1
      decision = "nonfinite"
    elif self._step <= self._warmup:
      decision = "warmup"
    else:
      decided = self.decide()
      new, decision = decided if isinstance(decided, tuple) else (decided, None)
      if not validation.is_int(new):
        raise TypeError(
          f"{type(self).__name__}.decide() must return an integer batch size, got {new!r}"
        )
      new = int(new)
      clamped = self._clamp(new)
      if clamped != new:
        decision = "clamped"
      elif decision is None:
        decision = "grow" if new > before else "shrink" if new < before else "hold"
      self._batch_size = clamped
    self._last_decision = decision
    if self._verbose:
      details = self._log_details(before)
      logger.info(
        "%s step %d: %s, batch size %d -> %d (similarity %r%s)",
        self.KIND,
        self._step,
        decision,
        before,
        self._batch_size,
        s,
        f"; {details}" if details else "",
      )
    return self._batch_size

  def set_batch_size(self, batch_size: int) -> None:
    """Adopts a batch size chosen elsewhere (e.g. the size a plan realised).

    Args:
      batch_size: an integer >= 1 within the bounds.
    """
    self._batch_size = self._check_size("batch_size", batch_size)

  # ---------------------------------------------------------------- checkpoints

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
      self._check_saved_config(state["config"])
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

  # ------------------------------------------------------------------ internals

  def _check_size(self, name: str, value: Any) -> int:
    return check_batch_size(name, value, self._lower, self._upper)

  def _clamp(self, size: int) -> int:
    if self._upper is not None:
      size = min(size, self._upper)
    if self._lower is not None:
      size = max(size, self._lower)
    return max(size, 1)

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

  def _log_details(self, before: int) -> str:
    """What the verbose log adds after the similarity (``before``: the size that ran)."""
    del before
    return ""


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


def require_stats(kind: str, stats: Mapping[str, Any] | None, keys: tuple[str, ...]) -> None:
  """Raises a ValueError unless ``stats`` holds every key in ``keys``."""
  if stats is None or any(k not in stats for k in keys):
    have = None if stats is None else sorted(stats)
    raise ValueError(
      f"the {kind!r} controller needs update(similarity, stats=...) with the keys "
      f"{list(keys)} (simigrad_jax.Trainer passes them); got {have}"
    )


def check_finite_float(name: str, value: Any) -> float:
  """Returns ``float(value)`` for a finite real number, or raises ValueError naming it."""
  if not validation.is_real(value) or not math.isfinite(float(value)):
    raise ValueError(f"{name} must be a finite number, got {value!r}")
  return float(value)
