"""The loops and models that ``benchmarks/trainer_overhead/overhead.py`` times side by side.

A user's own ``jax.pmap`` loop (:class:`PmapLoop`, with ``lax.pmean`` or
:func:`simigrad_jax.transform`) and :class:`simigrad_jax.Trainer`
(:class:`TrainerLoop`), on the same models (:data:`FULL_MODELS`,
:data:`QUICK_MODELS`) and the same random data. Each loop has
``warm_up(steps)``, ``run(steps) -> (examples, seconds)``, ``details()`` and
``close()``. Import it after the devices are set up (it imports JAX).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import threading
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import simigrad_jax
from simigrad_jax.data import EpochSampler
from train import models

AXIS = "batch"
NUM_CLASSES = 10
LEARNING_RATE = 0.05
SEED = 0
# The compiled step's memory: XLA's argument and temporary bytes, and its memory traffic.
MEMORY_KEYS = ("argument_bytes", "temp_bytes", "bytes_accessed")
WAIT_FOR_SHAPES = simigrad_jax.CompileConfig(fallback=False)
""":class:`TrainerLoop`'s compile settings unless given: only warm-up steps can find their
shape still compiling (the timed ones start after every shape compiled), and they wait for it
rather than accumulate on a smaller one."""


def thread_cpu_seconds() -> dict[Any, float] | None:
  """The process's CPU seconds so far: under ``"process"``, all its threads'; under each live
  Python thread (the :class:`threading.Thread`, so that a later thread that reuses its id is
  another key), that thread's: the host's side, the main, data and compile threads. The rest
  are XLA's (on CPU, the simulated devices'). None where threads have no CPU clock (not Linux)."""
  if not hasattr(time, "pthread_getcpuclockid"):
    return None
  seconds: dict[Any, float] = {"process": time.process_time()}
  for thread in threading.enumerate():
    if thread.ident is not None:
      try:
        seconds[thread] = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
      except OSError:  # it ended meanwhile
        pass
  return seconds


def cpu_split(before: dict[Any, float] | None, after: dict[Any, float] | None) -> dict[str, float]:
  """The CPU seconds between two :func:`thread_cpu_seconds`: Python threads' (a thread that
  started meanwhile counts whole; one that ended is lost) and the rest's."""
  if before is None or after is None:
    return {"python_threads": math.nan, "other_threads": math.nan}
  python = sum(
    seconds - before.get(thread, 0.0) for thread, seconds in after.items() if thread != "process"
  )
  return {
    "python_threads": python,
    "other_threads": after["process"] - before["process"] - python,
  }


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A model of the benchmark and the shape of one input example."""

  description: str
  build: Callable[[], nn.Module]
  input_shape: tuple[int, ...]
  batch_norm: bool = False


def _resnet(filters: int, stages: tuple[int, ...]) -> nn.Module:
  return models.ResNet(
    stage_sizes=stages,
    block_cls=models.ResNetBlock,
    num_classes=NUM_CLASSES,
    num_filters=filters,
    stem="cifar",
  )


FULL_MODELS = {
  "mlp": ModelSpec(
    "MLP 784-1024-1024-10", lambda: models.MLP(NUM_CLASSES, hidden=(1024, 1024)), (784,)
  ),
  "resnet": ModelSpec(
    "ResNet (CIFAR stem, 8 filters, blocks 1-1-1-1), 32x32x3",
    lambda: _resnet(8, (1, 1, 1, 1)),
    (32, 32, 3),
    batch_norm=True,
  ),
}
QUICK_MODELS = {
  "mlp": ModelSpec("MLP 64-32-10", lambda: models.MLP(NUM_CLASSES, hidden=(32,)), (64,)),
  "resnet": ModelSpec(
    "ResNet (CIFAR stem, 4 filters, blocks 1-1), 8x8x3",
    lambda: _resnet(4, (1, 1)),
    (8, 8, 3),
    batch_norm=True,
  ),
}


# ----------------------------------------------------------------------------
# Model, loss and data, shared by every variant.
# ----------------------------------------------------------------------------


def make_data(spec: ModelSpec, num_examples: int, seed: int = SEED) -> dict[str, np.ndarray]:
  """Standard normal inputs, labelled by the argmax of a random linear teacher."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((num_examples,) + spec.input_shape, dtype=np.float32)
  teacher = rng.standard_normal((int(np.prod(spec.input_shape)), NUM_CLASSES), dtype=np.float32)
  y = (x.reshape(num_examples, -1) @ teacher).argmax(-1).astype(np.int32)
  return {"x": x, "y": y}


