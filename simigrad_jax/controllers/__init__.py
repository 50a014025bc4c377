"""Host side: controllers that turn each step's measurements into the next global batch size.

The interface the Trainer reads is :class:`BatchSizeController`; every
controller here derives from :class:`BaseController`, on which a new one is a
rule of two or three methods (docs/controllers.md). :class:`ProfilingController`
adds a similarity-versus-batch-size profile to any controller;
:class:`OneStepLateController` makes any controller's decisions take effect
a step later. The batch-size ramps without gradient feedback are
:mod:`simigrad_jax.ramps`, a floor above.

Modules: ``interface`` (what the Trainer reads), ``base`` (the base class), ``state``
(the saved state every controller shares), ``simigrad``
(:class:`Controller`, SimiGrad's rule), ``noise_scale`` (the gradient noise scale),
``similarity_model`` (the noise scale read from the similarities),
``profiling``, ``one_step_late``, ``wrapper`` (what both wrappers share),
``registry`` (controllers by name) and ``learning_rate`` (the learning-rate
factor that follows the batch size).
"""

from simigrad_jax.controllers.base import BaseController
from simigrad_jax.controllers.interface import AnticipatesBatchSizes
from simigrad_jax.controllers.interface import BatchSizeController
from simigrad_jax.controllers.interface import ProfilesBatchSizes
from simigrad_jax.controllers.noise_scale import GnsController
from simigrad_jax.controllers.one_step_late import OneStepLateController
from simigrad_jax.controllers.profiling import ProfilingController
from simigrad_jax.controllers.registry import controller_names
from simigrad_jax.controllers.registry import controller_options
from simigrad_jax.controllers.registry import make_controller
from simigrad_jax.controllers.registry import register_controller
from simigrad_jax.controllers.simigrad import Controller

__all__ = [
  "AnticipatesBatchSizes",
  "BaseController",
  "BatchSizeController",
  "Controller",
  "GnsController",
  "OneStepLateController",
  "ProfilesBatchSizes",
  "ProfilingController",
  "controller_names",
  "controller_options",
  "make_controller",
  "register_controller",
]
