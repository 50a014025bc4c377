"""simigrad-jax: adaptive batch-size training for JAX (SimiGrad).

In-graph (runs inside your jit / pmap / shard_map step):
  transform, SimilarityState, value_and_half_grads, HalfGrads,
  scale_by_lr_factor, LrFactorState.
Host side (Python decisions between steps):
  Controller, lr_factor, similarity, similarity_stats, set_lr_factor,
  BucketPolicy, BatchPlan, plan_batch, bucket_shapes; other controllers by
  name: make_controller, controller_names, controller_options.
Training engine (host side): Trainer, with EpochSampler, ArraySource,
  TfdsSource, GrainSource (grain-style data, decoded ahead in worker
  processes; BadRecordError), StepCompiler, Checkpointer, MetricsWriter, ProgressBar.
Simulated CPU devices: simulated_cpu_devices_env (set before JAX starts).
JAX's persistent compilation cache: enable_persistent_cache (process-wide),
  persistent_cache_settings (puts those settings back).
Errors: CheckpointMismatchError (a checkpoint from another run),
  ProcessDisagreementError (hosts disagree on a decision), ProcessLostError
  (a host stopped answering; exit_on_lost_process ends a script on one),
  StepCompileError,
  HalvesContractError (an optimizer that does not pass half_grads on).
"""

from simigrad_jax.engine.batch_plan import BatchPlan
from simigrad_jax.engine.batch_plan import BucketPolicy
from simigrad_jax.engine.batch_plan import bucket_shapes
from simigrad_jax.engine.batch_plan import plan_batch
from simigrad_jax.engine.batch_plan import representable_batch_sizes
from simigrad_jax.runtime.checkpointer import CheckpointMismatchError
from simigrad_jax.runtime.checkpointer import Checkpointer
from simigrad_jax.controllers.simigrad import Controller
from simigrad_jax.controllers.registry import controller_names
from simigrad_jax.controllers.registry import controller_options
from simigrad_jax.controllers.registry import make_controller
from simigrad_jax.controllers.registry import register_controller
from simigrad_jax.runtime.cpu_devices import simulated_cpu_devices_env
from simigrad_jax.data.grain_source import BadRecordError
from simigrad_jax.data.grain_source import GrainSource
from simigrad_jax.controllers.learning_rate import lr_factor
from simigrad_jax.runtime.metrics import MetricsWriter
from simigrad_jax.runtime.metrics import ProgressBar
from simigrad_jax.runtime.metrics import read_metrics
from simigrad_jax.data.sampler import EpochSampler
from simigrad_jax.data.sources import ArraySource
from simigrad_jax.data.sources import TfdsSource
from simigrad_jax.optimizer_state import lr_factor_of
from simigrad_jax.optimizer_state import set_lr_factor
from simigrad_jax.optimizer_state import similarity
from simigrad_jax.optimizer_state import similarity_stats
from simigrad_jax.engine.compiler import StepCompileError
from simigrad_jax.engine.compiler import StepCompiler
from simigrad_jax.engine.compiler import enable_persistent_cache
from simigrad_jax.engine.compiler import persistent_cache_settings
from simigrad_jax.runtime.process_agreement import ProcessDisagreementError
from simigrad_jax.runtime.process_agreement import ProcessLostError
from simigrad_jax.runtime.process_agreement import exit_on_lost_process
from simigrad_jax.engine.trainer import Trainer
from simigrad_jax.ingraph.half_batch import value_and_half_grads
from simigrad_jax.ingraph.lr_scaling import LrFactorState
from simigrad_jax.ingraph.lr_scaling import scale_by_lr_factor
from simigrad_jax.ingraph.transform import HalfGrads
from simigrad_jax.ingraph.transform import HalvesContractError
from simigrad_jax.ingraph.transform import SimilarityState
from simigrad_jax.ingraph.transform import transform

__version__ = "0.1.0"

__all__ = [
    "ArraySource",
    "BadRecordError",
    "BatchPlan",
    "BucketPolicy",
    "CheckpointMismatchError",
    "Checkpointer",
    "Controller",
    "EpochSampler",
    "GrainSource",
    "HalfGrads",
    "HalvesContractError",
    "LrFactorState",
    "MetricsWriter",
    "ProcessDisagreementError",
    "ProcessLostError",
    "ProgressBar",
    "SimilarityState",
    "StepCompileError",
    "StepCompiler",
    "TfdsSource",
    "Trainer",
    "bucket_shapes",
    "controller_names",
    "controller_options",
    "enable_persistent_cache",
    "exit_on_lost_process",
    "lr_factor",
    "lr_factor_of",
    "make_controller",
    "persistent_cache_settings",
    "plan_batch",
    "read_metrics",
    "register_controller",
    "representable_batch_sizes",
    "scale_by_lr_factor",
    "set_lr_factor",
    "similarity",
    "similarity_stats",
    "simulated_cpu_devices_env",
    "transform",
    "value_and_half_grads",
]
