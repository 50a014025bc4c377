"""Benchmark: serial optimizer steps and tokens to a target validation loss, for a causal LM.

Language-model pre-training changes the batch size with ramps fixed before
the run. This script asks whether an adaptive batch (SimiGrad, and the
``"allowance"`` rule, which spends a stated token allowance for the fewest
steps) reaches the best constant batch's validation loss in fewer serial
optimizer steps, spending at most 1.10x its tokens. It trains the
``train/configs/shakespeare_lm.py`` recipe (a character-level decoder-only
transformer on tinyshakespeare, AdamW, warm-up then cosine decay over each
run, in tokens) at a reduced size, on a CPU with 8 simulated devices, with
the real :class:`simigrad_jax.Trainer`.

The protocol, built so that it can be won or lost honestly:

1. The constant-batch grid, tuned on seed ``--seeds[0]``: for each size of
   ``--fixed``, the learning rate over ``--lr-multipliers`` of the square-root
   rule's ``--base-lr * sqrt(B / --lr-batch-size)``, widened by a factor 2 at
   a time past an edge until the best is strictly inside (at most
   ``--max-widen`` times a side). The best size must be bracketed too: while
   it is the smallest or the largest size, the next size out (half or double)
   is tuned as well. Each size's best learning rate and loss are in
   ``fixed_grid``.
2. The best ``(size, learning rate)`` with every seed (paired: seed k sees the
   same data order and initial parameters in every setting): its mean final
   validation loss is the target, its steps and tokens the reference
   (``best_fixed``).
3. Every adaptive setting from that size and learning rate, within
   ``[B_0, --upper-factor x B_0]``, with every seed, on ``--token-allowance``
   (1.10) times the best constant run's tokens:
   ``allowance`` (the new rule, its only setting the allowance) and SimiGrad
   at ``--targets``, each under both learning-rate couplings (``"full"``: the
   square-root factor times the schedule; ``"peak"``: the factor in full at
   the schedule's peak, fading as it decays), ``gns`` and the four ramps LM
   trainers use (:func:`ramp_specs`). The others use ``--lr-coupling``
   (``"peak"``), but Seesaw, whose own schedule assumes the full coupling.
4. Steps and tokens to the target, read on each run's validation curve
   (``--evals`` >= 20 evaluations, evenly in tokens, on ``--eval-windows``
   windows spread over the whole held-out text), interpolated between the
   two evaluations around the crossing.
5. Reproducibility: the first adaptive run is trained twice; the JSON's
   ``reproducibility`` holds both final losses and their difference. The
   runs wait for their own shape's compilation (no compile fallback, whose
   choice of shape depends on timing), which is what makes a run repeat.
   The verdict counts a loss within that difference of the target as
   reaching it.

Two budgets: ``--budget today`` (12,288 windows of 64 tokens, 786k tokens,
the earlier comparison's) and ``--budget long`` (4x: 3.1M tokens, about 3.1
passes over tinyshakespeare's 15,685 training windows). Results JSON live in
``benchmarks/results/`` (``pareto_lm.json``, ``pareto_lm_long.json``,
``pareto_lm_quick.json``); the plots go to ``docs/``. docs/results.md shows
the results and how long each budget took to train.

Resume: every finished run is appended to ``OUT.runs.jsonl`` as it ends;
killed and started again with the same flags, the comparison reads them back
and trains only the rest (a file of another experiment is refused). The file
is removed once the JSON is written. ``--extend`` reads back the runs of a
finished ``OUT`` (its ``experiment`` must match) and trains only the runs it
lacks: a setting added to the protocol after a budget finished. A JSON
written before results recorded their ``experiment`` (``pareto_lm_long.json``)
is read as the experiment it was (:func:`legacy_experiment`).
``benchmarks/lm/run_lm_budgets.sh`` runs both budgets in the background at low
priority.

Usage::

  python benchmarks/lm/pareto_lm.py --quick            # a small grid: pareto_lm_quick.json
  python benchmarks/lm/pareto_lm.py                    # today's budget: pareto_lm.json
  python benchmarks/lm/pareto_lm.py --budget long      # 4x the tokens: pareto_lm_long.json
  python benchmarks/lm/pareto_lm.py --extend           # pareto_lm.json plus the settings it lacks
  python benchmarks/lm/pareto_lm.py --markdown benchmarks/results/pareto_lm.json   # the docs table
  python benchmarks/lm/pareto_lm.py --replot benchmarks/results/pareto_lm.json     # docs/pareto_lm.png
  python benchmarks/lm/pareto_lm.py --compare-budgets benchmarks/results/pareto_lm.json \\
    benchmarks/results/pareto_lm_long.json          # each setting's saving on both budgets

JSON (machine-read)::

  {"target_val_loss": float, "token_allowance": float,
   "experiment": {...} (what a resumed or extended run must share),
   "fixed_grid": [{"batch_size", "learning_rates", "final_val_losses", "best_learning_rate",
                   "bracketed"}, ...],
   "best_fixed": {"batch_size": int, "learning_rate": float, ...},
   "reproducibility": {"first", "second", "abs_diff", "deterministic"},
   "runs": [{"controller": "fixed" | "allowance" | "simigrad" | "gns" | "step_schedule"
                           | "linear_ramp" | "doubling_warmup" | "seesaw",
             "setting": str, "seed": int, "learning_rate": float (its peak at B_0),
             "batch_size": int (constant runs), "lr_coupling": str, "budget_share": float,
             "steps_to_target": float | null, "tokens_to_target": float | null,
             "final_val_loss": float, "steps": int, "tokens": int,
             "curve": [[steps, tokens, val_loss], ...], ...}],
   "settings": [...], "verdict": {...}, ...}

and a PNG (``--png``; by default ``docs/NAME.png`` for a JSON in
``benchmarks/results/``).
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
import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402

import simigrad_jax  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.lm import report  # noqa: E402
from benchmarks.lm.experiment import LmExperiment  # noqa: E402
from benchmarks.lm.frontier import lr_grid  # noqa: E402
from benchmarks.lm.protocol import ramp_options  # noqa: E402
from benchmarks.lm.run_store import RunStore  # noqa: E402
from benchmarks.pareto.protocol import RunSpec  # noqa: E402
from benchmarks.pareto.protocol import base_lr_for  # noqa: E402
from benchmarks.pareto.protocol import comparison_folder  # noqa: E402

RAMPS = ("step_schedule", "linear_ramp", "doubling_warmup", "seesaw")
COUPLINGS = ("full", "peak")

TODAY: dict[str, Any] = {
  "seeds": (0, 1, 2, 3, 4),
  "seq_length": 64,
  "hidden": 64,
  "budget_windows": 12288,  # 786,432 tokens
  "eval_windows": 256,
  "evals": 24,
  "fixed": (8, 16, 32, 64),
  "lr_multipliers": (2.0, 4.0, 8.0),
  "max_widen": 2,
  "max_size_widen": 2,
  "upper_factor": 16,
  "targets": (0.1, 0.2),
  "gns": (1.0,),
  "ramps": RAMPS,
}
LONG: dict[str, Any] = {**TODAY, "budget_windows": 4 * 12288}  # 3,145,728 tokens
QUICK: dict[str, Any] = {
  **TODAY,
  "seeds": (0, 1),
  "seq_length": 32,
  "hidden": 32,
  "budget_windows": 256,  # 8,192 tokens: 32 steps at B=8
  "eval_windows": 64,
  "evals": 10,
  "fixed": (8, 16, 32),
  "lr_multipliers": (4.0, 8.0, 16.0),
  "max_widen": 0,
  "max_size_widen": 0,
  "upper_factor": 4,
  "targets": (0.1,),
  "gns": (),
  "ramps": ("doubling_warmup",),
}
BUDGETS = {"today": TODAY, "long": LONG}


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


def setting_label(spec: RunSpec) -> str:
  """A run's setting in a few words: the batch size, target or ramp (counts in tokens)."""
  options = dict(spec.options)
  coupling = "" if spec.lr_coupling == "full" else f" lr@{spec.lr_coupling}"
  if spec.controller == "step_schedule":
    return f"{options['thresholds']} tokens{coupling}"
  if spec.controller == "linear_ramp":
    return (
      f"{options['initial_batch_size']}->{options['final_batch_size']} by "
      f"{options['increment']} over {options['ramp']} tokens{coupling}"
    )
  if spec.controller == "doubling_warmup":
    points = " and ".join(options["doubling_points"].split(","))
    return f"x2 from {options['initial_batch_size']} at {points} tokens{coupling}"
  if spec.controller == "seesaw":
    return (
      f"x2 at the cosine's {options['num_halvings']} halvings, "
      f"{options['initial_batch_size']}->{options['batch_size_upper_bound']}{coupling}"
    )
  return spec.label() + coupling


