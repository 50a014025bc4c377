"""Benchmark: what a SimiGrad step costs against the plain data-parallel loop.

Trains the same model on the same random data, on all local devices (by
default 8 simulated CPU devices), at the same global batch size (default 256)
in six variants, side by side in one process:

* ``plain``: the loop a user writes without SimiGrad: a ``jax.pmap`` step
  (``value_and_grad`` of the mean cross-entropy, ``lax.pmean(grads, "batch")``,
  ``optax.sgd(lr)``, parameters and optimizer state donated), dispatched
  asynchronously: no host read per step, the host only blocks at the end of
  a timed window;
* ``plain_read``: the same loop reading the loss of every step on the host
  (after sending the next batch), as a loop that decides anything from a
  device value every step must: the price of that wait alone, without
  SimiGrad, for comparison with ``transform``;
* ``transform``: the same loop with ``optax.chain(simigrad_jax.transform("batch"),
  optax.sgd(lr))`` in place of the ``pmean``, reading the similarity on the
  host after every step (``simigrad_jax.similarity(opt_state)``), as a user
  who feeds a controller must. Both loops gather the next step's rows on the
  host and send them to the devices right after dispatching a step, while
  the devices compute, and this one reads the similarity after that: the
  order that keeps the devices busy;
* ``transform_read_late``: the same, but reading each step's similarity after
  dispatching the next step, as a loop whose controller decides one step
  late would (not a goal): the host never waits for the devices before
  dispatching, so this isolates the transform's own cost from the per-step
  wait that any loop reading a device value every step pays;
* ``trainer_fixed``: :class:`simigrad_jax.Trainer` with a controller that
  holds the batch at the fixed size (``enable_adjust=False``, both bounds at
  that size), ``max_micro_batch_size`` = batch / devices (one micro-step per
  optimizer step), TensorBoard on, progress bar off, checkpoints only at epoch
  ends and at the end of ``train()``;
* ``trainer_adaptive``: the Trainer adapting: SimiGrad's
  :class:`simigrad_jax.Controller` starting at the fixed size, bounds
  [batch / 4, 4 x batch], ``--similarity-target``; its batch moves, so its
  average batch size (and the share of padding rows its shape grid adds) is
  reported beside its examples/s. ``max_micro_batch_size`` is batch /
  devices as in ``trainer_fixed`` (larger sizes accumulate gradients over
  micro-steps).

Every variant reads its rows from the same NumPy arrays in the same order (a
seeded :class:`simigrad_jax.data.EpochSampler`); the plain loops gather them on the
host thread, the Trainer in its background data thread. The data set holds
enough examples that the fixed-size variants finish the whole benchmark within
one epoch (so they save no epoch-end checkpoint); the adaptive variant's larger
batches may cross epochs, and then it saves asynchronously at each epoch end,
as any run does.

Timing: every variant is built and warmed up first (compiled, and
``--warmup-steps`` steps run; the Trainers also wait until every shape their
bounds can reach is compiled). Then ``--rounds`` rounds each time every
variant over ``--steps`` optimizer steps, the variants' order rotating by one
each round, so machine noise hits all variants alike; the reported
examples/s of a variant is the median over rounds. A window of the pmap loops
runs from the first dispatch to ``block_until_ready`` on the last step's
outputs. A Trainer window is one ``trainer.train(num_steps=...)`` call (the
Trainer resumes its step count, ``num_steps`` is absolute) timed from the
outside, so it includes everything the engine does between steps (planning,
data placement, the statistics read, the controller, metrics and TensorBoard
writes), up to the call of its end-of-run checkpoint save: that save and its
wait happen once per run, not once per step, and are reported separately as
``checkpoint_seconds``. ``ratio_to_plain`` is the variant's median examples/s
over plain's; ``ratio_to_plain_paired`` the median over rounds of the ratio
within each round, and ``ratio_to_plain_paired_range`` its lowest and highest
round: how far one run's ratio can stray on this machine.

Also reported, where the Trainer provides them (None otherwise): the median of
the step records' ``host_seconds`` (host time on the step's critical
path) and the compiled memory of its step (``trainer.step_memory()``:
``argument_bytes``, ``temp_bytes``), against the plain step's
``compiled.memory_analysis()`` (``argument_size_in_bytes``,
``temp_size_in_bytes``) and its memory traffic (``cost_analysis()``'s
``bytes accessed``; the pmap loops' ``step_memory`` holds all three).
Goals, printed as PASS/FAIL: ``trainer_fixed`` at least 0.90x plain and
``transform`` at least 0.95x plain.

Models (``--model``): ``mlp``, a perceptron 784-1024-1024-10 on 784-dimensional
inputs; ``resnet``, a small ResNet-18-style network (``train.models.ResNet``,
CIFAR stem, 8 base filters, one block per stage) with per-device BatchNorm on
32x32x3 inputs, its statistics averaged over devices every step in every
variant (the Trainer averages them after each micro-step). The data are
standard normal inputs labelled by a random linear teacher (10 classes).

NOTE: CPU timings are noisy (other processes; the simulated devices share the
host's cores). Compare variants by the ratios within one run. On a CPU the
devices and the host share cores, so host work between steps costs the
devices time; on accelerators it only costs time when it is on the critical
path.

Usage::

  python benchmarks/trainer_overhead/overhead.py                          # MLP: benchmarks/results/overhead.json
  python benchmarks/trainer_overhead/overhead.py --model all --out /tmp/overhead.json
  python benchmarks/trainer_overhead/overhead.py --quick                  # tiny, for tests: overhead_quick.json

JSON written to ``--out`` (by default ``benchmarks/results/overhead.json``)::

  {"devices": 8, "global_batch_size": 256, "steps": ..., "rounds": ...,
   "models": {MODEL: {"params": ..., "plain_step_memory": {...},
                      "variants": {NAME: {"examples_per_second", "ratio_to_plain",
                                          "ratio_to_plain_paired",
                                          "ratio_to_plain_paired_range",
                                          "examples_per_second_rounds",
                                          "average_batch_size", "host_seconds",
                                          "step_memory", ...}},
                      "goals": {NAME: {"min_ratio", "ratio", "pass"}}}},
   "variants": {...}, "goals": {...}}   # the first model's, again at the top
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
import pathlib  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.trainer_overhead.overhead_loops import FULL_MODELS  # noqa: E402
from benchmarks.trainer_overhead.overhead_loops import MEMORY_KEYS  # noqa: E402
from benchmarks.trainer_overhead.overhead_loops import QUICK_MODELS  # noqa: E402
from benchmarks.trainer_overhead.overhead_loops import ModelSpec  # noqa: E402
from benchmarks.trainer_overhead.overhead_loops import PmapLoop  # noqa: E402
from benchmarks.trainer_overhead.overhead_loops import TrainerLoop  # noqa: E402
from benchmarks.trainer_overhead.overhead_loops import count_params  # noqa: E402
from benchmarks.trainer_overhead.overhead_loops import init_model  # noqa: E402
from benchmarks.trainer_overhead.overhead_loops import make_data  # noqa: E402

VARIANTS = (
  "plain",
  "plain_read",
  "transform",
  "transform_read_late",
  "trainer_fixed",
  "trainer_adaptive",
)
# Minimum examples/s relative to plain.
GOALS = {"trainer_fixed": 0.90, "transform": 0.95}

FULL = {"batch_size": 256, "steps": {"mlp": 30, "resnet": 10}, "rounds": 5, "warmup_steps": 3}
QUICK = {"batch_size": 32, "steps": {"mlp": 3, "resnet": 3}, "rounds": 2, "warmup_steps": 2}


# ----------------------------------------------------------------------------
# Timing.
# ----------------------------------------------------------------------------


def time_rounds(variants: dict[str, Any], steps: int, rounds: int) -> dict[str, list[float]]:
  """Examples/s of each variant per round; the order rotates by one each round."""
  names = list(variants)
  rates: dict[str, list[float]] = {name: [] for name in names}
  for r in range(rounds):
    order = names[r % len(names) :] + names[: r % len(names)]
    for name in order:
      examples, seconds = variants[name].run(steps)
      rates[name].append(examples / seconds)
    print(
      f"    round {r + 1}/{rounds}: "
      + ", ".join(f"{name} {rates[name][-1]:,.0f}/s" for name in names),
      flush=True,
    )
  return rates


def _goals(variants: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
  return {
    name: {
      "min_ratio": least,
      "ratio": variants[name]["ratio_to_plain"],
      "pass": variants[name]["ratio_to_plain"] >= least,
    }
    for name, least in GOALS.items()
    if name in variants
  }


def run_model(
  name: str,
  spec: ModelSpec,
  *,
  batch_size: int,
  steps: int,
  rounds: int,
  warmup_steps: int,
  similarity_target: float,
  root: pathlib.Path,
) -> dict[str, Any]:
  """Builds, warms up and times every variant on one model; returns its results."""
  # The fixed-size variants stay within the first epoch; the adaptive one's upper bound fits.
  num_examples = max((warmup_steps + rounds * steps) * batch_size, 4 * batch_size)
  data = make_data(spec, num_examples)
  params, _ = init_model(spec)
  print(
    f"  {name}: {spec.description}, {count_params(params):,} parameters, {num_examples:,} examples",
    flush=True,
  )
  variants: dict[str, Any] = {}
  try:
    variants["plain"] = PmapLoop(spec, data, batch_size, use_transform=False)
    variants["plain_read"] = PmapLoop(spec, data, batch_size, use_transform=False, read_loss=True)
    variants["transform"] = PmapLoop(spec, data, batch_size, use_transform=True)
    variants["transform_read_late"] = PmapLoop(
      spec, data, batch_size, use_transform=True, read_late=True
    )
    for variant, adaptive in (("trainer_fixed", False), ("trainer_adaptive", True)):
      workdir = pathlib.Path(tempfile.mkdtemp(prefix=f"{name}-{variant}-", dir=root))
      variants[variant] = TrainerLoop(spec, data, batch_size, adaptive, similarity_target, workdir)
    for variant in variants.values():
      variant.warm_up(warmup_steps)
    rates = time_rounds(variants, steps, rounds)
    details = {variant: loop.details() for variant, loop in variants.items()}
  finally:
    for variant in variants.values():
      variant.close()
  plain_rate = statistics.median(rates["plain"])
  results: dict[str, Any] = {}
  for variant in variants:
    rate = statistics.median(rates[variant])
    paired = [a / b for a, b in zip(rates[variant], rates["plain"])]
    results[variant] = {
      "examples_per_second": rate,
      "ratio_to_plain": rate / plain_rate,
      "ratio_to_plain_paired": statistics.median(paired),
      "ratio_to_plain_paired_range": [min(paired), max(paired)],
      "examples_per_second_rounds": rates[variant],
      "host_seconds": None,
      "step_memory": None,
      **details[variant],
    }
  return {
    "description": spec.description,
    "params": count_params(params),
    "num_examples": num_examples,
    "steps": steps,
    "plain_step_memory": results["plain"]["step_memory"],
    "variants": results,
    "goals": _goals(results),
  }


# ----------------------------------------------------------------------------
# Main.
# ----------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", choices=(*FULL_MODELS, "all"), default="mlp")
  parser.add_argument(
    "--quick",
    action="store_true",
    help=f"tiny models and sizes, for tests: {QUICK} unless given below",
  )
  parser.add_argument(
    "--steps",
    type=int,
    default=None,
    help=f"optimizer steps per variant per round (default {FULL['steps']})",
  )
  parser.add_argument(
    "--rounds",
    type=int,
    default=None,
    help=f"timed rounds (default {FULL['rounds']}); the median is reported",
  )
  parser.add_argument(
    "--warmup-steps",
    type=int,
    default=None,
    help=f"untimed steps per variant first (default {FULL['warmup_steps']})",
  )
  parser.add_argument(
    "--batch-size",
    type=int,
    default=None,
    help=f"the global batch size (default {FULL['batch_size']})",
  )
  parser.add_argument(
    "--similarity-target", type=float, default=0.3, help="trainer_adaptive's similarity target"
  )
  common.add_out_flag(parser, "overhead")
  args = parser.parse_args(argv)
  args.out = common.out_path(args.out, "overhead", args.quick)
  preset = QUICK if args.quick else FULL
  common.apply_preset(args, preset, ("batch_size", "rounds", "warmup_steps"))
  for key in ("steps", "rounds", "warmup_steps"):
    value = getattr(args, key)
    if value is not None and value < 1:
      raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {value}")
  n = jax.device_count()
  if n % 2 or args.batch_size % n:
    raise ValueError(
      f"--batch-size must be a multiple of the {n} devices (an even count), got {args.batch_size}"
    )
  return args


def _format_table(results: dict[str, Any]) -> str:
  columns = (
    f"{'variant':<18}{'examples/s':>11}{'vs plain':>10}{'paired':>9}"
    f"{'paired range':>15}{'avg batch':>10}"
    f"{'padding':>9}{'host s':>12}{'arg MB':>8}{'temp MB':>8}{'traffic MB':>11}"
    "  goal"
  )
  lines = []
  for name, model in results["models"].items():
    lines += [
      f"{name} ({model['description']}): global batch {results['global_batch_size']}, "
      f"{model['steps']} steps x {results['rounds']} rounds, median examples/s",
      columns,
      "-" * len(columns),
    ]
    for variant, row in model["variants"].items():
      memory = row["step_memory"] or {}
      cells = [
        f"{variant:<18}{row['examples_per_second']:>11,.0f}",
        f"{row['ratio_to_plain']:>9.3f}x{row['ratio_to_plain_paired']:>8.3f}x",
        "{:>15}".format("{:.3f}-{:.3f}".format(*row["ratio_to_plain_paired_range"])),
        f"{row['average_batch_size']:>10.1f}",
        _cell(row.get("padding_fraction"), 9, ".1%"),
        _cell(row["host_seconds"], 12, ".4f"),
      ]
      cells += [
        _cell(memory.get(key), width, ".1f", 2**-20) for key, width in zip(MEMORY_KEYS, (8, 8, 11))
      ]
      goal = model["goals"].get(variant)
      if goal:
        cells.append(f"  >= {goal['min_ratio']:.2f}x {'PASS' if goal['pass'] else 'FAIL'}")
      lines.append("".join(cells))
    lines.append("")
  return "\n".join(lines).rstrip()


def _cell(value: float | None, width: int, fmt: str, scale: float = 1.0) -> str:
  return f"{'-':>{width}}" if value is None else f"{format(value * scale, fmt):>{width}}"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark; prints a table, writes JSON to ``--out``, returns the results.

  Args:
    argv: command-line arguments (``sys.argv[1:]`` when None).

  Returns:
    ``{"devices", "global_batch_size", "models": {MODEL: {"variants": {...},
    "goals": {...}, ...}}, "variants": {...}, "goals": {...}}`` (see the module
    docstring).
  """
  args = _parse_args(argv)
  specs = QUICK_MODELS if args.quick else FULL_MODELS
  names = list(specs) if args.model == "all" else [args.model]
  preset = QUICK if args.quick else FULL
  devices = jax.devices()
  print(
    f"{len(devices)} x {devices[0].platform} devices; global batch {args.batch_size}; "
    f"{args.rounds} rounds after {args.warmup_steps} warm-up steps",
    flush=True,
  )
  root = pathlib.Path(tempfile.mkdtemp(prefix="simigrad-overhead-"))
  models_results = {}
  try:
    for name in names:
      models_results[name] = run_model(
        name,
        specs[name],
        batch_size=args.batch_size,
        steps=args.steps or preset["steps"][name],
        rounds=args.rounds,
        warmup_steps=args.warmup_steps,
        similarity_target=args.similarity_target,
        root=root,
      )
  finally:
    shutil.rmtree(root, ignore_errors=True)
  first = models_results[names[0]]
  results = {
    "devices": len(devices),
    "platform": devices[0].platform,
    "jax_version": jax.__version__,
    "global_batch_size": args.batch_size,
    "rounds": args.rounds,
    "warmup_steps": args.warmup_steps,
    "similarity_target": args.similarity_target,
    "quick": bool(args.quick),
    "note": "CPU timings are noisy; compare the variants by the ratios within one run.",
    "models": models_results,
    "variants": first["variants"],
    "goals": first["goals"],
  }
  return common.report(results, _format_table(results), args.out)


if __name__ == "__main__":
  main(sys.argv[1:])
