"""Host: the Trainer's settings, one frozen object checked in one place.

Every setting is checked when the :class:`TrainerConfig` is made, before
anything is created, compiled or trained, so that a bad value fails in
seconds, not after the first GPU-hour; each error names the value and what
would be valid. What the settings cannot tell alone (a split the devices
cannot serve, bounds the data set cannot fill) is checked when the run is
built (:mod:`simigrad_jax.trainer.run_setup`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any, Literal

from simigrad_jax import validation
from simigrad_jax.controllers import learning_rate
from simigrad_jax.multihost import process_agreement
from simigrad_jax.shapes import batch_plan
from simigrad_jax.shapes import layout

Mode = Literal["recompile", "pad"]
MODES: tuple[str, ...] = ("recompile", "pad")

_FLAGS = (
  "background_compile",
  "compile_fallback",
  "timed_fallback",
  "progress",
  "allow_shared_workdir",
  "allow_changed_settings",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig:
  """The settings of a training run, checked when made.

  A keyword that is no setting is refused with a ``TypeError`` that names the
  setting it resembles (``max_micro_batch``: ``max_micro_batch_size``).

  Attributes:
    max_micro_batch_size: the most rows per device per micro-step (rounded up
      to even with the local split, whose two passes hold half each).
    mode: ``"recompile"`` (one compiled micro-step per shape of a grid,
      compiled ahead in the background) or ``"pad"`` (one shape; smaller
      batches are padded with zero-weight rows).
    min_micro_batch_size: the smallest compiled shape in ``recompile`` mode
      (None: 1; only the shapes the batch-size bounds need are compiled).
    shapes_per_octave: the grid's shapes per factor of two in ``recompile``
      mode, 1 to 16 (:class:`simigrad_jax.shapes.BucketPolicy`), or None (the
      default): 8. A batch that moves pads about ``35% / shapes_per_octave``
      of the rows it computes (8: 4%; 1, the halvings: 15-30%). With the
      compile fallback only the shapes near the batch compile, as it comes
      near them; without it, every shape of the grid is one compile.
    lr_rule: ``"sqrt"``, ``"linear"`` or ``"none"`` (see
      :func:`simigrad_jax.lr_factor`).
    lr_adjust_factor: optional damping of the learning-rate factor (>= 0).
    lr_coupling: how the batch-size factor meets ``lr_schedule``: ``"full"``
      (multiplied at every step) or ``"peak"`` (in full at the schedule's
      peak, fading as it decays; see
      :func:`simigrad_jax.controllers.learning_rate.scheduled_lr_factor`).
    seed: seeds the data order and the per-step random keys.
    checkpoint_every_steps: save every this many steps (None: only at epoch
      ends and at the end).
    checkpoint_every_seconds: also save at the first step that ends this
      many seconds after the last checkpoint (None: never on time), so that
      a process killed without warning (SIGKILL, a lost host) loses at most
      about this much work. Decided on process 0's clock at each step's
      agreement, so every process saves at the same step. (A SIGTERM or
      SIGINT loses nothing: the run saves and stops.)
    max_checkpoints: how many checkpoints to keep.
    allow_changed_settings: resume from a checkpoint made with other
      optimizer settings, controller settings, data, learning-rate rule or
      ``run_settings`` (the Trainer's) instead of refusing it with
      :class:`simigrad_jax.checkpoint.CheckpointMismatchError`; the changes are logged
      and kept in the history every later checkpoint carries. A changed
      model or optimizer structure is refused all the same (its arrays
      cannot be restored); a changed device count is always allowed.
    background_compile: compile the other shapes in a background thread.
    compile_fallback: in ``"recompile"`` mode, run a step whose micro-batch
      shape is still compiling on the nearest shape already compiled instead
      of waiting (the same examples and global batch, with more accumulation
      steps or zero-weight padding; the record's ``compile_fallback`` says
      so), so that only the first step waits for a compile (for its shape's
      programs, and the micro-step and update that let a larger batch
      accumulate on that shape, compiled while it runs). With BatchNorm the
      statistics are those of the fallback's micro-batches. Which steps fall
      back is decided from the step count, never the clock
      (:mod:`simigrad_jax.compile.schedule`): each program the run requests
      (its batch's shape and those near it) may run ``steps_per_compile``
      steps after the one before it in the schedule, so the same config and
      seed give the same steps whether interrupted or not, on a loaded
      machine or an idle one; a step whose program the schedule admits
      before its compile has finished waits for it.
    steps_per_compile: the steps the schedule gives each compile (> 0; a
      fraction admits several programs a step). Larger: fewer waits on a
      slow compiler, more steps on a fallback shape.
    timed_fallback: let the fallback follow the compiles' timing instead: a
      step runs on its own shape as soon as that is compiled, and never
      waits for a compile after the first step; but the shapes, hence the
      sums, the similarity and every later batch size, then depend on the
      machine's load, and a resumed run may differ from one not interrupted.
      With several processes, the fallback shape is then one that every
      process had compiled at the previous step's agreement.
    compilation_cache_dir: optional persistent compilation cache directory
      (:func:`simigrad_jax.compile.enable_persistent_cache`, a process-wide setting).
    allow_shared_workdir: use a workdir (and compilation cache) that other
      users can change. By default the run refuses one that belongs to
      another user, or that a group or other users can write to (or whose
      parent folders they can: :func:`simigrad_jax.files.check_private_dir`),
      and keeps its checkpoints and cache unreadable by other users. True
      turns that off, for a shared file system of a pod whose folders are
      group-writable by design. The risk: whoever else can write there can
      change the run's checkpoints and metrics, or make it run code of their
      choosing through the compilation cache, whose programs JAX loads and runs.
    tensorboard: also write TensorBoard event files: None (the default) when
      tensorboardX is installed (the ``tensorboard`` and ``train`` extras),
      True to require it, False never.
    progress: show a progress bar (process 0 only).
    axis_name: the data-parallel axis name used by the transform.
    halves: the split into the two halves the similarity compares
      (:mod:`simigrad_jax.shapes.layout`): ``"device"`` (even devices
      against odd ones), ``"local"`` (two blocks of rows per device), or
      ``"auto"`` (``"device"`` on an even number of devices, else
      ``"local"``; see :meth:`halves_for`).
    agreement_timeout_seconds: several hosts: how long a process waits for
      the others at a check (the settings, every step's decision, every
      checkpoint; and after a step failed) before it raises
      :class:`simigrad_jax.multihost.ProcessLostError` naming the missing ones. A
      process that waits this long in a collective while a peer's heartbeats
      have stopped is ended with the same error by a watchdog
      (:class:`simigrad_jax.multihost.process_agreement.Watchdog`). Default
      :data:`simigrad_jax.multihost.process_agreement.AGREEMENT_TIMEOUT_SECONDS`
      (300; None means it too); keep it above the longest time a process may
      wait for another at a step's end.

  Raises:
    ValueError: for a bad value, naming it and what is valid.

  Example:
    >>> config = TrainerConfig(max_micro_batch_size=32, seed=3)
    >>> config.replace(mode="pad").mode
    'pad'
    >>> config.halves_for(3)
    'local'
  """

  max_micro_batch_size: int
  mode: Mode = "recompile"
  min_micro_batch_size: int | None = None
  shapes_per_octave: int | None = None
  lr_rule: learning_rate.LrRule = "sqrt"
  lr_adjust_factor: float | None = None
  lr_coupling: learning_rate.LrCoupling = "full"
  seed: int = 0
  checkpoint_every_steps: int | None = None
  checkpoint_every_seconds: float | None = None
  max_checkpoints: int = 3
  allow_changed_settings: bool = False
  background_compile: bool = True
  compile_fallback: bool = True
  steps_per_compile: float = 0.5
  timed_fallback: bool = False
  compilation_cache_dir: str | os.PathLike | None = None
  allow_shared_workdir: bool = False
  tensorboard: bool | None = None
  progress: bool = True
  axis_name: str = "batch"
  halves: str = "auto"
  agreement_timeout_seconds: float = process_agreement.AGREEMENT_TIMEOUT_SECONDS

  def __new__(cls, *args: Any, **settings: Any) -> TrainerConfig:
    # Before the dataclass's __init__, whose TypeError for an unknown keyword suggests nothing.
    _check_setting_names(settings)
    return super().__new__(cls)

  def __post_init__(self):
    for name, value in _checked_fields(self).items():  # as plain Python numbers (NumPy ints too)
      object.__setattr__(self, name, value)

  def replace(self, **changes: Any) -> TrainerConfig:
    """A copy with ``changes`` (checked as a new config)."""
    return dataclasses.replace(self, **changes)

  def halves_for(self, num_devices: int) -> str:
    """The split :attr:`halves` names on ``num_devices`` devices: ``"device"`` or ``"local"``.

    Raises:
      ValueError: ``"device"`` on an odd number of devices.
    """
    return layout.resolve_halves(self.halves, num_devices)

  @property
  def uses_compile_fallback(self) -> bool:
    """Whether a step whose shape is still compiling runs on a compiled one (see
    :attr:`compile_fallback`: ``"recompile"`` mode, compiling in the background)."""
    return self.compile_fallback and self.background_compile and self.mode == "recompile"


def _checked_fields(config: TrainerConfig) -> dict[str, Any]:
  """The fields of ``config``, checked, that checking turns into plain Python numbers.

  Raises:
    ValueError: for a bad value, naming it and what is valid.
  """
  if config.mode not in MODES:
    raise ValueError(f"mode={config.mode!r} is not valid; choose one of {MODES}")
  if config.lr_rule not in learning_rate.LR_RULES:
    raise ValueError(
      f"lr_rule={config.lr_rule!r} is not valid; choose one of {learning_rate.LR_RULES}"
    )
  if config.lr_coupling not in learning_rate.LR_COUPLINGS:
    raise ValueError(
      f"lr_coupling={config.lr_coupling!r} is not valid; choose one of {learning_rate.LR_COUPLINGS}"
    )
  checked: dict[str, Any] = {}
  checked["max_micro_batch_size"] = max_micro = validation.check_int(
    "max_micro_batch_size", config.max_micro_batch_size, 1
  )
  if config.min_micro_batch_size is not None:
    if (
      not validation.is_int(config.min_micro_batch_size)
      or not 1 <= config.min_micro_batch_size <= max_micro
    ):
      raise ValueError(
        f"min_micro_batch_size must be None or an integer in [1, max_micro_batch_size="
        f"{max_micro}], got {config.min_micro_batch_size!r}"
      )
    checked["min_micro_batch_size"] = int(config.min_micro_batch_size)
  if config.shapes_per_octave is not None:
    checked["shapes_per_octave"] = batch_plan.check_shapes_per_octave(config.shapes_per_octave)
  if config.lr_adjust_factor is not None:
    checked["lr_adjust_factor"] = validation.check_real(  # (as lr_factor checks it)
      "lr_adjust_factor", config.lr_adjust_factor, "[0, inf)", lambda f: 0 <= f < math.inf
    )
  checked["seed"] = validation.check_int("seed", config.seed, 0)
  if config.checkpoint_every_steps is not None:
    checked["checkpoint_every_steps"] = validation.check_int(
      "checkpoint_every_steps", config.checkpoint_every_steps, 1
    )
  if config.checkpoint_every_seconds is not None:
    checked["checkpoint_every_seconds"] = validation.check_real(
      "checkpoint_every_seconds",
      config.checkpoint_every_seconds,
      "(0, inf) (finite)",
      lambda x: 0 < x < math.inf,
    )
  checked["steps_per_compile"] = validation.check_real(
    "steps_per_compile", config.steps_per_compile, "(0, inf) (finite)", lambda x: 0 < x < math.inf
  )
  checked["max_checkpoints"] = validation.check_int("max_checkpoints", config.max_checkpoints, 1)
  for name in _FLAGS:
    checked[name] = validation.check_bool(name, getattr(config, name))
  if config.tensorboard is not None:
    checked["tensorboard"] = validation.check_bool("tensorboard", config.tensorboard)
  if config.compilation_cache_dir is not None and not isinstance(
    config.compilation_cache_dir, (str, os.PathLike)
  ):
    raise ValueError(
      f"compilation_cache_dir must be None or a path (str or os.PathLike), "
      f"got {config.compilation_cache_dir!r}"
    )
  if not isinstance(config.axis_name, str) or not config.axis_name:
    raise ValueError(f"axis_name must be a non-empty string, got {config.axis_name!r}")
  layout.check_halves(config.halves)
  timeout = config.agreement_timeout_seconds
  checked["agreement_timeout_seconds"] = process_agreement.check_timeout(
    process_agreement.AGREEMENT_TIMEOUT_SECONDS if timeout is None else timeout
  )
  return checked


def _check_setting_names(settings: Mapping[str, Any]) -> None:
  """Refuses a name in ``settings`` that is no field of :class:`TrainerConfig`, suggesting the
  field it resembles.

  Raises:
    TypeError: naming every unknown setting and the fields.

  Example:
    >>> _check_setting_names({"seed": 3})  # a field: nothing happens
  """
  fields = [f.name for f in dataclasses.fields(TrainerConfig)]
  unknown = sorted(set(settings) - set(fields))
  if unknown:
    raise TypeError(
      f"TrainerConfig() got unexpected keyword argument(s) {unknown}: "
      f"{validation.unknown_names(unknown, fields)}; the settings are the fields of "
      f"TrainerConfig: {fields}"
    )
