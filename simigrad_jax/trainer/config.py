"""Host: the Trainer's settings, in groups, each a frozen object checked when made.

:class:`TrainerConfig` holds the settings of the run itself (the micro-batch,
the seed, the split, the workdir, the multi-host timeout) and three groups
of the settings users think of together, as levanter nests its config:

- :class:`CompileConfig` (``config.compile``): the compiled shapes and how
  they compile;
- :class:`CheckpointConfig` (``config.checkpoints``): when checkpoints are
  saved, how many are kept and what a resume accepts;
- :class:`LearningRateConfig` (``config.lr``): how the learning rate follows
  the batch size.

Every setting is checked when its object is made, before anything is
created, compiled or trained, so that a bad value fails in seconds, not
after the first GPU-hour; each error names the value by its path
(``checkpoints.every_steps``) and what would be valid. A keyword that is no
setting is refused with the name it resembles, and 0.2's flat names
(``lr_rule``) with their place in the groups (:data:`MOVED_SETTINGS`). What
the settings cannot tell alone (a split the devices cannot serve, bounds the
data set cannot fill) is checked when the run is built
(:mod:`simigrad_jax.trainer.run_setup`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, Literal, Self, TypeVar

from simigrad_jax import validation
from simigrad_jax.compile import compiler
from simigrad_jax.compile import persistent_cache
from simigrad_jax.controllers import learning_rate
from simigrad_jax.ingraph import half_batch
from simigrad_jax.multihost import process_agreement
from simigrad_jax.shapes import batch_plan
from simigrad_jax.shapes import layout

Mode = Literal["recompile", "pad"]
MODES: tuple[str, ...] = ("recompile", "pad")

MOVED_SETTINGS: Mapping[str, str] = {
  "mode": "compile.mode",
  "min_micro_batch_size": "compile.min_micro_batch_size",
  "shapes_per_octave": "compile.shapes_per_octave",
  "background_compile": "compile.background",
  "compile_fallback": "compile.fallback",
  "steps_per_compile": "compile.steps_per_compile",
  "timed_fallback": "compile.timed_fallback",
  "compilation_cache_dir": "compile.cache_dir",
  "checkpoint_every_steps": "checkpoints.every_steps",
  "checkpoint_every_seconds": "checkpoints.every_seconds",
  "max_checkpoints": "checkpoints.max_to_keep",
  "allow_changed_settings": "checkpoints.allow_changed_settings",
  "lr_rule": "lr.rule",
  "lr_adjust_factor": "lr.adjust_factor",
  "lr_coupling": "lr.coupling",
}
"""The settings 0.3 moved into groups: 0.2's flat name -> its path in :class:`TrainerConfig`
(``"lr_rule"`` -> ``"lr.rule"``: ``TrainerConfig(lr=LearningRateConfig(rule=...))``)."""

_SettingsT = TypeVar("_SettingsT", bound=type)


def _refuses_unknown_names(cls: _SettingsT) -> _SettingsT:
  """Makes the dataclass ``cls`` refuse an unknown keyword with the name it resembles
  (:func:`check_setting_names`) instead of the dataclass's bare TypeError."""
  made = cls.__init__  # type: ignore[misc]

  @functools.wraps(made)
  def __init__(self: Any, *args: Any, **settings: Any) -> None:
    check_setting_names(settings, cls)
    made(self, *args, **settings)

  cls.__init__ = __init__  # type: ignore[misc]
  return cls


@contextlib.contextmanager
def _named_in(group: str) -> Iterator[None]:
  """Names a bad value by its path in :class:`TrainerConfig`: ``mode='fast' is not valid``
  becomes ``compile.mode='fast' is not valid``."""
  try:
    yield
  except ValueError as error:
    raise ValueError(f"{group}.{error}") from error


class _Settings:
  """What every group of settings shares: its path in :class:`TrainerConfig` and ``replace``."""

  PATH: ClassVar[str]
  """The group's field in :class:`TrainerConfig` (``"compile"``)."""

  def replace(self, **changes: Any) -> Self:
    """A copy with ``changes`` (checked as a new object).

    Raises:
      ValueError: for a bad value, naming it and what is valid.
      TypeError: for a name that is no setting of the group, suggesting the one it resembles.
    """
    return dataclasses.replace(self, **changes)  # type: ignore[type-var]

  def __post_init__(self) -> None:
    with _named_in(self.PATH):
      for name, value in self._checked().items():  # as plain Python numbers (NumPy ints too)
        object.__setattr__(self, name, value)

  def _checked(self) -> dict[str, Any]:
    """The fields, checked, that checking turns into plain Python values.

    Raises:
      ValueError: for a bad value, naming it (by its name in the group) and what is valid.
    """
    raise NotImplementedError


