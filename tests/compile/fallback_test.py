"""The compile fallback: a step whose programs are compiling runs the same batch on compiled ones,
padding least in a bounded number of micro-steps, or waits for a load rather than a compile; the
run's last step asks for no compile."""

import doctest

import pytest
from recording_compilers import RecordingCompiler

import simigrad_jax
import tiny_run
from simigrad_jax.compile import compiler
from simigrad_jax.compile import fallback
from simigrad_jax.compile import persistent_cache
from simigrad_jax.compile.agreement import CompileAgreement
from simigrad_jax.compile.fallback import TimedFallback
from simigrad_jax.compile.fallback import choose_plan
from simigrad_jax.compile.fallback import fallback_plan
from simigrad_jax.shapes.batch_plan import BucketPolicy
from simigrad_jax.shapes.batch_plan import plan_batch

POLICY = BucketPolicy(32, 1, shapes_per_octave=8)


def ready(fused=(), micro=(), apply=True):
  """A view of the programs a fallback may run (no failed ones)."""
  return {"fused": set(fused), "micro": set(micro), "apply": apply}


@pytest.mark.parametrize(
  "batch_size, fused, micro, want",
  [
    (100, {8, 32}, {8, 32}, (8, 8)),  # accumulate two of 8 rather than pad one of 32
    (100, {12, 16, 32}, {12, 16, 32}, (16,)),  # the least padding: one step of 16
    (300, {16, 20, 32}, {16, 20, 32}, (20, 20)),  # 40 rows a device, the fewest of them all
    (100, (), {4}, (4, 4, 4, 4)),  # only a smaller one: accumulate
    (100, (), {1, 4, 8}, (8, 4, 1)),  # shapes mixed: 13 rows a device, none padded
    (100, {32}, {1}, (32,)),  # 13 micro-steps of 1 are past the bound: one step, padded
    (100, (), {1}, (1,) * 13),  # nothing within the bound: the fewest micro-steps there are
  ],
)
def test_least_padding_within_the_bound_then_the_fewest_micro_steps(batch_size, fused, micro, want):
  plan = plan_batch(batch_size, 8, POLICY)
  got = fallback_plan(plan, ready(fused, micro))
  assert got.shapes == want
  assert (got.micro_batch_size, got.accumulation_steps) == (want[0], len(want))
  assert got.global_batch_size == batch_size
  assert got.padded_examples == got.rows_per_step - batch_size == 8 * sum(want) - batch_size


def test_only_ready_programs_and_none_keeps_the_plan():
  plan = plan_batch(100, 8, POLICY)
  # Micro-steps without the update cannot run: one step of 32, padded.
  assert fallback_plan(plan, ready({32}, {8}, apply=False)).shapes == (32,)
  assert fallback_plan(plan, ready((), {8}, apply=False)) == plan
  assert fallback_plan(plan, ready({8})) == plan  # one micro-batch of 8 cannot hold 13 rows


def timed_fallback(compilers, *, cached, agreement):
  """The timed fallback on ``compilers``, a :class:`RecordingCompiler` (its prefetcher's own
  queueing is tested in prefetch_test)."""
  return TimedFallback(compilers, None, None, cached=cached, agreement=agreement)


def view(fused=(), micro=(), apply=False, failed_fused=()):
  return {
    "fused": set(fused),
    "micro": set(micro),
    "apply": apply,
    "failed_fused": set(failed_fused),
    "failed_micro": set(),
  }


def test_doctests():
  result = doctest.testmod(fallback)
  assert result.attempted > 0 and result.failed == 0


def test_choose_plan_keeps_a_ready_or_failed_plan_and_falls_back_otherwise():
  plan = plan_batch(100, 8, POLICY)  # 13 rows a device
  assert plan.micro_batch_size == 13
  assert choose_plan(plan, view(fused={13, 16})) is plan
  assert choose_plan(plan, view(fused={16}, failed_fused={13})) is plan  # running it raises
  assert choose_plan(plan, view(fused={16})).micro_batch_size == 16
  assert choose_plan(plan, view()) is plan  # nothing compiled: it waits for its own


def test_with_nothing_compiled_the_plan_waits_for_a_program_the_cache_holds():
  plan = plan_batch(100, 8, POLICY)
  cached = {"fused": {16}, "micro": {4}, "apply": True}
  assert choose_plan(plan, view(), cached).shapes == (16,)  # as padded as 4 x 4, in one step
  no_fused = {"fused": set(), "micro": {4}, "apply": True}
  got = choose_plan(plan, view(), no_fused)
  assert (got.micro_batch_size, got.accumulation_steps) == (4, 4)  # accumulated
  # Its own program in the cache, or a compiled one that holds it: no detour to the cache.
  assert choose_plan(plan, view(), {"fused": {13, 32}, "micro": set(), "apply": False}) is plan
  assert choose_plan(plan, view(fused={8}, micro={8}, apply=True), cached).micro_batch_size == 8


