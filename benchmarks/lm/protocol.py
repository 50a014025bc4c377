"""The language-model verdict's protocol as data: tasks, methods, grids, seeds, budgets, targets.

``docs/lm_protocol.md`` explains it; ``benchmarks/lm/verdict_lm.py`` runs it
and ``benchmarks/lm/frontier.py`` analyses it. Nothing here changes after the
protocol's first run: a changed value makes another experiment, and the run
store (``benchmarks/results/lm_<task>_runs.jsonl``) refuses to mix them.

Every run follows a warmup-stable-decay (WSD) learning-rate schedule: a
linear warm-up over :data:`WARMUP_SHARE` of the longest budget, a constant
rate, and for each budget in :data:`BUDGET_SHARES` a decay branched from the
stable run at ``(1 - DECAY_SHARE)`` of that budget, linear down to
:data:`FLOOR` of the peak at the budget's end. One stable run per (method,
learning rate, seed) and one short decay per budget give the method's
frontier: the (steps, tokens, validation loss) of each budget.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sysconfig
from collections.abc import Callable
from typing import Any

# The learning-rate schedule, shares of the task's longest budget in tokens.
BUDGET_SHARES = (0.125, 0.25, 0.5, 1.0, 1.1)  # 1.1: the adaptive rule's token allowance
TARGET_BUDGETS = (0, 1, 2, 3)  # the targets: the best constant batch's mean loss at these budgets
REFERENCE_BUDGET = 3  # a learning rate and a batch size are tuned on the loss at budget 1.0
WARMUP_SHARE = 0.025  # of the longest budget: linear from FLOOR to the peak
DECAY_SHARE = 0.2  # of each budget: the last 20%, linear to FLOOR
FLOOR = 0.02  # the schedule's least multiplier of the peak

# Seeds: seed k draws the same initial parameters and data order in every setting (paired).
TUNING_SEED = 0
EVALUATION_SEEDS = tuple(range(1, 11))

# Learning rates: multipliers of the square-root rule's BASE_LR * sqrt(B / LR_BATCH_SIZE).
BASE_LR = 3e-3
LR_BATCH_SIZE = 32
LR_MULTIPLIERS = (2.0, 4.0, 8.0)  # three, widened by 2x past an edge
MAX_LR_WIDEN = 2  # widenings per side; a best still at an edge is reported as such
CONSTANT_SIZES = (8, 16, 32, 64)  # widened by 2x past an edge (the best at any target budget)
MAX_SIZE_WIDEN = 2  # sizes added per side

# Ramps and adaptive rules start at B_0, the tuning seed's best constant size at the shortest
# budget; ramps grow to 8 B_0 (their published shapes), adaptive rules within [B_0, 16 B_0].
RAMP_GROWTH = 8
ADAPTIVE_UPPER_FACTOR = 16
TOKEN_ALLOWANCE = 1.1
SIMILARITY_TARGET = 0.1  # SimiGrad's (the recipe's, train/configs/shakespeare_lm.py)
GNS_MULTIPLE = 1.0
EMA_DECAY = 0.9
COUPLINGS = ("full", "peak")
RAMPS = ("step_schedule", "linear_ramp", "doubling_warmup")
ADAPTIVE = ("allowance", "simigrad", "gns")

# The analysis.
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
CONFIDENCE = 0.95
STEPS_GOAL = 0.50  # the best adaptive rule against the best constant batch: steps at most this,
STEPS_GOAL_UPPER = 0.60  # the interval's upper end below this,
TOKENS_GOAL = 1.10  # and tokens at most this


def stdlib_text_files() -> str:
  """The second task's text: the standard library's top-level ``*.py`` files, sorted by name.

  A glob for ``train.text_data.read_text_files``, which reads the matches in
  sorted order; the result JSON records the text's hash, so runs on another
  Python's library never mix with these.
  """
  return f"{sysconfig.get_paths()['stdlib']}/*.py"


@dataclasses.dataclass(frozen=True)
class Task:
  """One language-model task: its text, model and longest budget.

  Attributes:
    name: the task's name (``lm_<name>.json``).
    text_files: a glob of local text files, or None for tinyshakespeare.
    seq_length: tokens (characters) each window predicts.
    hidden: the transformer's width (heads of 16, MLP 4x).
    layers: transformer layers.
    budget_windows: the longest budget (share 1.0), in windows.
    eval_windows: validation windows, spread over the held-out text.
    stable_points: validation measurements over the stable run.
    decay_points: validation measurements during each decay (and one at its end).
    whole_text: train on every window of the training text (less than one pass
      at every budget); else on the first ``1.1 x budget_windows`` windows.
  """

  name: str
  text_files: Callable[[], str] | None
  seq_length: int
  hidden: int
  layers: int
  budget_windows: int
  eval_windows: int = 256
  stable_points: int = 24
  decay_points: int = 4
  whole_text: bool = False

  @property
  def budget_tokens(self) -> int:
    return self.budget_windows * self.seq_length

  def experiment(self) -> dict[str, Any]:
    """What the task's stored runs must share with this code (JSON data)."""
    return {
      "task": self.name,
      "seq_length": self.seq_length,
      "hidden": self.hidden,
      "layers": self.layers,
      "budget_windows": self.budget_windows,
      "eval_windows": self.eval_windows,
      "stable_points": self.stable_points,
      "decay_points": self.decay_points,
      "whole_text": self.whole_text,
      "budget_shares": list(BUDGET_SHARES),
      "warmup_share": WARMUP_SHARE,
      "decay_share": DECAY_SHARE,
      "floor": FLOOR,
      "base_lr": BASE_LR,
      "lr_batch_size": LR_BATCH_SIZE,
      "token_allowance": TOKEN_ALLOWANCE,
      "ema_decay": EMA_DECAY,
    }


