"""Benchmark: every SimiGrad step a user can write against its plain step, on 1 and 8 devices.

For an MLP (784-1024-1024-10) and a small CNN (three 3x3 ``nn.Conv`` layers
of 16, 32 and 32 channels on 28x28x1 images, a dense layer), at a global
batch of 256, softmax cross-entropy and ``optax.sgd``, on a mesh of one data
axis with ``Auto`` axes (``nn.Conv`` under ``Explicit`` axes fails in JAX):

* ``two_pass`` (plain ``jax.jit``): ``value_and_half_grads`` and
  ``transform()``, against ``plain`` (``jax.value_and_grad``);
* ``device_halves`` (8 devices): ``device_halves_step`` with
  ``transform("data")``, against ``plain``;
* ``nnx``: the same model in Flax NNX with ``nnx_value_and_half_grads``,
  against ``nnx_plain`` (``nnx.value_and_grad``), both as pure functions of
  ``nnx.split`` states under ``jax.jit``;
* ``pmap``: ``transform("batch")`` (8 devices: the device split; 1 device:
  ``value_and_half_grads`` passed as ``half_grads``), against ``pmap_plain``
  (``lax.pmean`` of the gradient).

Each device count runs in its own process (the simulated devices are fixed
when JAX starts). Per row: ``paired_time_ratio``, the median over rounds of
the SimiGrad step's time over its plain step's timed just before or after
(the order alternates every round), and ``temp_ratio``, the ratio of
``compiled.memory_analysis().temp_size_in_bytes``.

Usage::

  python benchmarks/halves_steps.py           # benchmarks/results/halves.json
  python benchmarks/halves_steps.py --quick   # small: halves_quick.json
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks import common  # noqa: E402

FULL = {"batch": 256, "rounds": 15, "devices": (1, 8)}
QUICK = {"batch": 32, "rounds": 2, "devices": (1, 8)}
MODELS = ("mlp", "cnn")
# Each SimiGrad step, by name, and the plain step it is compared with.
BASELINES = {
  "two_pass": "plain",
  "device_halves": "plain",
  "nnx": "nnx_plain",
  "pmap": "pmap_plain",
}


def _steps(model_name: str, batch_size: int, num_devices: int) -> dict[str, tuple[Any, tuple]]:
  """name -> (compiled step, its arguments), every step of one model on this process's devices."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from jax.sharding import AxisType  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  import simigrad_jax  # pylint: disable=import-outside-toplevel

  class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
      if model_name == "mlp":
        x = x.reshape(x.shape[0], -1)
        for width in (1024, 1024):
          x = nn.relu(nn.Dense(width)(x))
      else:
        for width in (16, 32, 32):
          x = nn.relu(nn.Conv(width, (3, 3))(x))
        x = jnp.mean(x, axis=(1, 2))
      return nn.Dense(10)(x)

  class NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      if model_name == "mlp":
        self.layers = nnx.List(
          [nnx.Linear(a, b, rngs=rngs) for a, b in ((784, 1024), (1024, 1024), (1024, 10))]
        )
      else:
        convs = [nnx.Conv(a, b, (3, 3), rngs=rngs) for a, b in ((1, 16), (16, 32), (32, 32))]
        self.layers = nnx.List([*convs, nnx.Linear(32, 10, rngs=rngs)])

    def __call__(self, x):
      if model_name == "mlp":
        x = x.reshape(x.shape[0], -1)
      for layer in self.layers[:-1]:
        x = nnx.relu(layer(x))
      if model_name == "cnn":
        x = jnp.mean(x, axis=(1, 2))
      return self.layers[-1](x)

  rng = np.random.default_rng(0)
  host = {
    "x": rng.normal(size=(batch_size, 28, 28, 1)).astype(np.float32),
    "y": rng.integers(0, 10, size=batch_size).astype(np.int32),
  }
  mesh = jax.make_mesh((num_devices,), ("data",), axis_types=(AxisType.Auto,))
  batch = jax.device_put(host, NamedSharding(mesh, P("data")))
  net = LinenNet()
  params = jax.device_put(
    net.init(jax.random.key(0), host["x"][:1])["params"], NamedSharding(mesh, P())
  )

  def loss(p, b):
    logits = net.apply({"params": p}, b["x"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]))

  sgd = optax.sgd(0.1)
  simigrad = optax.chain(simigrad_jax.transform(), optax.sgd(0.1))

  def plain(p, s, b):
    value, grads = jax.value_and_grad(loss)(p, b)
    updates, s = sgd.update(grads, s, p)
    return optax.apply_updates(p, updates), s, value

  def two_pass(p, s, b):
    value, grads, halves = simigrad_jax.value_and_half_grads(loss)(p, b)
    updates, s = simigrad.update(grads, s, p, half_grads=halves)
    return optax.apply_updates(p, updates), s, value

  out: dict[str, tuple[Any, tuple]] = {}
  with jax.set_mesh(mesh):
    for name, fn, opt in (("plain", plain, sgd), ("two_pass", two_pass, simigrad)):
      args = (params, opt.init(params), batch)
      out[name] = (jax.jit(fn).lower(*args).compile(), args)
    if num_devices % 2 == 0:
      devices_opt = optax.chain(simigrad_jax.transform("data"), optax.sgd(0.1))
      args = (params, devices_opt.init(params), batch)
      step = jax.jit(simigrad_jax.device_halves_step(loss, devices_opt))
      out["device_halves"] = (step.lower(*args).compile(), args)

    # NNX: pure functions of the split states, so that they compile ahead like the others.
    with jax.set_mesh(mesh):
      model = NnxNet(nnx.Rngs(0))
    nnx_loss = lambda m, b: jnp.mean(
      optax.softmax_cross_entropy_with_integer_labels(m(b["x"]), b["y"])
    )
    for name, tx, halves in (("nnx_plain", sgd, False), ("nnx", simigrad, True)):
      optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      graphdef, state = nnx.split((model, optimizer))

      def nnx_step(state, b, graphdef=graphdef, halves=halves):
        m, o = nnx.merge(graphdef, state)
        if halves:
          value, grads, half = simigrad_jax.nnx_value_and_half_grads(nnx_loss)(m, b)
          o.update(m, grads, half_grads=half)
        else:
          value, grads = nnx.value_and_grad(nnx_loss)(m, b)
          o.update(m, grads)
        return nnx.state((m, o)), value

      args = (jax.device_put(state, NamedSharding(mesh, P())), batch)
      out[name] = (jax.jit(nnx_step).lower(*args).compile(), args)

  # pmap: each device's rows, its own leading axis.
  stacked = lambda tree: jax.tree.map(lambda a: np.stack([np.asarray(a)] * num_devices), tree)
  local = jax.tree.map(lambda a: a.reshape(num_devices, -1, *a.shape[1:]), host)
  pmap_opt = optax.chain(simigrad_jax.transform("batch"), optax.sgd(0.1))
  host_params = jax.device_get(params)

  def pmap_plain(p, s, b):
    value, grads = jax.value_and_grad(loss)(p, b)
    updates, s = sgd.update(jax.lax.pmean(grads, "batch"), s, p)
    return optax.apply_updates(p, updates), s, jax.lax.pmean(value, "batch")

  def pmap_simigrad(p, s, b):
    if num_devices % 2:
      value, grads, halves = simigrad_jax.value_and_half_grads(loss)(p, b)
      updates, s = pmap_opt.update(grads, s, p, half_grads=halves)
    else:
      value, grads = jax.value_and_grad(loss)(p, b)
      updates, s = pmap_opt.update(grads, s, p)
    return optax.apply_updates(p, updates), s, jax.lax.pmean(value, "batch")

  for name, fn, opt in (("pmap_plain", pmap_plain, sgd), ("pmap", pmap_simigrad, pmap_opt)):
    args = (stacked(host_params), stacked(opt.init(host_params)), local)
    args = tuple(jax.pmap(lambda *a: a)(*args))  # on the devices once, as a loop holds them
    out[name] = (jax.pmap(fn, axis_name="batch").lower(*args).compile(), args)
  return out


