"""Host: the batch-size controller interface, what :class:`simigrad_jax.Trainer` reads.

:class:`BatchSizeController` is the whole interface: anything with its
members can drive a run, and
:class:`~simigrad_jax.controllers.base.BaseController` implements them all.
:class:`ProfilesBatchSizes` marks a controller that may visit a list of batch
sizes before it adapts; :class:`AnticipatesBatchSizes` one that can say which
sizes it may decide next, before it decides.

The engine reads a controller through the functions here, which work for any
object with the protocol's members: :func:`likely_batch_sizes` (the sizes it
may decide next), :func:`batch_size_bounds`, :func:`adapts` and
:func:`similarity_target` (what its ``config`` says). How a rule moves the
size is the controller's own business; nothing outside this room knows it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from simigrad_jax import validation


@runtime_checkable
class BatchSizeController(Protocol):
  """What :class:`simigrad_jax.Trainer` reads from a batch-size controller: the whole interface.

  Anything with these members drives a run; ``isinstance(c,
  BatchSizeController)`` checks that they exist. :class:`BaseController`
  implements them all, so a new controller usually derives from it and writes
  only its rule. The Trainer calls :meth:`update` once after every optimizer
  step, runs the next step at :attr:`batch_size`, and saves
  :meth:`state_dict` in each checkpoint.

  Example:
    >>> import simigrad_jax
    >>> from simigrad_jax.controllers import BatchSizeController
    >>> isinstance(simigrad_jax.Controller(64, 0.1), BatchSizeController)
    True
  """

  @property
  def batch_size(self) -> int:
    """The global batch size of the next optimizer step (an int >= 1)."""

  @property
  def initial_batch_size(self) -> int:
    """B_0, the size the base learning rate is tuned for (the learning-rate factor's 1)."""

  @property
  def config(self) -> Mapping[str, Any]:
    """The settings as plain JSON data (saved whole in every checkpoint).

    At least :data:`REQUIRED_CONFIG_KEYS`: ``batch_size_lower_bound`` and
    ``batch_size_upper_bound`` (the range the size can take, None where
    unbounded; the Trainer compiles for it) and ``similarity_target`` (None
    for a controller that does not read the similarity; the Trainer then
    allows a batch of 1). An optional ``enable_adjust`` of False says the size
    never moves (no upper bound needed). Every process of a run must have the
    same config. The engine reads these keys through :func:`batch_size_bounds`,
    :func:`adapts` and :func:`similarity_target`.
    """

  @property
  def last_decision(self) -> str | None:
    """Why the last update kept or moved the size (logged per step); None before the first."""

  def update(self, similarity: float, stats: Mapping[str, Any] | None = None) -> int:
    """Takes one optimizer step's measurements; returns the next batch size.

    Args:
      similarity: the cosine similarity of the two half-batch gradients (NaN
        for a step without a measurement: gradients not finite, or a half
        whose mean gradient is zero). It comes here alone, not in ``stats``.
      stats: the step's other measurements and where the run stands, passed
        by keyword. :class:`simigrad_jax.Trainer` passes ``loss`` (the mean
        over the step's real examples), ``norm_a``, ``norm_b``,
        ``norm_mean`` (the half and full gradient norms), ``measured``
        (whether ``similarity`` is a measurement), ``grads_finite`` (False:
        the step changed nothing), ``nonfinite_count`` (the transform's count
        of such steps), ``batch_size`` (the size that ran),
        ``examples_seen``, ``epochs`` (fractional) and ``epoch_end``.

    Returns:
      The batch size of the next step (also :attr:`batch_size` afterwards).
    """

  def set_batch_size(self, batch_size: int) -> None:
    """Adopts a batch size chosen elsewhere (e.g. the size a plan realised), within the bounds."""

  def state_dict(self) -> dict[str, Any]:
    """The whole dynamic state as plain JSON data; loading it resumes the run exactly."""

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restores a :meth:`state_dict`; raises ValueError and changes nothing if it is refused."""


# The protocol's members, in the order above (the Trainer's check names the missing ones).
CONTROLLER_MEMBERS: tuple[str, ...] = tuple(
  name for name in vars(BatchSizeController) if not name.startswith("_")
)
CONTROLLER_METHODS: tuple[str, ...] = tuple(
  name for name in CONTROLLER_MEMBERS if callable(vars(BatchSizeController)[name])
)
# The keys every controller's config has (None where one does not apply).
REQUIRED_CONFIG_KEYS: tuple[str, ...] = (
  "batch_size_lower_bound",
  "batch_size_upper_bound",
  "similarity_target",
)


@runtime_checkable
class ProfilesBatchSizes(Protocol):
  """A controller that may visit a list of batch sizes (a profile) before it adapts.

  The Trainer checks that the data set and the devices can serve these sizes
  too. :class:`simigrad_jax.Controller` and
  :class:`~simigrad_jax.controllers.profiling.ProfilingController` have it.
  """

  @property
  def profile_batch_sizes(self) -> tuple[int, ...]:
    """The sizes of the profile in progress or waiting to start (visited or not); () if none."""


@runtime_checkable
class AnticipatesBatchSizes(Protocol):
  """A controller that can say, before a step ends, which sizes it may decide for the next one.

  While a step runs, :class:`simigrad_jax.Trainer` places the next step's
  rows on the devices for each size the controller may decide, so that the
  step after the decision starts at once; it asks through
  :func:`likely_batch_sizes`. Without this method (or where it returns None)
  that is the size the controller has. A schedule knows its next size
  exactly; a feedback rule names where it moves for a similarity below and
  above its target. :class:`~simigrad_jax.controllers.base.BaseController`
  has it (the size it has, unless its rule says more), and every controller
  in the library answers it.
  """

  def likely_batch_sizes(self, examples_seen: int, epochs: float) -> Sequence[int] | None:
    """The sizes this controller may decide for the step that starts after ``examples_seen``
    examples (``epochs`` epochs), the likeliest first, each within its bounds; None: only
    the size it has."""


# --------------------------------------------------- how the engine reads a controller


def likely_batch_sizes(
  controller: BatchSizeController,
  examples_seen: int,
  epochs: float,
  bounds: tuple[int | None, int | None] | None = None,
) -> tuple[int, ...]:
  """The sizes ``controller`` may decide at its next update, the likeliest first.

  The controller's own
  :meth:`~AnticipatesBatchSizes.likely_batch_sizes`, checked, where it has
  one that names sizes; else ``(controller.batch_size,)``. Asked before the
  current step's update, to place the next step's rows ahead.

  Args:
    controller: any object with the :class:`BatchSizeController` members.
    examples_seen: the examples served once the current step has run.
    epochs: the same in epochs (fractional).
    bounds: the controller's :func:`batch_size_bounds`, read once by a
      caller that asks at every step (None: read now from its ``config``,
      which for a schedule lists every threshold).

  Returns:
    One or more distinct ints >= 1 within the controller's bounds
    (:func:`batch_size_bounds`), the likeliest first.

  Raises:
    ValueError: ``bounds`` is not a pair of None or ints >= 1 (NumPy's
      integers taken as Python's) with the lower at most the upper; or the
      controller named no size, a size that is not an int >= 1, or one
      outside its bounds, the message naming the controller's class and what
      it returned.

  Example:
    >>> import simigrad_jax
    >>> from simigrad_jax.controllers import interface
    >>> c = simigrad_jax.Controller(100, 0.3, batch_size_upper_bound=105)
    >>> interface.likely_batch_sizes(c, 6400, 0.1)  # a grow (clamped) or a shrink
    (105, 90)
  """
  if bounds is not None:
    bounds = _checked_bounds(bounds)
  own = getattr(controller, "likely_batch_sizes", None)
  said = own(examples_seen, epochs) if callable(own) else None
  if said is None:
    return (int(controller.batch_size),)
  lower, upper = batch_size_bounds(controller) if bounds is None else bounds
  is_sequence = isinstance(said, (Sequence, np.ndarray)) and not isinstance(said, (str, bytes))
  sizes = list(said) if is_sequence else None
  if not sizes or not all(
    validation.is_int(size) and (lower or 1) <= size <= (math.inf if upper is None else upper)
    for size in sizes
  ):
    raise ValueError(
      f"{type(controller).__name__}.likely_batch_sizes({examples_seen}, {epochs!r}) returned "
      f"{said!r:.200}: it must return None or a non-empty sequence of ints within the "
      f"controller's bounds [{lower or 1}, {'inf' if upper is None else upper}]"
    )
  return tuple(dict.fromkeys(int(size) for size in sizes))


def _checked_bounds(bounds: Any) -> tuple[int | None, int | None]:
  """``bounds`` as ``(lower, upper)`` ints or None, each >= 1, the lower at most the upper."""
  pair = tuple(bounds) if isinstance(bounds, (tuple, list)) else ()
  ints = all(b is None or (validation.is_int(b) and b >= 1) for b in pair)
  if len(pair) != 2 or not ints or (None not in pair and pair[0] > pair[1]):
    raise ValueError(
      f"bounds must be a pair (lower, upper) of None (unbounded) or integers >= 1 with "
      f"lower <= upper, got {bounds!r:.200}"
    )
  lower, upper = pair
  return (None if lower is None else int(lower)), (None if upper is None else int(upper))


def batch_size_bounds(controller: BatchSizeController) -> tuple[int | None, int | None]:
  """``(lower, upper)``: the range ``controller`` keeps the size in, as configured (None: unbounded).

  Raises:
    ValueError: its ``config`` lacks a bound, or a bound is not None or an
      int >= 1.

  Example:
    >>> import simigrad_jax
    >>> from simigrad_jax.controllers import interface
    >>> interface.batch_size_bounds(simigrad_jax.Controller(64, 0.1, batch_size_upper_bound=512))
    (None, 512)
  """
  bounds = []
  for key in ("batch_size_lower_bound", "batch_size_upper_bound"):
    value = _config_value(controller, key)
    if value is not None and not (validation.is_int(value) and value >= 1):
      raise ValueError(
        f"{type(controller).__name__}.config[{key!r}] must be None (unbounded) or an int >= 1, "
        f"got {value!r:.200}"
      )
    bounds.append(None if value is None else int(value))
  return bounds[0], bounds[1]


def adapts(controller: BatchSizeController) -> bool:
  """Whether ``controller``'s rule may move the size.

  False where its ``config`` says ``enable_adjust`` False or has equal
  bounds. A profile (:class:`ProfilesBatchSizes`) visits its sizes either way.

  Example:
    >>> import simigrad_jax
    >>> from simigrad_jax.controllers import interface
    >>> interface.adapts(simigrad_jax.make_controller("fixed", initial_batch_size=64))
    False
  """
  if _config(controller).get("enable_adjust", True) is False:
    return False
  lower, upper = batch_size_bounds(controller)
  return lower is None or lower != upper


def similarity_target(controller: BatchSizeController) -> float | None:
  """The similarity ``controller`` holds, or None for one that does not read the similarity.

  Raises:
    ValueError: its ``config`` lacks ``similarity_target``, or it is not None
      or a finite number.

  Example:
    >>> import simigrad_jax
    >>> from simigrad_jax.controllers import interface
    >>> interface.similarity_target(simigrad_jax.Controller(64, 0.1, batch_size_upper_bound=512))
    0.1
  """
  value = _config_value(controller, "similarity_target")
  if value is None:
    return None
  if not (validation.is_real(value) and math.isfinite(float(value))):
    raise ValueError(
      f"{type(controller).__name__}.config['similarity_target'] must be None or a finite "
      f"number, got {value!r:.200}"
    )
  return float(value)


def steps_per_update(controller: BatchSizeController, measure_every: int) -> int:
  """The optimizer steps each update of ``controller`` stands for, checked against ``measure_every``.

  Its ``config``'s ``steps_per_update`` (:class:`simigrad_jax.Controller`),
  1 where the config has none: one update, one move of the rule. Other than
  1, it must be the run's ``measure_every``: the controller is then updated
  on the steps numbered ``0, k, 2k, ...`` only, each update standing for the
  ``k`` steps it decides the size of.

  Args:
    controller: the run's controller.
    measure_every: the run's ``measure_every`` (an int >= 1).

  Returns:
    1 or ``measure_every``.

  Raises:
    ValueError: another value, or one that is no integer >= 1.

  Example:
    >>> import simigrad_jax
    >>> from simigrad_jax.controllers import interface
    >>> c = simigrad_jax.Controller(64, 0.1, steps_per_update=4)
    >>> interface.steps_per_update(c, measure_every=4)
    4
  """
  value = _config(controller).get("steps_per_update", 1)
  if not validation.is_int(value) or int(value) not in (1, measure_every):
    raise ValueError(
      f"{type(controller).__name__}.config['steps_per_update'] must be 1 (one move of the rule "
      f"per measurement) or the run's measure_every ({measure_every}: the rule's rate per "
      f"optimizer step), got {value!r:.200}"
    )
  return int(value)


def _config(controller: BatchSizeController) -> Mapping[str, Any]:
  config = controller.config
  if not isinstance(config, Mapping):
    raise ValueError(
      f"{type(controller).__name__}.config must be a dict with the keys "
      f"{list(REQUIRED_CONFIG_KEYS)}, got {config!r:.200}"
    )
  return config


def _config_value(controller: BatchSizeController, key: str) -> Any:
  config = _config(controller)
  if key not in config:
    raise ValueError(
      f"{type(controller).__name__}.config lacks {key!r}; a controller's config has the keys "
      f"{list(REQUIRED_CONFIG_KEYS)} (None where one does not apply), got {sorted(config)}"
    )
  return config[key]
