"""simigrad-jax: adaptive batch-size training for JAX (SimiGrad).

Start here:
  transform: the optax transformation for your own pmap / shard_map / jit
    step; it replaces ``lax.pmean(grads)`` and measures the similarity of the
    two halves' gradients (SimilarityState).
  scale_by_lr_factor, set_lr_factor: the learning rate follows the batch size
    without recompiling (LrFactorState, lr_factor, lr_factor_of);
    couple_to_batch_size, set_coupled_batch_size: Adam's beta2 and weight
    decay follow it too (BatchCouplingState).
  similarity, similarity_stats: read the step's similarity on the host.
  Controller: SimiGrad's rule from similarity to the next global batch size;
    make_controller(name, ...) builds the others (controller_names,
    controller_options, register_controller for your own). Every controller
    has the BatchSizeController interface; a new one derives from
    BaseController (docs/controllers.md); ProfilingController records a
    similarity-versus-batch-size profile around any controller;
    OneStepLateController makes any controller's decisions take effect a
    step later (each step's size known a step ahead); replay_schedule,
    replay_controller: a run's realised sizes as a step schedule, replayed
    (python -m simigrad_jax.replay metrics.jsonl).
  Trainer: the training engine (compiled shapes, data placement, metrics,
    checkpoints, multi-host agreement) over a source: ArraySource, TfdsSource,
    GrainSource (grain-style data decoded ahead in worker processes). Its
    settings are one TrainerConfig; every step gives a typed StepRecord to
    its hooks (StepHook: metrics, progress, evaluation, checkpoints, yours).
    A SIGTERM or SIGINT saves a checkpoint and raises Preempted.

Realising a batch size on the devices (host side):
  plan_batch, BatchPlan, BucketPolicy, bucket_shapes, representable_batch_sizes.
Your own step, in-graph: value_and_half_grads, HalfGrads; device_halves_step
  (a plain-jit step on a mesh whose halves are the data axis's even and odd
  devices; deal_to_devices orders its batch); with Flax NNX,
  nnx_value_and_half_grads and set_nnx_lr_factor (flax imported when called).
Run services: EpochSampler, Checkpointer, MetricsWriter, read_metrics,
  ProgressBar, simulated_cpu_devices_env (set before JAX starts),
  exit_on_lost_process.
Engine internals, documented in their rooms: StepCompiler
  (simigrad_jax.compile.compiler), enable_persistent_cache and
  persistent_cache_settings (simigrad_jax.compile.persistent_cache: JAX's
  persistent compilation cache).

Errors: every one derives from SimiGradError and keeps its built-in parent:
  AxisNameError, BadRecordError, CheckpointMismatchError, HalvesContractError,
  LossContractError, UnsafePathError (ValueError); CheckpointSaveError,
  Preempted, ProcessDisagreementError, ProcessLostError, StepCompileError,
  WorkdirLockedError (RuntimeError).

Rooms: ingraph/ (pure, runs under jit), controllers/, data/, runtime/ (host
side), engine/ (the Trainer and its compiled step).
"""

