"""Host: which of a step's programs compile next, in the background: those near the batch first.

What the policies without a schedule queue (:mod:`simigrad_jax.compile.policy`,
:mod:`simigrad_jax.compile.fallback`).

With the compile fallback (:mod:`simigrad_jax.compile.fallback`), the
one-micro-batch programs within
:data:`~simigrad_jax.shapes.layout.COMPILE_WINDOW_OCTAVES` of the batch's
shape compile, nearest first, and the window follows the batch; without it,
the whole grid, the shapes near the batch moved ahead at each step. The
micro-steps a step of several micro-batches can use, and the update, compile
from the start. Programs the persistent cache holds from
an earlier process of the run go first: they only load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from simigrad_jax.compile.persistent_cache import nearest_cached
from simigrad_jax.compile.program_compiler import StepProgramCompiler
from simigrad_jax.compile.step_functions import APPLY
from simigrad_jax.compile.step_functions import Program
from simigrad_jax.compile.step_functions import ProgramShape
from simigrad_jax.shapes.layout import COMPILE_WINDOW_OCTAVES
from simigrad_jax.shapes.layout import StepLayout


class Prefetcher:
  """Queues a step's programs for the background compiles, the shapes a run needs soonest first.

  The update's compile starts at once when a step may accumulate (some
  ``accumulation_shapes``, or the fallback).

  Args:
    compiler: the step's compiler.
    layout: the step layout (its grid of shapes, in rows per slot).
    accumulation_shapes: the shapes a planned step of several micro-batches
      can use.
    compile_fallback: compile the window of shapes near the batch rather
      than the whole grid (the fallback runs a step on them meanwhile).
    cached: what the persistent cache holds from an earlier process of the
      run (:func:`~simigrad_jax.compile.persistent_cache.cached_view`), or
      None.

  Example:
    ``Prefetcher(compiler, layout, [], compile_fallback=True,
    cached=None).prefetch_for(64)`` queues the shapes near 64 rows a step.
  """

  def __init__(
    self,
    compiler: StepProgramCompiler,
    layout: StepLayout,
    accumulation_shapes: Sequence[int],
    *,
    compile_fallback: bool,
    cached: Mapping[str, Any] | None,
  ):
    self._compiler = compiler
    self._layout = layout
    self._accumulation_shapes = list(accumulation_shapes)
    self._compile_fallback = compile_fallback
    self._cached = cached
    if self._accumulation_shapes or compile_fallback:
      compiler.prefetch([APPLY])

  def prefetch_for(self, batch_size: int) -> None:
    """Queues what a run starting at ``batch_size`` needs.

    The one-micro-batch programs nearest to ``batch_size``'s shape first:
    with the fallback, those within :data:`~simigrad_jax.shapes.layout.
    COMPILE_WINDOW_OCTAVES` of it (:meth:`prefetch_near` queues more as the
    batch moves), else the whole grid; with the fallback, the micro-step of
    the first shape (the fallback accumulates on it while a larger shape
    compiles); the micro-steps of the shapes a batch of several
    micro-batches can plan, largest first; and the update for these.
    """
    window = COMPILE_WINDOW_OCTAVES if self._compile_fallback else None
    shapes = self._layout.shapes_by_distance(batch_size, window)
    cached = self._cached
    if cached is not None:  # the programs the cache holds first: they only load
      shapes.sort(key=lambda size: size not in cached["fused"])
    self._compiler.prefetch([ProgramShape(Program.FUSED, shape) for shape in shapes])
    accumulating = []
    if self._compile_fallback:
      first = self._layout.plan(batch_size).micro_batch_size
      accumulating.append(nearest_cached("micro", first, cached))
    accumulating.extend(self._accumulation_shapes)
    if accumulating:
      micro_steps = [ProgramShape(Program.MICRO, shape) for shape in dict.fromkeys(accumulating)]
      self._compiler.prefetch([APPLY, *micro_steps])

  def prefetch_near(self, micro: int) -> None:
    """Queues the one-micro-batch programs within
    :data:`~simigrad_jax.shapes.layout.COMPILE_WINDOW_OCTAVES` of shape ``micro``,
    nearest first, ahead of those queued before (called at each step, so the
    compiles follow the batch; without the fallback, whose queue holds the
    whole grid from the start, it only moves them ahead)."""
    shapes = self._layout.shapes_near(micro, COMPILE_WINDOW_OCTAVES)
    self._compiler.prefetch([ProgramShape(Program.FUSED, shape) for shape in shapes], first=True)
