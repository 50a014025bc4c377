"""Host: batch-size controllers by name, for :class:`simigrad_jax.Trainer` and the train configs.

Every controller here has the interface the Trainer reads,
:class:`~simigrad_jax.controllers.interface.BatchSizeController`, and derives from
:class:`~simigrad_jax.controllers.base.BaseController`; a new one is made
available by name with :func:`register_controller`.

The built-in names are listed once, in this module's table
(``BUILT_IN_CONTROLLERS``): the controllers of :mod:`simigrad_jax.controllers`
and the ramps of :mod:`simigrad_jax.ramps`, the two rooms below this module.
Importing a controller's module registers nothing.

Built-in names (:func:`make_controller`):

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
* ``"allowance"``: :class:`AllowanceController`, the batch that spends a
  stated token allowance (e.g. 1.10x the initial batch's tokens) for the
  fewest steps, from the noise scale read from the similarities; nothing to
  tune but the allowance.
* ``"step_schedule"``, ``"linear_ramp"``, ``"doubling_warmup"``, ``"seesaw"``:
  the ramps language-model trainers use, counted in tokens or examples
  (:mod:`simigrad_jax.ramps.token_schedules`,
  :mod:`simigrad_jax.ramps.seesaw`): Megatron-LM's thresholds, MaxText's
  linear ramp, Merrill et al.'s doubling warmup and Seesaw.

Every controller here holds its size on a non-finite step (a NaN or infinite
similarity, a ``stats["grads_finite"]`` of False or, for the noise scale, a
non-finite norm) and counts it in ``nonfinite_count``; refuses bad settings
with a ValueError that names the value and the valid range; and saves its
whole state as plain JSON (``state_dict``) that resumes exactly.

Example:
  >>> from simigrad_jax import registry
  >>> "seesaw" in registry.controller_names() and "simigrad" in registry.controller_names()
  True
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Mapping
from typing import Any

from simigrad_jax import validation
from simigrad_jax.controllers.interface import BatchSizeController
from simigrad_jax.controllers.noise_scale import GnsController
from simigrad_jax.controllers.simigrad import Controller
from simigrad_jax.controllers.token_allowance import AllowanceController
from simigrad_jax.ramps.schedules import LossPlateauController
from simigrad_jax.ramps.schedules import decreasing_schedule
from simigrad_jax.ramps.schedules import geometric_schedule
from simigrad_jax.ramps.schedules import linear_schedule
from simigrad_jax.ramps.seesaw import SeesawController
from simigrad_jax.ramps.token_schedules import DoublingWarmupController
from simigrad_jax.ramps.token_schedules import LinearRampController
from simigrad_jax.ramps.token_schedules import StepScheduleController

__all__ = [
  "BUILT_IN_CONTROLLERS",
  "controller_names",
  "controller_options",
  "make_controller",
  "register_controller",
]

ControllerFactory = Callable[..., BatchSizeController]


def _fixed(initial_batch_size: int, similarity_target: float = 0.0, **options: Any) -> Controller:
  """A constant batch size: SimiGrad's controller with adjustment off (similarity still logged).

  Without a profile, a bound left out (or None) defaults to
  ``initial_batch_size``, so that :class:`simigrad_jax.Trainer` compiles only
  the shapes it needs.
  """
  if (
    options.get("batch_sizes_to_profile") is None
    and validation.is_int(initial_batch_size)
    and initial_batch_size >= 1
  ):
    for key in ("batch_size_lower_bound", "batch_size_upper_bound"):
      if options.get(key) is None:
        options[key] = int(initial_batch_size)
  return Controller(initial_batch_size, similarity_target, enable_adjust=False, **options)


vars(_fixed).update(forwards_options_to=Controller, sets_options=("enable_adjust",))

# The built-in controllers by name: the one place where they are named.
BUILT_IN_CONTROLLERS: Mapping[str, ControllerFactory] = types.MappingProxyType(
  {
    "simigrad": Controller,
    "fixed": _fixed,
    "gns": GnsController,
    "allowance": AllowanceController,
    "linear": linear_schedule,
    "geometric": geometric_schedule,
    "decreasing": decreasing_schedule,
    "loss_plateau": LossPlateauController,
    "step_schedule": StepScheduleController,
    "linear_ramp": LinearRampController,
    "doubling_warmup": DoublingWarmupController,
    "seesaw": SeesawController,
  }
)

# What make_controller builds: the built-in controllers and those added with register_controller.
_FACTORIES: dict[str, ControllerFactory] = dict(BUILT_IN_CONTROLLERS)


def register_controller(name: str, factory: ControllerFactory) -> None:
  """Makes ``make_controller(name, ...)`` build a controller with ``factory(**options)``.

  Args:
    name: the new name (a name already registered is refused).
    factory: a controller class or a function returning a controller; the
      options :func:`make_controller` accepts are read from its signature.

  Raises:
    ValueError: for a name that is not a non-empty string or is taken, or a
      factory that cannot be called.

  Example (a whole controller written and registered: docs/controllers.md)::

    simigrad_jax.register_controller("proportional", ProportionalController)
    controller = simigrad_jax.make_controller("proportional", initial_batch_size=128)
  """
  if not isinstance(name, str) or not name.strip():
    raise ValueError(f"register_controller: the name must be a non-empty string, got {name!r}")
  if not callable(factory):
    raise ValueError(
      f"register_controller({name!r}, factory): the factory must be a controller class or a "
      f"function returning a controller, got {factory!r} ({type(factory).__name__})"
    )
  if name in _FACTORIES:
    raise ValueError(f"a controller named {name!r} is already registered")
  _FACTORIES[name] = factory


def controller_names() -> tuple[str, ...]:
  """The names :func:`make_controller` accepts."""
  return tuple(sorted(_FACTORIES))


def make_controller(name: str, **options: Any) -> BatchSizeController:
  """Builds the batch-size controller called ``name``.

  Args:
    name: one of :func:`controller_names`: ``"simigrad"``
      (:class:`Controller`: the reference rule), ``"fixed"`` (a constant
      batch size; the baseline), ``"linear"``, ``"geometric"`` and
      ``"decreasing"`` (:class:`ScheduleController`), ``"loss_plateau"``
      (:class:`LossPlateauController`), ``"gns"`` (:class:`GnsController`),
      ``"allowance"`` (:class:`AllowanceController`),
      ``"step_schedule"``, ``"linear_ramp"``, ``"doubling_warmup"``,
      ``"seesaw"`` (ramps in tokens), or any name added with :func:`register_controller`.
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
  if accepted is not None and (unknown := sorted(set(options) - set(accepted))):
    hints = validation.unknown_names(unknown, accepted)
    raise TypeError(
      f"make_controller({name!r}) got unknown option(s) {hints}; {name!r} takes {sorted(accepted)}"
    )
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
  names = {
    p.name
    for p in params
    if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
  }
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
    target = getattr(factory, "forwards_options_to", None)
    forwarded = None if target is None else _option_names(target)
    if forwarded is None:
      return None
    names |= set(forwarded) - set(getattr(factory, "sets_options", ()))
  return tuple(sorted(names))