def _measure(steps: dict[str, tuple[Any, tuple]], rounds: int) -> dict[str, dict[str, Any]]:
  """Times every SimiGrad step paired with its plain step, in alternating order."""
  import jax  # pylint: disable=import-outside-toplevel

  for compiled, args in steps.values():
    jax.block_until_ready(compiled(*args))

  def run(name: str) -> float:
    compiled, args = steps[name]
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return time.perf_counter() - start

  rows: dict[str, dict[str, Any]] = {}
  for name, base in BASELINES.items():
    if name not in steps:
      continue
    ratios, own, plain = [], [], []
    for r in range(rounds):
      if r % 2 == 0:
        b, s = run(base), run(name)
      else:
        s, b = run(name), run(base)
      ratios.append(s / b)
      own.append(s)
      plain.append(b)
    temp = steps[name][0].memory_analysis().temp_size_in_bytes
    base_temp = steps[base][0].memory_analysis().temp_size_in_bytes
    rows[name] = {
      "baseline": base,
      "paired_time_ratio": statistics.median(ratios),
      "step_seconds": statistics.median(own),
      "plain_step_seconds": statistics.median(plain),
      "temp_bytes": int(temp),
      "plain_temp_bytes": int(base_temp),
      "temp_ratio": temp / base_temp if base_temp else None,
    }
  return rows