@_refuses_unknown_names
@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileConfig(_Settings):
  """The compiled shapes of a run and how they compile (``TrainerConfig.compile``).

  Attributes:
    mode: ``"recompile"`` (one compiled micro-step per shape of a grid,
      compiled ahead in the background) or ``"pad"`` (one shape; smaller
      batches are padded with zero-weight rows).
    min_micro_batch_size: the smallest compiled shape in ``recompile`` mode
      (None: 1; only the shapes the batch-size bounds need are compiled; at
      most ``TrainerConfig.max_micro_batch_size``).
    shapes_per_octave: the grid's shapes per factor of two in ``recompile``
      mode, 1 to 16 (:class:`simigrad_jax.shapes.BucketPolicy`), or None (the
      default): the coarsest grid whose padding over the batch-size bounds
      stays within 6% of the rows computed
      (:func:`simigrad_jax.shapes.grid_costs.choose_shapes_per_octave`). A
      batch that moves pads about ``35% / shapes_per_octave`` of the rows it
      computes, above the padding to whole rows per device (docs/compiling.md
      tabulates it). With the compile fallback only the shapes near the batch
      compile, as it comes near them; without it, every shape of the grid is
      one compile.
    shapes_per_step: the most micro-steps, 1 to 4, that hold a step's rows
      beyond its micro-steps of the largest shape, the largest shapes that
      fit first (:class:`simigrad_jax.shapes.BucketPolicy`): a step of 11
      rows per device on the grid of halvings runs 8 + 4 rows rather than
      16, so that a grid of about one shape per octave (few programs) pads
      little, at the price of up to this many micro-steps (and the update)
      in place of one fused step. Default 1: every micro-step of a step on
      one shape; the training scripts' default is 3 (docs/compiling.md
      tabulates both).
    whole_rows: round each batch size the controller decides to whole rows
      per device (a multiple of the data-parallel devices, or slots), in the
      direction of the change and within its bounds, as the reference
      implementation realises its sizes as workers x micro-batch x
      accumulation (:func:`simigrad_jax.shapes.batch_plan.round_to_whole_rows`);
      the controller adopts the rounded size, so that its next decision starts
      from the size that ran. A batch of a few rows per device otherwise pads
      the rest of a row on every device; the grid's shapes still pad as
      planned. It changes the batch sizes, hence the trajectory: recorded in
      the checkpoints (a resume with another value is refused unless allowed).
      Default False (every size as decided); the controller must not decide a
      step late or visit a profile (their sizes are their own).
    background: compile the other shapes in background threads.
    threads: the compiles of one program (the fused steps' shapes, or the
      micro-steps') that run at once, each in a thread of its own, an int
      ``>= 1``; None (the default): sized from the host, its cores less one
      for the training loop, at most 8
      (:func:`simigrad_jax.compile.compiler.host_compile_threads`). XLA's
      compile releases the GIL, so they overlap where the cores allow. Which
      program a step runs does not depend on it (see ``fallback``).
    fallback: in ``"recompile"`` mode, run a step whose micro-batch shape is
      still compiling on the nearest shape already compiled instead of
      waiting (the same examples and global batch, with more accumulation
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
      fraction admits several programs a step; default 4; the training
      scripts' default is 64). Larger: fewer waits on a slow compiler, more
      steps on the fallback (the same batch on admitted programs: more
      micro-steps, padding bounded by their smallest shape). A step that
      outruns its compile waits: a compile takes seconds, so steps of a
      tenth of a second or less ask for 64 or more (docs/compiling.md).
    timed_fallback: let the fallback follow the compiles' timing instead: a
      step runs on its own shape as soon as that is compiled, and never
      waits for a compile after the first step; but the shapes, hence the
      sums, the similarity and every later batch size, then depend on the
      machine's load, and a resumed run may differ from one not interrupted.
      With several processes, the fallback shape is then one that every
      process had compiled at the previous step's agreement.
    cache_dir: the persistent compilation cache's directory
      (:func:`simigrad_jax.compile.enable_persistent_cache`, a process-wide
      setting; ``TrainerConfig.allow_shared_workdir`` applies to it too). By
      default one directory shared by every run of this user
      (:func:`simigrad_jax.compile.persistent_cache.default_cache_dir`:
      ``$SIMIGRAD_JAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/simigrad_jax/
      compilation_cache``), so that a run in a new workdir loads the programs
      an earlier run compiled; capped in size, the least recently used
      programs evicted first. None or ``""``: no cache (JAX's own settings
      are left as they are).

  Raises:
    ValueError: for a bad value, naming it (``compile.mode=...``) and what is valid.
    TypeError: for a keyword that is no setting, suggesting the one it resembles.

  Example:
    >>> padded = CompileConfig(mode="pad")
    >>> padded.uses_fallback, padded.replace(mode="recompile").uses_fallback
    (False, True)
  """

  PATH: ClassVar[str] = "compile"

  mode: Mode = "recompile"
  min_micro_batch_size: int | None = None
  shapes_per_octave: int | None = None
  shapes_per_step: int = 1
  whole_rows: bool = False
  background: bool = True
  threads: int | None = None
  fallback: bool = True
  steps_per_compile: float = 4.0
  timed_fallback: bool = False
  cache_dir: str | os.PathLike | None = dataclasses.field(
    default_factory=persistent_cache.default_cache_dir
  )

  def threads_for_host(self) -> int:
    """The compile threads of one program: :attr:`threads`, or when None those the host affords
    (:func:`~simigrad_jax.compile.compiler.host_compile_threads`)."""
    return compiler.host_compile_threads() if self.threads is None else self.threads

  @property
  def uses_fallback(self) -> bool:
    """Whether a step whose shape is still compiling runs on a compiled one (see
    :attr:`fallback`: ``"recompile"`` mode, compiling in the background)."""
    return self.fallback and self.background and self.mode == "recompile"

  def _checked(self) -> dict[str, Any]:
    if self.mode not in MODES:
      raise ValueError(f"mode={self.mode!r} is not valid; choose one of {MODES}")
    checked: dict[str, Any] = {}
    if self.min_micro_batch_size is not None:
      if not validation.is_int(self.min_micro_batch_size) or self.min_micro_batch_size < 1:
        raise ValueError(
          f"min_micro_batch_size must be None or an integer >= 1 (and at most "
          f"max_micro_batch_size), got {self.min_micro_batch_size!r}"
        )
      checked["min_micro_batch_size"] = int(self.min_micro_batch_size)
    if self.shapes_per_octave is not None:
      checked["shapes_per_octave"] = batch_plan.check_shapes_per_octave(self.shapes_per_octave)
    checked["shapes_per_step"] = batch_plan.check_shapes_per_step(self.shapes_per_step)
    if self.threads is not None:
      checked["threads"] = validation.check_int("threads", self.threads)
    for name in ("whole_rows", "background", "fallback", "timed_fallback"):
      checked[name] = validation.check_bool(name, getattr(self, name))
    checked["steps_per_compile"] = validation.check_interval(
      "steps_per_compile", self.steps_per_compile, 0, low_open=True
    )
    if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
      raise ValueError(
        f"cache_dir must be None or a path (str or os.PathLike), got {self.cache_dir!r}"
      )
    if isinstance(self.cache_dir, str) and not self.cache_dir:
      checked["cache_dir"] = None  # "": no cache, as None
    return checked


