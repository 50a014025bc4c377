"""benchmarks/pareto/pareto.py's command line: the flags, the grid they give, and their checks."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from benchmarks import common
from benchmarks.pareto import images
from benchmarks.pareto import mlm
from benchmarks.pareto.protocol import LR_SCHEDULES
from benchmarks.pareto.protocol import SIMIGRAD_GRID_KEYS
from simigrad_jax.controllers import LR_RULES


def _option_sets(text: str) -> tuple[dict[str, float], ...]:
  """A JSON list of objects of numeric SimiGrad options (not the ones the grid sets)."""
  try:
    value = json.loads(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
  if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
    raise argparse.ArgumentTypeError(f"want a non-empty JSON list of objects, got {text!r}")
  for options in value:
    for key, v in options.items():
      if key in SIMIGRAD_GRID_KEYS or isinstance(v, bool) or not isinstance(v, (int, float)):
        raise argparse.ArgumentTypeError(
          f"{key}={v!r}: give numeric options other than {SIMIGRAD_GRID_KEYS}"
        )
  return tuple(value)


def _bounds(text: str) -> tuple[tuple[int, int], ...]:
  pairs = []
  for part in text.split(","):
    if part.strip():
      lower, upper = part.split(":")
      pairs.append((int(lower), int(upper)))
  return tuple(pairs)


# The tasks: each module has FULL and QUICK grids, BASE_LR per data set and setup() -> experiment.
TASKS = {"images": images, "mlm": mlm}


def parse_args(argv: Sequence[str] | None, description: str = "") -> argparse.Namespace:
  """The flags of ``argv``, with ``args.grid``: the task's grid (full or quick) as the flags change it.

  Args:
    argv: command-line arguments (``sys.argv[1:]`` when None).
    description: the ``--help`` text's first line.

  Returns:
    The parsed flags; ``--lr-schedule`` defaults to the grid's.
  """
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument(
    "--task",
    choices=tuple(TASKS),
    default="images",
    help="images: an MLP on MNIST or digits; mlm: a small BERT's masked LM on tinyshakespeare",
  )
  parser.add_argument(
    "--quick",
    action="store_true",
    help="the small grid: about 5 (images: digits, 8 epochs, 2 seeds) to 10 "
    "(mlm) minutes on 2 cores",
  )
  parser.add_argument(
    "--dataset", choices=images.DATASETS, default=None, help="the image task's data set"
  )
  parser.add_argument("--epochs", type=float, default=None)
  parser.add_argument("--seeds", type=common.integers, default=None, help="e.g. 0,1,2")
  parser.add_argument("--hidden", type=int, default=None, help="the model's hidden width")
  parser.add_argument(
    "--train-windows", type=int, default=None, help="mlm: how many text windows to train on"
  )
  parser.add_argument(
    "--eval-examples", type=int, default=None, help="mlm: windows in each of validation and test"
  )
  parser.add_argument(
    "--fixed", type=common.integers, default=None, help="fixed batch sizes, e.g. 16,64,256"
  )
  parser.add_argument(
    "--lr-multipliers",
    type=common.floats,
    default=None,
    help="the per-batch-size learning-rate grid around the sqrt-scaled base",
  )
  parser.add_argument(
    "--targets", type=common.floats, default=None, help="SimiGrad similarity targets"
  )
  parser.add_argument(
    "--bounds",
    type=_bounds,
    default=None,
    help="adaptive batch-size bounds as lower:upper pairs, e.g. 16:512,32:1024",
  )
  parser.add_argument(
    "--simigrad-options",
    type=_option_sets,
    default=None,
    help="more SimiGrad Controller options as a JSON list of objects, one "
    'variant each, e.g. \'[{}, {"smooth_factor": 0.5}, {"dead_band": 0.1}]\' '
    '(default: [{}]); {"one_step_late": 1} wraps the controller in OneStepLateController',
  )
  parser.add_argument("--gns", type=common.floats, default=None, help="noise-scale multiples")
  parser.add_argument(
    "--schedules",
    default=None,
    help="comma-separated: linear, geometric, loss_plateau ('' for none)",
  )
  parser.add_argument(
    "--initial-batch-size", type=int, default=32, help="B_0 of every adaptive run"
  )
  parser.add_argument(
    "--base-lr",
    type=float,
    default=None,
    help="the learning rate at --base-batch-size, sqrt-scaled to other sizes "
    f"(default per data set: {images.BASE_LR}, {mlm.BASE_LR})",
  )
  parser.add_argument("--base-batch-size", type=int, default=32)
  parser.add_argument(
    "--lr-schedule",
    choices=LR_SCHEDULES,
    default=None,
    help="the learning-rate schedule in epochs (default: the task's, cosine for "
    "images, warmup_cosine for mlm)",
  )
  parser.add_argument(
    "--adaptive-lr-multipliers",
    type=common.floats,
    default=None,
    help="learning-rate multipliers (of the sqrt-scaled base at B_0) for the "
    "adaptive runs; quick default: the one selected for the fixed batch B_0; "
    "full default: 1,2",
  )
  parser.add_argument(
    "--adaptive-lr-rules",
    default=None,
    help="comma-separated: how the trainer scales the adaptive runs' lr with "
    "the batch size: sqrt (the reference), linear, none (default: sqrt,linear)",
  )
  parser.add_argument(
    "--reuse",
    action="append",
    default=None,
    help="an earlier --out JSON (same data set, epochs, model, learning rates): "
    "its runs that match this grid are taken from it instead of trained again "
    "(repeat the flag for several files)",
  )
  parser.add_argument(
    "--keep-reused",
    action="store_true",
    help="also keep every other run of the --reuse files in the result, so "
    "that it adds this grid's runs to the earlier ones",
  )
  parser.add_argument(
    "--markdown",
    default=None,
    metavar="JSON",
    help="print docs/results.md's tables for an earlier --out JSON and exit",
  )
  parser.add_argument("--gns-ema-decay", type=float, default=0.9)
  parser.add_argument(
    "--profile",
    action="store_true",
    help="also profile similarity against batch size during a fixed run",
  )
  parser.add_argument("--profile-steps", type=int, default=None, help="steps per profiled size")
  parser.add_argument(
    "--out",
    default=None,
    metavar="JSON",
    help="write the results as JSON here (default: benchmarks/results/pareto_mnist.json, "
    "mlm.json with --task mlm, pareto_quick.json or pareto_mlm_quick.json with "
    "--quick; '' writes none)",
  )
  parser.add_argument(
    "--png",
    default=None,
    help="the plot (default: docs/NAME.png for a JSON in benchmarks/results/, else --out "
    "with .png)",
  )
  parser.add_argument("--workdir", default=None, help="keep every run's workdir under this path")
  args = parser.parse_args(argv)
  task = TASKS[args.task]
  grid = dict(task.QUICK if args.quick else task.FULL)
  if args.dataset is not None and args.task != "images":
    parser.error("--dataset is for --task images")
  if args.task != "mlm" and (args.train_windows is not None or args.eval_examples is not None):
    parser.error("--train-windows and --eval-examples are for --task mlm")
  for key, value in (
    ("dataset", args.dataset),
    ("epochs", args.epochs),
    ("seeds", args.seeds),
    ("hidden", args.hidden),
    ("fixed", args.fixed),
    ("lr_multipliers", args.lr_multipliers),
    ("targets", args.targets),
    ("bounds", args.bounds),
    ("gns", args.gns),
    ("simigrad_options", args.simigrad_options),
    ("train_windows", args.train_windows),
    ("eval_examples", args.eval_examples),
  ):
    if value is not None:
      grid[key] = value
  if args.schedules is not None:
    grid["schedules"] = tuple(s.strip() for s in args.schedules.split(",") if s.strip())
  if args.adaptive_lr_multipliers:
    grid["adaptive_lr_multipliers"] = args.adaptive_lr_multipliers
  if args.adaptive_lr_rules is not None:
    grid["adaptive_lr_rules"] = tuple(
      r.strip() for r in args.adaptive_lr_rules.split(",") if r.strip()
    )
  if args.lr_schedule is None:
    args.lr_schedule = grid["lr_schedule"]
  args.grid = grid
  return args


def validate(args: argparse.Namespace, num_train: int) -> None:
  """Raises ValueError, naming the flag, for settings the training set of ``num_train`` cannot run."""
  grid = args.grid
  if args.keep_reused and not args.reuse:
    raise ValueError("--keep-reused needs --reuse")
  if args.profile and args.task != "images":
    raise ValueError("--profile is for --task images")
  if not grid["seeds"] or not grid["fixed"] or not grid["lr_multipliers"]:
    raise ValueError("need at least one seed, fixed batch size and learning-rate multiplier")
  if grid["epochs"] <= 0:
    raise ValueError(f"--epochs must be > 0, got {grid['epochs']}")
  for b in grid["fixed"]:
    if not 1 <= b <= num_train:
      raise ValueError(f"fixed batch size {b} must lie in [1, {num_train}] (the training set)")
  for lower, upper in grid["bounds"]:
    if not 2 <= lower <= args.initial_batch_size <= upper <= num_train:
      raise ValueError(
        f"bounds {lower}:{upper} must satisfy 2 <= lower <= --initial-batch-size "
        f"({args.initial_batch_size}) <= upper <= {num_train}"
      )
  for target in grid["targets"]:
    if not -1 <= target <= 1:
      raise ValueError(f"similarity target {target} must lie in [-1, 1]")
  rules = grid["adaptive_lr_rules"]
  if not rules or set(rules) - set(LR_RULES):
    raise ValueError(f"--adaptive-lr-rules must name some of {LR_RULES}, got {rules!r}")
  unknown = sorted(set(grid["schedules"]) - {"linear", "geometric", "loss_plateau"})
  if unknown:
    raise ValueError(f"unknown schedules {unknown}; choose from linear, geometric, loss_plateau")
