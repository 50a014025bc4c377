"""The step's programs and the compile policy chosen for a run: which policy the settings choose,
the protocol every policy keeps, the plans each one chooses, and what each queues for compiling."""

from __future__ import annotations

import json
import math

import pytest
import schedule_test
from recording_compilers import RecordingCompiler

import simigrad_jax
from simigrad_jax.compile.fallback import TimedFallback
from simigrad_jax.compile.policy import CompilePolicy
from simigrad_jax.compile.policy import ExactPrograms
from simigrad_jax.compile.program_compiler import StepProgramCompiler
from simigrad_jax.compile.programs import compile_policy
from simigrad_jax.compile.schedule import CompileSchedule
from simigrad_jax.compile.schedule import ScheduledFallback
from simigrad_jax.compile.schedule import first_step_programs
from simigrad_jax.compile.schedule import starts_accumulating
from simigrad_jax.compile.step_functions import APPLY
from simigrad_jax.compile.step_functions import Program
from simigrad_jax.compile.step_functions import ProgramShape
from simigrad_jax.compile.step_functions import StepFunctions
from simigrad_jax.compile.step_functions import programs_of
from simigrad_jax.compile.step_runner import StepRunner
from simigrad_jax.shapes.layout import COMPILE_WINDOW_OCTAVES
from simigrad_jax.trainer.config import CompileConfig
from tiny_run import make_trainer
from tiny_run import trainer_objects
from tiny_run import trainer_with

# 8 devices, 1 to 16 rows a device, 8 shapes an octave (rows 1, 2, ..., 16).
LAYOUT = schedule_test.layout()
CACHE = "/cache"


def nothing_compiled():
  return {
    "fused": set(),
    "micro": set(),
    "apply": False,
    "failed_fused": set(),
    "failed_micro": set(),
  }


def policy(kind, compiled=None, cached_programs=None, shared=False, cache_dir=None):
  """A policy of ``kind`` ("exact", "scheduled" or "timed") on a recording compiler whose view is
  ``compiled`` (default: nothing compiled), as :func:`compile_policy` chooses it."""
  compiler = RecordingCompiler(nothing_compiled() if compiled is None else compiled)
  chosen = compile_policy(
    compiler,
    LAYOUT,
    [],
    compile_fallback=kind != "exact",
    steps_per_compile=0.5 if kind == "scheduled" else None,
    shared_compiles=shared,
    cache_dir=cache_dir,
    cached_programs=cached_programs,
  )
  return chosen, compiler


def fused(micro):
  return ProgramShape(Program.FUSED, micro)


def micro_step(micro):
  return ProgramShape(Program.MICRO, micro)


# ------------------------------------------------------------------ the policy the settings choose


@pytest.mark.parametrize(
  "kind, cls",
  [("exact", ExactPrograms), ("scheduled", ScheduledFallback), ("timed", TimedFallback)],
)
def test_the_settings_choose_one_policy(kind, cls):
  chosen, _ = policy(kind)
  assert type(chosen) is cls


def test_the_trainers_programs_hold_the_policy_its_settings_choose(tmp_path):
  """The Trainer's settings reach the choice: the schedule by default, the timed fallback, or
  none; the other pieces a step uses are held beside it."""
  for name, settings, cls in [
    ("scheduled", {}, ScheduledFallback),
    ("timed", {"compile": CompileConfig(timed_fallback=True)}, TimedFallback),
    ("exact", {"compile": CompileConfig(fallback=False)}, ExactPrograms),
  ]:
    with make_trainer(tmp_path / name, **settings) as trainer:
      programs = trainer._programs
      assert type(programs.policy) is cls
      assert isinstance(programs.functions, StepFunctions)
      assert isinstance(programs.compiler, StepProgramCompiler)
      assert isinstance(programs.runner, StepRunner)


