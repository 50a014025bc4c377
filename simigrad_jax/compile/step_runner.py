"""Host: running one optimizer step's plan on its compiled programs.

A step of one micro-batch per device runs the one-micro-batch program of its
shape; a step of several accumulates with the micro-step of each micro-batch's
shape (a step's micro-batches may be of several shapes), then applies the
update (:class:`~simigrad_jax.compile.program_compiler.StepProgramCompiler`
compiles them). A step takes its scalars as one
:class:`~simigrad_jax.ingraph.train_step.StepScalars` and returns what it
measured as one :class:`~simigrad_jax.ingraph.train_step.StepMeasurements`.
The steps are dispatched, not waited for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from simigrad_jax.compile.program_compiler import StepProgramCompiler
from simigrad_jax.compile.step_functions import APPLY
from simigrad_jax.compile.step_functions import Program
from simigrad_jax.compile.step_functions import ProgramShape
from simigrad_jax.data.data_loader import StepBatch
from simigrad_jax.ingraph import train_step


class StepRunner:
  """Runs a step's micro-batches on the compiled programs of its plan.

  The gradient accumulator of steps of several micro-batches is allocated
  when a step first accumulates, and reused (donated) by the next.

  Args:
    compiler: the step's compiler (a program not compiled yet is waited
      for, or compiled at once; its functions make the first zero
      accumulator).

  Example:
    ``state, measurements = StepRunner(compiler).run(state, data, scalars)``
    dispatches one step (see :meth:`run`).
  """

  def __init__(self, compiler: StepProgramCompiler):
    self._compiler = compiler
    self._acc: Any = None  # allocated when a step first accumulates

  def run(
    self,
    state: Mapping[str, Any],
    data: StepBatch,
    scalars: train_step.StepScalars,
    measure: bool = True,
  ) -> tuple[dict[str, Any], train_step.StepMeasurements]:
    """Dispatches one optimizer step; returns the new state and its measurements (not waited for).

    Args:
      state: the ``{"params", "opt_state", "model_state"}`` on the mesh; its
        arrays are donated.
      data: the step's micro-batches, as :attr:`StepBatch.plan` lays them out.
      scalars: the step's scalars, replicated.
      measure: False: a step of one micro-batch runs its shape's plain
        step, which does not measure the similarity (a step of several
        measures either way).

    Returns:
      ``(new_state, measurements)``: the step's
      :class:`~simigrad_jax.ingraph.train_step.StepMeasurements`, replicated.

    Raises:
      StepCompileError: when the compile of the plan's program failed.
    """
    plan = data.plan
    params, opt_state, model_state = state["params"], state["opt_state"], state["model_state"]
    if plan.accumulation_steps == 1:
      ((batch, weights),) = data.micro_batches
      fused = Program.FUSED if measure else Program.PLAIN
      program = self._compiler.get(ProgramShape(fused, plan.micro_batch_size))
      params, opt_state, model_state, measurements = program(
        params, opt_state, model_state, batch, weights, scalars, data.counters[0]
      )
    else:
      micro_steps = {
        size: self._compiler.get(ProgramShape(Program.MICRO, size)) for size in plan.shapes
      }
      apply = self._compiler.get(APPLY)
      acc = self._acc
      if acc is None:
        acc = self._compiler.functions.zero_accumulator()
      accumulated_state = model_state
      for size, (batch, weights), counters in zip(
        plan.shapes, data.micro_batches, data.counters, strict=True
      ):
        acc, accumulated_state = micro_steps[size](
          params, accumulated_state, acc, batch, weights, scalars, counters
        )
      params, opt_state, self._acc, model_state, measurements = apply(
        params, opt_state, acc, model_state, accumulated_state, scalars
      )
    return {"params": params, "opt_state": opt_state, "model_state": model_state}, measurements
