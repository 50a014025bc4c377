"""Host: an own loop's SimiGrad step at whatever batch size the controller asks for.

:class:`AdaptiveStep` is the step of a user's own adaptive loop: it takes the
parameters, the optimizer state and a batch of any size, plans the batch on a
few compiled shapes (:class:`simigrad_jax.shapes.layout.StepLayout`: shapes
a factor ``2^(1 / shapes_per_octave)`` apart, the spare rows padding of
weight 0), lays the rows out in the order the devices take them, and runs the
Trainer's own compiled programs (:mod:`simigrad_jax.compile.step_functions`): one program
for a batch up to ``max_batch_size``, the micro-step and the update for a
larger one. What it computes is the Trainer's step: the mean gradient over the
batch's examples, and the similarity of its even- and odd-numbered examples'
gradients, exactly those of a plain ``jax.jit`` step of
:func:`simigrad_jax.value_and_half_grads` on the same batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from simigrad_jax import validation
from simigrad_jax.compile.step_functions import APPLY
from simigrad_jax.compile.step_functions import Program
from simigrad_jax.compile.step_functions import ProgramShape
from simigrad_jax.compile.step_functions import StepFunctions
from simigrad_jax.compile.step_functions import programs_of
from simigrad_jax.errors import SimiGradError
from simigrad_jax.ingraph import train_step
from simigrad_jax.shapes import batch_plan
from simigrad_jax.shapes.layout import StepLayout
from simigrad_jax.shapes.layout import resolve_halves
from simigrad_jax.trainer import checks

# loss_fn(params, batch) -> one loss per row of batch (no mean: the step weighs the rows).
RowLossFn = Callable[[Any, Mapping[str, jax.Array]], jax.Array]

DEFAULT_SHAPES_PER_OCTAVE = 4


class AdaptiveBatchError(SimiGradError, ValueError):
  """A batch :class:`AdaptiveStep` cannot run: no rows, rows of different counts, other names."""


class AdaptiveStep:
  """SimiGrad's step for an own loop, at the batch size the controller asks for, in one program.

  A step takes a batch of any size: it is planned on a few compiled shapes,
  ``shapes_per_octave`` per factor of two between ``min_batch_size`` and
  ``max_batch_size`` (each shape compiled when a batch first needs it), and
  the rows it lacks are padding of weight 0, so a batch up to
  ``max_batch_size`` runs as one compiled program (its gradient, the halves'
  statistics and the update) and a larger one as several micro-steps of the
  largest shape, accumulated on the devices, and the update. The mean
  gradient is over the batch's examples, and the similarity that of its even-
  and odd-numbered examples' gradients, as
  :func:`simigrad_jax.value_and_half_grads` splits a batch: the same numbers
  as a plain ``jax.jit`` step of it on the same batch. With
  ``measure_every=k`` only every ``k``-th step measures; the steps between
  are plain steps, each one gradient pass over its batch, in a program of
  its own per shape.

  On an even number of devices the halves are the even and the odd devices
  (example ``e`` on device ``e % n``), on one or an odd number each device's
  rows in two blocks (:mod:`simigrad_jax.shapes.layout`). The parameters and
  the optimizer state are replicated on the devices (:meth:`init`); a step
  donates them and returns the new ones, placed for the next step.

  The host's share of a step is small: the rows gathered into the devices'
  order (one ``np.take`` per array, a copy: the batch may change once the
  call returns) and handed to the program as NumPy arrays, which its call
  places; a batch size seen before reuses its plan, its row weights and its
  scalars already on the devices, and nothing waits for the devices.

  Args:
    loss_fn: ``loss_fn(params, batch) -> losses``, one loss per row of
      ``batch`` (a dict of arrays with a shared leading row axis: one device's
      rows, padding rows included), no mean: the step weighs the rows.
    optimizer: an optax optimizer whose chain holds
      ``simigrad_jax.transform(axis_name)`` and
      ``simigrad_jax.scale_by_lr_factor()``.
    max_batch_size: the largest batch one program runs; a larger one
      accumulates micro-steps of that size.
    min_batch_size: the smallest batch size of the run, which sets the
      smallest compiled shape (smaller batches pad up to it); None: 2 (the
      smallest batch whose second half holds an example).
    shapes_per_octave: compiled shapes per factor of two (1 to 16): more pad
      less and compile more.
    measure_every: ``k``: the steps numbered ``0, k, 2k, ...`` (counted by
      :attr:`steps`) measure the similarity; the others are plain steps, one
      gradient pass over the batch and the update, at the plain step's cost
      (the optimizer state keeps the last measurement, with ``measured``
      False). :meth:`measuring` says which; a step of several micro-steps
      (above ``max_batch_size``) always measures.
    mesh: a mesh with the data axis ``axis_name``; None: every device on it.
    axis_name: the data axis, the name the optimizer's transform is given.
    seed: the seed of the programs' random keys, which the loss does not see
      (nothing it computes depends on it); an integer in ``[0, 2**32 - 1]``.

  Example:
    >>> import jax.numpy as jnp, numpy as np, optax, simigrad_jax
    >>> loss = lambda w, batch: (batch["x"] @ w - batch["y"]) ** 2  # one loss per row
    >>> opt = optax.chain(
    ...   simigrad_jax.transform("batch"), optax.sgd(0.1), simigrad_jax.scale_by_lr_factor())
    >>> step = simigrad_jax.AdaptiveStep(loss, opt, max_batch_size=64)
    >>> w, opt_state = step.init(jnp.zeros(3))
    >>> batch = {"x": np.ones((40, 3), np.float32), "y": np.arange(40, dtype=np.float32)}
    >>> w, opt_state, measured = step(w, opt_state, batch)
    >>> -1 <= simigrad_jax.similarity(opt_state) <= 1
    True
  """

  def __init__(
    self,
    loss_fn: RowLossFn,
    optimizer: optax.GradientTransformation,
    *,
    max_batch_size: int,
    min_batch_size: int | None = None,
    shapes_per_octave: int = DEFAULT_SHAPES_PER_OCTAVE,
    measure_every: int = 1,
    mesh: Mesh | None = None,
    axis_name: str = "batch",
    seed: int = 0,
  ):
    checks.check_callable("loss_fn", loss_fn)
    upper = validation.check_int("max_batch_size", max_batch_size, 2)
    lower = 2 if min_batch_size is None else min_batch_size
    if not validation.is_int(lower) or not 2 <= lower <= upper:
      raise ValueError(
        f"min_batch_size must be None or an int in [2, max_batch_size={upper}] (a batch below 2 "
        f"leaves its second half without an example), got {min_batch_size!r}"
      )
    if not isinstance(axis_name, str) or not axis_name:
      raise ValueError(f"axis_name must be a non-empty string, got {axis_name!r}")
    if jax.process_count() > 1:
      raise ValueError(
        "AdaptiveStep runs in one process (it lays out every row of the batch itself); with "
        f"{jax.process_count()} processes use simigrad_jax.Trainer"
      )
    if mesh is None:
      mesh = jax.make_mesh((jax.device_count(),), (axis_name,), (jax.sharding.AxisType.Auto,))
    if not isinstance(mesh, Mesh) or axis_name not in mesh.axis_names:
      raise ValueError(
        f"mesh must be a jax.sharding.Mesh with the data axis {axis_name!r}, got {mesh!r:.200}"
      )
    num_data = mesh.shape[axis_name]
    self._layout = StepLayout.create(
      resolve_halves("auto", num_data),
      num_data,
      mode="recompile",
      max_micro=math.ceil(upper / num_data),
      min_micro=math.ceil(lower / num_data),
      lower=lower,
      upper=upper,
      shapes_per_octave=batch_plan.check_shapes_per_octave(shapes_per_octave),
    )
    self._loss_fn, self._optimizer = loss_fn, optimizer
    self._seed = validation.check_seed(seed)
    self._measure_every = validation.check_int("measure_every", measure_every, 1)
    self._mesh, self._axis_name = mesh, axis_name
    self._replicated = NamedSharding(mesh, P())
    self._sharded = NamedSharding(mesh, P(axis_name))
    self._functions: StepFunctions | None = None
    self._element_spec: dict[str, tuple[tuple[int, ...], Any]] = {}
    self._programs: dict[ProgramShape, Any] = {}
    self._accumulator: Any = None
    self._placed_plans: dict[int, _PlacedPlan] = {}
    self._counters: list[jax.Array] = []
    self._steps = 0

  @property
  def halves(self) -> str:
    """The split into halves: ``"device"`` (even devices against odd ones) or ``"local"``."""
    return self._layout.halves

  @property
  def batch_shapes(self) -> tuple[int, ...]:
    """The batch sizes of the compiled shapes (devices x rows per device), ascending."""
    return tuple(self._layout.num_slots * g for g in self._layout.grid)

  @property
  def steps(self) -> int:
    """The steps run so far: the number of the next step."""
    return self._steps

  def measuring(self, step: int) -> bool:
    """Whether the step numbered ``step`` measures the similarity: every ``measure_every``-th,
    from step 0, whatever the batch sizes (the step number alone decides).

    Example:
      >>> import optax, simigrad_jax
      >>> opt = optax.chain(simigrad_jax.transform("batch"), simigrad_jax.scale_by_lr_factor())
      >>> step = simigrad_jax.AdaptiveStep(lambda p, b: b["x"], opt, max_batch_size=8,
      ...                                  measure_every=4)
      >>> [n for n in range(10) if step.measuring(n)]
      [0, 4, 8]

    Raises:
      ValueError: for a ``step`` that is not an integer >= 0 (NumPy's integers
        are taken as Python's).
    """
    return validation.check_int("step", step, 0) % self._measure_every == 0

  @property
  def compiled(self) -> tuple[ProgramShape, ...]:
    """The programs compiled so far, in the order they were compiled."""
    return tuple(self._programs)

  def program(self, key: ProgramShape) -> jax.stages.Compiled:
    """The compiled program ``key`` (one of :attr:`compiled`), e.g. to read its
    ``memory_analysis()`` or ``cost_analysis()``.

    Raises:
      KeyError: naming the programs compiled so far, for one that is not.
    """
    if key not in self._programs:
      raise KeyError(f"{key} is not compiled; compiled so far: {list(self._programs)}")
    return self._programs[key]

  def plan(self, batch_size: int) -> batch_plan.BatchPlan:
    """How a batch of ``batch_size`` examples runs: its shape, micro-steps and padding.

    Raises:
      AdaptiveBatchError: for a batch size that is not an integer (NumPy's
        integers are taken as Python's), or one below 2.
    """
    if not validation.is_int(batch_size):
      raise AdaptiveBatchError(
        f"batch_size must be an integer >= 2, got {batch_size!r} ({type(batch_size).__name__})"
      )
    if batch_size < 2:
      raise AdaptiveBatchError(
        f"a batch of {batch_size!r} examples leaves its second half (the odd-numbered "
        "examples) without an example, so the similarity cannot be measured: give at least 2"
      )
    return self._layout.plan(int(batch_size))

  def init(self, params: Any) -> tuple[Any, Any]:
    """The parameters and the optimizer's initial state, replicated on the mesh for the step.

    Raises:
      ValueError: when the optimizer lacks ``simigrad_jax.transform`` or
        ``simigrad_jax.scale_by_lr_factor``.
    """
    opt_state = checks.checked_optimizer_state(self._optimizer, params)
    return self._place(params), self._place(opt_state)

  def __call__(
    self, params: Any, opt_state: Any, batch: Mapping[str, Any], *, lr_factor: float = 1.0
  ) -> tuple[Any, Any, train_step.StepMeasurements]:
    """One optimizer step on every example of ``batch``.

    Args:
      params: the parameters (from :meth:`init` or the last step; donated).
      opt_state: the optimizer state (likewise).
      batch: a dict of host arrays (NumPy) with a shared leading example axis
        of any size of at least 2 (its rows are copied: it may change once the
        call returns).
      lr_factor: the learning-rate factor of this step
        (:func:`simigrad_jax.lr_factor` of the batch size), given to
        ``scale_by_lr_factor`` in the program: no recompile when it changes.

    Returns:
      ``(params, opt_state, measurements)``: the new parameters and optimizer
      state, and the step's
      :class:`~simigrad_jax.ingraph.train_step.StepMeasurements` (its mean
      loss and the transform's ``SimilarityState``), not waited for.

    Raises:
      AdaptiveBatchError: for a batch that is not a dict of arrays of one row
        count of at least 2, or whose names or per-example shapes differ
        from the first batch's.
      ValueError: for an ``lr_factor`` that is not a finite number > 0.
    """
    rows = self._checked_batch(batch)
    placed = self._placed_plan(len(next(iter(rows.values()))))
    plan = placed.plan
    if self._functions is None:
      params, opt_state = self._place(params), self._place(opt_state)
      self._functions = self._build(params, opt_state, rows)
    scalars = placed.scalars._replace(lr_factor=_checked_lr_factor(lr_factor))
    micro_batches = placed.laid_out(rows)
    counters = self._micro_counters(plan.accumulation_steps)
    measure = self.measuring(self._steps)
    self._steps += 1
    programs = self._programs_for(plan, measure)
    if plan.accumulation_steps == 1:
      (fused,) = programs.values()
      params, opt_state, _, measured = fused(
        params, opt_state, (), micro_batches[0], placed.weights[0], scalars, counters[0]
      )
      return params, opt_state, measured
    acc = self._accumulator
    if acc is None:
      assert self._functions is not None
      acc = self._functions.zero_accumulator()
    for size, rows_j, weights_j, counters_j in zip(
      plan.shapes, micro_batches, placed.weights, counters, strict=True
    ):
      micro = programs[ProgramShape(Program.MICRO, size)]
      acc, _ = micro(params, (), acc, rows_j, weights_j, scalars, counters_j)
    params, opt_state, self._accumulator, _, measured = programs[APPLY](
      params, opt_state, acc, (), (), scalars
    )
    return params, opt_state, measured

  def _place(self, tree: Any) -> Any:
    """``tree`` replicated on the mesh, as copies (the step donates its arguments)."""
    copies = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, tree)
    return jax.device_put(copies, self._replicated)

  def _checked_batch(self, batch: Any) -> dict[str, np.ndarray]:
    """The batch as NumPy arrays, refused unless its rows and names fit."""
    if not isinstance(batch, Mapping) or not batch:
      raise AdaptiveBatchError(
        f"the batch must be a non-empty dict of arrays, name -> rows, got {type(batch).__name__}"
      )
    rows = {name: np.asarray(array) for name, array in batch.items()}
    counts = {name: (a.shape[0] if a.ndim else None) for name, a in rows.items()}
    if len(set(counts.values())) != 1 or None in counts.values():
      raise AdaptiveBatchError(
        f"every array of the batch needs the same leading (example) axis, got {counts}"
      )
    if self._functions is not None:
      spec = {name: (a.shape[1:], a.dtype) for name, a in rows.items()}
      if spec != self._element_spec:
        raise AdaptiveBatchError(
          f"the batch's examples are {_describe(spec)}, the first batch's were "
          f"{_describe(self._element_spec)}: a step's examples keep their names, shapes and "
          "dtypes (only their number changes)"
        )
    return rows

  def _build(self, params: Any, opt_state: Any, rows: dict[str, np.ndarray]) -> StepFunctions:
    """The step's jitted programs, for the state as placed and the batch's examples."""
    self._element_spec = {name: (a.shape[1:], a.dtype) for name, a in rows.items()}
    return StepFunctions(
      loss_fn=_weighed_rows(self._loss_fn),
      optimizer=self._optimizer,
      mesh=self._mesh,
      axis_name=self._axis_name,
      layout=self._layout,
      seed=self._seed,
      state={"params": params, "opt_state": opt_state, "model_state": ()},
      element_spec=self._element_spec,
    )

  def _programs_for(
    self, plan: batch_plan.BatchPlan, measure: bool = True
  ) -> dict[ProgramShape, Any]:
    """The compiled programs of ``plan`` (:func:`programs_of`), each compiled once."""
    assert self._functions is not None
    programs = {}
    for key in programs_of(plan, measure):
      if key not in self._programs:
        with checks.transform_named_for(self._axis_name):
          if key.program is Program.FUSED:
            self._functions.trace(key.micro)  # names the data when the loss does not fit it
          self._programs[key] = self._functions.lower(key).compile()
      programs[key] = self._programs[key]
    return programs

  def _placed_plan(self, batch_size: int) -> _PlacedPlan:
    """The plan of a batch of ``batch_size`` (:meth:`plan`) and what its steps reuse (placed
    once, kept for the next batch of that size)."""
    placed = self._placed_plans.get(batch_size)
    if placed is None:
      placed = _PlacedPlan.create(self.plan(batch_size), self._sharded, self._replicated)
      if len(self._placed_plans) >= 64:  # a run's recent sizes; a moving batch visits a few
        self._placed_plans.clear()
      self._placed_plans[batch_size] = placed
    return placed

  def _micro_counters(self, micro_steps: int) -> list[jax.Array]:
    """The programs' ``counters`` of ``micro_steps`` micro-steps, placed once for every step.

    The counters only derive the random keys handed to the loss, and the
    step's loss takes none (:func:`_weighed_rows`), so they need not change
    between steps: the same placed arrays save a transfer per step.
    """
    while len(self._counters) < micro_steps:
      counters = np.array([0, len(self._counters)], np.int32)
      self._counters.append(jax.device_put(counters, self._replicated))
    return self._counters[:micro_steps]


class _PlacedPlan(NamedTuple):
  """A batch plan and what every step of its size reuses: its row weights and scalars on the
  devices, and which example each of its rows holds.

  A step lays its rows out on the host (:meth:`laid_out`) and hands them to
  the program as NumPy arrays: the program's call places them as its inputs
  are sharded, at less host time than a ``jax.device_put`` of its own.
  """

  plan: batch_plan.BatchPlan
  weights: list[jax.Array]  # one float32 array a micro-step, sharded over the data axis.
  # total_weight and first_half_weight placed (replicated); each step sets lr_factor.
  scalars: train_step.StepScalars
  take: np.ndarray  # int [rows of every micro-step, in turn]: the example in each row.
  padding: np.ndarray | None  # the positions in ``take`` of the padding rows; None: none.
  ends: list[int]  # where each micro-step's rows end in ``take``, the last one's excepted.

  @classmethod
  def create(
    cls, plan: batch_plan.BatchPlan, sharded: NamedSharding, replicated: NamedSharding
  ) -> _PlacedPlan:
    """``plan``'s weights and scalars placed, and its rows' examples (micro-step ``j``: the
    first ``plan.shapes[j]`` rows of each slot, slot by slot)."""
    layout = plan.example_layout()
    examples = np.concatenate(
      [layout[j, :, :size].reshape(-1) for j, size in enumerate(plan.shapes)]
    )
    ends = np.cumsum([layout.shape[1] * size for size in plan.shapes])[:-1].tolist()
    weights = np.split((examples >= 0).astype(np.float32), ends)
    batch_size = plan.global_batch_size
    scalars = train_step.StepScalars(
      total_weight=jax.device_put(np.float32(batch_size), replicated),
      lr_factor=np.float32(1.0),
      first_half_weight=jax.device_put(
        np.float32(StepLayout.first_half_weight(batch_size)), replicated
      ),
    )
    padding = np.flatnonzero(examples < 0)
    return cls(
      plan=plan,
      weights=[jax.device_put(w, sharded) for w in weights],
      scalars=scalars,
      take=np.maximum(examples, 0),
      padding=padding if padding.size else None,
      ends=ends,
    )

  def laid_out(self, rows: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """The batch's rows in the plan's order, padding rows zero: one dict of NumPy arrays a
    micro-step, each array gathered by one ``np.take``."""
    micro_batches: list[dict[str, np.ndarray]] = [{} for _ in range(len(self.ends) + 1)]
    for name, array in rows.items():
      gathered = np.take(array, self.take, axis=0)
      if self.padding is not None:
        gathered[self.padding] = 0
      parts = np.split(gathered, self.ends) if self.ends else [gathered]
      for micro_batch, part in zip(micro_batches, parts, strict=True):
        micro_batch[name] = part
    return micro_batches


def _checked_lr_factor(lr_factor: float) -> np.float32:
  """``lr_factor`` as the program's float32 scalar; refused unless a number > 0, finite in float32."""
  return np.float32(validation.check_lr_factor(lr_factor))


def _weighed_rows(loss_fn: RowLossFn) -> train_step.PerExampleLossFn:
  """``loss_fn`` in the Trainer's form: no model state, one loss per row checked at trace time."""

  def per_example(params, model_state, batch, weights, rng):
    del rng
    losses = loss_fn(params, batch)
    if jnp.shape(losses) != weights.shape:
      raise train_step.LossContractError(
        f"AdaptiveStep's loss_fn(params, batch) must return one loss per row, shape "
        f"{weights.shape} on this device's rows, got shape {jnp.shape(losses)}: no mean, the "
        "step weighs the rows itself (padding rows have weight 0)"
      )
    return losses, model_state

  return per_example


def _describe(spec: Mapping[str, tuple[tuple[int, ...], Any]]) -> str:
  return ", ".join(
    f"{name} {tuple(shape)} {np.dtype(dtype)}" for name, (shape, dtype) in spec.items()
  )
