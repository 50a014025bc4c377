"""Host: a run's realised batch sizes as a step schedule, to replay it here or hand it to another trainer.

Every step's record (a line of the run's ``metrics.jsonl``) holds the size
that ran, ``batch_size``, and the examples seen after it, ``examples_seen``;
the step started at ``examples_seen - batch_size``. The sizes, with the
counts at which they changed, are Megatron-LM's step schedule
(``"0:20,140:22,..."``), which the ``"step_schedule"`` controller replays:
the same sizes at the same examples, whatever rule chose them (SimiGrad, the
noise scale, ...). ``python -m simigrad_jax.replay metrics.jsonl`` prints it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from simigrad_jax import validation
from simigrad_jax.ramps.token_schedules import StepScheduleController
from simigrad_jax.ramps.token_schedules import format_thresholds


def replay_thresholds(
  records: Iterable[Mapping[str, Any]], tokens_per_example: int | None = None
) -> list[tuple[int, int]]:
  """The ``(count, size)`` thresholds at which a run's batch size changed.

  Args:
    records: the run's metrics records in order (e.g. from
      :func:`simigrad_jax.read_metrics`); those without ``batch_size`` (an
      evaluation's) are skipped.
    tokens_per_example: optional: give the counts in tokens, this many per
      example; without it, in examples.

  Returns:
    The thresholds, the first at 0.

  Raises:
    ValueError: no step record, or one whose examples do not follow on from
      the step before (records of another run, or missing), naming the step.

  Example:
    >>> from simigrad_jax.ramps.replay import replay_thresholds
    >>> replay_thresholds([{"step": 1, "batch_size": 16, "examples_seen": 16},
    ...                    {"step": 2, "batch_size": 16, "examples_seen": 32},
    ...                    {"step": 3, "batch_size": 24, "examples_seen": 56}])
    [(0, 16), (32, 24)]
  """
  scale = (
    1
    if tokens_per_example is None
    else validation.check_int("tokens_per_example", tokens_per_example, 1)
  )
  thresholds: list[tuple[int, int]] = []
  seen = 0
  for record in records:
    if "batch_size" not in record:
      continue
    step = record.get("step")
    size = validation.check_int(f"step {step}'s batch_size", record["batch_size"], 1)
    after = validation.check_int(f"step {step}'s examples_seen", record["examples_seen"], 1)
    if after - size != seen:
      raise ValueError(
        f"step {step} starts at {after - size} examples (examples_seen {after} - batch_size "
        f"{size}), but the steps before it end at {seen}: the records are not one run's steps "
        "in order"
      )
    if not thresholds or thresholds[-1][1] != size:
      thresholds.append((seen * scale, size))
    seen = after
  if not thresholds:
    raise ValueError("no step records (records with batch_size and examples_seen) to replay")
  return thresholds


def replay_schedule(
  records: Iterable[Mapping[str, Any]], tokens_per_example: int | None = None
) -> str:
  """A run's batch sizes as a Megatron-style schedule string, ``"0:16,32:24"`` (see :func:`replay_thresholds`)."""
  return format_thresholds(replay_thresholds(records, tokens_per_example))


def replay_controller(
  records: Iterable[Mapping[str, Any]], **options: Any
) -> StepScheduleController:
  """A ``"step_schedule"`` controller that runs a recorded run's batch sizes again.

  Args:
    records: the run's metrics records (see :func:`replay_thresholds`).
    **options: the controller's other options (``batch_size_lower_bound``,
      ``batch_size_upper_bound``: give the recorded run's, and the Trainer
      lays out every step as it did; ``verbose``).

  Returns:
    The controller; with the recorded run's model, data, optimizer and seed,
    :class:`simigrad_jax.Trainer` retraces its steps.
  """
  return StepScheduleController(replay_thresholds(records), **options)
