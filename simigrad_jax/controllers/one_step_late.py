"""Host: any controller's decisions, taking effect one step later.

SimiGrad decides the size of step ``t + 1`` from the similarity of step
``t``, so that size is known only once step ``t`` has finished. While step
``t`` runs, :class:`simigrad_jax.Trainer` therefore places the next step's
rows on the devices for each size the controller may decide (a grow and a
shrink), and uses one of them. :class:`OneStepLateController` moves each
decision one step later: step ``t + 1`` runs at the size decided from step
``t - 1``'s similarity, which is known before step ``t`` ends, so the rows of
exactly one size are placed a step. It changes the algorithm (each move
reacts one step later), so it is an option, not the default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from simigrad_jax.controllers.interface import BatchSizeController
from simigrad_jax.controllers.interface import ProfilesBatchSizes
from simigrad_jax.controllers.state import STATE_VERSION
from simigrad_jax.controllers.state import check_state_header
from simigrad_jax.controllers.wrapper import ControllerWrapper


class OneStepLateController(ControllerWrapper):
  """Any controller, each of its decisions taking effect one step later.

  The wrapped controller sees every step's measurements, in order, and
  decides as it would; its decision after step ``t`` is the size of step
  ``t + 2``, and step ``t + 1`` runs at the size it decided after step
  ``t - 1`` (the first two steps at its initial size). Its rule moves from
  its own last decision, so the sizes form one chain, each a grow, shrink
  or hold of the one before, only a step late.

  The Trainer gains: the next step's size is known while the step before it
  runs (:meth:`likely_batch_sizes`), so its rows are placed once, ahead, in
  place of once for each size the controller may decide. That saves host
  work where the host is short of CPU (simulated CPU devices, a busy input
  pipeline); docs/controllers.md gives what it measured, on throughput and
  on accuracy.

  A rule that pairs each similarity with the batch size (the model rule,
  ``ema_decay``) pairs it with the size decided after it ran, at most one
  move away. A similarity profile pairs every sample with the size that ran,
  which this order breaks: a controller with a profile planned or running is
  refused.

  Args:
    controller: the controller to wrap (any
      :class:`~simigrad_jax.controllers.interface.BatchSizeController`).
      Attributes the wrapper does not define (``step``, ``noise_scale``, ...)
      are read from it.

  Raises:
    ValueError: ``controller`` is not a batch-size controller, or it has a
      similarity profile planned or running.

  Example:
    >>> import simigrad_jax
    >>> from simigrad_jax.controllers import OneStepLateController
    >>> c = OneStepLateController(simigrad_jax.Controller(100, 0.5))
    >>> [c.update(s) for s in (0.1, 0.1, 0.9)]  # grow, grow, shrink: each a step late
    [100, 110, 121]
    >>> c.likely_batch_sizes(0, 0.0)  # the next step's size after this one: decided
    [108]
  """

  KIND = "one_step_late"

  def __init__(self, controller: BatchSizeController):
    super().__init__(controller)
    self._check_no_profile("wrap")
    self._next = controller.batch_size  # the size of the next step

  @property
  def batch_size(self) -> int:
    """The global batch size of the next optimizer step (decided a step before)."""
    return self._next

  @property
  def config(self) -> dict[str, Any]:
    """The wrapped controller's settings, with ``"one_step_late": True``."""
    return {**self._inner.config, "one_step_late": True}

  @property
  def last_decision(self) -> str | None:
    """The wrapped controller's last decision (it takes effect a step after the next)."""
    return self._inner.last_decision

  def likely_batch_sizes(self, examples_seen: int, epochs: float) -> Sequence[int] | None:
    """The size of the step after the one running: decided already, so exactly one."""
    del examples_seen, epochs
    return [self._inner.batch_size]

  def update(self, similarity: float, stats: Mapping[str, Any] | None = None) -> int:
    """Passes the step to the wrapped controller; returns the size it decided a step ago.

    Raises:
      RuntimeError: the wrapped controller started a similarity profile.
    """
    self._check_no_profile("update")
    upcoming = self._inner.batch_size  # decided after the step before this one
    self._inner.update(similarity, stats=stats)
    self._next = upcoming
    return upcoming

  def set_batch_size(self, batch_size: int) -> None:
    """Adopts a batch size chosen elsewhere: the next step's, and the wrapped controller's."""
    self._inner.set_batch_size(batch_size)
    self._next = self._inner.batch_size

  def state_dict(self) -> dict[str, Any]:
    """The size decided for the next step and the wrapped controller's state, as plain JSON."""
    return {
      "version": STATE_VERSION,
      "controller": self.KIND,
      "batch_size": self._next,
      "wrapped": self._inner.state_dict(),
    }

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restores a :meth:`state_dict`, the wrapped controller's included; nothing changes if refused."""
    check_state_header(state, self.KIND)
    try:
      upcoming = self._check_size("batch_size", state["batch_size"])
      wrapped = state["wrapped"]
    except (KeyError, TypeError) as e:
      raise ValueError(f"malformed controller state: {e!r}") from e
    if not isinstance(wrapped, Mapping):
      raise ValueError(f"malformed controller state: wrapped must be a dict, got {wrapped!r:.200}")
    self._inner.load_state_dict(wrapped)
    self._next = upcoming

  def _check_no_profile(self, action: str) -> None:
    inner = self._inner
    if isinstance(inner, ProfilesBatchSizes) and inner.profile_batch_sizes:
      raise (ValueError if action == "wrap" else RuntimeError)(
        f"the wrapped controller has a similarity profile of {list(inner.profile_batch_sizes)} "
        "planned or running; one step late, each similarity would be paired with the size "
        "decided after it ran. Profile without OneStepLateController"
      )
