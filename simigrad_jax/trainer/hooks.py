"""Host: what runs on every step's record: metrics, progress, evaluation, checkpoints, yours.

A hook is any object with ``on_step(record)`` (:class:`StepHook`); the
Trainer calls its hooks with each :class:`~simigrad_jax.trainer.step_record.
StepRecord`, in step order, in this order: the metrics file, the run's
totals, the progress bar, the hooks you added, the evaluation, the
checkpoint. A step's hooks run after the next step is dispatched, while the
devices work, except at a step that is checkpointed (an epoch's end, every
``checkpoint_every_steps``, once ``checkpoint_every_seconds`` have passed, the
last step of a run or of a stop on a signal): its hooks run at once, so that
a resumed run holds exactly the records up to its checkpoint, and the
evaluation and the checkpoint see the parameters of that step. A hook whose
``runs_at_once`` attribute is True runs as soon as its step is decided, before
the next step is dispatched and before every other hook (it costs the host the
overlap with the devices): for a hook that must act between two steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np
from jax.experimental import multihost_utils

from simigrad_jax.trainer.metrics import MetricsWriter
from simigrad_jax.trainer.progress import ProgressBar
from simigrad_jax.trainer.step_record import StepRecord


@runtime_checkable
class StepHook(Protocol):
  """Receives every optimizer step's :class:`StepRecord`, in order.

  Example:
    >>> class BatchSizes:
    ...   def __init__(self):
    ...     self.sizes = []
    ...   def on_step(self, record):
    ...     self.sizes.append(record.batch_size)
    >>> isinstance(BatchSizes(), StepHook)
    True
  """

  def on_step(self, record: StepRecord) -> None:
    """Called once per optimizer step, after the next step is dispatched (see the module), or
    as soon as the step is decided if the hook has ``runs_at_once = True``."""


def check_hook(hook: Any) -> StepHook:
  """Returns ``hook`` if it has a callable ``on_step``, else raises ValueError naming it."""
  if not callable(getattr(hook, "on_step", None)):
    raise ValueError(
      f"a hook must have a method on_step(record) (simigrad_jax.trainer.hooks."
      f"StepHook), got {hook!r:.200} ({type(hook).__name__})"
    )
  return hook


class MetricsHook:
  """Writes each record to ``metrics.jsonl`` and TensorBoard (:class:`MetricsWriter`).

  Args:
    writer: the run's metrics writer.
  """

  def __init__(self, writer: MetricsWriter):
    self.writer = writer

  def on_step(self, record: StepRecord) -> None:
    self.writer.write(record.as_dict())


class ProgressHook:
  """A progress bar over the run's examples, showing each step's loss, batch size and similarity.

  Args:
    total_examples: the examples the run will have seen at its end (inf when
      it ends by steps: a counter without a bar).
    examples_seen: the examples seen before (a resumed run's).
    enabled: draw the bar (else it only counts).
  """

  def __init__(self, total_examples: float, examples_seen: int, enabled: bool):
    known = math.isfinite(total_examples)
    self.bar = ProgressBar(
      int(total_examples) if known else 0,
      initial=int(min(examples_seen, total_examples)) if known else 0,
      enabled=enabled,
    )

  def on_step(self, record: StepRecord) -> None:
    self.bar.update(
      record.batch_size, loss=record.loss, batch=record.batch_size, sim=record.similarity
    )

  def close(self) -> None:
    self.bar.close()


class EvaluationHook:
  """At every epoch's end, evaluates the parameters and logs the results with an ``eval_`` prefix.

  Args:
    eval_fn: ``eval_fn(params, model_state) -> dict`` of numbers, or None
      (nothing is evaluated).
    state: gives the run's current ``{"params", "model_state", ...}``
      (replicated arrays).
    writer: where the results go, as a record of their own (the step, its
      epoch and the examples seen).
  """

  def __init__(
    self,
    eval_fn: Callable[[Any, Any], Mapping[str, float]] | None,
    state: Callable[[], Mapping[str, Any]],
    writer: MetricsWriter,
  ):
    self._eval_fn, self._state, self._writer = eval_fn, state, writer
    self.results: dict[str, float] = {}  # the last evaluation's

  def on_step(self, record: StepRecord) -> None:
    if not record.epoch_end or self._eval_fn is None:
      return
    state = self._state()
    params, model_state = host_copy((state["params"], state["model_state"]))
    self.results = {f"eval_{k}": float(v) for k, v in self._eval_fn(params, model_state).items()}
    self._writer.write(
      {
        "step": record.step,
        "epoch": record.epoch,
        "examples_seen": record.examples_seen,
        **self.results,
      }
    )


def host_copy(tree: Any) -> Any:
  """A NumPy copy of a tree on the devices: a replicated leaf read from this process's first device.

  A leaf sharded over a mesh (its model axes) is gathered whole, over every
  process (each process calls this at the same step).
  """

  def copy(x: jax.Array) -> np.ndarray:
    if x.is_fully_replicated:
      return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  return jax.tree.map(copy, tree)
