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
"""

from __future__ import annotations

from typing import Any, Callable

from simigrad_jax.host.controller import Controller

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
    name: ``"simigrad"`` (:class:`Controller`: the reference rule) or
      ``"fixed"`` (a constant batch size; the baseline), or any name added
      with :func:`register_controller`.
    **options: the controller's constructor arguments (for ``"simigrad"`` and
      ``"fixed"``: those of :class:`Controller`; ``"fixed"`` needs no
      ``similarity_target``).

  Returns:
    The controller.

  Example:
    >>> import simigrad_jax
    >>> simigrad_jax.make_controller("fixed", initial_batch_size=128).update(0.5)
    128
  """
  if name not in _FACTORIES:
    raise ValueError(f"unknown controller {name!r}; choose one of {controller_names()}")
  return _FACTORIES[name](**options)


def _fixed(initial_batch_size: int, similarity_target: float = 0.0, **options: Any) -> Controller:
  """A constant batch size: SimiGrad's controller with adjustment off (similarity still logged)."""
  return Controller(initial_batch_size, similarity_target, enable_adjust=False, **options)


register_controller("simigrad", Controller)
register_controller("fixed", _fixed)
