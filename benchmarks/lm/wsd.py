"""A warmup-stable-decay frontier: one stable run, and a decay branched from it for each budget.

:func:`run_frontier` trains one :class:`~benchmarks.pareto.protocol.RunSpec`
of :class:`~benchmarks.lm.experiment.LmExperiment` under the WSD schedule of
:mod:`benchmarks.lm.protocol`. The stable run trains in segments, each ending
at the next decay's start with a checkpoint (state, controller and data
order); each decay copies that workdir and resumes from the checkpoint with
its own schedule, to its budget's end. Every decay's record goes to
``on_branch`` as it ends.

Resumable: the stable run's workdir and its validation points live in
``state_dir``; killed and started again, the stable run resumes from its
newest checkpoint, decays already recorded (``done``) are skipped, and a
decay cut short starts again from its checkpoint. Without ``state_dir``'s
files (another machine), the stable run trains again from the start, the
same run: its segments end at every decay's start, the recorded decays'
too, since a segment's last step is cut short to end there exactly and so
decides where the later steps fall.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import simigrad_jax
from benchmarks.lm import protocol as P
from benchmarks.lm.experiment import LmExperiment
from benchmarks.lm.experiment import ValidationCurve
from benchmarks.lm.experiment import batch_fields
from benchmarks.lm.experiment import step_records
from benchmarks.pareto.protocol import RunSpec
from simigrad_jax.trainer.hooks import host_copy


def budget_examples(task: P.Task) -> list[int]:
  """Each budget of :data:`~benchmarks.lm.protocol.BUDGET_SHARES`, in whole examples."""
  return [round(share * task.budget_windows) for share in P.BUDGET_SHARES]


def schedule(longest: int, num_train: int, budget: int | None) -> Callable[[float], float]:
  """The WSD multiplier by epochs: the stable run's (``budget`` None) or a decay's (examples)."""
  return lambda epochs: P.wsd_multiplier(epochs * num_train, longest, budget)


def run_frontier(
  exp: LmExperiment,
  spec: RunSpec,
  *,
  budgets: Sequence[int],
  longest: int,
  state_dir: pathlib.Path,
  stable_points: int,
  decay_points: int,
  done: Collection[int],
  on_branch: Callable[[int, dict[str, Any]], None],
) -> None:
  """Trains the stable run and every decay not in ``done``; hands each decay's record on.

  Args:
    exp: the task.
    spec: the run (controller, options, learning rate, coupling, seed).
    budgets: the budgets in examples, increasing.
    longest: the budget of share 1.0, in examples (the warm-up's unit).
    state_dir: where the stable run's workdir and validation points live.
    stable_points: validation measurements over the stable run.
    decay_points: validation measurements during each decay (and one at its end).
    done: the indices of budgets whose decay is already recorded.
    on_branch: ``on_branch(index, record)``, called as each decay ends.
  """
  todo = [k for k in range(len(budgets)) if k not in done]
  if not todo:
    return
  starts = [round(P.decay_start(b)) for b in budgets]
  stable = _StableRun(exp, spec, state_dir, longest, stable_points, starts[-1])
  for k in range(max(todo) + 1):
    began = time.perf_counter()
    if k in done:
      # A resumed stable run is past this decay's start already; one trained again from the start
      # ends a segment there as the run that recorded the decay did.
      if not stable.resumed:
        stable.train_to(starts[k])
      continue
    stable.train_to(starts[k])
    branch = state_dir / f"decay-{k}"
    shutil.rmtree(branch, ignore_errors=True)
    shutil.copytree(stable.workdir, branch)
    record = _decay(exp, spec, branch, budgets[k], starts[k], longest, decay_points, stable.points)
    shutil.rmtree(branch, ignore_errors=True)
    record["wall_seconds"] = round(time.perf_counter() - began, 2)
    on_branch(k, record)
  shutil.rmtree(state_dir, ignore_errors=True)


class _StableRun:
  """The stable run's workdir and validation points, trained on to each decay's start."""

  def __init__(
    self,
    exp: LmExperiment,
    spec: RunSpec,
    state_dir: pathlib.Path,
    longest: int,
    points: int,
    end: int,
  ):
    self.exp, self.spec, self.longest = exp, spec, longest
    self.workdir = state_dir / "stable"
    self._points_file = state_dir / "stable_points.json"
    self._thresholds = [end * i / points for i in range(1, points)]
    self.points: list[tuple[int, int, float]] = []
    self.resumed = self._points_file.exists() and self.workdir.exists()
    if self.resumed:
      self.points = [tuple(p) for p in json.loads(self._points_file.read_text("utf-8"))]
    else:
      shutil.rmtree(state_dir, ignore_errors=True)
      state_dir.mkdir(parents=True)

  def train_to(self, examples: int) -> None:
    """Trains on to ``examples`` (a segment), measuring the points on the way; a stable run
    already past them (state of another order) trains again from the start."""
    exp = self.exp
    controller = simigrad_jax.make_controller(self.spec.controller, **dict(self.spec.options))
    curve = _Points(exp, self._thresholds, self._keep)
    lr = schedule(self.longest, exp.num_train, None)
    with exp.trainer(controller, self.spec, self.workdir, curve, lr) as trainer:
      curve.trainer = trainer
      seen = trainer.sampler.examples_seen
      if seen > examples:
        raise RuntimeError(
          f"the stable run in {self.workdir} is at {seen} examples, past the decay's start at "
          f"{examples}; delete {self.workdir.parent} to train it again"
        )
      # Points measured after the checkpoint it resumed from (a kill) are measured again.
      self.points = [p for p in self.points if p[1] <= seen]
      if seen == 0 and not self.points:
        curve.measure(host_copy(trainer.state["params"]), 0, 0)
      curve.skip_to(seen)
      if seen < examples:
        trainer.train(num_epochs=examples / exp.num_train)

  def _keep(self, point: tuple[int, int, float]) -> None:
    """Keeps a measured point, on disk at once (a kill loses none before its checkpoint)."""
    self.points.append(point)
    self._points_file.write_text(json.dumps(self.points), "utf-8")


class _Points(ValidationCurve):
  """A :class:`ValidationCurve` at given example counts (those already passed are skipped), each
  point handed to ``keep`` as it is measured."""

  def __init__(
    self,
    exp: LmExperiment,
    thresholds: Sequence[float],
    keep: Callable[[tuple[int, int, float]], None],
  ):
    super().__init__(exp.evaluate, 1, 1)
    self._thresholds = list(thresholds)
    self._keep = keep

  def measure(self, params: Any, steps: int, examples: int) -> None:
    super().measure(params, steps, examples)
    self._keep(self.points[-1])

  def skip_to(self, examples: int) -> None:
    self._thresholds = [t for t in self._thresholds if t > examples]


def _decay(
  exp: LmExperiment,
  spec: RunSpec,
  workdir: pathlib.Path,
  budget: int,
  start: int,
  longest: int,
  points: int,
  stable_points: Sequence[tuple[int, int, float]],
) -> dict[str, Any]:
  """One decay, from the stable run's checkpoint at ``start`` to ``budget``: its record."""
  controller = simigrad_jax.make_controller(spec.controller, **dict(spec.options))
  curve = ValidationCurve(exp.evaluate, budget, points, start_examples=start)
  lr = schedule(longest, exp.num_train, budget)
  with exp.trainer(controller, spec, workdir, curve, lr) as trainer:
    curve.trainer = trainer
    if trainer.sampler.examples_seen != start:
      raise RuntimeError(
        f"the decay from {start} examples resumed at {trainer.sampler.examples_seen}"
      )
    summary = trainer.train(num_epochs=budget / exp.num_train)
    curve.measure(host_copy(trainer.state["params"]), summary["steps"], summary["examples_seen"])
  tokens = exp.config.seq_length
  before = [p for p in stable_points if p[1] <= start]
  return {
    "controller": spec.controller,
    "seed": spec.seed,
    "learning_rate": spec.lr,
    "lr_multiplier": spec.lr_multiplier,
    "lr_coupling": spec.lr_coupling,
    "options": dict(spec.options),
    "budget_tokens": budget * tokens,
    "decay_start_tokens": start * tokens,
    "steps": int(summary["steps"]),
    "tokens": int(summary["examples_seen"]) * tokens,
    "final_val_loss": round(curve.points[-1][2], 6),
    **batch_fields(summary, step_records(workdir)),
    "curve": [[s, e * tokens, round(v, 6)] for s, e, v in [*before, *curve.points]],
  }