@_refuses_unknown_names
@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig(_Settings):
  """When a run saves checkpoints, how many it keeps and what a resume accepts
  (``TrainerConfig.checkpoints``).

  Attributes:
    every_steps: save every this many steps (None: only at epoch ends and at
      the end).
    every_seconds: also save at the first step that ends this many seconds
      after the last checkpoint (None: never on time), so that a process
      killed without warning (SIGKILL, a lost host) loses at most about this
      much work. Decided on process 0's clock at each step's agreement, so
      every process saves at the same step. (A SIGTERM or SIGINT loses
      nothing: the run saves and stops.)
    max_to_keep: how many checkpoints to keep.
    allow_changed_settings: resume from a checkpoint made with other
      optimizer settings, controller settings, data, learning-rate rule or
      ``run_settings`` (the Trainer's) instead of refusing it with
      :class:`simigrad_jax.checkpoint.CheckpointMismatchError`; the changes
      are logged and kept in the history every later checkpoint carries. A
      changed model or optimizer structure is refused all the same (its
      arrays cannot be restored); a changed device count is always allowed.

  Raises:
    ValueError: for a bad value, naming it (``checkpoints.every_steps=...``) and what is valid.
    TypeError: for a keyword that is no setting, suggesting the one it resembles.

  Example:
    >>> CheckpointConfig(every_steps=100, max_to_keep=2).every_seconds is None
    True
  """

  PATH: ClassVar[str] = "checkpoints"

  every_steps: int | None = None
  every_seconds: float | None = None
  max_to_keep: int = 3
  allow_changed_settings: bool = False

  def _checked(self) -> dict[str, Any]:
    checked: dict[str, Any] = {}
    if self.every_steps is not None:
      checked["every_steps"] = validation.check_int("every_steps", self.every_steps, 1)
    if self.every_seconds is not None:
      checked["every_seconds"] = validation.check_interval(
        "every_seconds", self.every_seconds, 0, low_open=True
      )
    checked["max_to_keep"] = validation.check_int("max_to_keep", self.max_to_keep, 1)
    checked["allow_changed_settings"] = validation.check_bool(
      "allow_changed_settings", self.allow_changed_settings
    )
    return checked


