"""Host: the jitted functions of a training step, and the placeholders they are traced and
lowered on.

A step of one micro-batch per device runs the fused step (gradient,
reduction and update: :func:`simigrad_jax.ingraph.train_step.make_fused_step`),
or, when it does not measure the similarity, the plain step
(:func:`~simigrad_jax.ingraph.train_step.make_plain_step`);
a step of several micro-batches accumulates with the micro-step, then applies
the update (:func:`~simigrad_jax.ingraph.train_step.make_micro_step` and
:func:`~simigrad_jax.ingraph.train_step.make_apply_step`). Each is jitted once
with the shardings the state keeps, and lowered per micro-batch shape on
``jax.ShapeDtypeStruct`` placeholders (no data needed), for the compilers of
:mod:`simigrad_jax.compile.compiler`. Nothing here runs a step.

The programs are named by :class:`Program`, and a program of one shape
by :class:`ProgramShape` (the key the compiler of
:mod:`simigrad_jax.compile.program_compiler` compiles them by).

Shapes are counted in rows per slot: a slot is a device, or with the local
split one of the two blocks of a device's rows
(:mod:`simigrad_jax.shapes.layout`).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from simigrad_jax.ingraph import train_step
from simigrad_jax.shapes import batch_plan
from simigrad_jax.shapes.layout import StepLayout


class Program(enum.StrEnum):
  """The programs of a training step.

  Their values are the names a checkpoint records them by (the compile
  schedule's state, the persistent cache's record) and the keys of a *view*
  of the compiled programs (:mod:`simigrad_jax.compile.fallback`).

  Attributes:
    FUSED: a step of one micro-batch per device: gradient, reduction and
      update in one program (one per shape).
    MICRO: a micro-step of a step of several micro-batches: the gradient,
      added to the accumulator (one per shape).
    APPLY: the update of the accumulated micro-steps (one for every shape).
    PLAIN: a step of one micro-batch per device that does not measure the
      similarity (``measure_every``): one gradient pass per device, the
      reduction and the update, in one program (one per shape).
  """

  FUSED = "fused"
  MICRO = "micro"
  APPLY = "apply"
  PLAIN = "plain"


class ProgramShape(NamedTuple):
  """A program of a training step at one micro-batch shape: what is compiled, once.

  Attributes:
    program: which program.
    micro: its shape in rows per slot; 0 for :attr:`Program.APPLY`, the same
      program for every shape.

  Example:
    >>> ProgramShape(Program.MICRO, 4) == ("micro", 4)
    True
  """

  program: Program
  micro: int


# The update of accumulated micro-steps: one program for every shape.
APPLY = ProgramShape(Program.APPLY, 0)


def _key(program: Program, micro: int) -> ProgramShape:
  """The :class:`ProgramShape` of ``program`` at shape ``micro`` (:data:`APPLY` whatever the
  shape)."""
  return APPLY if program is Program.APPLY else ProgramShape(program, micro)


def programs_of(plan: batch_plan.BatchPlan, measure: bool = True) -> list[ProgramShape]:
  """The programs a step of ``plan`` runs: its shape's fused step, or the micro-step of each of
  its shapes (largest first) and the update.

  A step that does not measure (``measure=False``) runs its shape's plain
  step; one of several micro-batches measures (its programs are the
  measuring step's).

  Example:
    >>> plan = batch_plan.plan_batch(64, 8, batch_plan.BucketPolicy(4, 1))  # 8 rows: 2 steps of 4
    >>> programs_of(plan) == [(Program.MICRO, 4), APPLY]
    True
  """
  if plan.accumulation_steps == 1:
    program = Program.FUSED if measure else Program.PLAIN
    return [ProgramShape(program, plan.micro_batch_size)]
  micro = [ProgramShape(Program.MICRO, size) for size in dict.fromkeys(plan.shapes)]
  return [*micro, APPLY]


def abstract(tree: Any) -> Any:
  """Placeholders (shape, dtype, sharding) for the arrays of ``tree``.

  Example:
    >>> import jax.numpy as jnp
    >>> abstract({"w": jnp.zeros((2, 3))})["w"].shape
    (2, 3)
  """
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class StepFunctions:
  """The jitted fused step, micro-step and update of a data-parallel training step, lowered on
  placeholders for any micro-batch shape.

  Args:
    loss_fn: the per-example loss (see :class:`simigrad_jax.Trainer`), already
      checked.
    optimizer: the optax optimizer, with :func:`simigrad_jax.transform` over
      ``axis_name`` and :func:`simigrad_jax.scale_by_lr_factor`.
    mesh: the mesh; its axis ``axis_name`` holds the data-parallel devices
      (the slots), its other axes, if any, the model's shards.
    axis_name: the data axis.
    layout: the step layout (halves, slots); shapes (``micro``) are in rows
      per slot.
    seed: the run's seed (per-step random keys derive from it).
    state: the ``{"params", "opt_state", "model_state"}`` on the mesh (its
      shapes, dtypes and shardings make the placeholders and the shardings
      the steps keep; nothing else is kept).
    element_spec: the source's ``{name: (shape, dtype)}`` per example.
    passes: with the local split, how the fused step and the micro-step
      take the two halves' gradients (a name in
      :data:`simigrad_jax.ingraph.half_batch.PASSES`); the device split and
      the plain step read none.

  Attributes:
    mesh: the mesh the functions run on.
    axis_name: its data axis.
    layout: the step layout the functions were made for.

  Example:
    A step's programs come from :meth:`lower`, e.g.
    ``StepCompiler(functions.lower_fused)`` for the fused steps alone, or
    :class:`~simigrad_jax.compile.program_compiler.StepProgramCompiler`, which
    compiles every program by its :class:`ProgramShape`.
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
    passes: str = "sequential",
  ):
    self.mesh, self.axis_name, self.layout = mesh, axis_name, layout
    self._replicated = NamedSharding(mesh, P())
    self._sharded = NamedSharding(mesh, P(axis_name))
    self._element_spec = element_spec
    self._state = abstract(dict(state))
    halves = layout.halves
    self._acc = train_step.abstract_accumulator(state["params"], mesh, axis_name, halves)
    # The state keeps its shardings through every step (model axes, and the data axis a leaf
    # stored sharded over it is gathered from for the step).
    keep = jax.tree.map(lambda x: x.sharding, self._state)
    specs = jax.tree.map(lambda x: x.spec, keep["params"])
    acc_sharding = jax.tree.map(lambda x: x.sharding, self._acc)
    self._fused = jax.jit(
      train_step.make_fused_step(
        loss_fn, optimizer, mesh, axis_name, seed, halves, specs, passes=passes
      ),
      donate_argnums=(0, 1, 2),
      out_shardings=(keep["params"], keep["opt_state"], keep["model_state"], self._replicated),
    )
    self._plain = jax.jit(
      train_step.make_plain_step(loss_fn, optimizer, mesh, axis_name, seed, specs),
      donate_argnums=(0, 1, 2),
      out_shardings=(keep["params"], keep["opt_state"], keep["model_state"], self._replicated),
    )
    self._micro = jax.jit(
      train_step.make_micro_step(loss_fn, mesh, axis_name, seed, halves, specs, passes),
      donate_argnums=(2,),
      out_shardings=(acc_sharding, keep["model_state"]),
    )
    self._apply = jax.jit(
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
    # The first accumulated step's zero accumulator (later steps reuse the update's cleared one):
    # compiled beside the update (lower_apply), not in the step that first accumulates.
    self._zeros = train_step.zeros_program(self._acc)
    self._zeros_compiled: jax.stages.Compiled | None = None
    self._zeros_lock = threading.Lock()
    self._traced: dict[ProgramShape, jax.stages.Traced] = {}
    self._lowered: dict[ProgramShape, jax.stages.Lowered] = {}  # lowered ahead (lower_ahead)
    self._traces_under_way: dict[ProgramShape, threading.Event] = {}
    self._marks_lock = threading.Lock()  # a mark's end replaces nothing marked since (below)

  def trace(self, micro: int, program: Program = Program.FUSED) -> None:
    """Traces (does not compile) the ``program`` (by default the fused step) of shape ``micro``.

    A model, loss, optimizer or data set that do not fit each other fail here
    in seconds (the loss and the data in a fused step or a micro-step, the
    optimizer in a fused step or the update); the trace is reused when
    :meth:`lower` lowers that program.

    Args:
      micro: the shape, in rows per slot (any, for :attr:`Program.APPLY`).
      program: :attr:`Program.FUSED`, :attr:`Program.MICRO` or
        :attr:`Program.APPLY` (KeyError for :attr:`Program.PLAIN`).

    Raises:
      ValueError: naming the features, the rows and the error (for the
        update, the optimizer's error); or the ``loss_fn`` contract error as
        it is.
    """
    key = _key(program, micro)
    jitted, args = {
      Program.FUSED: lambda: (self._fused, self._fused_args(micro)),
      Program.MICRO: lambda: (self._micro, self._micro_args(micro)),
      Program.APPLY: lambda: (self._apply, self._apply_args()),
    }[program]()
    try:
      self._traced[key] = jitted.trace(*args)
    except (train_step.LossContractError, train_step.HalvesContractError):
      raise
    except Exception as error:
      # JAX's "unbound axis name: data", raised as it is or named by the transform's own check.
      if isinstance(error, NameError) or isinstance(error.__cause__, NameError):
        raise ValueError(
          f"the optimizer's simigrad_jax.transform must use the Trainer's "
          f"axis_name={self.axis_name!r}: {error}"
        ) from error
      if program is Program.APPLY:
        raise ValueError(
          f"the optimizer fails on the parameters' gradients: {type(error).__name__}: {error}"
        ) from error
      spec = {k: (tuple(s), str(d)) for k, (s, d) in self._element_spec.items()}
      raise ValueError(
        f"loss_fn fails on one device's rows of this source (features {spec}, "
        f"{self.layout.device_rows(micro)} rows): {type(error).__name__}: {error}"
      ) from error

  def trace_under_way(self, micro: int, program: Program = Program.FUSED) -> Callable[[], None]:
    """Marks the ``program`` (by default the fused step) of shape ``micro`` as traced (and
    lowered) by another thread, from now on.

    Until the mark ends, lowering that program waits for the trace and lowers
    it, rather than tracing the program a second time beside it, and every
    other lowering (:meth:`lower`) waits too: tracing and lowering hold the
    GIL, and the first step needs its programs before the others (the first
    step's programs are traced and lowered while the run is set up and its
    compiler's threads hold the other programs:
    :class:`~simigrad_jax.compile.first_program.FirstProgram`).

    Args:
      micro: the shape whose trace is under way, in rows per slot (any, for
        :attr:`Program.APPLY`).
      program: the program whose trace is under way.

    Returns:
      What ends the mark: call it once when the trace is over, whether it
      succeeded or failed (a failed trace leaves nothing to lower from, so
      the lowering traces again and meets the same error).
    """
    key = _key(program, micro)
    over = threading.Event()
    with self._marks_lock:
      self._traces_under_way[key] = over

    def end() -> None:
      # Under the lock: a mark of the same program made between the check and the removal would
      # be removed with it, and its lowerings would not wait.
      with self._marks_lock:
        if self._traces_under_way.get(key) is over:
          del self._traces_under_way[key]
      over.set()

    return end

  def lower(self, key: ProgramShape) -> jax.stages.Lowered:
    """The program ``key`` names, lowered (:meth:`lower_fused`, :meth:`lower_plain`,
    :meth:`lower_micro` or :meth:`lower_apply`): at once when it was lowered ahead
    (:meth:`lower_ahead`), else once no trace is under way (:meth:`trace_under_way`)."""
    if key not in self._lowered:
      for under_way in list(self._traces_under_way.values()):
        under_way.wait()
    if key.program is Program.FUSED:
      return self.lower_fused(key.micro)
    if key.program is Program.PLAIN:
      return self.lower_plain(key.micro)
    if key.program is Program.MICRO:
      return self.lower_micro(key.micro)
    return self.lower_apply()

  def lower_fused(self, micro: int) -> jax.stages.Lowered:
    """The fused step of shape ``micro``, lowered (from its :meth:`trace`, if any; a trace
    under way in another thread is waited for: :meth:`trace_under_way`)."""
    return self._lower_traced(_key(Program.FUSED, micro), self._fused, self._fused_args(micro))

  def lower_ahead(self, micro: int, program: Program = Program.FUSED) -> None:
    """Lowers the ``program`` (by default the fused step) of shape ``micro`` from its
    :meth:`trace` now, in the calling thread, and keeps it for :meth:`lower`.

    Nothing without a trace of that program. A lowering that fails keeps the
    trace: :meth:`lower` lowers it again in the compiler's thread, and meets
    the error there, where a compile's errors are reported.
    """
    key = _key(program, micro)
    traced = self._traced.get(key)
    if traced is None:
      return
    try:
      lowered = traced.lower()
    except Exception:  # (met again, and reported, by lower)
      return
    self._lowered[key] = lowered
    del self._traced[key]

  def lower_plain(self, micro: int) -> jax.stages.Lowered:
    """The plain step (a step that does not measure) of shape ``micro``, lowered."""
    return self._plain.lower(*self._fused_args(micro))

  def lower_micro(self, micro: int) -> jax.stages.Lowered:
    """The micro-step of shape ``micro``, lowered (from its :meth:`trace`, if any)."""
    return self._lower_traced(_key(Program.MICRO, micro), self._micro, self._micro_args(micro))

  def lower_apply(self) -> jax.stages.Lowered:
    """The update of accumulated micro-steps (one program for every shape), lowered (from its
    :meth:`trace`, if any).

    The zero accumulator's program (:meth:`zero_accumulator`) is compiled
    first, in the calling thread: the compiler's thread of the update, so
    that a step that waits for the update's compile finds both ready, rather
    than compiling the accumulator's program itself when it first
    accumulates.
    """
    self._compiled_zeros()
    return self._lower_traced(APPLY, self._apply, self._apply_args())

  def _lower_traced(
    self, key: ProgramShape, jitted: jax.stages.Wrapped, args: tuple
  ) -> jax.stages.Lowered:
    """``key``'s program lowered ahead, or lowered from its trace, or traced and lowered now; a
    trace of it under way in another thread is waited for first."""
    under_way = self._traces_under_way.get(key)
    if under_way is not None:
      under_way.wait()
    lowered = self._lowered.pop(key, None)
    if lowered is not None:
      return lowered
    traced = self._traced.pop(key, None)
    return traced.lower() if traced is not None else jitted.lower(*args)

  def zero_accumulator(self) -> train_step.Accumulator:
    """A zero accumulator, for the first step that accumulates (the update returns it cleared for
    the next): its program compiled by :meth:`lower_apply`, or now when no update was lowered."""
    return self._compiled_zeros()()

  def _compiled_zeros(self) -> jax.stages.Compiled:
    """The zero accumulator's program, compiled once (whichever thread asks first)."""
    with self._zeros_lock:
      if self._zeros_compiled is None:
        self._zeros_compiled = self._zeros.lower().compile()
      return self._zeros_compiled

  def _micro_args(self, micro: int) -> tuple:
    state = self._state
    return (state["params"], state["model_state"], self._acc, *self._step_args(micro))

  def _apply_args(self) -> tuple:
    state = self._state
    model_state = state["model_state"]
    return (
      state["params"],
      state["opt_state"],
      self._acc,
      model_state,
      model_state,
      self._scalars(),
    )

  def _step_args(self, micro: int) -> tuple:
    rows = self.layout.num_slots * micro
    batch = {
      name: jax.ShapeDtypeStruct((rows,) + tuple(shape), dtype, sharding=self._sharded)
      for name, (shape, dtype) in self._element_spec.items()
    }
    weights = jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=self._sharded)
    counters = jax.ShapeDtypeStruct((2,), jnp.int32, sharding=self._replicated)
    return batch, weights, self._scalars(), counters

  def _scalars(self) -> train_step.StepScalars:
    """The placeholders of a step's :class:`~simigrad_jax.ingraph.train_step.StepScalars` (each
    a replicated float32 scalar)."""
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=self._replicated)
    return train_step.StepScalars._make([scalar] * len(train_step.StepScalars._fields))

  def _fused_args(self, micro: int) -> tuple:
    state = self._state
    return (state["params"], state["opt_state"], state["model_state"], *self._step_args(micro))