def test_the_timed_fallback_of_one_process_reads_the_caches_record_and_of_several_agrees():
  record = {"compilation_cache_dir": CACHE, "fused": [4], "micro": [], "apply": True}
  alone, compiler = policy("timed", cached_programs=record, cache_dir=CACHE)
  assert alone.compiled_report() is None  # no agreement with one process
  assert alone.ready_plan(LAYOUT.plan(24), 0).micro_batch_size == 4  # on the cache's program
  shared, compiler = policy("timed", cached_programs=record, shared=True, cache_dir=CACHE)
  assert shared.ready_plan(LAYOUT.plan(24), 0) == LAYOUT.plan(24)  # nothing agreed yet
  compiler.compiled = {**nothing_compiled(), "fused": {4}}
  other = shared.compiled_report()  # (another process's)
  compiler.compiled = {**nothing_compiled(), "fused": {3, 4}}
  mine = shared.compiled_report()
  assert set(mine) == {"fused", "micro", "apply", "failed_fused", "failed_micro"}
  shared.agree_on_compiles([mine, other])
  assert shared.ready_plan(LAYOUT.plan(24), 0).micro_batch_size == 4  # 3 is not everywhere


def test_the_schedule_is_restored_from_the_checkpoints_record():
  straight, _ = policy("scheduled")
  straight.start(8, 0)
  sizes = [8, 24, 40, 24, 64, 16]
  plans = [straight.choose(LAYOUT.plan(size), step, math.inf) for step, size in enumerate(sizes)]
  first, _ = policy("scheduled")
  first.start(8, 0)
  for step, size in enumerate(sizes[:3]):
    first.choose(LAYOUT.plan(size), step, math.inf)
  saved = json.loads(json.dumps(first.compiled_programs()))  # as a checkpoint keeps it
  resumed, _ = policy("scheduled", cached_programs=saved)
  resumed.start(sizes[3], 3)
  again = [resumed.choose(LAYOUT.plan(sizes[step]), step, math.inf) for step in range(3, 6)]
  assert again == plans[3:]


def test_a_schedule_saved_with_the_names_a_checkpoint_records_is_read():
  """The record names the programs by their values ("fused", "micro", "apply"), as the
  checkpoints of earlier versions do."""
  saved = {
    "schedule": {
      "steps_per_compile": 0.5,
      "free_at": 2.0,
      "admitted": [["apply", 0, 0], ["fused", 1, 0], ["fused", 3, 2], ["micro", 1, 0]],
    }
  }
  resumed, _ = policy("scheduled", cached_programs=saved)
  assert resumed.compiled_programs() == saved  # read whole, written back the same
  assert resumed.choose(LAYOUT.plan(24), 1, 1).micro_batch_size == 1  # 3 not yet
  assert resumed.choose(LAYOUT.plan(24), 2, 2).micro_batch_size == 3  # admitted at 2


# ------------------------------------------------------------------------------- the protocol


@pytest.mark.parametrize("kind", ["exact", "scheduled", "timed"])
def test_every_policy_keeps_the_protocol(kind):
  chosen, compiler = policy(kind, cache_dir=CACHE)
  keeps: CompilePolicy = chosen  # (mypy checks the same in programs.compile_policy)
  keeps.start(8, 0)
  assert compiler.calls  # something to compile before the first step
  for step, size in enumerate([8, 24, 40]):
    exact = LAYOUT.plan(size)
    plan = keeps.choose(exact, step, math.inf)
    # The same examples, on whatever shape: the batch and its devices never change.
    assert plan.global_batch_size == exact.global_batch_size
    assert plan.num_devices == exact.num_devices
    assert plan.rows_per_step - plan.padded_examples == exact.global_batch_size
    assert keeps.ready_plan(exact, step + 1).global_batch_size == exact.global_batch_size
    keeps.await_fallback(plan.micro_batch_size)
  record = keeps.compiled_programs()
  assert record["compilation_cache_dir"] == CACHE
  assert json.loads(json.dumps(record)) == record  # JSON data, for the checkpoint
  report = keeps.compiled_report()
  assert report is None or all(isinstance(value, int) for value in report.values())
  keeps.agree_on_compiles([report] if report is not None else [])


@pytest.mark.parametrize("kind", ["exact", "scheduled", "timed"])
def test_the_runs_last_step_and_a_look_ahead_without_prefetch_queue_nothing(kind):
  chosen, compiler = policy(kind)
  chosen.start(8, 0)
  chosen.choose(LAYOUT.plan(8), 0, math.inf)
  queued = len(compiler.calls)
  chosen.choose(LAYOUT.plan(64), 1, 1)
  chosen.ready_plan(LAYOUT.plan(128), 2, prefetch=False)
  assert len(compiler.calls) == queued


@pytest.mark.parametrize("kind", ["exact", "scheduled"])
def test_a_policy_that_asks_nothing_of_the_other_processes(kind):
  chosen, _ = policy(kind)
  assert chosen.compiled_report() is None
  chosen.agree_on_compiles([])  # nothing to agree on