@_refuses_unknown_names
@dataclasses.dataclass(frozen=True, kw_only=True)
class LearningRateConfig(_Settings):
  """How the learning rate follows the batch size (``TrainerConfig.lr``).

  The Trainer sets the factor :func:`simigrad_jax.lr_factor` gives for each
  step's batch size against the controller's initial one in the optimizer
  state (:func:`simigrad_jax.scale_by_lr_factor` applies it).

  Attributes:
    rule: ``"sqrt"``, ``"linear"`` or ``"none"`` (see :func:`simigrad_jax.lr_factor`).
    adjust_factor: optional damping of the learning-rate factor (>= 0).
    coupling: how the batch-size factor meets ``lr_schedule``: ``"full"``
      (multiplied at every step) or ``"peak"`` (in full at the schedule's
      peak, fading as it decays; see
      :func:`simigrad_jax.controllers.learning_rate.scheduled_lr_factor`).

  Raises:
    ValueError: for a bad value, naming it (``lr.rule=...``) and what is valid.
    TypeError: for a keyword that is no setting, suggesting the one it resembles.

  Example:
    >>> LearningRateConfig(rule="linear").coupling
    'full'
  """

  PATH: ClassVar[str] = "lr"

  rule: learning_rate.LrRule = "sqrt"
  adjust_factor: float | None = None
  coupling: learning_rate.LrCoupling = "full"

  def _checked(self) -> dict[str, Any]:
    if self.rule not in learning_rate.LR_RULES:
      raise ValueError(f"rule={self.rule!r} is not valid; choose one of {learning_rate.LR_RULES}")
    if self.coupling not in learning_rate.LR_COUPLINGS:
      raise ValueError(
        f"coupling={self.coupling!r} is not valid; choose one of {learning_rate.LR_COUPLINGS}"
      )
    if self.adjust_factor is None:
      return {}
    return {  # (as lr_factor checks it)
      "adjust_factor": validation.check_real(
        "adjust_factor", self.adjust_factor, "[0, inf)", lambda f: 0 <= f < math.inf
      )
    }


_GROUPS: Mapping[str, type[_Settings]] = {
  group.PATH: group for group in (CompileConfig, CheckpointConfig, LearningRateConfig)
}

_FLAGS = ("progress", "allow_shared_workdir")


