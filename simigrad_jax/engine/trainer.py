"""Host: the adaptive-batch training loop.

Every optimizer step:

1. the controller's global batch size is planned onto the devices
   (:func:`simigrad_jax.plan_batch`): micro-batch shape, accumulation steps,
   padding;
2. the step's examples (the next ones of the epoch's permutation, counted in
   examples, so nothing is dropped or repeated within an epoch) are on the
   devices already when the batch size is the one expected, else they are
   placed now (:mod:`simigrad_jax.engine.data_loader`); each process loads only
   the rows of its own devices;
3. the step's compiled program runs (:mod:`simigrad_jax.engine.programs`):
   one program for gradient, reduction and update when the step holds one
   micro-batch per device, else micro-steps then the update. The transform
   averages the gradients and measures the similarity; the host reads one
   small vector of statistics;
4. the controller picks the next batch size, the learning-rate factor follows
   it, every process agrees on the decision, and the next step is dispatched
   at once;
5. while the devices run it, the last step's record
   (:class:`~simigrad_jax.engine.step_record.StepRecord`) goes to the hooks
   (:mod:`simigrad_jax.engine.hooks`): metrics to JSONL and TensorBoard, the
   run's totals, the progress bar, yours; at an epoch's end the evaluation,
   and checkpoints with orbax.

A SIGTERM or SIGINT during :meth:`Trainer.train` stops every process after
the same step, with that step's checkpoint saved
(:mod:`simigrad_jax.engine.preemption`).

The settings are a :class:`~simigrad_jax.engine.config.TrainerConfig`;
building the run (checks, layout, agreement, resume, tracing) is
:func:`~simigrad_jax.engine.run_setup.build_run`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import optax

from simigrad_jax import validation
from simigrad_jax.engine import preemption
from simigrad_jax.engine import run_setup
from simigrad_jax.engine import train_step
from simigrad_jax.engine.config import MODES
from simigrad_jax.engine.config import TrainerConfig
from simigrad_jax.engine.hooks import CheckpointHook
from simigrad_jax.engine.hooks import EvaluationHook
from simigrad_jax.engine.hooks import MetricsHook
from simigrad_jax.engine.hooks import ProgressHook
from simigrad_jax.engine.hooks import StepHook
from simigrad_jax.engine.hooks import check_hook
from simigrad_jax.engine.preemption import Preempted
from simigrad_jax.engine.run_totals import RunTotals
from simigrad_jax.engine.step_record import DispatchedStep
from simigrad_jax.engine.step_record import StepRecord
from simigrad_jax.engine.step_record import StepStats
from simigrad_jax.runtime.metrics import MetricsWriter
from simigrad_jax.runtime.process_agreement import ProcessAgreement
from simigrad_jax.runtime.process_agreement import ProcessDisagreementError
from simigrad_jax.runtime.process_agreement import ProcessLostError

__all__ = [
  "MODES",
  "Preempted",
  "ProcessDisagreementError",
  "ProcessLostError",
  "Trainer",
  "TrainerConfig",
]


class Trainer:
  """Trains a model with SimiGrad's adaptive global batch size on all devices.

  Args:
    loss_fn: ``loss_fn(params, model_state, batch, weights, rng) ->
      (per_example_losses, new_model_state)`` for one device's rows (a dict of
      arrays with a leading example axis). ``weights`` is 1 for real rows and
      0 for padding: models with BatchNorm should pass it as the mask.
      BatchNorm statistics are averaged over devices after every micro-step.
    params: the initial parameters (a pytree; copied onto the devices, so the
      caller's arrays stay usable, e.g. to start another Trainer).
    optimizer: an optax optimizer containing ``simigrad_jax.transform(axis_name)``
      and, last, ``simigrad_jax.scale_by_lr_factor()``.
    source: a random-access data source (``len()``, ``get_batch(indices)``,
      ``element_spec``: :class:`simigrad_jax.ArraySource`, ``TfdsSource``,
      ``GrainSource``), or grain-style data (``__len__``, ``__getitem__``
      giving a dict of arrays), read through a ``GrainSource``.
    controller: a :class:`simigrad_jax.Controller`, or any controller with the
      :class:`simigrad_jax.BatchSizeController` interface.
    workdir: where metrics and checkpoints go; a run resumes from the newest
      checkpoint found there. Its parent must exist; it is created ``0700``.
      One run per workdir: the Trainer holds its lock until :meth:`close`
      (a :class:`~simigrad_jax.runtime.workdir.WorkdirLock` this process
      holds is used as it is). It must belong to this user and be writable
      by no other (see ``allow_shared_workdir``).
    model_state: non-trainable state (e.g. BatchNorm statistics), or None.
    eval_fn: optional ``eval_fn(params, model_state) -> dict`` run at every
      epoch end; its numbers are logged with an ``eval_`` prefix.
    lr_schedule: optional ``lr_schedule(epochs) -> float``, a multiplier of
      the base learning rate after ``epochs`` epochs (fractional, counted in
      examples, not steps), e.g. a step decay or a warm-up. It multiplies the
      batch-size factor, at no recompilation.
    devices: the devices to train on (default: all, over every process), 1 or more.
    run_settings: what else decides the run and the Trainer cannot see, as
      JSON data (e.g. an experiment's config): recorded in every checkpoint
      with the optimizer's hyperparameters, the controller's settings, the
      data, the model, the devices and the versions; a resume that changes
      any of them but the devices and versions is refused
      (:class:`simigrad_jax.CheckpointMismatchError`, listing the
      differences) unless ``allow_changed_settings=True``.
    hooks: objects with ``on_step(record)``
      (:class:`~simigrad_jax.engine.hooks.StepHook`), given every step's
      :class:`~simigrad_jax.engine.step_record.StepRecord` in order, after the
      metrics and the progress bar (see :mod:`simigrad_jax.engine.hooks`).
    config: the run's settings (:class:`TrainerConfig`); or give them as
      keywords instead (not both):
    **settings: the fields of :class:`TrainerConfig` (``max_micro_batch_size``,
      which has no default, ``mode``, ``seed``, ``halves``, ...).

  Raises:
    ValueError: for any setting or input that could not train as asked,
      before anything is compiled or trained, naming the value and what is
      valid: e.g. bounds the data set cannot fill, a similarity controller's
      lower bound below 2, ``halves="device"`` on an odd number of devices,
      a ``loss_fn`` that does not return one loss per row, a config given
      with setting keywords;
      :class:`~simigrad_jax.files.UnsafePathError` for a workdir or cache
      other users can change.
    WorkdirLockedError: another run (or Trainer) holds the workdir; the
      message names it.
    CheckpointMismatchError: (a ValueError) the workdir holds checkpoints of
      another run: another model, optimizer structure or seed, or (unless
      ``allow_changed_settings``) other optimizer hyperparameters, controller
      settings, data or ``run_settings``; the message lists the differences.
    ProcessDisagreementError: in a multi-host run, when the processes were
      built with different settings or took different decisions.
    ProcessLostError: (a ProcessDisagreementError) in a multi-host run, when
      another process does not reach a check within
      ``agreement_timeout_seconds``; it names the missing processes. Restart
      all processes to resume from the newest checkpoint.
    OSError: resuming, when the file system fails every read of a
      checkpoint (e.g. EIO); nothing is moved (a damaged checkpoint is moved
      aside and the one before it restored instead).

  Example:
    >>> trainer = simigrad_jax.Trainer(loss_fn=loss_fn, params=params,  # doctest: +SKIP
    ...     optimizer=optimizer, source=simigrad_jax.ArraySource({"x": x, "y": y}),
    ...     controller=simigrad_jax.Controller(64, 0.1, batch_size_lower_bound=16,
    ...                                        batch_size_upper_bound=1024),
    ...     workdir="/tmp/run", max_micro_batch_size=32)
    >>> summary = trainer.train(num_epochs=3)  # doctest: +SKIP

  Note:
    A SIGTERM or SIGINT during :meth:`train` (in the main thread) finishes
    the step under way on every process, saves its checkpoint and raises
    :class:`~simigrad_jax.engine.preemption.Preempted`; a second signal ends
    the process at once.

    A step whose gradient is NaN or infinite on any device keeps the
    parameters, the optimizer state (momentum, Adam's moments and counters)
    and the model state as they were, like ``optax.apply_if_finite``; the
    controller holds the batch size and ``nonfinite_steps`` counts it.
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
    model_state: Any = None,
    eval_fn: Callable[[Any, Any], Mapping[str, float]] | None = None,
    lr_schedule: Callable[[float], float] | None = None,
    devices: list[jax.Device] | None = None,
    hooks: Sequence[StepHook] = (),
    run_settings: Mapping[str, Any] | None = None,
    config: TrainerConfig | None = None,
    **settings: Any,
  ):
    # Everything is checked before anything is created, compiled or trained.
    self.config = config = TrainerConfig.from_settings(config, settings)
    self._hooks = [check_hook(hook) for hook in hooks]
    self._agreement = ProcessAgreement(config.agreement_timeout_seconds)
    run = run_setup.build_run(
      config,
      self._agreement,
      loss_fn=loss_fn,
      params=params,
      optimizer=optimizer,
      source=source,
      controller=controller,
      workdir=workdir,
      model_state=model_state,
      eval_fn=eval_fn,
      lr_schedule=lr_schedule,
      devices=devices,
      run_settings=run_settings,
    )
    self.controller, self.eval_fn = controller, eval_fn
    self.workdir, self.source, self.mesh, self.layout = (
      run.workdir,
      run.source,
      run.mesh,
      run.layout,
    )
    self._workdir_lock = run.workdir_lock
    self.halves, self.num_devices = run.layout.halves, run.layout.num_devices
    self.shapes = run.layout.device_grid  # the compiled micro-batch shapes, rows per device
    self.sampler, self.state, self.step = run.sampler, run.state, run.step
    self._nonfinite_steps = run.nonfinite_steps
    self._checkpoints, self._programs, self._data = run.checkpoints, run.programs, run.data
    self._step_inputs = run.step_inputs
    self._is_main = jax.process_index() == 0
    self._metrics = MetricsHook(
      MetricsWriter(
        run.workdir, tensorboard=config.tensorboard, resume_step=self.step, enabled=self._is_main
      )
    )
    self._checkpoint = CheckpointHook(
      self.save_checkpoint, config.checkpoint_every_steps, config.checkpoint_every_seconds
    )
    self._signals = preemption.StopSignals()
    self._stop: str | None = None  # the signal the processes agreed to stop on
    self._last_read: float | None = None  # when the last step's statistics were read

  def add_hook(self, hook: StepHook) -> None:
    """Adds ``hook`` (an object with ``on_step(record)``) after the others, from the next
    :meth:`train` call on."""
    self._hooks.append(check_hook(hook))

  def save_checkpoint(self) -> None:
    """Saves the current state as the checkpoint of the current step (once per step)."""
    self._checkpoints.save(
      self.step,
      self.state,
      sampler=self.sampler,
      controller=self.controller,
      nonfinite_steps=self._nonfinite_steps,
    )

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
      A summary dict: steps, examples seen, average batch size, final batch
      size, last loss and similarity, the compile and data timings (and
      ``compile_fallback_steps``: steps run on a fallback shape), the median
      ``host_seconds`` (the host's critical path between steps), the steps
      skipped for a non-finite gradient (``nonfinite_steps`` in the whole
      run, ``run_nonfinite_steps`` in this call, whose first,
      ``first_nonfinite_step``, a warning names), and the last evaluation
      (if any).

    Raises:
      Preempted: a SIGTERM or SIGINT arrived (on any process) before the
        end: the step under way was finished and its checkpoint saved; its
        ``summary`` is the dict this would have returned. A second signal
        ends the process at once.
      Exception: a background checkpoint save failed (e.g. ``OSError`` of a
        full disk): the save's own error, at the first step after it failed.
    """
    total_examples, max_steps = _run_length(num_epochs, num_steps, self.sampler.num_examples)
    totals = RunTotals()
    progress = ProgressHook(
      total_examples, self.sampler.examples_seen, enabled=self.config.progress and self._is_main
    )
    evaluation = EvaluationHook(self.eval_fn, lambda: self.state, self._metrics.writer)
    hooks: list[StepHook] = [
      self._metrics,
      totals,
      progress,
      *self._hooks,
      evaluation,
      self._checkpoint,
    ]
    batch_size = self.controller.batch_size
    self._step_inputs.set_lr_factor(self._step_inputs.lr_factors(batch_size, self._epochs()))
    self._programs.prefetch_for(batch_size)
    self._data.submit_ahead(batch_size, total_examples, self.step)
    self._last_read, self._stop = None, None
    self._checkpoint.restart_clock()
    with self._signals:  # a signal stops the run after the step under way
      try:
        self._run_steps(hooks, total_examples, max_steps)
        if totals.steps:
          self.save_checkpoint()
        self._checkpoints.wait(f"end of the run at step {self.step}")
      except jax.errors.JaxRuntimeError as error:
        # Multi-host: a collective that lost a peer fails with an error that names no process.
        self._agreement.roll_call(f"step {self.step + 1}", error)
        raise
      finally:
        progress.close()
    summary = {
      "steps": self.step,
      "examples_seen": self.sampler.examples_seen,
      "final_batch_size": self.controller.batch_size,
      "nonfinite_steps": self._nonfinite_steps,
      **self.compile_stats(),
      **totals.summary(),
      **evaluation.results,
    }
    if self._stop is not None and self._more_steps(total_examples, max_steps):
      raise Preempted(
        self._stop,
        self.step,
        os.path.join(self._checkpoints.checkpointer.directory, str(self.step)),
        summary,
      )
    return summary

  def _more_steps(self, total_examples: float, max_steps: float) -> bool:
    """Whether the run has steps left before ``total_examples`` or ``max_steps``."""
    return self.step < max_steps and self.sampler.examples_seen < total_examples

  def _run_steps(self, hooks: list[StepHook], total_examples: float, max_steps: float) -> None:
    """Runs steps until the run's end or a stop the processes agreed on.

    A step's hooks run once the next step is dispatched, while the devices
    work, but a checkpointed step's run at once: the records up to a
    checkpoint are written before it.
    """
    pending = None  # the last step's record
    try:
      while self._more_steps(total_examples, max_steps) and self._stop is None:
        dispatched = self._dispatch(total_examples)
        if pending is not None:
          self._run_hooks(hooks, pending)
          pending = None
        record = self._read_and_decide(dispatched)
        if self._checkpoint.due(record):
          self._run_hooks(hooks, record)
        else:
          pending = record
    finally:
      if pending is not None:
        self._run_hooks(hooks, pending)

  def _epochs(self) -> float:
    """The epochs trained so far (fractional, counted in examples)."""
    return self.sampler.examples_seen / self.sampler.num_examples

  def _dispatch(self, total_examples: float) -> DispatchedStep:
    """Plans the controller's batch size, takes its examples and dispatches the step."""
    start = time.perf_counter()
    # The run's last step lands exactly on num_epochs.
    remaining = total_examples - self.sampler.examples_seen
    exact = self.layout.plan(int(min(self.controller.batch_size, remaining)))
    plan = self._programs.ready_plan(exact)
    data, data_seconds = self._data.take(plan, self.sampler.examples_seen, self.step)
    epoch = self.sampler.epoch
    self.sampler.take(plan.global_batch_size)
    step_inputs = self._step_inputs.on_devices(plan.global_batch_size)
    wait_before = self._programs.wait_seconds()
    # The host's critical path ends here: the program call is the runtime's (on CPU the
    # simulated devices are host threads, and the call runs part of the step).
    host_seconds = math.nan if self._last_read is None else time.perf_counter() - self._last_read
    self.state, stats = self._programs.run(self.state, data, step_inputs)
    # While the first step runs: the programs that let every later step fall back.
    self._programs.await_fallback(plan.micro_batch_size)
    compile_wait = self._programs.wait_seconds() - wait_before
    # Load the next step's rows while the devices work.
    self._data.submit_ahead(self.controller.batch_size, total_examples, self.step + 1)
    return DispatchedStep(
      plan=plan,
      exact_plan=exact,
      stats=stats,
      start=start,
      epoch=epoch,
      data_seconds=data_seconds,
      host_seconds=host_seconds,
      compile_wait_seconds=compile_wait,
      lr_factor=self._step_inputs.lr_factor,
      schedule_factor=self._step_inputs.schedule_factor,
    )

  def _read_and_decide(self, dispatched: DispatchedStep) -> StepRecord:
    """Waits for the step's statistics, lets the controller decide, agrees on the decision with
    the other processes, and returns the step's record."""
    stats = StepStats.read(dispatched.stats)
    read = time.perf_counter()
    step_seconds = read - (dispatched.start if self._last_read is None else self._last_read)
    self._last_read = read
    self._nonfinite_steps += not stats.grads_finite
    batch_size, examples_seen = dispatched.plan.global_batch_size, self.sampler.examples_seen
    epoch_end = self.sampler.epoch > dispatched.epoch
    next_batch_size = self.controller.update(
      stats.similarity,
      stats=stats.for_controller(
        batch_size=batch_size,
        examples_seen=examples_seen,
        epochs=self._epochs(),
        epoch_end=epoch_end,
      ),
    )
    self.step += 1
    self._step_inputs.set_lr_factor(self._step_inputs.lr_factors(next_batch_size, self._epochs()))
    agreement_seconds = self._agree_on_decision(
      {
        "step": self.step,
        "batch_size": batch_size,
        "examples_seen": examples_seen,
        "similarity": stats.similarity,
        "decision": self.controller.last_decision,
        "next_batch_size": next_batch_size,
        "next_lr_factor": self._step_inputs.lr_factor,
      }
    )
    return StepRecord.create(
      dispatched,
      stats,
      step=self.step,
      examples_seen=examples_seen,
      micro_batch_size=self.layout.device_rows(dispatched.plan.micro_batch_size),
      decision=self.controller.last_decision,
      similarity_target=self.controller.config["similarity_target"],
      next_batch_size=next_batch_size,
      next_lr_factor=self._step_inputs.lr_factor,
      nonfinite_steps=self._nonfinite_steps,
      step_seconds=step_seconds,
      agreement_seconds=agreement_seconds,
      epoch_end=epoch_end,
    )

  def _agree_on_decision(self, decision: dict[str, Any]) -> float:
    """Multi-host: the next step's shapes and learning rate follow ``decision``; every process
    must hold the same one before any of them uses it. Returns the seconds it took.

    Each process's report rides along, and every process acts on all of them alike: the
    compiled shapes (the next step falls back only to a shape compiled on all), a signal
    (every process stops after this step), process 0's seconds since the last checkpoint
    (``checkpoint_every_seconds``) and a failed background save (raised now, on every process).
    """
    start = time.perf_counter()
    compiled = self._programs.compiled_report()
    report = {
      "compiled": compiled,
      **preemption.step_report(
        self._signals, self._checkpoint.seconds_since_save(), self._checkpoints.failed_save()
      ),
    }
    reports = self._agreement.agree(f"decision of step {self.step}", decision, report=report)
    assert reports is not None  # one per process, as a report was given
    if compiled is not None:
      self._programs.agree_on_compiles([r["compiled"] for r in reports])
    agreed = preemption.Agreed.read(reports)
    self._checkpoints.stop_on_failed_saves(agreed.failed_saves, self.step)
    self._checkpoint.save_on_time(self.step, agreed.seconds_since_checkpoint)
    self._stop = agreed.stop
    return time.perf_counter() - start

  def _run_hooks(self, hooks: list[StepHook], record: StepRecord) -> None:
    """A step's bookkeeping: its record, with the compile counters as they are now, to each hook."""
    record = record.with_compile_stats(self._programs.stats())
    for hook in hooks:
      hook.on_step(record)

  def compile_stats(self) -> dict[str, Any]:
    """Compiles so far (programs per shape plus the update of accumulated steps), their seconds,
    the seconds steps waited for them, and the compiled micro-batch shapes."""
    return self._programs.stats()

  def step_memory(self, micro_batch_size: int | None = None) -> dict[str, int]:
    """XLA's compiled memory of the one-micro-batch step program for that shape.

    Args:
      micro_batch_size: rows per device (default: the shape of the
        controller's current batch size). Compiled if it is not yet.

    Returns:
      ``argument_bytes``, ``output_bytes``, ``alias_bytes`` (outputs that reuse
      the donated parameters and optimizer state) and ``temp_bytes``, per
      device, from ``compiled.memory_analysis()``.
    """
    if micro_batch_size is None:
      return self._programs.memory(self.layout.plan(self.controller.batch_size).micro_batch_size)
    return self._programs.memory(self.layout.slot_rows(micro_batch_size))

  def close(self) -> None:
    """Waits for saves and compiles, closes the metrics files and releases the workdir.

    After a :class:`ProcessLostError` it does not wait for a checkpoint
    save under way: the save would wait for the lost process.
    """
    self._checkpoints.close()
    self._programs.close()
    self._data.close()
    self._metrics.writer.close()
    self._agreement.close()
    if self._workdir_lock is not None:  # the last: the files above are complete
      self._workdir_lock.close()

  def __enter__(self) -> Trainer:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


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
