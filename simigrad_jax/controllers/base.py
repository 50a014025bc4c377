"""Host: the base class every controller here derives from.

:class:`~simigrad_jax.controllers.interface.BatchSizeController` is what
:class:`simigrad_jax.Trainer` reads from a controller, the whole interface
(:mod:`simigrad_jax.controllers.interface`). :class:`BaseController` provides
all of it and leaves a new controller its rule:
:meth:`~BaseController.decide` (the next size) and, where it reads more than
the similarity, :meth:`~BaseController.observe` (take a step's
measurements). The base validates the bounds, counts steps, holds the size on
non-finite steps and during the warm-up, clamps to the bounds, names and logs
each decision, and saves and restores its state as plain JSON
(:class:`~simigrad_jax.controllers.state.SavedState`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from simigrad_jax import validation
from simigrad_jax.controllers.state import SavedState

logger = logging.getLogger("simigrad_jax")


def check_bounds(lower: Any, upper: Any) -> tuple[int | None, int | None]:
  """``(lower, upper)`` checked: each None (unbounded) or an int >= 1, lower at most upper."""
  low = None if lower is None else validation.check_int("batch_size_lower_bound", lower, 1)
  high = None if upper is None else validation.check_int("batch_size_upper_bound", upper, 1)
  if low is not None and high is not None and low > high:
    raise ValueError(
      f"batch_size_lower_bound ({low}) must not exceed batch_size_upper_bound ({high})"
    )
  return low, high


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


def clamp_size(size: int, lower: int | None, upper: int | None) -> int:
  """``size`` within ``[lower, upper]`` (None: unbounded), and at least 1."""
  if upper is not None:
    size = min(size, upper)
  if lower is not None:
    size = max(size, lower)
  return max(size, 1)


def named_decision(
  decided: Any, before: int, lower: int | None, upper: int | None, rule: str
) -> tuple[int, str]:
  """A rule's answer, a size or ``(size, decision)``, as ``(the size within the bounds, decision)``.

  The decision is the rule's own, else the direction of the move from
  ``before`` (``"grow"``, ``"shrink"``, ``"hold"``); ``"clamped"`` where the
  bounds changed the size. A size that is no integer raises a TypeError
  naming ``rule``.
  """
  new, decision = decided if isinstance(decided, tuple) else (decided, None)
  if not validation.is_int(new):
    raise TypeError(f"{rule} must return an integer batch size, got {new!r}")
  new = int(new)
  clamped = clamp_size(new, lower, upper)
  if clamped != new:
    decision = "clamped"
  elif decision is None:
    decision = "grow" if new > before else "shrink" if new < before else "hold"
  return clamped, decision


# A similarity a little outside [-1, 1] is float rounding (a cosine computed in float32);
# further out it is not a similarity at all.
_SIMILARITY_ROUNDING = 1e-5


def check_similarity(similarity: Any) -> float:
  """``similarity`` as a float: a real scalar in [-1, 1], or NaN or infinite for an unmeasured step.

  Python, NumPy and 0-d JAX scalars are accepted; a value within float
  rounding of the range (1e-5) is clipped into it.

  Raises:
    ValueError: a string, None, a bool, an array with more than one element,
      or a finite number outside [-1, 1], named with what is valid.

  Example:
    >>> check_similarity(0.25), check_similarity(1.000001)
    (0.25, 1.0)
  """
  value = None if isinstance(similarity, str) else validation.as_float(similarity)
  if value is None or validation.is_bool(similarity):
    shape = getattr(similarity, "shape", None)
    what = f"an array of shape {tuple(shape)}" if shape is not None else repr(similarity)
    raise ValueError(
      "update(similarity) takes the cosine similarity of the two half-batch gradients, a real "
      f"scalar in [-1, 1] (NaN for a step without a measurement), got {what} "
      f"({type(similarity).__name__}); read it with simigrad_jax.similarity(opt_state)"
    )
  if math.isfinite(value) and not -1 - _SIMILARITY_ROUNDING <= value <= 1 + _SIMILARITY_ROUNDING:
    raise ValueError(
      f"update(similarity) takes a cosine similarity, in [-1, 1] (NaN for a step without a "
      f"measurement), got {value!r}; read it with simigrad_jax.similarity(opt_state)"
    )
  return min(max(value, -1.0), 1.0) if math.isfinite(value) else value


# The measurements of ``stats`` that are norms: never negative.
NORM_STATS = ("norm_a", "norm_b", "norm_mean")
# Those that count where the run stands or what a step held: never negative either.
COUNT_STATS = ("batch_size", "examples_seen", "epochs", "nonfinite_count")
# Those that are numbers (NaN or infinite for a step that measured nothing finite).
NUMBER_STATS = ("loss", *NORM_STATS, *COUNT_STATS)
# Those that are flags.
FLAG_STATS = ("grads_finite", "measured", "epoch_end")


def check_stats(stats: Any) -> dict[str, Any] | None:
  """``stats`` (the step's measurements by name) with its known values as Python's, or a ValueError.

  The measurements a controller reads (:data:`NUMBER_STATS`,
  :data:`FLAG_STATS`) may be Python's, NumPy's or 0-d JAX values; each is
  returned as a Python ``int``, ``float`` or ``bool``, so that every rule
  reads ``jnp.bool_(False)`` as it reads ``False``. A flag that is not a
  bool, a number that is a bool or not a number, and a negative norm or
  count (which no step gives: the stats were made wrong) are refused. A NaN
  or infinite number is a step without that measurement, which the
  controller holds on. Other keys are passed on as they are.

  Args:
    stats: None, or a mapping of names to values (e.g.
      ``simigrad_jax.similarity_stats(opt_state)``).

  Returns:
    None, or a new dict of ``stats``'s items, the known ones converted.

  Example:
    >>> import numpy as np
    >>> check_stats({"grads_finite": np.bool_(False), "epochs": np.float32(0.5)})
    {'grads_finite': False, 'epochs': 0.5}
  """
  if stats is not None and not isinstance(stats, Mapping):
    raise ValueError(
      "update(similarity, stats=...) takes the step's measurements as a mapping of names to "
      f"values (e.g. simigrad_jax.similarity_stats(opt_state)) or None, got "
      f"{type(stats).__name__}"
    )
  if stats is None:
    return None
  checked = dict(stats)
  for key in FLAG_STATS:
    if key in checked:
      checked[key] = _stat_flag(key, checked[key])
  for key in NUMBER_STATS:
    if key not in checked:
      continue
    value = checked[key] = _stat_number(key, checked[key])
    if value < 0 and not math.isinf(value) and key in NORM_STATS + COUNT_STATS:
      what = "a norm" if key in NORM_STATS else "a count"
      raise ValueError(
        f"update(similarity, stats=...): stats[{key!r}] must be {what} (>= 0), got {stats[key]!r}"
      )
  return checked


def _stat_flag(key: str, value: Any) -> bool:
  if not validation.is_flag(value):
    raise ValueError(
      f"update(similarity, stats=...): stats[{key!r}] must be a bool (True or False; NumPy's "
      f"or a 0-d JAX bool too), got {value!r}"
    )
  return bool(value)


def _stat_number(key: str, value: Any) -> int | float:
  kind = validation.scalar_kind(value)
  if kind not in ("i", "u", "f"):
    raise ValueError(
      f"update(similarity, stats=...): stats[{key!r}] must be a real number (Python's, NumPy's "
      f"or a 0-d JAX one; not a bool), got {value!r}"
    )
  return int(value) if kind in ("i", "u") else float(value)


def unmeasured_but_finite(similarity: float, stats: Mapping[str, Any] | None) -> bool:
  """True for a step without a similarity (NaN) whose ``stats`` say its gradients were finite.

  A half whose mean gradient is exactly zero has no direction, so the
  transform measures no similarity; the gradients themselves were finite.
  Without ``stats`` a NaN similarity cannot be told apart from a non-finite
  gradient, and counts as non-finite. ``stats`` are as :func:`check_stats`
  returns them (a ``grads_finite`` flag, if any, is Python's bool).
  """
  said_finite = stats is not None and stats.get("grads_finite") is True
  return math.isnan(similarity) and said_finite


def step_is_finite(similarity: float, stats: Mapping[str, Any] | None) -> bool:
  """False for a non-finite similarity or a step whose ``stats`` say ``grads_finite`` is False.

  ``stats`` are as :func:`check_stats` returns them.
  """
  said_not_finite = stats is not None and stats.get("grads_finite") is False
  return math.isfinite(similarity) and not said_not_finite


class Rule:
  """The methods a controller on :class:`BaseController` writes, its rule, with their defaults.

  :meth:`decide` is required; the others have defaults that suit a rule
  reading the similarity alone. The state they read is the base's
  (:attr:`BaseController.batch_size`, :attr:`BaseController.last_similarity`,
  ...) and whatever :meth:`observe` keeps.
  """

  _batch_size: int

  def decide(self) -> int | tuple[int, str]:
    """The rule: returns the next batch size (the bounds are applied afterwards).

    Called by :meth:`update` after :meth:`observe`, on finite steps past the
    warm-up. :attr:`batch_size` is still the size that ran and
    :attr:`last_similarity` its similarity. The decision is named by the
    direction of the change (``"grow"``, ``"shrink"``, ``"hold"``); a rule
    with decisions of its own returns ``(size, decision)``, the decision one
    of :data:`.state.DECISIONS`.

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
        :meth:`~simigrad_jax.controllers.interface.BatchSizeController.update`), or None.
      finite: False for a non-finite similarity or a step whose
        ``stats["grads_finite"]`` is False; learn nothing from such a step
        (unless you must, e.g. to close an epoch).

    Returns:
      Whether the step counts as finite: usually ``finite``, False where a
      value the rule reads is not finite. None means ``finite``.
    """
    del similarity, stats
    return finite

  def likely_batch_sizes(self, examples_seen: int, epochs: float) -> Sequence[int]:
    """The sizes the rule may decide for the step after ``examples_seen`` examples, likeliest first.

    Called before the current step's :meth:`update`, to place the next
    step's rows ahead (:class:`~simigrad_jax.controllers.interface.
    AnticipatesBatchSizes`; the Trainer reads it through
    :func:`~simigrad_jax.controllers.interface.likely_batch_sizes`). The
    default is the size the controller has: what a warm-up, a non-finite
    step or a rule that holds decides. A rule that moves says where to
    (:meth:`BaseController._holds_next`: whether the next update holds the
    size in any case).

    Args:
      examples_seen: the examples served once the current step has run.
      epochs: the same in epochs.

    Returns:
      One or more batch sizes within the bounds.
    """
    del examples_seen, epochs
    return [self._batch_size]

  def settings(self) -> dict[str, Any]:
    """The controller's own settings, as plain JSON data, added to :attr:`config`.

    A saved state whose config differs from this one is refused, so list
    every setting that changes the sizes the controller chooses.
    """
    return {}

  def _log_details(self, before: int) -> str:
    """What the verbose log adds after the similarity (``before``: the size that ran)."""
    del before
    return ""


class BaseController(Rule, SavedState):
  """A batch size within bounds, moved by a rule its subclass writes.

  A controller on this base writes:

  * :meth:`decide` (required): the next batch size, from what the controller
    has observed (:attr:`last_similarity` and anything :meth:`observe` kept).
  * :meth:`observe` (optional): take one step's measurements (``stats``);
    say whether the step counts as finite.
  * :meth:`settings` (optional): its own settings, for :attr:`config` (which
    a saved state must match) and, if it keeps state across steps,
    :meth:`extra_state` and :meth:`parse_extra_state` to save and restore it.
  * :meth:`likely_batch_sizes` (optional): the sizes the next update may
    decide, where the rule can tell more than "the size it has".

  The class attribute ``KIND`` names the controller in :attr:`config` and in
  saved states (default: the class name); ``REQUIRED_STATS`` lists the keys
  of ``stats`` that :meth:`update` needs (checked before anything changes).

  Each :meth:`update` checks its arguments, counts the step, calls
  :meth:`observe`, and then holds the size on a non-finite step (decision
  ``"nonfinite"``), on a step without a measurement whose gradients were
  finite (``"unmeasured"``) or during the first
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
    self._lower, self._upper = check_bounds(batch_size_lower_bound, batch_size_upper_bound)
    self._initial = self._check_size("initial_batch_size", initial_batch_size)
    self._warmup = validation.check_int("warmup_steps", warmup_steps, 0)
    self._verbose = validation.check_bool("verbose", verbose)
    self._batch_size = self._initial
    self._step = 0
    self._nonfinite = 0
    self._last_decision: str | None = None
    self._last_similarity: float | None = None

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
    """Why the last update kept or moved the size (one of :data:`.state.DECISIONS`)."""
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
    non-finite, see :meth:`observe`). A NaN similarity whose ``stats`` say
    ``grads_finite`` is True (a half whose mean gradient is exactly zero, so
    no similarity was measured) keeps the size too, with the decision
    ``"unmeasured"``, and is not counted as non-finite.

    Args:
      similarity: the cosine similarity of the two half-batch gradients, a
        real scalar in [-1, 1] (Python, NumPy or 0-d JAX), NaN for a step
        without a measurement; anything else raises a ValueError.
      stats: the step's measurements as :class:`simigrad_jax.Trainer` passes
        them (``loss``, ``norm_a``, ``norm_b``, ``norm_mean``, ``batch_size``,
        ``examples_seen``, ``epochs``, ``epoch_end``, ``grads_finite``);
        which keys a controller needs is in its docstring.

    Returns:
      The batch size for the next step (also :attr:`batch_size`).
    """
    s = check_similarity(similarity)
    stats = check_stats(stats)
    if self.REQUIRED_STATS:
      require_stats(self.KIND, stats, self.REQUIRED_STATS)
    self._step += 1
    self._last_similarity = s
    before = self._batch_size
    finite = step_is_finite(s, stats)
    counted = self.observe(s, stats, finite)
    if not (finite if counted is None else counted):
      if unmeasured_but_finite(s, stats):
        decision = "unmeasured"
      else:
        self._nonfinite += 1
        decision = "nonfinite"
    elif self._step <= self._warmup:
      decision = "warmup"
    else:
      self._batch_size, decision = named_decision(
        self.decide(), before, self._lower, self._upper, f"{type(self).__name__}.decide()"
      )
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

  # ------------------------------------------------------------------ internals

  def _check_size(self, name: str, value: Any) -> int:
    return check_batch_size(name, value, self._lower, self._upper)

  def _clamp(self, size: int) -> int:
    return clamp_size(size, self._lower, self._upper)

  def _holds_next(self) -> bool:
    """Whether the next :meth:`update` is in the warm-up, so keeps the size whatever it measures."""
    return self._step < self._warmup


def require_stats(kind: str, stats: Mapping[str, Any] | None, keys: tuple[str, ...]) -> None:
  """Raises a ValueError unless ``stats`` holds every key in ``keys``."""
  if stats is None or any(k not in stats for k in keys):
    have = None if stats is None else sorted(stats)
    raise ValueError(
      f"the {kind!r} controller needs update(similarity, stats=...) with the keys "
      f"{list(keys)} (simigrad_jax.Trainer passes them); got {have}"
    )