@_refuses_unknown_names
@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig:
  """The settings of a training run, in groups, checked when made.

  Attributes:
    max_micro_batch_size: the most rows per device per micro-step (rounded up
      to even with the local split, whose two passes hold half each).
    seed: seeds the data order and the per-step random keys (an integer in
      ``[0, 2**32 - 1]``: :func:`simigrad_jax.validation.check_seed`).
    halves: the split into the two halves the similarity compares
      (:mod:`simigrad_jax.shapes.layout`): ``"device"`` (even devices
      against odd ones), ``"local"`` (two blocks of rows per device), or
      ``"auto"`` (``"device"`` on an even number of devices, else
      ``"local"``; see :meth:`halves_for`).
    measure_every: ``k``: the steps numbered ``0, k, 2k, ...`` (over the
      whole run, resumes included) measure the similarity, and a controller
      that reads it is updated on them only, holding its batch size over the
      plain steps between (one gradient pass each, at the plain step's cost;
      a step of several micro-batches measures, and is read by a controller
      of one move per measurement). 1 (the default): every step. A
      controller's ``steps_per_update`` must be 1 (one move per measurement)
      or ``k`` (the rule's rate per step, the reading to use with ``k > 1``;
      docs/controllers.md, "Measuring every k-th step"). Recorded in the
      checkpoints: a resume with another ``k`` is refused.
    halves_passes: with the local split, how each device takes its two
      halves' gradients (:data:`simigrad_jax.ingraph.half_batch.PASSES`):
      ``"sequential"`` (the default: one pass of each half's rows after the
      other, one half's activations held at a time), ``"stacked"``
      (one pass of both halves, each kernel's gradient a batched product) or
      ``"signed"`` (one pass of the whole rows with two cotangents). The
      same numbers to float rounding (docs/own_step.md, Choosing the passes);
      the device split takes one pass per device and reads none. Recorded in
      the checkpoints of a run with the local split: a resume with another
      value is refused.
    axis_name: the data-parallel axis name used by the transform.
    progress: show a progress bar (process 0 only).
    tensorboard: also write TensorBoard event files: None (the default) when
      tensorboardX is installed (the ``tensorboard`` and ``train`` extras),
      True to require it, False never.
    allow_shared_workdir: use a workdir (and compilation cache) that other
      users can change. By default the run refuses one that belongs to
      another user, or that a group or other users can write to (or whose
      parent folders they can: :func:`simigrad_jax.files.check_private_dir`),
      and keeps its checkpoints and cache unreadable by other users. True
      turns that off, for a shared file system of a pod whose folders are
      group-writable by design. The risk: whoever else can write there can
      change the run's checkpoints and metrics, or make it run code of their
      choosing through the compilation cache, whose programs JAX loads and runs.
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
    compile: the compiled shapes and how they compile (:class:`CompileConfig`).
    checkpoints: when checkpoints are saved and what a resume accepts
      (:class:`CheckpointConfig`).
    lr: how the learning rate follows the batch size (:class:`LearningRateConfig`).

  A nested setting is replaced through its group's own ``replace``:
  ``config.replace(compile=config.compile.replace(mode="pad"))``.

  Raises:
    ValueError: for a bad value, naming it by its path (``checkpoints.every_steps=...``)
      and what is valid.
    TypeError: for a keyword that is no setting, suggesting the one it resembles, and for
      a setting of 0.2 that moved into a group, naming its new place.

  Example:
    >>> config = TrainerConfig(max_micro_batch_size=32, seed=3)
    >>> config.compile.mode, config.checkpoints.max_to_keep, config.lr.rule
    ('recompile', 3, 'sqrt')
    >>> config.replace(compile=config.compile.replace(mode="pad")).compile.mode
    'pad'
    >>> config.halves_for(3)
    'local'
    >>> try:
    ...   TrainerConfig(max_micro_batch_size=32, lr_rule="linear")  # 0.2's flat name
    ... except TypeError as error:
    ...   print(str(error).split("; ")[-1])
    give lr=LearningRateConfig(rule='linear')
  """

  max_micro_batch_size: int
  seed: int = 0
  halves: str = "auto"
  measure_every: int = 1
  halves_passes: str = "sequential"
  axis_name: str = "batch"
  progress: bool = True
  tensorboard: bool | None = None
  allow_shared_workdir: bool = False
  agreement_timeout_seconds: float = process_agreement.AGREEMENT_TIMEOUT_SECONDS
  compile: CompileConfig = dataclasses.field(default_factory=CompileConfig)
  checkpoints: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  lr: LearningRateConfig = dataclasses.field(default_factory=LearningRateConfig)

  def __post_init__(self) -> None:
    for name, value in _checked_fields(self).items():  # as plain Python numbers (NumPy ints too)
      object.__setattr__(self, name, value)

  def replace(self, **changes: Any) -> TrainerConfig:
    """A copy with ``changes`` (checked as a new config).

    A setting in a group is replaced through the group's own ``replace``:
    ``config.replace(lr=config.lr.replace(rule="linear"))``.

    Raises:
      ValueError: for a bad value, naming it and what is valid.
      TypeError: for a name that is no setting (a moved one of 0.2 names its new place).
    """
    check_setting_names(changes, TrainerConfig, replacing=True)
    return dataclasses.replace(self, **changes)

  def halves_for(self, num_devices: int) -> str:
    """The split :attr:`halves` names on ``num_devices`` devices: ``"device"`` or ``"local"``.

    Raises:
      ValueError: ``"device"`` on an odd number of devices.
    """
    return layout.resolve_halves(self.halves, num_devices)