TASKS = {
  # The main task: the recipe of train/configs/shakespeare_lm.py at the earlier budgets' size.
  "shakespeare": Task(
    "shakespeare", None, seq_length=64, hidden=64, layers=2, budget_windows=12288
  ),
  # A task Llama 3's ramp was not made for: wider, deeper, twice the context, Python source.
  "python_stdlib": Task(
    "python_stdlib",
    stdlib_text_files,
    seq_length=128,
    hidden=80,
    layers=3,
    budget_windows=4096,
    whole_text=True,
  ),
}
TASK_ORDER = ("shakespeare", "python_stdlib")


@dataclasses.dataclass(frozen=True)
class Method:
  """A batch-size method: a constant size, a ramp or an adaptive rule, under one coupling.

  Attributes:
    name: how the results name it (``"B=16"``, ``"doubling_warmup@full"``).
    controller: the registered controller.
    coupling: how the batch's learning-rate factor meets the schedule
      (``"full"`` or ``"peak"``; constant batches have no factor).
    batch_size: a constant batch's size (None for the others).
  """

  name: str
  controller: str
  coupling: str = "full"
  batch_size: int | None = None

  @property
  def kind(self) -> str:
    """``"constant"``, ``"ramp"`` or ``"adaptive"``."""
    if self.controller == "fixed":
      return "constant"
    return "ramp" if self.controller in RAMPS else "adaptive"


def constant(size: int) -> Method:
  return Method(f"B={size}", "fixed", "full", size)


def ramp_and_adaptive_methods() -> list[Method]:
  """Every ramp and adaptive rule under both couplings, in the protocol's order."""
  return [Method(f"{c}@{k}", c, k) for c in (*RAMPS, *ADAPTIVE) for k in COUPLINGS]


def method_by_name(name: str) -> Method:
  """The method ``name`` (``B=16``, ``allowance@full``, ...); a ValueError names the valid ones."""
  if name.startswith("B=") and name[2:].isdigit() and int(name[2:]) >= 1:
    return constant(int(name[2:]))
  for method in ramp_and_adaptive_methods():
    if method.name == name:
      return method
  valid = ", ".join(m.name for m in ramp_and_adaptive_methods())
  raise ValueError(f"unknown method {name!r}; give B=<size> or one of {valid}")


def base_lr(batch_size: int) -> float:
  """The square-root rule's learning rate at ``batch_size``."""
  return BASE_LR * (batch_size / LR_BATCH_SIZE) ** 0.5


