"""Host: building a training run: check the objects, lay out, agree, resume, trace.

:func:`build_run` does what the Trainer needs before its first step, in order:

1. check every object (loss, optimizer, data, controller, devices,
   parameters, workdir) before anything is created, so that a bad one fails
   in seconds; each error names the value and what would be valid;
2. lay out: the mesh, the split into halves and the grid of compiled shapes
   (:class:`~simigrad_jax.shapes.layout.StepLayout`);
3. agree: with several processes, every one must run the same program (a
   difference would deadlock the first collective), so they compare their
   settings first;
4. take the workdir: checked, private, and locked for this run before anything
   in it is read or written (:mod:`simigrad_jax.multihost.workdir`);
5. record what the run is (:mod:`simigrad_jax.checkpoint.run_record`), resume
   from the newest checkpoint in the workdir, if any, when its record allows
   (:mod:`simigrad_jax.checkpoint.run_checkpoints`), and agree on it;
6. trace the first step's program, so that a model, loss, optimizer and data
   that do not fit each other fail now; the programs compile in the
   background (:class:`~simigrad_jax.compile.programs.StepPrograms`).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from simigrad_jax import files
from simigrad_jax import optimizer_state
from simigrad_jax.checkpoint import run_record
from simigrad_jax.checkpoint.run_checkpoints import RunCheckpoints
from simigrad_jax.compile.persistent_cache import enable_persistent_cache
from simigrad_jax.compile.programs import StepPrograms
from simigrad_jax.controllers import learning_rate
from simigrad_jax.data import grain_source
from simigrad_jax.data.data_loader import StepDataLoader
from simigrad_jax.data.data_loader import local_device_positions
from simigrad_jax.data.sampler import EpochSampler
from simigrad_jax.ingraph import train_step
from simigrad_jax.multihost.process_agreement import ProcessAgreement
from simigrad_jax.multihost.workdir import WorkdirLock
from simigrad_jax.multihost.workdir import open_workdir
from simigrad_jax.shapes import mesh_sharding
from simigrad_jax.shapes.layout import StepLayout
from simigrad_jax.trainer import checks
from simigrad_jax.trainer.config import TrainerConfig
from simigrad_jax.trainer.step_inputs import StepInputs


@dataclasses.dataclass
class Run:
  """What the training loop needs, checked and built by :func:`build_run`.

  Attributes:
    workdir: the absolute workdir.
    workdir_lock: the run's lock on it, when the run took it (None: the
      caller holds it, and releases it).
    source: the random-access data source.
    mesh: the mesh: one data axis over the training devices, or the mesh
      given, whose other axes the parameters may be sharded over.
    layout: the split into halves and the grid of compiled shapes.
    sampler: the order of the examples (resumed).
    state: the ``{"params", "opt_state", "model_state"}`` on the mesh, with
      the parameters' shardings (replicated by default; resumed).
    step: the optimizer steps done (resumed).
    nonfinite_steps: the steps whose gradient was not finite, so far.
    checkpoints: saves and resumes the run.
    programs: the step's compiled programs.
    data: loads each step's examples ahead.
    step_inputs: the learning-rate factor and the step's scalars.
  """

  workdir: pathlib.Path
  workdir_lock: WorkdirLock | None
  source: Any
  mesh: Mesh
  layout: StepLayout
  sampler: EpochSampler
  state: dict[str, Any]
  step: int
  nonfinite_steps: int
  checkpoints: RunCheckpoints
  programs: StepPrograms
  data: StepDataLoader
  step_inputs: StepInputs


def build_run(
  config: TrainerConfig,
  agreement: ProcessAgreement,
  *,
  loss_fn: train_step.PerExampleLossFn,
  params: Any,
  optimizer: optax.GradientTransformation,
  source: Any,
  controller: Any,
  workdir: str | os.PathLike,
  model_state: Any,
  eval_fn: Callable[[Any, Any], Mapping[str, float]] | None,
  lr_schedule: Callable[[float], float] | None,
  devices: list[jax.Device] | None,
  run_settings: Mapping[str, Any] | None = None,
  mesh: Mesh | None = None,
  param_sharding: mesh_sharding.ParamSharding = None,
) -> Run:
  """Checks the objects of a run, lays it out, agrees on it, resumes it and traces its first step.

  Args:
    config: the run's settings.
    agreement: the run's agreement between processes (its watchdog starts
      here and runs until it is closed).
    loss_fn, params, optimizer, source, controller, workdir, model_state,
      eval_fn, lr_schedule, devices, run_settings, mesh, param_sharding: as
      :class:`simigrad_jax.Trainer` takes them (``source`` may be grain-style
      data; ``devices`` None: all, or the mesh's).

  Returns:
    A :class:`Run`, resumed from the workdir's newest checkpoint if there is
    one; ``controller`` is resumed in place.

  Raises:
    ValueError: an object that could not train as asked (see the Trainer).
    CheckpointMismatchError: (a ValueError) the workdir holds checkpoints of
      another run (see :mod:`simigrad_jax.checkpoint.run_checkpoints`).
    ProcessDisagreementError: with several processes, different settings or
      resumed states.
  """
  source = grain_source.as_source(source)
  given_workdir = workdir
  num_examples, workdir, devices, opt_state, lower, upper = _check_objects(
    config,
    loss_fn=loss_fn,
    params=params,
    optimizer=optimizer,
    source=source,
    controller=controller,
    workdir=workdir,
    eval_fn=eval_fn,
    lr_schedule=lr_schedule,
    devices=devices,
    mesh=mesh,
  )
  if mesh is None:
    mesh = Mesh(np.array(devices), (config.axis_name,))
  num_data = mesh.shape[config.axis_name]  # data-parallel positions: the slots' devices
  specs = mesh_sharding.param_specs(param_sharding, params, mesh)
  replicated = NamedSharding(mesh, P())
  # Plans and compiled shapes count rows per slot (a device, or half of one: see layout).
  layout = StepLayout.create(
    config.halves_for(num_data),
    num_data,
    mode=config.mode,
    max_micro=config.max_micro_batch_size,
    min_micro=config.min_micro_batch_size,
    shapes_per_octave=config.shapes_per_octave,
    lower=lower,
    upper=upper,
  )
  agreement.agree(
    "settings",
    set_up=True,
    values=settings_to_agree(
      config, layout, controller=controller, source=source, params=params, num_examples=num_examples
    )
    | _mesh_settings(mesh, specs),
  )

  sampler = EpochSampler(num_examples, config.seed)
  initial = {"params": params, "opt_state": opt_state, "model_state": model_state}
  record = run_record_of(
    config,
    layout,
    initial,
    optimizer=optimizer,
    controller=controller,
    source=source,
    num_examples=num_examples,
    devices=devices,
    run_settings=run_settings,
    mesh_settings=_mesh_settings(mesh, specs),
  )
  # Copies: the steps donate the state's buffers, and the caller may still hold these arrays
  # (device_put alone would reuse a device array's buffer for the shard on its device).
  state = jax.device_put(
    jax.tree.map(_own_copy, initial),
    mesh_sharding.state_shardings(optimizer, initial, specs, mesh),
  )
  step = nonfinite_steps = 0
  workdir_lock = _lock_workdir(given_workdir, workdir, config, agreement)
  checkpoints = programs = None
  # Multi-host: names a lost process when this one waits for it in a collective (until closed).
  agreement.start_watchdog()
  try:
    checkpoints = RunCheckpoints(
      files.make_private_dir(
        workdir / "checkpoints",
        what="checkpoint folder",
        tighten=True,
        allow_shared=config.allow_shared_workdir,
      ),
      seed=config.seed,
      max_to_keep=config.max_checkpoints,
      agreement=agreement,
      record=record,
      allow_changed_settings=config.allow_changed_settings,
    )
    resumed = checkpoints.resume(state, sampler, controller)
    if resumed is not None:
      state, step, nonfinite_steps = resumed.state, resumed.step, resumed.nonfinite_steps
    agreement.agree(
      "resumed state",
      set_up=True,
      values={"step": step, "controller": controller.state_dict(), "sampler": sampler.state_dict()},
    )
    if config.compilation_cache_dir is not None:
      enable_persistent_cache(
        config.compilation_cache_dir, allow_shared=config.allow_shared_workdir
      )
    # With several processes, a fallback uses only shapes that every process reported compiled
    # at the last step's agreement, so all of them pick the same shape.
    programs = StepPrograms(
      loss_fn=train_step.checked_loss_fn(loss_fn, model_state),
      optimizer=optimizer,
      mesh=mesh,
      axis_name=config.axis_name,
      layout=layout,
      seed=config.seed,
      state=state,
      element_spec=source.element_spec,
      accumulation_shapes=layout.accumulation_shapes(upper),
      background=config.background_compile,
      compile_fallback=config.uses_compile_fallback,
      shared_compiles=jax.process_count() > 1,
      compilation_cache_dir=config.compilation_cache_dir,
      cached_programs=None if resumed is None else resumed.compiled_programs,
    )
    # A model, loss, optimizer or data set that do not fit each other fail here.
    with checks.transform_named_for(config.axis_name):
      programs.trace(layout.plan(controller.batch_size).micro_batch_size)
  except BaseException:
    agreement.close()
    if checkpoints is not None:
      checkpoints.close()
    if programs is not None:
      programs.close()
    if workdir_lock is not None:
      workdir_lock.close()
    raise
  step_inputs = StepInputs(
    base_batch_size=controller.initial_batch_size,
    lr_rule=config.lr_rule,
    lr_adjust_factor=config.lr_adjust_factor,
    lr_schedule=lr_schedule,
    lr_factor=optimizer_state.lr_factor_of(state["opt_state"]),
    replicated=replicated,
  )
  data = StepDataLoader(
    source,
    sampler,
    NamedSharding(mesh, P(config.axis_name)),
    replicated,
    layout.slot_positions(
      local_device_positions(devices)
      if mesh.axis_names == (config.axis_name,)
      else mesh_sharding.data_positions(mesh, config.axis_name)
    ),
    layout.num_slots,
    place_ahead=jax.process_count() == 1,
    upper=upper,
    plan_for=lambda batch_size: programs.ready_plan(layout.plan(batch_size)),
    lower=lower,
    anticipate=getattr(controller, "likely_batch_sizes", None),
    place_inputs_ahead=lambda sizes, served, remaining: step_inputs.place_ahead(
      sizes, served / num_examples, remaining
    ),
  )
  return Run(
    workdir=workdir,
    workdir_lock=workdir_lock,
    source=source,
    mesh=mesh,
    layout=layout,
    sampler=sampler,
    state=state,
    step=step,
    nonfinite_steps=nonfinite_steps,
    checkpoints=checkpoints,
    programs=programs,
    data=data,
    step_inputs=step_inputs,
  )


def _lock_workdir(
  given: Any, workdir: pathlib.Path, config: TrainerConfig, agreement: ProcessAgreement
) -> WorkdirLock | None:
  """Takes the workdir for this run (None when ``given`` is this process's held lock on it)."""
  if isinstance(given, WorkdirLock) and given.held and given.path == workdir:
    return None
  return open_workdir(workdir, allow_shared=config.allow_shared_workdir, agreement=agreement)


def _own_copy(leaf: Any) -> Any:
  """A copy of a device array (NumPy arrays are copied onto the devices by device_put)."""
  return leaf.copy() if isinstance(leaf, jax.Array) else leaf


def _check_objects(
  config: TrainerConfig,
  *,
  loss_fn: Any,
  params: Any,
  optimizer: Any,
  source: Any,
  controller: Any,
  workdir: str | os.PathLike,
  eval_fn: Any,
  lr_schedule: Any,
  devices: Any,
  mesh: Any,
) -> tuple[int, pathlib.Path, list[jax.Device], Any, int, int]:
  """Checks the run's objects against each other and the settings.

  With a ``mesh``, the devices are the mesh's, and the split into halves is
  that of its data axis.

  Returns ``(examples in the source, the absolute workdir, the devices, the
  optimizer's initial state, the smallest and the largest global batch size)``.
  """
  checks.check_callable("loss_fn", loss_fn)
  for name, fn in (("eval_fn", eval_fn), ("lr_schedule", lr_schedule)):
    if fn is not None:
      checks.check_callable(name, fn)
  checks.check_controller(controller)
  num_examples = checks.check_source(source)
  workdir = checks.check_workdir(workdir)
  if mesh is None:
    devices = checks.check_devices(devices)
    num_data = len(devices)
  else:
    mesh = mesh_sharding.check_mesh(mesh, config.axis_name, devices)
    devices, num_data = list(mesh.devices.flat), mesh.shape[config.axis_name]
  halves = config.halves_for(num_data)
  checks.check_finite_params(params)
  opt_state = checks.checked_optimizer_state(optimizer, params)
  lower, upper = checks.check_bounds(controller, num_examples, halves)
  for size in (lower, controller.initial_batch_size, upper):
    learning_rate.lr_factor(
      size, controller.initial_batch_size, config.lr_rule, config.lr_adjust_factor
    )
  return num_examples, workdir, devices, opt_state, lower, upper


def _mesh_settings(mesh: Mesh, specs: Any) -> dict[str, Any]:
  """The mesh's axes and the parameters' specs as JSON data; empty on a one-axis, replicated run."""
  spec_leaves = jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P))
  sharded = {jax.tree_util.keystr(path): str(spec) for path, spec in spec_leaves if spec != P()}
  if len(mesh.axis_names) == 1 and not sharded:
    return {}
  return {"mesh": {str(name): int(size) for name, size in mesh.shape.items()}, "specs": sharded}


