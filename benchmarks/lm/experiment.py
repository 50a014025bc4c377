"""The causal LM of ``benchmarks/lm/pareto_lm.py``: the recipe at a reduced size, runs and their loss curves.

:class:`LmExperiment` builds ``train/configs/shakespeare_lm.py``'s data, model
and loss once and trains one :class:`~benchmarks.pareto.protocol.RunSpec` at
a time with the real Trainer, all runs sharing one compilation cache. A run
trains a share of the token budget (1 for a constant batch, the allowance for
an adaptive run), its learning-rate schedule stretched over its own length.
A :class:`ValidationCurve` hook measures the validation loss at evenly spaced
token counts during each run, on windows spread evenly over the whole
held-out text.

The runs are reproducible on one machine: a step waits for its own shape's
compilation (no compile fallback, whose choice of shape depends on timing),
so the same seed and code run the same programs on the same rows; the
shapes are the halvings (``compile.shapes_per_octave=1``), few enough that
waiting for them costs little. The learning rate lives in the optimizer state
(AdamW at rate 1, its update scaled by the run's rate, the same arithmetic),
so that every rate and seed of a shape runs one compiled program, from the
cache.
"""

from __future__ import annotations

import math
import pathlib
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import optax

import simigrad_jax
from benchmarks.pareto.protocol import RunSpec
from benchmarks.pareto.protocol import benchmark_trainer
from benchmarks.pareto.protocol import lr_schedule_fn
from benchmarks.pareto.protocol import token_model_params
from simigrad_jax import StepRecord
from simigrad_jax.trainer.hooks import host_copy
from train import input_pipeline
from train import models
from train import optimizers
from train import tasks
from train.configs import shakespeare_lm

WARMUP_FRACTION = 0.1  # the warm-up of lr_schedule_fn("warmup_cosine", epochs), of the run


class ValidationCurve:
  """A hook that measures the validation loss each time another ``1 / points`` of the budget is trained.

  A step's hooks run once the next step is dispatched, so the state they see
  may be one step ahead of the record: each point is recorded with the steps
  and examples of the state it measured (the sampler's count).

  Args:
    evaluate: ``evaluate(params, None) -> {"loss", ...}``.
    total_examples: the run's budget in examples.
    points: measurements during the run (the end is measured by the caller).
    start_examples: where the measured stretch starts (a resumed run's
      examples): the points divide the stretch from it to ``total_examples``.
  """

  def __init__(
    self,
    evaluate: Callable[[Any, Any], dict[str, float]],
    total_examples: int,
    points: int,
    *,
    start_examples: int = 0,
  ):
    self._evaluate = evaluate
    span = total_examples - start_examples
    self._thresholds = [start_examples + span * k / points for k in range(1, points)]
    self.trainer: Any = None
    self.points: list[tuple[int, int, float]] = []  # (steps, examples, validation loss)

  def measure(self, params: Any, steps: int, examples: int) -> None:
    self.points.append((steps, examples, float(self._evaluate(params, None)["loss"])))

  def on_step(self, record: StepRecord) -> None:
    examples = self.trainer.sampler.examples_seen
    if not self._thresholds or examples < self._thresholds[0]:
      return
    while self._thresholds and examples >= self._thresholds[0]:
      self._thresholds.pop(0)
    steps = record.step + (1 if examples > record.examples_seen else 0)
    self.measure(host_copy(self.trainer.state["params"]), steps, examples)


def crossing(
  points: list[tuple[int, int, float]], target: float
) -> tuple[float | None, float | None]:
  """``(steps, examples)`` where the loss first reaches ``target``, interpolated linearly.

  Between the last measurement above the target and the first at or below
  it; ``(None, None)`` when no measurement reaches it.

  Example:
    >>> crossing([(0, 0, 4.0), (10, 100, 3.0), (20, 200, 2.0)], 2.5)
    (15.0, 150.0)
  """
  for i, (steps, examples, loss) in enumerate(points):
    if loss <= target:
      if i == 0:
        return float(steps), float(examples)
      s0, e0, l0 = points[i - 1]
      f = (l0 - target) / (l0 - loss)
      return s0 + f * (steps - s0), e0 + f * (examples - e0)
  return None, None


