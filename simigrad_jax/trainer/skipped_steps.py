"""Host: a run that skips every step trains nothing: after a streak of skipped steps it stops.

A step whose gradient, loss, update or new parameters hold NaN or an
infinity is skipped and changes nothing
(:data:`~simigrad_jax.ingraph.train_step.NONFINITE_CAUSES`). One such step
now and then (a bad example, a spike) is harmless: the next batch trains
from the same parameters. But a loss that is NaN for every row (labels
outside the classes the model outputs: optax's integer-label cross-entropy
gives NaN for them), or a learning rate that is NaN, skips every step, and a
run that went on would end with the parameters it started from. So
:data:`MAX_SKIPPED_IN_A_ROW` skipped steps in a row, all on different
batches but the same parameters, are an error that names the likely cause.
"""

from __future__ import annotations

from simigrad_jax.errors import SimiGradError

# Skipped steps in a row that stop the run: each ran other rows from the same parameters.
MAX_SKIPPED_IN_A_ROW = 10

# What was not finite, for each cause, as a message says it (then "NaN or infinite").
SAID = {
  "gradient": "the gradient was",
  "loss": "the loss was",
  "update": "the optimizer's update was",
  "parameters": "the new parameters were",
}

# The likely cause of a streak of steps skipped for each reason, and the fix, for the message.
_LIKELY_CAUSE = {
  "gradient": (
    "a loss_fn whose gradient is NaN or infinite for every batch (e.g. log(0), a sqrt at 0, or "
    "inputs holding NaN)"
  ),
  "loss": (
    "a loss that is NaN for every row: most often labels outside the classes the model "
    "outputs (optax's integer-label cross-entropy gives NaN for a label >= num_classes or "
    "< 0; check num_classes against the data), or a loss_fn that returns NaN"
  ),
  "update": (
    "an optimizer whose update is NaN or infinite with a finite gradient: a learning rate, "
    "schedule or other setting of the optimizer that is NaN or infinite"
  ),
  "parameters": (
    "parameters that overflow their dtype (a learning rate far too large for a float16 or "
    "bfloat16 model)"
  ),
}


class NonFiniteRunError(SimiGradError, RuntimeError):
  """Every step of a streak was skipped as not finite: the run trains nothing.

  Attributes:
    step: the last step of the streak.
    cause: why its steps were skipped (the last step's cause).
  """

  def __init__(self, message: str, step: int, cause: str):
    super().__init__(message)
    self.step, self.cause = step, cause


class SkippedStreak:
  """Counts the skipped steps in a row and raises :class:`NonFiniteRunError` at too many.

  Args:
    limit: the skipped steps in a row that stop the run (>= 1).

  Example::

    streak = SkippedStreak()
    streak.count(step=12, cause=None)  # a step that trained: the streak starts again
    streak.count(step=13, cause="loss")  # the 10th of a row raises
  """

  def __init__(self, limit: int = MAX_SKIPPED_IN_A_ROW):
    self.limit = limit
    self.in_a_row = 0

  def count(self, step: int, cause: str | None) -> None:
    """Counts ``step``: ``cause`` None for a step that trained, else why it was skipped.

    Raises:
      NonFiniteRunError: the ``limit``-th skipped step in a row.
    """
    if cause is None:
      self.in_a_row = 0
      return
    self.in_a_row += 1
    if self.in_a_row < self.limit:
      return
    first = step - self.in_a_row + 1
    raise NonFiniteRunError(
      f"steps {first} to {step}, {self.in_a_row} in a row, were all skipped because "
      f"{SAID[cause]} NaN or infinite, so the run trains nothing; the likely cause: "
      f"{_LIKELY_CAUSE[cause]}",
      step,
      cause,
    )