def test_without_the_cache_only_the_schedule_is_recorded():
  assert policy("exact")[0].compiled_programs() is None
  assert policy("timed")[0].compiled_programs() is None
  scheduled, _ = policy("scheduled")
  scheduled.start(8, 0)
  assert set(scheduled.compiled_programs()) == {"schedule"}


def test_the_caches_record_lists_what_was_compiled():
  compiled = {**nothing_compiled(), "fused": {1, 3}, "micro": {1}, "apply": True}
  for kind in ("exact", "scheduled", "timed"):
    record = policy(kind, compiled=compiled, cache_dir=CACHE)[0].compiled_programs()
    assert {key: record[key] for key in ("fused", "micro", "apply")} == {
      "fused": [1, 3],
      "micro": [1],
      "apply": True,
    }


# ---------------------------------------------------------------------- the plans each chooses


def test_without_the_fallback_a_step_runs_its_own_plan_whatever_is_compiled():
  exact, _ = policy("exact")
  exact.start(8, 0)
  for step, size in enumerate([8, 24, 128, 40]):
    assert exact.choose(LAYOUT.plan(size), step, math.inf) == LAYOUT.plan(size)


def test_on_the_schedule_a_step_runs_on_admitted_programs_until_its_own_are():
  scheduled, compiler = policy("scheduled")
  scheduled.start(8, 0)  # 1 row a device: admitted at once
  plans = [scheduled.choose(LAYOUT.plan(24), step, math.inf) for step in range(4)]
  # 3 rows a device, requested at step 0, admitted at step 1 (half a step each), whatever is
  # compiled: until then, 3 micro-steps of 1 row.
  assert [(p.micro_batch_size, p.accumulation_steps) for p in plans] == [
    (1, 3),
    (3, 1),
    (3, 1),
    (3, 1),
  ]
  assert compiler.compiled == nothing_compiled()  # (the compiles' timing is never read)


def test_the_timed_fallback_runs_on_what_is_compiled_now():
  first = {**nothing_compiled(), "fused": {1}, "micro": {1}, "apply": True}
  timed, compiler = policy("timed", compiled=first)
  timed.start(8, 0)
  plan = timed.choose(LAYOUT.plan(24), 0, math.inf)  # 3 rows compiling: on 1 row
  assert (plan.micro_batch_size, plan.accumulation_steps) == (1, 3)
  compiler.compiled = {**first, "fused": {1, 3}}
  assert timed.choose(LAYOUT.plan(24), 1, math.inf) == LAYOUT.plan(24)  # compiled: its own


def test_the_timed_fallback_waits_once_for_what_it_holds_a_batch_on():
  timed, compiler = policy("timed")
  timed.await_fallback(3)
  timed.await_fallback(4)  # once only
  assert (compiler.fused.got, compiler.micro.got, compiler.update.got) == ([3], [3], [0])
  for kind in ("exact", "scheduled"):  # the others wait only for the programs a step runs
    other, compiler = policy(kind)
    other.await_fallback(3)
    assert (compiler.fused.got, compiler.micro.got, compiler.update.got) == ([], [], [])


# ------------------------------------------------------------------- what is compiled and queued


def test_without_the_fallback_the_whole_grid_queues_and_a_steps_own_programs_go_first():
  exact, compiler = policy("exact")
  exact.start(8, 0)
  assert compiler.fused.queued == [LAYOUT.shapes_by_distance(8, None)]  # the grid, 1 row first
  assert compiler.update.prefetches == 0  # no step accumulates
  exact.choose(LAYOUT.plan(24), 0, math.inf)
  assert compiler.calls[-2] == ([fused(3)], True)  # the step's own, ahead
  near = LAYOUT.shapes_near(3, COMPILE_WINDOW_OCTAVES)
  assert compiler.calls[-1] == ([fused(shape) for shape in near], True)  # following the batch


def test_the_timed_fallback_queues_the_window_and_the_first_shapes_micro_step_and_update():
  timed, compiler = policy("timed")
  assert compiler.calls == [([APPLY], False)]  # at once: the fallback may accumulate
  timed.start(8, 0)
  assert compiler.fused.queued == [LAYOUT.shapes_by_distance(8, COMPILE_WINDOW_OCTAVES)]
  assert compiler.micro.queued == [[1]]
  timed.choose(LAYOUT.plan(24), 0, math.inf)
  assert compiler.fused.queued[-1] == [3]  # its own shape, still compiling
  assert compiler.fused.first[-1] == LAYOUT.shapes_near(3, COMPILE_WINDOW_OCTAVES)  # following


