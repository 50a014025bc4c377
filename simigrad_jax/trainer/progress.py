"""Host: a progress bar over examples, with the loss, batch size and similarity beside it.

Plain Python; nothing here is traced.
"""

from __future__ import annotations

from typing import Any, TextIO

import numpy as np
import tqdm

from simigrad_jax import validation

__all__ = ["ProgressBar"]


def _format_postfix(value: Any) -> str:
  """A compact display of a postfix value: 4 significant digits for floats."""
  if validation.is_bool(value) or isinstance(value, str):
    return str(value)
  if validation.is_int(value):
    return str(int(value))
  number = validation.as_float(value)
  if number is None:
    return str(value)
  if np.asarray(value).dtype.kind in "iu":  # 0-d integer arrays
    return str(int(number))
  return f"{number:.4g}"


class ProgressBar:
  """A tqdm progress bar over examples with loss, batch size and similarity in its postfix.

  Counting examples rather than steps keeps the bar honest when the batch size
  changes every step.

  Args:
    total_examples: the number of examples the run (or epoch) will see; None
      or 0 when unknown (a counter without a bar).
    initial: examples already seen, e.g. when resuming.
    desc: the bar's label.
    enabled: False makes a bar that only counts (for processes other than 0,
      or quiet runs).
    file: where the bar is drawn (default: ``sys.stderr``, as tqdm does).
    leave: keep the finished bar on screen (False: it is cleared when
      closed, for a bar of a passing phase such as an evaluation).

  Example:
    >>> with ProgressBar(1000, enabled=False) as bar:
    ...   bar.update(256, loss=0.1234567, batch=256, sim=0.05)
    >>> bar.n, bar.postfix
    (256, {'loss': '0.1235', 'batch': '256', 'sim': '0.05'})
  """

  def __init__(
    self,
    total_examples: int | None,
    *,
    initial: int = 0,
    desc: str = "train",
    enabled: bool = True,
    file: TextIO | None = None,
    leave: bool = True,
  ):
    self._total = (
      None if total_examples is None else validation.check_int("total_examples", total_examples, 0)
    )
    self._n = validation.check_int("initial", initial, 0)
    if not isinstance(desc, str):
      raise ValueError(f"desc must be a string, got {desc!r} ({type(desc).__name__})")
    self._enabled = validation.check_bool("enabled", enabled)
    self._postfix: dict[str, str] = {}
    self._bar = None
    if self._enabled:
      self._bar = tqdm.tqdm(
        total=self._total,
        initial=self._n,
        desc=desc,
        unit=" ex",
        unit_scale=True,
        dynamic_ncols=True,
        file=file,
        leave=validation.check_bool("leave", leave),
      )

  @property
  def n(self) -> int:
    """Examples counted so far, ``initial`` included."""
    return self._n

  @property
  def postfix(self) -> dict[str, str]:
    """The postfix last shown, as formatted strings."""
    return dict(self._postfix)

  def update(self, examples: int, **postfix: Any) -> None:
    """Counts ``examples`` more and replaces the postfix if any is given.

    Args:
      examples: the number of examples in the step just taken (>= 0).
      **postfix: values to show, e.g. ``loss=0.123, batch=256, sim=0.05``;
        floats are shown with 4 significant digits.
    """
    examples = validation.check_int("examples", examples, 0)
    self._n += examples
    if postfix:
      self._postfix = {key: _format_postfix(value) for key, value in postfix.items()}
    if self._bar is not None:
      if postfix:
        self._bar.set_postfix(self._postfix, refresh=False)
      self._bar.update(examples)

  def close(self) -> None:
    """Draws the final state and releases the bar; safe to call twice."""
    if self._bar is not None:
      self._bar.close()
      self._bar = None

  def __enter__(self) -> ProgressBar:
    return self

  def __exit__(self, *exc_info: object) -> None:
    self.close()