def init_model(spec: ModelSpec, seed: int = SEED) -> tuple[Any, Any]:
  """``(params, model_state)`` as NumPy arrays; ``model_state`` is None without BatchNorm."""
  variables = spec.build().init(jax.random.key(seed), np.zeros((1,) + spec.input_shape, np.float32))
  variables = jax.tree.map(np.asarray, variables)
  model_state = {"batch_stats": variables["batch_stats"]} if spec.batch_norm else None
  return variables["params"], model_state


def per_example_losses(
  model: nn.Module,
  params: Any,
  model_state: Any,
  x: jax.Array,
  y: jax.Array,
  mask: jax.Array | None = None,
) -> tuple[jax.Array, Any]:
  """Cross-entropy per example and the new model state (BatchNorm statistics, if any)."""
  if model_state is None:
    logits = model.apply({"params": params}, x)
  else:
    logits, model_state = model.apply(
      {"params": params, **model_state}, x, train=True, mask=mask, mutable=["batch_stats"]
    )
  return optax.softmax_cross_entropy_with_integer_labels(logits, y), model_state


def make_trainer_loss_fn(model: nn.Module) -> Callable[..., tuple[jax.Array, Any]]:
  """The Trainer's ``loss_fn``: padding rows (weight 0) are masked out of BatchNorm."""

  def loss_fn(params, model_state, batch, weights, rng):
    del rng
    return per_example_losses(model, params, model_state, batch["x"], batch["y"], weights > 0)

  return loss_fn


def count_params(params: Any) -> int:
  return int(sum(np.size(leaf) for leaf in jax.tree.leaves(params)))


# ----------------------------------------------------------------------------
# The variants. Each has run(steps) -> (examples, seconds) and details() -> dict.
# ----------------------------------------------------------------------------


def _replicate(tree: Any, n: int) -> Any:
  return jax.tree.map(lambda a: np.broadcast_to(a, (n,) + np.shape(a)).copy(), tree)


@jax.jit
def _copy(tree: Any) -> Any:
  return jax.tree.map(jnp.copy, tree)


def _similarity_state(opt_state: Any) -> Any:
  """A copy of the step's SimilarityState (one small dispatch): the optimizer state itself is
  donated to the next step."""
  return _copy(optax.tree_utils.tree_get(opt_state, simigrad_jax.SimilarityState.__name__))


