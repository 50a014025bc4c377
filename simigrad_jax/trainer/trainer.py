"""Host: the adaptive-batch training loop.

:meth:`Trainer.train` runs :meth:`StepLoop.run_steps`, one optimizer step after
another, each in the same order, written out in that one method:

1. plan: the controller's global batch size on the devices
   (:class:`~simigrad_jax.shapes.layout.StepLayout`): micro-batch shape,
   accumulation steps, padding; a shape still compiling falls back to a
   compiled one (the compile policy of
   :class:`~simigrad_jax.compile.programs.StepPrograms`);
2. take the rows: the next examples of the epoch's permutation, counted in
   examples, so nothing is dropped or repeated within an epoch
   (:class:`simigrad_jax.data.EpochSampler`), loaded and placed on the devices while
   the last step ran (:class:`~simigrad_jax.data.data_loader.StepDataLoader`);
3. run: the step's compiled program; the transform averages the gradients and
   measures the similarity; the host goes on at once, loading the next step's
   rows and running the last step's hooks while the devices work;
4. read: what the step measured, one named pytree
   (:class:`~simigrad_jax.ingraph.train_step.StepMeasurements`), read once into
   a :class:`~simigrad_jax.trainer.step_record.MeasuredStep`;
5. decide: the controller's next batch size from the similarity and the
   step's other measurements, and the learning-rate factor that follows it
   (:class:`~simigrad_jax.trainer.step_inputs.StepInputs`);
6. agree: every process holds the same decision before any of them uses it
   (:class:`~simigrad_jax.trainer.step_agreement.StepAgreement`);
7. hooks: the step's record (:class:`~simigrad_jax.trainer.step_record.
   StepRecord`) to the metrics file, the run's totals, the progress bar, yours,
   the evaluation and the checkpoint (:mod:`simigrad_jax.trainer.hooks`).

A SIGTERM or SIGINT during :meth:`Trainer.train` stops every process after
the same step, with that step's checkpoint saved
(:mod:`simigrad_jax.multihost.preemption`). What the Trainer builds before its
first step is :mod:`simigrad_jax.trainer.run_setup`.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from simigrad_jax import validation
from simigrad_jax.checkpoint.hook import CheckpointHook
from simigrad_jax.checkpoint.run_checkpoints import Resumed
from simigrad_jax.checkpoint.run_checkpoints import RunCheckpoints
from simigrad_jax.compile.compiler import CompileAbandoned
from simigrad_jax.compile.programs import StepPrograms
from simigrad_jax.compile.step_functions import ProgramShape
from simigrad_jax.compile.step_functions import programs_of
from simigrad_jax.controllers import interface as controller_interface
from simigrad_jax.data import grain_source
from simigrad_jax.data.data_loader import StepDataLoader
from simigrad_jax.data.sampler import EpochSampler
from simigrad_jax.ingraph import train_step
from simigrad_jax.multihost import preemption
from simigrad_jax.multihost.process_agreement import ProcessAgreement
from simigrad_jax.shapes import batch_plan
from simigrad_jax.shapes import mesh_sharding
from simigrad_jax.shapes.layout import StepLayout
from simigrad_jax.trainer import run_setup
from simigrad_jax.trainer.config import TrainerConfig
from simigrad_jax.trainer.hooks import EvaluationHook
from simigrad_jax.trainer.hooks import MetricsHook
from simigrad_jax.trainer.hooks import ProgressHook
from simigrad_jax.trainer.hooks import StepHook
from simigrad_jax.trainer.hooks import check_hook
from simigrad_jax.trainer.metrics import MetricsWriter
from simigrad_jax.trainer.run_totals import RunTotals
from simigrad_jax.trainer.skipped_steps import SkippedStreak
from simigrad_jax.trainer.step_agreement import StepAgreement
from simigrad_jax.trainer.step_inputs import StepInputs
from simigrad_jax.trainer.step_record import DispatchedStep
from simigrad_jax.trainer.step_record import MeasuredStep
from simigrad_jax.trainer.step_record import StepRecord


class StepLoop:
  """A run's optimizer steps, each in the same order: plan, take the rows, run, read, decide, agree,
  hooks (the module's docstring says what each does).

  It holds the run's state, which each step's program takes (donated) and
  replaces, and counts the run's steps and those whose gradient was not finite.

  Args:
    controller: the run's batch-size controller (updated in place).
    layout: the step's layout: its plans.
    sampler: the run's example order (moved past each step's examples).
    programs: the step's compiled programs.
    data: loads each step's rows, ahead of the step.
    inputs: the step's scalars and the learning-rate factor.
    checkpoints: the run's checkpoints.
    agreement: the agreement between the run's processes.
    config: the run's settings (when to checkpoint).
    resumed: what the run resumed from: its state on the mesh, steps done and
      steps whose gradient was not finite.
    steps_per_update: the optimizer steps each controller update stands for
      (checked by :func:`simigrad_jax.controllers.interface.steps_per_update`):
      1 updates it on every measuring step, ``config.measure_every`` on the
      scheduled measurements only.

  Example::

    loop.run([metrics_hook, loop.checkpoint], total_examples, max_steps=math.inf)
  """

  def __init__(
    self,
    *,
    controller: Any,
    layout: StepLayout,
    sampler: EpochSampler,
    programs: StepPrograms,
    data: StepDataLoader,
    inputs: StepInputs,
    checkpoints: RunCheckpoints,
    agreement: ProcessAgreement,
    config: TrainerConfig,
    resumed: Resumed,
    steps_per_update: int,
  ):
    self.controller, self.layout, self.sampler = controller, layout, sampler
    self._programs, self._data, self._inputs = programs, data, inputs
    self._checkpoints, self._processes = checkpoints, agreement
    self.state, self.step, self.nonfinite_steps = resumed[:3]
    self.checkpoint = CheckpointHook(
      self.save_checkpoint, config.checkpoints.every_steps, config.checkpoints.every_seconds
    )
    self.stop = preemption.RunStop()
    self._skipped = SkippedStreak()
    self._agreement = StepAgreement(
      agreement, programs.policy, checkpoints, self.checkpoint, self.stop
    )
    self._programs_run: set[ProgramShape] = set()  # the programs a step of this loop ran
    self._saves_prepared = False  # whether the checkpoints' save program was started
    self._taken_at = -1  # the step whose rows the sampler last gave (the state is whole after it)
    # A setting, read once: a schedule's config lists all its thresholds (a replay's, one a step).
    self._similarity_target = controller_interface.similarity_target(controller)
    self._measure_every = config.measure_every
    self._steps_per_update = steps_per_update
    self._bounds = controller_interface.batch_size_bounds(controller)
    self._whole_rows = config.compile.whole_rows

  def run(self, hooks: Sequence[StepHook], total_examples: float, max_steps: float) -> None:
    """A ``train()`` call's steps, then its checkpoint, until its end or a stop on a signal.

    Raises:
      Exception: a background checkpoint save failed (its error); a collective
        lost a process (:class:`simigrad_jax.multihost.ProcessLostError`).
    """
    first_step = self.step
    self.prepare(total_examples)
    self.checkpoint.restart_clock()
    with self.stop:  # a signal stops the run after the step under way
      if jax.process_count() == 1:  # (with several, every process runs the step under way)
        self._programs.compiler.set_interrupt(lambda: self.stop.signalled)
      try:
        self.run_steps(hooks, total_examples, max_steps)
        if self.step > first_step:
          self.save_checkpoint()
        self._checkpoints.wait(f"end of the run at step {self.step}")
      except Exception as error:
        if isinstance(error, jax.errors.JaxRuntimeError):
          # Multi-host: a collective that lost a peer fails with an error that names no process.
          self._processes.roll_call(f"step {self.step + 1}", error)
        state = self.state if self._taken_at < self.step else None  # (None: a step under way)
        self._checkpoints.save_elsewhere(error, self.step, state, **self._saved_with())  # a disk's
        self._checkpoints.save_before_failing(error, self.step, state, **self._saved_with())
        raise
      finally:
        self._programs.compiler.set_interrupt(None)

  def save_checkpoint(self) -> None:
    """Saves the current state as the checkpoint of the current step (once per step)."""
    self._checkpoints.save(self.step, self.state, **self._saved_with())

  def _saved_with(self) -> dict[str, Any]:
    """What a checkpoint holds beside the state and the step."""
    return {
      "sampler": self.sampler,
      "controller": self.controller,
      "nonfinite_steps": self.nonfinite_steps,
      "compiled_programs": self._programs.policy.compiled_programs(),
    }

  def run_steps(self, hooks: Sequence[StepHook], total_examples: float, max_steps: float) -> None:
    """The step loop, until the run's end (``total_examples``, ``max_steps``) or an agreed stop.

    A step's hooks run while the next step runs on the devices, but a
    checkpointed step's at once: the records up to a checkpoint are written
    before it. A hook with ``runs_at_once`` set runs as soon as its step is
    decided.
    """
    at_once = [hook for hook in hooks if getattr(hook, "runs_at_once", False)]
    later = [hook for hook in hooks if hook not in at_once]
    pending: StepRecord | None = None  # the last step's record, for the later hooks
    last_read: float | None = None  # when the last step's measurements were read
    try:
      while self.more_steps(total_examples, max_steps) and self.stop.agreed is None:
        start = time.perf_counter()
        # 1. Plan: the controller's size on the devices; the run's last step lands on its end.
        batch_size = self.controller.batch_size
        remaining = total_examples - self.sampler.examples_seen
        exact = self.layout.plan(int(min(batch_size, remaining)))
        last_step = self._last_step(remaining, batch_size, max_steps)
        plan = self._programs.policy.choose(exact, self.step, last_step)  # by the step count
        # Whether the step measures the similarity: decided by the step number alone.
        scheduled = self.step % self._measure_every == 0
        measure = scheduled or plan.accumulation_steps > 1
        wait_before = self._programs.compiler.wait_seconds
        try:
          self._programs.compiler.wait_for(plan, measure)
        except CompileAbandoned:  # a signal while this step's compile was awaited: not run
          if self.stop.stop_alone():
            break
          raise
        # 2. Take the rows, placed ahead while the last step ran.
        rows, data_seconds = self._data.take(plan, self.sampler.examples_seen, self.step)
        epoch = self.sampler.epoch
        self._taken_at = self.step
        self.sampler.take(plan.global_batch_size)
        # 3. Run. The host's critical path ends at the program's call.
        scalars = self._inputs.on_devices(plan.global_batch_size)
        host_seconds = math.nan if last_read is None else time.perf_counter() - last_read
        first_run = not set(programs_of(plan, measure)) <= self._programs_run
        self._programs_run |= set(programs_of(plan, measure))
        self.state, measurements = self._programs.runner.run(self.state, rows, scalars, measure)
        if not self._saves_prepared:  # after the first step, whose program went first
          self._checkpoints.prepare_saves(self.state)
          self._saves_prepared = True
        self._programs.policy.await_fallback(plan.micro_batch_size)  # (the first step's wait)
        dispatched = DispatchedStep(
          plan=plan,
          exact_plan=exact,
          measurements=measurements,
          start=start,
          epoch=epoch,
          data_seconds=data_seconds,
          host_seconds=host_seconds,
          compile_wait_seconds=self._programs.compiler.wait_seconds - wait_before,
          first_run=first_run,
          lr_factor=self._inputs.lr_factor,
          schedule_factor=self._inputs.schedule_factor,
        )
        # While the devices work: the next step's rows, and the last step's hooks.
        self._load_ahead(total_examples)
        if pending is not None:
          self._run_hooks(later, pending)
          pending = None
        # 4. Read the step's measurements.
        measured = MeasuredStep.read(dispatched.measurements)
        read = time.perf_counter()
        step_seconds, last_read = read - (start if last_read is None else last_read), read
        # 5. Decide the next batch size, and the learning-rate factor that follows it.
        self.nonfinite_steps += measured.skipped
        examples_seen = self.sampler.examples_seen
        epochs = examples_seen / self.sampler.num_examples
        epoch_end = self.sampler.epoch > epoch
        # A plain step holds a similarity rule; one whose updates stand for measure_every steps
        # each reads the scheduled measurements only (a step of several micro-batches between
        # them measures too, and is recorded), so that it moves at its rate per step.
        updates = scheduled if self._steps_per_update > 1 else measure
        if updates or self._similarity_target is None:
          next_batch_size = self.controller.update(
            measured.similarity,
            stats=measured.controller_stats(
              batch_size=plan.global_batch_size,
              examples_seen=examples_seen,
              epochs=epochs,
              epoch_end=epoch_end,
            ),
          )
          decision = self.controller.last_decision
        else:
          next_batch_size, decision = self.controller.batch_size, None
        rounded = self._rounded(next_batch_size, batch_size)
        if rounded != next_batch_size:  # adopted: the next decision starts from what runs
          self.controller.set_batch_size(rounded)
          next_batch_size = rounded
        self.step += 1
        self._inputs.set_lr_factor(self._inputs.lr_factors(next_batch_size, epochs))
        # 6. Agree: every process holds the same decision before any of them uses it.
        agreement_seconds = self._agreement.agree(
          self.step,
          {
            "step": self.step,
            "batch_size": plan.global_batch_size,
            "examples_seen": examples_seen,
            "similarity": measured.similarity,
            "decision": decision,
            "next_batch_size": next_batch_size,
            "next_lr_factor": self._inputs.lr_factor,
          },
        )
        record = StepRecord.create(
          dispatched,
          measured,
          step=self.step,
          examples_seen=examples_seen,
          micro_batch_size=self.layout.device_rows(plan.micro_batch_size),
          micro_batch_sizes=tuple(self.layout.device_rows(size) for size in plan.shapes),
          decision=decision,
          similarity_target=self._similarity_target,
          next_batch_size=next_batch_size,
          next_lr_factor=self._inputs.lr_factor,
          nonfinite_steps=self.nonfinite_steps,
          step_seconds=step_seconds,
          agreement_seconds=agreement_seconds,
          epoch_end=epoch_end,
        )
        # 7. Hooks: those that run at once, then the rest now if checkpointed, else next step.
        self._run_hooks(at_once, record)
        if self.checkpoint.due(record):
          self._run_hooks(later, record)
        else:
          pending = record
        self._skipped.count(self.step, measured.nonfinite_cause)  # raises at a long streak
        self._agreement.raise_failed_saves(self.step)  # (the records are out: pending's, finally)
    finally:
      if pending is not None:
        self._run_hooks(later, pending)

  def _load_ahead(self, total_examples: float) -> None:
    """Starts loading the next step's rows, placed for each plan it is likely to run."""
    start = self.sampler.examples_seen
    remaining = total_examples - start
    if remaining <= 0:
      return
    epochs = start / self.sampler.num_examples
    sizes = controller_interface.likely_batch_sizes(self.controller, start, epochs, self._bounds)
    sizes = tuple(dict.fromkeys(self._rounded(s, self.controller.batch_size) for s in sizes))
    plans = [
      self._programs.policy.ready_plan(self.layout.plan(int(min(s, remaining))), self.step + 1)
      for s in sizes
    ]
    count = int(min(max(self.controller.batch_size, *sizes), remaining))
    place_inputs = functools.partial(self._inputs.place_ahead, sizes, epochs, remaining)
    self._data.submit(start, count, self.step + 1, plans, then=place_inputs)  # the next step

  def _rounded(self, batch_size: int, previous: int) -> int:
    """``batch_size`` as the run realises a decision from ``previous``: with
    ``compile.whole_rows``, whole rows per device in the direction of the change
    (:func:`~simigrad_jax.shapes.batch_plan.round_to_whole_rows`); else as it is."""
    if not self._whole_rows:
      return batch_size
    return batch_plan.round_to_whole_rows(
      batch_size, previous, self.layout.num_slots, *self._bounds
    )

  def _run_hooks(self, hooks: Sequence[StepHook], record: StepRecord) -> None:
    """Hands ``record``, with the compile counters as they are now, to each of ``hooks``."""
    record = record.with_compile_stats(self._programs.compiler.totals())
    for hook in hooks:
      hook.on_step(record)

  def prepare(self, total_examples: float) -> None:
    """Before a ``train()`` call's first step: its learning-rate factor, programs and rows, asked
    for ahead."""
    batch_size, start = self.controller.batch_size, self.sampler.examples_seen
    self._inputs.set_lr_factor(
      self._inputs.lr_factors(batch_size, start / self.sampler.num_examples)
    )
    self._programs.policy.start(batch_size, self.step)
    if total_examples > start:  # (a resumed run may have no step left)
      first = self.layout.plan(int(min(batch_size, total_examples - start)))
      self._data.submit(start, first.global_batch_size, self.step, [first])

  def _last_step(self, remaining: float, batch_size: int, max_steps: float) -> float:
    """The last step the run may reach from this one, ``remaining`` examples and ``max_steps``
    before its end: every step but the last takes at least the lower bound's examples. A compile
    that no step up to it would run is not queued (the policy's ``choose``)."""
    if remaining <= batch_size:
      steps_left = 1.0  # this step ends the run
    elif math.isinf(remaining):
      steps_left = math.inf
    else:
      steps_left = math.ceil(remaining / (self._bounds[0] or 1))
    return min(self.step + steps_left, max_steps) - 1

  def more_steps(self, total_examples: float, max_steps: float) -> bool:
    """Whether the run has steps left before ``total_examples`` or ``max_steps``."""
    return self.step < max_steps and self.sampler.examples_seen < total_examples