def controller_options(method: Method, b0: int, task: Task) -> dict[str, Any]:
  """The controller options of ``method`` starting from ``b0`` on ``task`` (sizes in examples).

  Ramps have their published shapes (:func:`ramp_options`), scaled to the longest budget (their thresholds are token
  counts, so a shorter budget's decay sees the ramp as far as it got).
  """
  if method.kind == "constant":
    return {"initial_batch_size": method.batch_size}
  if method.kind == "ramp":
    options = ramp_options(
      method.controller,
      initial=b0,
      upper=RAMP_GROWTH * b0,
      num_tokens=task.budget_tokens,
      seq_length=task.seq_length,
    )
    return dict(options)
  bounds = {"batch_size_lower_bound": b0, "batch_size_upper_bound": ADAPTIVE_UPPER_FACTOR * b0}
  if method.controller == "allowance":
    return {
      "initial_batch_size": b0,
      "token_allowance": TOKEN_ALLOWANCE,
      **bounds,
      "ema_decay": EMA_DECAY,
    }
  if method.controller == "simigrad":
    return {"initial_batch_size": b0, "similarity_target": SIMILARITY_TARGET, **bounds}
  return {"initial_batch_size": b0, "multiple": GNS_MULTIPLE, **bounds, "ema_decay": EMA_DECAY}


def ramp_options(
  name: str, *, initial: int, upper: int, num_tokens: int, seq_length: int
) -> tuple[tuple[str, Any], ...]:
  """The controller options of one ramp, sorted by name (``benchmarks/lm/pareto_lm.py``'s
  ``ramp_specs`` describes the shapes; :data:`RAMPS`, and Seesaw, which a WSD schedule leaves out)."""
  n = num_tokens
  options: dict[str, Any] = {"tokens_per_example": seq_length}
  if name == "step_schedule":
    points = (0, n // 8, n // 4, n // 2)
    options["thresholds"] = ",".join(f"{p}:{initial * 2**i}" for i, p in enumerate(points))
  elif name == "linear_ramp":
    options.update(
      initial_batch_size=initial, final_batch_size=8 * initial, increment=initial, ramp=n // 2
    )
  elif name == "doubling_warmup":
    options.update(
      initial_batch_size=initial, doubling_points=f"{round(0.017 * n)},{round(0.19 * n)}"
    )
  elif name == "seesaw":
    options.update(
      initial_batch_size=initial,
      batch_size_upper_bound=upper,
      decay_start=n // 10,
      decay_end=n,
      num_halvings=max(1, (upper // initial).bit_length() - 1),
      final_lr_fraction=0.02,
    )
  else:
    raise ValueError(f"unknown ramp {name!r}; choose one of {(*RAMPS, 'seesaw')}")
  return tuple(sorted(options.items()))


def wsd_multiplier(tokens: float, longest: float, budget: float | None) -> float:
  """The WSD schedule's multiplier of the peak learning rate after ``tokens``.

  Args:
    tokens: tokens trained so far.
    longest: the task's longest budget (share 1.0), in tokens: the warm-up's unit.
    budget: the branch's budget in tokens (its decay is its last
      :data:`DECAY_SHARE`), or None for the stable run (no decay).

  Example:
    >>> wsd_multiplier(500.0, 1000.0, 1000.0)
    1.0
    >>> round(wsd_multiplier(900.0, 1000.0, 1000.0), 4)  # half-way down the decay from 800
    0.51
  """
  warmup = WARMUP_SHARE * longest
  if tokens < warmup:
    return max(FLOOR, tokens / warmup)
  if budget is None:
    return 1.0
  start = (1.0 - DECAY_SHARE) * budget
  if tokens < start:
    return 1.0
  return max(FLOOR, 1.0 - (1.0 - FLOOR) * (tokens - start) / (budget - start))


def decay_start(budget: float) -> float:
  """Where a branch's decay starts (in the budget's unit)."""
  return (1.0 - DECAY_SHARE) * budget


def text_hash(text: str) -> str:
  """The first 16 hex digits of the text's SHA-256: the same text everywhere."""
  return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
