"""Host: what a Trainer builds before its first step, one function a collaborator.

:class:`simigrad_jax.Trainer` calls these in order, and keeps what each returns:

1. :func:`check_objects`: every object (loss, optimizer, data, controller,
   devices, parameters, workdir) checked before anything is created, so that a
   bad one fails in seconds; each error names the value and what would be valid;
2. :func:`make_layout`: the split into halves and the grid of compiled shapes
   (:class:`~simigrad_jax.shapes.layout.StepLayout`);
3. :func:`settings_to_agree`: with several processes, every one must run the
   same program (a difference would deadlock the first collective), so they
   compare these first;
4. :func:`place_state`, then :func:`lock_workdir`: the workdir checked, private
   and locked for this run before anything in it is read or written
   (:mod:`simigrad_jax.multihost.workdir`);
5. :func:`run_record_of` and :func:`open_checkpoints`: what the run is
   (:mod:`simigrad_jax.checkpoint.run_record`), and its checkpoints, from
   which it resumes when the record allows;
6. :func:`make_programs` and :func:`make_data_loader`: the step's compiled
   programs (:class:`~simigrad_jax.compile.programs.StepPrograms`) and its
   rows' loader (:class:`~simigrad_jax.data.data_loader.StepDataLoader`).

Before 3, :func:`start_first_program` makes the step's functions and their
compiler from the state's placeholders and starts the first step's program
(its trace, then its load from the persistent cache or its compile) in the
background, so that 3 to 5 overlap it; :func:`open_run` waits for its trace.
"""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
from collections.abc import Mapping
from typing import Any, cast

import jax
import optax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from simigrad_jax import files
from simigrad_jax import validation
from simigrad_jax.checkpoint import run_record
from simigrad_jax.checkpoint.run_checkpoints import Resumed
from simigrad_jax.checkpoint.run_checkpoints import RunCheckpoints
from simigrad_jax.checkpoint.run_checkpoints import check_checkpoints_kept
from simigrad_jax.compile import schedule
from simigrad_jax.compile import step_functions
from simigrad_jax.compile.first_program import FirstProgram
from simigrad_jax.compile.persistent_cache import enable_persistent_cache
from simigrad_jax.compile.program_compiler import StepProgramCompiler
from simigrad_jax.compile.programs import StepPrograms
from simigrad_jax.compile.programs import step_compiler
from simigrad_jax.compile.step_functions import programs_of
from simigrad_jax.controllers import interface as controller_interface
from simigrad_jax.controllers import learning_rate
from simigrad_jax.data.data_loader import StepDataLoader
from simigrad_jax.data.data_loader import local_device_positions
from simigrad_jax.data.sampler import EpochSampler
from simigrad_jax.ingraph import lr_scaling
from simigrad_jax.ingraph import train_step
from simigrad_jax.multihost.process_agreement import ProcessAgreement
from simigrad_jax.multihost.workdir import WorkdirLock
from simigrad_jax.multihost.workdir import open_workdir
from simigrad_jax.shapes import batch_plan
from simigrad_jax.shapes import mesh_sharding
from simigrad_jax.shapes.layout import StepLayout
from simigrad_jax.trainer import checks
from simigrad_jax.trainer.config import TrainerConfig


def lock_workdir(
  given: Any, workdir: pathlib.Path, config: TrainerConfig, agreement: ProcessAgreement
) -> WorkdirLock | None:
  """Takes the workdir for this run (None when ``given`` is this process's held lock on it).

  Args:
    given: the ``workdir`` the Trainer was given (a path, or a held
      :class:`~simigrad_jax.multihost.workdir.WorkdirLock`).
    workdir: the absolute workdir (:func:`check_objects`).
    config: the run's settings (``allow_shared_workdir``).
    agreement: the run's agreement between processes.

  Returns:
    The run's lock on the workdir, or None when the caller holds it (and releases it).
  """
  if isinstance(given, WorkdirLock) and given.held and given.path == workdir:
    return None
  return open_workdir(workdir, allow_shared=config.allow_shared_workdir, agreement=agreement)


