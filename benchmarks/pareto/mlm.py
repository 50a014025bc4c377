"""The Pareto benchmark's masked-LM task: a small BERT (``train/configs/bert_tiny.py``) on text.

SimiGrad's headline result is BERT pre-training, a masked language model. This
task trains the ``bert_tiny`` recipe (LAMB, byte-level tokens, 15% masking) at
a size that a CPU trains a whole grid of: sequences of ``seq_length``
bytes of ``../shared/data/tinyshakespeare.txt`` (Python's own documentation
when absent), a model of ``hidden`` width. The text is cut into consecutive
parts: the first ``train_windows`` windows are trained on, and the last 10% of
the text is held out, its first half for validation (selecting learning rates)
and its second half for test (reported), ``eval_examples`` windows each. Both
are scored by masked-token accuracy and loss under a fixed mask, the same for
every run.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import simigrad_jax
from benchmarks import common
from benchmarks.pareto.protocol import RunSpec
from benchmarks.pareto.protocol import benchmark_trainer
from benchmarks.pareto.protocol import lr_schedule_fn
from benchmarks.pareto.protocol import token_model_params
from benchmarks.pareto.protocol import train_run
from train import input_pipeline
from train import models
from train import optimizers
from train import tasks
from train import text_data
from train.configs import bert_tiny

DATA_DIR = pathlib.Path(common.REPOSITORY_ROOT).parent / "shared" / "data"
HELD_OUT = 0.1  # the last 10% of the text: validation, then test
# LAMB's learning rate at --base-batch-size (64) before the per-size multipliers (from bert_tiny's
# 1e-2 at B=128, sqrt-scaled and rounded).
BASE_LR = {"text": 7e-3}

# The grids. "bounds" are (lower, upper) pairs for the adaptive controllers.
FULL = {
  "dataset": "text",
  "lr_schedule": "warmup_cosine",
  "epochs": 1,
  "seeds": (0, 1),
  "hidden": 64,
  "seq_length": 64,
  "train_windows": 8192,
  "eval_examples": 512,
  "fixed": (16, 32, 64, 128, 256, 512),
  "lr_multipliers": (0.5, 1.0, 2.0),
  "targets": (0.8, 0.6, 0.4, 0.2),
  "bounds": ((16, 512),),
  "gns": (0.5, 1.0, 2.0),
  "schedules": (),
  "simigrad_options": ({}, {"ema_decay": 0.9}),
  "adaptive_lr_multipliers": None,
  "adaptive_lr_rules": ("sqrt",),
}
QUICK = {
  **FULL,
  "seeds": (0, 1),
  "train_windows": 2048,
  "eval_examples": 256,
  "fixed": (16, 64, 256),
  "lr_multipliers": (1.0, 2.0),
  "targets": (0.8, 0.4),
  "gns": (1.0,),
  "simigrad_options": ({},),
}


class MlmExperiment:
  """Runs :class:`RunSpec` s of BERT's masked LM with the real Trainer, sharing a compilation cache.

  Args:
    hidden: the model width (heads of 32; MLP 4x; 2 layers).
    seq_length: bytes per window.
    train_windows: how many windows of the text's start are trained on.
    eval_examples: windows in each of validation and test.
    epochs: passes over the training windows.
    lr_schedule: the protocol's schedule name (``cosine``, ``step``, ``constant``).
    root: where workdirs and the compilation cache go.
    keep_workdirs: keep each run's workdir.
    data_dir: where ``tinyshakespeare.txt`` is looked for.
  """

  def __init__(
    self,
    *,
    hidden: int,
    seq_length: int,
    train_windows: int,
    eval_examples: int,
    epochs: float,
    lr_schedule: str,
    root: pathlib.Path,
    keep_workdirs: bool = False,
    data_dir: pathlib.Path = DATA_DIR,
  ):
    config = bert_tiny.get_config()
    config.seq_length, config.bert_hidden = seq_length, hidden
    config.bert_heads, config.bert_mlp = max(1, hidden // 32), 4 * hidden
    config.eval_batch_size = 256
    self.config = config
    text, where = text_data.default_text(data_dir)
    tokens = text_data.encode_bytes(text)
    held_out = int(len(tokens) * HELD_OUT)
    train_tokens, val_tokens = tokens[:-held_out], tokens[-held_out : -held_out // 2]
    test_tokens = tokens[-held_out // 2 :]
    windows = text_data.TextWindowSource(train_tokens, seq_length)
    if train_windows > len(windows):
      raise ValueError(
        f"train_windows={train_windows} exceeds the {len(windows)} windows of "
        f"{seq_length} bytes the text's first {1 - HELD_OUT:.0%} holds"
      )
    self.train = input_pipeline.limit_examples(windows, train_windows)
    splits = {
      name: input_pipeline.limit_examples(
        text_data.TextWindowSource(part, seq_length), eval_examples
      )
      for name, part in (("val", val_tokens), ("test", test_tokens))
    }
    self.num_val, self.num_test = len(splits["val"]), len(splits["test"])
    self.note = (
      None
      if where.endswith("tinyshakespeare.txt")
      else (f"tinyshakespeare.txt not found in {data_dir}; used {where}")
    )
    self.description = (
      f"{len(tokens):,} bytes from {where}: {len(self.train)} train windows of "
      f"{seq_length} / {self.num_val} validation / {self.num_test} test"
    )
    self.model = models.create_model(config, vocab_size=text_data.BYTE_VOCAB_SIZE)
    datasets = input_pipeline.Datasets(self.train, None, vocab_size=text_data.BYTE_VOCAB_SIZE)
    self.loss_fn, _, eval_step = tasks.mlm_fns(config, self.model, datasets)
    evaluators = {
      name: tasks.make_evaluate(
        config,
        input_pipeline.Datasets(self.train, split, vocab_size=text_data.BYTE_VOCAB_SIZE),
        eval_step,
        text=True,
      )
      for name, split in splits.items()
    }

    def eval_fn(params, model_state):
      out = {}
      for name, evaluate in evaluators.items():
        result = evaluate(params, model_state)
        out[f"{name}_accuracy"], out[f"{name}_loss"] = result["accuracy"], result["loss"]
      return out

    self.eval_fn = eval_fn
    self.epochs, self.root, self.keep_workdirs = epochs, root, keep_workdirs
    self.lr_schedule: Callable[[float], float] = lr_schedule_fn(lr_schedule, epochs)
    self.cache_dir = root / "compilation_cache"
    self._params = token_model_params(self.model, seq_length)

  @property
  def num_train(self) -> int:
    return len(self.train)

  def info(self) -> dict[str, Any]:
    """What the result JSON records about the task: data set, split sizes, model, optimizer."""
    c = self.config
    return {
      "dataset": "text",
      "dataset_note": self.note,
      "num_train": self.num_train,
      "num_val": self.num_val,
      "num_test": self.num_test,
      "seq_length": c.seq_length,
      "optimizer": f"lamb(weight_decay={c.weight_decay})",
      "description": f"{self.description}; BERT MLM (hidden {c.bert_hidden}, "
      f"{c.bert_layers} layers, {c.bert_heads} heads, masking "
      f"{c.mask_rate:.0%})",
    }

  def init_params(self, seed: int) -> Any:
    return self._params(seed)

  def make_trainer(
    self,
    controller: Any,
    lr: float,
    seed: int,
    workdir: pathlib.Path,
    lr_schedule: Callable[[float], float] | None = None,
    lr_rule: str = "sqrt",
  ) -> simigrad_jax.Trainer:
    config = self.config.copy_and_resolve_references()
    config.learning_rate = lr
    return benchmark_trainer(
      controller,
      workdir,
      self.cache_dir,
      loss_fn=self.loss_fn,
      params=self.init_params(seed),
      optimizer=optimizers.create_optimizer(config),
      source=self.train,
      eval_fn=self.eval_fn,
      lr_schedule=lr_schedule or self.lr_schedule,
      lr=simigrad_jax.LearningRateConfig(rule=lr_rule),
      seed=seed,
    )

  def run(self, spec: RunSpec) -> dict[str, Any]:
    """Trains one run for the epoch budget; returns its JSON record (:func:`train_run`)."""
    return train_run(self, spec)


def setup(
  grid: dict[str, Any], *, lr_schedule: str, root: pathlib.Path, keep_workdirs: bool = False
) -> MlmExperiment:
  """The task's experiment for a grid (``hidden``, ``seq_length``, ``train_windows``, ...)."""
  return MlmExperiment(
    hidden=grid["hidden"],
    seq_length=grid["seq_length"],
    train_windows=grid["train_windows"],
    eval_examples=grid["eval_examples"],
    epochs=grid["epochs"],
    lr_schedule=lr_schedule,
    root=root,
    keep_workdirs=keep_workdirs,
  )
