"""Host: batch-size controllers by name, all with the interface of :class:`simigrad_jax.Controller`.

The interface :class:`simigrad_jax.Trainer` relies on: ``batch_size`` and
``initial_batch_size`` (ints), ``config`` (a dict with at least
``batch_size_lower_bound``, ``batch_size_upper_bound`` and
``similarity_target``, None where it does not apply), ``last_decision`` (str),
``update(similarity, stats=None) -> int`` called once after every optimizer
step (``stats`` holds the step's loss, half-gradient norms, realised batch
size, examples seen, fractional epochs and whether the step ended an epoch),
``set_batch_size(b)``, and ``state_dict()`` / ``load_state_dict()`` (plain
JSON) for exact resume.

Registered names (:func:`make_controller`):

* ``"simigrad"``: :class:`simigrad_jax.Controller`, the reference rule on the
  half-batch gradient similarity (with ``ema_decay``: the model rule, on a
  moving estimate of the noise scale read from the similarities).
* ``"fixed"``: a constant batch size (the baseline).
* ``"linear"``, ``"geometric"``: :class:`ScheduleController`, a batch size
  that moves from ``initial_batch_size`` to ``final_batch_size`` over
  ``ramp_epochs`` epochs, linearly or geometrically, continuously or in steps
  of ``interval_epochs`` (e.g. Smith et al. 2017, "Don't Decay the Learning
  Rate, Increase the Batch Size": multiply the batch at fixed epochs).
* ``"decreasing"``: the same with ``final_batch_size < initial_batch_size``.
* ``"loss_plateau"``: :class:`LossPlateauController`, multiply the batch size
  when the epoch's mean training loss stops improving.
* ``"gns"``: :class:`GnsController`, keep the batch size near a multiple of
  McCandlish et al.'s (2018) simple gradient noise scale, estimated from the
  same half-batch gradient norms that ``simigrad_jax.transform`` measures.

Every controller here holds its size on a non-finite step (a NaN or infinite
similarity, a ``stats["grads_finite"]`` of False or, for the noise scale, a
non-finite norm) and counts it in ``nonfinite_count``; refuses bad settings
with a ValueError that names the value and the valid range; and saves its
whole state as plain JSON (``state_dict``) that resumes exactly.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import math
from collections.abc import Mapping
from typing import Any, Callable

from simigrad_jax.host import validation
from simigrad_jax.host.controller import BoundedBatchSize
from simigrad_jax.host.controller import Controller

logger = logging.getLogger("simigrad_jax")

STATE_VERSION = 1
DECISIONS: tuple[str, ...] = ("grow", "shrink", "hold", "clamped", "warmup", "nonfinite")

_FACTORIES: dict[str, Callable[..., Any]] = {}


def register_controller(name: str, factory: Callable[..., Any]) -> None:
  """Makes ``make_controller(name, ...)`` build a controller with ``factory(**options)``."""
  if name in _FACTORIES:
    raise ValueError(f"a controller named {name!r} is already registered")
  _FACTORIES[name] = factory


def controller_names() -> tuple[str, ...]:
  """The names :func:`make_controller` accepts."""
  return tuple(sorted(_FACTORIES))


def make_controller(name: str, **options: Any) -> Any:
  """Builds the batch-size controller called ``name``.

  Args:
    name: one of :func:`controller_names`: ``"simigrad"``
      (:class:`Controller`: the reference rule), ``"fixed"`` (a constant
      batch size; the baseline), ``"linear"``, ``"geometric"`` and
      ``"decreasing"`` (:class:`ScheduleController`), ``"loss_plateau"``
      (:class:`LossPlateauController`), ``"gns"`` (:class:`GnsController`),
      or any name added with :func:`register_controller`.
    **options: the controller's constructor arguments (for ``"fixed"``: those
      of :class:`Controller`, with no ``similarity_target`` needed).

  Returns:
    The controller.

  Example:
    >>> import simigrad_jax
    >>> simigrad_jax.make_controller("fixed", initial_batch_size=128).update(0.5)
    128
    >>> simigrad_jax.make_controller(
    ...     "gns", initial_batch_size=64, multiple=0.5,
    ...     batch_size_upper_bound=1024).config["multiple"]
    0.5
  """
  if name not in _FACTORIES:
    raise ValueError(f"unknown controller {name!r}; choose one of {controller_names()}")
  accepted = controller_options(name)
  unknown = sorted(set(options) - set(accepted)) if accepted is not None else []
  if unknown:
    hints = [f"{u!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(
        u, accepted, n=1)) else repr(u) for u in unknown]
    raise TypeError(f"make_controller({name!r}) got unknown option(s) {', '.join(hints)}; "
                    f"{name!r} takes {sorted(accepted)}")
  return _FACTORIES[name](**options)


def controller_options(name: str) -> tuple[str, ...] | None:
  """The keyword options ``make_controller(name, ...)`` accepts (None: the factory does not say).

  Read from the factory's signature; a factory that passes ``**options`` on to
  a class names it in ``forwards_options_to`` (and the options it sets
  itself in ``sets_options``).
  """
  if name not in _FACTORIES:
    raise ValueError(f"unknown controller {name!r}; choose one of {controller_names()}")
  return _option_names(_FACTORIES[name])


def _option_names(factory: Callable[..., Any]) -> tuple[str, ...] | None:
  params = inspect.signature(factory).parameters.values()
  names = {p.name for p in params
           if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
    target = getattr(factory, "forwards_options_to", None)
    forwarded = None if target is None else _option_names(target)
    if forwarded is None:
      return None
    names |= set(forwarded) - set(getattr(factory, "sets_options", ()))
  return tuple(sorted(names))


def _fixed(initial_batch_size: int, similarity_target: float = 0.0, **options: Any) -> Controller:
  """A constant batch size: SimiGrad's controller with adjustment off (similarity still logged).

  Without a profile, a bound left out (or None) defaults to
  ``initial_batch_size``, so that :class:`simigrad_jax.Trainer` compiles only
  the shapes it needs.
  """
  if (options.get("batch_sizes_to_profile") is None and validation.is_int(initial_batch_size)
      and initial_batch_size >= 1):
    for key in ("batch_size_lower_bound", "batch_size_upper_bound"):
      if options.get(key) is None:
        options[key] = int(initial_batch_size)
  return Controller(initial_batch_size, similarity_target, enable_adjust=False, **options)


# ----------------------------------------------------------------------------
# Shared machinery.
# ----------------------------------------------------------------------------


class _BaseController(BoundedBatchSize):
  """Step counting, non-finite handling, bounds, logging and JSON state for the controllers here.

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
      _require_stats(self.KIND, stats, self.REQUIRED_STATS)
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
      ours, theirs = self.config, state["config"]
      differing = [k for k in ours if theirs.get(k, "<missing>") != ours[k]]
      if differing:
        details = ", ".join(f"{k} (saved {theirs.get(k, '<missing>')!r}, here {ours[k]!r})"
                            for k in differing)
        raise ValueError(f"state config differs from this controller's in: {details}")
    try:
      batch_size = self._check_size("batch_size", state["batch_size"])
      step = validation.check_int("step", state["step"], 0)
      nonfinite = validation.check_int("nonfinite_count", state["nonfinite_count"], 0)
      decision = state["last_decision"]
      if decision is not None and decision not in DECISIONS:
        raise ValueError(f"last_decision must be one of {DECISIONS}, got {decision!r}")
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