class Trainer:
  """Trains a model with SimiGrad's adaptive global batch size on all devices.

  Its steps are :class:`StepLoop`'s; the arguments and errors in full:
  ``docs/trainer.md``.

  Args:
    loss_fn: ``loss_fn(params, model_state, batch, weights, rng) ->
      (per_example_losses, new_model_state)`` for one device's rows;
      ``weights`` is 0 for padding rows (BatchNorm's mask).
    params: the initial parameters (copied onto the devices).
    optimizer: an optax optimizer containing ``simigrad_jax.transform(axis_name)``
      and, last, ``simigrad_jax.scale_by_lr_factor()``.
    source: a random-access data source (:class:`simigrad_jax.ArraySource`,
      ``TfdsSource``, ``GrainSource``) or grain-style data.
    controller: a :class:`simigrad_jax.BatchSizeController`, e.g.
      :class:`simigrad_jax.Controller`.
    workdir: where metrics and checkpoints go, locked for this run; a run
      resumes from its newest checkpoint.
    config: the run's settings, a :class:`simigrad_jax.TrainerConfig`.
    model_state: non-trainable state (e.g. BatchNorm statistics), or None.
    eval_fn: optional ``eval_fn(params, model_state) -> dict``, run at every
      epoch's end.
    lr_schedule: optional ``lr_schedule(epochs) -> float``, a multiplier of
      the base learning rate.
    devices: the devices to train on (default: all, over every process).
    mesh: a ``jax.sharding.Mesh`` (Auto axes) instead of ``devices``: the
      batch is sharded over ``axis_name``, parameters may be over the others.
    param_sharding: the parameters' ``PartitionSpec``: None (replicated), one
      spec, a pytree of them like ``params`` (or a prefix of it), or a
      callable ``(path, leaf) -> PartitionSpec``.
    hooks: objects with ``on_step(record)`` (:class:`simigrad_jax.StepHook`).
    run_settings: what else decides the run, as JSON data, recorded in every
      checkpoint and compared on resume.

  Raises:
    ValueError: a setting or input that could not train as asked, before any
      step, naming the value and what is valid.
    WorkdirLockedError: another run holds the workdir.
    CheckpointMismatchError: the workdir holds checkpoints of another run.
    ProcessDisagreementError: processes built with different settings.

  Example:
    >>> trainer = simigrad_jax.Trainer(loss_fn=loss_fn, params=params,  # doctest: +SKIP
    ...     optimizer=optimizer, source=simigrad_jax.ArraySource({"x": x, "y": y}),
    ...     controller=simigrad_jax.Controller(64, 0.1, batch_size_lower_bound=16,
    ...                                        batch_size_upper_bound=1024),
    ...     workdir="/tmp/run", config=simigrad_jax.TrainerConfig(max_micro_batch_size=32))
    >>> summary = trainer.train(num_epochs=3)  # doctest: +SKIP
  """

  def __init__(
    self,
    *,
    loss_fn: train_step.PerExampleLossFn,
    params: Any,
    optimizer: optax.GradientTransformation,
    source: Any,
    controller: Any,
    workdir: str | os.PathLike,
    config: TrainerConfig | None = None,
    model_state: Any = None,
    eval_fn: Callable[[Any, Any], Mapping[str, float]] | None = None,
    lr_schedule: Callable[[float], float] | None = None,
    devices: list[jax.Device] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    param_sharding: Any = None,
    hooks: Sequence[StepHook] = (),
    run_settings: Mapping[str, Any] | None = None,
  ):
    # Everything is checked before anything is created, compiled or trained.
    self.config = config = _config_of(config)
    self._hooks = [check_hook(hook) for hook in hooks]
    self.controller, self.eval_fn, self.source = controller, eval_fn, grain_source.as_source(source)
    self._agreement = agreement = ProcessAgreement(config.agreement_timeout_seconds)
    num_examples, self.workdir, devices, opt_state, lower, upper = run_setup.check_objects(
      config,
      loss_fn=loss_fn,
      params=params,
      optimizer=optimizer,
      source=self.source,
      controller=controller,
      workdir=workdir,
      eval_fn=eval_fn,
      lr_schedule=lr_schedule,
      devices=devices,
      mesh=mesh,
    )
    steps_per_update = controller_interface.steps_per_update(controller, config.measure_every)
    self.mesh = mesh = Mesh(np.array(devices), (config.axis_name,)) if mesh is None else mesh
    specs = mesh_sharding.param_specs(param_sharding, params, mesh)
    self.layout = run_setup.make_layout(config, mesh.shape[config.axis_name], lower, upper)
    fixed_batch = lower == upper  # the first step's programs and the schedule's must agree
    run_setup.check_whole_rows(config, controller, self.layout, lower, upper)
    self.halves, self.num_devices = self.layout.halves, self.layout.num_devices
    self.shapes = self.layout.device_grid  # the compiled micro-batch shapes, rows per device
    self.sampler = EpochSampler(num_examples, config.seed)
    initial = {"params": params, "opt_state": opt_state, "model_state": model_state}
    # The first step's program traces, then loads or compiles, while the rest is set up.
    first = run_setup.start_first_program(
      config,
      self.workdir,
      self.layout,
      initial,
      loss_fn=loss_fn,
      optimizer=optimizer,
      specs=specs,
      mesh=mesh,
      element_spec=self.source.element_spec,
      batch_size=controller.batch_size,
      fixed_batch=fixed_batch,
    )
    try:
      # What the run is, agreed between processes; the workdir locked, its checkpoints opened and
      # resumed from, the first step's trace waited for.
      record = run_setup.agree_on_run(
        config,
        self.layout,
        agreement,
        initial,
        optimizer=optimizer,
        controller=controller,
        source=self.source,
        devices=devices,
        mesh=mesh,
        specs=specs,
        run_settings=run_settings,
      )
      state = run_setup.place_state(initial, optimizer, specs, mesh)
    except BaseException:
      first.compiler.close()
      raise
    self._workdir_lock, self._checkpoints, self._programs, resumed = run_setup.open_run(
      config,
      workdir,
      self.workdir,
      agreement,
      record,
      state=state,
      sampler=self.sampler,
      controller=controller,
      loss_fn=loss_fn,
      model_state=model_state,
      optimizer=optimizer,
      element_spec=self.source.element_spec,
      mesh=mesh,
      layout=self.layout,
      upper=upper,
      fixed_batch=fixed_batch,
      first=first,
    )
    self._data = run_setup.make_data_loader(
      config, self.source, self.sampler, mesh, devices, self.layout
    )
    self._loop = StepLoop(
      controller=controller,
      layout=self.layout,
      sampler=self.sampler,
      programs=self._programs,
      data=self._data,
      inputs=StepInputs.for_run(config, controller, lr_schedule, resumed.state, mesh),
      checkpoints=self._checkpoints,
      agreement=agreement,
      config=config,
      resumed=resumed,
      steps_per_update=steps_per_update,
    )
    on_main = jax.process_index() == 0
    self._metrics = MetricsHook(
      MetricsWriter(
        self.workdir, tensorboard=config.tensorboard, resume_step=resumed.step, enabled=on_main
      )
    )

  @property
  def step(self) -> int:
    """The optimizer steps done, over the whole run (resumes included)."""
    return self._loop.step

  @property
  def state(self) -> dict[str, Any]:
    """The ``{"params", "opt_state", "model_state"}`` of the last step dispatched, on the mesh."""
    return self._loop.state

  def add_hook(self, hook: StepHook) -> None:
    """Adds ``hook`` (an object with ``on_step(record)``) after the others, from the next
    :meth:`train` call on."""
    self._hooks.append(check_hook(hook))

  def save_checkpoint(self) -> None:
    """Saves the current state as the checkpoint of the current step (once per step)."""
    self._loop.save_checkpoint()

  def train(
    self, *, num_epochs: float | None = None, num_steps: int | None = None
  ) -> dict[str, Any]:
    """Trains until ``num_epochs`` epochs of examples or ``num_steps`` optimizer steps.

    Args:
      num_epochs: stop after this many epochs' worth of examples (may be
        fractional); the last step is cut to land exactly on it.
      num_steps: stop after this optimizer step (counted from the start of
        the run, resumes included).

    Returns:
      A summary dict: steps, examples seen and the average batch size (the
      whole run's; ``run_...``: this call's), the final batch size,
      last loss and similarity, compile and data timings, non-finite steps
      and the last evaluation (each key in ``docs/trainer.md``).

    Raises:
      Preempted: a SIGTERM or SIGINT arrived (on any process): the step under
        way was finished and its checkpoint saved.
      Exception: a background checkpoint save failed: the save's own error
        (e.g. ``OSError`` of a full disk), at the first step after it failed.
    """
    total_examples, max_steps = _run_length(num_epochs, num_steps, self.sampler.num_examples)
    totals = RunTotals()
    progress = ProgressHook(
      total_examples,
      self.sampler.examples_seen,
      enabled=self.config.progress and jax.process_index() == 0,
    )
    evaluation = EvaluationHook(self.eval_fn, lambda: self.state, self._metrics.writer)
    hooks: list[StepHook] = [self._metrics, totals, progress, *self._hooks]
    hooks += [evaluation, self._loop.checkpoint]  # an epoch's end: evaluated, then checkpointed
    try:
      self._loop.run(hooks, total_examples, max_steps)
    finally:
      progress.close()
    summary = {
      "final_batch_size": self.controller.batch_size,
      "nonfinite_steps": self._loop.nonfinite_steps,
      **self.compile_stats(),
      **totals.summary(self.step, self.sampler.examples_seen),  # whole-run and this call's
      **evaluation.results,
    }
    if self._loop.more_steps(total_examples, max_steps):
      checkpoint = os.path.join(self._checkpoints.checkpointer.directory, str(self.step))
      self._loop.stop.raise_if_agreed(self.step, checkpoint, summary)
    return summary

  def compile_stats(self) -> dict[str, Any]:
    """Compiles so far (programs per shape plus the update of accumulated steps), their seconds,
    the seconds steps waited for them, and the compiled micro-batch shapes."""
    return self._programs.compiler.totals()

  def step_memory(self, micro_batch_size: int | None = None) -> dict[str, int]:
    """XLA's memory per device (``compiled.memory_analysis()``) of the one-micro-batch step
    of ``micro_batch_size`` rows per device (default: the current batch's; compiled if need be):
    ``argument_bytes``, ``output_bytes``, ``alias_bytes`` (outputs reusing the donated state)
    and ``temp_bytes``."""
    if micro_batch_size is None:
      micro = self.layout.plan(self.controller.batch_size).micro_batch_size
      return self._programs.compiler.memory(micro)
    return self._programs.compiler.memory(self.layout.slot_rows(micro_batch_size))

  def close(self) -> None:
    """Waits for saves and compiles, closes the metrics files and releases the workdir (after a
    lost process, it waits for no checkpoint save: the save would wait for that process)."""
    self._checkpoints.close()
    self._programs.compiler.close()
    self._data.close()
    self._metrics.writer.close()
    self._agreement.close()
    if self._workdir_lock is not None:  # the last: the files above are complete
      self._workdir_lock.close()

  def __enter__(self) -> Trainer:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