def test_on_the_schedule_the_admitted_programs_queue_in_the_order_they_become_usable():
  scheduled, compiler = policy("scheduled")
  assert compiler.calls == [([APPLY], False)]  # at once: every run admits it with its first plan
  scheduled.start(8, 0)
  # Admitted at once: the first plan's (near its batch, first), and the fallback's.
  assert compiler.calls[1:] == [([fused(1), APPLY, fused(1), micro_step(1)], False)]
  scheduled.choose(LAYOUT.plan(24), 0, math.inf)
  same = CompileSchedule(LAYOUT, 0.5, [])  # the same requests, on a schedule of its own
  same.start(LAYOUT.plan(8), 0)
  requested = same.advance(LAYOUT.plan(24), 0)
  assert requested[0] == fused(3) and fused(4) in requested  # the batch's, then those near it
  assert compiler.calls[-1] == (requested, False)  # newly requested, in the schedule's order
  scheduled.choose(LAYOUT.plan(24), 1, math.inf)
  assert compiler.calls[-1] == ([], False)  # requested before: nothing new


def test_on_the_schedule_a_program_admitted_after_the_runs_last_step_is_not_queued():
  """Requested all the same (the schedule, hence which program a step runs, is the one of a longer
  run), but compiled for no step: a run near its end leaves the cores to its steps."""
  scheduled, compiler = policy("scheduled")
  scheduled.start(8, 0)
  same = CompileSchedule(LAYOUT, 0.5, [])
  same.start(LAYOUT.plan(8), 0)
  requested = same.advance(LAYOUT.plan(40), 0)  # 5 rows a device, and the shapes near it
  admitted = [same.admitted_at(program) for program in requested]
  assert admitted == [1, 1, 2, 2]  # two a step (0.5 steps a compile)
  scheduled.choose(LAYOUT.plan(40), 0, 1)  # the run may reach step 1, not step 2
  assert compiler.calls[-1] == (requested[:2], False)
  resumed, compiler = policy("scheduled", cached_programs=scheduled.compiled_programs())
  resumed.start(40, 1)  # a resume that goes on further: every program admitted queued
  assert set(requested) <= set(compiler.calls[-1][0])


def test_a_resumed_schedule_queues_what_it_admitted_those_near_the_batch_first():
  first, _ = policy("scheduled")
  first.start(8, 0)
  first.choose(LAYOUT.plan(40), 0, math.inf)  # 5 rows: the shapes near it requested
  resumed, compiler = policy("scheduled", cached_programs=first.compiled_programs())
  resumed.start(40, 1)
  (queued, ahead) = compiler.calls[-1]
  assert not ahead and queued[0] == fused(5)  # the batch's own first
  saved = CompileSchedule(LAYOUT, 0.5, [])
  assert saved.load_state_dict(first.compiled_programs()["schedule"])
  assert set(queued) == set(saved.start(LAYOUT.plan(40), 1))  # every program admitted so far


# ------------------------------------------------ a run of several shapes a step starts accumulating


def mixed_layout(lower=8, upper=128, max_micro=16):
  """8 devices, 1 to ``max_micro`` rows a device, steps of up to 3 shapes (the training scripts'
  default)."""
  return schedule_test.layout_of(3, lower, upper, max_micro)


def test_a_run_of_several_shapes_a_step_starts_on_the_smallest_micro_step_and_the_update():
  layout = mixed_layout()
  plans = CompileSchedule(layout, 0.5, [])
  admitted = plans.start(layout.plan(32), 0)  # 4 rows a device
  # The smallest shape's micro-step and the update: no fused step until the schedule admits it
  # like any other.
  assert admitted == [APPLY, micro_step(1)]
  first = plans.choose(layout.plan(32), 0)
  assert first.micro_batch_sizes == (1, 1, 1, 1)  # the same 32 examples, in 4 micro-steps
  assert programs_of(first) == first_step_programs(layout, layout.plan(32))
  plans.advance(layout.plan(32), 0)
  assert plans.choose(layout.plan(32), 1) == layout.plan(32)  # its fused step, admitted next