def _require_stats(kind: str, stats: Mapping[str, Any] | None, keys: tuple[str, ...]) -> None:
  if stats is None or any(k not in stats for k in keys):
    have = None if stats is None else sorted(stats)
    raise ValueError(f"the {kind!r} controller needs update(similarity, stats=...) with the keys "
                     f"{list(keys)} (simigrad_jax.Trainer passes them); got {have}")


def _check_finite_float(name: str, value: Any) -> float:
  if not validation.is_real(value) or not math.isfinite(float(value)):
    raise ValueError(f"{name} must be a finite number, got {value!r}")
  return float(value)


# ----------------------------------------------------------------------------
# Schedules: the batch size as a function of the epochs trained.
# ----------------------------------------------------------------------------

SCHEDULE_SHAPES: tuple[str, ...] = ("linear", "geometric")


class ScheduleController(_BaseController):
  """A batch size that follows a fixed schedule in epochs (no feedback).

  With ``e`` the fractional epochs trained so far (``stats["epochs"]``, counted
  in examples, so the schedule does not depend on how many steps it took),
  ``p = min(e / ramp_epochs, 1)`` (or, with ``interval_epochs`` = I,
  ``p = min(floor(e / I) * I / ramp_epochs, 1)``: a staircase), B_0 the
  initial and B_1 the final size:

  * ``shape="linear"``: ``B(e) = round(B_0 + (B_1 - B_0) p)``;
  * ``shape="geometric"``: ``B(e) = round(B_0 (B_1 / B_0)^p)``.

  E.g. ``initial_batch_size=32, final_batch_size=512, ramp_epochs=16,
  interval_epochs=4, shape="geometric"`` doubles the batch every 4 epochs
  (Smith et al. 2017). ``final_batch_size`` below ``initial_batch_size`` gives
  a decreasing schedule. Sizes are clamped to the bounds when given; the
  bounds in :attr:`config` are the range the schedule can reach (the smaller
  and the larger of the two sizes, narrowed by the bounds). The similarity is
  not used (a non-finite one still holds the size for that step and is
  counted, like every controller here).

  Args:
    initial_batch_size: B_0, the size at epoch 0 (integer >= 1).
    final_batch_size: B_1, the size from ``ramp_epochs`` on (integer >= 1).
    ramp_epochs: the epochs over which the size moves (> 0).
    shape: ``"linear"`` or ``"geometric"``.
    interval_epochs: optional: change the size only every this many epochs
      (> 0), as a staircase.
    batch_size_lower_bound: optional smallest batch size.
    batch_size_upper_bound: optional largest batch size.
    verbose: log each decision (logger ``"simigrad_jax"``, level INFO).

  Note:
    Needs ``stats["epochs"]`` in :meth:`update` (:class:`simigrad_jax.Trainer`
    passes it).
  """

  KIND = "linear"
  REQUIRED_STATS = ("epochs",)

  def __init__(
      self,
      initial_batch_size: int,
      final_batch_size: int,
      ramp_epochs: float,
      *,
      shape: str = "linear",
      interval_epochs: float | None = None,
      batch_size_lower_bound: int | None = None,
      batch_size_upper_bound: int | None = None,
      verbose: bool = False,
  ):
    b0 = validation.check_int("initial_batch_size", initial_batch_size, 1)
    b1 = validation.check_int("final_batch_size", final_batch_size, 1)
    self._final = b1
    self._ramp = validation.check_real("ramp_epochs", ramp_epochs, "(0, inf)",
                                       lambda x: 0.0 < x < math.inf)
    if shape not in SCHEDULE_SHAPES:
      raise ValueError(f"shape must be one of {SCHEDULE_SHAPES}, got {shape!r}")
    self._shape = shape
    self._interval = None if interval_epochs is None else validation.check_real(
        "interval_epochs", interval_epochs, "(0, inf)", lambda x: 0.0 < x < math.inf)
    self.KIND = shape  # What config["controller"] and the saved state call it.
    self._epochs = 0.0
    # Checks the given bounds (and B_0 within them), then narrows them to the reachable range.
    self._init_base(b0, batch_size_lower_bound, batch_size_upper_bound, 0, verbose)
    self._lower = max(min(b0, b1), self._lower or 1)
    self._upper = min(max(b0, b1), self._upper or math.inf)

  @property
  def epochs(self) -> float:
    """The epochs trained so far, as the last update reported them."""
    return self._epochs

  def size_at(self, epochs: float) -> int:
    """The schedule's batch size after ``epochs`` epochs of training (within the bounds)."""
    return self._clamp(self._unbounded_size_at(epochs))

  def _unbounded_size_at(self, epochs: float) -> int:
    e = max(float(epochs), 0.0)
    if self._interval is not None:
      e = math.floor(e / self._interval + 1e-9) * self._interval
    p = min(e / self._ramp, 1.0)
    b0, b1 = self._initial, self._final
    if self._shape == "linear":
      value = b0 + (b1 - b0) * p
    else:
      value = b0 * (b1 / b0) ** p
    return int(round(value))

  def _observe(self, similarity, stats, finite):
    epochs = float(stats["epochs"])
    if not (finite and math.isfinite(epochs)):
      return False
    self._epochs = epochs
    return True

  def _decide(self):  # The base class clamps to the bounds (decision "clamped").
    new = self._unbounded_size_at(self._epochs)
    return new, self._direction(new)

  def _settings(self):
    return {"final_batch_size": self._final, "ramp_epochs": self._ramp, "shape": self._shape,
            "interval_epochs": self._interval}

  def _dynamic_state(self):
    return {"epochs": self._epochs}

  def _parse_dynamic_state(self, state):
    return {"_epochs": _check_finite_float("epochs", state["epochs"])}

  def _log_details(self):
    return f" (epochs {self._epochs:.3f})"


