"""Host: batch-size ramps, schedules that move the batch without gradient feedback.

The baselines an adaptive batch is compared with: epoch schedules and the
loss-plateau rule (``schedules``), the ramps language-model trainers use,
counted in tokens or examples (``token_schedules``: Megatron-LM's thresholds,
MaxText's linear ramp, the doubling warmup; ``seesaw``), and a run's realised
sizes replayed as a step schedule (``replay``). Each is a controller
(:class:`simigrad_jax.controllers.BaseController`), built by name with
:func:`simigrad_jax.make_controller` (the table of :mod:`simigrad_jax.registry`,
a floor above this room).

Documented API: :class:`ScheduleController` (``"linear"``, ``"geometric"``,
``"decreasing"``) and :class:`LossPlateauController`;
:class:`StepScheduleController`, :class:`LinearRampController` and
:class:`DoublingWarmupController`; :class:`SeesawController`;
:func:`replay_schedule` (a run's records as a step schedule) and
:func:`replay_controller` (the ``"step_schedule"`` controller that runs it again).
"""

from simigrad_jax.ramps.replay import replay_controller
from simigrad_jax.ramps.replay import replay_schedule
from simigrad_jax.ramps.schedules import LossPlateauController
from simigrad_jax.ramps.schedules import ScheduleController
from simigrad_jax.ramps.seesaw import SeesawController
from simigrad_jax.ramps.token_schedules import DoublingWarmupController
from simigrad_jax.ramps.token_schedules import LinearRampController
from simigrad_jax.ramps.token_schedules import StepScheduleController

__all__ = [
  "DoublingWarmupController",
  "LinearRampController",
  "LossPlateauController",
  "ScheduleController",
  "SeesawController",
  "StepScheduleController",
  "replay_controller",
  "replay_schedule",
]
