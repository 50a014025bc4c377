"""Host: a compile policy, what the Trainer asks at each step about its compiled programs.

A step's plan may run only on compiled programs. How a run copes with a
program still compiling is its *compile policy*, chosen once when the run is
built (:class:`~simigrad_jax.compile.programs.StepPrograms`), each one object
behind the one protocol :class:`CompilePolicy`:

- :class:`ExactPrograms`: a step runs its own plan, waiting for its programs
  if need be (no fallback);
- :class:`~simigrad_jax.compile.schedule.ScheduledFallback`: a step whose
  programs are not admitted yet by the schedule of the step count runs on
  admitted ones, the same whatever the compiles' timing;
- :class:`~simigrad_jax.compile.fallback.TimedFallback`: a step whose
  programs are still compiling runs on compiled ones, never waiting after
  the first step (its trajectory then depends on the machine's load).

Nothing here runs under ``jit``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from simigrad_jax.compile.persistent_cache import cache_record
from simigrad_jax.compile.prefetch import Prefetcher
from simigrad_jax.compile.program_compiler import StepProgramCompiler
from simigrad_jax.compile.step_functions import programs_of
from simigrad_jax.shapes import batch_plan


class CompilePolicy(Protocol):
  """Which compiled programs a step runs on, and which programs compile next.

  The Trainer calls :meth:`start` before a ``train()`` call's first step,
  then at each step :meth:`choose` (once, in step order), waits for the
  chosen plan's programs
  (:meth:`~simigrad_jax.compile.program_compiler.StepProgramCompiler.wait_for`),
  runs it, and calls :meth:`await_fallback`; :meth:`ready_plan` says which
  plan a likely next step would run, so that its rows load ahead. A
  checkpoint keeps :meth:`compiled_programs`; with several processes, every
  step's agreement carries :meth:`compiled_report` and hands every
  process's to :meth:`agree_on_compiles`.
  """

  def start(self, batch_size: int, step: int) -> None:
    """Queues what a run at ``batch_size`` from ``step`` needs first."""
    ...

  def choose(
    self, exact: batch_plan.BatchPlan, step: int, last_step: float
  ) -> batch_plan.BatchPlan:
    """The plan step ``step`` runs for ``exact``: ``exact``, or the same batch on other
    programs; and the compiles that follow the batch queued, those a step up to ``last_step``
    (the last step the run may reach: ``step`` when no step follows, ``math.inf`` when
    unknown) may run."""
    ...

  def ready_plan(
    self, plan: batch_plan.BatchPlan, step: int, prefetch: bool = True
  ) -> batch_plan.BatchPlan:
    """The plan a step of ``plan`` at ``step`` would run, as :meth:`choose` decides it;
    unless ``prefetch`` is False, its programs move ahead of those queued."""
    ...

  def await_fallback(self, micro: int) -> None:
    """After a step of shape ``micro``: waits for what later steps fall back on, if anything."""
    ...

  def compiled_programs(self) -> dict[str, Any] | None:
    """What a checkpoint keeps for a resume (passed back as ``cached_programs``); None:
    nothing."""
    ...

  def compiled_report(self) -> dict[str, int] | None:
    """This process's compiled shapes for the other processes; None when they need none."""
    ...

  def agree_on_compiles(self, reports: Sequence[dict[str, int]]) -> None:
    """Takes every process's :meth:`compiled_report` (the same list on every process)."""
    ...


class ExactPrograms:
  """The compile policy without a fallback: every step runs its own plan, waiting for its programs.

  The programs compile ahead in the order of the
  :class:`~simigrad_jax.compile.prefetch.Prefetcher` (the whole grid, the
  shapes near the batch first); a step's own move ahead of the others.

  Args:
    compiler: the step's compiler.
    prefetcher: the order of the compiles.
    cache_dir: JAX's persistent compilation cache (absolute), or None.

  Example:
    ``ExactPrograms(compiler, prefetcher, None).choose(plan, step, math.inf)``
    is ``plan``, its programs queued first.
  """

  def __init__(
    self, compiler: StepProgramCompiler, prefetcher: Prefetcher, cache_dir: str | None
  ) -> None:
    self._compiler = compiler
    self._prefetcher = prefetcher
    self._cache_dir = cache_dir
    self._cached: dict[str, Any] | None = None  # what the cache held before, as far as known

  def start(self, batch_size: int, step: int) -> None:
    """Queues the programs nearest ``batch_size``'s shape first
    (:meth:`~simigrad_jax.compile.prefetch.Prefetcher.prefetch_for`)."""
    del step
    self._prefetcher.prefetch_for(batch_size)

  def choose(
    self, exact: batch_plan.BatchPlan, step: int, last_step: float
  ) -> batch_plan.BatchPlan:
    """:meth:`ready_plan`'s plan for ``exact``; then, unless ``step`` is the ``last_step``, the
    shapes near ``exact``'s move ahead (the compiles follow the batch)."""
    last = last_step <= step
    plan = self.ready_plan(exact, step, prefetch=not last)
    if not last:
      self._prefetcher.prefetch_near(exact.micro_batch_size)
    return plan

  def ready_plan(
    self, plan: batch_plan.BatchPlan, step: int, prefetch: bool = True
  ) -> batch_plan.BatchPlan:
    """``plan``, whose programs (unless ``prefetch`` is False) move ahead of those queued."""
    del step
    if prefetch:
      self._compiler.prefetch(programs_of(plan), first=True)
    return plan

  def await_fallback(self, micro: int) -> None:
    """Nothing: no step falls back."""
    del micro

  def compiled_programs(self) -> dict[str, Any] | None:
    """What the persistent compilation cache holds from this run
    (:func:`~simigrad_jax.compile.persistent_cache.cache_record`); None without the cache."""
    if self._cache_dir is None:
      return None
    return cache_record(self._cache_dir, self._compiler.view(), self._cached)

  def compiled_report(self) -> dict[str, int] | None:
    """None: every process waits for its own programs."""
    return None

  def agree_on_compiles(self, reports: Sequence[dict[str, int]]) -> None:
    """Nothing to agree on."""
    del reports