def _child(args: argparse.Namespace) -> None:
  common.configure_host_devices(args.child)
  results = {}
  for model in MODELS:
    steps = _steps(model, args.batch, args.child)
    results[model] = _measure(steps, args.rounds)
    print(f"{args.child} device(s), {model}: done", flush=True)
  with open(args.out, "w") as f:
    json.dump({"rows": results, "device": common.device_record()}, f)


def _format_table(results: dict[str, Any]) -> str:
  header = f"{'devices':>7}  {'model':<5} {'step':<14}{'vs':<11}{'time':>8}{'temp':>8}  goal"
  lines = [header, "-" * len(header)]
  for devices, by_model in results["devices"].items():
    for model, rows in by_model["rows"].items():
      for name, row in rows.items():
        temp = row["temp_ratio"]
        met = row["paired_time_ratio"] <= 1.10 and temp is not None and temp <= 1.25
        lines.append(
          f"{devices:>7}  {model:<5} {name:<14}{row['baseline']:<11}"
          f"{row['paired_time_ratio']:>7.2f}x{(temp or float('nan')):>7.2f}x  "
          f"{'met' if met else 'missed'}"
        )
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs each device count in its own process; prints the table and writes the JSON.

  Args:
    argv: command-line arguments (``sys.argv[1:]`` when None).

  Returns:
    ``{"devices": {"1" | "8": {"rows": {model: {step: {"paired_time_ratio",
    "temp_ratio", ...}}}, "device": {...}}}, "batch", "rounds", ...}``.
  """
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help=f"small: {QUICK}")
  parser.add_argument("--rounds", type=int, default=None, help="paired timed rounds per step")
  parser.add_argument("--batch", type=int, default=None, help="global batch size")
  parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
  common.add_out_flag(parser, "halves")
  args = parser.parse_args(argv)
  preset = QUICK if args.quick else FULL
  common.apply_preset(args, preset, ("rounds", "batch"))
  if args.child is not None:
    _child(args)
    return {}
  out = common.out_path(args.out, "halves", args.quick)
  results: dict[str, Any] = {"devices": {}, "batch": args.batch, "rounds": args.rounds}
  script = os.path.abspath(__file__)
  with tempfile.TemporaryDirectory() as folder:
    for count in preset["devices"]:
      part = os.path.join(folder, f"{count}.json")
      command = [sys.executable, script, "--child", str(count), "--out", part]
      command += ["--rounds", str(args.rounds), "--batch", str(args.batch)]
      env = {**os.environ, "PYTHONPATH": common.REPOSITORY_ROOT}
      subprocess.run(command, check=True, env=env)
      with open(part) as f:
        results["devices"][str(count)] = json.load(f)
  return common.report(results, _format_table(results), out)


if __name__ == "__main__":
  main(sys.argv[1:])
