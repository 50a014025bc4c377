"""Host: the adaptive-batch training loop.

Every optimizer step:

1. the controller's global batch size is planned onto the devices
   (:func:`simigrad_jax.plan_batch`): micro-batch shape, accumulation steps,
   padding;
2. the sampler hands out exactly that many examples (position counted in
   examples, so nothing is dropped or repeated within an epoch); each process
   loads only the rows of its own devices;
3. the compiled micro-step for that shape runs once per accumulation step
   (compiled ahead of time; the other shapes compile in a background thread);
4. the apply step averages the gradients, measures the similarity
   (:func:`simigrad_jax.transform`) and updates the parameters; the host reads
   one small vector of statistics;
5. the controller picks the next batch size and the learning-rate factor
   follows it, written into the optimizer state with no recompilation;
6. metrics go to JSONL and TensorBoard; checkpoints are saved with orbax.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import logging
import math
import os
import pathlib
import time
import zlib
from typing import Any, Callable, Literal, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from simigrad_jax.host import batch_plan
from simigrad_jax.host import lr_rules
from simigrad_jax.host import state_access
from simigrad_jax.host import validation
from simigrad_jax.host.checkpointing import CheckpointMismatchError
from simigrad_jax.host.checkpointing import Checkpointer
from simigrad_jax.host.controller import Controller
from simigrad_jax.host.metrics import MetricsWriter
from simigrad_jax.host.metrics import ProgressBar
from simigrad_jax.host.sampler import EpochSampler
from simigrad_jax.host.step_compiler import StepCompiler
from simigrad_jax.host.step_compiler import enable_persistent_cache
from simigrad_jax.ingraph import train_step
from simigrad_jax.ingraph.lr_scaling import LrFactorState
from simigrad_jax.ingraph.transform import SimilarityState

logger = logging.getLogger("simigrad_jax")

Mode = Literal["recompile", "pad"]
MODES: tuple[str, ...] = ("recompile", "pad")
# What the Trainer reads from a controller (see simigrad_jax.host.controllers).
_CONTROLLER_ATTRIBUTES = ("batch_size", "initial_batch_size", "config", "last_decision", "update",
                          "set_batch_size", "state_dict", "load_state_dict")
_CONTROLLER_CONFIG_KEYS = ("batch_size_lower_bound", "batch_size_upper_bound", "similarity_target")


class ProcessDisagreementError(RuntimeError):
  """The processes of a multi-host run set up or decided differently (a collective would deadlock)."""


@dataclasses.dataclass
class _StepData:
  """One optimizer step's rows, already on the devices."""

  plan: batch_plan.BatchPlan
  micro_batches: list[tuple[Any, Any]]  # (batch, weights) per accumulation step
  seconds: float  # host time spent gathering and placing them


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
      ``element_spec``), e.g. :class:`simigrad_jax.ArraySource` or
      :class:`simigrad_jax.TfdsSource`.
    controller: a :class:`simigrad_jax.Controller` (or one with its interface).
    workdir: where metrics and checkpoints go; a run resumes from the newest
      checkpoint found there. Its parent must exist.
    max_micro_batch_size: the most rows per device per micro-step.
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
      so), so that only the first step waits for a compile. With BatchNorm
      the statistics are those of the fallback's micro-batches. Used with one
      process only: every process must run the same shapes.
    compilation_cache_dir: optional persistent compilation cache directory.
    tensorboard: also write TensorBoard event files.
    progress: show a progress bar (process 0 only).
    axis_name: the data-parallel axis name used by the transform.
    devices: the devices to train on (default: all, over every process); an
      even number, since the similarity compares the two device halves.

  Raises:
    ValueError: for any setting or input that could not train as asked,
      before anything is compiled or trained; the message names the value
      and what is valid. Among them: a controller that adapts without
      ``batch_size_upper_bound`` or with bounds the data set cannot fill; a
      similarity controller whose ``batch_size_lower_bound`` is below 2 (the
      second device half would hold no example, the similarity could not be
      measured and the size would never move again); non-finite initial parameters; a ``loss_fn`` that fails on the
      source's rows or does not return one loss per row; a workdir whose
      checkpoints belong to another model, seed, data set or controller.
    ProcessDisagreementError: in a multi-host run, when the processes were
      built with different settings, or (checked after every step, before the
      next uses it) took different decisions; also when another process does
      not reach the set-up check within :data:`AGREEMENT_TIMEOUT_SECONDS`.

  Example:
    >>> trainer = simigrad_jax.Trainer(loss_fn=loss_fn, params=params,  # doctest: +SKIP
    ...     optimizer=optimizer, source=simigrad_jax.ArraySource({"x": x, "y": y}),
    ...     controller=simigrad_jax.Controller(64, 0.1, batch_size_lower_bound=16,
    ...                                        batch_size_upper_bound=1024),
    ...     workdir="/tmp/run", max_micro_batch_size=32)
    >>> summary = trainer.train(num_epochs=3)  # doctest: +SKIP

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
      lr_rule: lr_rules.LrRule = "sqrt",
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
  ):
    # Every setting is checked before anything is created, compiled or trained,
    # so that a bad value fails in seconds, not after the first GPU-hour.
    if mode not in MODES:
      raise ValueError(f"mode={mode!r} is not valid; choose one of {MODES}")
    if lr_rule not in lr_rules.LR_RULES:
      raise ValueError(f"lr_rule={lr_rule!r} is not valid; choose one of {lr_rules.LR_RULES}")
    _check_callable("loss_fn", loss_fn)
    for name, fn in (("eval_fn", eval_fn), ("lr_schedule", lr_schedule)):
      if fn is not None:
        _check_callable(name, fn)
    if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
      raise ValueError(f"optimizer must be an optax GradientTransformation (with init and update), "
                       f"got {optimizer!r:.200}")
    _check_controller(controller)
    num_examples = _check_source(source)
    max_micro = validation.check_int("max_micro_batch_size", max_micro_batch_size, 1)
    if min_micro_batch_size is not None and (
        not validation.is_int(min_micro_batch_size) or not 1 <= min_micro_batch_size <= max_micro):
      raise ValueError(f"min_micro_batch_size must be None or an integer in [1, max_micro_batch_size="
                       f"{max_micro}], got {min_micro_batch_size!r}")
    seed = validation.check_int("seed", seed, 0)
    if checkpoint_every_steps is not None:
      checkpoint_every_steps = validation.check_int("checkpoint_every_steps", checkpoint_every_steps, 1)
    max_checkpoints = validation.check_int("max_checkpoints", max_checkpoints, 1)
    for name, flag in (("background_compile", background_compile), ("tensorboard", tensorboard),
                       ("progress", progress), ("compile_fallback", compile_fallback)):
      validation.check_bool(name, flag)
    if not isinstance(axis_name, str) or not axis_name:
      raise ValueError(f"axis_name must be a non-empty string, got {axis_name!r}")
    workdir = pathlib.Path(workdir).absolute()
    if not workdir.parent.is_dir():
      raise ValueError(f"the workdir's parent {str(workdir.parent)!r} does not exist")
    if workdir.exists() and not workdir.is_dir():
      raise ValueError(f"workdir {str(workdir)!r} exists and is not a directory")
    devices = _check_devices(devices)
    _check_finite_params(params)
    probe_state = optimizer.init(params)
    for state_type, name in ((SimilarityState, "simigrad_jax.transform"),
                             (LrFactorState, "simigrad_jax.scale_by_lr_factor()")):
      if not optax.tree_utils.tree_get_all_with_path(probe_state, state_type.__name__):
        raise ValueError(f"the optimizer has no {state_type.__name__}: chain {name} into it")
    self.num_devices = len(devices)
    self.lower, self.upper = _check_bounds(controller, self.num_devices, num_examples)
    for size in (self.lower, controller.initial_batch_size, self.upper):
      lr_rules.lr_factor(size, controller.initial_batch_size, lr_rule, lr_adjust_factor)

    self.workdir = workdir
    self.loss_fn, self.optimizer, self.source, self.controller = loss_fn, optimizer, source, controller
    self.mode, self.lr_rule, self.lr_adjust_factor = mode, lr_rule, lr_adjust_factor
    self.seed, self.eval_fn, self.axis_name = seed, eval_fn, axis_name
    self.lr_schedule = lr_schedule
    self.checkpoint_every_steps = checkpoint_every_steps
    self.base_batch_size = controller.initial_batch_size

    self.mesh = Mesh(np.array(devices), (axis_name,))
    self._local_positions = _local_device_positions(devices)
    self._replicated = NamedSharding(self.mesh, P())
    self._sharded = NamedSharding(self.mesh, P(axis_name))

    if mode == "pad":
      self.policy = batch_plan.BucketPolicy(max_micro, max_micro, padding=True)
    else:
      grid = batch_plan.BucketPolicy(max_micro, min_micro_batch_size or 1, padding=True)
      needed = batch_plan.bucket_shapes(grid, self.num_devices, self.lower, self.upper)
      # Smaller requests (the last step of a run) pad up to the smallest needed shape.
      self.policy = batch_plan.BucketPolicy(max_micro, min(needed), padding=True)
    self.shapes = self.policy.micro_batch_sizes()
    # Processes decide from their own compile progress, so they could pick different shapes.
    self._compile_fallback = (compile_fallback and background_compile and mode == "recompile"
                              and jax.process_count() == 1)

    # Multi-host: every process must run the same program; a difference would
    # deadlock the first collective, so compare the settings first.
    self._agree("settings", set_up=True, values={
        "controller": controller.config, "batch_size": controller.batch_size, "seed": seed,
        "mode": mode, "shapes": list(self.shapes), "lr_rule": lr_rule,
        "lr_adjust_factor": lr_adjust_factor, "num_examples": num_examples,
        "element_spec": {k: [list(shape), str(dtype)] for k, (shape, dtype)
                         in sorted(source.element_spec.items())},
        "num_devices": self.num_devices, "checkpoint_every_steps": checkpoint_every_steps,
        "params": [[jax.tree_util.keystr(path), list(np.shape(x)), str(getattr(x, "dtype", ""))]
                   for path, x in jax.tree_util.tree_flatten_with_path(params)[0]],
    })

    workdir.mkdir(exist_ok=True)
    self.sampler = EpochSampler(num_examples, seed)
    self.state = jax.device_put(
        {"params": params, "opt_state": probe_state, "model_state": model_state}, self._replicated)
    self.step = 0
    self._nonfinite_steps = 0
    self._checkpointer = Checkpointer(workdir / "checkpoints", max_to_keep=max_checkpoints)
    try:
      self._resume()
      self._agree("resumed state", set_up=True, values={
          "step": self.step, "controller": controller.state_dict(),
          "sampler": self.sampler.state_dict()})
      if compilation_cache_dir is not None:
        enable_persistent_cache(compilation_cache_dir)
      self._acc = train_step.zero_accumulator(params, self.mesh, axis_name)
      checked_loss = _checked_loss_fn(loss_fn, model_state)
      micro = jax.jit(train_step.make_micro_step(checked_loss, self.mesh, axis_name, seed),
                      donate_argnums=(2,))
      # Trace (not compile) the first step's micro-step now: a model, loss or data set
      # that do not fit each other fail here, with the features named. The trace is
      # reused when that shape is compiled.
      first_shape = self._plan(controller.batch_size, None).micro_batch_size
      try:
        traced = {first_shape: micro.trace(*self._abstract_micro_args(first_shape))}
      except _LossContractError:
        raise
      except Exception as error:
        raise ValueError(
            f"loss_fn fails on one device's rows of this source (features "
            f"{ {k: (tuple(s), str(d)) for k, (s, d) in source.element_spec.items()} }, "
            f"{first_shape} rows): {type(error).__name__}: {error}") from error

      def lower(micro_batch_size: int) -> jax.stages.Lowered:
        first = traced.pop(micro_batch_size, None)
        return first.lower() if first is not None else micro.lower(
            *self._abstract_micro_args(micro_batch_size))

      self._compiler = StepCompiler(lower, background=background_compile, name="micro_step")
      apply = jax.jit(_skip_nonfinite(train_step.make_apply_step(optimizer, self.mesh, axis_name)),
                      donate_argnums=(0, 1, 2),
                      out_shardings=(self._replicated, self._replicated, self._sharded,
                                     self._replicated))
      start = time.perf_counter()
      try:
        self._apply = apply.lower(*_abstract(
            (self.state["params"], self.state["opt_state"], self._acc))).compile()
      except NameError as error:  # e.g. "unbound axis name: data"
        raise ValueError(f"the optimizer's simigrad_jax.transform must use the Trainer's "
                         f"axis_name={axis_name!r}: {error}") from error
    except BaseException:
      self._checkpointer.close()
      raise
    self._apply_compile_seconds = time.perf_counter() - start
    self._data_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="simigrad-data")
    self._is_main = jax.process_index() == 0
    self._lr_used = state_access.lr_factor_of(self.state["opt_state"])
    self._schedule_factor = 1.0
    self._metrics = MetricsWriter(workdir, tensorboard=tensorboard, resume_step=self.step,
                                  enabled=self._is_main)
    self._progress_enabled = progress and self._is_main

  # ------------------------------------------------------------------ set-up

  def _abstract_micro_args(self, micro: int) -> tuple:
    rows = self.num_devices * micro
    batch = {name: jax.ShapeDtypeStruct((rows,) + tuple(shape), dtype, sharding=self._sharded)
             for name, (shape, dtype) in self.source.element_spec.items()}
    weights = jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=self._sharded)
    total_weight = jax.ShapeDtypeStruct((), jnp.float32, sharding=self._replicated)
    counters = jax.ShapeDtypeStruct((2,), jnp.int32, sharding=self._replicated)
    return (*_abstract((self.state["params"], self.state["model_state"], self._acc)),
            batch, weights, total_weight, counters)

  def _resume(self) -> None:
    """Continues from the newest readable checkpoint in the workdir, if any."""
    if self._checkpointer.latest_step() is None:
      return
    directory = self._checkpointer.directory
    try:
      state, host, step = self._checkpointer.restore(self.state)
    except CheckpointMismatchError as error:
      raise ValueError(f"the workdir {str(self.workdir)!r} holds checkpoints of another run: "
                       f"{error}") from error
    if host.get("seed") != self.seed:
      raise ValueError(f"the checkpoint at step {step} in {directory} was made with "
                       f"seed={host.get('seed')!r}, this run has seed={self.seed}; use the same "
                       "seed to resume, or a new workdir")
    try:  # both refuse without changing anything
      self.sampler.load_state_dict(host["sampler"])
      self.controller.load_state_dict(host["controller"])
    except (KeyError, TypeError, ValueError) as error:
      raise ValueError(f"the checkpoint at step {step} in {directory} does not match this run's "
                       f"settings: {error}; resume with the settings it was made with, or use a "
                       "new workdir") from error
    self.state = state
    self.step = int(host["step"])
    self._nonfinite_steps = int(host.get("nonfinite_steps", 0))
    skipped = self._checkpointer.skipped
    if skipped:
      logger.warning("resumed from the checkpoint at step %d in %s after skipping %d unreadable "
                     "newer one(s): %s", step, directory, len(skipped),
                     "; ".join(f"step {s}: {why}" for s, why in skipped))
    else:
      logger.info("resumed from the checkpoint at step %d in %s", step, directory)

  def save_checkpoint(self) -> None:
    """Saves the current state as the checkpoint of the current step (once per step)."""
    if self._checkpointer.latest_step() == self.step:
      return
    host = {"step": self.step, "seed": self.seed, "controller": self.controller.state_dict(),
            "sampler": self.sampler.state_dict(), "nonfinite_steps": self._nonfinite_steps}
    self._checkpointer.save(self.step, self.state, host)

  # ------------------------------------------------------------------ data

  def _plan(self, batch_size: int, previous: int | None) -> batch_plan.BatchPlan:
    return batch_plan.plan_batch(batch_size, self.num_devices, self.policy,
                                 previous_batch_size=previous, lower=1, upper=None)

  def _ready_plan(self, plan: batch_plan.BatchPlan) -> batch_plan.BatchPlan:
    """``plan``, or while its shape is still compiling, the same batch on the nearest compiled shape.

    The nearest in log scale (ties: the larger shape, fewer micro-steps) with
    the fewest accumulation steps that hold the batch; the examples and their
    devices are those of ``plan`` (the device halves hold the same examples).
    """
    if not self._compile_fallback:
      return plan
    stats = self._compiler.stats()
    ready = [g for g in stats["compiled_sizes"] if g in self.shapes]
    # A failed shape is not replaced: getting it raises, rather than falling back for ever.
    if not ready or plan.micro_batch_size in ready + stats["failed_sizes"]:
      return plan
    self._compiler.prefetch([plan.micro_batch_size])  # (a no-op when queued or compiling)
    micro = min(ready, key=lambda g: (abs(math.log(g / plan.micro_batch_size)), -g))
    steps = -(-plan.global_batch_size // (self.num_devices * micro))
    return dataclasses.replace(
        plan, micro_batch_size=micro, accumulation_steps=steps,
        padded_examples=self.num_devices * micro * steps - plan.global_batch_size)

  def _local_rows(self, first_example: int, count: int):
    """Loads this process's rows among the next ``count`` examples (runs in the data thread)."""
    indices = self.sampler.indices_at(first_example, count)
    examples = np.arange(count)
    mine = np.isin(examples % self.num_devices, self._local_positions)
    return examples[mine], self.source.get_batch(indices[mine])

  def _place(self, plan: batch_plan.BatchPlan, loaded) -> _StepData:
    """Arranges loaded rows into the plan's micro-batches on the devices."""
    start = time.perf_counter()
    local_examples, rows = loaded
    layout = plan.example_layout()[:, self._local_positions, :]  # (k, local, micro)
    weights = plan.example_weights()[:, self._local_positions, :]
    where = np.searchsorted(local_examples, np.maximum(layout, 0))
    micro_batches = []
    for j in range(plan.accumulation_steps):
      take = where[j].reshape(-1)
      real = layout[j].reshape(-1) >= 0
      local = {name: _gather_rows(array, take, real) for name, array in rows.items()}
      micro_batches.append((self._to_devices(local, plan.micro_batch_size),
                            self._to_devices(weights[j].reshape(-1).astype(np.float32), plan.micro_batch_size)))
    return _StepData(plan, micro_batches, time.perf_counter() - start)

  def _to_devices(self, local_tree, micro: int):
    rows = self.num_devices * micro
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(self._sharded, x, (rows,) + x.shape[1:]),
        local_tree)

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
      ``compile_fallback_steps``: steps run on a fallback shape), and the
      last evaluation (if any).
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
    self._set_lr_factor(self.controller.batch_size)
    self._compiler.prefetch(self._shapes_by_distance(self.controller.batch_size))
    progress = ProgressBar(
        total_examples if math.isfinite(total_examples) else 0,
        initial=min(self.sampler.examples_seen, total_examples) if math.isfinite(total_examples) else 0,
        enabled=self._progress_enabled)
    run = {"examples": 0, "steps": 0, "wall": 0.0, "data": 0.0, "fallback": 0, "last": {},
           "eval": {}}
    next_data = self._submit_data(self.controller.batch_size, total_examples)
    try:
      while self.step < max_steps and self.sampler.examples_seen < total_examples:
        record, next_data = self._train_one_step(next_data, total_examples)
        run["examples"] += record["batch_size"]
        run["steps"] += 1
        run["wall"] += record["step_seconds"]
        run["data"] += record["data_seconds"]
        run["fallback"] += record["compile_fallback"]
        run["last"] = record
        progress.update(record["batch_size"], loss=record["loss"], batch=record["batch_size"],
                        sim=record["similarity"])
        if record["epoch_end"]:
          run["eval"] = self._evaluate()
        if (record["epoch_end"] or (self.checkpoint_every_steps
                                    and self.step % self.checkpoint_every_steps == 0)):
          self.save_checkpoint()
      if run["steps"]:
        self.save_checkpoint()
      self._checkpointer.wait()
    finally:
      progress.close()
    compile_stats = self.compile_stats()
    last = run["last"]
    return {
        "steps": self.step, "examples_seen": self.sampler.examples_seen,
        "run_steps": run["steps"], "run_examples": run["examples"],
        "average_batch_size": run["examples"] / run["steps"] if run["steps"] else math.nan,
        "final_batch_size": self.controller.batch_size,
        "loss": last.get("loss"), "similarity": last.get("similarity"),
        "wall_seconds": run["wall"], "data_seconds": run["data"],
        "compile_fallback_steps": run["fallback"], **compile_stats,
        **run["eval"],
    }

  def _shapes_by_distance(self, batch_size: int) -> list[int]:
    current = self._plan(batch_size, None).micro_batch_size
    return sorted(self.shapes, key=lambda m: (abs(math.log(m / current)), m))

  def _submit_data(self, batch_size: int, total_examples: float):
    """Starts loading the rows for the next step, for up to one grow of ``batch_size``."""
    start = self.sampler.examples_seen
    most = max(batch_size + 1, int(batch_size * 1.1))
    if self.upper is not None:
      most = min(most, self.upper)
    most = max(most, batch_size)
    most = int(min(most, total_examples - start)) if math.isfinite(total_examples) else most
    return start, most, self._data_pool.submit(self._local_rows, start, max(most, 1))

  def _train_one_step(self, pending, total_examples: float):
    step_start = time.perf_counter()
    batch_size = self.controller.batch_size
    remaining = total_examples - self.sampler.examples_seen
    if remaining < batch_size:
      batch_size = int(remaining)  # the run's last step lands exactly on num_epochs
    exact = self._plan(batch_size, None)
    plan = self._ready_plan(exact)
    start, loaded_count, future = pending
    wait_start = time.perf_counter()
    if start == self.sampler.examples_seen and loaded_count >= plan.global_batch_size:
      loaded = future.result()
    else:  # the speculative load does not cover this step (e.g. after a resume)
      future.result()
      loaded = self._local_rows(self.sampler.examples_seen, plan.global_batch_size)
    data = self._place(plan, loaded)
    data_seconds = (time.perf_counter() - wait_start)
    compile_before = self._compiler.stats()["compile_wait_seconds"]

    epoch_before = self.sampler.epoch
    self.sampler.take(plan.global_batch_size)
    state, acc = self.state, self._acc
    model_state = state["model_state"]
    total_weight = jax.device_put(np.float32(plan.global_batch_size), self._replicated)
    for j, (batch, weights) in enumerate(data.micro_batches):
      compiled = self._compiler.get(plan.micro_batch_size)
      counters = jax.device_put(np.array([self.step, j], np.int32), self._replicated)
      acc, model_state = compiled(state["params"], model_state, acc, batch, weights,
                                  total_weight, counters)
    params, opt_state, self._acc, stats_vector = self._apply(state["params"], state["opt_state"], acc)
    # Load the next step's rows while the devices work.
    lr_used, schedule_used = self._lr_used, self._schedule_factor
    next_pending = self._submit_data(self.controller.batch_size, total_examples)
    stats = dict(zip(train_step.STEP_STATS,
                     np.asarray(jax.device_get(stats_vector.addressable_data(0))).tolist()))
    grads_finite = bool(stats["grads_finite"])
    if not grads_finite:
      self._nonfinite_steps += 1
      model_state = state["model_state"]  # BatchNorm statistics of a bad step are dropped too
    similarity = stats["similarity"] if stats["measured"] else math.nan
    observed = {**stats, "similarity": similarity, "grads_finite": grads_finite,
                "batch_size": plan.global_batch_size, "examples_seen": self.sampler.examples_seen,
                "epochs": self.sampler.examples_seen / self.sampler.num_examples,
                "epoch_end": self.sampler.epoch > epoch_before}
    next_batch_size = self.controller.update(similarity, stats=observed)
    self.state = {"params": params, "opt_state": opt_state, "model_state": model_state}
    self.step += 1
    factors = self._lr_factor(next_batch_size)
    # Multi-host: the next step's shapes and learning rate follow this decision; every
    # process must hold the same one before any of them uses it.
    self._agree(f"decision of step {self.step}", {
        "step": self.step, "batch_size": plan.global_batch_size,
        "examples_seen": self.sampler.examples_seen, "similarity": similarity,
        "decision": self.controller.last_decision, "next_batch_size": next_batch_size,
        "next_lr_factor": float(np.float32(factors[0]))})
    self._set_lr_factor(next_batch_size, factors)

    step_seconds = time.perf_counter() - step_start
    compile_stats = self.compile_stats()
    record = {
        "step": self.step,
        "epoch": epoch_before,
        "examples_seen": self.sampler.examples_seen,
        "batch_size": plan.global_batch_size,
        "micro_batch_size": plan.micro_batch_size,
        "accumulation_steps": plan.accumulation_steps,
        "padded_examples": plan.padded_examples,
        "compile_fallback": plan != exact,
        "lr_factor": lr_used,
        "next_batch_size": next_batch_size,
        "next_lr_factor": self._lr_used,
        "schedule_factor": schedule_used,
        "decision": self.controller.last_decision,
        "similarity_target": self.controller.config["similarity_target"],
        "loss": stats["loss"],
        "similarity": similarity,
        "norm_a": stats["norm_a"], "norm_b": stats["norm_b"], "norm_mean": stats["norm_mean"],
        "grads_finite": grads_finite,
        "nonfinite_steps": self._nonfinite_steps,
        "step_seconds": step_seconds,
        "examples_per_second": plan.global_batch_size / step_seconds,
        "data_seconds": data_seconds,
        "compile_wait_step_seconds": compile_stats["compile_wait_seconds"] - compile_before,
        **compile_stats,
    }
    self._metrics.write(record)
    record["epoch_end"] = self.sampler.epoch > epoch_before
    return record, next_pending

  def _agree(self, what: str, values: Mapping[str, Any], set_up: bool = False) -> None:
    """Raises :class:`ProcessDisagreementError` unless every process holds the same ``values``.

    Nothing happens with one process. Each value is compared as JSON; the
    error names each differing key with every process's value. Per step, one
    small all-gather over the processes; at set-up (``set_up=True``) the
    values go through jax.distributed's key-value store instead, so that a
    process that failed before reaching this point is reported after
    :data:`AGREEMENT_TIMEOUT_SECONDS` rather than leaving the others waiting.
    """
    if jax.process_count() == 1:
      return
    texts = [json.dumps(values[key], sort_keys=True, default=str) for key in values]
    gathered = _gather_texts_with_timeout(texts, what) if set_up else _gather_texts(texts)
    differing = [i for i in range(len(texts)) if len({row[i] for row in gathered}) > 1]
    if not differing:
      return
    details = "; ".join(
        f"{key}: " + ", ".join(f"process {p} has {row[i]}" for p, row in enumerate(gathered))
        for i, key in enumerate(values) if i in differing)
    raise ProcessDisagreementError(
        f"the {jax.process_count()} processes disagree on the {what} ({details}). All processes "
        "must run with the same settings and take the same decisions, or the next collective "
        "would deadlock; build the Trainer with the same settings, data set and code on every "
        "process")

  def _lr_factor(self, batch_size: int) -> tuple[float, float]:
    """``(learning-rate factor, schedule factor)`` for ``batch_size`` at the current progress."""
    epochs = self.sampler.examples_seen / self.sampler.num_examples
    schedule = 1.0 if self.lr_schedule is None else float(self.lr_schedule(epochs))
    factor = lr_rules.lr_factor(batch_size, self.base_batch_size, self.lr_rule,
                                self.lr_adjust_factor) * schedule
    if not math.isfinite(factor) or factor <= 0:
      raise ValueError(f"the learning-rate factor at epoch {epochs:.3f} would be {factor} "
                       f"(lr_schedule returned {schedule}); it must be finite and > 0")
    return factor, schedule

  def _set_lr_factor(self, batch_size: int, factors: tuple[float, float] | None = None) -> None:
    """Writes the learning-rate factor for ``batch_size`` at the current progress into the state."""
    factor, self._schedule_factor = self._lr_factor(batch_size) if factors is None else factors
    self.state["opt_state"] = state_access.set_lr_factor(self.state["opt_state"], factor)
    self._lr_used = float(np.float32(factor))  # the value the next step runs with

  def _evaluate(self) -> dict[str, float]:
    if self.eval_fn is None:
      return {}
    params, model_state = _host_copy((self.state["params"], self.state["model_state"]))
    results = {f"eval_{k}": float(v) for k, v in self.eval_fn(params, model_state).items()}
    self._metrics.write({"step": self.step, "epoch": self.sampler.epoch - 1,
                         "examples_seen": self.sampler.examples_seen, **results})
    return results

  def compile_stats(self) -> dict[str, Any]:
    """Compiles so far (micro-step shapes plus the apply step), their seconds, and the seconds steps waited."""
    stats = self._compiler.stats()
    return {"compiles": stats["compiles"] + 1,
            "compile_seconds": stats["compile_seconds"] + self._apply_compile_seconds,
            "compile_wait_seconds": stats["compile_wait_seconds"],
            "compiled_micro_batch_sizes": stats["compiled_sizes"]}

  def close(self) -> None:
    """Waits for saves and compiles, and closes the metrics files."""
    self._checkpointer.close()
    self._compiler.close()
    self._data_pool.shutdown(wait=True)
    self._metrics.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


