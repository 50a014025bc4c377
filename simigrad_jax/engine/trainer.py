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
   it, and the next step is dispatched at once;
5. while the devices run it, the last step's metrics go to JSONL and
   TensorBoard and the progress bar moves; checkpoints are saved with orbax.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any, Callable, Literal, Mapping

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from simigrad_jax.controllers import learning_rate
from simigrad_jax.data import grain_source
from simigrad_jax.runtime import process_agreement
from simigrad_jax import optimizer_state
from simigrad_jax.engine import layout
from simigrad_jax.engine import trainer_checks
from simigrad_jax import validation
from simigrad_jax.controllers.simigrad import Controller
from simigrad_jax.runtime.metrics import MetricsWriter
from simigrad_jax.runtime.progress import ProgressBar
from simigrad_jax.runtime.process_agreement import ProcessDisagreementError
from simigrad_jax.runtime.process_agreement import ProcessLostError
from simigrad_jax.runtime.run_checkpoints import RunCheckpoints
from simigrad_jax.engine.run_totals import RunTotals
from simigrad_jax.data.sampler import EpochSampler
from simigrad_jax.engine.compiler import enable_persistent_cache
from simigrad_jax.engine.data_loader import StepDataLoader
from simigrad_jax.engine.data_loader import local_device_positions
from simigrad_jax.engine.data_loader import speculative_count
from simigrad_jax.engine.programs import StepPrograms
from simigrad_jax.engine.programs import host_scalars
from simigrad_jax.engine import train_step

logger = logging.getLogger("simigrad_jax")

Mode = Literal["recompile", "pad"]
MODES: tuple[str, ...] = ("recompile", "pad")

__all__ = ["MODES", "ProcessDisagreementError", "ProcessLostError", "Trainer"]


