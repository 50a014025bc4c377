"""Host: the batch-size controller interface, what :class:`simigrad_jax.Trainer` reads.

:class:`BatchSizeController` is the whole interface: anything with its
members can drive a run, and
:class:`~simigrad_jax.controllers.base.BaseController` implements them all.
:class:`ProfilesBatchSizes` marks a controller that may visit a list of batch
sizes before it adapts; :class:`AnticipatesBatchSizes` one that can say which
sizes it may decide next, before it decides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable


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
    """The settings as plain JSON data.

    At least :data:`REQUIRED_CONFIG_KEYS`: ``batch_size_lower_bound`` and
    ``batch_size_upper_bound`` (the range the size can take, None where
    unbounded; the Trainer compiles for it) and ``similarity_target`` (None
    for a controller that does not read the similarity; the Trainer then
    allows a batch of 1). An optional ``enable_adjust`` of False says the size
    never moves (no upper bound needed). Every process of a run must have the
    same config.
    """

  @property
  def last_decision(self) -> str | None:
    """Why the last update kept or moved the size (logged per step); None before the first."""

  def update(self, similarity: float, stats: Mapping[str, Any] | None = None) -> int:
    """Takes one optimizer step's measurements; returns the next batch size.

    Args:
      similarity: the cosine similarity of the two half-batch gradients (NaN
        for a step whose gradients were not finite).
      stats: the step's other measurements, passed by keyword: ``loss``,
        ``norm_a``, ``norm_b``, ``norm_mean`` (the half and full gradient
        norms), ``batch_size`` (the size that ran), ``examples_seen``,
        ``epochs`` (fractional), ``epoch_end`` and ``grads_finite``.

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
  step after the decision starts at once. Without this method (or where it
  returns None) those are SimiGrad's grow and shrink of the current size. A
  schedule knows its next size exactly; a controller holding its size says
  that size. :class:`~simigrad_jax.controllers.base.BaseController` has it
  (returning None), and the schedules and :class:`simigrad_jax.Controller`
  answer it.
  """

  def likely_batch_sizes(self, examples_seen: int, epochs: float) -> Sequence[int] | None:
    """The sizes this controller may decide for the step that starts after ``examples_seen``
    examples (``epochs`` epochs), the likeliest first; None: no better guess than SimiGrad's."""


def likely_batch_sizes(controller: Any, examples_seen: int, epochs: float) -> tuple[int, ...]:
  """The sizes ``controller`` may decide at its next update, the likeliest first (never empty)."""
  said = getattr(controller, "likely_batch_sizes", None)
  sizes = None if said is None else said(examples_seen, epochs)
  return tuple(dict.fromkeys(int(s) for s in sizes)) if sizes else (int(controller.batch_size),)


def similarity_target(controller: Any) -> float | None:
  """The similarity ``controller`` steers toward (None for one that does not read it)."""
  return controller.config.get("similarity_target")
