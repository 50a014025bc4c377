"""Host: building a training run: check the objects, lay out, agree, resume, trace.

:func:`build_run` does what the Trainer needs before its first step, in order:

1. check every object (loss, optimizer, data, controller, devices,
   parameters, workdir) before anything is created, so that a bad one fails
   in seconds; each error names the value and what would be valid;
2. lay out: the mesh, the split into halves and the grid of compiled shapes
   (:class:`~simigrad_jax.engine.layout.StepLayout`);
3. agree: with several processes, every one must run the same program (a
   difference would deadlock the first collective), so they compare their
   settings first;
4. resume from the newest checkpoint in the workdir, if any, and agree on it;
5. trace the first step's program, so that a model, loss, optimizer and data
   that do not fit each other fail now; the programs compile in the
   background (:class:`~simigrad_jax.engine.programs.StepPrograms`).
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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from simigrad_jax import optimizer_state
from simigrad_jax.controllers import learning_rate
from simigrad_jax.data import grain_source
from simigrad_jax.data.sampler import EpochSampler
from simigrad_jax.engine import trainer_checks
from simigrad_jax.engine import train_step
from simigrad_jax.engine.compiler import enable_persistent_cache
from simigrad_jax.engine.config import TrainerConfig
from simigrad_jax.engine.data_loader import StepDataLoader
from simigrad_jax.engine.data_loader import local_device_positions
from simigrad_jax.engine.layout import StepLayout
from simigrad_jax.engine.programs import StepPrograms
from simigrad_jax.engine.step_inputs import StepInputs
from simigrad_jax.runtime.process_agreement import ProcessAgreement
from simigrad_jax.runtime.run_checkpoints import RunCheckpoints


@dataclasses.dataclass
class Run:
  """What the training loop needs, checked and built by :func:`build_run`.

  Attributes:
    workdir: the absolute workdir.
    source: the random-access data source.
    mesh: the one-axis mesh over the training devices.
    layout: the split into halves and the grid of compiled shapes.
    sampler: the order of the examples (resumed).
    state: the replicated ``{"params", "opt_state", "model_state"}`` (resumed).
    step: the optimizer steps done (resumed).
    nonfinite_steps: the steps whose gradient was not finite, so far.
    checkpoints: saves and resumes the run.
    programs: the step's compiled programs.
    data: loads each step's examples ahead.
    step_inputs: the learning-rate factor and the step's scalars.
  """

  workdir: pathlib.Path
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


def build_run(config: TrainerConfig, agreement: ProcessAgreement, *,
              loss_fn: train_step.PerExampleLossFn, params: Any,
              optimizer: optax.GradientTransformation, source: Any, controller: Any,
              workdir: str | os.PathLike, model_state: Any,
              eval_fn: Callable[[Any, Any], Mapping[str, float]] | None,
              lr_schedule: Callable[[float], float] | None,
              devices: list[jax.Device] | None) -> Run:
  """Checks the objects of a run, lays it out, agrees on it, resumes it and traces its first step.

  Args:
    config: the run's settings.
    agreement: the run's agreement between processes (its watchdog starts
      here and runs until it is closed).
    loss_fn, params, optimizer, source, controller, workdir, model_state,
      eval_fn, lr_schedule, devices: as :class:`simigrad_jax.Trainer` takes
      them (``source`` may be grain-style data; ``devices`` None: all).

  Returns:
    A :class:`Run`, resumed from the workdir's newest checkpoint if there is
    one; ``controller`` is resumed in place.

  Raises:
    ValueError: an object that could not train as asked (see the Trainer).
    ProcessDisagreementError: with several processes, different settings or
      resumed states.
  """
  source = grain_source.as_source(source)
  num_examples, workdir, devices, opt_state, lower, upper = _check_objects(
      config, loss_fn=loss_fn, params=params, optimizer=optimizer, source=source,
      controller=controller, workdir=workdir, eval_fn=eval_fn, lr_schedule=lr_schedule,
      devices=devices)
  mesh = Mesh(np.array(devices), (config.axis_name,))
  replicated = NamedSharding(mesh, P())
  # Plans and compiled shapes count rows per slot (a device, or half of one: see layout).
  layout = StepLayout.create(
      config.halves_for(len(devices)), len(devices), mode=config.mode,
      max_micro=config.max_micro_batch_size, min_micro=config.min_micro_batch_size,
      lower=lower, upper=upper)
  agreement.agree("settings", set_up=True, values=settings_to_agree(
      config, layout, controller=controller, source=source, params=params,
      num_examples=num_examples))

  workdir.mkdir(exist_ok=True)
  sampler = EpochSampler(num_examples, config.seed)
  state = jax.device_put({"params": params, "opt_state": opt_state, "model_state": model_state},
                         replicated)
  step = nonfinite_steps = 0
  checkpoints = RunCheckpoints(workdir / "checkpoints", seed=config.seed,
                               max_to_keep=config.max_checkpoints, agreement=agreement)
  # Multi-host: names a lost process when this one waits for it in a collective (until closed).
  agreement.start_watchdog()
  programs = None
  try:
    resumed = checkpoints.resume(state, sampler, controller)
    if resumed is not None:
      state, step, nonfinite_steps = resumed
    agreement.agree("resumed state", set_up=True,
                    values={"step": step, "controller": controller.state_dict(),
                            "sampler": sampler.state_dict()})
    if config.compilation_cache_dir is not None:
      enable_persistent_cache(config.compilation_cache_dir)
    # With several processes, a fallback uses only shapes that every process reported compiled
    # at the last step's agreement, so all of them pick the same shape.
    programs = StepPrograms(
        loss_fn=trainer_checks.checked_loss_fn(loss_fn, model_state), optimizer=optimizer,
        mesh=mesh, axis_name=config.axis_name, layout=layout, seed=config.seed, state=state,
        element_spec=source.element_spec,
        needs_accumulation=upper > layout.num_slots * max(layout.grid),
        background=config.background_compile, compile_fallback=config.uses_compile_fallback,
        shared_compiles=jax.process_count() > 1)
    # A model, loss, optimizer or data set that do not fit each other fail here.
    programs.trace(layout.plan(controller.batch_size).micro_batch_size)
  except BaseException:
    agreement.close()
    checkpoints.close()
    if programs is not None:
      programs.close()
    raise
  data = StepDataLoader(source, sampler, NamedSharding(mesh, P(config.axis_name)), replicated,
                        layout.slot_positions(local_device_positions(devices)),
                        layout.num_slots, place_ahead=jax.process_count() == 1, upper=upper,
                        plan_for=lambda batch_size: programs.ready_plan(layout.plan(batch_size)))
  step_inputs = StepInputs(
      base_batch_size=controller.initial_batch_size, lr_rule=config.lr_rule,
      lr_adjust_factor=config.lr_adjust_factor, lr_schedule=lr_schedule,
      lr_factor=optimizer_state.lr_factor_of(state["opt_state"]), replicated=replicated)
  return Run(workdir=workdir, source=source, mesh=mesh, layout=layout, sampler=sampler,
             state=state, step=step, nonfinite_steps=nonfinite_steps,
             checkpoints=checkpoints, programs=programs, data=data, step_inputs=step_inputs)


def _check_objects(config: TrainerConfig, *, loss_fn: Any, params: Any, optimizer: Any,
                   source: Any, controller: Any, workdir: str | os.PathLike, eval_fn: Any,
                   lr_schedule: Any, devices: Any
                   ) -> tuple[int, pathlib.Path, list[jax.Device], Any, int, int]:
  """Checks the run's objects against each other and the settings.

  Returns ``(examples in the source, the absolute workdir, the devices, the
  optimizer's initial state, the smallest and the largest global batch size)``.
  """
  trainer_checks.check_callable("loss_fn", loss_fn)
  for name, fn in (("eval_fn", eval_fn), ("lr_schedule", lr_schedule)):
    if fn is not None:
      trainer_checks.check_callable(name, fn)
  trainer_checks.check_controller(controller)
  num_examples = trainer_checks.check_source(source)
  workdir = trainer_checks.check_workdir(workdir)
  devices = trainer_checks.check_devices(devices)
  halves = config.halves_for(len(devices))
  trainer_checks.check_finite_params(params)
  opt_state = trainer_checks.checked_optimizer_state(optimizer, params)
  lower, upper = trainer_checks.check_bounds(controller, num_examples, halves)
  for size in (lower, controller.initial_batch_size, upper):
    learning_rate.lr_factor(size, controller.initial_batch_size, config.lr_rule,
                            config.lr_adjust_factor)
  return num_examples, workdir, devices, opt_state, lower, upper


def settings_to_agree(config: TrainerConfig, layout: StepLayout, *, controller: Any,
                      source: Any, params: Any, num_examples: int) -> dict[str, Any]:
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
      "controller": controller.config, "batch_size": controller.batch_size,
      "seed": config.seed, "mode": config.mode,
      "shapes": list(layout.device_grid), "lr_rule": config.lr_rule,
      "lr_adjust_factor": config.lr_adjust_factor, "num_examples": num_examples,
      "num_devices": layout.num_devices, "halves": layout.halves,
      "checkpoint_every_steps": config.checkpoint_every_steps,
      "element_spec": {k: [list(shape), str(dtype)] for k, (shape, dtype)
                       in sorted(source.element_spec.items())},
      "params": [[jax.tree_util.keystr(path), list(np.shape(x)), str(getattr(x, "dtype", ""))]
                 for path, x in jax.tree_util.tree_flatten_with_path(params)[0]],
  }