def settings_to_agree(
  config: TrainerConfig,
  layout: StepLayout,
  *,
  controller: Any,
  source: Any,
  params: Any,
  num_examples: int,
) -> dict[str, Any]:
  """What every process of a multi-host run must share, as JSON-able values to compare.

  A difference would deadlock the first collective, so the processes compare
  these before anything is compiled.

  Args:
    config: the run's settings (those that shape the programs and the data).
    layout: the run's split and shapes.
    controller: the run's controller (its settings and batch size).
    source: the data source (its ``element_spec``).
    params: the parameters (their paths, shapes and dtypes; not their values).
    num_examples: the examples in the source.

  Returns:
    A dict of the values.
  """
  return {
    "controller": controller.config,
    "batch_size": controller.batch_size,
    "seed": config.seed,
    "mode": config.mode,
    "shapes": list(layout.device_grid),
    "lr_rule": config.lr_rule,
    "lr_adjust_factor": config.lr_adjust_factor,
    "num_examples": num_examples,
    "num_devices": layout.num_devices,
    "halves": layout.halves,
    "checkpoint_every_steps": config.checkpoint_every_steps,
    "checkpoint_every_seconds": config.checkpoint_every_seconds,
    "element_spec": run_record.describe_element_spec(source.element_spec),
    "params": run_record.describe_tree(params),
  }