def _linear(initial_batch_size: int, final_batch_size: int, ramp_epochs: float,
            **options: Any) -> ScheduleController:
  """A linear schedule from ``initial_batch_size`` to ``final_batch_size``."""
  return ScheduleController(initial_batch_size, final_batch_size, ramp_epochs, shape="linear",
                            **options)


def _geometric(initial_batch_size: int, final_batch_size: int, ramp_epochs: float,
               **options: Any) -> ScheduleController:
  """A geometric schedule from ``initial_batch_size`` to ``final_batch_size``."""
  return ScheduleController(initial_batch_size, final_batch_size, ramp_epochs, shape="geometric",
                            **options)


def _decreasing(initial_batch_size: int, final_batch_size: int, ramp_epochs: float,
                shape: str = "geometric", **options: Any) -> ScheduleController:
  """A schedule that shrinks the batch from ``initial_batch_size`` to ``final_batch_size``."""
  if (validation.is_int(initial_batch_size) and validation.is_int(final_batch_size)
      and not final_batch_size < initial_batch_size):
    raise ValueError(f"a decreasing schedule needs final_batch_size < initial_batch_size "
                     f"({initial_batch_size}), got {final_batch_size}")
  return ScheduleController(initial_batch_size, final_batch_size, ramp_epochs, shape=shape,
                            **options)