def place_state(
  initial: Mapping[str, Any], optimizer: optax.GradientTransformation, specs: Any, mesh: Mesh
) -> dict[str, Any]:
  """The run's ``{"params", "opt_state", "model_state"}`` on the mesh, with the parameters' specs.

  Copies: the steps donate the state's buffers, and the caller may still hold
  these arrays (``device_put`` alone would reuse a device array's buffer for
  the shard on its device). The optimizer state's copies of the parameters
  follow the parameters' specs.
  """
  return jax.device_put(
    jax.tree.map(_own_copy, initial),
    mesh_sharding.state_shardings(optimizer, initial, specs, mesh),
  )


def abstract_state(
  initial: Mapping[str, Any], optimizer: optax.GradientTransformation, specs: Any, mesh: Mesh
) -> dict[str, Any]:
  """The placeholders (shape, dtype, sharding) of the state :func:`place_state` places, made
  without placing it: the dtypes JAX gives the leaves on the devices, the state's shardings."""
  shapes = jax.eval_shape(lambda tree: tree, dict(initial))
  shardings = mesh_sharding.state_shardings(optimizer, initial, specs, mesh)
  return jax.tree.map(
    lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
    shapes,
    shardings,
  )


def may_resume(workdir: pathlib.Path) -> bool:
  """Whether ``workdir`` holds a checkpoint folder with anything in it (read before the workdir
  is locked: a hint for what to start early, never what a step runs)."""
  checkpoints = workdir / "checkpoints"
  try:
    return checkpoints.is_dir() and any(checkpoints.iterdir())
  except OSError:
    return True


def start_first_program(
  config: TrainerConfig,
  workdir: pathlib.Path,
  layout: StepLayout,
  initial: Mapping[str, Any],
  *,
  loss_fn: train_step.PerExampleLossFn,
  optimizer: optax.GradientTransformation,
  specs: Any,
  mesh: Mesh,
  element_spec: Any,
  batch_size: int,
  fixed_batch: bool,
) -> FirstProgram:
  """The step's functions and compiler, made from the state's placeholders, with the first step's
  program started in the background (:class:`~simigrad_jax.compile.first_program.FirstProgram`).

  The persistent compilation cache is turned on first (``config.compile.cache_dir``), so that the
  program loads from it. The first step's programs are those the compile schedule admits for it
  (:func:`~simigrad_jax.compile.schedule.first_step_programs`: the smallest shape's micro-step
  and the update where the run starts by accumulating), else its plan's own. In a workdir that may
  resume (:func:`may_resume`), only the traces start: the checkpoint decides the first step's
  shape.

  Args:
    config: the run's settings.
    workdir: the absolute workdir.
    layout: the run's split and shapes.
    initial: the initial ``{"params", "opt_state", "model_state"}``.
    loss_fn, optimizer, specs, mesh, element_spec: what the programs are made of.
    batch_size: the controller's batch size before any resume.
    fixed_batch: the run's bounds are one batch size: its first plan's programs are all the run
      compiles (:class:`~simigrad_jax.compile.schedule.CompileSchedule`).

  Returns:
    The first program under way; :meth:`~simigrad_jax.compile.first_program.FirstProgram.result`
    raises the trace's error.
  """
  if config.compile.cache_dir is not None:
    enable_persistent_cache(config.compile.cache_dir, allow_shared=config.allow_shared_workdir)
  state = abstract_state(initial, optimizer, specs, mesh)
  compiler = make_compiler(
    config,
    layout,
    state,
    loss_fn=loss_fn,
    model_state=initial["model_state"],
    optimizer=optimizer,
    mesh=mesh,
    element_spec=element_spec,
  )
  plan = layout.plan(batch_size)
  scheduled = config.compile.uses_fallback and not config.compile.timed_fallback
  programs = (
    schedule.first_step_programs(layout, plan, fixed_batch) if scheduled else programs_of(plan)
  )
  return FirstProgram(
    compiler,
    state,
    programs,
    lambda: checks.transform_named_for(config.axis_name),
    queue=not may_resume(workdir),
  )


