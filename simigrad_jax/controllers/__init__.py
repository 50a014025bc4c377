"""Host: controllers that turn each step's measurements into the next global batch size.

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
``token_allowance`` (:class:`AllowanceController`, the fewest steps for a token allowance),
``similarity_model`` (the noise scale read from the similarities),
``profiling``, ``one_step_late``, ``wrapper`` (what both wrappers share)
and ``learning_rate`` (the learning-rate factor that follows the batch size).
Controllers by name (``make_controller``) are :mod:`simigrad_jax.registry`,
which names these and the ramps.

Documented API: the interface and its optional parts
(:class:`BatchSizeController`, :class:`AnticipatesBatchSizes`,
:class:`ProfilesBatchSizes`), the controllers above, :class:`GnsController`
(the gradient noise scale) and :class:`AllowanceController` (a token
allowance), the accessors through which the rest of the package reads any
controller (:func:`batch_size_bounds`, :func:`adapts`,
:func:`similarity_target`, :func:`likely_batch_sizes`), :func:`lr_factor`
(the learning-rate factor at a batch size, under one of ``LR_RULES``) and
:func:`noise_scale_estimates` (one step's estimates of ``|G|^2`` and
``tr(Sigma)`` from the halves' norms).
"""

from simigrad_jax.controllers.base import BaseController
from simigrad_jax.controllers.interface import AnticipatesBatchSizes
from simigrad_jax.controllers.interface import BatchSizeController
from simigrad_jax.controllers.interface import ProfilesBatchSizes
from simigrad_jax.controllers.interface import adapts
from simigrad_jax.controllers.interface import batch_size_bounds
from simigrad_jax.controllers.interface import likely_batch_sizes
from simigrad_jax.controllers.interface import similarity_target
from simigrad_jax.controllers.learning_rate import LR_RULES
from simigrad_jax.controllers.learning_rate import lr_factor
from simigrad_jax.controllers.noise_scale import GnsController
from simigrad_jax.controllers.noise_scale import noise_scale_estimates
from simigrad_jax.controllers.one_step_late import OneStepLateController
from simigrad_jax.controllers.profiling import ProfilingController
from simigrad_jax.controllers.simigrad import Controller
from simigrad_jax.controllers.token_allowance import AllowanceController

__all__ = [
  "AllowanceController",
  "AnticipatesBatchSizes",
  "BaseController",
  "BatchSizeController",
  "Controller",
  "GnsController",
  "LR_RULES",
  "OneStepLateController",
  "ProfilesBatchSizes",
  "ProfilingController",
  "adapts",
  "batch_size_bounds",
  "likely_batch_sizes",
  "lr_factor",
  "noise_scale_estimates",
  "similarity_target",
]
