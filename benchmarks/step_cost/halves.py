"""Benchmark: a training step with the two half-batch gradients against a plain one.

Compiles and times, on ONE device (by default one CPU device; set
``JAX_PLATFORMS`` to time a GPU), a training step of the CIFAR ResNet-18 of
``train/models.py`` (3x3 stem, stages of 2 basic blocks, base width 64: 11.2M
float32 parameters) on 32x32x3 images and 10 classes, with BatchNorm in
training mode as the trainer runs it (``mask=`` the real rows, running
statistics updated), softmax cross-entropy averaged over the real rows, and
``optax.sgd(0.1, momentum=0.9)``:

* ``plain``: ``jax.value_and_grad`` of the mean loss, then the update;
* ``halves``: :func:`simigrad_jax.value_and_half_grads` (first and second
  halves of the batch, each with its own BatchNorm statistics), the update
  with their mean, and the cosine of the two half gradients (what
  :func:`simigrad_jax.transform` reads; three dot products), so the half
  gradients are used as a training step uses them.

Per batch size (``--batch-sizes``, default 32 and 128) and variant it records
the median step seconds (the variants' timed runs interleaved, their order
alternating, so machine noise hits both alike), the compile seconds, and
``temp_bytes`` (``compiled.memory_analysis().temp_size_in_bytes``: temporary
memory, not counting arguments and outputs), with the ratios to ``plain``.
Two more estimates of the time ratio: ``paired_time_ratio``, the median over
repeats of the ratio of back-to-back runs (robust to slow drifts), and
``min_time_ratio_to_plain``, the ratio of the fastest runs (other processes
only ever add time).

Its results, on one CPU device and on one GPU: docs/own_step.md.

Usage::

  python benchmarks/step_cost/halves.py                        # full size: benchmarks/results/halves_resnet.json
  python benchmarks/step_cost/halves.py --out /tmp/halves.json # the JSON elsewhere (--out '': none)
  python benchmarks/step_cost/halves.py --batch-sizes 8,32 --repeats 5
  python benchmarks/step_cost/halves.py --quick                # tiny, for tests: halves_resnet_quick.json

JSON written to ``--out`` (by default ``benchmarks/results/halves_resnet.json``)::

  {"variants": {"plain": {"32": {"step_seconds", "compile_seconds",
                                 "temp_bytes", "time_ratio_to_plain",
                                 "temp_ratio_to_plain", ...}, "128": {...}},
                "halves": {...}},
   "device": {"platform", "device_kind", "devices_used", ...}, ...}
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
  from benchmarks import common  # noqa: E402  (imports no JAX)

  common.configure_host_devices(1)
  common.prepare_script()

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import simigrad_jax  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.step_cost import timing  # noqa: E402
from train import models  # noqa: E402

VARIANTS = ("plain", "halves")
NUM_CLASSES = 10
FULL = {
  "batch_sizes": (32, 128),
  "width": 64,
  "image_size": 32,
  "stages": (2, 2, 2, 2),
  "repeats": 15,
}
QUICK = {"batch_sizes": (4, 8), "width": 4, "image_size": 8, "stages": (1,), "repeats": 2}

Step = Callable[..., tuple[Any, Any, Any, jax.Array]]


def make_model(width: int, stages: Sequence[int]) -> models.ResNet:
  """The CIFAR ResNet of ``train/models.py`` (ResNet-18 with ``stages=(2, 2, 2, 2)``)."""
  return models.ResNet(
    stage_sizes=tuple(stages),
    block_cls=models.ResNetBlock,
    num_classes=NUM_CLASSES,
    num_filters=width,
    stem="cifar",
  )


def make_loss(model: models.ResNet) -> Callable[..., tuple[jax.Array, Any]]:
  """``loss(params, batch, model_state) -> (mean loss, new model_state)``, as the trainer's.

  BatchNorm runs in training mode with ``mask=`` the rows of positive weight,
  and the loss is the weighted mean of the per-example cross-entropies.
  """

  def loss(params, batch, model_state):
    weights = batch["weight"]
    logits, new_state = model.apply(
      {"params": params, **model_state},
      batch["image"],
      train=True,
      mask=weights > 0,
      mutable=list(model_state),
    )
    losses = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), batch["label"]
    )
    return jnp.sum(losses * weights) / jnp.sum(weights), new_state

  return loss


def _cosine(first: Any, second: Any) -> jax.Array:
  dot = lambda a, b: sum(
    jnp.vdot(x.astype(jnp.float32), y.astype(jnp.float32))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )
  return dot(first, second) / jnp.sqrt(dot(first, first) * dot(second, second))


def make_steps(
  loss: Callable[..., Any], optimizer: optax.GradientTransformation
) -> dict[str, Step]:
  """The training step of each variant, by name.

  Args:
    loss: ``loss(params, batch, model_state) -> (mean loss, new model_state)``.
    optimizer: the optimizer both steps apply to the (mean) gradient.

  Returns:
    ``{"plain": step, "halves": step}``, each ``step(params, model_state,
    opt_state, batch) -> (params, model_state, opt_state, stats)``; ``stats``
    holds the loss and, for ``halves``, the cosine of the half gradients
    (whose step keeps the mean of the two halves' BatchNorm running statistics).
  """

  def plain(params, model_state, opt_state, batch):
    (value, new_state), grads = jax.value_and_grad(loss, has_aux=True)(params, batch, model_state)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_state, opt_state, value[None]

  def halves(params, model_state, opt_state, batch):
    (value, new_states), grads, half_grads = simigrad_jax.value_and_half_grads(
      loss,
      has_aux=True,
      batch_argnums=1,  # the model state goes whole to both halves
    )(params, batch, model_state)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    new_state = jax.tree.map(lambda s: jnp.mean(s, axis=0), new_states)
    stats = jnp.stack([value, _cosine(half_grads.first, half_grads.second)])
    return optax.apply_updates(params, updates), new_state, opt_state, stats

  return {"plain": plain, "halves": halves}


def make_batch(batch_size: int, image_size: int, seed: int = 0) -> dict[str, jax.Array]:
  """Random normalised images, labels and unit weights on the default device."""
  rng = np.random.default_rng(seed)
  return {
    "image": jnp.asarray(rng.normal(size=(batch_size, image_size, image_size, 3)), jnp.float32),
    "label": jnp.asarray(rng.integers(0, NUM_CLASSES, size=batch_size), jnp.int32),
    "weight": jnp.ones((batch_size,), jnp.float32),
  }


def measure(
  steps: dict[str, Step],
  args: tuple[Any, ...],
  repeats: int,
  warmup: int = 1,
  compiled: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
  """Compiles every step for ``args`` and times them, interleaved.

  Args:
    steps: name -> step function (not yet jitted).
    args: the step's arguments.
    repeats: timed runs per step; in repeat ``r`` the steps run in their order
      when ``r`` is even and in reverse order when it is odd.
    warmup: untimed runs per step first.
    compiled: if given, receives name -> the compiled step.

  Returns:
    name -> ``{"step_seconds": median, "min_seconds", "compile_seconds",
    "temp_bytes", "seconds": [every timed run]}``.
  """
  compiled = {} if compiled is None else compiled
  results = {}
  for name, step in steps.items():
    start = time.perf_counter()
    compiled[name] = jax.jit(step).lower(*args).compile()
    results[name] = {
      "compile_seconds": time.perf_counter() - start,
      "temp_bytes": timing.temp_bytes(compiled[name]),
      "seconds": [],
    }
  for name in steps:
    for _ in range(warmup):
      jax.block_until_ready(compiled[name](*args))
  names = list(steps)
  for r in range(repeats):
    for name in names if r % 2 == 0 else names[::-1]:
      results[name]["seconds"].append(timing.run_seconds(compiled[name], args))
  for result in results.values():
    result["step_seconds"] = statistics.median(result["seconds"])
    result["min_seconds"] = min(result["seconds"])
  return results


def add_ratios(entries: dict[str, dict[str, Any]]) -> None:
  """Adds ``time_ratio_to_plain``, ``paired_time_ratio``, ``min_time_ratio_to_plain`` and
  ``temp_ratio_to_plain``."""
  base = entries["plain"]
  for entry in entries.values():
    entry["time_ratio_to_plain"] = entry["step_seconds"] / base["step_seconds"]
    entry["min_time_ratio_to_plain"] = entry["min_seconds"] / base["min_seconds"]
    entry["paired_time_ratio"] = statistics.median(
      a / b for a, b in zip(entry["seconds"], base["seconds"])
    )
    entry["temp_ratio_to_plain"] = (
      entry["temp_bytes"] / base["temp_bytes"]
      if entry["temp_bytes"] and base["temp_bytes"]
      else None
    )


def _format_table(results: dict[str, Any]) -> str:
  header = (
    f"{'batch':>6}  {'variant':<8}{'step s':>10}{'time/plain':>12}{'paired':>9}"
    f"{'min':>8}{'temp MB':>10}{'temp/plain':>12}{'compile s':>11}"
  )
  rows = [header, "-" * len(header)]
  for size in results["batch_sizes"]:
    for name, by_size in results["variants"].items():
      v = by_size[str(size)]
      temp = f"{v['temp_bytes'] / 1e6:.1f}" if v["temp_bytes"] is not None else "-"
      temp_ratio = (
        f"{v['temp_ratio_to_plain']:.2f}x" if v["temp_ratio_to_plain"] is not None else "-"
      )
      rows.append(
        f"{size:>6}  {name:<8}{v['step_seconds']:>10.4f}"
        f"{v['time_ratio_to_plain']:>11.2f}x{v['paired_time_ratio']:>8.2f}x"
        f"{v['min_time_ratio_to_plain']:>7.2f}x"
        f"{temp:>10}{temp_ratio:>12}{v['compile_seconds']:>11.2f}"
      )
  return "\n".join(rows)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--quick", action="store_true", help=f"tiny sizes for tests: {QUICK} (flags given still win)"
  )
  parser.add_argument(
    "--batch-sizes",
    type=common.integers,
    default=None,
    help=f"comma-separated even batch sizes (default {FULL['batch_sizes']})",
  )
  parser.add_argument(
    "--width", type=int, default=None, help=f"base width of the ResNet (default {FULL['width']})"
  )
  parser.add_argument(
    "--stages",
    type=common.integers,
    default=None,
    help=f"blocks per stage (default {FULL['stages']}: ResNet-18)",
  )
  parser.add_argument(
    "--image-size",
    type=int,
    default=None,
    help=f"image height and width (default {FULL['image_size']})",
  )
  parser.add_argument(
    "--repeats",
    type=int,
    default=None,
    help=f"timed runs per variant and batch size (default {FULL['repeats']})",
  )
  common.add_out_flag(parser, "halves_resnet")
  args = parser.parse_args(argv)
  args.out = common.out_path(args.out, "halves_resnet", args.quick)
  common.apply_preset(args, QUICK if args.quick else FULL)
  odd = [size for size in args.batch_sizes if size <= 0 or size % 2]
  if odd:
    parser.error(f"batch sizes must be positive and even, got {odd}")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark; prints a table, writes JSON to ``--out``, returns the results.

  Args:
    argv: command-line arguments (``sys.argv[1:]`` when None).

  Returns:
    ``{"variants": {"plain" | "halves": {str(batch_size): {"step_seconds",
    "compile_seconds", "temp_bytes", "time_ratio_to_plain",
    "temp_ratio_to_plain", ...}}}, "device": {...}, ...}``.
  """
  args = _parse_args(argv)
  device = jax.devices()[0]
  model = make_model(args.width, args.stages)
  loss = make_loss(model)
  optimizer = optax.sgd(0.1, momentum=0.9)
  steps = make_steps(loss, optimizer)
  sample = make_batch(2, args.image_size)["image"]
  variables = jax.jit(lambda key: model.init(key, sample, train=True))(jax.random.key(0))
  params = variables.pop("params")
  model_state = dict(variables)
  opt_state = optimizer.init(params)
  num_params = sum(x.size for x in jax.tree.leaves(params))
  print(
    f"1 {device.platform} device ({device.device_kind}); ResNet stages {args.stages}, "
    f"width {args.width}, {num_params:,} params; {args.image_size}x{args.image_size}x3 "
    f"images; batch sizes {args.batch_sizes}; {args.repeats} timed runs each",
    flush=True,
  )

  variants: dict[str, dict[str, Any]] = {name: {} for name in VARIANTS}
  for size in args.batch_sizes:
    batch = make_batch(size, args.image_size, seed=size)
    entries = measure(steps, (params, model_state, opt_state, batch), args.repeats)
    add_ratios(entries)
    for name in VARIANTS:
      variants[name][str(size)] = entries[name]
    halves = entries["halves"]
    print(
      f"  batch {size}: halves/plain time {halves['time_ratio_to_plain']:.2f}x, "
      f"temp {halves['temp_ratio_to_plain'] or float('nan'):.2f}x",
      flush=True,
    )

  results = {
    "variants": variants,
    "device": {
      "platform": device.platform,
      "device_kind": device.device_kind,
      "devices_used": 1,
      "devices_visible": jax.device_count(),
      "host_cpus": os.cpu_count(),
    },
    "batch_sizes": list(args.batch_sizes),
    "model": {
      "name": "resnet",
      "stages": list(args.stages),
      "width": args.width,
      "image_size": args.image_size,
      "num_classes": NUM_CLASSES,
      "params": int(num_params),
    },
    "repeats": args.repeats,
    "jax_version": jax.__version__,
  }
  return common.report(results, _format_table(results), args.out)


if __name__ == "__main__":
  main(sys.argv[1:])
