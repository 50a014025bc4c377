"""Host: which compiled programs a step may run on, decided from the step count, never the clock.

The compile fallback (:mod:`simigrad_jax.compile.fallback`) runs a step whose
own program is not ready on another compiled shape. Which shape that is
changes the step's floating-point sums, hence its similarity and every later
batch size; so if it followed the compiles' timing, a run's trajectory would
depend on the machine's load, and a resumed run would differ from one never
interrupted. :class:`CompileSchedule` makes it a function of the run's steps
alone: a program becomes *admitted* (a step may run on it) a fixed number of
steps after it was first requested, as if one compiler compiled the requests
in order, ``steps_per_compile`` steps each. A step runs its own plan when its
programs are admitted, else the fallback among the admitted ones; a step that
needs an admitted program whose real compile has not finished waits for it.
The schedule's state is saved in every checkpoint, so a resumed run admits
the same programs at the same steps. :class:`ScheduledFallback` is the
compile policy (:mod:`simigrad_jax.compile.policy`) that runs a run's steps by
it. Nothing here runs under ``jit``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from simigrad_jax.compile.fallback import choose_plan
from simigrad_jax.compile.fallback import fallback_plan
from simigrad_jax.compile.fallback import settled
from simigrad_jax.compile.persistent_cache import cache_record
from simigrad_jax.compile.program_compiler import StepProgramCompiler
from simigrad_jax.compile.step_functions import APPLY
from simigrad_jax.compile.step_functions import Program
from simigrad_jax.compile.step_functions import ProgramShape
from simigrad_jax.compile.step_functions import programs_of
from simigrad_jax.shapes import batch_plan
from simigrad_jax.shapes.layout import COMPILE_WINDOW_OCTAVES
from simigrad_jax.shapes.layout import StepLayout

logger = logging.getLogger("simigrad_jax")


def starts_accumulating(layout: StepLayout) -> bool:
  """Whether a new run's first step accumulates (micro-steps of the grid's smallest shape and the
  update) rather than running its shape's fused step: with steps of several shapes on a grid of
  several shapes.

  Such a run needs that micro-step and the update from its first steps
  whatever the first step runs: the fallback accumulates any batch on the
  smallest shape, and a batch between two shapes accumulates. Starting on
  them, the first steps wait for those two programs, compiled side by side
  (each smaller than a fused step), rather than for the fused step with both
  compiling beside it; the first step's fused program is requested like any
  other, ``steps_per_compile`` steps later. A run on one shape (a batch held
  fixed) or with steps on one shape starts on its fused step, as many
  programs as it needs.

  Example:
    >>> from simigrad_jax.shapes.layout import StepLayout
    >>> layout = StepLayout.create("device", 8, mode="recompile", max_micro=8, min_micro=None,
    ...                            shapes_per_step=3, lower=8, upper=64)
    >>> starts_accumulating(layout)
    True
  """
  return layout.policy.shapes_per_step > 1 and len(layout.grid) > 1


def first_step_programs(
  layout: StepLayout, plan: batch_plan.BatchPlan, fixed_batch: bool = False
) -> list[ProgramShape]:
  """The programs a new run's first step runs, for its first ``plan``: its own
  (:func:`~simigrad_jax.compile.step_functions.programs_of`), or when the run
  :func:`starts_accumulating` and ``plan`` is one micro-batch, the fallback's plan of the same
  batch on the grid's smallest shape's micro-step and the update (a batch of one micro-batch of
  the smallest shape has no such plan: its fused step). A ``fixed_batch`` (one the run cannot
  move) runs its own: no later step needs another program.

  Example:
    >>> from simigrad_jax.shapes.layout import StepLayout
    >>> layout = StepLayout.create("device", 8, mode="recompile", max_micro=8, min_micro=None,
    ...                            shapes_per_step=3, lower=8, upper=64)
    >>> [(p.program.value, p.micro) for p in first_step_programs(layout, layout.plan(32))]
    [('micro', 1), ('apply', 0)]
  """
  if fixed_batch or not starts_accumulating(layout) or plan.accumulation_steps > 1:
    return programs_of(plan)
  smallest = {"fused": set(), "micro": {min(layout.grid)}, "apply": True}
  return programs_of(fallback_plan(plan, smallest))


class CompileSchedule:
  """The programs admitted at each step: requested programs, ``steps_per_compile`` steps each.

  Args:
    layout: the step layout (its grid of shapes, in rows per slot).
    steps_per_compile: the steps each requested program takes, in the
      schedule, before a step may run on it (> 0; a fraction admits several a
      step).
    accumulation_shapes: the shapes a planned step of several micro-batches
      can use (their micro-steps are requested with their fused steps).
    fixed_batch: the run's batch size cannot move (its bounds are one size):
      only the programs of its plan are admitted and requested, no fallback
      and no shape near it, since no step would run them (a step cut short
      at the run's end runs on those programs, padded or accumulated).

  Example:
    >>> from simigrad_jax.shapes.layout import StepLayout
    >>> layout = StepLayout.create("device", 8, mode="recompile", max_micro=8, min_micro=None,
    ...                            shapes_per_octave=1, lower=8, upper=64)
    >>> schedule = CompileSchedule(layout, 2.0, [])
    >>> first = schedule.start(layout.plan(8), step=0)  # admitted at once: the first step waits
    >>> schedule.choose(layout.plan(64), step=0).micro_batch_size  # 8 rows a device: on 1 row
    1
  """

  def __init__(
    self,
    layout: StepLayout,
    steps_per_compile: float,
    accumulation_shapes: list[int],
    fixed_batch: bool = False,
  ) -> None:
    if not (isinstance(steps_per_compile, (int, float)) and 0 < steps_per_compile < math.inf):
      raise ValueError(f"steps_per_compile must be a finite number > 0, got {steps_per_compile!r}")
    self._layout = layout
    self.fixed_batch = fixed_batch
    self._pace = float(steps_per_compile)
    self._accumulation = set(accumulation_shapes)
    self._admitted: dict[ProgramShape, int] = {}  # program -> the step from which it may run
    self._free_at = 0.0  # when the schedule's one compiler is free (in steps)

  def start(self, plan: batch_plan.BatchPlan, step: int) -> list[ProgramShape]:
    """Admits, at ``step`` when nothing is admitted yet (a new run), the programs the first step
    runs (:func:`first_step_programs`) and the fallback's: a micro-step and the update, and
    unless the first step accumulates (:func:`starts_accumulating`), its shape's fused step. With
    steps of several shapes the micro-step is the grid's smallest shape's, so that any batch
    accumulates on it with less than that shape of padding per device; else the first step's
    shape's. A fixed batch (``fixed_batch``) admits its plan's programs alone.

    Changes nothing otherwise (a resumed run, a later ``train()`` call), so
    that the schedule is the same whether a run was interrupted or not.

    Returns:
      Every program admitted or requested, in the order the schedule
      admits them: the order to compile them in.
    """
    if not self._admitted:
      first = first_step_programs(self._layout, plan, self.fixed_batch)
      fallback = [] if self.fixed_batch else self._fallback_programs(plan, first)
      for program in [*first, *fallback]:
        self._admitted.setdefault(program, step)
      self._free_at = float(step)
    return self._in_order(self._admitted)

  def _fallback_programs(
    self, plan: batch_plan.BatchPlan, first: list[ProgramShape]
  ) -> list[ProgramShape]:
    """The programs a new run admits beside its ``first`` step's (see :meth:`start`)."""
    # Steps of several shapes accumulate on the smallest shape; steps on one shape, on the first
    # step's.
    mixed = self._layout.policy.shapes_per_step > 1
    accumulate_on = min(self._layout.grid) if mixed else plan.micro_batch_size
    fallback = [ProgramShape(Program.MICRO, accumulate_on), APPLY]
    if first == programs_of(plan):  # (not accumulating from the start: its fused step too)
      fallback.insert(0, ProgramShape(Program.FUSED, plan.micro_batch_size))
    return fallback

  def usable(self, step: int) -> list[ProgramShape]:
    """The programs a step may run at ``step`` (admitted at or before it), in the order admitted."""
    return self._in_order(program for program, at in self._admitted.items() if at <= step)

  def _in_order(self, programs: Iterable[ProgramShape]) -> list[ProgramShape]:
    """``programs`` (admitted or requested) in the order the schedule admits them."""
    return sorted(programs, key=lambda program: (self._admitted[program], program))

  def admitted(self, step: int) -> dict[str, Any]:
    """The view (:mod:`~simigrad_jax.compile.fallback`) of the programs admitted at ``step``."""
    ready = self.usable(step)
    return {
      "fused": {size for program, size in ready if program is Program.FUSED},
      "micro": {size for program, size in ready if program is Program.MICRO},
      "apply": APPLY in ready,
      "failed_fused": set(),
      "failed_micro": set(),
    }

  def choose(self, plan: batch_plan.BatchPlan, step: int) -> batch_plan.BatchPlan:
    """``plan`` when its programs are admitted at ``step``, else the same batch on admitted
    programs (:func:`~simigrad_jax.compile.fallback.choose_plan`)."""
    return choose_plan(plan, self.admitted(step))

  def advance(self, plan: batch_plan.BatchPlan, step: int) -> list[ProgramShape]:
    """Requests, at ``step``, ``plan``'s programs and the fused steps near its
    shape (within :data:`~simigrad_jax.shapes.layout.COMPILE_WINDOW_OCTAVES`, nearest first;
    with the micro-step of a shape a planned step may accumulate on); with a fixed batch,
    ``plan``'s programs alone.

    Call it once a step, with the step's own plan; what it admits depends
    only on the requests and their steps.

    Returns:
      The programs newly requested, in the order the schedule admits them.
    """
    wanted = programs_of(plan) if self.fixed_batch else self.near(plan)
    new = [program for program in wanted if program not in self._admitted]
    for program in new:
      self._free_at = max(self._free_at, float(step)) + self._pace
      self._admitted[program] = math.ceil(self._free_at)
    return new

  def admitted_at(self, program: ProgramShape) -> int:
    """The step from which ``program`` may run (KeyError: never requested)."""
    return self._admitted[program]

  def near(self, plan: batch_plan.BatchPlan) -> list[ProgramShape]:
    """``plan``'s programs and the fused steps near its shape (within
    :data:`~simigrad_jax.shapes.layout.COMPILE_WINDOW_OCTAVES`, nearest first; with the
    micro-step of a shape a planned step may accumulate on): what :meth:`advance` requests, and
    the order in which the run is likely to need them, whether requested before or not."""
    wanted = list(programs_of(plan))
    for size in self._layout.shapes_near(plan.micro_batch_size, COMPILE_WINDOW_OCTAVES):
      wanted.append(ProgramShape(Program.FUSED, size))
      if size in self._accumulation:
        wanted.extend([ProgramShape(Program.MICRO, size), APPLY])
    return list(dict.fromkeys(wanted))

  def state_dict(self) -> dict[str, Any]:
    """The schedule as JSON data, for a checkpoint (:meth:`load_state_dict` reads it back)."""
    admitted = sorted([program.value, size, at] for (program, size), at in self._admitted.items())
    return {"steps_per_compile": self._pace, "free_at": self._free_at, "admitted": admitted}

  def load_state_dict(self, state: Mapping[str, Any] | None) -> bool:
    """Restores a checkpoint's schedule; False (nothing restored) when ``state`` is None (a new
    run), or, with a warning that says why, malformed, of another ``steps_per_compile`` or
    naming shapes off this grid: the schedule then starts again at the resumed step."""
    if state is None:
      return False
    try:
      admitted, free_at = self._read_state(state)
    except (KeyError, TypeError, ValueError) as error:
      why = error.args[0] if isinstance(error, ValueError) else f"malformed: {error!r}"
      logger.warning(
        "The checkpoint's compile schedule is not restored (%s): it starts again at the resumed "
        "step, so the steps may run other programs than they would have (the same training: a "
        "step on the fallback computes the same batch).",
        why,
      )
      return False
    self._admitted, self._free_at = admitted, free_at
    return True

  def _read_state(self, state: Any) -> tuple[dict[ProgramShape, int], float]:
    """The admitted programs and the compiler's free step of a saved ``state``; ValueError
    saying why when it is not one of this schedule's."""
    if not isinstance(state, Mapping):
      raise ValueError(f"not a schedule's record: {type(state).__name__}")
    if state["steps_per_compile"] != self._pace:
      raise ValueError(
        f"saved with steps_per_compile={state['steps_per_compile']!r}, this run has {self._pace!r}"
      )
    admitted = {}
    for kind, size, at in state["admitted"]:
      program = ProgramShape(Program(kind), size)  # (ValueError: no such program)
      on_grid = size in self._layout.grid or program == APPLY
      if not isinstance(at, int) or not on_grid:
        raise ValueError(f"not a program of this grid: {[kind, size, at]}")
      admitted[ProgramShape(program.program, int(size))] = at
    return admitted, float(state["free_at"])


class ScheduledFallback:
  """The deterministic compile policy: which programs a step runs on, by the schedule of the step count.

  A step runs its own plan when the schedule
  (:class:`CompileSchedule`) has admitted its programs, else the same batch
  on admitted ones; it waits for an admitted program whose real compile has
  not finished. The compiles are queued in the order the schedule admits
  the programs, those the run is likely to need next first (the update's
  from the start: every run whose batch may move admits it with its first
  plan). The schedule's state is in the checkpoint's record
  (:meth:`compiled_programs`), so that a resumed run admits the same
  programs at the same steps as one never interrupted: the trajectory does
  not depend on the compiles' timing, nor on the processes (the schedule is
  the same on every one).

  Where the compiler runs one compile of each kind of program at a time
  (``threads=1``: a host of two cores or fewer), the programs the steps
  request are queued only once the programs admitted at this process's
  first step have compiled (or failed): the first steps wait for those, and
  a third compile beside the two that already share the cores would delay
  them. With more threads, requests are queued at once. Only when a compile
  starts changes, never which program a step runs.

  Args:
    compiler: the step's compiler.
    schedule: the schedule of the run's steps (restored, on a resume, from
      the checkpoint's record).
    layout: the step layout (its plans).
    cache_dir: JAX's persistent compilation cache (absolute), or None.

  Example:
    ``ScheduledFallback(compiler, CompileSchedule(layout, 2.0, []), layout,
    None)``: after ``start(batch_size, 0)``, ``choose(plan, step, last)`` is
    ``plan`` once its programs are admitted, and until then the same batch
    on admitted ones.
  """

  def __init__(
    self,
    compiler: StepProgramCompiler,
    schedule: CompileSchedule,
    layout: StepLayout,
    cache_dir: str | None,
  ) -> None:
    self._compiler = compiler
    self._schedule = schedule
    self._layout = layout
    self._cache_dir = cache_dir
    self._started = False
    # With one compile thread a kind: the programs the first step may run, until they compiled,
    # and the programs requested meanwhile, queued then.
    self._first: list[ProgramShape] = []
    self._held: list[ProgramShape] = []
    if not schedule.fixed_batch:
      compiler.prefetch([APPLY])  # at once: the fallback may accumulate from the first step

  def start(self, batch_size: int, step: int) -> None:
    """Queues the programs the schedule admits (a new run's first plan and its fallback, a
    resumed run's as saved), those near ``batch_size``'s plan first."""
    plan = self._layout.plan(batch_size)
    admitted = self._schedule.start(plan, step)
    self._compiler.prefetch([p for p in self._schedule.near(plan) if p in admitted] + admitted)
    if not self._started and self._compiler.threads == 1:
      self._first = self._schedule.usable(step)
    self._started = True

  def choose(
    self, exact: batch_plan.BatchPlan, step: int, last_step: float
  ) -> batch_plan.BatchPlan:
    """``exact``, or the same batch on admitted programs
    (:meth:`CompileSchedule.choose`); then the programs near ``exact`` requested
    (:meth:`CompileSchedule.advance`: call it once a step, in step order), and those admitted
    by ``last_step`` (the last step the run may reach) queued in the order they become usable:
    a program admitted after it would compile for no step of the run (on a resume that goes
    on further, :meth:`start` queues it)."""
    plan = self._schedule.choose(exact, step)
    requested = self._schedule.advance(exact, step)
    if step < last_step:  # (the next step's likely plans go ahead)
      self._queue([p for p in requested if self._schedule.admitted_at(p) <= last_step])
    return plan

  def _queue(self, requested: list[ProgramShape]) -> None:
    """Queues ``requested``, or holds it while the first step's programs compile (see the class
    docstring); queues what was held once they have."""
    if self._first:
      view = self._compiler.view()
      if not all(settled(program, view) for program in self._first):
        self._held.extend(requested)
        return
      requested, self._first, self._held = self._held + requested, [], []
    self._compiler.prefetch(requested)

  def ready_plan(
    self, plan: batch_plan.BatchPlan, step: int, prefetch: bool = True
  ) -> batch_plan.BatchPlan:
    """``plan``, or the same batch on the programs admitted at ``step``; unless ``prefetch`` is
    False, the programs of the plan returned move ahead of those queued."""
    chosen = self._schedule.choose(plan, step)
    if prefetch:
      self._compiler.prefetch(programs_of(chosen), first=True)
    return chosen

  def await_fallback(self, micro: int) -> None:
    """Nothing: a step waits only for the programs it runs."""
    del micro

  def compiled_programs(self) -> dict[str, Any]:
    """The schedule's state (``"schedule"``) and, with the persistent compilation cache, what it
    holds from this run (:func:`~simigrad_jax.compile.persistent_cache.cache_record`)."""
    record: dict[str, Any] = {}
    if self._cache_dir is not None:
      record = cache_record(self._cache_dir, self._compiler.view(), None)
    record["schedule"] = self._schedule.state_dict()
    return record

  def compiled_report(self) -> dict[str, int] | None:
    """None: the schedule is the same on every process."""
    return None

  def agree_on_compiles(self, reports: Sequence[dict[str, int]]) -> None:
    """Nothing to agree on."""
    del reports
