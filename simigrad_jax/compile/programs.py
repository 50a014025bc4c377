"""Host: the compiled programs of a training step, and the compile policy chosen for a run.

A step of one micro-batch per device runs ONE compiled program, the fused
step (gradient, reduction and update:
:func:`simigrad_jax.ingraph.train_step.make_fused_step`), one per micro-batch
shape of the grid. A step of several micro-batches accumulates with the
micro-step of its shape, then applies the update
(:func:`~simigrad_jax.ingraph.train_step.make_micro_step` and
:func:`~simigrad_jax.ingraph.train_step.make_apply_step`); the three are the
:class:`~simigrad_jax.compile.step_functions.Program` members. Every program
is compiled ahead of time from placeholders, in background threads, by one
compiler keyed by program and shape
(:class:`~simigrad_jax.compile.program_compiler.StepProgramCompiler`), so
that a new shape need not stall the loop.

While a step's program is not ready, the run's compile policy
(:mod:`simigrad_jax.compile.policy`) decides what the step runs: its own
plan, waiting (:class:`~simigrad_jax.compile.policy.ExactPrograms`, without
a fallback); the same examples on a shape the schedule of the step count has
admitted (:class:`~simigrad_jax.compile.schedule.ScheduledFallback`), so
that a run's trajectory does not depend on how fast its compiles are; or
with ``timed_fallback``, on a shape compiled by now
(:class:`~simigrad_jax.compile.fallback.TimedFallback`: never a wait after
the first step, but the trajectory then depends on the machine's load).

:class:`StepPrograms` is what the Trainer holds: the four pieces of this
room a step uses, each one thing: the jitted functions and their tracing
(:mod:`~simigrad_jax.compile.step_functions`) and their compiler
(:mod:`~simigrad_jax.compile.program_compiler`), which it is given
(:func:`step_compiler`), and the compile policy and the runner of a step's
plan (:mod:`~simigrad_jax.compile.step_runner`), which it builds once. The policy's pieces are the
order of the compiles (:mod:`~simigrad_jax.compile.prefetch`), the
agreement across processes (:mod:`~simigrad_jax.compile.agreement`) and the
record of the persistent cache
(:mod:`~simigrad_jax.compile.persistent_cache`).

Shapes are counted in rows per slot: a slot is a device, or with the local
split one of the two blocks of a device's rows
(:mod:`simigrad_jax.shapes.layout`); what is reported is rows per device.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from simigrad_jax.compile.agreement import CompileAgreement
from simigrad_jax.compile.fallback import TimedFallback
from simigrad_jax.compile.persistent_cache import cached_view
from simigrad_jax.compile.policy import CompilePolicy
from simigrad_jax.compile.policy import ExactPrograms
from simigrad_jax.compile.prefetch import Prefetcher
from simigrad_jax.compile.program_compiler import StepProgramCompiler
from simigrad_jax.compile.schedule import CompileSchedule
from simigrad_jax.compile.schedule import ScheduledFallback
from simigrad_jax.compile.step_functions import StepFunctions
from simigrad_jax.compile.step_runner import StepRunner
from simigrad_jax.shapes.layout import StepLayout


class StepPrograms:
  """The programs of a data-parallel training step for every micro-batch shape: their functions,
  compiler, compile policy and runner.

  Args:
    compiler: the step's compiler (:func:`step_compiler`); its functions are
      the step's, and their mesh, data axis and layout are the runner's and
      the policy's. It may have started on the first step's program while the
      run was set up (:class:`~simigrad_jax.compile.first_program.FirstProgram`).
    accumulation_shapes: the shapes (rows per slot) a planned step of several
      micro-batches can use (their micro-steps and the update are then
      compiled in the background from the start; the others only when the
      fallback or a plan first needs them).
    compile_fallback: let the policy replace a plan whose program is not
      ready.
    steps_per_compile: the steps the schedule gives each program it admits
      (:class:`~simigrad_jax.compile.schedule.CompileSchedule`): a plan is
      replaced by the step count, the same whatever the compiles' timing;
      None (the timed fallback): while its program is still compiling.
    shared_compiles: several processes run the steps together; with the
      timed fallback a plan may then only be replaced by a shape compiled on
      every one of them (the policy's view is what every process reported at
      the last step's agreement), and the exact shape is waited for until a
      first view is agreed. (The schedule is the same on every process.)
    compilation_cache_dir: JAX's persistent compilation cache, if on.
    cached_programs: what an earlier process of the run compiled into that
      cache, as the policy's ``compiled_programs()`` said (from the
      checkpoint a run resumes). With the timed fallback and one process,
      those programs load first, and a step that no compiled program can run
      yet (the first) runs on one of them rather than wait for a compile.
      Ignored when it names another cache. Its ``"schedule"`` restores the
      schedule of the run's steps.
    fixed_batch: the run's batch size cannot move (its bounds are one size):
      the schedule compiles its plan's programs alone
      (:class:`~simigrad_jax.compile.schedule.CompileSchedule`).

  Attributes:
    functions: the step's jitted functions
      (:class:`~simigrad_jax.compile.step_functions.StepFunctions`):
      ``functions.trace(micro)`` fails in seconds, with a ValueError, on a
      model, loss, optimizer or data set that do not fit each other.
    compiler: their compiler
      (:class:`~simigrad_jax.compile.program_compiler.StepProgramCompiler`):
      a plan's programs waited for, the totals, a program's memory.
    policy: the run's compile policy
      (:class:`~simigrad_jax.compile.policy.CompilePolicy`), chosen here once.
    runner: runs a step's plan on its programs
      (:class:`~simigrad_jax.compile.step_runner.StepRunner`).

  Example:
    The Trainer builds one (:mod:`simigrad_jax.trainer.run_setup`), calls
    ``functions.trace`` once and ``policy.start`` before each ``train()``
    call's first step, then at each step ``policy.choose``,
    ``compiler.wait_for``, ``runner.run`` and ``policy.await_fallback``.
  """

  def __init__(
    self,
    compiler: StepProgramCompiler,
    *,
    accumulation_shapes: list[int],
    compile_fallback: bool,
    steps_per_compile: float | None = None,
    shared_compiles: bool = False,
    compilation_cache_dir: str | os.PathLike | None = None,
    cached_programs: Mapping[str, Any] | None = None,
    fixed_batch: bool = False,
  ):
    self.functions, self.compiler = compiler.functions, compiler
    layout = self.functions.layout
    cache_dir = None if compilation_cache_dir is None else os.path.abspath(compilation_cache_dir)
    self.policy = compile_policy(
      self.compiler,
      layout,
      accumulation_shapes,
      compile_fallback=compile_fallback,
      steps_per_compile=steps_per_compile,
      shared_compiles=shared_compiles,
      cache_dir=cache_dir,
      cached_programs=cached_programs,
      fixed_batch=fixed_batch,
    )
    self.runner = StepRunner(self.compiler)


def step_compiler(
  functions: StepFunctions, *, background: bool, threads: int
) -> StepProgramCompiler:
  """The compiler of the step's jitted functions, on their layout.

  Args:
    functions: the step's functions
      (:class:`~simigrad_jax.compile.step_functions.StepFunctions`, made from
      the state's shapes, dtypes and shardings: the state itself or its
      placeholders).
    background: compile in background threads.
    threads: the compiles of one program (the fused steps, or the
      micro-steps) that run at once.

  Returns:
    The compiler :class:`StepPrograms` takes.
  """
  return StepProgramCompiler(functions, functions.layout, background=background, threads=threads)


def compile_policy(
  compiler: StepProgramCompiler,
  layout: StepLayout,
  accumulation_shapes: list[int],
  *,
  compile_fallback: bool,
  steps_per_compile: float | None,
  shared_compiles: bool,
  cache_dir: str | None,
  cached_programs: Mapping[str, Any] | None,
  fixed_batch: bool = False,
) -> CompilePolicy:
  """The run's compile policy: without ``compile_fallback``, :class:`ExactPrograms`; with it,
  the schedule of ``steps_per_compile`` (:class:`ScheduledFallback`, its state restored from
  ``cached_programs``), or when that is None the timed fallback (:class:`TimedFallback`).

  Args:
    compiler: the step's compiler.
    layout: the step layout.
    accumulation_shapes: the shapes a planned step of several micro-batches can use.
    compile_fallback: whether a plan whose program is not ready may be replaced.
    steps_per_compile: the schedule's steps per program, or None: the timed fallback.
    shared_compiles: several processes run the steps together.
    cache_dir: JAX's persistent compilation cache (absolute), or None.
    cached_programs: the record a resumed checkpoint holds, or None.
    fixed_batch: the run's batch size cannot move: the schedule admits its
      plan's programs alone.

  Returns:
    The policy the Trainer asks at each step.
  """
  if compile_fallback and steps_per_compile is not None:
    schedule = CompileSchedule(layout, steps_per_compile, accumulation_shapes, fixed_batch)
    schedule.load_state_dict((cached_programs or {}).get("schedule"))
    return ScheduledFallback(compiler, schedule, layout, cache_dir)
  # What the cache holds from an earlier process of the run: loads, not compiles.
  timed_alone = compile_fallback and not shared_compiles
  cached = cached_view(cached_programs, cache_dir, set(layout.grid)) if timed_alone else None
  prefetcher = Prefetcher(
    compiler, layout, accumulation_shapes, compile_fallback=compile_fallback, cached=cached
  )
  if not compile_fallback:
    return ExactPrograms(compiler, prefetcher, cache_dir)
  agreement = CompileAgreement(layout.grid) if shared_compiles else None
  return TimedFallback(compiler, prefetcher, cache_dir, cached=cached, agreement=agreement)
