"""Host: the compiled programs of a training step, per micro-batch shape, and running a plan.

A step of one micro-batch per device runs ONE compiled program (gradient,
reduction and update: :func:`simigrad_jax.ingraph.train_step.make_fused_step`),
one per micro-batch shape of the grid. A step of several micro-batches
accumulates with the micro-step of its shape, then applies the update
(:func:`~simigrad_jax.ingraph.train_step.make_micro_step` and
:func:`~simigrad_jax.ingraph.train_step.make_apply_step`). Every program is
compiled ahead of time from placeholders, in background threads
(:class:`simigrad_jax.compile.StepCompiler`), so that a new shape need not stall the
loop; while a step's program is not ready, the compile fallback runs the same
examples on another compiled shape. Which programs are ready is decided from
the step count (:mod:`~simigrad_jax.compile.schedule`), so that a run's
trajectory does not depend on how fast its compiles are; ``timed_fallback``
decides it from the compiles' timing instead (never a wait after the first
step, but the trajectory then depends on the machine's load).

:class:`StepPrograms` is what the Trainer holds; it composes the pieces of
this room, each one thing: the jitted functions and their tracing
(:mod:`~simigrad_jax.compile.step_functions`), their compilers
(:mod:`~simigrad_jax.compile.step_compilers`), the order of the compiles
(:mod:`~simigrad_jax.compile.prefetch`), the fallback
(:mod:`~simigrad_jax.compile.fallback`) and its schedule
(:mod:`~simigrad_jax.compile.schedule`), the agreement across processes
(:mod:`~simigrad_jax.compile.agreement`), the record of the persistent cache
(:mod:`~simigrad_jax.compile.persistent_cache`) and running a step
(:mod:`~simigrad_jax.compile.step_runner`).

Shapes are counted in rows per slot: a slot is a device, or with the local
split one of the two blocks of a device's rows
(:mod:`simigrad_jax.shapes.layout`); what is reported is rows per device.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import optax
from jax.sharding import Mesh

from simigrad_jax.compile.agreement import CompileAgreement
from simigrad_jax.compile.compiler import CompileAbandoned
from simigrad_jax.compile.fallback import CompileFallback
from simigrad_jax.compile.persistent_cache import cache_record
from simigrad_jax.compile.persistent_cache import cached_view
from simigrad_jax.compile.prefetch import Prefetcher
from simigrad_jax.compile.schedule import CompileSchedule
from simigrad_jax.compile.schedule import programs_of
from simigrad_jax.compile.step_compilers import StepCompilers
from simigrad_jax.compile.step_functions import StepFunctions
from simigrad_jax.compile.step_runner import StepRunner
from simigrad_jax.data.data_loader import StepBatch
from simigrad_jax.ingraph import train_step
from simigrad_jax.shapes import batch_plan
from simigrad_jax.shapes.layout import StepLayout


class StepPrograms:
  """Compiles and runs the programs of a data-parallel training step for every micro-batch shape.

  Args:
    loss_fn: the per-example loss (see :class:`simigrad_jax.Trainer`), already
      checked.
    optimizer: the optax optimizer, with :func:`simigrad_jax.transform` over
      ``axis_name`` and :func:`simigrad_jax.scale_by_lr_factor`.
    mesh: the mesh; its axis ``axis_name`` holds the data-parallel devices
      (the slots), its other axes, if any, the model's shards.
    axis_name: the data axis.
    layout: the step layout (halves, slots); shapes (``micro``) are in
      rows per slot.
    seed: the run's seed (per-step random keys derive from it).
    state: the ``{"params", "opt_state", "model_state"}`` on the mesh (its
      shapes, dtypes and shardings make the placeholders and the shardings
      the steps keep; nothing else is kept).
    element_spec: the source's ``{name: (shape, dtype)}`` per example.
    accumulation_shapes: the shapes (rows per slot) a planned step of several
      micro-batches can use (their micro-steps and the update are then
      compiled in the background from the start; the others only when the
      fallback or a plan first needs them).
    background: compile in background threads.
    compile_fallback: let :meth:`choose` replace a plan whose program is
      not ready.
    steps_per_compile: the steps the schedule gives each program it admits
      (:class:`~simigrad_jax.compile.schedule.CompileSchedule`): a plan is
      replaced by the step count, the same whatever the compiles' timing;
      None (the timed fallback): while its program is still compiling.
    shared_compiles: several processes run the steps together; with the
      timed fallback a plan may then only be replaced by a shape compiled on
      every one of them: :meth:`choose` uses the view that
      :meth:`agree_on_compiles` last set from every process's
      :meth:`compiled_report`, and waits for the exact shape until a first
      view is set. (The schedule is the same on every process.)
    compilation_cache_dir: JAX's persistent compilation cache, if on.
    cached_programs: what an earlier process of the run compiled into that
      cache, as its :meth:`compiled_programs` said (from the checkpoint a
      run resumes). With the fallback and one process, those programs load
      first, and a step that no compiled program can run yet (the first)
      runs on one of them rather than wait for a compile (with the timed
      fallback). Ignored when it names another cache. Its ``"schedule"``
      restores the schedule of the run's steps.

  Attributes:
    fused_compiler: the :class:`~simigrad_jax.compile.compiler.StepCompiler`
      of the one-micro-batch programs.
    micro_compiler: that of the micro-steps.

  Raises:
    ValueError: when ``loss_fn``, the optimizer and the data do not fit each
      other; found by tracing the first shape's program (see :meth:`trace`).

  Example:
    The Trainer builds one (:mod:`simigrad_jax.trainer.run_setup`), calls
    :meth:`trace` and :meth:`start` once, then at each step :meth:`choose`,
    :meth:`wait_for`, :meth:`run` and :meth:`await_fallback`.
  """

  def __init__(
    self,
    *,
    loss_fn: train_step.PerExampleLossFn,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    axis_name: str,
    layout: StepLayout,
    seed: int,
    state: Mapping[str, Any],
    element_spec: Mapping[str, tuple[Any, Any]],
    accumulation_shapes: list[int],
    background: bool,
    compile_fallback: bool,
    steps_per_compile: float | None = None,
    shared_compiles: bool = False,
    compilation_cache_dir: str | os.PathLike | None = None,
    cached_programs: Mapping[str, Any] | None = None,
  ):
    self._functions = StepFunctions(
      loss_fn=loss_fn,
      optimizer=optimizer,
      mesh=mesh,
      axis_name=axis_name,
      layout=layout,
      seed=seed,
      state=state,
      element_spec=element_spec,
    )
    self._compilers = StepCompilers(self._functions, layout, background=background)
    self.fused_compiler, self.micro_compiler = self._compilers.fused, self._compilers.micro
    self._layout = layout
    self._schedule = None
    if compile_fallback and steps_per_compile is not None:
      self._schedule = CompileSchedule(layout, steps_per_compile, accumulation_shapes)
      self._schedule.load_state_dict((cached_programs or {}).get("schedule"))
    scheduled = self._schedule is not None
    self._shared_compiles = shared_compiles and compile_fallback and not scheduled
    self._agreement = CompileAgreement(layout.grid)
    self._cache_dir = (
      None if compilation_cache_dir is None else os.path.abspath(compilation_cache_dir)
    )
    # What the cache holds from an earlier process of the run: loads, not compiles.
    self._cached = (
      cached_view(cached_programs, self._cache_dir, set(layout.grid))
      if compile_fallback and not self._shared_compiles and not scheduled
      else None
    )
    self._fallback = (  # the timed fallback's (with the schedule a step waits for what it runs)
      CompileFallback(
        self._compilers,
        cached=self._cached,
        agreement=self._agreement if self._shared_compiles else None,
      )
      if compile_fallback and not scheduled
      else None
    )
    self._prefetcher = Prefetcher(
      self._compilers,
      layout,
      accumulation_shapes,
      compile_fallback=compile_fallback,
      cached=self._cached,
    )
    self._runner = StepRunner(self._compilers, mesh, axis_name, layout.halves)

  def trace(self, micro: int) -> None:
    """Traces (does not compile) the one-micro-batch program of shape ``micro``
    (:meth:`~simigrad_jax.compile.step_functions.StepFunctions.trace`): a model, loss, optimizer
    or data set that do not fit each other fail here in seconds, with a ValueError."""
    self._functions.trace(micro)

  def start(self, batch_size: int, step: int) -> None:
    """Queues for the background compilers what a run at ``batch_size`` from ``step`` needs:
    with the schedule, the programs it admits (a new run's first plan and its fallback, a resumed
    run's as saved), those near the batch first; else the prefetcher's
    (:meth:`~simigrad_jax.compile.prefetch.Prefetcher.prefetch_for`)."""
    if self._schedule is None:
      return self._prefetcher.prefetch_for(batch_size)
    plan = self._layout.plan(batch_size)
    admitted = self._schedule.start(plan, step)
    self._compilers.queue([p for p in self._schedule.near(plan) if p in admitted] + admitted)

  def choose(self, exact: batch_plan.BatchPlan, step: int, last: bool) -> batch_plan.BatchPlan:
    """The plan step ``step`` runs: ``exact``, or the fallback's (:meth:`ready_plan`); and the
    compiles that follow the batch queued, unless the step is the run's ``last``.

    Call it once a step, in step order: the schedule requests the programs
    near ``exact``'s shape at ``step``.
    """
    if self._schedule is not None:
      plan = self._schedule.choose(exact, step)
      requested = self._schedule.advance(exact, step)
      if not last:  # in the order they become usable (the next step's likely plans go ahead)
        self._compilers.queue(requested)
      return plan
    plan = self.ready_plan(exact, step, prefetch=not last)
    if not last:
      self._prefetcher.prefetch_near(exact.micro_batch_size)  # the compiles follow the batch
    return plan

  def ready_plan(
    self, plan: batch_plan.BatchPlan, step: int, prefetch: bool = True
  ) -> batch_plan.BatchPlan:
    """``plan``, or the same batch on other programs when its own are not ready at ``step``.

    With the schedule, ready means admitted at ``step``
    (:meth:`~simigrad_jax.compile.schedule.CompileSchedule.choose`); with the
    timed fallback, compiled now
    (:meth:`~simigrad_jax.compile.fallback.CompileFallback.ready_plan`,
    which queues the compile unless ``prefetch`` is False); ``plan`` without
    the fallback. Else, unless ``prefetch`` is False, the programs of the plan
    returned (a step's, or the next one's likely) move ahead of those queued.
    """
    if self._schedule is None and self._fallback is not None:
      return self._fallback.ready_plan(plan, prefetch)
    chosen = plan if self._schedule is None else self._schedule.choose(plan, step)
    if prefetch:
      self._compilers.queue(programs_of(chosen), first=True)
    return chosen

  def wait_for(self, plan: batch_plan.BatchPlan) -> None:
    """Waits until ``plan``'s programs are compiled
    (:meth:`~simigrad_jax.compile.step_compilers.StepCompilers.wait_for`)."""
    self._compilers.wait_for(plan)

  def set_interrupt(self, interrupt: Any) -> None:
    """Makes a wait for a compile give up when ``interrupt()`` says so
    (:meth:`~simigrad_jax.compile.step_compilers.StepCompilers.set_interrupt`)."""
    self._compilers.set_interrupt(interrupt)

  def await_fallback(self, micro: int) -> None:
    """Waits, once, until the fallback can hold a batch of any size on shape ``micro``
    (:meth:`~simigrad_jax.compile.fallback.CompileFallback.await_fallback`): the timed
    fallback's; a no-op without it (with the schedule a step waits only for the programs it
    runs), and given up (no error) when the interrupt says so."""
    if self._fallback is not None:
      try:
        self._fallback.await_fallback(micro)
      except CompileAbandoned:
        pass  # the run is stopping: the later steps that would use them will not run

  def compiled_programs(self) -> dict[str, Any] | None:
    """What the persistent compilation cache holds from this run
    (:func:`~simigrad_jax.compile.persistent_cache.cache_record`) and the schedule's state, for
    its checkpoints: pass it as ``cached_programs`` when the run resumes; None with neither."""
    record: dict[str, Any] = {}
    if self._cache_dir is not None:
      record = cache_record(self._cache_dir, self._compilers.view(), self._cached)
    if self._schedule is not None:
      record["schedule"] = self._schedule.state_dict()
    return record or None

  def compiled_report(self) -> dict[str, int] | None:
    """This process's compiled shapes for the other processes, as bitmasks over the layout's
    grid (:func:`~simigrad_jax.compile.agreement.report_bitmasks`); None unless
    ``shared_compiles``."""
    if not self._shared_compiles:
      return None
    return self._agreement.report(self._compilers.view())

  def agree_on_compiles(self, reports: list[dict[str, int]]) -> None:
    """Sets the view :meth:`ready_plan` uses to what EVERY process reported compiled; every
    process passes the same ``reports``, one per process
    (:meth:`~simigrad_jax.compile.agreement.CompileAgreement.agree`)."""
    self._agreement.agree(reports)

  def run(
    self, state: Mapping[str, Any], data: StepBatch, scalars: train_step.StepScalars
  ) -> tuple[dict[str, Any], train_step.StepMeasurements]:
    """Dispatches one optimizer step; returns the new state (``state`` is donated) and its
    measurements, not waited for (:meth:`~simigrad_jax.compile.step_runner.StepRunner.run`)."""
    return self._runner.run(state, data, scalars)

  def memory(self, micro: int) -> dict[str, int]:
    """Compiled memory of the one-micro-batch program of shape ``micro``, compiling it if needed
    (:meth:`~simigrad_jax.compile.step_compilers.StepCompilers.memory`)."""
    return self._compilers.memory(micro)

  def wait_seconds(self) -> float:
    """Seconds steps have waited for compiles so far (cheap enough for every step)."""
    return self._compilers.wait_seconds()

  def stats(self) -> dict[str, Any]:
    """Compiles so far, their seconds, the seconds steps waited, and the compiled shapes
    (:meth:`~simigrad_jax.compile.step_compilers.StepCompilers.stats`)."""
    return self._compilers.stats()

  def close(self) -> None:
    """Cancels queued compiles and abandons those in progress (returns at once)."""
    self._compilers.close()