# ----------------------------------------------------------------------------
# Loss plateau: grow the batch when the epoch loss stops improving.
# ----------------------------------------------------------------------------


class LossPlateauController(_BaseController):
  """Multiplies the batch size when the epoch's training loss plateaus.

  The rule of PyTorch's ``ReduceLROnPlateau`` applied to the batch size
  instead of the learning rate (as in the dynamic-batching literature, e.g.
  AdaBatch, Devarakonda et al. 2017, which grows the batch where others decay
  the learning rate). Over each epoch the controller averages the training
  loss, weighting each step by its realised batch size:
  ``L_epoch = sum_t B_t L_t / sum_t B_t``. At the end of the epoch, with
  ``L_best`` the best epoch loss so far:

  * ``L_epoch < L_best - threshold * |L_best|``: an improvement; it becomes
    ``L_best`` and the count of bad epochs restarts at 0;
  * otherwise the count of bad epochs grows by one (not during the
    ``cooldown`` epochs that follow a change);
  * when it reaches ``patience``: ``B -> max(B + 1, round(B * factor))``,
    clamped to ``batch_size_upper_bound``, and the count restarts.

  Args:
    initial_batch_size: B_0 (integer >= 1); the batch never shrinks below it.
    factor: the growth factor (> 1).
    patience: the number of bad epochs in a row that makes the batch grow
      (integer >= 1; PyTorch's ``patience`` counts one fewer).
    threshold: the relative improvement that counts (>= 0).
    cooldown: epochs after a change during which bad epochs are not counted
      (integer >= 0).
    batch_size_lower_bound: optional smallest batch size (at most
      ``initial_batch_size``; :attr:`config` reports ``initial_batch_size``,
      below which the size never goes).
    batch_size_upper_bound: optional largest batch size.
    verbose: log each decision (logger ``"simigrad_jax"``, level INFO).

  Note:
    Needs ``stats["loss"]``, ``stats["batch_size"]`` and ``stats["epoch_end"]``
    in :meth:`update` (:class:`simigrad_jax.Trainer` passes them). A step with
    a non-finite loss is left out of the epoch mean and counted as non-finite;
    if the epoch ends on it, the epoch is still judged, and a growth that is
    due waits for the next finite step. Decisions are ``"hold"`` except at the
    end of a plateau.
  """

  KIND = "loss_plateau"
  REQUIRED_STATS = ("loss", "batch_size", "epoch_end")

  def __init__(
      self,
      initial_batch_size: int,
      *,
      factor: float = 2.0,
      patience: int = 1,
      threshold: float = 0.01,
      cooldown: int = 0,
      batch_size_lower_bound: int | None = None,
      batch_size_upper_bound: int | None = None,
      verbose: bool = False,
  ):
    self._factor = validation.check_real("factor", factor, "(1, inf)", lambda x: 1.0 < x < math.inf)
    self._patience = validation.check_int("patience", patience, 1)
    self._threshold = validation.check_real("threshold", threshold, "[0, inf)",
                                            lambda x: 0.0 <= x < math.inf)
    self._cooldown = validation.check_int("cooldown", cooldown, 0)
    self._init_base(initial_batch_size, batch_size_lower_bound, batch_size_upper_bound, 0, verbose)
    self._lower = self._initial
    self._loss_sum = 0.0
    self._loss_weight = 0.0
    self._best: float | None = None
    self._bad_epochs = 0
    self._cooldown_left = 0
    self._epoch_losses: list[float] = []
    self._grow_pending = False

  @property
  def epoch_losses(self) -> list[float]:
    """The mean training loss of every completed epoch."""
    return list(self._epoch_losses)

  @property
  def best_loss(self) -> float | None:
    """The best epoch loss so far (None before the first epoch ends)."""
    return self._best

  def _observe(self, similarity, stats, finite):
    loss, weight = stats["loss"], stats["batch_size"]
    finite = (finite and validation.is_real(loss) and math.isfinite(float(loss))
              and validation.is_real(weight) and math.isfinite(float(weight)) and float(weight) > 0)
    if finite:
      self._loss_sum += float(loss) * float(weight)
      self._loss_weight += float(weight)
    if stats["epoch_end"]:  # A non-finite last step still ends the epoch.
      self._end_epoch()
    return finite

  def _end_epoch(self) -> None:
    """Closes the epoch: judges its mean loss; a due growth waits in ``_grow_pending``."""
    if self._loss_weight <= 0:
      return
    epoch_loss = self._loss_sum / self._loss_weight
    self._loss_sum, self._loss_weight = 0.0, 0.0
    self._epoch_losses.append(epoch_loss)
    if self._best is None or epoch_loss < self._best - self._threshold * abs(self._best):
      self._best = epoch_loss
      self._bad_epochs = 0
    elif self._cooldown_left > 0:
      self._bad_epochs = 0
    else:
      self._bad_epochs += 1
    self._cooldown_left = max(self._cooldown_left - 1, 0)
    if self._bad_epochs >= self._patience:
      self._bad_epochs = 0
      self._cooldown_left = self._cooldown
      self._grow_pending = True

  def _decide(self):
    b = self._batch_size
    if not self._grow_pending:
      return b, "hold"
    self._grow_pending = False
    return max(b + 1, int(round(b * self._factor))), "grow"

  def _settings(self):
    return {"factor": self._factor, "patience": self._patience, "threshold": self._threshold,
            "cooldown": self._cooldown}

  def _dynamic_state(self):
    return {"loss_sum": self._loss_sum, "loss_weight": self._loss_weight, "best_loss": self._best,
            "bad_epochs": self._bad_epochs, "cooldown_left": self._cooldown_left,
            "epoch_losses": list(self._epoch_losses), "grow_pending": self._grow_pending}

  def _parse_dynamic_state(self, state):
    best = state["best_loss"]
    return {
        "_loss_sum": _check_finite_float("loss_sum", state["loss_sum"]),
        "_loss_weight": _check_finite_float("loss_weight", state["loss_weight"]),
        "_best": None if best is None else _check_finite_float("best_loss", best),
        "_bad_epochs": validation.check_int("bad_epochs", state["bad_epochs"], 0),
        "_cooldown_left": validation.check_int("cooldown_left", state["cooldown_left"], 0),
        "_epoch_losses": [_check_finite_float("epoch_losses[]", x) for x in state["epoch_losses"]],
        "_grow_pending": validation.check_bool("grow_pending", state["grow_pending"]),
    }

  def _log_details(self):
    return f" (best epoch loss {self._best}, bad epochs {self._bad_epochs})"