from simigrad_jax.checkpoint.checkpointer import Checkpointer
from simigrad_jax.checkpoint.checkpointer import CheckpointMismatchError
from simigrad_jax.checkpoint.run_checkpoints import CheckpointSaveError
from simigrad_jax.compile.compiler import StepCompileError
from simigrad_jax.compile.compiler import StepCompiler
from simigrad_jax.compile.persistent_cache import enable_persistent_cache
from simigrad_jax.compile.persistent_cache import persistent_cache_settings
from simigrad_jax.controllers.base import BaseController
from simigrad_jax.controllers.interface import BatchSizeController
from simigrad_jax.controllers.learning_rate import lr_factor
from simigrad_jax.controllers.one_step_late import OneStepLateController
from simigrad_jax.controllers.profiling import ProfilingController
from simigrad_jax.controllers.registry import controller_names
from simigrad_jax.controllers.registry import controller_options
from simigrad_jax.controllers.registry import make_controller
from simigrad_jax.controllers.registry import register_controller
from simigrad_jax.controllers.simigrad import Controller
from simigrad_jax.data.device_order import deal_to_devices
from simigrad_jax.data.grain_source import GrainSource
from simigrad_jax.data.record_reader import BadRecordError
from simigrad_jax.data.sampler import EpochSampler
from simigrad_jax.data.sources import ArraySource
from simigrad_jax.data.sources import TfdsSource
from simigrad_jax.errors import SimiGradError
from simigrad_jax.files import UnsafePathError
from simigrad_jax.flax_nnx import nnx_value_and_half_grads
from simigrad_jax.flax_nnx import set_nnx_lr_factor
from simigrad_jax.ingraph.batch_coupling import BatchCouplingState
from simigrad_jax.ingraph.batch_coupling import couple_to_batch_size
from simigrad_jax.ingraph.device_halves_step import device_halves_step
from simigrad_jax.ingraph.half_batch import value_and_half_grads
from simigrad_jax.ingraph.lr_scaling import LrFactorState
from simigrad_jax.ingraph.lr_scaling import scale_by_lr_factor
from simigrad_jax.ingraph.train_step import LossContractError
from simigrad_jax.ingraph.transform import AxisNameError
from simigrad_jax.ingraph.transform import HalfGrads
from simigrad_jax.ingraph.transform import HalvesContractError
from simigrad_jax.ingraph.transform import SimilarityState
from simigrad_jax.ingraph.transform import transform
from simigrad_jax.multihost.cpu_devices import simulated_cpu_devices_env
from simigrad_jax.multihost.preemption import Preempted
from simigrad_jax.multihost.process_agreement import ProcessDisagreementError
from simigrad_jax.multihost.process_agreement import ProcessLostError
from simigrad_jax.multihost.process_agreement import exit_on_lost_process
from simigrad_jax.multihost.workdir import WorkdirLockedError
from simigrad_jax.optimizer_state import lr_factor_of
from simigrad_jax.optimizer_state import set_coupled_batch_size
from simigrad_jax.optimizer_state import set_lr_factor
from simigrad_jax.optimizer_state import similarity
from simigrad_jax.optimizer_state import similarity_stats
from simigrad_jax.ramps.replay import replay_controller
from simigrad_jax.ramps.replay import replay_schedule
from simigrad_jax.shapes.batch_plan import BatchPlan
from simigrad_jax.shapes.batch_plan import BucketPolicy
from simigrad_jax.shapes.batch_plan import bucket_shapes
from simigrad_jax.shapes.batch_plan import plan_batch
from simigrad_jax.shapes.batch_plan import representable_batch_sizes
from simigrad_jax.trainer.config import TrainerConfig
from simigrad_jax.trainer.hooks import StepHook
from simigrad_jax.trainer.metrics import MetricsWriter
from simigrad_jax.trainer.metrics import read_metrics
from simigrad_jax.trainer.progress import ProgressBar
from simigrad_jax.trainer.step_record import StepRecord
from simigrad_jax.trainer.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
  "ArraySource",
  "AxisNameError",
  "BadRecordError",
  "BaseController",
  "BatchCouplingState",
  "BatchPlan",
  "BatchSizeController",
  "BucketPolicy",
  "CheckpointMismatchError",
  "CheckpointSaveError",
  "Checkpointer",
  "Controller",
  "EpochSampler",
  "GrainSource",
  "HalfGrads",
  "HalvesContractError",
  "LossContractError",
  "LrFactorState",
  "MetricsWriter",
  "OneStepLateController",
  "Preempted",
  "ProcessDisagreementError",
  "ProcessLostError",
  "ProfilingController",
  "ProgressBar",
  "SimiGradError",
  "SimilarityState",
  "StepCompileError",
  "StepCompiler",
  "StepHook",
  "StepRecord",
  "TfdsSource",
  "Trainer",
  "TrainerConfig",
  "UnsafePathError",
  "WorkdirLockedError",
  "bucket_shapes",
  "controller_names",
  "couple_to_batch_size",
  "controller_options",
  "enable_persistent_cache",
  "exit_on_lost_process",
  "lr_factor",
  "lr_factor_of",
  "make_controller",
  "persistent_cache_settings",
  "nnx_value_and_half_grads",
  "plan_batch",
  "read_metrics",
  "register_controller",
  "replay_controller",
  "replay_schedule",
  "representable_batch_sizes",
  "scale_by_lr_factor",
  "set_coupled_batch_size",
  "set_lr_factor",
  "set_nnx_lr_factor",
  "similarity",
  "similarity_stats",
  "simulated_cpu_devices_env",
  "transform",
  "value_and_half_grads",
  "deal_to_devices",
  "device_halves_step",
]
