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
import math
import os
import pathlib
import time
from typing import Any, Callable, Literal, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from simigrad_jax.host import batch_plan
from simigrad_jax.host import lr_rules
from simigrad_jax.host import state_access
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

Mode = Literal["recompile", "pad"]
MODES: tuple[str, ...] = ("recompile", "pad")


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
    compilation_cache_dir: optional persistent compilation cache directory.
    tensorboard: also write TensorBoard event files.
    progress: show a progress bar (process 0 only).
    axis_name: the data-parallel axis name used by the transform.
    devices: the devices to train on (default: all, over every process).

  Example:
    >>> trainer = simigrad_jax.Trainer(loss_fn=loss_fn, params=params,  # doctest: +SKIP
    ...     optimizer=optimizer, source=simigrad_jax.ArraySource({"x": x, "y": y}),
    ...     controller=simigrad_jax.Controller(64, 0.1), workdir="/tmp/run",
    ...     max_micro_batch_size=32)
    >>> summary = trainer.train(num_epochs=3)  # doctest: +SKIP
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
      compilation_cache_dir: str | os.PathLike | None = None,
      tensorboard: bool = True,
      progress: bool = True,
      axis_name: str = "batch",
      devices: list[jax.Device] | None = None,
  ):
    if mode not in MODES:
      raise ValueError(f"mode={mode!r} is not valid; choose one of {MODES}")
    if lr_rule not in lr_rules.LR_RULES:
      raise ValueError(f"lr_rule={lr_rule!r} is not valid; choose one of {lr_rules.LR_RULES}")
    workdir = pathlib.Path(workdir).absolute()
    if not workdir.parent.is_dir():
      raise ValueError(f"the workdir's parent {str(workdir.parent)!r} does not exist")
    workdir.mkdir(exist_ok=True)
    self.workdir = workdir
    self.loss_fn, self.optimizer, self.source, self.controller = loss_fn, optimizer, source, controller
    self.mode, self.lr_rule, self.lr_adjust_factor = mode, lr_rule, lr_adjust_factor
    self.seed, self.eval_fn, self.axis_name = seed, eval_fn, axis_name
    self.lr_schedule = lr_schedule
    self.checkpoint_every_steps = checkpoint_every_steps
    self.base_batch_size = controller.initial_batch_size

    devices = list(jax.devices() if devices is None else devices)
    self.mesh = Mesh(np.array(devices), (axis_name,))
    self.num_devices = len(devices)
    self._local_positions = _local_device_positions(devices)
    self._replicated = NamedSharding(self.mesh, P())
    self._sharded = NamedSharding(self.mesh, P(axis_name))

    self.lower = controller.config["batch_size_lower_bound"] or 1
    self.upper = controller.config["batch_size_upper_bound"]
    num_examples = len(source)
    largest = self.upper if self.upper is not None else controller.batch_size
    if largest > num_examples:
      raise ValueError(
          f"the data set has {num_examples} examples, fewer than the largest batch size "
          f"{largest} (batch_size_upper_bound): a step would repeat examples; lower the bound")
    max_micro = int(max_micro_batch_size)
    if mode == "pad":
      self.policy = batch_plan.BucketPolicy(max_micro, max_micro, padding=True)
    else:
      grid = batch_plan.BucketPolicy(max_micro, min_micro_batch_size or 1, padding=True)
      shape_upper = self.upper if self.upper is not None else num_examples
      needed = batch_plan.bucket_shapes(grid, self.num_devices, self.lower, shape_upper)
      # Smaller requests (the last step of a run) pad up to the smallest needed shape.
      self.policy = batch_plan.BucketPolicy(max_micro, min(needed), padding=True)
    self.shapes = self.policy.micro_batch_sizes()

    probe_state = optimizer.init(params)
    for state_type, name in ((SimilarityState, "simigrad_jax.transform"),
                             (LrFactorState, "simigrad_jax.scale_by_lr_factor()")):
      if not optax.tree_utils.tree_get_all_with_path(probe_state, state_type.__name__):
        raise ValueError(f"the optimizer has no {state_type.__name__}: chain {name} into it")

    self.sampler = EpochSampler(num_examples, seed)
    self.state = jax.device_put(
        {"params": params, "opt_state": probe_state, "model_state": model_state}, self._replicated)
    self.step = 0
    self._nonfinite_steps = 0
    self._checkpointer = Checkpointer(workdir / "checkpoints", max_to_keep=max_checkpoints)
    self._resume()

    if compilation_cache_dir is not None:
      enable_persistent_cache(compilation_cache_dir)
    self._acc = train_step.zero_accumulator(params, self.mesh, axis_name)
    micro = jax.jit(train_step.make_micro_step(loss_fn, self.mesh, axis_name, seed),
                    donate_argnums=(2,))
    self._compiler = StepCompiler(lambda m: micro.lower(*self._abstract_micro_args(m)),
                                  background=background_compile, name="micro_step")
    apply = jax.jit(train_step.make_apply_step(optimizer, self.mesh, axis_name),
                    donate_argnums=(0, 1, 2))
    start = time.perf_counter()
    self._apply = apply.lower(*_abstract(
        (self.state["params"], self.state["opt_state"], self._acc))).compile()
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
    if self._checkpointer.latest_step() is None:
      return
    state, host, step = self._checkpointer.restore(self.state)
    self.state = state
    self.controller.load_state_dict(host["controller"])
    self.sampler.load_state_dict(host["sampler"])
    self.step = int(host["step"])
    self._nonfinite_steps = int(host.get("nonfinite_steps", 0))
    if host.get("seed") != self.seed:
      raise ValueError(f"the checkpoint at step {step} was made with seed={host.get('seed')}, "
                       f"this run has seed={self.seed}")

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
      size, last loss and similarity, the compile and data timings, and the
      last evaluation (if any).
    """
    if num_epochs is None and num_steps is None:
      raise ValueError("give num_epochs or num_steps")
    total_examples = (math.inf if num_epochs is None
                      else int(round(num_epochs * self.sampler.num_examples)))
    max_steps = math.inf if num_steps is None else int(num_steps)
    self._set_lr_factor(self.controller.batch_size)
    self._compiler.prefetch(self._shapes_by_distance(self.controller.batch_size))
    progress = ProgressBar(
        total_examples if math.isfinite(total_examples) else 0,
        initial=min(self.sampler.examples_seen, total_examples) if math.isfinite(total_examples) else 0,
        enabled=self._progress_enabled)
    run = {"examples": 0, "steps": 0, "wall": 0.0, "data": 0.0, "last": {}, "eval": {}}
    next_data = self._submit_data(self.controller.batch_size, total_examples)
    try:
      while self.step < max_steps and self.sampler.examples_seen < total_examples:
        record, next_data = self._train_one_step(next_data, total_examples)
        run["examples"] += record["batch_size"]
        run["steps"] += 1
        run["wall"] += record["step_seconds"]
        run["data"] += record["data_seconds"]
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
        "wall_seconds": run["wall"], "data_seconds": run["data"], **compile_stats,
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
    plan = self._plan(batch_size, None)
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
    self._set_lr_factor(next_batch_size)

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

  def _set_lr_factor(self, batch_size: int) -> None:
    """Writes the learning-rate factor for ``batch_size`` at the current progress into the state."""
    epochs = self.sampler.examples_seen / self.sampler.num_examples
    self._schedule_factor = 1.0 if self.lr_schedule is None else float(self.lr_schedule(epochs))
    factor = lr_rules.lr_factor(batch_size, self.base_batch_size, self.lr_rule,
                                self.lr_adjust_factor) * self._schedule_factor
    if not math.isfinite(factor) or factor <= 0:
      raise ValueError(f"the learning-rate factor at epoch {epochs:.3f} would be {factor} "
                       f"(schedule {self._schedule_factor}); it must be finite and > 0")
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