def test_a_first_batch_of_the_smallest_shape_starts_on_its_fused_step():
  layout = mixed_layout()
  plan = layout.plan(8)  # 1 row a device: no micro-steps of a smaller shape hold it
  assert first_step_programs(layout, plan) == [fused(1)]
  plans = CompileSchedule(layout, 0.5, [])
  assert plans.start(plan, 0) == sorted([fused(1), micro_step(1), APPLY])
  assert plans.choose(plan, 0) == plan


@pytest.mark.parametrize("size", [8, 32, 40, 100, 128])
def test_the_first_step_runs_the_programs_its_first_program_prepares(size):
  layout = mixed_layout()
  plans = CompileSchedule(layout, 0.5, [])
  plans.start(layout.plan(size), 0)
  assert programs_of(plans.choose(layout.plan(size), 0)) == first_step_programs(
    layout, layout.plan(size)
  )


def test_a_run_on_one_shape_or_with_steps_on_one_shape_starts_on_its_fused_step():
  held = mixed_layout(lower=32, upper=32, max_micro=4)  # the batch held at 32: one shape
  assert not starts_accumulating(held) and len(held.grid) == 1
  assert first_step_programs(held, held.plan(32)) == [fused(4)]
  assert starts_accumulating(mixed_layout())
  one_shape = schedule_test.layout()  # steps on one shape
  assert not starts_accumulating(one_shape)
  plans = CompileSchedule(one_shape, 0.5, [])
  assert fused(4) in plans.start(one_shape.plan(32), 0)


# ------------------------------------------------------ a fixed batch compiles its own programs alone


@pytest.mark.parametrize("shapes_per_step", [1, 3])
def test_a_fixed_batch_admits_and_requests_its_plans_programs_alone(shapes_per_step):
  held = schedule_test.layout_of(shapes_per_step, lower=32, upper=32)  # 4 rows a device
  plans = CompileSchedule(held, 0.5, [], fixed_batch=True)
  assert plans.start(held.plan(32), 0) == [fused(4)]  # no fallback: no step would run one
  assert first_step_programs(held, held.plan(32), fixed_batch=True) == [fused(4)]
  assert plans.choose(held.plan(32), 0) == held.plan(32)
  assert plans.advance(held.plan(32), 0) == []  # no shape near it requested
  partial = held.plan(20)  # an epoch's last batch: 3 rows a device, padded to the same shape
  assert programs_of(partial) == [fused(4)] and plans.choose(partial, 1) == partial
  assert plans.advance(partial, 1) == []
  # The same batch in a run that may move it admits the fallback too.
  assert len(CompileSchedule(held, 0.5, []).start(held.plan(32), 0)) == 3


def test_a_fixed_batch_of_several_micro_steps_admits_those_and_the_update_alone():
  held = schedule_test.layout_of(3, lower=200, upper=200)  # 25 rows a device: 16 + 8 + 1
  plan = held.plan(200)
  assert plan.micro_batch_sizes == (16, 8, 1)
  plans = CompileSchedule(held, 0.5, [], fixed_batch=True)
  assert sorted(plans.start(plan, 0)) == sorted(programs_of(plan))
  assert plans.choose(plan, 0) == plan
  # A run that may move the batch admits the largest shape's fused step beside them.
  assert fused(16) in CompileSchedule(held, 0.5, []).start(plan, 0)


def test_a_fixed_batch_queues_no_update_it_would_not_run():
  held = schedule_test.layout_of(3, lower=32, upper=32)
  compiler = RecordingCompiler(nothing_compiled(), threads=1)
  scheduled = ScheduledFallback(
    compiler, CompileSchedule(held, 0.5, [], fixed_batch=True), held, None
  )
  scheduled.start(32, 0)
  for step in range(3):
    scheduled.choose(held.plan(32), step, math.inf)
  queued = [program for programs, _ in compiler.calls for program in programs]
  assert set(queued) == {fused(4)}
  moving, compiler = scheduled_on(held, threads=1)
  assert compiler.update.prefetches == 1  # queued at once where the batch may move