_TEXT_WIDTH = 512  # bytes per compared value in the agreement check (longer ones: a CRC prefix)
# How long a process waits at set-up for the others to reach the same point (multi-host).
AGREEMENT_TIMEOUT_SECONDS = 300.0
_agreement_rounds = itertools.count()


def _gather_texts_with_timeout(texts: list[str], what: str) -> list[list[str]]:
  """Every process's ``texts`` through jax.distributed's key-value store, waiting at most
  :data:`AGREEMENT_TIMEOUT_SECONDS` for each process (falls back to an all-gather)."""
  try:
    from jax._src import distributed  # pylint: disable=import-outside-toplevel
    client = distributed.global_state.client
  except (ImportError, AttributeError):
    client = None
  if client is None:
    return _gather_texts(texts)
  key = f"simigrad_jax/agreement/{next(_agreement_rounds)}"
  client.key_value_set(f"{key}/{jax.process_index()}", json.dumps(texts))
  gathered = []
  for process in range(jax.process_count()):
    try:
      gathered.append(json.loads(client.blocking_key_value_get(
          f"{key}/{process}", int(AGREEMENT_TIMEOUT_SECONDS * 1000))))
    except Exception as error:  # pylint: disable=broad-except  (a timeout, as the runtime reports it)
      raise ProcessDisagreementError(
          f"process {process} did not reach the Trainer's check of the {what} within "
          f"{AGREEMENT_TIMEOUT_SECONDS:g} s: it failed before it (see its log) or is far behind "
          f"({type(error).__name__}: {_first_line(error)})") from error
  return gathered


