"""Host: the compile fallback: which compiled program runs a step whose own is still compiling.

A *view* of the compiled programs is a dict: ``fused`` and ``micro``, the
shapes (rows per slot) with a one-micro-batch program and with a micro-step;
``apply``, whether the update of accumulated steps is compiled; and in the
views of this run's processes, ``failed_fused`` and ``failed_micro``, the
shapes whose compile failed. The views are this process's
(:meth:`simigrad_jax.compile.step_compilers.StepCompilers.view`), what every
process compiled (:mod:`simigrad_jax.compile.agreement`) and what the
persistent compilation cache holds from an earlier process of the run
(:func:`simigrad_jax.compile.persistent_cache.cached_view`); the functions
here say which plan runs on them, and :class:`CompileFallback` asks them at
each step. Nothing here runs under ``jit``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from simigrad_jax.compile.agreement import CompileAgreement
from simigrad_jax.compile.step_compilers import StepCompilers
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


class CompileFallback:
  """Runs a step whose program is still compiling on a compiled one instead, with the same examples.

  Args:
    compilers: the step's compilers: what this process has compiled, and the
      programs the first step waits for.
    cached: what the persistent cache holds from an earlier process of the
      run (:func:`~simigrad_jax.compile.persistent_cache.cached_view`), or
      None.
    agreement: with several processes, where what EVERY process compiled is
      agreed (a plan is then only replaced by a shape compiled on every one,
      and kept until a first view is agreed); None when this process decides
      alone.

  Example:
    ``CompileFallback(compilers, cached=None, agreement=None).ready_plan(plan)``
    is ``plan`` once its program is compiled, and until then the same batch
    on the nearest compiled shape.
  """

  def __init__(
    self,
    compilers: StepCompilers,
    *,
    cached: Mapping[str, Any] | None,
    agreement: CompileAgreement | None,
  ):
    self._compilers = compilers
    self._cached = cached
    self._agreement = agreement
    self._ready = False  # see await_fallback

  def ready_plan(self, plan: batch_plan.BatchPlan, prefetch: bool = True) -> batch_plan.BatchPlan:
    """``plan``, or while its program is still compiling, the same batch on the nearest compiled one.

    The compiled shape that holds the batch in the fewest micro-steps, the
    nearest in log scale among those (ties: the larger shape): a larger
    shape pads with zero-weight rows, a smaller one accumulates
    (:func:`choose_plan`). The examples and their devices are those of
    ``plan``. A shape whose compile FAILED is not replaced: running it
    raises. With an ``agreement``, "compiled" means compiled on every
    process, as its last view says. A program not compiled yet is queued for
    compiling unless ``prefetch`` is False (the run's last step).
    """
    if self._agreement is not None:
      if self._agreement.view is None:
        return plan
      compiled = self._agreement.view
    else:
      compiled = self._compilers.view()
    if prefetch and waits_for_compile(plan, compiled):
      # (a no-op when queued or compiling)
      one_step = plan.accumulation_steps == 1
      compiler = self._compilers.fused if one_step else self._compilers.micro
      compiler.prefetch([plan.micro_batch_size])
    return choose_plan(plan, compiled, self._cached)

  def await_fallback(self, micro: int) -> None:
    """Waits until the fallback can hold a batch of any size on shape ``micro``.

    That is the one-micro-batch program of ``micro``, its micro-step and the
    update: a batch larger than one micro-batch of ``micro`` then accumulates
    on it. Called once, at the first step (which waits for its own program
    anyway, and whose devices run while this waits), so that no later step
    waits for a compile. When the persistent cache holds programs of an
    earlier process of the run (``cached``) but not ``micro``'s, the
    programs are those of its nearest shape instead: loads, not compiles.
    The time blocked counts as compile wait. A no-op once done.
    """
    if self._ready:
      return
    self._compilers.fused.get(nearest_cached("fused", micro, self._cached))
    self._compilers.micro.get(nearest_cached("micro", micro, self._cached))
    self._compilers.update.get()
    self._ready = True
