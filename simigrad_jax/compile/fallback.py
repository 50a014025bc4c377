"""Host: the compile fallback: which compiled program runs a step whose own is still compiling.

A *view* of the compiled programs is a dict keyed by the
:class:`~simigrad_jax.compile.step_functions.Program` names: ``fused`` and
``micro``, the shapes (rows per slot) with a fused step and with a
micro-step; ``apply``, whether the update of accumulated steps is compiled;
and in the views of this run's processes, ``failed_fused`` and
``failed_micro``, the shapes whose compile failed. The views are this
process's
(:meth:`simigrad_jax.compile.program_compiler.StepProgramCompiler.view`),
what every process compiled (:mod:`simigrad_jax.compile.agreement`), what
the persistent compilation cache holds from an earlier process of the run
(:func:`simigrad_jax.compile.persistent_cache.cached_view`) and what the
schedule admitted (:mod:`simigrad_jax.compile.schedule`); the functions here
say which plan runs on them. :class:`TimedFallback`, the compile policy
(:mod:`simigrad_jax.compile.policy`) that asks them of the compiled
programs at each step, is here too. Nothing here runs under ``jit``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from simigrad_jax.compile.agreement import CompileAgreement
from simigrad_jax.compile.compiler import CompileAbandoned
from simigrad_jax.compile.persistent_cache import nearest_cached
from simigrad_jax.compile.policy import ExactPrograms
from simigrad_jax.compile.prefetch import Prefetcher
from simigrad_jax.compile.program_compiler import StepProgramCompiler
from simigrad_jax.compile.step_functions import APPLY
from simigrad_jax.compile.step_functions import Program
from simigrad_jax.compile.step_functions import ProgramShape
from simigrad_jax.compile.step_functions import programs_of
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


class TimedFallback(ExactPrograms):
  """The timed compile policy: a step whose program is still compiling runs on a compiled one, with the same examples.

  Its programs compile in the window of shapes near the batch
  (:class:`~simigrad_jax.compile.prefetch.Prefetcher`); a step's own runs as
  soon as it is compiled. No step waits after the first, but which shape a
  step runs on depends on the compiles' timing, hence so does the run's
  trajectory (:class:`~simigrad_jax.compile.schedule.ScheduledFallback`
  decides it from the step count instead).

  Args:
    compiler: the step's compiler: what this process has compiled, and the
      programs the first step waits for.
    prefetcher: the order of the compiles (the window near the batch).
    cache_dir: JAX's persistent compilation cache (absolute), or None.
    cached: what the persistent cache holds from an earlier process of the
      run (:func:`~simigrad_jax.compile.persistent_cache.cached_view`), or
      None.
    agreement: with several processes, where what EVERY process compiled is
      agreed (a plan is then only replaced by a shape compiled on every one,
      and kept until a first view is agreed); None when this process decides
      alone.

  Example:
    ``TimedFallback(compiler, prefetcher, None, cached=None,
    agreement=None).ready_plan(plan, step)`` is ``plan`` once its program is
    compiled, and until then the same batch on the nearest compiled shape.
  """

  def __init__(
    self,
    compiler: StepProgramCompiler,
    prefetcher: Prefetcher,
    cache_dir: str | None,
    *,
    cached: Mapping[str, Any] | None,
    agreement: CompileAgreement | None,
  ):
    super().__init__(compiler, prefetcher, cache_dir)
    self._cached = None if cached is None else dict(cached)
    self._agreement = agreement
    self._ready = False  # see await_fallback

  def ready_plan(
    self, plan: batch_plan.BatchPlan, step: int, prefetch: bool = True
  ) -> batch_plan.BatchPlan:
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
    del step
    if self._agreement is not None:
      if self._agreement.view is None:
        return plan
      compiled = self._agreement.view
    else:
      compiled = self._compiler.view()
    if prefetch and waits_for_compile(plan, compiled):
      # (a no-op when queued or compiling)
      self._compiler.prefetch(programs_of(plan)[:1])
    return choose_plan(plan, compiled, self._cached)

  def await_fallback(self, micro: int) -> None:
    """Waits until the fallback can hold a batch of any size on shape ``micro``.

    That is the fused step of ``micro``, its micro-step and the update: a
    batch larger than one micro-batch of ``micro`` then accumulates on it.
    Called once, at the first step (which waits for its own program anyway,
    and whose devices run while this waits), so that no later step waits for
    a compile. When the persistent cache holds programs of an earlier
    process of the run (``cached``) but not ``micro``'s, the programs are
    those of its nearest shape instead: loads, not compiles. The time
    blocked counts as compile wait. A no-op once done, and given up (no
    error) when the compiler's interrupt says so: the run is stopping, and
    the later steps that would use them will not run.
    """
    if self._ready:
      return
    try:
      self._compiler.get(ProgramShape(Program.FUSED, nearest_cached("fused", micro, self._cached)))
      self._compiler.get(ProgramShape(Program.MICRO, nearest_cached("micro", micro, self._cached)))
      self._compiler.get(APPLY)
    except CompileAbandoned:
      return
    self._ready = True

  def compiled_report(self) -> dict[str, int] | None:
    """This process's compiled shapes for the other processes, as bitmasks over the layout's
    grid (:func:`~simigrad_jax.compile.agreement.report_bitmasks`); None with one process."""
    if self._agreement is None:
      return None
    return self._agreement.report(self._compiler.view())

  def agree_on_compiles(self, reports: Sequence[dict[str, int]]) -> None:
    """Sets the view :meth:`ready_plan` uses to what EVERY process reported compiled; every
    process passes the same ``reports``, one per process
    (:meth:`~simigrad_jax.compile.agreement.CompileAgreement.agree`)."""
    if self._agreement is not None:
      self._agreement.agree(reports)
