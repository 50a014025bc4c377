"""simigrad-jax: adaptive batch-size training for JAX (SimiGrad).

The top level holds the names a user types (``__all__``); everything else is
imported from its room (below).

Your own step:
  transform: the optax transformation for your own pmap / shard_map / jit
    step; it replaces ``lax.pmean(grads)`` and measures the similarity of the
    two halves' gradients (SimilarityState). value_and_half_grads takes the
    two halves' gradients of each device's rows (a HalfGrads);
    device_halves_step builds a plain-jit step on a mesh whose halves are the
    data axis's even and odd devices; with Flax NNX, nnx_value_and_half_grads
    and set_nnx_lr_factor (flax imported when called).
  scale_by_lr_factor, set_lr_factor, lr_factor: the learning rate follows the
    batch size without recompiling (lr_factor_of reads the factor back);
    couple_to_batch_size, set_coupled_batch_size: Adam's beta2 and weight
    decay follow it too.
  similarity, similarity_stats: read the step's similarity on the host.
  AdaptiveStep: an own loop's step at whatever batch size the controller asks
    for, on a few compiled shapes (padding rows of weight 0), exactly the
    numbers of a plain value_and_half_grads step of the same batch.
Controllers:
  Controller: SimiGrad's rule from similarity to the next global batch size;
    make_controller(name, ...) builds it and the others by name
    (controller_names; register_controller for your own; simigrad_jax.registry
    lists the built-in ones and each one's options). Every controller has the
    BatchSizeController interface; a new one derives from BaseController
    (docs/controllers.md).
The Trainer:
  Trainer: the training engine (compiled shapes, data placement, metrics,
    checkpoints, multi-host agreement) over a source: ArraySource, TfdsSource,
    GrainSource (grain-style data decoded ahead in worker processes). Its
    settings are one TrainerConfig, with its groups CompileConfig,
    CheckpointConfig and LearningRateConfig; every step gives a typed StepRecord to
    its hooks (StepHook: metrics, progress, evaluation, checkpoints, yours);
    read_metrics reads a run's metrics.jsonl. A SIGTERM or SIGINT saves a
    checkpoint and raises Preempted. simulated_cpu_devices_env: the
    environment for simulated CPU devices (set before JAX starts).
Errors: every one derives from SimiGradError and keeps its built-in parent
  (ValueError or RuntimeError); each is imported from its room
  (simigrad_jax.errors lists where).

The rooms, each documenting its API in its ``__init__``:
  simigrad_jax.ingraph (runs under jit: the transform, the half gradients, the
    learning-rate and Adam coupling states, StackedGrads),
  simigrad_jax.reductions (the collectives behind the transform),
  simigrad_jax.controllers (OneStepLateController, ProfilingController, ...),
  simigrad_jax.ramps (batch-size ramps without feedback, replay_schedule,
    replay_controller),
  simigrad_jax.registry (the controllers by name: controller_options, the
    built-in table),
  simigrad_jax.shapes (plan_batch, BucketPolicy, bucket_shapes, ...),
  simigrad_jax.data (EpochSampler, deal_to_devices, ...),
  simigrad_jax.checkpoint (Checkpointer),
  simigrad_jax.compile (StepCompiler, enable_persistent_cache,
    persistent_cache_settings),
  simigrad_jax.multihost (the processes' agreement, the workdir's lock),
  simigrad_jax.trainer (MetricsWriter, ProgressBar, ...),
  simigrad_jax.cluster_time (training time against cluster size and bandwidth).
"""

from simigrad_jax.controllers.base import BaseController
from simigrad_jax.controllers.interface import BatchSizeController
from simigrad_jax.controllers.learning_rate import lr_factor
from simigrad_jax.controllers.simigrad import Controller
from simigrad_jax.data.grain_source import GrainSource
from simigrad_jax.data.sources import ArraySource
from simigrad_jax.data.sources import TfdsSource
from simigrad_jax.errors import SimiGradError
from simigrad_jax.flax_nnx import nnx_value_and_half_grads
from simigrad_jax.flax_nnx import set_nnx_lr_factor
from simigrad_jax.ingraph.batch_coupling import couple_to_batch_size
from simigrad_jax.ingraph.device_halves_step import device_halves_step
from simigrad_jax.ingraph.half_batch import value_and_half_grads
from simigrad_jax.ingraph.lr_scaling import scale_by_lr_factor
from simigrad_jax.ingraph.transform import HalfGrads
from simigrad_jax.ingraph.transform import SimilarityState
from simigrad_jax.ingraph.transform import transform
from simigrad_jax.multihost.cpu_devices import simulated_cpu_devices_env
from simigrad_jax.multihost.preemption import Preempted
from simigrad_jax.optimizer_state import lr_factor_of
from simigrad_jax.optimizer_state import set_coupled_batch_size
from simigrad_jax.optimizer_state import set_lr_factor
from simigrad_jax.optimizer_state import similarity
from simigrad_jax.optimizer_state import similarity_stats
from simigrad_jax.registry import controller_names
from simigrad_jax.registry import make_controller
from simigrad_jax.registry import register_controller
from simigrad_jax.trainer.adaptive_step import AdaptiveStep
from simigrad_jax.trainer.config import CheckpointConfig
from simigrad_jax.trainer.config import CompileConfig
from simigrad_jax.trainer.config import LearningRateConfig
from simigrad_jax.trainer.config import TrainerConfig
from simigrad_jax.trainer.hooks import StepHook
from simigrad_jax.trainer.metrics import read_metrics
from simigrad_jax.trainer.step_record import StepRecord
from simigrad_jax.trainer.trainer import Trainer

__version__ = "0.3.0"

__all__ = [
  "AdaptiveStep",
  "ArraySource",
  "BaseController",
  "BatchSizeController",
  "CheckpointConfig",
  "CompileConfig",
  "Controller",
  "GrainSource",
  "HalfGrads",
  "LearningRateConfig",
  "Preempted",
  "SimiGradError",
  "SimilarityState",
  "StepHook",
  "StepRecord",
  "TfdsSource",
  "Trainer",
  "TrainerConfig",
  "controller_names",
  "couple_to_batch_size",
  "device_halves_step",
  "lr_factor",
  "lr_factor_of",
  "make_controller",
  "nnx_value_and_half_grads",
  "read_metrics",
  "register_controller",
  "scale_by_lr_factor",
  "set_coupled_batch_size",
  "set_lr_factor",
  "set_nnx_lr_factor",
  "similarity",
  "similarity_stats",
  "simulated_cpu_devices_env",
  "transform",
  "value_and_half_grads",
]