def make_compiler(
  config: TrainerConfig,
  layout: StepLayout,
  state: Mapping[str, Any],
  *,
  loss_fn: train_step.PerExampleLossFn,
  model_state: Any,
  optimizer: optax.GradientTransformation,
  mesh: Mesh,
  element_spec: Any,
) -> StepProgramCompiler:
  """The step's jitted functions, made from ``state``'s shapes, dtypes and shardings (the state
  or its placeholders), and their compiler (:func:`~simigrad_jax.compile.programs.step_compiler`).

  Args:
    config: the run's settings (the data axis, the seed, the halves' passes, how to compile).
    layout: the run's split and shapes.
    state: the ``{"params", "opt_state", "model_state"}`` the steps run on, or its placeholders.
    loss_fn: the per-example loss, checked here against ``model_state``'s structure.
    model_state, optimizer, mesh, element_spec: what the functions are made of.

  Returns:
    The compiler :func:`make_programs` takes, nothing traced or compiled yet.
  """
  functions = step_functions.StepFunctions(
    loss_fn=train_step.checked_loss_fn(loss_fn, model_state),
    optimizer=optimizer,
    mesh=mesh,
    axis_name=config.axis_name,
    layout=layout,
    seed=config.seed,
    state=state,
    element_spec=element_spec,
    passes=config.halves_passes,
  )
  return step_compiler(
    functions, background=config.compile.background, threads=config.compile.threads_for_host()
  )


def make_layout(config: TrainerConfig, num_data: int, lower: int, upper: int) -> StepLayout:
  """The split into halves and the grid of compiled shapes of a run over ``num_data`` data positions.

  Plans and compiled shapes count rows per slot (a device, or half of one:
  :mod:`simigrad_jax.shapes.layout`), for global batch sizes in ``[lower, upper]``.
  """
  return StepLayout.create(
    config.halves_for(num_data),
    num_data,
    mode=config.compile.mode,
    max_micro=config.max_micro_batch_size,
    min_micro=config.compile.min_micro_batch_size,
    shapes_per_octave=config.compile.shapes_per_octave,
    shapes_per_step=config.compile.shapes_per_step,
    lower=lower,
    upper=upper,
  )


def check_whole_rows(
  config: TrainerConfig, controller: Any, layout: StepLayout, lower: int, upper: int | None
) -> None:
  """Refuses ``compile.whole_rows`` where it cannot round the controller's decisions: bounds
  that hold no multiple of the slots, a controller that decides a step late or visits a profile
  (the size it returns, or visits, is not the one it decided last).

  Raises:
    ValueError: naming the setting and why.
  """
  if not config.compile.whole_rows:
    return
  batch_plan.check_whole_rows_bounds(layout.num_slots, lower, upper)
  late = bool(controller.config.get("one_step_late", False))
  profile = isinstance(controller, controller_interface.ProfilesBatchSizes) and bool(
    tuple(controller.profile_batch_sizes)
  )
  if late or profile:
    what = "decides a step late" if late else "visits a profile of batch sizes"
    raise ValueError(
      f"compile.whole_rows=True rounds the size the controller decided last, but this "
      f"controller ({type(controller).__name__}) {what}; use compile.whole_rows=False"
    )


def open_checkpoints(
  config: TrainerConfig, workdir: pathlib.Path, agreement: ProcessAgreement, record: dict[str, Any]
) -> RunCheckpoints:
  """The run's checkpoints in ``workdir/checkpoints`` (made private), recorded as ``record``."""
  check_checkpoints_kept(workdir)  # (before the folder is made)
  return RunCheckpoints(
    files.make_private_dir(
      workdir / "checkpoints",
      what="checkpoint folder",
      tighten=True,
      allow_shared=config.allow_shared_workdir,
    ),
    seed=config.seed,
    max_to_keep=config.checkpoints.max_to_keep,
    agreement=agreement,
    record=record,
    allow_changed_settings=config.checkpoints.allow_changed_settings,
  )


