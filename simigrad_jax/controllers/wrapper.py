"""Host: what a controller that wraps another one shares: the wrapped one, and what it passes on."""

from __future__ import annotations

from typing import Any

from simigrad_jax.controllers.base import check_batch_size
from simigrad_jax.controllers.interface import BatchSizeController


class ControllerWrapper:
  """The base of a controller around another one (:class:`ProfilingController`,
  :class:`OneStepLateController`).

  It checks that the wrapped object is a controller, reads from it every
  attribute the wrapper does not define (``step``, ``noise_scale``, ...),
  and checks sizes against its bounds.

  Args:
    controller: the controller to wrap.

  Raises:
    ValueError: ``controller`` is not a
      :class:`~simigrad_jax.controllers.interface.BatchSizeController`.
  """

  # Attributes a subclass sets itself: never read from the wrapped controller (before they are
  # set, e.g. while unpickling, reading one raises AttributeError).
  OWN_ATTRIBUTES: tuple[str, ...] = ("_inner",)

  def __init__(self, controller: BatchSizeController):
    if not isinstance(controller, BatchSizeController):
      raise ValueError(
        f"{type(self).__name__} wraps a batch-size controller (see "
        f"simigrad_jax.controllers.BatchSizeController), got {controller!r:.200}"
      )
    self._inner = controller

  def __getattr__(self, name: str) -> Any:
    if name.startswith("__") or name in self.OWN_ATTRIBUTES:
      raise AttributeError(name)
    return getattr(self._inner, name)

  @property
  def controller(self) -> BatchSizeController:
    """The wrapped controller."""
    return self._inner

  @property
  def initial_batch_size(self) -> int:
    """The wrapped controller's B_0."""
    return self._inner.initial_batch_size

  def _check_size(self, name: str, value: Any) -> int:
    """``value`` as a batch size within the wrapped controller's bounds (else ValueError naming
    ``name``)."""
    config = self._inner.config
    return check_batch_size(
      name, value, config["batch_size_lower_bound"], config["batch_size_upper_bound"]
    )
