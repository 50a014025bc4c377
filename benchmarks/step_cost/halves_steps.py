"""Benchmark: every SimiGrad step a user can write against its plain step, on 1 and 8 devices.

For an MLP (784-1024-1024-10) and a small CNN (three 3x3 ``nn.Conv`` layers
of 16, 32 and 32 channels on 28x28x1 images, a dense layer), at a global
batch of 256, softmax cross-entropy and ``optax.sgd``, on a mesh of one data
axis with ``Auto`` axes (and again on ``Explicit`` ones, below):

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

The 8 devices run a second time on ``Explicit`` mesh axes (``"8 Explicit"``),
the plain ``jax.jit`` steps only (``two_pass`` and ``device_halves`` against
``plain``), the CNN's forward pass under ``jax.sharding.auto_axes`` in all
three, as docs/own_step.md writes it.

Every step starts from the same parameters (the NNX model takes the linen
model's) and the same examples, dealt to the devices
(``simigrad_jax.data.deal_to_devices``) for the device splits, so that every
step compares the batch's even- and odd-numbered examples: the similarity
each measured in its first step is recorded and agrees between the steps.

Each device count runs in its own process (the simulated devices are fixed
when JAX starts). Per row: ``paired_time_ratio``, the median over rounds of
the SimiGrad step's time over its plain step's timed just before or after
(the order alternates every round), ``temp_ratio``, the ratio of
``compiled.memory_analysis().temp_size_in_bytes``, and ``similarity``.
The JSON is rewritten as each model of each device count finishes, so a run
stopped by a time-out keeps every part that finished.

Usage::

  python benchmarks/step_cost/halves_steps.py           # benchmarks/results/halves.json
  python benchmarks/step_cost/halves_steps.py --quick   # tiny models: halves_quick.json
  JAX_PLATFORMS=cuda python benchmarks/step_cost/halves_steps.py --devices 1 --out halves_gpu.json  # a GPU
  python benchmarks/step_cost/halves_steps.py --markdown benchmarks/results/halves.json  # docs/own_step.md's table
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import (
  Callable,  # noqa: E402
  Sequence,  # noqa: E402
)
from typing import (
  Any,  # noqa: E402
  NamedTuple,  # noqa: E402
)

from benchmarks import common  # noqa: E402
from benchmarks.step_cost import timing  # noqa: E402

FULL = {
  "batch": 256,
  "rounds": 15,
  "devices": (1, 8),
  "widths": (1024, 1024),
  "channels": (16, 32, 32),
  "image": 28,
}
QUICK = {
  "batch": 32,
  "rounds": 2,
  "devices": (1, 8),
  "widths": (32, 32),
  "channels": (4, 8),
  "image": 8,
}
MODELS = ("mlp", "cnn")
# Each SimiGrad step, by name, and the plain step it is compared with.
BASELINES = {
  "two_pass": "plain",
  "device_halves": "plain",
  "nnx": "nnx_plain",
  "pmap": "pmap_plain",
}
# The docs' column of each SimiGrad step (docs/own_step.md's table: markdown_table).
COLUMNS = {
  "two_pass": "`value_and_half_grads`",
  "nnx": "`nnx_value_and_half_grads`",
  "device_halves": "`device_halves_step`",
  "pmap": 'pmap, `transform("batch")`',
}
MODEL_NAMES = {"mlp": "MLP", "cnn": "CNN"}
# The key of the run on Explicit mesh axes: "8 Explicit" beside "1" and "8".
EXPLICIT = "Explicit"


class _Step(NamedTuple):
  """A compiled step, its arguments, and how to read its similarity from its outputs."""

  compiled: Any
  args: tuple
  similarity: Callable[[Any], float] | None  # None: a plain step, which measures none.


def _steps(
  model_name: str, batch_size: int, num_devices: int, sizes: dict, explicit: bool = False
) -> dict[str, _Step]:
  """name -> :class:`_Step`, every step of one model on this process's devices.

  Every step starts from the same parameters (the NNX model takes the linen
  model's) and the same examples; the device splits (``device_halves`` and
  ``pmap`` on several devices) take them dealt to the devices
  (``deal_to_devices``), so that every step compares the batch's even- and
  odd-numbered examples and measures the same similarity. With ``explicit``
  the mesh's axis is ``Explicit`` (``jax.make_mesh``'s default) and only the
  plain ``jax.jit`` steps run (``plain``, ``two_pass``, ``device_halves``);
  the CNN's forward pass then runs under ``jax.sharding.auto_axes``, as
  docs/own_step.md writes it (JAX refuses a convolution on Explicit axes).
  """
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

  widths, channels, image = tuple(sizes["widths"]), tuple(sizes["channels"]), sizes["image"]

  class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
      if model_name == "mlp":
        x = x.reshape(x.shape[0], -1)
        for width in widths:
          x = nn.relu(nn.Dense(width)(x))
      else:
        for width in channels:
          x = nn.relu(nn.Conv(width, (3, 3))(x))
        x = jnp.mean(x, axis=(1, 2))
      return nn.Dense(10)(x)

  class NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      if model_name == "mlp":
        ins = (image * image, *widths)
        layers = [nnx.Linear(a, b, rngs=rngs) for a, b in zip(ins, (*widths, 10), strict=True)]
      else:
        ins = (1, *channels)
        layers = [nnx.Conv(a, b, (3, 3), rngs=rngs) for a, b in zip(ins, channels, strict=False)]
        layers.append(nnx.Linear(channels[-1], 10, rngs=rngs))
      self.layers = nnx.List(layers)

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
    "x": rng.normal(size=(batch_size, image, image, 1)).astype(np.float32),
    "y": rng.integers(0, 10, size=batch_size).astype(np.int32),
  }
  dealt = simigrad_jax.data.deal_to_devices(host, num_devices)
  axis_type = AxisType.Explicit if explicit else AxisType.Auto
  mesh = jax.make_mesh((num_devices,), ("data",), axis_types=(axis_type,))
  rows = NamedSharding(mesh, P("data"))
  batch = jax.device_put(host, rows)
  net = LinenNet()
  host_params = net.init(jax.random.key(0), host["x"][:1])["params"]
  params = jax.device_put(host_params, NamedSharding(mesh, P()))

  def apply(p, x):
    return net.apply({"params": p}, x)

  if explicit and model_name == "cnn":
    apply = jax.sharding.auto_axes(apply, out_sharding=P("data"))

  def loss(p, b):
    logits = apply(p, b["x"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]))

  def local_loss(p, b):  # one device's rows, the data axis manual: no auto_axes there
    logits = net.apply({"params": p}, b["x"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]))

  sgd = optax.sgd(0.1)
  simigrad = optax.chain(simigrad_jax.transform(), optax.sgd(0.1))
  of_state = lambda outputs: simigrad_jax.similarity(outputs[1])

  def plain(p, s, b):
    value, grads = jax.value_and_grad(loss)(p, b)
    updates, s = sgd.update(grads, s, p)
    return optax.apply_updates(p, updates), s, value

  def two_pass(p, s, b):
    value, grads, halves = simigrad_jax.value_and_half_grads(loss)(p, b)
    updates, s = simigrad.update(grads, s, p, half_grads=halves)
    return optax.apply_updates(p, updates), s, value

  out: dict[str, _Step] = {}
  with jax.set_mesh(mesh):
    for name, fn, opt, read in (
      ("plain", plain, sgd, None),
      ("two_pass", two_pass, simigrad, of_state),
    ):
      args = (params, opt.init(params), batch)
      out[name] = _Step(jax.jit(fn).lower(*args).compile(), args, read)
    if num_devices % 2 == 0:
      devices_opt = optax.chain(simigrad_jax.transform("data"), optax.sgd(0.1))
      args = (params, devices_opt.init(params), jax.device_put(dealt, rows))
      step = jax.jit(simigrad_jax.device_halves_step(local_loss, devices_opt))
      out["device_halves"] = _Step(step.lower(*args).compile(), args, of_state)
    if explicit:
      return out

    # NNX: pure functions of the split states, so that they compile ahead like the others.
    model = NnxNet(nnx.Rngs(0))
    for layer, name in zip(model.layers, sorted(host_params), strict=True):
      layer.kernel.value = jnp.asarray(host_params[name]["kernel"])
      layer.bias.value = jnp.asarray(host_params[name]["bias"])
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

      def of_nnx(outputs, graphdef=graphdef):
        return simigrad_jax.similarity(nnx.merge(graphdef, outputs[0])[1].opt_state)

      args = (jax.device_put(state, NamedSharding(mesh, P())), batch)
      out[name] = _Step(jax.jit(nnx_step).lower(*args).compile(), args, of_nnx if halves else None)

  # pmap: each device's rows (on several devices, the dealt batch's), its own leading axis.
  stacked = lambda tree: jax.tree.map(lambda a: np.stack([np.asarray(a)] * num_devices), tree)
  local = jax.tree.map(lambda a: a.reshape(num_devices, -1, *a.shape[1:]), dealt)
  pmap_opt = optax.chain(simigrad_jax.transform("batch"), optax.sgd(0.1))

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

  for name, fn, opt, read in (
    ("pmap_plain", pmap_plain, sgd, None),
    ("pmap", pmap_simigrad, pmap_opt, of_state),
  ):
    args = (stacked(host_params), stacked(opt.init(host_params)), local)
    args = tuple(jax.pmap(lambda *a: a)(*args))  # on the devices once, as a loop holds them
    out[name] = _Step(jax.pmap(fn, axis_name="batch").lower(*args).compile(), args, read)
  return out


def _measure(steps: dict[str, _Step], rounds: int) -> dict[str, dict[str, Any]]:
  """Times every SimiGrad step paired with its plain step, in alternating order."""
  import jax  # pylint: disable=import-outside-toplevel

  similarity = {}
  for name, step in steps.items():
    outputs = jax.block_until_ready(step.compiled(*step.args))
    if step.similarity is not None:
      similarity[name] = float(step.similarity(outputs))

  def run(name: str) -> float:
    compiled, args, _ = steps[name]
    return timing.run_seconds(compiled, args)

  rows: dict[str, dict[str, Any]] = {}
  for name, base in BASELINES.items():
    if name not in steps:
      continue
    rows[name] = {
      "baseline": base,
      **timing.against_plain(
        functools.partial(run, name),
        functools.partial(run, base),
        rounds,
        temp=int(steps[name].compiled.memory_analysis().temp_size_in_bytes),
        plain_temp=int(steps[base].compiled.memory_analysis().temp_size_in_bytes),
      ),
      "similarity": similarity[name],
    }
  return rows


def _child(args: argparse.Namespace) -> None:
  """Measures every model on this process's devices, saving its part of ``args.out`` (under
  ``args.part``) as each model finishes."""
  common.configure_host_devices(args.child)
  sizes = {key: getattr(args, key) for key in ("widths", "channels", "image")}
  part: dict[str, Any] = {"rows": {}, "device": common.device_record()}
  for model in args.models:
    steps = _steps(model, args.batch, args.child, sizes, args.explicit)
    part["rows"][model] = _measure(steps, args.rounds)
    save_part(args.out, args.part, part)
    print(f"{args.child} device(s), {model}: done", flush=True)


def save_part(out: str, key: str, part: dict[str, Any]) -> None:
  """Writes ``part`` as ``results["devices"][key]`` of the JSON in ``out``, whole or not at all.

  The JSON is rewritten as each model of each device count finishes, so a
  run stopped by a time-out keeps every part that finished before it.
  """
  with open(out, encoding="utf-8") as f:
    results = json.load(f)
  results["devices"][key] = part
  write_json(out, results)


def write_json(out: str, results: dict[str, Any]) -> None:
  """Writes ``results`` to ``out`` through a file beside it, so a reader never sees half."""
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  partial = f"{out}.partial"
  with open(partial, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=2)
  os.replace(partial, out)


def met_goal(row: dict[str, Any]) -> bool:
  """Whether a row is within the goal: at most 1.10x the time and 1.25x the temp memory."""
  temp = row["temp_ratio"]
  return row["paired_time_ratio"] <= 1.10 and temp is not None and temp <= 1.25


def _format_table(results: dict[str, Any]) -> str:
  header = (
    f"{'devices':>7}  {'model':<5} {'step':<14}{'vs':<11}{'time':>8}{'temp':>8}"
    f"{'similarity':>12}  goal"
  )
  lines = [header, "-" * len(header)]
  for devices, by_model in results["devices"].items():
    for model, rows in by_model["rows"].items():
      for name, row in rows.items():
        lines.append(
          f"{devices:>7}  {model:<5} {name:<14}{row['baseline']:<11}"
          f"{row['paired_time_ratio']:>7.2f}x{(row['temp_ratio'] or float('nan')):>7.2f}x"
          f"{row.get('similarity', float('nan')):>12.6f}  {'met' if met_goal(row) else 'missed'}"
        )
  return "\n".join(lines)


def markdown_table(results: dict[str, Any]) -> str:
  """docs/own_step.md's table: per device count and model, each step's time and temp / plain.

  Args:
    results: the JSON :func:`main` writes.

  Returns:
    The markdown table, one row per device count and model, one column per
    SimiGrad step (``-`` where a step does not run: the device split on one
    device), each cell ``time / plain, temp memory / plain``.
  """
  lines = [
    "| devices | model | " + " | ".join(COLUMNS.values()) + " |",
    "|---|---|" + "---|" * len(COLUMNS),
  ]
  for devices, by_model in results["devices"].items():
    for model, rows in by_model["rows"].items():
      cells = [
        f"{rows[name]['paired_time_ratio']:.2f}x, {rows[name]['temp_ratio']:.2f}x"
        if name in rows
        else "-"
        for name in COLUMNS
      ]
      label = devices.replace(f" {EXPLICIT}", f", `{EXPLICIT}` axes")
      lines.append(f"| {label} | {MODEL_NAMES[model]} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _sizes(text: str) -> tuple[int, ...]:
  """A comma-separated list of positive layer sizes (``--widths``, ``--channels``)."""
  try:
    sizes = tuple(int(part) for part in text.split(","))
  except ValueError:
    sizes = ()
  if not sizes or min(sizes) <= 0:
    raise argparse.ArgumentTypeError(
      f"expected positive integers separated by commas, e.g. 32,32; got {text!r}"
    )
  return sizes


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help=f"tiny models, for tests: {QUICK}")
  parser.add_argument("--rounds", type=int, default=None, help="paired timed rounds per step")
  parser.add_argument("--batch", type=int, default=None, help="global batch size")
  parser.add_argument("--widths", type=_sizes, default=None, help="the MLP's hidden widths")
  parser.add_argument("--channels", type=_sizes, default=None, help="the CNN's conv channels")
  parser.add_argument(
    "--models",
    type=lambda text: tuple(text.split(",")),
    default=MODELS,
    help=f"which models, comma-separated (default {','.join(MODELS)})",
  )
  parser.add_argument("--image", type=int, default=None, help="image side (pixels)")
  parser.add_argument(
    "--devices",
    type=_sizes,
    default=None,
    help="device counts, each in its own process (default 1,8; on a GPU host with "
    "JAX_PLATFORMS=cuda, at most its GPUs)",
  )
  parser.add_argument(
    "--markdown", default=None, help="print the docs table of this JSON, and stop"
  )
  parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--explicit", action="store_true", help=argparse.SUPPRESS)
  common.add_out_flag(parser, "halves")
  args = parser.parse_args(argv)
  preset = QUICK if args.quick else FULL
  common.apply_preset(args, preset, ("rounds", "batch", "widths", "channels", "image", "devices"))
  unknown = sorted(set(args.models) - set(MODELS))
  if unknown or not args.models:
    parser.error(f"--models {','.join(args.models)}: expected some of {', '.join(MODELS)}")
  if args.child is None:
    args.out = common.out_path(args.out, "halves", args.quick)
  if args.batch <= 0 or args.batch % (2 * max(args.devices)):
    parser.error(
      f"--batch {args.batch}: every device needs an even number of rows, so the batch must be "
      f"a positive multiple of {2 * max(args.devices)}"
    )
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs each device count in its own process; prints the table and writes the JSON.

  Args:
    argv: command-line arguments (``sys.argv[1:]`` when None).

  Returns:
    ``{"devices": {"1" | "8": {"rows": {model: {step: {"paired_time_ratio",
    "temp_ratio", "similarity", ...}}}, "device": {...}}}, "batch", "rounds",
    "sizes"}``, or ``{}`` with ``--markdown``.
  """
  args = _parse_args(argv)
  if args.markdown:
    with open(args.markdown, encoding="utf-8") as f:
      print(markdown_table(json.load(f)))
    return {}
  if args.child is not None:
    _child(args)
    return {}
  sizes = {"widths": list(args.widths), "channels": list(args.channels), "image": args.image}
  results: dict[str, Any] = {
    "devices": {},
    "batch": args.batch,
    "rounds": args.rounds,
    "sizes": sizes,
  }
  script = os.path.abspath(__file__)
  # Each device count on Auto axes, then the largest on Explicit ones (jax.make_mesh's default).
  runs = [(count, False) for count in args.devices] + [(max(args.devices), True)]
  with tempfile.TemporaryDirectory() as folder:
    # The children save into the JSON as each model finishes (into a file of the folder's
    # with no --out).
    out = args.out or os.path.join(folder, "halves.json")
    write_json(out, results)
    for count, explicit in runs:
      key = f"{count} {EXPLICIT}" if explicit else str(count)
      command = [sys.executable, script, "--child", str(count), f"--out={out}", f"--part={key}"]
      command += ["--explicit"] if explicit else []
      command += ["--rounds", str(args.rounds), "--batch", str(args.batch)]
      command += ["--image", str(args.image), "--models", ",".join(args.models)]
      command += ["--widths", ",".join(map(str, args.widths))]
      command += ["--channels", ",".join(map(str, args.channels))]
      subprocess.run(command, check=True, env=common.child_environment(own_device_count=True))
    with open(out, encoding="utf-8") as f:
      results = json.load(f)
  return common.report(results, _format_table(results), args.out)


if __name__ == "__main__":
  main(sys.argv[1:])