def make_programs(
  config: TrainerConfig,
  compiler: StepProgramCompiler,
  *,
  upper: int,
  cached_programs: dict[str, Any] | None,
  fixed_batch: bool = False,
) -> StepPrograms:
  """The step's compiled programs on ``compiler`` (:func:`make_compiler`), compiling in the
  background.

  The fallback follows the schedule of ``steps_per_compile``, the same on
  every process; with ``timed_fallback`` and several processes, it uses only
  shapes that every process reported compiled at the last step's agreement,
  so all of them pick the same shape. ``cached_programs``: what a resumed
  checkpoint says the persistent compilation cache holds and the schedule's
  state (None: a new run). The persistent cache is on since the compiler was
  made (:func:`start_first_program`). ``fixed_batch``: the run's bounds are one batch size, and
  the schedule compiles only its plan's programs.
  """
  return StepPrograms(
    compiler,
    accumulation_shapes=compiler.functions.layout.accumulation_shapes(upper),
    compile_fallback=config.compile.uses_fallback,
    steps_per_compile=None if config.compile.timed_fallback else config.compile.steps_per_compile,
    shared_compiles=jax.process_count() > 1,
    compilation_cache_dir=config.compile.cache_dir,
    cached_programs=cached_programs,
    fixed_batch=fixed_batch,
  )


def open_run(
  config: TrainerConfig,
  given_workdir: Any,
  workdir: pathlib.Path,
  agreement: ProcessAgreement,
  record: dict[str, Any],
  *,
  state: dict[str, Any],
  sampler: EpochSampler,
  controller: Any,
  loss_fn: train_step.PerExampleLossFn,
  model_state: Any,
  optimizer: optax.GradientTransformation,
  element_spec: Any,
  mesh: Mesh,
  layout: StepLayout,
  upper: int,
  fixed_batch: bool,
  first: FirstProgram,
) -> tuple[WorkdirLock | None, RunCheckpoints, StepPrograms, Resumed]:
  """Takes the workdir, resumes from its newest checkpoint and waits for the first step's trace.

  In order: the workdir locked (:func:`lock_workdir`); the watchdog that names
  a lost process started; the checkpoints opened and the newest one resumed
  when the run's record allows (``sampler`` and ``controller`` in place);
  every process agreeing on the resumed state; the programs made
  (:func:`make_programs`, on ``first``'s compiler when its placeholders are
  the resumed state's); the programs the first step may run queued, so that
  they load or compile beside the first step's trace and while the set-up
  ends; and that trace waited for, so that a model, loss, optimizer and data
  that do not fit each other fail now. On an error, what was opened is closed again (the
  agreement and ``first``'s compiler too).

  Args:
    config: the run's settings.
    given_workdir, workdir: the workdir as given, and as checked (absolute).
    agreement: the run's agreement between processes.
    record: the run's record (:func:`run_record_of`).
    state: the initial state on the mesh (:func:`place_state`).
    sampler, controller: the run's, resumed in place.
    loss_fn, model_state, optimizer, element_spec, mesh, layout, upper, fixed_batch: what
      the programs are made of (:func:`make_compiler` when ``first``'s
      placeholders are not the resumed state's, :func:`make_programs`).
    first: the first step's program, started before (:func:`start_first_program`).

  Returns:
    ``(the run's lock on the workdir or None, the checkpoints, the programs,
    what the run resumed from)``: a new run resumes from ``state`` at step 0.
  """
  with contextlib.ExitStack() as undo:
    undo.callback(agreement.close)
    undo.callback(first.compiler.close)
    workdir_lock = lock_workdir(given_workdir, workdir, config, agreement)
    if workdir_lock is not None:
      undo.callback(workdir_lock.close)
    agreement.start_watchdog()  # names a lost process a collective waits for (until closed)
    checkpoints = open_checkpoints(config, workdir, agreement, record)
    undo.callback(checkpoints.close)
    resumed = checkpoints.resume(state, sampler, controller) or Resumed(state, 0, 0)
    agreement.agree(
      "resumed state",
      set_up=True,
      values={
        "step": resumed.step,
        "controller": controller.state_dict(),
        "sampler": sampler.state_dict(),
      },
    )
    # The functions of placeholders other than the resumed state's are never used (there are
    # none such: this only guards the programs against a stale executable).
    same = _same_placeholders(resumed.state, first.state)
    compiler = first.compiler
    if not same:
      compiler = make_compiler(
        config,
        layout,
        resumed.state,
        loss_fn=loss_fn,
        model_state=model_state,
        optimizer=optimizer,
        mesh=mesh,
        element_spec=element_spec,
      )
    programs = make_programs(
      config,
      compiler,
      upper=upper,
      cached_programs=resumed.compiled_programs,
      fixed_batch=fixed_batch,
    )
    undo.callback(programs.compiler.close)
    if same:
      # The programs the first step may run are queued while its own is still traced: the others
      # (the fallback's micro-step and update) are traced and lowered once its own is lowered,
      # and load or compile beside it (StepFunctions.trace_under_way). train() asks again: a
      # no-op.
      programs.policy.start(controller.batch_size, resumed.step)
    first.result()  # misfits fail here, at the first trace
    if not same:
      first.compiler.close()
      with checks.transform_named_for(config.axis_name):
        programs.functions.trace(layout.plan(controller.batch_size).micro_batch_size)
      programs.policy.start(controller.batch_size, resumed.step)
    undo.pop_all()
  return workdir_lock, checkpoints, programs, resumed