def _names(text: str) -> tuple[str, ...]:
  names = tuple(x.strip() for x in text.split(",") if x.strip())
  unknown = [n for n in names if n not in RAMPS]
  if unknown:
    raise argparse.ArgumentTypeError(f"unknown ramps {unknown}; choose from {RAMPS}")
  return names


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  p.add_argument("--quick", action="store_true", help="the quick grid (under 5 min on 2 cores)")
  p.add_argument(
    "--budget", choices=sorted(BUDGETS), default="today", help="today's, or 4x its tokens"
  )
  common.add_out_flag(p, "pareto_lm")
  p.add_argument(
    "--png",
    default=None,
    help="the plot (default: docs/NAME.png for a JSON in benchmarks/results/, else --out "
    "with .png)",
  )
  p.add_argument("--markdown", default=None, help="print the docs table of this JSON, and stop")
  p.add_argument("--replot", default=None, help="redraw the plot of this JSON (to --png), and stop")
  p.add_argument(
    "--compare-budgets",
    nargs=2,
    metavar=("TODAY", "LONG"),
    default=None,
    help="print the docs table of each adaptive setting's saving on both budgets' JSON, and stop",
  )
  p.add_argument(
    "--extend",
    action="store_true",
    help="read back the runs of the finished --out JSON (same experiment); train only the rest",
  )
  p.add_argument("--workdir", default=None, help="keep every run's workdir under this folder")
  p.add_argument("--text-file", default=None, help="train on this text, not tinyshakespeare")
  p.add_argument(
    "--seeds", type=common.integers, default=None, help="paired seeds (the first tunes)"
  )
  p.add_argument("--seq-length", type=int, default=None, help="tokens each example predicts")
  p.add_argument("--hidden", type=int, default=None, help="the transformer's width")
  p.add_argument("--budget-windows", type=int, default=None, help="the token budget, in windows")
  p.add_argument("--eval-windows", type=int, default=None, help="validation windows")
  p.add_argument("--evals", type=int, default=None, help="validation evaluations per run")
  p.add_argument(
    "--fixed", type=common.integers, default=None, help="constant batch sizes to start from"
  )
  p.add_argument("--lr-multipliers", type=common.floats, default=None, help="of the sqrt-rule lr")
  p.add_argument("--max-widen", type=int, default=None, help="lr grid widenings per side")
  p.add_argument("--max-size-widen", type=int, default=None, help="sizes added past an edge")
  p.add_argument(
    "--targets", type=common.floats, default=None, help="SimiGrad's similarity targets"
  )
  p.add_argument("--gns", type=common.floats, default=None, help="multiples of the noise scale")
  p.add_argument("--ramps", type=_names, default=None, help=f"some of {','.join(RAMPS)}")
  p.add_argument("--token-allowance", type=float, default=1.1, help="adaptive runs' tokens")
  p.add_argument(
    "--lr-coupling", choices=COUPLINGS, default="peak", help="of the runs other than SimiGrad's"
  )
  p.add_argument("--base-lr", type=float, default=3e-3, help="AdamW's lr at --lr-batch-size")
  p.add_argument("--lr-batch-size", type=int, default=32)
  p.add_argument("--upper-factor", type=int, default=None, help="adaptive bound: this x B_0")
  p.add_argument("--ema-decay", type=float, default=0.9, help="the noise-scale averages'")
  args = p.parse_args(argv)
  name = "pareto_lm" if args.budget == "today" else f"pareto_lm_{args.budget}"
  args.out = common.out_path(args.out, name, args.quick)
  common.apply_preset(args, QUICK if args.quick else BUDGETS[args.budget])
  if args.extend and not (args.out and os.path.exists(args.out)):
    p.error(f"--extend reads back the finished --out JSON, and {args.out!r} does not exist")
  if len(args.lr_multipliers) < 3:
    p.error(f"--lr-multipliers needs at least 3 values, got {args.lr_multipliers}")
  if not args.token_allowance >= 1.0:
    p.error(f"--token-allowance must be >= 1, got {args.token_allowance}")
  return args