def _first_line(error: BaseException) -> str:
  return (str(error).strip().splitlines() or [""])[0][:300]


def _gather_texts(texts: list[str]) -> list[list[str]]:
  """Every process's ``texts`` (same length on all), via one all-gather of fixed-width bytes."""
  rows = np.zeros((len(texts), _TEXT_WIDTH), np.uint8)
  for i, text in enumerate(texts):
    data = text.encode()
    if len(data) > _TEXT_WIDTH:
      data = f"crc32={zlib.crc32(data):08x} ".encode() + data[:_TEXT_WIDTH - 24] + b"..."
    rows[i, :len(data)] = np.frombuffer(data, np.uint8)
  gathered = np.asarray(multihost_utils.process_allgather(rows))  # (processes, texts, width)
  return [[bytes(row).rstrip(b"\0").decode(errors="replace") for row in process]
          for process in gathered]


class _LossContractError(ValueError):
  """``loss_fn`` returned something other than per-example losses and a model state."""


def _checked_loss_fn(loss_fn: train_step.PerExampleLossFn, model_state: Any) -> train_step.PerExampleLossFn:
  """``loss_fn``, checked at trace time: one loss per row, and the model state's structure kept."""
  state_structure = jax.tree.structure(model_state)

  def checked(params, state, batch, weights, rng):
    out = loss_fn(params, state, batch, weights, rng)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
      raise _LossContractError(
          f"loss_fn must return (per_example_losses, new_model_state), got {type(out).__name__}")
    losses, new_state = out
    if jnp.shape(losses) != weights.shape:
      raise _LossContractError(
          f"loss_fn must return one loss per row, shape {weights.shape}, got shape "
          f"{jnp.shape(losses)}: the Trainer weights the rows itself (padding rows have weight "
          "0), so a mean over the rows would count padding")
    if jax.tree.structure(new_state) != state_structure:
      raise _LossContractError(
          f"loss_fn must return a model state with the structure of model_state "
          f"({state_structure}), got {jax.tree.structure(new_state)}")
    return losses, new_state

  return checked