def _same_placeholders(state: Any, other: Any) -> bool:
  """Whether two states' leaves have the same shapes, dtypes and shardings, in the same tree."""
  leaves, tree = jax.tree.flatten(step_functions.abstract(dict(state)))
  other_leaves, other_tree = jax.tree.flatten(step_functions.abstract(dict(other)))
  return leaves == other_leaves and cast(object, tree) == other_tree  # (PyTreeDef's ==)


def make_data_loader(
  config: TrainerConfig,
  source: Any,
  sampler: EpochSampler,
  mesh: Mesh,
  devices: list[jax.Device],
  layout: StepLayout,
) -> StepDataLoader:
  """The loader of each step's rows, placing them ahead on a one-process run."""
  if mesh.axis_names == (config.axis_name,):
    positions = local_device_positions(devices)
  else:
    positions = mesh_sharding.data_positions(mesh, config.axis_name)
  return StepDataLoader(
    source,
    sampler,
    NamedSharding(mesh, P(config.axis_name)),
    NamedSharding(mesh, P()),
    layout.slot_positions(positions),
    layout.num_slots,
    place_ahead=jax.process_count() == 1,
  )


def _own_copy(leaf: Any) -> Any:
  """A copy of a device array (NumPy arrays are copied onto the devices by device_put)."""
  return leaf.copy() if isinstance(leaf, jax.Array) else leaf