class PmapLoop:
  """A user's own ``jax.pmap`` loop: ``pmean`` (plain) or ``simigrad_jax.transform``.

  Args:
    spec: the model.
    data: the arrays every variant reads.
    batch_size: the global batch size (a multiple of the device count).
    use_transform: chain ``simigrad_jax.transform`` instead of ``lax.pmean``,
      and read the similarity on the host after every step.
    read_late: read each step's similarity after dispatching the next step
      (default: before).
    read_loss: without the transform, read each step's loss on the host where
      the transform loop reads the similarity.
  """

  def __init__(
    self,
    spec: ModelSpec,
    data: dict[str, np.ndarray],
    batch_size: int,
    use_transform: bool,
    read_late: bool = False,
    read_loss: bool = False,
  ):
    self._data, self._batch_size = data, batch_size
    self._use_transform, self._read_late, self._read_loss = use_transform, read_late, read_loss
    self._n = jax.local_device_count()
    model = spec.build()
    if use_transform:
      optimizer = optax.chain(simigrad_jax.transform(AXIS), optax.sgd(LEARNING_RATE))
    else:
      optimizer = optax.sgd(LEARNING_RATE)

    def step(params, model_state, opt_state, x, y):

      def mean_loss(p):
        losses, new_state = per_example_losses(model, p, model_state, x, y)
        return losses.mean(), new_state

      (loss, new_state), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
      if not use_transform:
        grads = lax.pmean(grads, AXIS)
      new_state = lax.pmean(new_state, AXIS)  # BatchNorm statistics, as the Trainer does
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), new_state, opt_state, lax.pmean(loss, AXIS)

    self._step = jax.pmap(step, axis_name=AXIS, donate_argnums=(0, 1, 2))
    # A batch with a leading device axis, one slice per device, as pmap takes it.
    self._sharding = jax.sharding.NamedSharding(
      jax.sharding.Mesh(np.array(jax.local_devices()), (AXIS,)), jax.sharding.PartitionSpec(AXIS)
    )
    params, model_state = init_model(spec)
    self._state = _replicate((params, model_state, optimizer.init(params)), self._n)
    self._sampler = EpochSampler(len(data["y"]), SEED)
    self.last_similarity = math.nan
    self.last_loss = math.nan

  def _next_batch(self, advance: bool = True) -> tuple[jax.Array, jax.Array]:
    """The next rows, gathered on the host and sent to the devices (asynchronously)."""
    rows = (self._sampler.take if advance else self._sampler.peek)(self._batch_size)
    return tuple(
      jax.device_put(a[rows].reshape((self._n, -1) + a.shape[1:]), self._sharding)
      for a in (self._data["x"], self._data["y"])
    )

  def memory(self) -> dict[str, int]:
    """The compiled step's argument and temporary bytes, and the bytes it accesses.

    From XLA's ``memory_analysis()`` (``argument_size_in_bytes``,
    ``temp_size_in_bytes``) and ``cost_analysis()`` (``bytes accessed``: the
    memory traffic, which memory-bound work on an accelerator scales with).
    """
    compiled = self._step.lower(*self._state, *self._next_batch(False)).compile()
    analysis = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {
      "argument_bytes": int(analysis.argument_size_in_bytes),
      "temp_bytes": int(analysis.temp_size_in_bytes),
      "bytes_accessed": int(cost.get("bytes accessed", 0)),
    }

  def warm_up(self, steps: int) -> None:
    """Compiles the step and runs ``steps`` steps, untimed."""
    self.run(steps)

  def run(self, steps: int) -> tuple[int, float]:
    """Runs ``steps`` optimizer steps; returns (examples, seconds until the last finished)."""
    start = time.perf_counter()
    loss = None
    batch = self._next_batch()
    previous_state = None
    for i in range(steps):
      params, model_state, opt_state, loss = self._step(*self._state, *batch)
      self._state = (params, model_state, opt_state)
      if self._use_transform and self._read_late and previous_state is not None:
        self.last_similarity = simigrad_jax.similarity(previous_state)  # the step before
      if i + 1 < steps:
        batch = self._next_batch()  # host work while the devices compute the step
      if self._use_transform and not self._read_late:
        self.last_similarity = simigrad_jax.similarity(opt_state)
      if self._read_loss:
        self.last_loss = float(np.asarray(loss.addressable_data(0)).reshape(-1)[0])
      previous_state = _similarity_state(opt_state) if self._read_late else None
    if self._use_transform and self._read_late:
      self.last_similarity = simigrad_jax.similarity(opt_state)
    jax.block_until_ready((self._state, loss))
    return steps * self._batch_size, time.perf_counter() - start

  def details(self) -> dict[str, Any]:
    return {"average_batch_size": float(self._batch_size), "step_memory": self.memory()}

  def close(self) -> None:
    pass