def _experiment_key(args: argparse.Namespace) -> dict[str, Any]:
  """What the stored runs must share with this invocation to be reused."""
  keys = (
    "seq_length", "hidden", "budget_windows", "eval_windows", "evals", "text_file",
    "base_lr", "lr_batch_size", "token_allowance", "ema_decay", "upper_factor", "lr_coupling",
  )  # fmt: skip
  return {k: getattr(args, k) for k in keys}


def legacy_experiment(result: dict[str, Any]) -> dict[str, Any]:
  """The experiment of a result written before results recorded theirs (``experiment``).

  Read from what the result does record: its size, budget, evaluation and
  learning-rate settings, and the bounds' factor (``upper_bound /
  initial_batch_size``); the noise-scale averages' decay, which it does not
  record, had only ever run at its default (0.9), and such results trained
  on tinyshakespeare (``text_file`` None).

  Raises:
    ValueError: the result lacks a field the experiment needs (naming it).
  """
  needed = (
    "seq_length", "model", "budget_windows", "num_val", "evals_per_run", "base_lr",
    "lr_batch_size", "token_allowance", "upper_bound", "initial_batch_size", "lr_coupling",
  )  # fmt: skip
  missing = [k for k in needed if k not in result]
  hidden = re.search(r"hidden (\d+)", str(result.get("model", "")))
  if missing or hidden is None:
    raise ValueError(
      f"the result has no 'experiment' and lacks {missing or ['model (hidden N)']} to rebuild it"
    )
  return {
    "seq_length": result["seq_length"],
    "hidden": int(hidden.group(1)),
    "budget_windows": result["budget_windows"],
    "eval_windows": result["num_val"],
    "evals": result["evals_per_run"],
    "text_file": None,
    "base_lr": result["base_lr"],
    "lr_batch_size": result["lr_batch_size"],
    "token_allowance": result["token_allowance"],
    "ema_decay": 0.9,
    "upper_factor": result["upper_bound"] // result["initial_batch_size"],
    "lr_coupling": result["lr_coupling"],
  }