# ----------------------------------------------------------------------------
# Gradient noise scale (McCandlish et al. 2018).
# ----------------------------------------------------------------------------


def noise_scale_estimates(norm_a: float, norm_b: float, norm_mean: float,
                          batch_size: float) -> tuple[float, float]:
  """One step's unbiased estimates of |G|^2 and tr(Sigma) from the half-batch norms.

  McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training",
  appendix A.1): with gradients measured at a small batch b and a big batch B,
  ``E|g_b|^2 = |G|^2 + tr(Sigma) / b``, so

  * ``|G|^2 ~ (B |g_B|^2 - b |g_b|^2) / (B - b)``,
  * ``tr(Sigma) ~ (|g_b|^2 - |g_B|^2) / (1/b - 1/B)``.

  Here B is the global batch, b = B / 2 the half batch, ``|g_b|^2`` the mean
  of the two halves' squared norms ``(|g_A|^2 + |g_B|^2) / 2`` and ``|g_B|^2``
  the full mean's squared norm. With b = B / 2 these reduce to
  ``|G|^2 ~ 2 |g_B|^2 - |g_b|^2`` and ``tr(Sigma) ~ B (|g_b|^2 - |g_B|^2)``.

  Args:
    norm_a: |g_A|, the norm of the first half's mean gradient.
    norm_b: |g_B|, the norm of the second half's mean gradient.
    norm_mean: the norm of the full mean gradient ``(g_A + g_B) / 2``.
    batch_size: the realised global batch size B (> 1).

  Returns:
    ``(g2, trace)``: the estimates of |G|^2 and tr(Sigma). Either can be
    negative on a single step; average them over steps before dividing.

  Note:
    When the halves' row counts differ (B not a multiple of the device count),
    the trainer still divides each half's sum by B / 2; the tr(Sigma) estimate
    stays unbiased and the |G|^2 estimate is biased up by ``(2d / B)^2`` of
    |G|^2 for a difference of 2d rows, e.g. 4% for 12 and 8 rows.
  """
  big = float(batch_size)
  small = big / 2.0
  g_small = (float(norm_a) ** 2 + float(norm_b) ** 2) / 2.0
  g_big = float(norm_mean) ** 2
  g2 = (big * g_big - small * g_small) / (big - small)
  trace = (g_small - g_big) / (1.0 / small - 1.0 / big)
  return g2, trace


