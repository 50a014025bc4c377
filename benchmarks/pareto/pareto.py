"""Benchmark: test accuracy against average batch size, SimiGrad against fixed batches and other controllers.

SimiGrad's central claim (Qin et al. 2021, the Pareto plots for CIFAR-10 and
ImageNet) is that, for the same number of epochs, adapting the batch size to
the gradient similarity reaches the accuracy of small fixed batches while
training at a much larger average batch size (fewer optimizer steps, more
parallelism). This script checks that claim at small scale, on real data, on
a CPU with 8 simulated devices, with the real :class:`simigrad_jax.Trainer`:

* ``fixed``: constant batch sizes over a grid; the learning rate is
  ``base_lr * sqrt(B / base_batch_size)`` times a multiplier tuned per batch
  size over a small grid, picked by the mean VALIDATION accuracy over seeds
  (the test split is only reported);
* ``simigrad``: :class:`simigrad_jax.Controller` over a grid of similarity
  targets and batch-size bounds, starting at ``--initial-batch-size``;
* ``gns``: the gradient-noise-scale controller (McCandlish et al. 2018) over a
  grid of multiples of the noise scale;
* optionally the schedules (``linear``, ``geometric``) and ``loss_plateau``.

Every adaptive run starts at ``--initial-batch-size`` with the learning rate
tuned for that size in the fixed grid, and the trainer scales it by
``sqrt(B / B_0)`` as the batch moves (the reference's rule). With
``--adaptive-lr-multipliers`` and ``--adaptive-lr-rules`` (e.g. ``1,2`` and
``sqrt,linear``) every adaptive setting also runs with those learning rates
at B_0 and scaling rules, and the variant with the best mean validation
accuracy is the one judged, as for the fixed batches. Every run trains the
same number of epochs, with the same learning-rate schedule in epochs (cosine
by default), SGD with momentum 0.9 and a small MLP, over several seeds (the
seed sets the initialisation and the data order; the data split is fixed).

Reported per run: final test accuracy, average batch size (examples /
optimizer steps), optimizer steps and wall time (building the trainer,
compiling, training and evaluating). The table gives the mean and the spread
(sample standard deviation) over seeds per setting, and where each setting
stands against the fixed-batch Pareto front: the best accuracy that any tuned
fixed batch at least as large reaches (``front``); ``gap`` is the setting's
mean accuracy minus the front, in points (>= 0: on or beyond the front);
``interp`` is the stricter gap to the front interpolated linearly in
log2(B) at the setting's average batch size.

With ``--profile`` the script also trains one fixed-batch run at
``--initial-batch-size`` and, at a few points in training, visits a list of
batch sizes with the controller's profiling mode
(``Controller(batch_sizes_to_profile=...)``) at a near-zero learning rate,
recording the similarity measured at each size and the gradient noise scale
(from the same steps' half-batch norms), so that similarity against batch
size can be compared with ``1 / (1 + 2 B_simple / B)`` (SPEC.md).

Tasks: ``--task images`` (the default) trains the MLP on ``--dataset mnist``
(real MNIST from ``../shared/data``), ``digits`` (scikit-learn's) or ``auto``
(MNIST when its files are there); see ``benchmarks/pareto/images.py``.
``--task mlm`` trains ``train/configs/bert_tiny.py``'s masked language model,
made smaller, on ``../shared/data/tinyshakespeare.txt`` with LAMB, and scores
masked-token accuracy and loss on held-out text; see
``benchmarks/pareto/mlm.py``. The protocol is the same for both.

Where things live (all in ``benchmarks/pareto/``): this file runs the
benchmark; ``flags.py`` its command line (the flags, the grid they give, their
checks); ``protocol.py`` the run specs, the grid, one run's record and reusing
runs; ``analysis.py`` grouping over seeds, selection by validation, the fixed
front and the summary (one entry per controller, and per set of extra
SimiGrad options, e.g. ``"simigrad ema_decay=0.9"``); ``report.py`` the
printed table, the plot and the markdown tables of docs/results.md;
``images.py`` and ``mlm.py`` the tasks.

Usage::

  python benchmarks/pareto/pareto.py --quick --profile     # the small grid: pareto_quick.json
  python benchmarks/pareto/pareto.py --out /tmp/pareto.json --profile      # the full grid
  python benchmarks/pareto/pareto.py --task mlm --quick --out /tmp/mlm.json
  python benchmarks/pareto/pareto.py --task mlm            # pareto_mlm.json
  # Add learning-rate variants of the adaptive runs, reusing every run already done:
  python benchmarks/pareto/pareto.py --profile --reuse /tmp/pareto.json --out /tmp/pareto_lr.json \
      --adaptive-lr-multipliers 1,2 --adaptive-lr-rules sqrt,linear
  # SimiGrad with more Controller options, one variant per JSON object:
  python benchmarks/pareto/pareto.py --reuse benchmarks/results/pareto_mnist.json --targets 0.2,0.3,0.4 \
      --bounds 16:1024 --gns "" --schedules "" --out /tmp/variants.json \
      --simigrad-options '[{}, {"smooth_factor": 0.5}, {"dead_band": 0.1}]'
  # Add runs to a committed result, keeping all of its runs and training only the new ones:
  python benchmarks/pareto/pareto.py --profile --reuse benchmarks/results/pareto_mnist.json --keep-reused \
      --targets 0.3,0.35 --bounds 16:1024 --gns "" --schedules "" \
      --simigrad-options '[{"ema_decay": 0.9}]' --out benchmarks/results/pareto_mnist.json
  # docs/results.md's tables for a result:
  python benchmarks/pareto/pareto.py --markdown benchmarks/results/pareto_mnist.json

JSON written to ``--out`` (by default in ``benchmarks/results/``: ``pareto_mnist.json``,
``pareto_mlm.json`` with ``--task mlm``, ``pareto_quick.json`` or
``pareto_mlm_quick.json`` with ``--quick``; machine-read)::

  {"runs": [{"controller": "fixed" | "simigrad" | "gns" | ..., "seed": int,
             "test_accuracy": float in [0, 1], "avg_batch_size": float,
             "steps": int, "wall_seconds": float, "settings": {...}, ...}],
   "groups": [...], "summary": {...}, "profile": {...} | null, ...}

and a PNG (``--png``; by default ``docs/NAME.png`` for a JSON in
``benchmarks/results/``, where docs/results.md shows it, else ``--out`` with
``.png``) of accuracy against
average batch size with the fixed-batch Pareto front, the batch size over
training of the adaptive runs and, with ``--profile``, similarity against
batch size.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
  from benchmarks import common  # noqa: E402  (imports no JAX)

  common.prepare_script()

# pylint: disable=g-import-not-at-top,wrong-import-position
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.pareto import flags  # noqa: E402
from benchmarks.pareto import images  # noqa: E402
from benchmarks.pareto.analysis import group_runs  # noqa: E402,E501
from benchmarks.pareto.analysis import select_by_validation  # noqa: E402,E501
from benchmarks.pareto.analysis import select_fixed  # noqa: E402,E501
from benchmarks.pareto.analysis import summarize  # noqa: E402,E501
from benchmarks.pareto.protocol import RunCache  # noqa: E402
from benchmarks.pareto.protocol import adaptive_specs
from benchmarks.pareto.protocol import base_lr_for
from benchmarks.pareto.protocol import compact
from benchmarks.pareto.protocol import comparison_folder
from benchmarks.pareto.protocol import fixed_specs
from benchmarks.pareto.report import format_table  # noqa: E402
from benchmarks.pareto.report import lr_text  # noqa: E402
from benchmarks.pareto.report import markdown_tables  # noqa: E402
from benchmarks.pareto.report import plot  # noqa: E402


def result_name(task: str, dataset: str, quick: bool) -> str:
  """The default result's name: ``pareto_mnist``, ``pareto_mlm``, or ``pareto`` for the quick image grid.

  Args:
    task: ``--task`` (``"images"`` or ``"mlm"``).
    dataset: the image task's data set as resolved (``"mnist"``, ``"digits"``).
    quick: ``--quick``; :func:`benchmarks.common.out_path` adds ``_quick``, so
      the quick image grid writes ``pareto_quick.json``.

  Returns:
    The name :func:`benchmarks.common.out_path` turns into
    ``benchmarks/results/NAME.json``.
  """
  if task == "mlm":
    return "pareto_mlm"
  return "pareto" if quick else f"pareto_{dataset}"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark; prints a table, writes JSON to ``--out`` and the PNG; returns the results.

  Args:
    argv: command-line arguments (``sys.argv[1:]`` when None).

  Returns:
    ``{"runs": [...], "groups": [...], "summary": {...}, "profile": ..., ...}``
    (see the module docstring).
  """
  args = flags.parse_args(argv, description=__doc__.split("\n\n")[0])
  if args.markdown:
    with open(args.markdown, encoding="utf-8") as f:
      print(markdown_tables(json.load(f)))
    return {}
  grid = args.grid
  task = flags.TASKS[args.task]
  keep = args.workdir is not None
  started = time.perf_counter()
  runs: list[dict[str, Any]] = []
  profile = None
  with comparison_folder(args.workdir, prefix="simigrad-pareto-") as root:
    exp = task.setup(grid, lr_schedule=args.lr_schedule, root=root, keep_workdirs=keep)
    info = exp.info()
    if args.base_lr is None:
      args.base_lr = task.BASE_LR[info["dataset"]]
    num_train = exp.num_train
    flags.validate(args, num_train)
    devices = jax.devices()
    print(
      f"{len(devices)} x {devices[0].platform} devices; {info['description']}; "
      f"{grid['epochs']:g} epochs; lr {args.base_lr} at B={args.base_batch_size}, "
      f"sqrt-scaled, x{list(grid['lr_multipliers'])}; {args.lr_schedule} schedule; seeds "
      f"{list(grid['seeds'])}",
      flush=True,
    )
    if info["dataset_note"]:
      print(f"NOTE: {info['dataset_note']}", flush=True)

    cache = (
      None
      if args.reuse is None
      else RunCache(
        args.reuse,
        {
          "task": args.task,
          "dataset": info["dataset"],
          "epochs": grid["epochs"],
          "hidden": grid["hidden"],
          "lr_schedule": args.lr_schedule,
          "base_lr": args.base_lr,
          "base_batch_size": args.base_batch_size,
          "initial_batch_size": args.initial_batch_size,
          **{k: v for k, v in info.items() if k in ("num_train", "num_val", "seq_length")},
        },
      )
    )

    def execute(specs):
      for spec in specs:
        run = cache.lookup(spec) if cache else None
        if run is None:
          run = exp.run(spec)
        run = compact(run)
        if spec.seed != min(grid["seeds"]):
          run["trace"] = None  # kept for the one seed the plot draws: a smaller JSON
        runs.append(run)
        print(
          f"  {run['controller']:<12} {run['label']:<20} lr {lr_text(run['settings'])} seed "
          f"{run['seed']}: test {100 * run['test_accuracy']:.2f}%  avg B "
          f"{run['avg_batch_size']:.1f}  steps {run['steps']}  {run['wall_seconds']:.1f} s"
          f"{'  (reused)' if run.get('reused') else ''}",
          flush=True,
        )

    execute(
      fixed_specs(
        grid["fixed"], grid["lr_multipliers"], grid["seeds"], args.base_lr, args.base_batch_size
      )
    )
    best = select_fixed(group_runs(runs))
    b0 = args.initial_batch_size
    multiplier = best[b0]["settings"]["lr_multiplier"] if b0 in best else 1.0
    lr0 = base_lr_for(b0, args.base_lr, args.base_batch_size) * multiplier
    adaptive_multipliers = grid["adaptive_lr_multipliers"] or (multiplier,)
    variants = [
      (base_lr_for(b0, args.base_lr, args.base_batch_size) * m, m, rule)
      for m in adaptive_multipliers
      for rule in grid["adaptive_lr_rules"]
    ]
    execute(adaptive_specs(args, grid, variants, num_train))
    if args.keep_reused:
      rest = [compact(run) for run in cache.rest()]
      runs.extend(rest)
      print(f"  kept {len(rest)} more runs of {args.reuse}", flush=True)
    if args.profile:
      sizes = sorted({b for b in (8, 16, 32, 64, 128, 256, 512, 1024, 2048) if b <= num_train})
      e = grid["epochs"]
      steps = args.profile_steps or (6 if args.quick else 8)
      old = cache.profile if cache else None
      if (
        old
        and old["batch_size"] == b0
        and old["sizes"] == sizes
        and old["steps_per_size"] == steps
        and math.isclose(old["learning_rate"], lr0, rel_tol=1e-9)
      ):
        profile = {**old, "reused_from": old.get("reused_from") or cache.profile_from}
      else:
        profile = images.run_profile(
          exp,
          batch_size=b0,
          lr=lr0,
          sizes=sizes,
          steps_per_size=steps,
          at_epochs=(0.0, round(e / 4, 3), round(e / 2, 3), round(3 * e / 4, 3), e),
        )

  groups = group_runs(runs)
  select_by_validation(groups)
  summary = summarize(groups)
  results = {
    "runs": runs,
    "groups": groups,
    "summary": summary,
    "profile": profile,
    "task": args.task,
    **{k: v for k, v in info.items() if k != "description"},
    "epochs": grid["epochs"],
    "seeds": list(grid["seeds"]),
    "hidden": grid["hidden"],
    "quick": bool(args.quick),
    "initial_batch_size": args.initial_batch_size,
    "base_lr": args.base_lr,
    "base_batch_size": args.base_batch_size,
    "lr_schedule": args.lr_schedule,
    "lr_multipliers": list(grid["lr_multipliers"]),
    "adaptive_lr_rules": list(grid["adaptive_lr_rules"]),
    "simigrad_options": list(grid["simigrad_options"]),
    "adaptive_lr_multipliers": list(adaptive_multipliers),
    "reused_from": args.reuse,
    "reused_runs": 0 if cache is None else cache.reused,
    "devices": len(devices),
    "platform": devices[0].platform,
    "jax_version": jax.__version__,
    "total_wall_seconds": time.perf_counter() - started,
    "note": "lr per fixed batch size chosen by validation accuracy; test accuracy reported. "
    "gap_points: mean test accuracy minus the best tuned fixed batch at least as large.",
  }
  table = format_table(groups, summary, profile)
  table += f"\n\ntotal wall time {results['total_wall_seconds']:.0f} s"
  out = common.out_path(args.out, result_name(args.task, info["dataset"], args.quick), args.quick)
  png = common.plot_path(args.png, out)
  if png:
    results["png"] = common.repository_path(plot(results, png))
  common.report(results, table, out)
  if png:
    print(f"wrote {png}")
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
