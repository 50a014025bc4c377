"""How the step-cost benchmarks time a compiled step and read its memory, against a plain step.

Imports no JAX at import time (``halves_steps.py`` starts JAX only in the
child processes it runs on each device count).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def temp_bytes(compiled: Any) -> int | None:
  """The compiled program's temporary memory per device
  (``compiled.memory_analysis().temp_size_in_bytes``), or None where XLA gives no analysis."""
  analysis = compiled.memory_analysis()
  return None if analysis is None else int(analysis.temp_size_in_bytes)


def run_seconds(compiled: Any, args: tuple) -> float:
  """The seconds of one call of ``compiled`` on ``args``, waited for until its outputs are ready."""
  import jax  # pylint: disable=import-outside-toplevel

  start = time.perf_counter()
  jax.block_until_ready(compiled(*args))
  return time.perf_counter() - start


def paired_rounds(
  run_step: Callable[[], float], run_plain: Callable[[], float], rounds: int
) -> tuple[list[float], list[float], list[float]]:
  """Times a step and its plain step back to back, ``rounds`` times, the order alternating.

  Args:
    run_step: runs the step once and returns its seconds.
    run_plain: the same for the plain step.
    rounds: the number of pairs; in even rounds the plain step runs first.

  Returns:
    ``(ratios, step_seconds, plain_seconds)``, one entry per round: the
    step's time over the plain step's of the same round, and both times.
  """
  ratios, own, plain = [], [], []
  for r in range(rounds):
    if r % 2 == 0:
      b, s = run_plain(), run_step()
    else:
      s, b = run_step(), run_plain()
    ratios.append(s / b)
    own.append(s)
    plain.append(b)
  return ratios, own, plain


def against_plain(
  run_step: Callable[[], float],
  run_plain: Callable[[], float],
  rounds: int,
  *,
  temp: int,
  plain_temp: int,
) -> dict[str, Any]:
  """A step against its plain step: their times in paired rounds (:func:`paired_rounds`), and
  their temporary memory.

  Args:
    run_step, run_plain, rounds: as :func:`paired_rounds` takes them.
    temp: the step's temporary memory in bytes (:func:`temp_bytes`).
    plain_temp: the plain step's.

  Returns:
    ``{"paired_time_ratio", "step_seconds", "plain_step_seconds"}``: the
    medians over the rounds of the step's time over the plain step's and of
    each's time; ``{"temp_bytes", "plain_temp_bytes", "temp_ratio"}``: both
    memories and the step's over the plain step's (None when the plain
    step's is 0).
  """
  ratios, own, plain = paired_rounds(run_step, run_plain, rounds)
  return {
    "paired_time_ratio": statistics.median(ratios),
    "step_seconds": statistics.median(own),
    "plain_step_seconds": statistics.median(plain),
    "temp_bytes": temp,
    "plain_temp_bytes": plain_temp,
    "temp_ratio": temp / plain_temp if plain_temp else None,
  }