def run_record_of(
  config: TrainerConfig,
  layout: StepLayout,
  initial: Mapping[str, Any],
  *,
  optimizer: optax.GradientTransformation,
  controller: Any,
  source: Any,
  num_examples: int,
  devices: list[jax.Device],
  run_settings: Mapping[str, Any] | None,
  mesh_settings: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
  """The run's record, saved with every checkpoint and compared on resume.

  Args:
    config: the run's settings: ``lr_rule`` and ``lr_adjust_factor`` decide
      the trajectory (the seed is checked on its own); the split, the shapes
      and the fallback only lay the steps out.
    layout: the run's split and shapes.
    initial: the initial ``{"params", "opt_state", "model_state"}``.
    optimizer, controller, source, num_examples, devices, run_settings: the
      run's (see :func:`simigrad_jax.checkpoint.run_record.make_record`).
    mesh_settings: the mesh's axes and the parameters' specs, recorded with
      the devices, when the run has model axes or sharded parameters.

  Returns:
    The record (JSON data).
  """
  return run_record.make_record(
    optimizer=optimizer,
    state=initial,
    num_examples=num_examples,
    element_spec=source.element_spec,
    controller=controller.config,
    trainer={"lr_rule": config.lr_rule, "lr_adjust_factor": config.lr_adjust_factor},
    layout={
      "halves": layout.halves,
      "mode": config.mode,
      "max_micro_batch_size": config.max_micro_batch_size,
      "min_micro_batch_size": config.min_micro_batch_size,
      "compile_fallback": config.uses_compile_fallback,
    },
    devices={
      "num_devices": len(devices),
      "num_processes": jax.process_count(),
      "platform": devices[0].platform,
      **(mesh_settings or {}),
    },
    settings=run_settings,
  )