def test_nearest_cached_picks_the_nearest_shape_the_cache_holds():
  cached = {"fused": {4, 16}, "micro": set(), "apply": False}
  assert persistent_cache.nearest_cached("fused", 7, cached) == 4  # log scale: 7/4 < 16/7
  assert persistent_cache.nearest_cached("fused", 8, cached) == 16  # a tie: the larger
  assert persistent_cache.nearest_cached("fused", 16, cached) == 16
  assert persistent_cache.nearest_cached("micro", 7, cached) == 7  # none of that kind
  assert persistent_cache.nearest_cached("fused", 7, None) == 7


def test_a_plan_still_compiling_runs_on_a_compiled_shape_and_its_own_is_queued():
  compilers = RecordingCompiler(view(fused={16}))
  chooser = timed_fallback(compilers, cached=None, agreement=None)
  plan = plan_batch(100, 8, POLICY)  # 13 rows a device, one step
  assert chooser.ready_plan(plan, 0).micro_batch_size == 16
  assert compilers.fused.queued == [[13]] and compilers.micro.queued == []
  assert chooser.ready_plan(plan, 0, prefetch=False).micro_batch_size == 16  # the last step
  assert compilers.fused.queued == [[13]]
  big = plan_batch(1000, 8, POLICY)  # four micro-steps of 32 rows: the micro-step is queued
  assert big.accumulation_steps == 4 and chooser.ready_plan(big, 0) is big  # none to accumulate on
  assert compilers.micro.queued == [[32]]
  compilers.compiled = view(fused={13, 16})
  assert chooser.ready_plan(plan, 0) is plan and compilers.fused.queued == [[13]]


def test_with_several_processes_only_the_agreed_view_counts():
  compilers = RecordingCompiler(view(fused={13, 16}))
  agreement = CompileAgreement(POLICY.micro_batch_sizes())
  chooser = timed_fallback(compilers, cached=None, agreement=agreement)
  plan = plan_batch(100, 8, POLICY)
  assert chooser.ready_plan(plan, 0) is plan  # nothing agreed yet: it waits for its own
  assert compilers.fused.queued == []
  reports = [agreement.report(view(fused={13, 16})), agreement.report(view(fused={16}))]
  agreement.agree(reports)
  assert chooser.ready_plan(plan, 0).micro_batch_size == 16  # 13 is not compiled everywhere
  assert compilers.fused.queued == [[13]]


def test_the_first_step_waits_once_for_the_programs_the_fallback_holds_a_batch_on():
  compilers = RecordingCompiler(view())
  chooser = timed_fallback(compilers, cached=None, agreement=None)
  chooser.await_fallback(13)
  chooser.await_fallback(16)  # once only
  assert (compilers.fused.got, compilers.micro.got, compilers.update.gets) == ([13], [13], 1)
  # With the cache's programs of an earlier process, the nearest of those: loads, not compiles.
  compilers = RecordingCompiler(view())
  cached = {"fused": {16, 4}, "micro": {8}, "apply": True}
  timed_fallback(compilers, cached=cached, agreement=None).await_fallback(13)
  assert (compilers.fused.got, compilers.micro.got, compilers.update.gets) == ([16], [8], 1)


def test_the_runs_last_step_asks_for_no_compile(tmp_path, devices, monkeypatch):
  """The last step, cut to land on the run's end, is followed by none: it runs on a compiled
  shape (or waits for its own without the fallback), and queues no compile of its shape or of
  the shapes near it. Every step before it does."""
  del devices
  asked: list[tuple[int, list[int]]] = []  # (steps done, sizes asked for)
  prefetch = compiler.StepCompiler.prefetch
  training = []  # the trainer, once built (its first trace asks for compiles too)

  def recording_prefetch(self, sizes, *, first=False):
    sizes = list(sizes)
    if training:
      asked.append((training[0].step, sizes))
    return prefetch(self, sizes, first=first)

  monkeypatch.setattr(compiler.StepCompiler, "prefetch", recording_prefetch)
  with tiny_run.make_trainer(
    tmp_path, compile=simigrad_jax.CompileConfig(timed_fallback=True)
  ) as trainer:
    training.append(trainer)
    trainer.train(num_epochs=1.0)
    records = [
      r for r in simigrad_jax.read_metrics(tmp_path / "metrics.jsonl") if "batch_size" in r
    ]
  last = len(records) - 1  # the 0-based step of the last dispatch
  assert records[-1]["examples_seen"] == 120  # one epoch: the last step lands on its end
  assert not [sizes for step, sizes in asked if step == last]
  assert {step for step, _ in asked} == set(range(last))  # the window follows every other step