class Trainer:
  """Trains a model with SimiGrad's adaptive global batch size on all devices.

  Args:
    loss_fn: ``loss_fn(params, model_state, batch, weights, rng) ->
      (per_example_losses, new_model_state)`` for one device's rows (a dict of
      arrays with a leading example axis). ``weights`` is 1 for real rows and
      0 for padding: models with BatchNorm should pass it as the mask.
      BatchNorm statistics are averaged over devices after every micro-step.
    params: the initial parameters (a pytree).
    optimizer: an optax optimizer containing ``simigrad_jax.transform(axis_name)``
      and, last, ``simigrad_jax.scale_by_lr_factor()``.
    source: a random-access data source (``len()``, ``get_batch(indices)``,
      ``element_spec``), e.g. :class:`simigrad_jax.ArraySource`,
      :class:`simigrad_jax.TfdsSource` or :class:`simigrad_jax.GrainSource`;
      or any grain-style random-access data (``__len__``, ``__getitem__``
      giving a dict of arrays, e.g. a ``grain.MapDataset``), which is read
      through a :class:`simigrad_jax.GrainSource` with its defaults.
    controller: a :class:`simigrad_jax.Controller` (or one with its interface).
    workdir: where metrics and checkpoints go; a run resumes from the newest
      checkpoint found there. Its parent must exist.
    max_micro_batch_size: the most rows per device per micro-step (rounded up
      to even with the local split, whose two passes hold half each).
    model_state: non-trainable state (e.g. BatchNorm statistics), or None.
    mode: ``"recompile"`` (one compiled micro-step per shape of a power-of-two
      grid, compiled ahead in the background) or ``"pad"`` (one shape; smaller
      batches are padded with zero-weight rows).
    min_micro_batch_size: the smallest compiled shape in ``recompile`` mode
      (default 1; only the shapes the batch-size bounds need are compiled).
    lr_rule: ``"sqrt"``, ``"linear"`` or ``"none"`` (see :func:`lr_factor`).
    lr_adjust_factor: optional damping of the learning-rate factor.
    seed: seeds the data order and the per-step random keys.
    checkpoint_every_steps: save every this many steps (None: only at epoch
      ends and at the end).
    max_checkpoints: how many checkpoints to keep.
    eval_fn: optional ``eval_fn(params, model_state) -> dict`` run at every
      epoch end; its numbers are logged with an ``eval_`` prefix.
    lr_schedule: optional ``lr_schedule(epochs) -> float``, a multiplier of
      the base learning rate as a function of the epochs trained so far
      (fractional, counted in examples, so it does not depend on how many
      steps the changing batch size took). It multiplies the batch-size factor
      and is written into the optimizer state with it, so it costs no
      recompilation. E.g. step decay at epochs 80 and 120, or a warm-up.
    background_compile: compile the other shapes in a background thread.
    compile_fallback: in ``"recompile"`` mode, run a step whose micro-batch
      shape is still compiling on the nearest shape already compiled instead
      of waiting (the same examples and global batch, with more accumulation
      steps or zero-weight padding; the record's ``compile_fallback`` says
      so), so that only the first step waits for a compile (for its
      shape's programs, and the micro-step and update that let a larger
      batch accumulate on that shape, compiled while it runs). With BatchNorm
      the statistics are those of the fallback's micro-batches. With several
      processes, the fallback shape is one that every process had compiled
      at the previous step's agreement, so every process runs the same one.
    compilation_cache_dir: optional persistent compilation cache directory.
    tensorboard: also write TensorBoard event files.
    progress: show a progress bar (process 0 only).
    axis_name: the data-parallel axis name used by the transform.
    devices: the devices to train on (default: all, over every process), 1 or more.
    halves: the split into the two halves the similarity compares
      (:mod:`simigrad_jax.engine.layout`): ``"device"`` (even devices
      against odd ones), ``"local"`` (two blocks of rows per device), or
      ``"auto"`` (``"device"`` on an even number of devices, else ``"local"``).
    agreement_timeout_seconds: several hosts: how long a process waits for
      the others at a check (the settings, every step's decision, every
      checkpoint; and after a step failed) before it raises
      :class:`ProcessLostError` naming the missing ones. A process that
      waits this long in a collective while a peer's heartbeats have stopped
      is ended with the same error by a watchdog
      (:class:`simigrad_jax.runtime.process_agreement.Watchdog`). Default
      :data:`simigrad_jax.runtime.process_agreement.AGREEMENT_TIMEOUT_SECONDS`
      (300); keep it above the longest time a process may wait for another
      at a step's end.

  Each step's record (``metrics.jsonl``) also carries ``host_seconds``: the
  host's time on the critical path, from reading the previous step's
  statistics to calling this step's program (deciding the batch size, placing
  the data when it was not placed ahead). Metrics, TensorBoard, the
  progress bar and checkpoint bookkeeping of a step run after the next step is
  dispatched, while the devices work; a step that ends an epoch or is
  checkpointed writes its record before the checkpoint, so that a resumed run
  holds exactly the records up to its checkpoint.

  Raises:
    ValueError: for any setting or input that could not train as asked,
      before anything is compiled or trained; the message names the value
      and what is valid. Among them: a controller that adapts without
      ``batch_size_upper_bound`` or with bounds the data set cannot fill; a
      similarity controller whose ``batch_size_lower_bound`` is below 2 (the
      second half would hold no example, the similarity could not be
      measured and the size would never move again); ``halves="device"`` on
      an odd number of devices; non-finite initial parameters; a ``loss_fn``
      that fails on the source's rows or does not return one loss per row; a
      workdir whose checkpoints belong to another model, seed, data set or
      controller.
    ProcessDisagreementError: in a multi-host run, when the processes were
      built with different settings, or (checked after every step, before the
      next uses it) took different decisions.
    ProcessLostError: (a ProcessDisagreementError) in a multi-host run, when
      another process does not reach a check, or does not answer after a step
      failed (a collective that lost a peer), within
      ``agreement_timeout_seconds``; it names the missing processes. Restart
      all processes to resume from the newest checkpoint.

  Example:
    >>> trainer = simigrad_jax.Trainer(loss_fn=loss_fn, params=params,  # doctest: +SKIP
    ...     optimizer=optimizer, source=simigrad_jax.ArraySource({"x": x, "y": y}),
    ...     controller=simigrad_jax.Controller(64, 0.1, batch_size_lower_bound=16,
    ...                                        batch_size_upper_bound=1024),
    ...     workdir="/tmp/run", max_micro_batch_size=32)
    >>> summary = trainer.train(num_epochs=3)  # doctest: +SKIP
    >>> trainer.step_memory()["temp_bytes"]  # doctest: +SKIP

  Note:
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
      controller: Controller,
      workdir: str | os.PathLike,
      max_micro_batch_size: int,
      model_state: Any = None,
      mode: Mode = "recompile",
      min_micro_batch_size: int | None = None,
      lr_rule: learning_rate.LrRule = "sqrt",
      lr_adjust_factor: float | None = None,
      seed: int = 0,
      checkpoint_every_steps: int | None = None,
      max_checkpoints: int = 3,
      eval_fn: Callable[[Any, Any], Mapping[str, float]] | None = None,
      lr_schedule: Callable[[float], float] | None = None,
      background_compile: bool = True,
      compile_fallback: bool = True,
      compilation_cache_dir: str | os.PathLike | None = None,
      tensorboard: bool = True,
      progress: bool = True,
      axis_name: str = "batch",
      devices: list[jax.Device] | None = None,
      halves: str = "auto",
      agreement_timeout_seconds: float | None = None,
  ):
    # Every setting is checked before anything is created, compiled or trained,
    # so that a bad value fails in seconds, not after the first GPU-hour.
    if mode not in MODES:
      raise ValueError(f"mode={mode!r} is not valid; choose one of {MODES}")
    max_micro, seed, checkpoint_every_steps, max_checkpoints = trainer_checks.check_settings(
        lr_rule=lr_rule, loss_fn=loss_fn, eval_fn=eval_fn, lr_schedule=lr_schedule,
        max_micro_batch_size=max_micro_batch_size, min_micro_batch_size=min_micro_batch_size,
        seed=seed, checkpoint_every_steps=checkpoint_every_steps,
        max_checkpoints=max_checkpoints, axis_name=axis_name,
        flags={"background_compile": background_compile, "tensorboard": tensorboard,
               "progress": progress, "compile_fallback": compile_fallback})
    if agreement_timeout_seconds is None:
      agreement_timeout_seconds = process_agreement.AGREEMENT_TIMEOUT_SECONDS
    self._agreement_timeout = validation.check_real(
        "agreement_timeout_seconds", agreement_timeout_seconds, "(0, inf) (finite)",
        lambda x: 0 < x < math.inf)
    trainer_checks.check_controller(controller)
    source = grain_source.as_source(source)
    num_examples = trainer_checks.check_source(source)
    workdir = trainer_checks.check_workdir(workdir)
    devices = trainer_checks.check_devices(devices)
    self.num_devices = len(devices)
    self.halves = layout.resolve_halves(halves, self.num_devices)
    trainer_checks.check_finite_params(params)
    probe_state = trainer_checks.checked_optimizer_state(optimizer, params)
    self.lower, self.upper = trainer_checks.check_bounds(controller, num_examples, self.halves)
    for size in (self.lower, controller.initial_batch_size, self.upper):
      learning_rate.lr_factor(size, controller.initial_batch_size, lr_rule, lr_adjust_factor)

    self.workdir = workdir
    self.loss_fn, self.optimizer, self.source, self.controller = loss_fn, optimizer, source, controller
    self.mode, self.lr_rule, self.lr_adjust_factor = mode, lr_rule, lr_adjust_factor
    self.seed, self.eval_fn, self.axis_name = seed, eval_fn, axis_name
    self.lr_schedule = lr_schedule
    self.checkpoint_every_steps = checkpoint_every_steps
    self.base_batch_size = controller.initial_batch_size

    self.mesh = Mesh(np.array(devices), (axis_name,))
    self._replicated = NamedSharding(self.mesh, P())
    self._sharded = NamedSharding(self.mesh, P(axis_name))

    # Plans and compiled shapes count rows per slot (a device, or half of one: see
    # step_layout); self.shapes are rows per device.
    self.layout = layout.StepLayout.create(
        self.halves, self.num_devices, mode=mode, max_micro=max_micro,
        min_micro=min_micro_batch_size, lower=self.lower, upper=self.upper)
    self.shapes = tuple(self.layout.device_rows(g) for g in self.layout.grid)
    # With several processes, a fallback uses only shapes that every process reported compiled
    # at the last step's agreement, so all of them pick the same shape.
    fallback = compile_fallback and background_compile and mode == "recompile"
    needs_accumulation = self.upper > self.layout.num_slots * max(self.layout.grid)

    # Multi-host: every process must run the same program; a difference would
    # deadlock the first collective, so compare the settings first.
    process_agreement.agree("settings", set_up=True, timeout=self._agreement_timeout,
                            values=trainer_checks.settings_to_agree(
        controller=controller, source=source, params=params, seed=seed, mode=mode,
        shapes=list(self.shapes), lr_rule=lr_rule, lr_adjust_factor=lr_adjust_factor,
        num_examples=num_examples, num_devices=self.num_devices, halves=self.halves,
        checkpoint_every_steps=checkpoint_every_steps))

    workdir.mkdir(exist_ok=True)
    self.sampler = EpochSampler(num_examples, seed)
    self.state = jax.device_put(
        {"params": params, "opt_state": probe_state, "model_state": model_state}, self._replicated)
    self.step = 0
    self._nonfinite_steps = 0
    self._checkpoints = RunCheckpoints(workdir / "checkpoints", seed=seed,
                                       max_to_keep=max_checkpoints,
                                       agreement_timeout=self._agreement_timeout)
    # Multi-host: names a lost process when this one waits for it in a collective (until close).
    self._watchdog = process_agreement.Watchdog(self._agreement_timeout)
    try:
      resumed = self._checkpoints.resume(self.state, self.sampler, controller)
      if resumed is not None:
        self.state, self.step, self._nonfinite_steps = resumed
      process_agreement.agree("resumed state", set_up=True, timeout=self._agreement_timeout,
                              values={"step": self.step, "controller": controller.state_dict(),
                                      "sampler": self.sampler.state_dict()})
      if compilation_cache_dir is not None:
        enable_persistent_cache(compilation_cache_dir)
      self._programs = StepPrograms(
          loss_fn=trainer_checks.checked_loss_fn(loss_fn, model_state), optimizer=optimizer,
          mesh=self.mesh, axis_name=axis_name, layout=self.layout, seed=seed, state=self.state,
          element_spec=source.element_spec,
          needs_accumulation=needs_accumulation,
          background=background_compile, compile_fallback=fallback,
          shared_compiles=jax.process_count() > 1)
      # A model, loss, optimizer or data set that do not fit each other fail here.
      self._programs.trace(self.layout.plan(controller.batch_size).micro_batch_size)
    except BaseException:
      self._watchdog.close()
      self._checkpoints.close()
      if hasattr(self, "_programs"):
        self._programs.close()
      raise
    self._data = StepDataLoader(source, self.sampler, self._sharded, self._replicated,
                                self.layout.slot_positions(local_device_positions(devices)),
                                self.layout.num_slots, place_ahead=jax.process_count() == 1)
    self._is_main = jax.process_index() == 0
    self._lr_used = optimizer_state.lr_factor_of(self.state["opt_state"])
    self._schedule_factor = 1.0
    self._step_inputs: tuple[tuple[float, ...] | None, Any] = (None, None)
    self._metrics = MetricsWriter(workdir, tensorboard=tensorboard, resume_step=self.step,
                                  enabled=self._is_main)
    self._progress_enabled = progress and self._is_main

  # ------------------------------------------------------------------ set-up

  def save_checkpoint(self) -> None:
    """Saves the current state as the checkpoint of the current step (once per step)."""
    self._checkpoints.save(self.step, self.state, sampler=self.sampler,
                           controller=self.controller, nonfinite_steps=self._nonfinite_steps)

  # ------------------------------------------------------------------ training

  def train(self, *, num_epochs: float | None = None, num_steps: int | None = None) -> dict[str, Any]:
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
      ``host_seconds`` (the host's critical path between steps), and the last
      evaluation (if any).
    """
    if num_epochs is None and num_steps is None:
      raise ValueError("give num_epochs or num_steps")
    if num_epochs is not None:
      num_epochs = validation.check_real("num_epochs", num_epochs, "(0, inf) (finite)",
                                         lambda x: 0 < x < math.inf)
    if num_steps is not None:
      num_steps = validation.check_int("num_steps", num_steps, 0)
    total_examples = (math.inf if num_epochs is None
                      else int(round(num_epochs * self.sampler.num_examples)))
    max_steps = math.inf if num_steps is None else int(num_steps)
    batch_size = self.controller.batch_size
    self._set_lr_factor(batch_size)
    self._programs.prefetch_for(batch_size)
    progress = ProgressBar(
        total_examples if math.isfinite(total_examples) else 0,
        initial=min(self.sampler.examples_seen, total_examples) if math.isfinite(total_examples) else 0,
        enabled=self._progress_enabled)
    run = RunTotals()
    self._submit_data(batch_size, total_examples, self.step)
    self._last_read = None
    pending = None  # the last step's record, written once the next step is dispatched
    try:
      while self.step < max_steps and self.sampler.examples_seen < total_examples:
        dispatched = self._dispatch(total_examples)
        if pending is not None:  # bookkeeping of the last step, while the devices work
          self._finish(pending, run, progress)
          pending = None
        record = self._read_and_decide(dispatched)
        checkpoint = record["epoch_end"] or (self.checkpoint_every_steps
                                             and self.step % self.checkpoint_every_steps == 0)
        if not checkpoint:
          pending = record
          continue
        # Records up to a checkpoint are written before it, so a resume finds exactly those.
        self._finish(record, run, progress)
        if record["epoch_end"]:
          run.evaluation = self._evaluate()
        self.save_checkpoint()
      if pending is not None:
        self._finish(pending, run, progress)
        pending = None
      if run.steps:
        self.save_checkpoint()
      self._checkpoints.wait(f"end of the run at step {self.step}")
    except jax.errors.JaxRuntimeError as error:
      # Multi-host: a collective that lost a peer fails with an error that names no process.
      process_agreement.roll_call(f"step {self.step + 1}", error, self._agreement_timeout)
      raise
    finally:
      if pending is not None:
        self._finish(pending, run, progress)
      progress.close()
    return {"steps": self.step, "examples_seen": self.sampler.examples_seen,
            "final_batch_size": self.controller.batch_size, **self.compile_stats(),
            **run.summary()}

  def _submit_data(self, batch_size: int, total_examples: float, step: int) -> None:
    """Starts loading the rows of step ``step`` (0-based; for up to one grow of ``batch_size``)
    and placing them for ``batch_size`` unchanged."""
    start = self.sampler.examples_seen
    remaining = total_examples - start
    expected = None
    if remaining > 0:
      expected = self._programs.ready_plan(self.layout.plan(int(min(batch_size, remaining))))
    count = speculative_count(batch_size, self.upper, remaining)
    self._data.submit(start, count, step, expected)

  def _dispatch(self, total_examples: float) -> dict[str, Any]:
    """Plans the controller's batch size, takes its examples and dispatches the step."""
    start = time.perf_counter()
    batch_size = self.controller.batch_size
    remaining = total_examples - self.sampler.examples_seen
    if remaining < batch_size:
      batch_size = int(remaining)  # the run's last step lands exactly on num_epochs
    exact = self.layout.plan(batch_size)
    plan = self._programs.ready_plan(exact)
    data, data_seconds = self._data.take(plan, self.sampler.examples_seen, self.step)
    epoch_before = self.sampler.epoch
    self.sampler.take(plan.global_batch_size)
    inputs = (float(plan.global_batch_size), self._lr_used,
              float(self.layout.first_half_weight(plan.global_batch_size)))
    if self._step_inputs[0] != inputs:  # (unchanged at a fixed batch: no transfer)
      self._step_inputs = (inputs, host_scalars(list(inputs), np.float32, self._replicated))
    step_inputs = self._step_inputs[1]
    wait_before = self._programs.wait_seconds()
    # The host's critical path ends here: the program call is the runtime's (on CPU the
    # simulated devices are host threads, and the call runs part of the step).
    host_seconds = (time.perf_counter() - self._last_read if self._last_read is not None
                    else math.nan)
    self.state, stats = self._programs.run(self.state, data, step_inputs)
    # While the first step runs: the programs that let every later step fall back.
    self._programs.await_fallback(plan.micro_batch_size)
    compile_wait = self._programs.wait_seconds() - wait_before
    # Load the next step's rows while the devices work.
    self._submit_data(self.controller.batch_size, total_examples, self.step + 1)
    return {"start": start, "plan": plan, "exact": exact, "stats": stats,
            "data_seconds": data_seconds, "epoch_before": epoch_before,
            "compile_wait": compile_wait, "host_seconds": host_seconds,
            "lr_used": self._lr_used, "schedule_used": self._schedule_factor}

  def _read_and_decide(self, dispatched: dict[str, Any]) -> dict[str, Any]:
    """Waits for the step's statistics, lets the controller decide, and returns the step's record."""
    plan = dispatched["plan"]
    stats = dict(zip(train_step.STEP_STATS, np.asarray(
        jax.device_get(dispatched["stats"].addressable_data(0))).tolist()))
    read = time.perf_counter()
    step_seconds = read - (self._last_read if self._last_read is not None else dispatched["start"])
    self._last_read = read
    grads_finite = bool(stats["grads_finite"])
    if not grads_finite:
      self._nonfinite_steps += 1
    similarity = stats["similarity"] if stats["measured"] else math.nan
    epoch_end = self.sampler.epoch > dispatched["epoch_before"]
    observed = {**stats, "similarity": similarity, "grads_finite": grads_finite,
                "batch_size": plan.global_batch_size, "examples_seen": self.sampler.examples_seen,
                "epochs": self.sampler.examples_seen / self.sampler.num_examples,
                "epoch_end": epoch_end}
    next_batch_size = self.controller.update(similarity, stats=observed)
    self.step += 1
    factors = self._lr_factor(next_batch_size)
    # Multi-host: the next step's shapes and learning rate follow this decision; every
    # process must hold the same one before any of them uses it.
    # The compiled shapes ride along: the next step falls back only to a shape compiled on all.
    agreement_start = time.perf_counter()
    decision = {
        "step": self.step, "batch_size": plan.global_batch_size,
        "examples_seen": self.sampler.examples_seen, "similarity": similarity,
        "decision": self.controller.last_decision, "next_batch_size": next_batch_size,
        "next_lr_factor": float(np.float32(factors[0]))}
    compiled_reports = process_agreement.agree(
        f"decision of step {self.step}", decision, timeout=self._agreement_timeout,
        report=self._programs.compiled_report())
    if compiled_reports is not None:
      self._programs.agree_on_compiles(compiled_reports)
    agreement_seconds = time.perf_counter() - agreement_start
    self._set_lr_factor(next_batch_size, factors)
    return {
        "step": self.step,
        "epoch": dispatched["epoch_before"],
        "examples_seen": self.sampler.examples_seen,
        "batch_size": plan.global_batch_size,
        "micro_batch_size": self.layout.device_rows(plan.micro_batch_size),
        "accumulation_steps": plan.accumulation_steps,
        "padded_examples": plan.padded_examples,
        "compile_fallback": plan != dispatched["exact"],
        "lr_factor": dispatched["lr_used"],
        "next_batch_size": next_batch_size,
        "next_lr_factor": self._lr_used,
        "schedule_factor": dispatched["schedule_used"],
        "decision": self.controller.last_decision,
        "similarity_target": self.controller.config["similarity_target"],
        "loss": stats["loss"],
        "similarity": similarity,
        "norm_a": stats["norm_a"], "norm_b": stats["norm_b"], "norm_mean": stats["norm_mean"],
        "grads_finite": grads_finite,
        "nonfinite_steps": self._nonfinite_steps,
        "step_seconds": step_seconds,
        "examples_per_second": plan.global_batch_size / step_seconds,
        "data_seconds": dispatched["data_seconds"],
        "host_seconds": dispatched["host_seconds"],
        "agreement_seconds": agreement_seconds,
        "compile_wait_step_seconds": dispatched["compile_wait"],
        "epoch_end": epoch_end,
    }

  def _finish(self, record: dict[str, Any], run: RunTotals, progress: ProgressBar) -> None:
    """A step's bookkeeping: its metrics record, the run's totals and the progress bar."""
    self._metrics.write({**{k: v for k, v in record.items() if k != "epoch_end"},
                         **self.compile_stats()})
    run.add(record)
    progress.update(record["batch_size"], loss=record["loss"], batch=record["batch_size"],
                    sim=record["similarity"])

  def _lr_factor(self, batch_size: int) -> tuple[float, float]:
    """``(learning-rate factor, schedule factor)`` for ``batch_size`` at the current progress."""
    return learning_rate.scheduled_lr_factor(
        batch_size, self.base_batch_size, self.lr_rule, self.lr_adjust_factor, self.lr_schedule,
        self.sampler.examples_seen / self.sampler.num_examples)

  def _set_lr_factor(self, batch_size: int, factors: tuple[float, float] | None = None) -> None:
    """Sets the learning-rate factor the next step runs with (it is written into the optimizer
    state in-graph, at no recompilation)."""
    factor, self._schedule_factor = self._lr_factor(batch_size) if factors is None else factors
    self._lr_used = float(np.float32(factor))

  def _evaluate(self) -> dict[str, float]:
    if self.eval_fn is None:
      return {}
    params, model_state = _host_copy((self.state["params"], self.state["model_state"]))
    results = {f"eval_{k}": float(v) for k, v in self.eval_fn(params, model_state).items()}
    self._metrics.write({"step": self.step, "epoch": self.sampler.epoch - 1,
                         "examples_seen": self.sampler.examples_seen, **results})
    return results

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
    """Waits for saves and compiles, and closes the metrics files.

    After a :class:`ProcessLostError` it does not wait for a checkpoint
    save under way: the save would wait for the lost process.
    """
    self._checkpoints.close()
    self._programs.close()
    self._data.close()
    self._metrics.close()
    self._watchdog.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _host_copy(tree: Any) -> Any:
  """A NumPy copy of a replicated tree, read from this process's first device."""
  return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)
