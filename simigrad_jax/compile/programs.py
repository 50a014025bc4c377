"""Host: the compiled programs of a training step, per micro-batch shape, and running a plan.

A step of one micro-batch per device runs ONE compiled program (gradient,
reduction and update: :func:`simigrad_jax.ingraph.train_step.make_fused_step`),
one per micro-batch shape of the grid. A step of several micro-batches
accumulates with the micro-step of its shape, then applies the update
(:func:`~simigrad_jax.ingraph.train_step.make_micro_step` and
:func:`~simigrad_jax.ingraph.train_step.make_apply_step`). Every program is
compiled ahead of time from placeholders, in background threads
(:class:`simigrad_jax.StepCompiler`), so that a new shape need not stall the
loop; while a step's program is still compiling, the compile fallback runs the
same examples on the nearest program already compiled.

Shapes are counted in rows per slot: a slot is a device, or with the local
split one of the two blocks of a device's rows
(:mod:`simigrad_jax.shapes.layout`); what is reported is rows per device.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from simigrad_jax.compile.agreement import agreed_view
from simigrad_jax.compile.agreement import report_bitmasks
from simigrad_jax.compile.compiler import StepCompiler
from simigrad_jax.compile.fallback import choose_plan
from simigrad_jax.compile.fallback import nearest_cached
from simigrad_jax.compile.fallback import waits_for_compile
from simigrad_jax.compile.persistent_cache import cache_record
from simigrad_jax.compile.persistent_cache import cached_view
from simigrad_jax.compile.persistent_cache import counting_cache_hits
from simigrad_jax.data.data_loader import StepBatch
from simigrad_jax.ingraph import train_step
from simigrad_jax.shapes import batch_plan
from simigrad_jax.shapes.layout import COMPILE_WINDOW_OCTAVES
from simigrad_jax.shapes.layout import StepLayout


def abstract(tree: Any) -> Any:
  """Placeholders (shape, dtype, sharding) for the arrays of ``tree``."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


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
    compile_fallback: let :meth:`ready_plan` replace a plan whose program is
      still compiling.
    shared_compiles: several processes run the steps together, so a plan
      may only be replaced by a shape compiled on every one of them:
      :meth:`ready_plan` then uses the view that :meth:`agree_on_compiles`
      last set from every process's :meth:`compiled_report`, and waits for
      the exact shape until a first view is set.
    compilation_cache_dir: JAX's persistent compilation cache, if on.
    cached_programs: what an earlier process of the run compiled into that
      cache, as its :meth:`compiled_programs` said (from the checkpoint a
      run resumes). With the fallback and one process, those programs load
      first, and a step that no compiled program can run yet (the first)
      runs on one of them rather than wait for a compile. Ignored when it
      names another cache.

  Raises:
    ValueError: when ``loss_fn``, the optimizer and the data do not fit each
      other; found by tracing the first shape's program (see :meth:`trace`).
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
    shared_compiles: bool = False,
    compilation_cache_dir: str | os.PathLike | None = None,
    cached_programs: Mapping[str, Any] | None = None,
  ):
    self.mesh, self.axis_name, self.layout = mesh, axis_name, layout
    self.num_slots = layout.num_slots
    self._replicated = NamedSharding(mesh, P())
    self._sharded = NamedSharding(mesh, P(axis_name))
    self._element_spec = element_spec
    self._state = abstract(dict(state))
    halves = layout.halves
    self._acc_abstract = train_step.abstract_accumulator(state["params"], mesh, axis_name, halves)
    self._acc = None  # allocated when a step first accumulates
    self._background = background
    self._compile_fallback = compile_fallback
    self._accumulation_shapes = list(accumulation_shapes)
    self._shared_compiles = shared_compiles and compile_fallback
    self._grid = sorted(layout.grid)  # the shapes a report's bitmasks index
    self._agreed: dict[str, Any] | None = None  # what every process has compiled (shared_compiles)
    self._cache_dir = (
      None if compilation_cache_dir is None else os.path.abspath(compilation_cache_dir)
    )
    # What the cache holds from an earlier process of the run: loads, not compiles.
    self._cached = (
      cached_view(cached_programs, self._cache_dir, set(self._grid))
      if compile_fallback and not self._shared_compiles
      else None
    )

    # The state keeps its shardings through every step (model axes, and the data axis a leaf
    # stored sharded over it is gathered from for the step).
    keep = jax.tree.map(lambda x: x.sharding, self._state)
    specs = jax.tree.map(lambda x: x.spec, keep["params"])
    acc_sharding = jax.tree.map(lambda x: x.sharding, self._acc_abstract)
    self._fused = jax.jit(
      train_step.make_fused_step(loss_fn, optimizer, mesh, axis_name, seed, halves, specs),
      donate_argnums=(0, 1, 2),
      out_shardings=(keep["params"], keep["opt_state"], keep["model_state"], self._replicated),
    )
    self._micro = jax.jit(
      train_step.make_micro_step(loss_fn, mesh, axis_name, seed, halves, specs),
      donate_argnums=(2,),
      out_shardings=(acc_sharding, keep["model_state"]),
    )
    self._apply_jit = jax.jit(
      train_step.make_apply_step(optimizer, mesh, axis_name, halves, specs),
      donate_argnums=(0, 1, 2),
      out_shardings=(
        keep["params"],
        keep["opt_state"],
        acc_sharding,
        keep["model_state"],
        self._replicated,
      ),
    )
    self._traced: dict[int, jax.stages.Traced] = {}
    self.fused_compiler = StepCompiler(self._lower_fused, background=background, name="fused_step")
    self.micro_compiler = StepCompiler(self._lower_micro, background=background, name="micro_step")
    self._apply_pool = concurrent.futures.ThreadPoolExecutor(
      1, thread_name_prefix="simigrad-apply-compiler"
    )
    self._apply_future: concurrent.futures.Future | None = None
    self._apply_compile_seconds = 0.0
    self._apply_cache_hit = False
    self._apply_wait_seconds = 0.0
    self._fallback_ready = False  # see await_fallback
    if self._accumulation_shapes or compile_fallback:
      self._start_apply_compile()

  # ------------------------------------------------------------------ compiling

  def _step_args(self, micro: int) -> tuple:
    rows = self.num_slots * micro
    batch = {
      name: jax.ShapeDtypeStruct((rows,) + tuple(shape), dtype, sharding=self._sharded)
      for name, (shape, dtype) in self._element_spec.items()
    }
    weights = jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=self._sharded)
    step_inputs = jax.ShapeDtypeStruct(
      (len(train_step.STEP_INPUTS),), jnp.float32, sharding=self._replicated
    )
    counters = jax.ShapeDtypeStruct((2,), jnp.int32, sharding=self._replicated)
    return batch, weights, step_inputs, counters

  def _fused_args(self, micro: int) -> tuple:
    state = self._state
    return (state["params"], state["opt_state"], state["model_state"], *self._step_args(micro))

  def _micro_args(self, micro: int) -> tuple:
    state = self._state
    return (state["params"], state["model_state"], self._acc_abstract, *self._step_args(micro))

  def trace(self, micro: int) -> None:
    """Traces (does not compile) the one-micro-batch program of shape ``micro``.

    A model, loss, optimizer or data set that do not fit each other fail here
    in seconds; the trace is reused when that shape is compiled.

    Raises:
      ValueError: naming the features, the rows and the error; or the
        ``loss_fn`` contract error as it is.
    """
    try:
      self._traced[micro] = self._fused.trace(*self._fused_args(micro))
    except (train_step.LossContractError, train_step.HalvesContractError):
      raise
    except Exception as error:
      # JAX's "unbound axis name: data", raised as it is or named by the transform's own check.
      if isinstance(error, NameError) or isinstance(error.__cause__, NameError):
        raise ValueError(
          f"the optimizer's simigrad_jax.transform must use the Trainer's "
          f"axis_name={self.axis_name!r}: {error}"
        ) from error
      spec = {k: (tuple(s), str(d)) for k, (s, d) in self._element_spec.items()}
      raise ValueError(
        f"loss_fn fails on one device's rows of this source (features {spec}, "
        f"{self.layout.device_rows(micro)} rows): {type(error).__name__}: {error}"
      ) from error

  def _lower_fused(self, micro: int) -> jax.stages.Lowered:
    traced = self._traced.pop(micro, None)
    return traced.lower() if traced is not None else self._fused.lower(*self._fused_args(micro))

  def _lower_micro(self, micro: int) -> jax.stages.Lowered:
    return self._micro.lower(*self._micro_args(micro))

  def _compile_apply(self) -> jax.stages.Compiled:
    start = time.perf_counter()
    state = self._state
    lowered = self._apply_jit.lower(
      state["params"],
      state["opt_state"],
      self._acc_abstract,
      state["model_state"],
      state["model_state"],
      self._step_args(1)[2],
    )
    with counting_cache_hits() as hits:
      compiled = lowered.compile()
    self._apply_compile_seconds = time.perf_counter() - start
    self._apply_cache_hit = hits[0] > 0
    return compiled

  def _start_apply_compile(self) -> concurrent.futures.Future:
    if self._apply_future is None:
      if self._background:
        self._apply_future = self._apply_pool.submit(self._compile_apply)
      else:
        self._apply_future = concurrent.futures.Future()
        self._apply_future.set_result(self._compile_apply())
    return self._apply_future

  def _apply_program(self) -> jax.stages.Compiled:
    future = self._start_apply_compile()
    start = time.perf_counter()
    done = future.done()
    compiled = future.result()
    if not done:
      self._apply_wait_seconds += time.perf_counter() - start
    return compiled

  def prefetch_for(self, batch_size: int) -> None:
    """Queues for the background compilers what a run starting at ``batch_size`` needs.

    The one-micro-batch programs nearest to ``batch_size``'s shape first:
    with the fallback, those within :data:`~simigrad_jax.shapes.layout.
    COMPILE_WINDOW_OCTAVES` of it (:meth:`prefetch_near` queues more as the
    batch moves), else the whole grid; with the fallback, the micro-step of
    the first shape (the fallback accumulates on it while a larger shape
    compiles); the micro-steps of the shapes a batch of several
    micro-batches can plan, largest first; and the update for these.
    """
    window = COMPILE_WINDOW_OCTAVES if self._compile_fallback else None
    shapes = self.layout.shapes_by_distance(batch_size, window)
    cached = self._cached
    if cached is not None:  # the programs the cache holds first: they only load
      shapes.sort(key=lambda size: size not in cached["fused"])
    self.fused_compiler.prefetch(shapes)
    accumulating = []
    if self._compile_fallback:
      accumulating.append(
        nearest_cached("micro", self.layout.plan(batch_size).micro_batch_size, self._cached)
      )
    accumulating.extend(self._accumulation_shapes)
    if accumulating:
      self._start_apply_compile()
      self.micro_compiler.prefetch(list(dict.fromkeys(accumulating)))

  def prefetch_near(self, micro: int) -> None:
    """With the fallback, queues the one-micro-batch programs within
    :data:`~simigrad_jax.shapes.layout.COMPILE_WINDOW_OCTAVES` of shape ``micro``,
    nearest first, ahead of those queued before (called at each step, so the
    compiles follow the batch)."""
    if self._compile_fallback:
      self.fused_compiler.prefetch(
        self.layout.shapes_near(micro, COMPILE_WINDOW_OCTAVES), first=True
      )

  def await_fallback(self, micro: int) -> None:
    """Waits until the compile fallback can hold a batch of any size on shape ``micro``.

    That is the one-micro-batch program of ``micro``, its micro-step and the
    update: a batch larger than one micro-batch of ``micro`` then accumulates
    on it. Called once, at the first step (which waits for its own program
    anyway, and whose devices run while this waits), so that no later step
    waits for a compile. When the persistent cache holds programs of an
    earlier process of the run (``cached_programs``) but not ``micro``'s, the
    programs are those of its nearest shape instead: loads, not compiles.
    The time blocked counts as compile wait. A no-op without the fallback or
    once done.
    """
    if not self._compile_fallback or self._fallback_ready:
      return
    self.fused_compiler.get(nearest_cached("fused", micro, self._cached))
    self.micro_compiler.get(nearest_cached("micro", micro, self._cached))
    self._apply_program()
    self._fallback_ready = True

  def compiled_programs(self) -> dict[str, Any] | None:
    """What the persistent compilation cache holds from this run, for its checkpoints; None
    without the cache.

    The shapes (rows per slot) with a one-micro-batch program (``fused``)
    and with a micro-step (``micro``), whether the update is (``apply``),
    compiled by this process or by the earlier ones it resumed, and the
    cache's folder: pass it as ``cached_programs`` when the run resumes.
    """
    if self._cache_dir is None:
      return None
    return cache_record(self._cache_dir, self._compiled_here(), self._cached)

  # ------------------------------------------------------------------ choosing

  def _compiled_here(self) -> dict[str, Any]:
    """The shapes this process has compiled (or failed to compile) so far."""
    fused, micro = self.fused_compiler.stats(), self.micro_compiler.stats()
    return {
      "fused": set(fused["compiled_sizes"]),
      "micro": set(micro["compiled_sizes"]),
      "apply": self._apply_future is not None and self._apply_future.done(),
      "failed_fused": set(fused["failed_sizes"]),
      "failed_micro": set(micro["failed_sizes"]),
    }

  def compiled_report(self) -> dict[str, int] | None:
    """This process's compiled shapes for the other processes; None unless ``shared_compiles``.

    Bitmasks over the layout's grid of shapes
    (:func:`~simigrad_jax.compile.agreement.report_bitmasks`).
    """
    if not self._shared_compiles:
      return None
    return report_bitmasks(self._compiled_here(), self._grid)

  def agree_on_compiles(self, reports: list[dict[str, int]]) -> None:
    """Sets the view :meth:`ready_plan` uses to what EVERY process reported compiled.

    Every process passes the same ``reports`` (one per process, gathered at
    a step's agreement), so every process takes the same fallback decision
    at the next step and the collectives of the step match.
    """
    self._agreed = agreed_view(reports, self._grid)

  def ready_plan(self, plan: batch_plan.BatchPlan, prefetch: bool = True) -> batch_plan.BatchPlan:
    """``plan``, or while its program is still compiling, the same batch on the nearest compiled one.

    The compiled shape that holds the batch in the fewest micro-steps,
    the nearest in log scale among those (ties: the larger shape): a larger
    shape pads with zero-weight rows, a smaller one accumulates
    (:func:`~simigrad_jax.compile.fallback.choose_plan`). The
    examples and their devices are those of ``plan``. A shape whose compile
    FAILED is not replaced: running it raises. With ``shared_compiles``,
    "compiled" means compiled on every process, as the last
    :meth:`agree_on_compiles` said. A program not compiled yet is queued for
    compiling unless ``prefetch`` is False (the run's last step).
    """
    if not self._compile_fallback:
      return plan
    if self._shared_compiles:
      if self._agreed is None:
        return plan
      compiled = self._agreed
    else:
      compiled = self._compiled_here()
    if prefetch and waits_for_compile(plan, compiled):
      # (a no-op when queued or compiling)
      compiler = self.fused_compiler if plan.accumulation_steps == 1 else self.micro_compiler
      compiler.prefetch([plan.micro_batch_size])
    return choose_plan(plan, compiled, self._cached)

  # ------------------------------------------------------------------ running

  def run(
    self, state: Mapping[str, Any], data: StepBatch, step_inputs: jax.Array
  ) -> tuple[dict[str, Any], jax.Array]:
    """Dispatches one optimizer step; returns the new state and the stats vector (not waited for).

    Args:
      state: the ``{"params", "opt_state", "model_state"}`` on the mesh; its
        arrays are donated.
      data: the step's micro-batches, as :attr:`StepBatch.plan` lays them out.
      step_inputs: float32 :data:`~simigrad_jax.ingraph.train_step.STEP_INPUTS`,
        replicated.

    Returns:
      ``(new_state, stats)``: ``stats`` is the float32 vector of
      :data:`~simigrad_jax.ingraph.train_step.STEP_STATS`.
    """
    plan = data.plan
    params, opt_state, model_state = state["params"], state["opt_state"], state["model_state"]
    if plan.accumulation_steps == 1:
      ((batch, weights),) = data.micro_batches
      program = self.fused_compiler.get(plan.micro_batch_size)
      params, opt_state, model_state, stats = program(
        params, opt_state, model_state, batch, weights, step_inputs, data.counters[0]
      )
    else:
      program = self.micro_compiler.get(plan.micro_batch_size)
      apply = self._apply_program()
      acc = self._acc
      if acc is None:
        acc = train_step.zero_accumulator(params, self.mesh, self.axis_name, self.layout.halves)
      accumulated_state = model_state
      for (batch, weights), counters in zip(data.micro_batches, data.counters, strict=True):
        acc, accumulated_state = program(
          params, accumulated_state, acc, batch, weights, step_inputs, counters
        )
      params, opt_state, self._acc, model_state, stats = apply(
        params, opt_state, acc, model_state, accumulated_state, step_inputs
      )
    return {"params": params, "opt_state": opt_state, "model_state": model_state}, stats

  # ------------------------------------------------------------------ reporting

  def memory(self, micro: int) -> dict[str, int]:
    """Compiled memory of the one-micro-batch program of shape ``micro`` (compiling it if needed).

    Returns:
      ``micro_batch_size`` (rows per device), ``argument_bytes``,
      ``output_bytes``, ``alias_bytes`` (outputs that reuse donated
      arguments) and ``temp_bytes``, from XLA's ``memory_analysis()``.
    """
    analysis = self.fused_compiler.get(micro).memory_analysis()
    if analysis is None:
      raise RuntimeError(f"XLA reports no memory analysis for the {jax.default_backend()} backend")
    return {
      "micro_batch_size": self.layout.device_rows(micro),
      "argument_bytes": int(analysis.argument_size_in_bytes),
      "output_bytes": int(analysis.output_size_in_bytes),
      "alias_bytes": int(analysis.alias_size_in_bytes),
      "temp_bytes": int(analysis.temp_size_in_bytes),
    }

  def wait_seconds(self) -> float:
    """Seconds steps have waited for compiles so far (cheap enough for every step)."""
    return (
      self.fused_compiler.wait_seconds + self.micro_compiler.wait_seconds + self._apply_wait_seconds
    )

  def stats(self) -> dict[str, Any]:
    """Compiles so far, their seconds, the seconds steps waited, and the compiled shapes.

    ``compiled_step_sizes`` are the shapes with a one-micro-batch program,
    ``compiled_accumulation_sizes`` those with a micro-step (all in rows per
    device), and ``update_compiled`` says whether the update of accumulated
    steps is. ``compile_cache_hits`` are the compiles (of ``compiles``) that
    loaded their program from JAX's persistent compilation cache, and
    ``compile_cache_hit_seconds`` their seconds (of ``compile_seconds``:
    tracing and lowering, then the load).
    """
    fused, micro = self.fused_compiler.stats(), self.micro_compiler.stats()
    apply_compiled = (
      self._apply_future is not None
      and self._apply_future.done()
      and self._apply_future.exception() is None
    )
    rows = lambda sizes: [self.layout.device_rows(size) for size in sizes]
    return {
      "compiles": fused["compiles"] + micro["compiles"] + int(apply_compiled),
      "compile_seconds": (
        fused["compile_seconds"] + micro["compile_seconds"] + self._apply_compile_seconds
      ),
      "compile_wait_seconds": self.wait_seconds(),
      "compile_cache_hits": (
        fused["cache_hits"] + micro["cache_hits"] + int(apply_compiled and self._apply_cache_hit)
      ),
      "compile_cache_hit_seconds": (
        fused["cache_hit_seconds"]
        + micro["cache_hit_seconds"]
        + (self._apply_compile_seconds if apply_compiled and self._apply_cache_hit else 0.0)
      ),
      "compiled_micro_batch_sizes": rows(
        sorted(set(fused["compiled_sizes"]) | set(micro["compiled_sizes"]))
      ),
      "compiled_step_sizes": rows(fused["compiled_sizes"]),
      "compiled_accumulation_sizes": rows(micro["compiled_sizes"]),
      "update_compiled": apply_compiled,
    }

  def close(self) -> None:
    """Cancels queued compiles and waits for those in progress."""
    self.fused_compiler.close()
    self.micro_compiler.close()
    self._apply_pool.shutdown(wait=True, cancel_futures=True)
