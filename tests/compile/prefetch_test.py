"""The order of the compiles: the shapes near the batch first, the window following it, the
cache's programs before the others, the micro-steps and update a step may accumulate on."""

import pytest
from recording_compilers import RecordingCompiler

from simigrad_jax.compile.prefetch import Prefetcher
from simigrad_jax.shapes.layout import StepLayout

# 8 devices, two shapes an octave: (1, 2, 3, 4, 6, 8, 12, 16, 23, 32) rows; 64 examples: 8 rows.
LAYOUT = StepLayout.create(
  "device", 8, mode="recompile", max_micro=32, min_micro=1, lower=8, upper=256, shapes_per_octave=2
)


def prefetcher(accumulation_shapes=(), compile_fallback=True, cached=None):
  compilers = RecordingCompiler()
  prefetch = Prefetcher(
    compilers, LAYOUT, accumulation_shapes, compile_fallback=compile_fallback, cached=cached
  )
  return prefetch, compilers


def test_without_the_fallback_the_whole_grid_queues_nearest_first_then_follows_the_batch():
  prefetch, compilers = prefetcher(compile_fallback=False)
  assert compilers.update.prefetches == 0  # no step accumulates
  prefetch.prefetch_for(64)
  assert compilers.fused.queued == [[8, 6, 12, 4, 16, 3, 23, 2, 32, 1]]
  assert compilers.micro.queued == [] and compilers.update.prefetches == 0
  prefetch.prefetch_near(16)  # the shapes near the batch move ahead: it follows the batch
  assert compilers.fused.first == [[16, 12]]


def test_with_the_fallback_the_window_queues_then_follows_the_batch():
  prefetch, compilers = prefetcher()
  assert compilers.update.prefetches == 1  # the fallback may accumulate from the first step
  prefetch.prefetch_for(64)
  assert compilers.fused.queued == [[8, 6]]
  assert compilers.micro.queued == [[8]]  # the first shape's micro-step
  prefetch.prefetch_near(12)
  assert compilers.fused.first == [[12, 16]]  # ahead of those queued before


def test_the_micro_steps_of_the_accumulation_shapes_queue_with_the_update():
  prefetch, compilers = prefetcher(accumulation_shapes=[32, 8, 23], compile_fallback=True)
  assert compilers.update.prefetches == 1
  prefetch.prefetch_for(64)
  assert compilers.micro.queued == [[8, 32, 23]]  # 8 once, first: the fallback's
  assert compilers.update.prefetches == 2  # (a no-op once started)
  prefetch, compilers = prefetcher(accumulation_shapes=[32, 23], compile_fallback=False)
  prefetch.prefetch_for(64)
  assert compilers.micro.queued == [[32, 23]]


@pytest.mark.parametrize(
  "cached, fused, micro",
  [
    ({"fused": {6}, "micro": {4}, "apply": True}, [6, 8], [4]),  # loads before compiles
    ({"fused": set(), "micro": {8, 16}, "apply": False}, [8, 6], [8]),  # its own is held
    ({"fused": {32}, "micro": set(), "apply": False}, [8, 6], [8]),  # outside the window
  ],
)
def test_the_programs_the_cache_holds_queue_first(cached, fused, micro):
  prefetch, compilers = prefetcher(cached=cached)
  prefetch.prefetch_for(64)
  assert compilers.fused.queued == [fused]
  assert compilers.micro.queued == [micro]
