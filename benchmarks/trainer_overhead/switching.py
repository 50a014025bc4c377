"""Benchmark: switching the batch size every step, "recompile" against "pad".

Trains a small Flax CNN on scikit-learn's handwritten digits (1,797 8x8 images,
bundled, no download) with :class:`simigrad_jax.Trainer` on all local devices
(by default 8 simulated CPU devices), while the global batch size sweeps the
whole range ``[--lower, --upper]`` (default [8, 1600]) up and down (214
steps by default: two round trips), in each of three set-ups of the Trainer:

* ``recompile``: one compiled micro-step per micro-batch shape of the bucket
  grid (``max_micro_batch_size`` 300 and ``min_micro_batch_size`` 1 give the
  10 shapes 1, 2, 3, 5, 10, 19, 38, 75, 150, 300 rows per device), compiled
  ahead of time in background threads (the Trainer's default); until the
  compile schedule admits a step's shape it runs on an admitted one
  (``compile.fallback``, the Trainer's default);
* ``recompile_wait``: the same with ``compile.fallback=False``: such a step
  waits for its compile;
* ``pad``: one compiled shape (300 rows per device); smaller batches are
  filled with zero-weight padding rows;
* ``recompile_2proc``: ``recompile`` on the same devices split over 2
  processes (``jax.distributed`` on 127.0.0.1, half the devices each, every
  process loading its own devices' rows), as on a pod of 2 hosts: every step
  the processes check that they took the same decision; the compile
  schedule, a function of the step count, admits the same programs on both,
  and each process waits for its own compile (or load) of an admitted
  program, so a step is as late as the slower of the two (process 0
  records its own waits; the other's show in its step seconds). It adds
  ``agreement_seconds_per_step`` (the median seconds a step spends in that
  check) and, against ``recompile`` in one process, the
  ``recompile_2proc_over_recompile`` ratios.

The schedule: the batch size moves exactly as SimiGrad's rule moves it, one
rule step per optimizer step (grow ``B -> max(B + 1, int(1.1 B))`` up to the
upper bound, then shrink ``B -> min(B - 1, int(0.9 B))`` down to the lower
bound, and again), so it crosses every bucket, in both directions, at the
fastest pace the controller can. It is fed to the Trainer's
:class:`simigrad_jax.Controller` as ``batch_sizes_to_profile`` (one step per
size), so both modes train on the same sizes and the same examples. A real run
changes the size at most this fast, and usually stays in a few buckets.

Measured per mode (from the Trainer's per-step ``metrics.jsonl`` and summary):

* ``steps``; ``buckets_visited``: distinct micro-batch shapes the steps ran;
* ``compiles`` and ``compile_seconds``: as the Trainer counts them (one
  program per shape for steps of one micro-batch per device, a micro-step per
  shape that accumulated, and the update of accumulated steps), read after
  ``Trainer.close()``, which finishes the compile in progress and cancels
  queued ones (so a short run may compile fewer shapes than its grid has);
* ``compile_cache_hits``: the compiles, of ``compiles``, that loaded their
  program from the persistent compilation cache (``--persistent-cache``)
  instead of compiling it;
* ``compile_wait_seconds``: time steps were blocked waiting for a compile.
  Each shape is compiled once, so a step can only wait at the first visit of
  a shape whose background compile has not finished yet;
* ``wall_seconds``: the sum of the steps' seconds (data wait, compile wait,
  compute; what ``Trainer.train`` reports); ``total_seconds``: wall time of
  set-up (building the Trainer, which compiles the apply step), ``train()``
  (which also writes metrics and epoch-end checkpoints between steps:
  ``between_steps_seconds``) and ``close()``. The model's parameters are
  initialised before the clock starts, and before the timed runs an untimed
  2-step primer run pays the process's one-time costs (Flax's first init,
  eager ops, orbax's first save), so they are not charged to the first mode;
* the compile-wait share of ``wall_seconds``: overall, and after warm-up
  under two definitions of warm-up: after the first step (which has to wait for its shape:
  nothing compiles before ``train()`` starts); and after all shapes compiled
  (the steps after the first one whose record shows every shape of the grid
  compiled; no step can wait then, so this share is 0 by construction and
  ``warmup_end_step`` / ``warmup_end_seconds`` say how long that warm-up
  lasted). The target for ``recompile`` is under 1% after the first step.
  The sweep crosses a bucket every few steps, so when a step is much faster
  than a compile (small models on CPU) the first pass up the range outruns
  the background compiler: in ``recompile_wait`` those steps wait (the
  after-first-step share measures that, amortised over ``--steps``); in
  ``recompile`` a step runs on a fallback shape (``compile_fallback_steps``)
  until the compile schedule admits its own program, ``steps_per_compile``
  steps per program whatever the compiles' timing, and waits when the
  schedule admitted a program whose compile (or load) has not finished;
* ``data_seconds``: time steps spent gathering and placing rows (including
  waiting for the background loader), and its share of ``wall_seconds``;
* ``padding_fraction``: padded rows / all rows computed (real + padding),
  over the run: ``pad`` mode's waste (``recompile`` pads a little too, up to
  the next grid shape, and more on a fallback shape);
* ``examples_per_second``: real examples / ``wall_seconds`` (also after the
  first step).

NOTE: CPU timings are noisy (other processes, the 8 simulated devices share
the host's cores, and on a 2-core host a background compile competes with the
step for the CPU). Compare the modes by the ratios printed within one run
(``recompile / pad``), not by absolute seconds across runs or machines. On
GPUs the device computes while the host compiles, and the pad mode's waste
costs device time in proportion to ``padding_fraction``.

With ``--persistent-cache DIR`` the Trainers use JAX's on-disk compilation
cache (process-wide): a second run of this script then loads executables
instead of compiling them, and the pad mode's single shape (300) can be a
cache hit of the recompile mode's largest one.

The recompile modes run on the Trainer's compile schedule (``steps_per_compile``
steps per program, 4 by default, whatever the compiles' timing: see
docs/compiling.md); ``--steps-per-compile N`` gives it another pace, so that a
run can show how the waits after the first step fall as the schedule admits
programs no sooner than they compile (or load). ``--shapes-per-step N`` plans
steps of up to N shapes on the grid the Trainer chooses for them (with
``--steps-per-compile 64 --shapes-per-step 3``, the training scripts'
settings) instead of one shape a step on the grid of halvings. The JSON
records both and the host's load average (1 minute) before and after the
modes ran.

Usage::

  python benchmarks/trainer_overhead/switching.py                          # benchmarks/results/switching.json
  python benchmarks/trainer_overhead/switching.py --out /tmp/switching.json
  python benchmarks/trainer_overhead/switching.py --persistent-cache DIR   # twice: cold, then warm
  python benchmarks/trainer_overhead/switching.py --steps-per-compile 40
  python benchmarks/trainer_overhead/switching.py --markdown A.json B.json  # docs/results.md's table
  python benchmarks/trainer_overhead/switching.py --quick                  # small, for tests:
                                                          # MLP, [8, 64], 4 shapes

JSON written to ``--out`` (by default ``benchmarks/results/switching.json``,
``switching_quick.json`` with ``--quick``)::

  {"devices": 8, "schedule": [...], ...,
   "modes": {"recompile": {"steps", "buckets_visited", "compiles",
                           "compile_seconds", "compile_wait_seconds",
                           "wall_seconds", "data_seconds",
                           "padding_fraction", ...},
             "pad": {...}},
   "ratios": {"recompile_over_pad": {...}}}
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
  from benchmarks import common  # noqa: E402  (imports no JAX)

  common.prepare_script()

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402

import simigrad_jax  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.trainer_overhead import switching_report  # noqa: E402
from benchmarks.trainer_overhead.switching_models import MODELS  # noqa: E402
from benchmarks.trainer_overhead.switching_models import load_digits_data  # noqa: E402
from benchmarks.trainer_overhead.switching_modes import MULTI_PROCESS_MODES  # noqa: E402
from benchmarks.trainer_overhead.switching_modes import prime_process  # noqa: E402
from benchmarks.trainer_overhead.switching_modes import run_mode  # noqa: E402
from benchmarks.trainer_overhead.switching_modes import run_processes_mode  # noqa: E402
from simigrad_jax.shapes import BucketPolicy  # noqa: E402
from simigrad_jax.shapes import bucket_shapes  # noqa: E402

MODES = ("recompile", "recompile_wait", "pad", "recompile_2proc")

# Required keys of each mode's entry in the JSON (machine-read).
REQUIRED_KEYS = (
  "steps",
  "buckets_visited",
  "compiles",
  "compile_seconds",
  "compile_wait_seconds",
  "wall_seconds",
  "data_seconds",
  "padding_fraction",
)

FULL = {"lower": 8, "upper": 1600, "max_micro": 300, "steps": 214, "model": "cnn"}
QUICK = {"lower": 8, "upper": 64, "max_micro": 8, "steps": 24, "model": "mlp"}


# ----------------------------------------------------------------------------
# The schedule.
# ----------------------------------------------------------------------------


def rule_sweep(lower: int, upper: int, steps: int) -> list[int]:
  """``steps`` batch sizes that move as fast as SimiGrad's rule can, up and down.

  Starts at ``lower``; grows ``B -> max(B + 1, int(B * 1.1))`` until ``upper``,
  then shrinks ``B -> max(1, min(B - 1, int(B * 0.9)))`` until ``lower``, and
  repeats (clamped to the bounds, as the controller clamps).

  Example:
    >>> rule_sweep(8, 12, 9)
    [8, 9, 10, 11, 12, 10, 9, 8, 9]
  """
  if not 1 <= lower <= upper:
    raise ValueError(f"need 1 <= lower <= upper, got lower={lower}, upper={upper}")
  sizes, size, growing = [], lower, True
  for _ in range(steps):
    sizes.append(size)
    if lower == upper:
      continue
    if growing and size >= upper:
      growing = False
    elif not growing and size <= lower:
      growing = True
    size = max(size + 1, int(size * 1.1)) if growing else max(1, min(size - 1, int(size * 0.9)))
    size = min(max(size, lower), upper)
  return sizes


def ran_grid(results_by_mode: dict[str, Any]) -> list[int] | None:
  """The grid (rows per device) the first recompile mode ran on, or None when none ran."""
  for mode, result in results_by_mode.items():
    if mode != "pad":
      return list(result["grid_micro_batch_sizes"])
  return None


def _run_as_process(args: argparse.Namespace) -> None:
  """One process of a multi-process mode: joins the others and runs ``args.modes`` (one mode)."""
  jax.distributed.initialize(
    args.coordinator,
    num_processes=args.num_processes,
    process_id=args.process_id,
    initialization_timeout=120,
  )
  data = load_digits_data()
  root = pathlib.Path(args.workdir)
  schedule = rule_sweep(args.lower, args.upper, args.steps)
  prime_process(args.model, data, root, root / "primer")  # one-time costs, untimed
  result = run_mode(
    args.modes,
    data=data,
    schedule=schedule,
    lower=args.lower,
    upper=args.upper,
    max_micro=args.max_micro_batch_size,
    model_name=args.model,
    workdir=root / "run",
    persistent_cache=args.persistent_cache,
    steps_per_compile=args.steps_per_compile,
    shapes_per_step=args.shapes_per_step,
  )
  if result is not None:
    pathlib.Path(args.result_file).write_text(json.dumps(result))


# ----------------------------------------------------------------------------
# Main.
# ----------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--quick", action="store_true", help=f"a small run for tests: {QUICK} unless given below"
  )
  parser.add_argument(
    "--steps",
    type=int,
    default=None,
    help=f"optimizer steps per mode (default {FULL['steps']}, two sweeps)",
  )
  parser.add_argument("--lower", type=int, default=None, help="smallest global batch size")
  parser.add_argument(
    "--upper", type=int, default=None, help="largest global batch size (at most 1797, the digits)"
  )
  parser.add_argument(
    "--max-micro-batch-size",
    type=int,
    default=None,
    help="rows per device of the largest shape (the pad mode's one shape)",
  )
  parser.add_argument("--model", choices=sorted(MODELS), default=None)
  parser.add_argument(
    "--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES)
  )
  common.add_out_flag(parser, "switching")
  parser.add_argument(
    "--workdir",
    default=None,
    help="keep each mode's run (metrics.jsonl, checkpoints) in a new "
    "sub-directory here (default: a temporary directory, deleted)",
  )
  parser.add_argument(
    "--persistent-cache",
    default=None,
    metavar="DIR",
    help="JAX persistent compilation cache directory (process-wide)",
  )
  parser.add_argument(
    "--steps-per-compile",
    type=float,
    default=None,
    help="the compile schedule's steps per program in the recompile modes "
    "(CompileConfig.steps_per_compile; default: the Trainer's)",
  )
  parser.add_argument(
    "--shapes-per-step",
    type=int,
    default=None,
    help="steps of up to N shapes on the grid the Trainer chooses for them "
    "(CompileConfig.shapes_per_step, shapes_per_octave=None; default: one shape a step on the "
    "grid of halvings)",
  )
  parser.add_argument(
    "--markdown",
    nargs="+",
    default=None,
    metavar="JSON",
    help="print the Markdown table of these runs' JSON (one row per mode) and exit",
  )
  # One process of a multi-process mode (the benchmark starts them itself).
  for flag in ("--coordinator", "--num-processes", "--process-id", "--result-file"):
    parser.add_argument(
      flag, default=None, type=int if "process" in flag else str, help=argparse.SUPPRESS
    )
  args = parser.parse_args(argv)
  if args.shapes_per_step is not None and not 1 <= args.shapes_per_step <= 4:
    parser.error(f"--shapes-per-step {args.shapes_per_step}: expected 1 to 4 shapes a step")
  args.out = common.out_path(args.out, "switching", args.quick)
  common.apply_preset(
    args,
    QUICK if args.quick else FULL,
    {
      "steps": "steps",
      "lower": "lower",
      "upper": "upper",
      "max_micro_batch_size": "max_micro",
      "model": "model",
    },
  )
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark; prints a table, writes JSON to ``--out``, returns the results.

  Args:
    argv: command-line arguments (``sys.argv[1:]`` when None).

  Returns:
    ``{"modes": {"recompile": {...}, "pad": {...}}, "ratios": {...}, ...}``
    (see the module docstring for the keys).
  """
  args = _parse_args(argv)
  if args.markdown:
    runs = [json.loads(pathlib.Path(path).read_text()) for path in args.markdown]
    print(switching_report.markdown_table(runs))
    return {}
  if args.process_id is not None:
    _run_as_process(args)
    return {}
  modes = [m.strip() for m in args.modes.split(",") if m.strip()]
  unknown = sorted(set(modes) - set(MODES))
  if unknown or not modes:
    raise ValueError(f"unknown modes {unknown}; choose from {MODES}")
  if args.steps < 1:
    raise ValueError(f"--steps must be >= 1, got {args.steps}")
  data = load_digits_data()
  if args.upper > len(data["label"]):
    raise ValueError(f"--upper {args.upper} exceeds the {len(data['label'])} digits examples")
  schedule = rule_sweep(args.lower, args.upper, args.steps)
  devices = jax.devices()
  grid = BucketPolicy(args.max_micro_batch_size, 1).micro_batch_sizes()
  shapes = bucket_shapes(
    BucketPolicy(args.max_micro_batch_size, 1), len(devices), args.lower, args.upper
  )
  recompile_grid = (
    f"grid {list(shapes)}"
    if args.shapes_per_step is None
    else f"steps of up to {args.shapes_per_step} shapes, on the Trainer's grid for them"
  )
  print(
    f"{len(devices)} x {devices[0].platform} devices; {args.model} on digits "
    f"({len(data['label'])} examples); batch sizes {args.lower}..{args.upper} "
    f"(rule-paced sweep, {args.steps} steps per mode); max micro-batch "
    f"{args.max_micro_batch_size}: recompile {recompile_grid}, pad shape "
    f"[{args.max_micro_batch_size}]",
    flush=True,
  )

  if args.workdir:
    root = pathlib.Path(args.workdir).absolute()
    root.mkdir(parents=True, exist_ok=True)
    cleanup = None
  else:
    root = pathlib.Path(tempfile.mkdtemp(prefix="simigrad-switching-"))
    cleanup = root
  results_by_mode: dict[str, Any] = {}
  load_before = os.getloadavg()[0]
  try:
    primer_seconds = prime_process(args.model, data, root)
    for mode in modes:
      if mode in MULTI_PROCESS_MODES:
        script = os.path.abspath(__file__)
        result, workdir = run_processes_mode(mode, args, root, len(devices), script)
      else:
        workdir = pathlib.Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=root))
        result = run_mode(
          mode,
          data=data,
          schedule=schedule,
          lower=args.lower,
          upper=args.upper,
          max_micro=args.max_micro_batch_size,
          model_name=args.model,
          workdir=workdir,
          persistent_cache=args.persistent_cache,
          steps_per_compile=args.steps_per_compile,
          shapes_per_step=args.shapes_per_step,
        )
      result["workdir"] = None if cleanup else str(workdir)
      results_by_mode[mode] = result
      print(
        f"  {mode}: {result['steps']} steps, {result['buckets_visited']} buckets, "
        f"{result['wall_seconds']:.2f} s of steps, compile wait "
        f"{result['compile_wait_seconds']:.2f} s",
        flush=True,
      )
  finally:
    if cleanup is not None:
      shutil.rmtree(cleanup, ignore_errors=True)

  results = {
    "devices": len(devices),
    "platform": devices[0].platform,
    "jax_version": jax.__version__,
    "model": args.model,
    "data": "sklearn digits",
    "lower": args.lower,
    "upper": args.upper,
    "max_micro_batch_size": args.max_micro_batch_size,
    # The grid of halvings; with --shapes-per-step, the grid the recompile modes ran.
    "micro_batch_grid": list(grid) if args.shapes_per_step is None else ran_grid(results_by_mode),
    "schedule": schedule,
    "quick": bool(args.quick),
    "persistent_cache": args.persistent_cache,
    "steps_per_compile": args.steps_per_compile or simigrad_jax.CompileConfig().steps_per_compile,
    "shapes_per_step": args.shapes_per_step or 1,
    "load_average": [load_before, os.getloadavg()[0]],
    "primer_seconds": primer_seconds,
    "same_batch_sizes": len({tuple(r["batch_sizes"]) for r in results_by_mode.values()}) == 1,
    "warmup_definitions": {
      "after_first_step": "steps 2..N (the first step waits for its shape's compile)",
      "after_all_compiled": "steps after the first whose record shows every grid shape compiled",
    },
    "note": "CPU timings are noisy; compare the modes by the ratios within one run.",
    "modes": results_by_mode,
    "ratios": switching_report.mode_ratios(results_by_mode),
  }
  return common.report(results, switching_report.format_table(results), args.out)


if __name__ == "__main__":
  main(sys.argv[1:])