def _skip_nonfinite(apply_step: Callable[..., Any]) -> Callable[..., Any]:
  """Wraps the apply step: a step whose gradients are not finite keeps the parameters and the
  optimizer state (all but the SimilarityState, which records the event), like
  ``optax.apply_if_finite``; the transform alone would only zero the update, and momentum, weight
  decay or Adam's count would still move."""
  finite_index = train_step.STEP_STATS.index("grads_finite")

  def apply_or_keep(params, opt_state, acc):
    new_params, new_opt_state, cleared, stats = apply_step(params, opt_state, acc)
    finite = stats[finite_index] > 0

    def keep(new, old):
      if jax.dtypes.issubdtype(new.dtype, jax.dtypes.prng_key):
        data = jnp.where(finite, jax.random.key_data(new), jax.random.key_data(old))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(new))
      return jnp.where(finite, new, old)

    def keep_state(new, old):
      if isinstance(new, SimilarityState):
        return new
      return jax.tree.map(keep, new, old)

    params = jax.tree.map(keep, new_params, params)
    opt_state = jax.tree.map(keep_state, new_opt_state, opt_state,
                             is_leaf=lambda x: isinstance(x, SimilarityState))
    return params, opt_state, cleared, stats

  return apply_or_keep


def _check_callable(name: str, fn: Any) -> None:
  if not callable(fn):
    raise ValueError(f"{name} must be callable, got {fn!r:.200} ({type(fn).__name__})")


