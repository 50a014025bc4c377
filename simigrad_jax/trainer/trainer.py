"""Host: the adaptive-batch training loop.

Every optimizer step:

1. the controller's global batch size is planned onto the devices
   (:func:`simigrad_jax.plan_batch`): micro-batch shape, accumulation steps,
   padding;
2. the step's examples (the next ones of the epoch's permutation, counted in
   examples, so nothing is dropped or repeated within an epoch) are on the
   devices already when the batch size is the one expected, else they are
   placed now (:mod:`simigrad_jax.data.data_loader`); each process loads only
   the rows of its own devices;
3. the step's compiled program runs (:mod:`simigrad_jax.compile.programs`):
   one program for gradient, reduction and update when the step holds one
   micro-batch per device, else micro-steps then the update. The transform
   averages the gradients and measures the similarity; the host reads one
   small vector of statistics;
4. the controller picks the next batch size, the learning-rate factor follows
   it, every process agrees on the decision
   (:mod:`simigrad_jax.trainer.step_decision`), and the next step is
   dispatched at once (:mod:`simigrad_jax.trainer.step_inputs`);
5. while the devices run it, the last step's record
   (:class:`~simigrad_jax.trainer.step_record.StepRecord`) goes to the hooks
   (:mod:`simigrad_jax.trainer.hooks`): metrics to JSONL and TensorBoard, the
   run's totals, the progress bar, yours; at an epoch's end the evaluation,
   and checkpoints with orbax.

A SIGTERM or SIGINT during :meth:`Trainer.train` stops every process after
the same step, with that step's checkpoint saved
(:mod:`simigrad_jax.multihost.preemption`).

The settings are a :class:`~simigrad_jax.trainer.config.TrainerConfig`;
building the run (checks, layout, agreement, resume, tracing) is
:func:`~simigrad_jax.trainer.run_setup.build_run`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import optax

from simigrad_jax import validation
from simigrad_jax.ingraph import train_step
from simigrad_jax.multihost import preemption
from simigrad_jax.multihost.preemption import Preempted
from simigrad_jax.multihost.process_agreement import ProcessAgreement
from simigrad_jax.multihost.process_agreement import ProcessDisagreementError
from simigrad_jax.multihost.process_agreement import ProcessLostError
from simigrad_jax.trainer import run_setup
from simigrad_jax.trainer.config import MODES
from simigrad_jax.trainer.config import TrainerConfig
from simigrad_jax.trainer.hooks import CheckpointHook
from simigrad_jax.trainer.hooks import EvaluationHook
from simigrad_jax.trainer.hooks import MetricsHook
from simigrad_jax.trainer.hooks import ProgressHook
from simigrad_jax.trainer.hooks import StepHook
from simigrad_jax.trainer.hooks import check_hook
from simigrad_jax.trainer.metrics import MetricsWriter
from simigrad_jax.trainer.run_totals import RunTotals
from simigrad_jax.trainer.step_decision import StepDecider
from simigrad_jax.trainer.step_decision import epochs_trained
from simigrad_jax.trainer.step_inputs import StepDispatcher
from simigrad_jax.trainer.step_record import DispatchedStep
from simigrad_jax.trainer.step_record import StepRecord

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

  Every optimizer step plans the controller's batch size onto the devices,
  runs the step, reads the similarity, lets the controller choose the next
  size and hands the step's :class:`~simigrad_jax.trainer.step_record.
  StepRecord` to the hooks: metrics, progress, evaluation, checkpoints and
  yours. The arguments and errors in full: ``docs/trainer.md``.

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
    model_state: non-trainable state (e.g. BatchNorm statistics), or None.
    eval_fn: optional ``eval_fn(params, model_state) -> dict``, run at every
      epoch's end.
    lr_schedule: optional ``lr_schedule(epochs) -> float``, a multiplier of
      the base learning rate.
    devices: the devices to train on (default: all, over every process).
    mesh: a ``jax.sharding.Mesh`` (Auto axes) to train on instead of
      ``devices``: the batch is sharded over its axis ``axis_name``, and the
      parameters may be sharded over its other axes (``docs/trainer.md``,
      "On a mesh").
    param_sharding: the parameters' ``PartitionSpec``: None (replicated),
      one spec, a pytree of them like ``params`` (or a prefix of it), or a
      callable ``(path, leaf) -> PartitionSpec``; the optimizer state's
      copies of the parameters follow them.
    hooks: objects with ``on_step(record)``
      (:class:`~simigrad_jax.trainer.hooks.StepHook`).
    run_settings: what else decides the run, as JSON data, recorded in every
      checkpoint and compared on resume.
    config: the run's settings (:class:`TrainerConfig`), or
    **settings: its fields as keywords (``max_micro_batch_size``, ``mode``, ...).

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
    ...     workdir="/tmp/run", max_micro_batch_size=32)
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
    model_state: Any = None,
    eval_fn: Callable[[Any, Any], Mapping[str, float]] | None = None,
    lr_schedule: Callable[[float], float] | None = None,
    devices: list[jax.Device] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    param_sharding: Any = None,
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
      mesh=mesh,
      param_sharding=param_sharding,
    )
    self.controller, self.eval_fn = controller, eval_fn
    self.workdir, self.source = run.workdir, run.source
    self.mesh, self.layout, self.sampler = run.mesh, run.layout, run.sampler
    self.halves, self.num_devices = run.layout.halves, run.layout.num_devices
    self.shapes = run.layout.device_grid  # the compiled micro-batch shapes, rows per device
    self._workdir_lock, self._checkpoints = run.workdir_lock, run.checkpoints
    self._programs, self._data, self._is_main = run.programs, run.data, jax.process_index() == 0
    self._metrics = MetricsHook(
      MetricsWriter(
        run.workdir, tensorboard=config.tensorboard, resume_step=run.step, enabled=self._is_main
      )
    )
    self._checkpoint = CheckpointHook(
      self.save_checkpoint, config.checkpoint_every_steps, config.checkpoint_every_seconds
    )
    self._stop = preemption.RunStop()
    self._dispatcher = StepDispatcher(
      run.state, run.layout, run.programs, run.data, run.sampler, run.step_inputs
    )
    self._decider = StepDecider(run, controller, self._agreement, self._checkpoint, self._stop)

  @property
  def step(self) -> int:
    """The optimizer steps done, over the whole run (resumes included)."""
    return self._decider.step

  @property
  def state(self) -> dict[str, Any]:
    """The ``{"params", "opt_state", "model_state"}`` of the last step dispatched, on the mesh."""
    return self._dispatcher.state

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
      nonfinite_steps=self._decider.nonfinite_steps,
      compiled_programs=self._programs.compiled_programs(),
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
      A summary dict: steps, examples seen, average and final batch size,
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
      total_examples, self.sampler.examples_seen, enabled=self.config.progress and self._is_main
    )
    evaluation = EvaluationHook(self.eval_fn, lambda: self.state, self._metrics.writer)
    hooks: list[StepHook] = [self._metrics, totals, progress, *self._hooks]
    hooks += [evaluation, self._checkpoint]  # an epoch's end: evaluated, then checkpointed
    batch_size, epochs = self.controller.batch_size, epochs_trained(self.sampler)
    self._dispatcher.prepare(batch_size, total_examples, self.step, epochs)
    self._decider.last_read = None  # a call's first step has no host time before it
    self._checkpoint.restart_clock()
    with self._stop:  # a signal stops the run after the step under way
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
      "nonfinite_steps": self._decider.nonfinite_steps,
      **self.compile_stats(),
      **totals.summary(),
      **evaluation.results,
    }
    if self._more_steps(total_examples, max_steps):
      checkpoint = os.path.join(self._checkpoints.checkpointer.directory, str(self.step))
      self._stop.raise_if_agreed(self.step, checkpoint, summary)
    return summary

  def _more_steps(self, total_examples: float, max_steps: float) -> bool:
    """Whether the run has steps left before ``total_examples`` or ``max_steps``."""
    return self.step < max_steps and self.sampler.examples_seen < total_examples

  def _run_steps(self, hooks: Sequence[StepHook], total_examples: float, max_steps: float) -> None:
    """Runs steps until the run's end or a stop the processes agreed on.

    A step's hooks run once the next step is dispatched, while the devices
    work, but a checkpointed step's run at once: the records up to a
    checkpoint are written before it.
    """
    pending = None  # the last step's record
    try:
      while self._more_steps(total_examples, max_steps) and self._stop.agreed is None:
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

  def _dispatch(self, total_examples: float) -> DispatchedStep:
    """Plans the controller's batch size, takes its examples and dispatches the step."""
    return self._dispatcher.dispatch(
      self.controller.batch_size, total_examples, self.step, self._decider.last_read
    )

  def _read_and_decide(self, dispatched: DispatchedStep) -> StepRecord:
    """Reads the step's statistics, decides the next batch size, agrees on it: the step's record."""
    return self._decider.decide(dispatched)

  def _run_hooks(self, hooks: Sequence[StepHook], record: StepRecord) -> None:
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