def trainer_controller(
  batch_size: int, adaptive: bool, similarity_target: float
) -> simigrad_jax.Controller:
  """SimiGrad's controller from ``batch_size``: adapting within [batch / 4, 4 x batch] (at least
  one example per device), or held there."""
  if adaptive:
    return simigrad_jax.Controller(
      batch_size,
      similarity_target,
      batch_size_lower_bound=max(batch_size // 4, jax.device_count()),
      batch_size_upper_bound=4 * batch_size,
    )
  return simigrad_jax.Controller(
    batch_size,
    similarity_target,
    batch_size_lower_bound=batch_size,
    batch_size_upper_bound=batch_size,
    enable_adjust=False,
  )


class TrainerLoop:
  """:class:`simigrad_jax.Trainer` on the same model and data, timed per ``train()`` call.

  Args:
    spec: the model.
    data: the arrays every variant reads.
    batch_size: the initial (and, unless ``adaptive``, fixed) global batch size.
    adaptive: adapt the batch within [batch / 4, 4 x batch] with SimiGrad's rule.
    similarity_target: the adaptive controller's target.
    workdir: a fresh directory for the Trainer's metrics and checkpoints.
    max_micro_batch_size: the rows per device per micro-step (default
      ``batch_size // devices``).
    controller: optional: the batch-size controller, in place of the one
      ``batch_size`` and ``adaptive`` make (e.g. a replay of a run's sizes).
    compile: the Trainer's compile settings (``TrainerConfig.compile``: the grid's
      ``shapes_per_octave``, the ``cache_dir``, ...); by default
      :data:`WAIT_FOR_SHAPES`.
  """

  def __init__(
    self,
    spec: ModelSpec,
    data: dict[str, np.ndarray],
    batch_size: int,
    adaptive: bool,
    similarity_target: float,
    workdir: pathlib.Path,
    max_micro_batch_size: int | None = None,
    controller: simigrad_jax.controllers.BatchSizeController | None = None,
    compile: simigrad_jax.CompileConfig = WAIT_FOR_SHAPES,
  ):
    n = jax.device_count()
    max_micro = max_micro_batch_size or batch_size // n
    if controller is None:
      controller = trainer_controller(batch_size, adaptive, similarity_target)
    params, model_state = init_model(spec)
    self.workdir = workdir
    self.trainer = simigrad_jax.Trainer(
      loss_fn=make_trainer_loss_fn(spec.build()),
      params=params,
      model_state=model_state,
      optimizer=optax.chain(
        simigrad_jax.transform(AXIS), optax.sgd(LEARNING_RATE), simigrad_jax.scale_by_lr_factor()
      ),
      source=simigrad_jax.ArraySource(data),
      controller=controller,
      workdir=workdir,
      config=simigrad_jax.TrainerConfig(
        max_micro_batch_size=max_micro,
        seed=SEED,
        tensorboard=True,
        progress=False,
        axis_name=AXIS,
        compile=compile,
      ),
    )
    # train() ends with a checkpoint save: mark when the step loop is over (and the CPU used).
    self._save_calls: list[float] = []
    self._save_cpu: list[dict[Any, float] | None] = []
    save = self.trainer.save_checkpoint

    def marked_save() -> None:
      self._save_calls.append(time.perf_counter())
      self._save_cpu.append(thread_cpu_seconds())
      save()

    self.trainer.save_checkpoint = marked_save
    self.checkpoint_seconds: list[float] = []
    self.timed_steps: list[tuple[int, int]] = []  # (first, last) step of each timed window
    self.cpu_seconds = {"python_threads": 0.0, "other_threads": 0.0}  # the timed windows'

  def wait_for_compiles(self, timeout: float = 600.0) -> None:
    """Blocks until every shape the controller's bounds can reach is compiled."""
    deadline = time.perf_counter() + timeout
    while not set(self.trainer.shapes) <= set(
      self.trainer.compile_stats()["compiled_micro_batch_sizes"]
    ):
      if time.perf_counter() > deadline:
        raise TimeoutError(
          f"the Trainer's shapes {self.trainer.shapes} did not compile within {timeout} s"
        )
      time.sleep(0.05)

  def warm_up(self, steps: int) -> None:
    """Trains ``steps`` steps, untimed, and waits until every reachable shape is compiled."""
    self.trainer.train(num_steps=self.trainer.step + steps)
    self.wait_for_compiles()

  def run(self, steps: int) -> tuple[int, float]:
    """Trains ``steps`` more steps; returns (examples, seconds up to the final save)."""
    first = self.trainer.step + 1
    calls_before = len(self._save_calls)
    cpu_start = thread_cpu_seconds()
    start = time.perf_counter()
    summary = self.trainer.train(num_steps=self.trainer.step + steps)
    end = time.perf_counter()
    saved = len(self._save_calls) > calls_before
    loop_end = self._save_calls[-1] if saved else end
    cpu_end = self._save_cpu[-1] if saved else thread_cpu_seconds()
    for key, seconds in cpu_split(cpu_start, cpu_end).items():
      self.cpu_seconds[key] += seconds
    self.checkpoint_seconds.append(end - loop_end)
    self.timed_steps.append((first, self.trainer.step))
    return int(summary["run_examples"]), loop_end - start

  def timed_records(self) -> list[dict[str, Any]]:
    """The step records of the timed windows."""
    return [
      r
      for r in simigrad_jax.read_metrics(self.workdir / "metrics.jsonl")
      if "batch_size" in r and any(a <= r["step"] <= b for a, b in self.timed_steps)
    ]

  def details(self) -> dict[str, Any]:
    """Numbers from the timed windows' step records and the Trainer's own reports."""
    records = self.timed_records()
    critical = [r.get("host_seconds") for r in records]
    critical = [c for c in critical if c is not None]
    step_memory = getattr(self.trainer, "step_memory", None)
    memory = None
    if step_memory is not None:
      reported = step_memory()
      memory = {key: reported.get(key) for key in MEMORY_KEYS}
    examples = sum(r["batch_size"] for r in records)
    later = [r for r in records if not r["first_run"]]
    return {
      "average_batch_size": examples / len(records),
      "average_accumulation_steps": float(np.mean([r["accumulation_steps"] for r in records])),
      "padding_fraction": sum(r["padded_examples"] for r in records)
      / (examples + sum(r["padded_examples"] for r in records)),
      "host_seconds": float(np.median(critical)) if critical else None,
      "record_step_seconds": float(np.median([r["step_seconds"] for r in records])),
      "record_data_seconds": float(np.median([r["data_seconds"] for r in records])),
      "checkpoint_seconds": float(np.median(self.checkpoint_seconds)),
      "compile_fallback_steps": int(sum(bool(r.get("compile_fallback")) for r in records)),
      "first_run_steps": len(records) - len(later),
      # The records' examples over their step seconds, without the steps that ran a program
      # for the first time (a one-off per shape; None if every step did).
      "examples_per_second_without_first_runs": (
        sum(r["batch_size"] for r in later) / sum(r["step_seconds"] for r in later)
        if later
        else None
      ),
      "nonfinite_steps": int(sum(not r["grads_finite"] for r in records)),
      "timed_steps": len(records),
      # CPU seconds a step in the timed windows, up to their saves: the Python threads' (the
      # host's work) and the rest's (XLA's; on CPU the simulated devices' compute).
      "cpu_seconds_per_step": {
        key: seconds / len(records) for key, seconds in self.cpu_seconds.items()
      },
      "rows_computed": examples + sum(r["padded_examples"] for r in records),
      "step_memory": memory,
    }

  def close(self) -> None:
    self.trainer.close()
