"""Host: the compile fallback: which compiled program runs a step whose own is still compiling.

A *view* of the compiled programs is a dict: ``fused`` and ``micro``, the
shapes (rows per slot) with a one-micro-batch program and with a micro-step;
``apply``, whether the update of accumulated steps is compiled; and in the
views of this run's processes, ``failed_fused`` and ``failed_micro``, the
shapes whose compile failed. :class:`simigrad_jax.compile.programs.
StepPrograms` keeps the views (this process's, what every process compiled:
:mod:`simigrad_jax.compile.agreement`, what the persistent compilation cache
holds from an earlier process:
:func:`simigrad_jax.compile.persistent_cache.cached_view`) and asks the
functions here which plan runs. Nothing here runs under ``jit``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from simigrad_jax.shapes import batch_plan


def is_ready(micro: int, accumulation_steps: int, view: Mapping[str, Any]) -> bool:
  """Whether ``view`` holds the programs that run ``accumulation_steps`` micro-batches of shape
  ``micro``: one micro-batch runs the one-micro-batch program, several the micro-step and the
  update."""
  if accumulation_steps == 1:
    return micro in view["fused"]
  return bool(view["apply"]) and micro in view["micro"]


def waits_for_compile(plan: batch_plan.BatchPlan, view: Mapping[str, Any]) -> bool:
  """Whether ``plan``'s program is still to be compiled (neither compiled nor failed)."""
  failed = view["failed_fused"] if plan.accumulation_steps == 1 else view["failed_micro"]
  needed = plan.micro_batch_size
  return not is_ready(needed, plan.accumulation_steps, view) and needed not in failed


def choose_plan(
  plan: batch_plan.BatchPlan,
  compiled: Mapping[str, Any],
  cached: Mapping[str, Any] | None = None,
) -> batch_plan.BatchPlan:
  """``plan``, or while its program is still compiling, the same batch on a compiled program.

  The replacement is :func:`fallback_plan`'s among ``compiled``. When none
  is compiled that can hold the batch and ``cached`` (the programs the
  persistent cache holds from an earlier process of the run) lacks
  ``plan``'s own, it is :func:`fallback_plan`'s among ``cached``: a load to
  wait for instead of a compile. A plan whose compile failed is kept
  (running it raises).

  Args:
    plan: the exact plan.
    compiled: the view of the compiled programs.
    cached: the view of the programs the cache holds, or None.

  Returns:
    The plan to run.

  Example:
    >>> plan = batch_plan.plan_batch(40, 8, batch_plan.BucketPolicy(8, 1))  # 5 rows, 1 step
    >>> compiled = {"fused": {8}, "micro": set(), "apply": False,
    ...             "failed_fused": set(), "failed_micro": set()}
    >>> choose_plan(plan, compiled).micro_batch_size
    8
  """
  if not waits_for_compile(plan, compiled):
    return plan
  sizes = set(compiled["fused"]) | set(compiled["micro"])
  chosen = fallback_plan(plan, sizes, lambda size, steps: is_ready(size, steps, compiled))
  if (
    chosen is plan
    and cached is not None
    and not is_ready(plan.micro_batch_size, plan.accumulation_steps, cached)
  ):
    sizes = set(cached["fused"]) | set(cached["micro"])
    chosen = fallback_plan(plan, sizes, lambda size, steps: is_ready(size, steps, cached))
  return chosen


def nearest_cached(kind: str, micro: int, cached: Mapping[str, Any] | None) -> int:
  """``micro``, or the nearest shape (log scale; ties: the larger) whose ``kind`` program
  (``"fused"`` or ``"micro"``) ``cached`` holds, when it holds some but not ``micro``'s."""
  sizes = set() if cached is None else cached[kind]
  if not sizes or micro in sizes:
    return micro
  return min(sizes, key=lambda size: (abs(math.log(size / micro)), -size))


def fallback_plan(
  plan: batch_plan.BatchPlan,
  compiled_sizes: set[int],
  ready: Callable[[int, int], bool],
) -> batch_plan.BatchPlan:
  """``plan``'s batch on a compiled shape instead: the fewest micro-steps, then the nearest shape.

  Each shape holds the batch in ``ceil(B / (slots * size))`` micro-steps; of
  the shapes ``ready(size, steps)`` says can run them, those with the
  fewest micro-steps (a micro-step costs more than the padding of a larger
  shape), then the nearest in log scale to ``plan``'s (ties: the larger).

  Args:
    plan: the exact plan, whose shape is not compiled.
    compiled_sizes: the shapes with some program compiled.
    ready: whether a shape's program for that many micro-steps is compiled.

  Returns:
    The replacement plan, or ``plan`` when no shape is ready.

  Example:
    >>> plan = batch_plan.plan_batch(40, 8, batch_plan.BucketPolicy(8, 1))  # 5 rows, 1 step
    >>> fallback_plan(plan, {3, 8}, lambda size, steps: True).micro_batch_size
    8
  """
  n, needed = plan.num_devices, plan.micro_batch_size
  candidates = []
  for size in sorted(compiled_sizes):
    steps = -(-plan.global_batch_size // (n * size))
    if ready(size, steps):
      candidates.append((steps, abs(math.log(size / needed)), -size, size))
  if not candidates:
    return plan
  steps, _, _, size = min(candidates)
  return dataclasses.replace(
    plan,
    micro_batch_size=size,
    accumulation_steps=steps,
    padded_examples=n * size * steps - plan.global_batch_size,
  )
