"""Host: the Trainer: its step loop, its settings, the step record and the hooks that
consume it (metrics, progress, evaluation, checkpoints), and the checks before its first step.

Documented API:
  Trainer, TrainerConfig, StepHook, StepRecord: the training loop, its
    settings, what a hook implements (``on_step(record)``) and the record each
    step hands the hooks; the four are on the top level too.
  CompileConfig, CheckpointConfig, LearningRateConfig: the groups of
    TrainerConfig (``config.compile``, ``config.checkpoints``, ``config.lr``;
    on the top level too).
  MetricsWriter: one JSON line per step in ``metrics.jsonl`` (and TensorBoard
    scalars); read_metrics reads such a file back (also on the top level).
  ProgressBar: a progress bar over examples, with the loss, batch size and
    similarity beside it.
  NonFiniteRunError: a streak of steps skipped as not finite (a loss NaN for
    every row, a NaN learning rate): the run trained nothing, so it stops.
  AdaptiveStep: the step of an own adaptive loop, at any batch size on a few
    compiled shapes (also on the top level); AdaptiveBatchError: a batch it
    cannot run.

Modules: ``trainer``, ``config``, ``step_record``, ``hooks``, ``metrics``,
``progress``, ``skipped_steps``, ``adaptive_step`` (an own loop's step), and
the step's parts: ``run_setup`` (a run built from the Trainer's arguments),
``checks``, ``step_inputs``, ``step_agreement`` (every process's agreement on
a step's decision) and ``run_totals``.

Example:
  >>> import tempfile
  >>> from simigrad_jax import trainer
  >>> workdir = tempfile.mkdtemp()
  >>> with trainer.MetricsWriter(workdir) as writer:
  ...   writer.write({"step": 1, "batch_size": 64})
  >>> [record["batch_size"] for record in trainer.read_metrics(workdir + "/metrics.jsonl")]
  [64]
"""

from simigrad_jax.trainer.adaptive_step import AdaptiveBatchError
from simigrad_jax.trainer.adaptive_step import AdaptiveStep
from simigrad_jax.trainer.config import CheckpointConfig
from simigrad_jax.trainer.config import CompileConfig
from simigrad_jax.trainer.config import LearningRateConfig
from simigrad_jax.trainer.config import TrainerConfig
from simigrad_jax.trainer.hooks import StepHook
from simigrad_jax.trainer.metrics import MetricsWriter
from simigrad_jax.trainer.metrics import read_metrics
from simigrad_jax.trainer.progress import ProgressBar
from simigrad_jax.trainer.skipped_steps import NonFiniteRunError
from simigrad_jax.trainer.step_record import StepRecord
from simigrad_jax.trainer.trainer import Trainer

__all__ = [
  "AdaptiveBatchError",
  "AdaptiveStep",
  "CheckpointConfig",
  "CompileConfig",
  "LearningRateConfig",
  "MetricsWriter",
  "NonFiniteRunError",
  "ProgressBar",
  "StepHook",
  "StepRecord",
  "Trainer",
  "TrainerConfig",
  "read_metrics",
]