def _check_controller(controller: Any) -> None:
  """Refuses anything without the controller interface the Trainer uses."""
  if isinstance(controller, (str, Mapping)):
    raise ValueError(
        f"controller must be a controller object, got {controller!r:.200}; build one with "
        "simigrad_jax.make_controller(name, **options) or simigrad_jax.Controller(...)")
  missing = [a for a in _CONTROLLER_ATTRIBUTES if not hasattr(controller, a)]
  if missing:
    raise ValueError(f"controller {controller!r:.200} lacks {missing}; a controller needs "
                     f"{list(_CONTROLLER_ATTRIBUTES)} (see simigrad_jax.host.controllers)")
  config = controller.config
  if not isinstance(config, Mapping) or any(k not in config for k in _CONTROLLER_CONFIG_KEYS):
    raise ValueError(f"controller.config must be a dict with the keys {list(_CONTROLLER_CONFIG_KEYS)} "
                     f"(None where one does not apply), got {config!r:.300}")
  for name in ("batch_size", "initial_batch_size"):
    validation.check_int(f"controller.{name}", getattr(controller, name), 1)


def _check_source(source: Any) -> int:
  """Refuses anything that is not a random-access source; returns its length."""
  missing = [a for a in ("__len__", "get_batch", "element_spec") if not hasattr(source, a)]
  if missing:
    raise ValueError(f"source must be a random-access source (len(), get_batch(indices), "
                     f"element_spec) such as simigrad_jax.ArraySource; {source!r:.200} lacks {missing}")
  num_examples = len(source)
  if not validation.is_int(num_examples) or num_examples < 1:
    raise ValueError(f"the source must hold at least 1 example, got len(source)={num_examples!r}")
  spec = source.element_spec
  if not isinstance(spec, Mapping) or not spec:
    raise ValueError(f"source.element_spec must be a non-empty dict of name -> (shape, dtype), "
                     f"got {spec!r:.200}")
  return int(num_examples)


