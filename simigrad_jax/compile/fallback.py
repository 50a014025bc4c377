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

import math
from collections.abc import Mapping, Sequence
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

# A fallback step runs at most this many micro-steps (or its own plan's count, if more) where a
# plan within it holds the batch; past it, the fewest micro-steps the admitted programs allow.
FALLBACK_MICRO_STEPS = 4


def _holds(program: ProgramShape, view: Mapping[str, Any], key: str = "") -> bool:
  """Whether ``view``'s ``key`` programs (the compiled ones, or with ``"failed_"`` the failed)
  hold ``program``."""
  kind, size = program
  if program == APPLY:
    return not key and bool(view["apply"])
  return size in view[key + ("fused" if kind is Program.FUSED else "micro")]


def settled(program: ProgramShape, view: Mapping[str, Any]) -> bool:
  """Whether ``program``'s compile has ended in ``view``: compiled, or failed.

  Example:
    >>> view = {"fused": {4}, "micro": set(), "apply": False,
    ...         "failed_fused": set(), "failed_micro": {1}}
    >>> settled(ProgramShape(Program.FUSED, 4), view), settled(ProgramShape(Program.MICRO, 1), view)
    (True, True)
    >>> settled(APPLY, view)
    False
  """
  return _holds(program, view) or _holds(program, view, "failed_")


def plan_ready(plan: batch_plan.BatchPlan, view: Mapping[str, Any]) -> bool:
  """Whether ``view`` holds every program a step of ``plan`` runs: its shape's one-micro-batch
  program, or the micro-step of each of its shapes and the update."""
  return all(_holds(program, view) for program in programs_of(plan))


def waits_for_compile(plan: batch_plan.BatchPlan, view: Mapping[str, Any]) -> bool:
  """Whether ``plan``'s programs are still to be compiled (not all compiled, none failed)."""
  programs = programs_of(plan)
  failed = any(_holds(program, view, "failed_") for program in programs)
  return not failed and not all(_holds(program, view) for program in programs)


def choose_plan(
  plan: batch_plan.BatchPlan,
  compiled: Mapping[str, Any],
  cached: Mapping[str, Any] | None = None,
) -> batch_plan.BatchPlan:
  """``plan``, or while its programs are still compiling, the same batch on compiled programs.

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
  chosen = fallback_plan(plan, compiled)
  if chosen is plan and cached is not None and not plan_ready(plan, cached):
    chosen = fallback_plan(plan, cached)
  return chosen


def fallback_plan(plan: batch_plan.BatchPlan, view: Mapping[str, Any]) -> batch_plan.BatchPlan:
  """``plan``'s batch on the programs ``view`` holds instead: padding least in a bounded number
  of micro-steps.

  The candidates are one micro-batch of a shape with a one-micro-batch
  program, and, with the update, micro-steps of one shape with a micro-step
  or of several (the largest first, the rest on smaller ones:
  :func:`~simigrad_jax.shapes.batch_plan.step_shapes`). Of those within
  :data:`FALLBACK_MICRO_STEPS` micro-steps (or ``plan``'s own count, if
  more), the one that pads least, then the fewest micro-steps, then the
  nearest in log scale to ``plan``'s shape (ties: the larger); when none is
  within, the fewest micro-steps. So a batch accumulates on a smaller shape
  where that pads less, rather than padding a larger one.

  Args:
    plan: the exact plan, whose programs are not all in ``view``.
    view: the programs that may run (a view: see the module docstring).

  Returns:
    The replacement plan, or ``plan`` when nothing in ``view`` can hold the batch.

  Example:
    >>> plan = batch_plan.plan_batch(40, 8, batch_plan.BucketPolicy(8, 1))  # 5 rows, 1 step
    >>> view = {"fused": {3, 8}, "micro": {3, 8}, "apply": True}
    >>> fallback_plan(plan, view).shapes  # 2 x 3 rows pad less than 8
    (3, 3)
  """
  n, batch = plan.num_devices, plan.global_batch_size
  rows = -(-batch // n)
  candidates: set[tuple[int, ...]] = {(size,) for size in view["fused"] if size >= rows}
  micro = tuple(sorted(view["micro"])) if view["apply"] else ()
  for size in micro:
    candidates.add((size,) * -(-rows // size))
  for parts in range(1, batch_plan.MAX_SHAPES_PER_STEP + 1) if micro else ():
    candidates.add(batch_plan.step_shapes(rows, micro, parts))
  # One micro-batch runs the one-micro-batch program: only a shape that has one.
  candidates = {shapes for shapes in candidates if len(shapes) > 1 or shapes[0] in view["fused"]}
  if not candidates:
    return plan
  bound = max(FALLBACK_MICRO_STEPS, plan.accumulation_steps)

  def preference(shapes: tuple[int, ...]) -> tuple[Any, ...]:
    distance = abs(math.log(shapes[0] / plan.micro_batch_size))
    if len(shapes) <= bound:
      return (0, sum(shapes), len(shapes), distance, -shapes[0])
    return (1, len(shapes), sum(shapes), distance, -shapes[0])

  return batch_plan.plan_on_shapes(
    plan.requested_batch_size, batch, n, min(candidates, key=preference)
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