def sizes_bracketed(grid: list[dict[str, Any]]) -> bool:
  """Whether the best size of ``grid`` (sorted by size) has a size below it and one above."""
  best = min(range(len(grid)), key=lambda i: grid[i]["best_final_val_loss"])
  return 0 < best < len(grid) - 1


class Protocol:
  """The comparison's steps, each run trained once (or read back from the store).

  Args:
    args: the parsed flags.
    train: ``train(spec, label, share) -> run``.
    store: the finished runs.
  """

  def __init__(
    self,
    args: argparse.Namespace,
    train: Callable[[RunSpec, str, float], dict[str, Any]],
    store: RunStore,
  ):
    self.args, self._train, self.store = args, train, store
    self.runs: list[dict[str, Any]] = []
    self._seen: set[int] = set()

  def run(self, spec: RunSpec, share: float = 1.0) -> dict[str, Any]:
    """One run (trained, or the stored one), kept once in :attr:`runs`."""
    label = setting_label(spec)
    run, trained = self.store.get_or_run(spec, share, lambda: self._train(spec, label, share))
    if id(run) not in self._seen:
      self._seen.add(id(run))
      self.runs.append(run)
    print(
      f"  {'' if trained else '(stored) '}{run['controller']:<15} {run['setting']:<28} "
      f"lr {spec.lr:.2e} seed {spec.seed}: val loss {run['final_val_loss']:.4f}  "
      f"steps {run['steps']}  tokens {run['tokens']:,}  {run['wall_seconds']:.1f} s",
      flush=True,
    )
    return run

  def _fixed(self, size: int, multiplier: float, seed: int) -> RunSpec:
    a = self.args
    lr = base_lr_for(size, a.base_lr, a.lr_batch_size) * multiplier
    return RunSpec("fixed", (("initial_batch_size", size),), lr, multiplier, seed)

  def tune_size(self, size: int) -> dict[str, Any]:
    """One size's learning rate, widened past an edge until the best is strictly inside."""
    a, seed = self.args, self.args.seeds[0]
    losses: dict[float, float] = {}
    while True:
      to_run, best, bracketed = lr_grid(losses, a.lr_multipliers, a.max_widen)
      if not to_run:
        break
      for m in to_run:
        losses[m] = self.run(self._fixed(size, m, seed))["final_val_loss"]
    assert best is not None
    multipliers = sorted(losses)
    return {
      "batch_size": size,
      "learning_rates": [self._fixed(size, m, seed).lr for m in multipliers],
      "final_val_losses": [losses[m] for m in multipliers],
      "best_learning_rate": self._fixed(size, best, seed).lr,
      "best_multiplier": best,
      "best_final_val_loss": losses[best],
      "bracketed": bracketed,
    }

  def tune_grid(self, num_train: int) -> list[dict[str, Any]]:
    """Every size's tuning, the sizes widened until the best size is strictly inside."""
    sizes = sorted(self.args.fixed)
    grid = {b: self.tune_size(b) for b in sizes}
    for _ in range(self.args.max_size_widen):
      best = min(grid.values(), key=lambda g: g["best_final_val_loss"])["batch_size"]
      if best == sizes[0] and best // 2 >= 2:
        sizes.insert(0, best // 2)
      elif best == sizes[-1] and best * 2 <= num_train:
        sizes.append(best * 2)
      else:
        break
      grid |= {b: self.tune_size(b) for b in sizes if b not in grid}
    return [grid[b] for b in sizes]

  def best_fixed(self, grid: list[dict[str, Any]]) -> RunSpec:
    """The best size at its best learning rate; its runs with every seed."""
    best = min(grid, key=lambda g: g["best_final_val_loss"])
    for seed in self.args.seeds:
      self.run(self._fixed(best["batch_size"], best["best_multiplier"], seed))
    return self._fixed(best["batch_size"], best["best_multiplier"], self.args.seeds[0])

  def adaptive_specs(self, best: RunSpec, num_train: int) -> list[RunSpec]:
    """Every adaptive setting and ramp from the best size and learning rate, every seed."""
    a = self.args
    b0, lr = dict(best.options)["initial_batch_size"], best.lr
    upper = min(a.upper_factor * b0, num_train)
    bounds = (("batch_size_lower_bound", b0), ("batch_size_upper_bound", upper))
    allowance = (
      ("initial_batch_size", b0),
      ("token_allowance", a.token_allowance),
      *bounds,
      ("ema_decay", a.ema_decay),
    )
    # The rule's fewest-steps batch assumes a rate suited to each batch: both couplings are shown.
    settings: list[tuple[str, tuple[tuple[str, Any], ...], str]] = [
      ("allowance", allowance, coupling) for coupling in (a.lr_coupling, *COUPLINGS) if coupling
    ]
    settings = list(dict.fromkeys(settings))  # the --lr-coupling one first, each once
    for coupling in COUPLINGS:
      for target in a.targets:
        options = (("initial_batch_size", b0), ("similarity_target", target), *bounds)
        settings.append(("simigrad", options, coupling))
    for m in a.gns:
      options = (("initial_batch_size", b0), ("multiple", m), *bounds, ("ema_decay", a.ema_decay))
      settings.append(("gns", options, a.lr_coupling))
    specs = [
      RunSpec(name, options, lr, best.lr_multiplier, seed, lr_coupling=coupling)
      for seed in a.seeds
      for name, options, coupling in settings
    ]
    tokens = round(a.token_allowance * a.budget_windows) * a.seq_length
    ramps, a.missing_ramps = ramp_specs(
      a.ramps, a.seeds, initial=b0, upper=upper, num_tokens=tokens, seq_length=a.seq_length, lr=lr
    )
    return specs + [  # Seesaw's own schedule is built for the full coupling (2^-k sqrt(B_k / B_0))
      dataclasses.replace(
        r,
        lr_multiplier=best.lr_multiplier,
        lr_coupling="full" if r.controller == "seesaw" else a.lr_coupling,
      )
      for r in ramps
    ]

  def repeat(self, spec: RunSpec, share: float, first: dict[str, Any]) -> dict[str, Any]:
    """``spec`` trained once more: whether the same seed and code give the same final loss."""
    again = self.store.get_or_run(
      dataclasses.replace(spec, options=(*spec.options, ("_repeat", 1))),
      share,
      lambda: self._train(spec, setting_label(spec), share),
    )[0]
    diff = abs(again["final_val_loss"] - first["final_val_loss"])
    return {
      "run": f"{first['controller']} {first['setting']} seed {first['seed']}",
      "first": first["final_val_loss"],
      "second": again["final_val_loss"],
      "abs_diff": round(diff, 6),
      "deterministic": diff <= 1e-4,
      "how": "steps wait for their own shape's compilation (compile.fallback=False); "
      f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the comparison; prints the table and the verdict, writes the JSON and the PNG.

  Args:
    argv: command-line arguments (``sys.argv[1:]`` when None).

  Returns:
    The results (see the module docstring), or ``{}`` with ``--markdown``,
    ``--replot`` or ``--compare-budgets``.
  """
  args = _parse_args(argv)
  if args.replot:
    png = common.plot_path(args.png, args.replot)
    results = json.loads(pathlib.Path(args.replot).read_text("utf-8"))
    print(f"wrote {report.plot(results, png)}")
    return {}
  if args.compare_budgets:
    today, long = (json.loads(pathlib.Path(p).read_text("utf-8")) for p in args.compare_budgets)
    print(report.markdown_budgets(today, long))
    return {}
  if args.markdown:
    with open(args.markdown, encoding="utf-8") as f:
      print(report.markdown(json.load(f)))
    return {}
  keep = args.workdir is not None
  started = time.perf_counter()
  store = RunStore(args.out + ".runs.jsonl" if args.out else None, _experiment_key(args))
  if store.resumed:
    print(f"resuming: {store.resumed} runs read back from {store.path}", flush=True)
  if args.extend:
    with open(args.out, encoding="utf-8") as f:
      finished = json.load(f)
    if "experiment" not in finished:  # written before results recorded their experiment
      finished["experiment"] = legacy_experiment(finished)
    taken = store.read_back(finished, args.out)
    print(f"extending: {taken} runs read back from {args.out}", flush=True)
  with comparison_folder(args.workdir, prefix="simigrad-pareto-lm-") as root:
    exp = LmExperiment(
      hidden=args.hidden,
      seq_length=args.seq_length,
      budget_windows=args.budget_windows,
      max_share=args.token_allowance,
      eval_windows=args.eval_windows,
      evals=args.evals,
      root=root,
      keep_workdirs=keep,
      text_file=args.text_file,
    )
    devices = jax.devices()
    print(f"{len(devices)} x {devices[0].platform} devices; {exp.description}", flush=True)
    protocol = Protocol(args, exp.run, store)
    grid = protocol.tune_grid(exp.num_train)
    best = protocol.best_fixed(grid)
    print(f"best constant batch: {setting_label(best)} at lr {best.lr:.2e}", flush=True)
    adaptive = protocol.adaptive_specs(best, exp.num_train)
    for spec in adaptive:
      protocol.run(spec, args.token_allowance)
    first = protocol.run(adaptive[0], args.token_allowance)
    repeat = protocol.repeat(adaptive[0], args.token_allowance, first)

  results = report.analyse(
    protocol.runs,
    best={"batch_size": dict(best.options)["initial_batch_size"], "learning_rate": best.lr},
    seeds=args.seeds,
    tolerance=repeat["abs_diff"],
  )
  results.update(
    {
      **exp.info(),
      "experiment": _experiment_key(args),
      "budget": args.budget,
      "token_allowance": args.token_allowance,
      "fixed_grid": grid,
      "sizes_bracketed": sizes_bracketed(grid),
      "reproducibility": repeat,
      "quick": bool(args.quick),
      "seeds": list(args.seeds),
      "fixed_sizes": [g["batch_size"] for g in grid],
      "base_lr": args.base_lr,
      "lr_batch_size": args.lr_batch_size,
      "lr_multipliers": list(args.lr_multipliers),
      "lr_coupling": args.lr_coupling,
      "initial_batch_size": dict(best.options)["initial_batch_size"],
      "upper_bound": min(
        args.upper_factor * dict(best.options)["initial_batch_size"], exp.num_train
      ),
      "missing_ramps": args.missing_ramps,
      "devices": len(devices),
      "platform": devices[0].platform,
      "jax_version": jax.__version__,
      "runs_read_back": store.resumed,
      "total_wall_seconds": round(time.perf_counter() - started, 1),
    }
  )
  table = report.format_table(results)
  png = common.plot_path(args.png, args.out)
  if png:
    results["png"] = common.repository_path(report.plot(results, png))
  common.report(results, table, args.out)
  store.close(keep=False)
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