def _config_of(config: TrainerConfig | None) -> TrainerConfig:
  """The run's :class:`TrainerConfig`, refused when it is missing or is something else."""
  if config is None:
    raise TypeError(
      "Trainer() needs its settings: config=simigrad_jax.TrainerConfig(max_micro_batch_size=...) "
      "(the rows per device per micro-step; the other settings have defaults)"
    )
  if not isinstance(config, TrainerConfig):
    raise ValueError(
      f"config must be a simigrad_jax.TrainerConfig, got {config!r:.200} ({type(config).__name__})"
    )
  return config


def _run_length(
  num_epochs: float | None, num_steps: int | None, num_examples: int
) -> tuple[float, float]:
  """``(examples, steps)`` at which a ``train`` call stops (inf: no limit), after checking them."""
  if num_epochs is None and num_steps is None:
    raise ValueError("give num_epochs or num_steps")
  total_examples = max_steps = math.inf
  if num_epochs is not None:
    num_epochs = validation.check_real(
      "num_epochs", num_epochs, "(0, inf) (finite)", lambda x: 0 < x < math.inf
    )
    total_examples = int(round(num_epochs * num_examples))
  if num_steps is not None:
    max_steps = validation.check_int("num_steps", num_steps, 0)
  return total_examples, max_steps