def test_a_trainer_with_a_fixed_controller_compiles_one_program(tmp_path):
  controller = simigrad_jax.make_controller("fixed", initial_batch_size=16)
  for shapes_per_step in (1, 3):
    workdir = tmp_path / str(shapes_per_step)
    compile_config = CompileConfig(shapes_per_step=shapes_per_step)
    objects = {**trainer_objects(workdir), "controller": controller}
    settings = {"max_micro_batch_size": 4, "progress": False, "tensorboard": False}
    with trainer_with(**objects, **settings, compile=compile_config) as trainer:
      trainer.train(num_steps=8)
      admitted = trainer._programs.policy.compiled_programs()["schedule"]["admitted"]
      assert admitted == [["fused", 2, 0]]  # 2 rows a device on 8 devices
      assert trainer.compile_stats()["compiles"] == 1
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "micro_batch_size" in r]
    assert len(steps) == 8 and {(r["batch_size"], r["micro_batch_size"]) for r in steps} == {
      (16, 2)
    }


def test_a_trainer_queues_no_compile_that_no_step_up_to_its_end_would_run(tmp_path, monkeypatch):
  """An epoch of 120 examples in steps of at least 8 (the lower bound) ends by step 14: the
  programs the schedule admits after it are requested, never compiled."""
  # Two compile threads a kind: requests are queued at once, not held for the first programs.
  compile_config = CompileConfig(steps_per_compile=30.0, threads=2)
  with make_trainer(tmp_path, compile=compile_config) as trainer:
    compiler, queued = trainer._programs.compiler, []
    prefetch = compiler.prefetch

    def recording(programs, *, first=False):
      queued.extend(programs)
      return prefetch(programs, first=first)

    monkeypatch.setattr(compiler, "prefetch", recording)
    trainer.train(num_epochs=1)
    steps = trainer.step
    admitted = {
      ProgramShape(Program(kind), size): at
      for kind, size, at in trainer._programs.policy.compiled_programs()["schedule"]["admitted"]
    }
  assert steps <= 15
  after_the_end = {program for program, at in admitted.items() if at > 14}
  assert after_the_end  # requested (the schedule of a longer run), admitted too late to run
  assert not after_the_end & set(queued)
  assert set(admitted) - after_the_end <= set(queued)  # the start's programs, compiled


def scheduled_on(layout, threads):
  compiler = RecordingCompiler(nothing_compiled(), threads=threads)
  return ScheduledFallback(compiler, CompileSchedule(layout, 0.5, []), layout, None), compiler


def test_with_one_compile_thread_a_kind_requests_wait_for_the_first_steps_programs():
  layout = mixed_layout()
  scheduled, compiler = scheduled_on(layout, threads=1)
  scheduled.start(32, 0)
  queued = len(compiler.calls)
  scheduled.choose(layout.plan(32), 0, math.inf)  # requests its fused step and those near
  assert compiler.calls[queued:] == []  # held: the first step's programs still compile
  compiler.compiled = {**nothing_compiled(), "apply": True}
  scheduled.choose(layout.plan(40), 1, math.inf)
  assert compiler.calls[queued:] == []  # the smallest shape's micro-step is still compiling
  compiler.compiled = {**nothing_compiled(), "micro": {1}, "apply": True}
  scheduled.choose(layout.plan(40), 2, math.inf)
  ((released, first),) = compiler.calls[queued:]
  assert not first and released[0] == fused(4)  # what was held first, in the schedule's order
  assert micro_step(4) in released  # with the later steps' (40: 5 rows, on 4 and 1)
  scheduled.choose(layout.plan(48), 3, math.inf)
  assert len(compiler.calls) == queued + 2  # from now on queued at once


def test_with_more_compile_threads_requests_are_queued_at_once():
  layout = mixed_layout()
  scheduled, compiler = scheduled_on(layout, threads=2)
  scheduled.start(32, 0)
  queued = len(compiler.calls)
  scheduled.choose(layout.plan(32), 0, math.inf)
  ((requested, first),) = compiler.calls[queued:]
  assert requested[0] == fused(4) and not first


def test_a_failed_first_program_releases_the_held_requests():
  layout = mixed_layout()
  scheduled, compiler = scheduled_on(layout, threads=1)
  scheduled.start(32, 0)
  scheduled.choose(layout.plan(32), 0, math.inf)
  queued = len(compiler.calls)
  compiler.compiled = {**nothing_compiled(), "failed_micro": {1}, "apply": True}
  scheduled.choose(layout.plan(32), 1, math.inf)
  ((released, _),) = compiler.calls[queued:]
  assert released[0] == fused(4)