def _check_devices(devices: Any) -> list[jax.Device]:
  """The training devices: all by default; an even number (two halves), each once."""
  devices = list(jax.devices() if devices is None else devices)
  if not all(isinstance(d, jax.Device) for d in devices):
    raise ValueError(f"devices must be a list of jax.Device, got {devices!r:.200}")
  if len(set(devices)) != len(devices):
    raise ValueError(f"devices must be distinct, got {devices}")
  if len(devices) < 2 or len(devices) % 2:
    raise ValueError(
        f"the Trainer splits the devices into two halves to measure the similarity: it needs an "
        f"even number of devices >= 2, got {len(devices)}")
  return devices


def _check_finite_params(params: Any) -> None:
  """Refuses initial parameters with NaN or infinite entries (every step would be skipped)."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  if not leaves:
    raise ValueError("params holds no arrays: there is nothing to train")
  inexact = [(path, leaf) for path, leaf in leaves
             if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]
  finite = np.asarray(_all_finite([leaf for _, leaf in inexact])) if inexact else []
  for (path, _), ok in zip(inexact, finite):
    if not ok:
      raise ValueError(f"params{jax.tree_util.keystr(path)} holds NaN or infinite values: every "
                       "step would be skipped; initialise the model with finite values")


@jax.jit
def _all_finite(leaves: list[jax.Array]) -> jax.Array:
  """One bool per leaf: all its entries are finite (one compiled call for the whole tree)."""
  return jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves])


def _profile_sizes(controller: Any) -> list[int]:
  """The batch sizes a controller's pending profile will visit (SimiGrad's Controller)."""
  try:
    plan = controller.state_dict().get("profile_plan")
  except Exception:  # pylint: disable=broad-except  (not every controller has one)
    return []
  return [int(b) for b in plan["sizes"]] if isinstance(plan, Mapping) and plan.get("sizes") else []


def _check_bounds(controller: Any, num_devices: int, num_examples: int) -> tuple[int, int]:
  """The smallest and largest global batch sizes of the run, after checking them.

  Refuses sizes the data set cannot fill, an adaptive controller without an
  upper bound, and, for a controller that needs the similarity, sizes so small
  that the second device half holds no example (the similarity is then never
  measured and the size never moves again).
  """
  config = controller.config
  lower, upper = config["batch_size_lower_bound"], config["batch_size_upper_bound"]
  adapting = config.get("enable_adjust", True) is not False
  profile = _profile_sizes(controller)
  sizes = [controller.batch_size, controller.initial_batch_size, *profile]
  if upper is None and adapting:
    raise ValueError(
        f"batch_size_upper_bound=None lets the controller grow the global batch without limit, "
        f"past the data set's {num_examples} examples (a step would repeat examples); set "
        f"batch_size_upper_bound to at most {num_examples}")
  largest = max(sizes + ([upper] if upper is not None else []))
  if largest > num_examples:
    what = "batch_size_upper_bound" if largest == upper else "the controller's batch size"
    raise ValueError(
        f"the data set has {num_examples} examples, fewer than the largest batch size {largest} "
        f"({what}): a step would repeat examples; lower the bound")
  # Example e of a step goes to device e % n, and the halves are the even and the odd
  # devices: a batch of 1 leaves the second half without an example.
  floor = 2
  if config["similarity_target"] is not None:
    smallest = min([lower if lower is not None else 1] if adapting else sizes)
    smallest = min([smallest] + profile)
    if smallest < floor:
      what = (f"batch_sizes_to_profile holds {min(profile)}" if profile and min(profile) == smallest
              else f"batch_size_lower_bound={lower!r} lets the global batch shrink to {smallest}"
              if adapting else f"the batch size is {smallest}")
      if adapting or profile:
        raise ValueError(
            f"{what}, but a batch below {floor} leaves the odd devices (the second half) "
            f"without an example: the similarity cannot be measured and the batch size would "
            f"stay there; use sizes >= {floor} (set batch_size_lower_bound >= {floor})")
  return (lower if lower is not None else 1), largest


def _gather_rows(array: np.ndarray, take: np.ndarray, real: np.ndarray) -> np.ndarray:
  """``array[take]`` where ``real``, zero rows elsewhere (padding)."""
  out = np.zeros((len(take),) + array.shape[1:], array.dtype)
  out[real] = array[take[real]]
  return out


def _host_copy(tree: Any) -> Any:
  """A NumPy copy of a replicated tree, read from this process's first device."""
  return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


def _abstract(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _local_device_positions(devices: list[jax.Device]) -> np.ndarray:
  """Positions in the mesh of this process's devices (they must be contiguous)."""
  positions = np.array([i for i, d in enumerate(devices) if d.process_index == jax.process_index()])
  if positions.size == 0:
    raise ValueError("none of the training devices belongs to this process")
  if np.any(np.diff(positions) != 1):
    raise ValueError(f"this process's devices sit at mesh positions {positions.tolist()}; "
                     "they must be contiguous (order the devices by process)")
  return positions