class GnsController(_BaseController):
  """Keeps the batch size near a multiple of the gradient noise scale.

  The simple noise scale of McCandlish et al. 2018 is
  ``B_simple = tr(Sigma) / |G|^2``, with Sigma the per-example gradient
  covariance and G the true gradient; training is most efficient in examples
  and in steps together around ``B ~ B_simple`` (their B_crit). Each step, the
  controller estimates ``|G|^2`` and ``tr(Sigma)`` from the half-batch norms
  (:func:`noise_scale_estimates`), smooths each with an exponential moving
  average (as the paper's appendix recommends: the ratio of averages, not the
  average of ratios, since single-step estimates are noisy and can be
  negative),

    ``S_t = d S_{t-1} + (1 - d) trace_t``,  ``G_t = d G_{t-1} + (1 - d) g2_t``,
    ``B_simple = S_t / G_t``,

  and moves the batch to ``round(multiple * B_simple)``, at most by a factor
  ``max_change`` per step, within the bounds. ``G_t <= 0`` (noise dominates)
  counts as an infinite noise scale (grow as far as allowed) and ``S_t <= 0``
  as zero (shrink as far as allowed).

  Relation to SimiGrad: with E[cos] ~ |G|^2 / (|G|^2 + 2 tr(Sigma) / B)
  (SPEC.md), holding the similarity at s holds ``B ~ 2 s / (1 - s) B_simple``,
  so the multiple m corresponds to the similarity target ``m / (2 + m)``
  (e.g. s = 0.1 ~ m = 0.22, s = 0.2 ~ m = 0.5, s = 1/3 ~ m = 1).

  Args:
    initial_batch_size: B_0, the size of the first steps.
    multiple: m > 0, the multiple of the noise scale to hold.
    ema_decay: d in [0, 1), the moving averages' decay per step (0: no
      smoothing). The averages start at zero and are bias-corrected
      (divided by ``1 - d^t``), which cancels in the ratio.
    max_change: optional factor > 1: per step the size changes at most to
      ``max(B + 1, int(B * max_change))`` when growing and to
      ``min(B - 1, ceil(B / max_change))`` when shrinking; None jumps straight
      to the target.
    batch_size_lower_bound: optional smallest batch size (integer >= 2; the
      halves must both hold examples).
    batch_size_upper_bound: optional largest batch size.
    warmup_steps: the first this many updates never change the size (the
      averages still learn).
    verbose: log each decision (logger ``"simigrad_jax"``, level INFO).

  Note:
    Needs ``stats`` with ``norm_a``, ``norm_b``, ``norm_mean`` and
    ``batch_size`` (the realised size) in :meth:`update`
    (:class:`simigrad_jax.Trainer` passes them). A step with a non-finite
    norm, a NaN similarity (a half without a measurable gradient) or a batch
    below 2 leaves the averages alone, keeps the size and is counted in
    ``nonfinite_count``. The noise scale an unbounded controller chases can be
    infinite: with no ``batch_size_upper_bound`` and no ``max_change``, an
    infinite estimate holds the size.
  """

  KIND = "gns"
  REQUIRED_STATS = ("norm_a", "norm_b", "norm_mean", "batch_size")

  def __init__(
      self,
      initial_batch_size: int,
      multiple: float = 1.0,
      *,
      ema_decay: float = 0.9,
      max_change: float | None = 2.0,
      batch_size_lower_bound: int | None = None,
      batch_size_upper_bound: int | None = None,
      warmup_steps: int = 0,
      verbose: bool = False,
  ):
    self._multiple = validation.check_real("multiple", multiple, "(0, inf)",
                                           lambda x: 0.0 < x < math.inf)
    self._decay = validation.check_real("ema_decay", ema_decay, "[0, 1)", lambda x: 0.0 <= x < 1.0)
    self._max_change = None if max_change is None else validation.check_real(
        "max_change", max_change, "(1, inf)", lambda x: 1.0 < x < math.inf)
    if batch_size_lower_bound is not None:
      validation.check_int("batch_size_lower_bound", batch_size_lower_bound, 2)
    self._init_base(initial_batch_size, batch_size_lower_bound, batch_size_upper_bound,
                    warmup_steps, verbose)
    self._ema_trace = 0.0
    self._ema_g2 = 0.0
    self._ema_count = 0
    self._last_estimates: tuple[float, float] | None = None

  @property
  def trace_estimate(self) -> float | None:
    """The bias-corrected moving average of tr(Sigma) (None before a measurement)."""
    return None if self._ema_count == 0 else self._ema_trace / self._debias()

  @property
  def g2_estimate(self) -> float | None:
    """The bias-corrected moving average of |G|^2 (None before a measurement)."""
    return None if self._ema_count == 0 else self._ema_g2 / self._debias()

  @property
  def noise_scale(self) -> float | None:
    """B_simple = tr(Sigma) / |G|^2 from the moving averages (inf if |G|^2 <= 0, 0 if tr <= 0)."""
    if self._ema_count == 0:
      return None
    if self._ema_g2 <= 0:
      return math.inf
    return max(self._ema_trace, 0.0) / self._ema_g2

  @property
  def target_batch_size(self) -> float | None:
    """``multiple * noise_scale`` (before rounding, pacing and bounds)."""
    scale = self.noise_scale
    return None if scale is None else self._multiple * scale

  def _debias(self) -> float:
    return 1.0 - self._decay ** self._ema_count

  def _observe(self, similarity, stats, finite):
    if not finite:
      return False
    values = [stats[k] for k in ("norm_a", "norm_b", "norm_mean", "batch_size")]
    if not all(validation.is_real(v) and math.isfinite(float(v)) for v in values):
      return False
    if float(stats["batch_size"]) < 2:
      return False
    g2, trace = noise_scale_estimates(*values)
    if not (math.isfinite(g2) and math.isfinite(trace)):
      return False
    d = self._decay
    self._ema_trace = d * self._ema_trace + (1.0 - d) * trace
    self._ema_g2 = d * self._ema_g2 + (1.0 - d) * g2
    self._ema_count += 1
    self._last_estimates = (g2, trace)
    return True

  def _decide(self):
    b = self._batch_size
    target = self.target_batch_size
    if math.isinf(target):
      if self._max_change is None and self._upper is None:
        return b, "hold"
      new = self._upper if self._max_change is None else math.inf
    else:
      new = max(int(round(target)), 1)
    if self._max_change is not None:
      if new > b:
        new = min(new, max(b + 1, int(b * self._max_change)))
      elif new < b:
        new = max(new, min(b - 1, math.ceil(b / self._max_change)), 1)
    new = int(new)
    return new, self._direction(new)

  def _settings(self):
    return {"multiple": self._multiple, "ema_decay": self._decay, "max_change": self._max_change,
            "warmup_steps": self._warmup}

  def _dynamic_state(self):
    return {"ema_trace": self._ema_trace, "ema_g2": self._ema_g2, "ema_count": self._ema_count}

  def _parse_dynamic_state(self, state):
    return {"_ema_trace": _check_finite_float("ema_trace", state["ema_trace"]),
            "_ema_g2": _check_finite_float("ema_g2", state["ema_g2"]),
            "_ema_count": validation.check_int("ema_count", state["ema_count"], 0),
            "_last_estimates": None}

  def _log_details(self):
    return f" (noise scale {self.noise_scale}, target {self.target_batch_size})"


for _factory, _target, _sets in ((_fixed, Controller, ("enable_adjust",)),
                                 (_linear, ScheduleController, ("shape",)),
                                 (_geometric, ScheduleController, ("shape",)),
                                 (_decreasing, ScheduleController, ())):
  _factory.forwards_options_to, _factory.sets_options = _target, _sets

register_controller("simigrad", Controller)
register_controller("fixed", _fixed)
register_controller("linear", _linear)
register_controller("geometric", _geometric)
register_controller("decreasing", _decreasing)
register_controller("loss_plateau", LossPlateauController)
register_controller("gns", GnsController)
