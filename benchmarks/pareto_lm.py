"""Benchmark: serial optimizer steps and tokens to a target validation loss, for a causal LM.

Language-model pre-training changes the batch size with ramps fixed before
the run. This script asks whether SimiGrad, which measures instead, gets to
the same validation loss in fewer serial optimizer steps without spending
more tokens. It trains the ``train/configs/shakespeare_lm.py`` recipe (a
character-level decoder-only transformer on tinyshakespeare, AdamW, warm-up
then cosine decay in tokens) at a reduced size, on a CPU with 8 simulated
devices, with the real :class:`simigrad_jax.Trainer`, every run for the same
token budget (one pass over the first ``--train-windows`` windows):

* ``fixed``: constant batch sizes. The learning rate is tuned once, at
  ``--lr-batch-size``, over ``--lr-multipliers`` of ``--base-lr`` (seed 0,
  lowest final validation loss), and every other size takes it by the square
  root rule, ``lr * sqrt(B / lr_batch_size)``;
* the ramps LM trainers use (``step_schedule``, ``linear_ramp``,
  ``doubling_warmup``, ``seesaw``) where they are registered controllers,
  at their published settings scaled to this budget (:func:`ramp_specs`);
* ``gns``: the gradient-noise-scale controller;
* ``simigrad``: the reference rule and the model rule (``ema_decay``) at a
  few similarity targets.

Every adaptive run starts at ``--initial-batch-size`` with the square-root
learning rate of that size, and the Trainer scales it by ``sqrt(B / B_0)`` as
the batch moves. The validation loss (nats per token, a fixed set of
``--eval-windows`` windows from the held-out last 10% of the text) is
measured ``--evals`` times per run, evenly in tokens, and at the end.

The target is the best constant batch's final validation loss, the mean over
seeds. For every run: the serial optimizer steps and the tokens to reach it
(linearly interpolated between the two evaluations around the crossing;
null when never reached), the final validation loss, the steps and the
tokens. The verdict (``benchmarks/pareto_lm_report.py``) compares each
SimiGrad setting with the best constant batch's steps and tokens (its whole
run: on average over seeds it reaches the target at its end) and with every
ramp's steps to the target.

Usage::

  python benchmarks/pareto_lm.py --quick      # 14 runs, about 3 min on 2 cores: pareto_lm_quick.json
  python benchmarks/pareto_lm.py              # the full grid, ~10 min: benchmarks/results/pareto_lm.json
  python benchmarks/pareto_lm.py --train-windows 6144 --lr-multipliers 0.5,1,2 \
      --targets 0.1,0.3 --out benchmarks/results/pareto_lm_393k.json               # half the budget
  python benchmarks/pareto_lm.py --markdown benchmarks/results/pareto_lm.json     # docs/results.md's table

JSON written to ``--out`` (by default ``benchmarks/results/pareto_lm.json``, or
``pareto_lm_quick.json`` with ``--quick``; machine-read)::

  {"target_val_loss": float,
   "runs": [{"controller": "fixed" | "simigrad" | "gns" | "step_schedule" | "linear_ramp"
                           | "doubling_warmup" | "seesaw",
             "setting": str, "seed": int, "steps_to_target": float | null,
             "tokens_to_target": float | null, "final_val_loss": float,
             "steps": int, "tokens": int, "curve": [[steps, tokens, val_loss], ...], ...}],
   "settings": [...], "verdict": {...}, ...}

and a PNG (``--png``; by default ``docs/NAME.png`` for a JSON in
``benchmarks/results/``, where docs/results.md shows it, else ``--out`` with
``.png``).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from benchmarks import common  # noqa: E402  (imports no JAX)

  common.prepare_script()

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402

import simigrad_jax  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks import pareto_lm_report  # noqa: E402
from benchmarks.lm_experiment import LmExperiment  # noqa: E402
from benchmarks.pareto_protocol import RunSpec  # noqa: E402
from benchmarks.pareto_protocol import base_lr_for  # noqa: E402
from simigrad_jax.compile import persistent_cache_settings  # noqa: E402

RAMPS = ("step_schedule", "linear_ramp", "doubling_warmup", "seesaw")

FULL: dict[str, Any] = {
  "seeds": (0, 1, 2),
  "seq_length": 64,
  "hidden": 64,
  "train_windows": 12288,  # 786,432 tokens
  "eval_windows": 128,
  "evals": 12,
  "fixed": (16, 32, 64, 128),
  "lr_multipliers": (1.0, 2.0, 4.0, 8.0, 16.0),
  "targets": (0.1, 0.2),
  "model_targets": (0.1,),
  "gns": (1.0,),
  "ramps": RAMPS,
}
QUICK: dict[str, Any] = {
  **FULL,
  "seeds": (0, 1),
  "train_windows": 3072,
  "evals": 10,
  "fixed": (16, 64),
  "lr_multipliers": (8.0,),  # the full grid's choice
  "targets": (0.1,),
  "model_targets": (),
  "ramps": ("doubling_warmup", "seesaw"),
}


def ramp_specs(
  names: Sequence[str],
  seeds: Sequence[int],
  *,
  initial: int,
  upper: int,
  num_tokens: int,
  seq_length: int,
  lr: float,
) -> tuple[list[RunSpec], list[str]]:
  """The ramps LM trainers use, at their published shapes scaled to a budget of ``num_tokens``.

  All start at ``B_0 = initial`` and count tokens (``tokens_per_example =
  seq_length``):

  * ``step_schedule`` (Megatron-LM's thresholds): ``2 B_0`` from 1/8 of the
    budget, ``4 B_0`` from 1/4 and ``8 B_0`` from 1/2;
  * ``linear_ramp`` (MaxText, GPT-3's linear ramp): ``B_0`` to ``8 B_0`` in
    steps of ``B_0`` over the first half of the budget;
  * ``doubling_warmup`` (Merrill et al. 2025; Llama 3 doubles twice, at
    1.7% and 19% of its 15T tokens): ``B_0`` doubled at 1.7% and 19% of the
    budget;
  * ``seesaw`` (arXiv 2510.14717): the batch doubles where the run's cosine
    decay (from the end of the 10% warm-up to the end, down to 0.02x) would
    halve the learning rate, up to ``upper``, and the learning rate is
    ``2^-k sqrt(B_k / B_0)`` there (the controller's own schedule replaces the
    cosine: :meth:`LmExperiment.run`).

  Args:
    names: the ramps to run; those not registered
      (``simigrad_jax.controller_names()``) are left out and returned.
    seeds: the seeds.
    initial: ``B_0``.
    upper: Seesaw's largest batch.
    num_tokens: the run's budget in tokens.
    seq_length: tokens per example.
    lr: the learning rate at ``B_0``.

  Returns:
    ``(specs, missing)``: the runs, and the names of the ramps not registered.
  """
  registered = set(simigrad_jax.controller_names())
  missing = [n for n in names if n not in registered]
  specs = []
  for name in names:
    if name in missing:
      continue
    options = ramp_options(
      name, initial=initial, upper=upper, num_tokens=num_tokens, seq_length=seq_length
    )
    specs += [RunSpec(name, options, lr, 1.0, seed) for seed in seeds]
  return specs, missing


def ramp_options(
  name: str, *, initial: int, upper: int, num_tokens: int, seq_length: int
) -> tuple[tuple[str, Any], ...]:
  """The controller options of one ramp (see :func:`ramp_specs`), sorted by name."""
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
    raise ValueError(f"unknown ramp {name!r}; choose one of {RAMPS}")
  return tuple(sorted(options.items()))


def setting_label(spec: RunSpec) -> str:
  """A run's setting in a few words: the batch size, target or ramp (counts in tokens)."""
  options = dict(spec.options)
  if spec.controller == "step_schedule":
    return f"{options['thresholds']} tokens"
  if spec.controller == "linear_ramp":
    return (
      f"{options['initial_batch_size']}->{options['final_batch_size']} by "
      f"{options['increment']} over {options['ramp']} tokens"
    )
  if spec.controller == "doubling_warmup":
    points = " and ".join(options["doubling_points"].split(","))
    return f"x2 from {options['initial_batch_size']} at {points} tokens"
  if spec.controller == "seesaw":
    return (
      f"x2 at the cosine's {options['num_halvings']} halvings, "
      f"{options['initial_batch_size']}->{options['batch_size_upper_bound']}"
    )
  return spec.label()


def _floats(text: str) -> tuple[float, ...]:
  return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in text.split(",") if x.strip())


def _names(text: str) -> tuple[str, ...]:
  names = tuple(x.strip() for x in text.split(",") if x.strip())
  unknown = [n for n in names if n not in RAMPS]
  if unknown:
    raise argparse.ArgumentTypeError(f"unknown ramps {unknown}; choose from {RAMPS}")
  return names


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  p.add_argument(
    "--quick", action="store_true", help="the quick grid (14 runs, about 3 min on 2 cores)"
  )
  common.add_out_flag(p, "pareto_lm")
  p.add_argument(
    "--png",
    default=None,
    help="the plot (default: docs/NAME.png for a JSON in benchmarks/results/, else --out "
    "with .png)",
  )
  p.add_argument("--markdown", default=None, help="print the docs table of this JSON, and stop")
  p.add_argument("--workdir", default=None, help="keep every run's workdir under this folder")
  p.add_argument("--text-file", default=None, help="train on this text, not tinyshakespeare")
  p.add_argument("--seeds", type=_ints, default=None)
  p.add_argument("--seq-length", type=int, default=None, help="tokens each example predicts")
  p.add_argument("--hidden", type=int, default=None, help="the transformer's width")
  p.add_argument("--train-windows", type=int, default=None, help="the token budget, in windows")
  p.add_argument("--eval-windows", type=int, default=None, help="validation windows")
  p.add_argument("--evals", type=int, default=None, help="validation evaluations per run")
  p.add_argument("--fixed", type=_ints, default=None, help="constant batch sizes")
  p.add_argument("--lr-multipliers", type=_floats, default=None, help="of --base-lr, tuned")
  p.add_argument("--targets", type=_floats, default=None, help="SimiGrad's, reference rule")
  p.add_argument("--model-targets", type=_floats, default=None, help="SimiGrad's, model rule")
  p.add_argument("--gns", type=_floats, default=None, help="multiples of the noise scale")
  p.add_argument("--ramps", type=_names, default=None, help=f"some of {','.join(RAMPS)}")
  p.add_argument("--base-lr", type=float, default=3e-3, help="AdamW's lr at --lr-batch-size")
  p.add_argument("--lr-batch-size", type=int, default=32)
  p.add_argument("--initial-batch-size", type=int, default=16, help="B_0 of the adaptive runs")
  p.add_argument("--upper-bound", type=int, default=256, help="the adaptive runs' largest batch")
  p.add_argument("--ema-decay", type=float, default=0.9, help="the model rule's")
  args = p.parse_args(argv)
  args.out = common.out_path(args.out, "pareto_lm", args.quick)
  common.apply_preset(args, QUICK if args.quick else FULL)
  return args


def _lr_specs(args: argparse.Namespace) -> list[RunSpec]:
  b = args.lr_batch_size
  return [
    RunSpec("fixed", (("initial_batch_size", b),), args.base_lr * m, m, min(args.seeds))
    for m in args.lr_multipliers
  ]


def _adaptive_specs(args: argparse.Namespace, lr0: float, num_examples: int) -> list[RunSpec]:
  b0, upper = args.initial_batch_size, args.upper_bound
  bounds = (("batch_size_lower_bound", b0), ("batch_size_upper_bound", upper))
  specs: list[RunSpec] = []
  for seed in args.seeds:
    for target in args.targets:
      opts = (("initial_batch_size", b0), ("similarity_target", target), *bounds)
      specs.append(RunSpec("simigrad", opts, lr0, 1.0, seed))
    for target in args.model_targets:
      opts = (
        ("initial_batch_size", b0),
        ("similarity_target", target),
        *bounds,
        ("ema_decay", args.ema_decay),
      )
      specs.append(RunSpec("simigrad", opts, lr0, 1.0, seed))
    for multiple in args.gns:
      opts = (("initial_batch_size", b0), ("multiple", multiple), *bounds, ("ema_decay", 0.9))
      specs.append(RunSpec("gns", opts, lr0, 1.0, seed))
  ramps, missing = ramp_specs(
    args.ramps,
    args.seeds,
    initial=b0,
    upper=upper,
    num_tokens=num_examples * args.seq_length,
    seq_length=args.seq_length,
    lr=lr0,
  )
  args.missing_ramps = missing
  return specs + ramps


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the comparison; prints the table and the verdict, writes the JSON and the PNG.

  Args:
    argv: command-line arguments (``sys.argv[1:]`` when None).

  Returns:
    The results (see the module docstring), or ``{}`` with ``--markdown``.
  """
  args = _parse_args(argv)
  if args.markdown:
    with open(args.markdown, encoding="utf-8") as f:
      print(pareto_lm_report.markdown(json.load(f)))
    return {}
  keep = args.workdir is not None
  root = (
    pathlib.Path(args.workdir).absolute()
    if keep
    else pathlib.Path(tempfile.mkdtemp(prefix="simigrad-pareto-lm-"))
  )
  root.mkdir(parents=True, exist_ok=True)
  started = time.perf_counter()
  runs: list[dict[str, Any]] = []
  with contextlib.ExitStack() as cleanup:
    if not keep:
      cleanup.callback(shutil.rmtree, root, ignore_errors=True)
    cleanup.enter_context(persistent_cache_settings())
    exp = LmExperiment(
      hidden=args.hidden,
      seq_length=args.seq_length,
      train_windows=args.train_windows,
      eval_windows=args.eval_windows,
      evals=args.evals,
      root=root,
      keep_workdirs=keep,
      text_file=args.text_file,
    )
    for size in (*args.fixed, args.initial_batch_size, args.upper_bound):
      if size > exp.num_train:
        raise ValueError(
          f"batch size {size} exceeds the {exp.num_train} training windows (--train-windows)"
        )
    devices = jax.devices()
    print(f"{len(devices)} x {devices[0].platform} devices; {exp.description}", flush=True)

    def execute(specs: list[RunSpec]) -> list[dict[str, Any]]:
      done = []
      for spec in specs:
        run = exp.run(spec, setting_label(spec))
        runs.append(run)
        done.append(run)
        if args.out:  # every run so far, should the analysis at the end fail
          pathlib.Path(args.out + ".runs").write_text(json.dumps(runs))
        print(
          f"  {run['controller']:<15} {run['setting']:<24} lr {spec.lr:.2e} seed {spec.seed}: "
          f"val loss {run['final_val_loss']:.4f}  steps {run['steps']}  tokens {run['tokens']:,}"
          f"  {run['wall_seconds']:.1f} s",
          flush=True,
        )
      return done

    tuning = execute(_lr_specs(args))
    best = min(tuning, key=lambda r: r["final_val_loss"])
    multiplier = best["lr_multiplier"]
    lr_at = lambda b: base_lr_for(b, args.base_lr * multiplier, args.lr_batch_size)  # noqa: E731
    print(f"tuned: lr {args.base_lr * multiplier:.2e} at B={args.lr_batch_size}", flush=True)
    fixed = [
      RunSpec("fixed", (("initial_batch_size", b),), lr_at(b), multiplier, seed)
      for b in args.fixed
      for seed in args.seeds
    ]
    done = {(r["setting"], r["seed"], r["learning_rate"]) for r in runs}
    execute([s for s in fixed if (setting_label(s), s.seed, s.lr) not in done])
    execute(_adaptive_specs(args, lr_at(args.initial_batch_size), exp.num_train))

  results = pareto_lm_report.analyse(runs, fixed_sizes=args.fixed, seeds=args.seeds)
  results.update(
    {
      **exp.info(),
      "quick": bool(args.quick),
      "seeds": list(args.seeds),
      "fixed_sizes": list(args.fixed),
      "base_lr": args.base_lr,
      "lr_batch_size": args.lr_batch_size,
      "lr_multipliers": list(args.lr_multipliers),
      "tuned_lr_multiplier": multiplier,
      "initial_batch_size": args.initial_batch_size,
      "upper_bound": args.upper_bound,
      "missing_ramps": args.missing_ramps,
      "devices": len(devices),
      "platform": devices[0].platform,
      "jax_version": jax.__version__,
      "total_wall_seconds": round(time.perf_counter() - started, 1),
    }
  )
  table = pareto_lm_report.format_table(results)
  png = common.plot_path(args.png, args.out)
  if png:
    results["png"] = common.repository_path(pareto_lm_report.plot(results, png))
  common.report(results, table, args.out)
  if args.out:
    pathlib.Path(args.out + ".runs").unlink(missing_ok=True)
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
