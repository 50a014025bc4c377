"""Benchmark: the Trainer's per-device memory on a mesh, by how the parameters are laid out.

One MLP (``--widths``, default 256-2048-256, mean squared error) with
``optax.adamw`` after :func:`simigrad_jax.transform`, the same global batch
(``--batch-size``, one micro-batch a step), compiled by
:class:`simigrad_jax.Trainer` in each layout (XLA's compiled memory analysis
of the step, :meth:`simigrad_jax.Trainer.step_memory`; nothing is timed):

* ``replicated``: data parallel on the mesh's 4 data positions alone;
* ``tp``: a 4 x 2 ``batch`` x ``model`` mesh, the first kernel
  column-parallel and the second row-parallel over ``model``;
* ``fsdp_tp``: ``tp`` with each kernel also in blocks over ``batch``
  (``P("batch", "model")``, ``P("model", "batch")``): kept in blocks through
  the step, its optimizer state too;
* ``fsdp_tp_gathered``: ``tp`` with each kernel stored sharded over
  ``("model", "batch")`` together on one dimension, which the step gathers
  whole over ``batch``.

Reported per layout: the step's argument bytes (the state it takes) and
temporary bytes per device, and each against ``tp``'s. Goals, printed as
PASS/FAIL: ``fsdp_tp``'s temporary memory at most 1.05x ``tp``'s (keeping
blocks costs the step nothing), and its arguments at most 0.3x ``tp``'s (the
state at rest in blocks over 4 positions).

Usage::

  python benchmarks/step_cost/trainer_mesh.py --out /tmp/trainer_mesh.json
  python benchmarks/step_cost/trainer_mesh.py --quick    # tiny, for tests

The JSON goes to ``benchmarks/results/trainer_mesh.json``
(``trainer_mesh_quick.json`` with ``--quick``) unless ``--out`` says otherwise
(``--out ''``: none).
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
import tempfile  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import simigrad_jax  # noqa: E402
from benchmarks import common  # noqa: E402

FULL = {"widths": (256, 2048, 256), "batch_size": 64}
QUICK = {"widths": (8, 32, 8), "batch_size": 16}
GOALS = {"fsdp_tp temp / tp temp": 1.05, "fsdp_tp arguments / tp arguments": 0.3}
DATA, MODEL = 4, 2


class MLP(nn.Module):
  """Dense ReLU layers of the given widths (the first is the input's)."""

  widths: tuple[int, ...]

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for index, width in enumerate(self.widths[1:]):
      x = nn.Dense(width, name=f"Dense_{index}")(x)
      if index < len(self.widths) - 2:
        x = nn.relu(x)
    return x


def layouts(num_layers: int) -> dict[str, Any]:
  """Each layout's Trainer settings: ``devices`` or ``mesh`` and ``param_sharding``."""
  mesh = Mesh(np.array(jax.devices()[: DATA * MODEL]).reshape(DATA, MODEL), ("batch", "model"))

  def specs(column: P, row: P) -> dict[str, Any]:
    return {
      f"Dense_{i}": {"kernel": column if i % 2 == 0 else row, "bias": None}
      for i in range(num_layers)
    }

  return {
    "replicated": {"devices": jax.devices()[:DATA]},
    "tp": {"mesh": mesh, "param_sharding": specs(P(None, "model"), P("model", None))},
    "fsdp_tp": {"mesh": mesh, "param_sharding": specs(P("batch", "model"), P("model", "batch"))},
    "fsdp_tp_gathered": {
      "mesh": mesh,
      "param_sharding": specs(P(None, ("model", "batch")), P(("model", "batch"), None)),
    },
  }


def measure(widths: Sequence[int], batch_size: int) -> dict[str, dict[str, int]]:
  """The step memory of each layout, per device."""
  widths = tuple(widths)
  model = MLP(widths)
  rng = np.random.default_rng(0)
  data = {
    "x": rng.normal(size=(4 * batch_size, widths[0])).astype(np.float32),
    "y": rng.normal(size=(4 * batch_size, widths[-1])).astype(np.float32),
  }
  params = model.init(jax.random.key(0), data["x"][:1])["params"]

  def loss_fn(p, model_state, batch, weights, rng):
    del weights, rng
    return ((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2).mean(-1), model_state

  results = {}
  for name, settings in layouts(len(widths) - 1).items():
    optimizer = optax.chain(
      simigrad_jax.transform("batch"), optax.adamw(1e-3), simigrad_jax.scale_by_lr_factor()
    )
    with tempfile.TemporaryDirectory() as workdir:
      trainer = simigrad_jax.Trainer(
        loss_fn=loss_fn,
        params=params,
        optimizer=optimizer,
        source=simigrad_jax.ArraySource(data),
        controller=simigrad_jax.Controller(
          batch_size, 0.5, batch_size_lower_bound=batch_size, batch_size_upper_bound=batch_size
        ),
        workdir=pathlib.Path(workdir),
        **settings,
        config=simigrad_jax.TrainerConfig(
          max_micro_batch_size=batch_size // DATA, progress=False, tensorboard=False
        ),
      )
      with trainer:
        memory = trainer.step_memory()
    results[name] = {key: int(memory[key]) for key in ("argument_bytes", "temp_bytes")}
    print(f"  {name}: {results[name]}", flush=True)
  return results


def _format_table(results: dict[str, Any]) -> str:
  layout = results["layouts"]
  lines = [
    f"MLP {'-'.join(map(str, results['widths']))}, AdamW, batch {results['batch_size']} "
    f"({results['batch_size'] // DATA} rows per data position); per device",
    f"  {'layout':18s} {'arguments KiB':>13s} {'x tp':>6s} {'temp KiB':>9s} {'x tp':>6s}",
  ]
  for name, entry in layout.items():
    lines.append(
      f"  {name:18s} {entry['argument_bytes'] / 1024:13,.0f} {entry['arguments_to_tp']:6.3f} "
      f"{entry['temp_bytes'] / 1024:9,.0f} {entry['temp_to_tp']:6.3f}"
    )
  for key, goal in results["goals"].items():
    lines.append(
      f"  goal {key} <= {goal['bound']}: {goal['value']:.3f} {'PASS' if goal['pass'] else 'FAIL'}"
    )
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark; prints the table and returns (and writes) the results."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help=f"tiny, for tests: {QUICK}")
  parser.add_argument("--widths", type=int, nargs="+", default=None)
  parser.add_argument("--batch-size", type=int, default=None, help="the global batch")
  common.add_out_flag(parser, "trainer_mesh")
  args = parser.parse_args(argv)
  args.out = common.out_path(args.out, "trainer_mesh", args.quick)
  common.apply_preset(args, QUICK if args.quick else FULL)
  if args.batch_size < DATA or args.batch_size % DATA:
    raise ValueError(
      f"--batch-size must be a positive multiple of the {DATA} data positions, got "
      f"{args.batch_size}"
    )
  if jax.device_count() < DATA * MODEL:
    raise ValueError(f"needs {DATA * MODEL} devices, found {jax.device_count()}")
  measured = measure(args.widths, args.batch_size)
  tp = measured["tp"]
  for entry in measured.values():
    entry["arguments_to_tp"] = entry["argument_bytes"] / tp["argument_bytes"]
    entry["temp_to_tp"] = entry["temp_bytes"] / tp["temp_bytes"]
  values = {
    "fsdp_tp temp / tp temp": measured["fsdp_tp"]["temp_to_tp"],
    "fsdp_tp arguments / tp arguments": measured["fsdp_tp"]["arguments_to_tp"],
  }
  results = {
    "widths": list(args.widths),
    "batch_size": args.batch_size,
    "layouts": measured,
    "goals": {
      key: {"bound": GOALS[key], "value": value, "pass": value <= GOALS[key]}
      for key, value in values.items()
    },
  }
  return common.report(results, _format_table(results), args.out)


if __name__ == "__main__":
  main()