def _checked_fields(config: TrainerConfig) -> dict[str, Any]:
  """The run's own fields of ``config``, checked, that checking turns into plain Python numbers;
  the groups are checked when made, and here only against the run's settings.

  Raises:
    ValueError: for a bad value, naming it and what is valid.
  """
  for path, group in _GROUPS.items():
    if not isinstance(getattr(config, path), group):
      raise ValueError(
        f"{path} must be a simigrad_jax.{group.__name__}, got {getattr(config, path)!r:.200} "
        f"({type(getattr(config, path)).__name__})"
      )
  checked: dict[str, Any] = {}
  checked["max_micro_batch_size"] = max_micro = validation.check_int(
    "max_micro_batch_size", config.max_micro_batch_size, 1
  )
  min_micro = config.compile.min_micro_batch_size
  if min_micro is not None and min_micro > max_micro:
    raise ValueError(
      f"compile.min_micro_batch_size must be None or an integer in [1, max_micro_batch_size="
      f"{max_micro}], got {min_micro!r}"
    )
  checked["seed"] = validation.check_seed(config.seed)
  checked["measure_every"] = validation.check_int("measure_every", config.measure_every, 1)
  for name in _FLAGS:
    checked[name] = validation.check_bool(name, getattr(config, name))
  if config.tensorboard is not None:
    checked["tensorboard"] = validation.check_bool("tensorboard", config.tensorboard)
  if not isinstance(config.axis_name, str) or not config.axis_name:
    raise ValueError(f"axis_name must be a non-empty string, got {config.axis_name!r}")
  layout.check_halves(config.halves)
  if config.halves_passes not in half_batch.PASSES:
    raise ValueError(
      f"halves_passes={config.halves_passes!r} is not valid; choose one of "
      f"{tuple(half_batch.PASSES)} (how the local split takes its two halves' gradients)"
    )
  timeout = config.agreement_timeout_seconds
  checked["agreement_timeout_seconds"] = process_agreement.check_timeout(
    process_agreement.AGREEMENT_TIMEOUT_SECONDS if timeout is None else timeout
  )
  return checked


def check_setting_names(
  settings: Mapping[str, Any], group: type = TrainerConfig, *, replacing: bool = False
) -> None:
  """Refuses a name in ``settings`` that is no field of ``group``: a setting 0.2 had at the top
  that moved into a group (:data:`MOVED_SETTINGS`) with its new place, any other with the field
  it resembles.

  Args:
    settings: the keywords given to ``group`` (or to ``replace`` when ``replacing``).
    group: :class:`TrainerConfig` or one of its groups.
    replacing: name the new place as a ``config.replace(...)`` would give it.

  Raises:
    TypeError: naming every moved setting's new place, or every unknown setting and the fields.

  Example:
    >>> check_setting_names({"seed": 3})  # a field: nothing happens
    >>> try:
    ...   check_setting_names({"every_step": 3}, CheckpointConfig)
    ... except TypeError as error:
    ...   print(str(error).split("; ")[0])
    CheckpointConfig() got unexpected keyword argument(s) ['every_step']: 'every_step' (did you mean 'every_steps'?)
  """
  fields = [f.name for f in dataclasses.fields(group)]
  unknown = sorted(set(settings) - set(fields))
  moved = [name for name in settings if name in MOVED_SETTINGS and name not in fields]
  if group is TrainerConfig and moved:
    raise TypeError(_moved_message({name: settings[name] for name in moved}, replacing))
  if unknown:
    raise TypeError(
      f"{group.__name__}() got unexpected keyword argument(s) {unknown}: "
      f"{validation.unknown_names(unknown, fields)}; "
      f"the settings are the "
      f"fields of {group.__name__}: {fields}"
    )


def _moved_message(moved: Mapping[str, Any], replacing: bool) -> str:
  """Where 0.2's flat settings ``moved`` (name -> value) are given in 0.3, grouped by group:
  ``give lr=LearningRateConfig(rule='linear')`` (or ``lr=config.lr.replace(...)``)."""
  by_group: dict[str, list[str]] = {}
  for name, value in moved.items():
    path, field = MOVED_SETTINGS[name].split(".")
    by_group.setdefault(path, []).append(f"{field}={value!r:.80}")
  places = ", ".join(
    f"{path}=config.{path}.replace({', '.join(given)})"
    if replacing
    else f"{path}={_GROUPS[path].__name__}({', '.join(given)})"
    for path, given in by_group.items()
  )
  call = "config.replace" if replacing else "TrainerConfig"
  these = "this setting" if len(moved) == 1 else "these settings"
  return (
    f"{call}({', '.join(f'{name}=...' for name in moved)}): {these} moved into a group "
    f"in 0.3; give {places}"
  )
