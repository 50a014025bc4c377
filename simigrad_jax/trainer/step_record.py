"""Host: what one optimizer step ran, measured and decided, as typed records.

A step passes through three of them: :class:`DispatchedStep` (what the host
handed the devices, with the step's
:class:`~simigrad_jax.ingraph.train_step.StepMeasurements` still on them),
:class:`MeasuredStep` (those measurements, read once the step is done, what
the controller decides from) and :class:`StepRecord` (the step as a whole,
once the controller decided the next batch size). The Trainer hands every
:class:`StepRecord` to its hooks (:mod:`simigrad_jax.trainer.hooks`);
:meth:`StepRecord.as_dict` is the step's line in ``metrics.jsonl``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax

from simigrad_jax.ingraph import train_step
from simigrad_jax.shapes import batch_plan


@dataclasses.dataclass(frozen=True)
class DispatchedStep:
  """A step the host has handed to the devices, and what it knew when it did.

  Attributes:
    plan: the plan that runs (a compile fallback's, if any).
    exact_plan: the plan of the batch size asked for.
    measurements: what the step measured, on the devices, not yet read.
    start: when the host began the step (``time.perf_counter()``).
    epoch: the epoch the step's first example belongs to.
    data_seconds: the host's time waiting for and placing the data.
    host_seconds: the host's critical path from reading the last step's
      statistics to calling this step's program (NaN for a run's first step).
    compile_wait_seconds: the seconds this step waited for compiles.
    first_run: the step runs a program (a shape) for the first time in this
      Trainer.
    lr_factor: the learning-rate factor the step runs with.
    schedule_factor: the learning-rate schedule's part of it.
  """

  plan: batch_plan.BatchPlan
  exact_plan: batch_plan.BatchPlan
  measurements: train_step.StepMeasurements
  start: float
  epoch: int
  data_seconds: float
  host_seconds: float
  compile_wait_seconds: float
  first_run: bool
  lr_factor: float
  schedule_factor: float


@dataclasses.dataclass(frozen=True)
class MeasuredStep:
  """What a step measured (its :class:`~simigrad_jax.ingraph.train_step.StepMeasurements`), read
  on the host.

  Attributes:
    loss: the mean loss over the step's real examples.
    similarity: the cosine similarity of the two halves' gradients (NaN when
      it was not measured, and for a skipped step: the controller learns
      nothing from a step that changed nothing).
    norm_a: the norm of half A's mean gradient.
    norm_b: the norm of half B's.
    norm_mean: the norm of the step's mean gradient.
    measured: whether the similarity was measured (both halves held examples
      and the step was not skipped).
    grads_finite: whether the gradient was finite on every device.
    nonfinite_count: the transform's count of steps whose gradient was not
      finite, so far.
    nonfinite_cause: None for a step that wrote its results; else why it was
      skipped, changing nothing: the first of ``"gradient"``, ``"loss"``,
      ``"update"`` and ``"parameters"`` (the new ones) that held NaN or an
      infinity (:data:`~simigrad_jax.ingraph.train_step.NONFINITE_CAUSES`).
  """

  loss: float
  similarity: float
  norm_a: float
  norm_b: float
  norm_mean: float
  measured: bool
  grads_finite: bool
  nonfinite_count: int
  nonfinite_cause: str | None = None

  @property
  def skipped(self) -> bool:
    """Whether the step was skipped as not finite (it changed no parameter or state)."""
    return self.nonfinite_cause is not None

  @classmethod
  def read(cls, on_devices: train_step.StepMeasurements) -> MeasuredStep:
    """Waits for the step and reads its measurements from this process's first device (one
    ``jax.device_get``)."""
    host = jax.device_get(jax.tree.map(lambda a: a.addressable_data(0), on_devices))
    halves = host.similarity_state
    cause = int(host.nonfinite_cause)
    measured = bool(halves.measured) and not cause  # a skipped step trained nothing to measure
    return cls(
      loss=float(host.loss),
      similarity=float(halves.similarity) if measured else math.nan,
      norm_a=float(halves.norm_a),
      norm_b=float(halves.norm_b),
      norm_mean=float(halves.norm_mean),
      measured=measured,
      grads_finite=bool(halves.grads_finite),
      nonfinite_count=int(halves.nonfinite_count),
      nonfinite_cause=train_step.NONFINITE_CAUSES[cause - 1] if cause else None,
    )

  def controller_stats(
    self, *, batch_size: int, examples_seen: int, epochs: float, epoch_end: bool
  ) -> dict[str, Any]:
    """The ``stats`` a controller's ``update`` receives beside :attr:`similarity`: the other
    measurements and where the run stands (the keys
    :meth:`~simigrad_jax.controllers.BatchSizeController.update` lists).

    ``grads_finite`` is False for every skipped step, whatever its cause: the
    step changed nothing, so the controller holds the size.
    """
    return {
      "loss": self.loss,
      "norm_a": self.norm_a,
      "norm_b": self.norm_b,
      "norm_mean": self.norm_mean,
      "measured": self.measured,
      "grads_finite": not self.skipped,
      "nonfinite_count": self.nonfinite_count,
      "batch_size": batch_size,
      "examples_seen": examples_seen,
      "epochs": epochs,
      "epoch_end": epoch_end,
    }


# Fields of a StepRecord that are not keys of its metrics line (see StepRecord.as_dict).
_NOT_LOGGED = ("epoch_end", "compile_stats")


@dataclasses.dataclass(frozen=True)
class StepRecord:
  """One optimizer step: what ran, what was measured, what was decided, and how long it took.

  The Trainer builds one per step, once the controller has decided the next
  batch size, and hands it to its hooks (metrics, progress bar, run totals,
  yours) after the next step is dispatched.

  Attributes:
    step: the optimizer step (1 for the run's first; resumes continue the count).
    epoch: the epoch the step's first example belongs to (0-based).
    examples_seen: examples trained on after this step, over the whole run.
    batch_size: the global batch size the step trained on.
    micro_batch_size: rows per device per micro-step (of the largest, when a
      step's micro-steps are of several shapes).
    accumulation_steps: micro-steps of the step.
    micro_batch_sizes: each micro-step's rows per device, largest first.
    padded_examples: zero-weight rows that filled the shape.
    compile_fallback: the step ran on a compiled shape other than its own.
    lr_factor: the learning-rate factor the step ran with.
    next_batch_size: the controller's decision for the next step.
    next_lr_factor: the learning-rate factor of the next step.
    schedule_factor: the learning-rate schedule's part of ``lr_factor``.
    decision: the controller's ``last_decision`` (e.g. ``"grow"``).
    similarity_target: the controller's target (None if it has none).
    loss, similarity, norm_a, norm_b, norm_mean, grads_finite: as in
      :class:`MeasuredStep`.
    nonfinite_steps: steps of the run skipped as not finite, so far.
    step_seconds: wall time from the last step's statistics to this one's.
    examples_per_second: ``batch_size / step_seconds``.
    data_seconds: the host's time waiting for and placing the step's data.
    host_seconds: the host's critical path before the step (see
      :class:`DispatchedStep`; NaN for a run's first step).
    agreement_seconds: the time the processes took to agree on the decision.
    compile_wait_step_seconds: the time the step waited for compiles.
    first_run: the step ran a program (a shape) for the first time in this
      Trainer. A program's first run takes longer than the next ones (on
      XLA:CPU, its library kernels build their pipelines then), and a
      persistent compilation cache does not keep that work.
    epoch_end: the step finished an epoch (not logged: the next record's
      ``epoch`` says it).
    nonfinite_cause: as in :class:`MeasuredStep`: None, or why the step was
      skipped (``"gradient"``, ``"loss"``, ``"update"`` or ``"parameters"``).
    compile_stats: the Trainer's compile counters when the record was handed
      to the hooks (:meth:`simigrad_jax.Trainer.compile_stats`; empty before).

  Example::

    class PrintLoss:  # a hook: simigrad_jax.Trainer(..., hooks=[PrintLoss()])
      def on_step(self, record: StepRecord) -> None:
        print(record.step, record.batch_size, record.loss, record.similarity)
  """

  step: int
  epoch: int
  examples_seen: int
  batch_size: int
  micro_batch_size: int
  accumulation_steps: int
  padded_examples: int
  compile_fallback: bool
  lr_factor: float
  next_batch_size: int
  next_lr_factor: float
  schedule_factor: float
  decision: Any
  similarity_target: float | None
  loss: float
  similarity: float
  norm_a: float
  norm_b: float
  norm_mean: float
  grads_finite: bool
  nonfinite_steps: int
  step_seconds: float
  examples_per_second: float
  data_seconds: float
  host_seconds: float
  agreement_seconds: float
  compile_wait_step_seconds: float
  epoch_end: bool
  first_run: bool = False
  nonfinite_cause: str | None = None
  compile_stats: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  micro_batch_sizes: tuple[int, ...] = ()

  @classmethod
  def create(
    cls,
    dispatched: DispatchedStep,
    measured: MeasuredStep,
    *,
    step: int,
    examples_seen: int,
    micro_batch_size: int,
    decision: Any,
    micro_batch_sizes: tuple[int, ...] = (),
    similarity_target: float | None,
    next_batch_size: int,
    next_lr_factor: float,
    nonfinite_steps: int,
    step_seconds: float,
    agreement_seconds: float,
    epoch_end: bool,
  ) -> StepRecord:
    """The record of a step: what was dispatched, what it measured, and the rest as given."""
    plan = dispatched.plan
    return cls(
      step=step,
      epoch=dispatched.epoch,
      examples_seen=examples_seen,
      batch_size=plan.global_batch_size,
      micro_batch_size=micro_batch_size,
      micro_batch_sizes=micro_batch_sizes or (micro_batch_size,) * plan.accumulation_steps,
      accumulation_steps=plan.accumulation_steps,
      padded_examples=plan.padded_examples,
      compile_fallback=plan != dispatched.exact_plan,
      lr_factor=dispatched.lr_factor,
      next_batch_size=next_batch_size,
      next_lr_factor=next_lr_factor,
      schedule_factor=dispatched.schedule_factor,
      decision=decision,
      similarity_target=similarity_target,
      loss=measured.loss,
      similarity=measured.similarity,
      norm_a=measured.norm_a,
      norm_b=measured.norm_b,
      norm_mean=measured.norm_mean,
      grads_finite=measured.grads_finite,
      nonfinite_steps=nonfinite_steps,
      step_seconds=step_seconds,
      examples_per_second=plan.global_batch_size / step_seconds,
      data_seconds=dispatched.data_seconds,
      host_seconds=dispatched.host_seconds,
      agreement_seconds=agreement_seconds,
      compile_wait_step_seconds=dispatched.compile_wait_seconds,
      epoch_end=epoch_end,
      first_run=dispatched.first_run,
      nonfinite_cause=measured.nonfinite_cause,
    )

  @property
  def skipped(self) -> bool:
    """Whether the step was skipped as not finite (it changed no parameter or state)."""
    return self.nonfinite_cause is not None or not self.grads_finite

  def as_dict(self) -> dict[str, Any]:
    """The step's line of ``metrics.jsonl``: every field but ``epoch_end``, then the compile
    counters (``compiles``, ``compile_seconds``, ...) as keys of their own."""
    fields = {
      f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NOT_LOGGED
    }
    return {**fields, **self.compile_stats}

  def with_compile_stats(self, compile_stats: Mapping[str, Any]) -> StepRecord:
    """This record with the compile counters as they are now."""
    return dataclasses.replace(self, compile_stats=dict(compile_stats))