def check_objects(
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

  Raises:
    ValueError: for a bad object or setting, naming it and what would be
      valid: among them an empty workdir, an ``lr_schedule`` whose first
      multiplier is NaN, infinite or negative, an optimizer chain out of order
      (:func:`simigrad_jax.ingraph.lr_scaling.check_chain_order`) and an
      optimizer hyperparameter that is NaN or infinite, or a negative learning
      rate (:func:`check_hyperparameters`).
  """
  checks.check_callable("loss_fn", loss_fn)
  for name, fn in (("eval_fn", eval_fn), ("lr_schedule", lr_schedule)):
    if fn is not None:
      checks.check_callable(name, fn)
  if lr_schedule is not None:
    check_lr_multiplier("lr_schedule(0.0)", lr_schedule(0.0))
  checks.check_controller(controller)
  num_examples = checks.check_source(source)
  workdir = checks.check_workdir(validation.check_path("workdir", workdir))
  if mesh is None:
    devices = checks.check_devices(devices)
    num_data = len(devices)
  else:
    mesh = mesh_sharding.check_mesh(mesh, config.axis_name, devices)
    devices, num_data = list(mesh.devices.flat), mesh.shape[config.axis_name]
  halves = config.halves_for(num_data)
  checks.check_finite_params(params)
  opt_state = checks.checked_optimizer_state(optimizer, params)
  lr_scaling.check_chain_order(opt_state)
  check_hyperparameters(optimizer, opt_state)
  lower, upper = checks.check_bounds(controller, num_examples, halves)
  for size in (lower, controller.initial_batch_size, upper):
    learning_rate.lr_factor(
      size, controller.initial_batch_size, config.lr.rule, config.lr.adjust_factor
    )
  return num_examples, workdir, devices, opt_state, lower, upper


def check_lr_multiplier(name: str, value: Any) -> float:
  """Returns the learning-rate multiplier ``value`` as a float if it is finite and >= 0.

  A bool (Python's, NumPy's or a 0-d array of bools) is refused: ``float(True)``
  is 1.0, so a schedule that answers a bool would train at full rate.

  Raises:
    ValueError: naming ``name`` (``"lr_schedule(0.0)"``) and the value.
  """
  if validation.is_flag(value):
    raise ValueError(f"{name} must be a number in [0, inf) (finite), not a bool, got {value!r}")
  return validation.check_interval(name, validation.as_float(value), 0)


def check_hyperparameters(optimizer: optax.GradientTransformation, opt_state: Any) -> None:
  """Refuses an optimizer with a hyperparameter that is NaN or infinite, or a negative learning rate
  it names.

  The hyperparameters are the numbers the optimizer's functions close over
  and those ``optax.inject_hyperparams`` keeps in its state, as the run's
  record describes them (:mod:`simigrad_jax.checkpoint.run_record`). A NaN
  learning rate would write NaN into every parameter at the first step while
  its gradients are finite. A negative learning rate is seen only where
  ``inject_hyperparams`` names it: optax's ``sgd(-0.1)`` keeps ``step_size =
  0.1``, which a deliberate ``optax.scale(0.1)`` keeps too.

  Raises:
    ValueError: naming the hyperparameter's place in the optimizer and its value.

  Example:
    >>> import jax.numpy as jnp, optax, simigrad_jax
    >>> bad = optax.chain(simigrad_jax.transform(), optax.sgd(float("nan")),
    ...                   simigrad_jax.scale_by_lr_factor())
    >>> try:
    ...   check_hyperparameters(bad, bad.init(jnp.zeros(2)))
    ... except ValueError as error:
    ...   print(str(error).split(":")[0])
    the optimizer's hyperparameter update.update_fns[1].update_fns[1].tx.update.step_size is nan
  """
  described = run_record.describe_optimizer(optimizer)
  injected = run_record.injected_hyperparameters(opt_state)
  for place, value in (described | injected).items():
    number = _hyperparameter(value)
    if number is None:
      continue
    if not math.isfinite(number):
      raise ValueError(
        f"the optimizer's hyperparameter {place} is {number}: every step would write NaN or "
        f"infinite values into the parameters; give the optimizer finite hyperparameters"
      )
    if place.endswith("['learning_rate']") and number < 0:
      raise ValueError(
        f"the optimizer's learning rate is negative ({place} = {number}): every step would "
        f"climb the loss; give a learning rate >= 0"
      )


def _hyperparameter(value: Any) -> float | None:
  """A described hyperparameter as a float (``"nan"``, ``"inf"``: the record's non-finite
  floats), or None for one that is no number."""
  if isinstance(value, str):
    return float(value) if value in ("nan", "inf", "-inf") else None
  return validation.as_float(value)


def mesh_settings(mesh: Mesh, specs: Any) -> dict[str, Any]:
  """The mesh's axes and the parameters' specs as JSON data; empty on a one-axis, replicated run."""
  spec_leaves = jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P))
  sharded = {jax.tree_util.keystr(path): str(spec) for path, spec in spec_leaves if spec != P()}
  if len(mesh.axis_names) == 1 and not sharded:
    return {}
  return {"mesh": {str(name): int(size) for name, size in mesh.shape.items()}, "specs": sharded}


def agree_on_run(
  config: TrainerConfig,
  layout: StepLayout,
  agreement: ProcessAgreement,
  initial: Mapping[str, Any],
  *,
  optimizer: optax.GradientTransformation,
  controller: Any,
  source: Any,
  devices: list[jax.Device],
  mesh: Mesh,
  specs: Any,
  run_settings: Mapping[str, Any] | None,
) -> dict[str, Any]:
  """Makes every process agree on what the run is, and returns the run's record.

  With several processes, every one must run the same program (a difference
  would deadlock the first collective), so they compare
  :func:`settings_to_agree` and the mesh's settings before anything is
  compiled.

  Args:
    config: the run's settings.
    layout: the run's split and shapes.
    agreement: the agreement between the run's processes.
    initial: the initial ``{"params", "opt_state", "model_state"}``.
    optimizer, controller, source, devices, run_settings: the run's.
    mesh, specs: the mesh and the parameters' ``PartitionSpec``s.

  Returns:
    The run's record (:func:`run_record_of`), as JSON data.

  Raises:
    ProcessDisagreementError: the processes were built differently.
  """
  on_mesh = mesh_settings(mesh, specs)
  shared = settings_to_agree(
    config,
    layout,
    controller=controller,
    source=source,
    params=initial["params"],
    num_examples=len(source),
  )
  agreement.agree("settings", set_up=True, values=shared | on_mesh)
  return run_record_of(
    config,
    layout,
    initial,
    optimizer=optimizer,
    controller=controller,
    source=source,
    num_examples=len(source),
    devices=devices,
    run_settings=run_settings,
    mesh_settings=on_mesh,
  )


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
    "mode": config.compile.mode,
    "shapes": list(layout.device_grid),
    "lr_rule": config.lr.rule,
    "lr_adjust_factor": config.lr.adjust_factor,
    "num_examples": num_examples,
    "num_devices": layout.num_devices,
    "halves": layout.halves,
    "measure_every": config.measure_every,
    "whole_rows": config.compile.whole_rows,
    "halves_passes": config.halves_passes,
    "checkpoint_every_steps": config.checkpoints.every_steps,
    "checkpoint_every_seconds": config.checkpoints.every_seconds,
    "element_spec": run_record.describe_element_spec(source.element_spec),
    "params": run_record.describe_tree(params),
  }


def _passes_record(config: TrainerConfig, layout: StepLayout) -> dict[str, str]:
  """The run record's ``halves_passes``: recorded where the local split reads it and it is not
  the default (so that a checkpoint written before the setting compares the same)."""
  if layout.halves != "local" or config.halves_passes == "sequential":
    return {}
  return {"halves_passes": config.halves_passes}


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
    config: the run's settings: ``config.lr`` (its coupling recorded when
      not ``"full"``) decides the trajectory (the seed is checked on its
      own); the split, the shapes and the fallback only lay the steps out.
      The record names them as 0.2's flat settings did (``lr_rule``,
      ``mode``, ...), so that a checkpoint of 0.2 compares the same.
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
    trainer={"lr_rule": config.lr.rule, "lr_adjust_factor": config.lr.adjust_factor}
    | ({} if config.lr.coupling == "full" else {"lr_coupling": config.lr.coupling})
    | ({} if config.measure_every == 1 else {"measure_every": config.measure_every})
    | ({"whole_rows": True} if config.compile.whole_rows else {})
    | _passes_record(config, layout),
    layout={
      "halves": layout.halves,
      "mode": config.compile.mode,
      "max_micro_batch_size": config.max_micro_batch_size,
      "min_micro_batch_size": config.compile.min_micro_batch_size,
      "compile_fallback": config.compile.uses_fallback,
    },
    devices={
      "num_devices": len(devices),
      "num_processes": jax.process_count(),
      "platform": devices[0].platform,
      **(mesh_settings or {}),
    },
    settings=run_settings,
  )