class LmExperiment:
  """Trains the causal LM recipe at a reduced size, one run at a time, recording its loss curve.

  Args:
    hidden: the width (heads of 16; MLP 4x; 2 layers).
    seq_length: tokens each window predicts.
    budget_windows: the token budget in windows (a constant batch's run).
    max_share: the largest share of the budget a run trains (the allowance):
      the training windows are the first ``ceil(max_share * budget_windows)``
      (or all there are: a run then passes over some windows again).
    eval_windows: the validation windows, spread evenly over the held-out text.
    evals: validation measurements per run, evenly in tokens (and one at the end).
    root: where workdirs and the compilation cache go.
    keep_workdirs: keep each run's workdir.
    text_file: train on this text (a path or glob pattern) instead of tinyshakespeare.
    layers: transformer layers.
  """

  def __init__(
    self,
    *,
    hidden: int,
    seq_length: int,
    budget_windows: int,
    max_share: float,
    eval_windows: int,
    evals: int,
    root: pathlib.Path,
    keep_workdirs: bool = False,
    text_file: str | None = None,
    layers: int = 2,
  ):
    config = shakespeare_lm.get_config()
    config.seq_length, config.bert_hidden, config.bert_layers = seq_length, hidden, layers
    config.bert_heads, config.bert_mlp = max(1, hidden // 16), 4 * hidden
    config.eval_examples, config.eval_batch_size = None, min(eval_windows, 256)
    if text_file:
      config.text_files = str(text_file)
    self.config = config
    datasets = input_pipeline.create_datasets(config)
    windows = min(len(datasets.train), math.ceil(max_share * budget_windows))
    if windows < 1 or budget_windows < 1:
      raise ValueError(f"--budget-windows must be >= 1, got {budget_windows}")
    self.train = input_pipeline.limit_examples(datasets.train, windows)
    num_val = len(datasets.eval)
    picks = np.unique(np.linspace(0, num_val - 1, min(eval_windows, num_val)).round().astype(int))
    datasets.eval = simigrad_jax.ArraySource(datasets.eval.get_batch(picks))
    self.num_val = len(picks)
    self.budget_windows = budget_windows
    self.vocab_size = datasets.vocab_size
    self.unigram_entropy = datasets.unigram_entropy
    self.model = models.create_model(config, vocab_size=datasets.vocab_size)
    self.loss_fn, _, eval_step = tasks.causal_lm_fns(config, self.model, datasets)
    self.evaluate = tasks.make_evaluate(config, datasets, eval_step, text=False)
    self.evals, self.root, self.keep_workdirs = evals, root, keep_workdirs
    self.cache_dir = root / "compilation_cache"
    self._params = token_model_params(self.model, seq_length)
    self.description = (
      f"{datasets.description}; a budget of {budget_windows} windows of {seq_length} tokens "
      f"({budget_windows * seq_length:,} tokens) from {len(self.train)} training windows; "
      f"{self.num_val} validation windows spread over the {num_val} held-out ones"
    )

  @property
  def num_train(self) -> int:
    return len(self.train)

  def info(self) -> dict[str, Any]:
    """What the result JSON records about the task."""
    c = self.config
    return {
      "task": "causal_lm",
      "description": self.description,
      "num_train": self.num_train,
      "num_val": self.num_val,
      "seq_length": c.seq_length,
      "budget_windows": self.budget_windows,
      "token_budget": self.budget_windows * c.seq_length,
      "vocab_size": self.vocab_size,
      "unigram_entropy": round(self.unigram_entropy, 6),
      "model": f"causal_lm (hidden {c.bert_hidden}, {c.bert_layers} layers, "
      f"{c.bert_heads} heads, MLP {c.bert_mlp})",
      "optimizer": f"adamw(b2={c.b2}, weight_decay={c.weight_decay}, "
      f"clip {c.grad_clip_norm}); warm-up 10% then cosine to 0.02x over each run, in tokens",
      "evals_per_run": self.evals,
    }

  def epochs_of(self, share: float) -> float:
    """The epochs (passes over the training windows) of ``share`` of the budget."""
    return share * self.budget_windows / self.num_train

  def trainer(
    self,
    controller: Any,
    spec: RunSpec,
    workdir: pathlib.Path,
    curve: Any,
    lr_schedule: Callable[[float], float],
    measure_every: int = 1,
  ) -> simigrad_jax.Trainer:
    """A Trainer of ``spec`` in ``workdir`` (resumed from its newest checkpoint, if any).

    Args:
      controller: the run's batch-size controller.
      spec: the run (its learning rate, coupling and seed).
      workdir: the run's workdir.
      curve: the run's :class:`ValidationCurve`.
      lr_schedule: the learning-rate multiplier by epochs trained.
      measure_every: the similarity measured on every ``measure_every``-th
        step, plain steps between (``TrainerConfig.measure_every``).
    """
    config = self.config.copy_and_resolve_references()
    config.learning_rate = 1.0  # the rate is in the optimizer state: one program for every rate
    # The learning-rate factor comes last in the chain (the Trainer checks it), after the rate.
    optimizer = optimizers.create_optimizer(
      config, then=optax.inject_hyperparams(optax.scale)(step_size=spec.lr)
    )
    return benchmark_trainer(
      controller,
      workdir,
      self.cache_dir,
      loss_fn=self.loss_fn,
      params=self._params(spec.seed),
      optimizer=optimizer,
      source=self.train,
      lr_schedule=lr_schedule,
      seed=spec.seed,
      lr=simigrad_jax.LearningRateConfig(rule=spec.lr_rule, coupling=spec.lr_coupling),
      compile=simigrad_jax.CompileConfig(
        fallback=False,  # a step's shape must not depend on compile timing
        shapes_per_octave=1,  # few shapes to compile: each step waits for its own
      ),
      hooks=[curve],
      measure_every=measure_every,
    )

  def _lr_schedule(self, controller: Any, epochs: float) -> Callable[[float], float]:
    """Warm-up then cosine over the run's ``epochs``, or Seesaw's own after the warm-up."""
    schedule = lr_schedule_fn("warmup_cosine", epochs)
    if not hasattr(controller, "lr_schedule"):
      return schedule
    warmup = WARMUP_FRACTION * epochs
    return controller.lr_schedule(
      self.num_train, base_schedule=lambda e: schedule(e) if e < warmup else 1.0
    )

  def run(
    self, spec: RunSpec, setting: str, share: float = 1.0, measure_every: int = 1
  ) -> dict[str, Any]:
    """Trains one run for ``share`` of the budget; returns its JSON record (the target is set later).

    Args:
      spec: the run.
      setting: its label in the record.
      share: the share of the token budget it trains (the allowance for an
        adaptive run).
      measure_every: the similarity measured on every ``measure_every``-th
        step, plain steps between (recorded when not 1).
    """
    workdir = pathlib.Path(tempfile.mkdtemp(prefix=f"{spec.controller}-", dir=self.root))
    start = time.perf_counter()
    controller = simigrad_jax.make_controller(spec.controller, **dict(spec.options))
    epochs = self.epochs_of(share)
    curve = ValidationCurve(self.evaluate, round(epochs * self.num_train), self.evals)
    schedule = self._lr_schedule(controller, epochs)
    with self.trainer(controller, spec, workdir, curve, schedule, measure_every) as trainer:
      curve.trainer = trainer
      curve.measure(host_copy(trainer.state["params"]), 0, 0)
      summary = trainer.train(num_epochs=epochs)
      curve.measure(host_copy(trainer.state["params"]), summary["steps"], summary["examples_seen"])
    wall = time.perf_counter() - start
    records = step_records(workdir)
    if not self.keep_workdirs:
      shutil.rmtree(workdir, ignore_errors=True)
    tokens = self.config.seq_length
    options = dict(spec.options)
    return {
      "controller": spec.controller,
      "setting": setting,
      "seed": spec.seed,
      "steps_to_target": None,
      "tokens_to_target": None,
      "final_val_loss": round(curve.points[-1][2], 6),
      "steps": int(summary["steps"]),
      "tokens": int(summary["examples_seen"]) * tokens,
      "learning_rate": spec.lr,
      "lr_multiplier": spec.lr_multiplier,
      "lr_coupling": spec.lr_coupling,
      "budget_share": share,
      **({"measure_every": measure_every} if measure_every != 1 else {}),
      **({"batch_size": int(options["initial_batch_size"])} if spec.controller == "fixed" else {}),
      "options": options,
      **batch_fields(summary, records),
      "wall_seconds": round(wall, 2),
      "curve": [[s, e * tokens, round(v, 6)] for s, e, v in curve.points],
      **({"workdir": str(workdir)} if self.keep_workdirs else {}),
    }


def step_records(workdir: pathlib.Path) -> list[dict[str, Any]]:
  """The step records of a run's ``metrics.jsonl`` (those with a batch size)."""
  return [r for r in simigrad_jax.read_metrics(workdir / "metrics.jsonl") if "batch_size" in r]


def batch_fields(summary: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
  """What a run's JSON record holds about its batches, from the Trainer's summary and records."""
  sims = [r["similarity"] for r in records if r["similarity"] is not None]
  return {
    "avg_batch_size": round(summary["examples_seen"] / max(summary["steps"], 1), 3),
    "final_batch_size": int(records[-1]["next_batch_size"]),
    "max_batch_size": int(max(r["batch_size"] for r in records)),
    "mean_similarity": round(float(np.mean(sims)), 4) if sims else None,
    "nonfinite_steps": int(records[-1]["nonfinite_steps"]),
    "train_loss": None if not math.isfinite(summary["loss"]) else round(summary["loss"], 6),
    "compile_seconds": round(float(summary["compile_seconds"]), 2),
    "batch_sizes": _batch_trace(records),
  }


def _batch_trace(records: list[dict[str, Any]], points: int = 32) -> list[list[float]]:
  """``[[step, batch size], ...]`` at up to ``points`` evenly spaced steps."""
  picks = np.unique(np.linspace(0, len(records) - 1, min(points, len(records))).astype(int))
  return [[records[i]["step"], records[i]["batch_size"]] for i in picks]
