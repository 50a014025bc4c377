"""Benchmark: an own adaptive loop's step, each way of writing it, against the plain step.

An MLP (784-512-512-10 by default, softmax cross-entropy, ``optax.sgd``) on
random data, on one device (a process of its own), at a global batch of 256.
Every step takes its batch as NumPy rows, as a loop hands them over, and waits
for the step's outputs (the SimiGrad steps read the similarity on the host, as
the controller does). Each way, timed in rounds paired with the plain step at
the same batch size (``jax.value_and_grad`` and the update in one
``jax.jit`` program), the order alternating every round:

* ``adaptive_step``: :class:`simigrad_jax.AdaptiveStep` (``max_batch_size``
  512, 4 shapes per octave) at 256, one of its compiled shapes
  (docs/adaptive_loop.md's loop);
* ``adaptive_program``: the program that step runs (``step.program``), called
  alone with its inputs already on the device (the rows laid out and placed
  once): the step's cost without the host's share (laying out the rows,
  handing them over, the plan);
* ``adaptive_step_padded``: the same at 232, padded to the shape of 256 (the
  cost of a batch between two shapes, against the plain step at 232);
* ``adaptive_step_moving``: the same over a batch that moves by about 10% a
  step around 256 (6 sizes in turn), against a plain step compiled for each;
* ``two_pass``: a hand-written ``jax.jit`` step of
  :func:`simigrad_jax.value_and_half_grads` and ``transform()`` at 256 (no
  adaptive batch: the floor of a SimiGrad step);
* ``recipe_tenth``: the recipe the page gave before ``AdaptiveStep``: one
  compiled micro-step of a tenth of the batch (32 rows), accumulated on the
  host over 8 micro-steps, and the update;
* ``recipe_256``: the same recipe with a micro-step of 256 rows.

Per row: ``paired_time_ratio`` (the median over rounds of the way's time over
the plain step's), the seconds of each, and, for the ways that run
``AdaptiveStep``, the programs it compiled.

Usage::

  python benchmarks/trainer_overhead/adaptive_loop.py          # benchmarks/results/adaptive_loop.json
  python benchmarks/trainer_overhead/adaptive_loop.py --quick  # a tiny MLP: adaptive_loop_quick.json
  python benchmarks/trainer_overhead/adaptive_loop.py --markdown benchmarks/results/adaptive_loop.json
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks import common  # noqa: E402

FULL = {"batch": 256, "rounds": 15, "steps": 4, "widths": (512, 512), "features": 784}
QUICK = {"batch": 32, "rounds": 2, "steps": 1, "widths": (16,), "features": 8}
CLASSES = 10
LEARNING_RATE = 0.01
# The moving batch's sizes, as fractions of --batch: moves of about 10%, as SimiGrad's rule.
MOVING = (1.0, 1.1, 0.99, 0.9, 0.99, 1.09)
# The padded batch, as a fraction of --batch: between two of AdaptiveStep's default shapes.
PADDED = 232 / 256
WAYS = (
  "adaptive_step",
  "adaptive_program",
  "adaptive_step_padded",
  "adaptive_step_moving",
  "two_pass",
  "recipe_tenth",
  "recipe_256",
)
# The goal of docs/adaptive_loop.md: AdaptiveStep at most 1.3x the plain step at the batch.
GOAL = 1.3
DESCRIPTIONS = {
  "adaptive_step": "`AdaptiveStep`, a batch of one compiled shape",
  "adaptive_program": "its compiled program alone, the inputs on the device beforehand",
  "adaptive_step_padded": "`AdaptiveStep`, a batch padded to the next shape",
  "adaptive_step_moving": "`AdaptiveStep`, the batch moving by ~10% a step",
  "two_pass": "a `jax.jit` step of `value_and_half_grads` (no adaptive batch)",
  "recipe_tenth": "the former recipe: micro-steps of a tenth, added on the host",
  "recipe_256": "the former recipe with one micro-step of the whole batch",
}


def _sizes(batch: int) -> dict[str, list[int]]:
  """Each way's batch sizes, in turn (even, at least 2)."""
  even = lambda fraction: max(2, 2 * round(batch * fraction / 2))
  return {
    "adaptive_step": [batch],
    "adaptive_program": [batch],
    "adaptive_step_padded": [even(PADDED)],
    "adaptive_step_moving": [even(f) for f in MOVING],
    "two_pass": [batch],
    "recipe_tenth": [batch],
    "recipe_256": [batch],
  }


def mlp(features: int, widths: Sequence[int], rows: int) -> tuple[Any, Callable, Callable]:
  """The benchmark's MLP and data: ``(params, row_losses, batch_of)``.

  ``row_losses(params, batch)`` is one softmax cross-entropy per row, and
  ``batch_of(size)`` the first ``size`` of ``rows`` random examples, as NumPy
  rows. Imports JAX: call it after the devices are set up.
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(0)
  sizes = (features, *widths, CLASSES)
  params = [
    {
      "w": jnp.asarray(rng.normal(size=(a, b)).astype(np.float32) / np.sqrt(a)),
      "b": jnp.zeros(b, jnp.float32),
    }
    for a, b in zip(sizes, sizes[1:])
  ]
  x = rng.normal(size=(rows, features)).astype(np.float32)
  y = rng.integers(0, CLASSES, size=rows).astype(np.int32)

  def row_losses(params, batch):
    h = batch["x"]
    for layer in params[:-1]:
      h = jax.nn.relu(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])

  return params, row_losses, lambda size: {"x": x[:size], "y": y[:size]}


def plain_step(
  params: Any, row_losses: Callable, batch_of: Callable, mesh: Any = None
) -> Callable[[int], None]:
  """The plain step as ``run(batch_size)``: ``jax.grad`` of the mean loss and ``optax.sgd``'s
  update in one ``jax.jit`` program, on NumPy rows, waited for; with a ``mesh``, data-parallel
  over its one axis (the rows placed in blocks over it, the parameters replicated)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  sgd = optax.sgd(LEARNING_RATE)
  if mesh is not None:
    params = jax.device_put(params, NamedSharding(mesh, P()))
    rows_of = batch_of
    batch_of = lambda size: jax.device_put(rows_of(size), NamedSharding(mesh, P(*mesh.axis_names)))
  step = plain_program(row_losses)
  state = [jax.tree.map(jnp.copy, params), sgd.init(params)]

  def run(size: int) -> None:
    state[:] = jax.block_until_ready(step(*state, batch_of(size)))

  return run


def plain_program(row_losses: Callable) -> Callable:
  """The plain step's jitted function, ``step(params, opt_state, batch) -> (params,
  opt_state)``: ``jax.grad`` of the mean loss and ``optax.sgd``'s update."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  sgd = optax.sgd(LEARNING_RATE)

  @jax.jit
  def step(params, opt_state, batch):
    grads = jax.grad(lambda p: jnp.mean(row_losses(p, batch)))(params)
    updates, opt_state = sgd.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step


def paired(
  way: Callable[[int], None],
  plain: Callable[[int], None],
  sizes: list[int],
  rounds: int,
  steps: int,
) -> dict[str, Any]:
  """``way`` timed against ``plain`` over ``sizes`` in turn, ``steps`` times a round, the order
  alternating every round (after one untimed round of each, which compiles what they visit).

  Each round is timed twice: by the wall clock, and by the CPU seconds this
  process spent (every thread's: on XLA:CPU the devices' work too), which
  other jobs on the machine's cores do not inflate.

  Returns:
    ``{"batch_sizes", "paired_time_ratio", "ratio_quartiles", "paired_cpu_ratio",
    "cpu_ratio_quartiles", "step_seconds", "plain_step_seconds"}``: the median over rounds
    of the wall-clock ratio and of the CPU-seconds ratio, the first and third quartiles of
    each, and the median of each one's wall-clock seconds per step.
  """

  def timed(run: Callable[[int], None]) -> tuple[float, float]:
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
      for size in sizes:
        run(size)
    return time.perf_counter() - start, time.process_time() - cpu

  timed(way)
  timed(plain)
  ratios, cpu_ratios, own, base = [], [], [], []
  for r in range(rounds):
    if r % 2 == 0:
      b, s = timed(plain), timed(way)
    else:
      s, b = timed(way), timed(plain)
    ratios.append(s[0] / b[0])
    cpu_ratios.append(s[1] / b[1])
    own.append(s[0] / (steps * len(sizes)))
    base.append(b[0] / (steps * len(sizes)))
  return {
    "batch_sizes": list(sizes),
    "paired_time_ratio": statistics.median(ratios),
    "ratio_quartiles": _quartiles(ratios),
    "paired_cpu_ratio": statistics.median(cpu_ratios),
    "cpu_ratio_quartiles": _quartiles(cpu_ratios),
    "step_seconds": statistics.median(own),
    "plain_step_seconds": statistics.median(base),
  }


def _quartiles(values: list[float]) -> list[float]:
  """The first and third quartiles of ``values`` (the one value twice, for one)."""
  if len(values) < 2:
    return [values[0], values[0]]
  quartiles = statistics.quantiles(values, n=4)
  return [quartiles[0], quartiles[2]]


def _ways(args: argparse.Namespace) -> tuple[dict[str, Callable[[int], Any]], Callable, dict]:
  """Every way's step and the plain step, as ``run(batch_size)`` that trains one step and waits."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  import simigrad_jax  # pylint: disable=import-outside-toplevel

  largest = max(max(sizes) for sizes in _sizes(args.batch).values())
  params0, row_losses, rows = mlp(args.features, args.widths, largest)
  x, y = rows(largest)["x"], rows(largest)["y"]
  mean_loss = lambda params, batch: jnp.mean(row_losses(params, batch))
  sgd = optax.sgd(LEARNING_RATE)
  with_lr = lambda first: optax.chain(first, sgd, simigrad_jax.scale_by_lr_factor())
  copy = lambda tree: jax.tree.map(jnp.copy, tree)
  plain = plain_step(params0, row_losses, rows)

  opt = with_lr(simigrad_jax.transform("batch"))
  # Twice the batch: its shapes are 2 * batch / 2^(i / 4), the batch one of them exactly.
  adaptive = simigrad_jax.AdaptiveStep(row_losses, opt, max_batch_size=2 * args.batch)
  adaptive_state = list(adaptive.init(params0))

  def adaptive_step(size: int) -> None:
    params, opt_state, _ = adaptive(*adaptive_state, rows(size))
    adaptive_state[:] = params, opt_state
    simigrad_jax.similarity(opt_state)  # the controller reads it: the host waits for the step

  adaptive_step(args.batch)  # compiles the program of the batch's shape
  adaptive_program = _program_alone(adaptive, params0, rows(args.batch))
  local = with_lr(simigrad_jax.transform())

  @jax.jit
  def two_pass_step(params, opt_state, batch):
    _, grads, halves = simigrad_jax.value_and_half_grads(mean_loss)(params, batch)
    updates, opt_state = local.update(grads, opt_state, params, half_grads=halves)
    return optax.apply_updates(params, updates), opt_state

  two_pass_state = [copy(params0), local.init(params0)]

  def two_pass(size: int) -> None:
    two_pass_state[:] = two_pass_step(*two_pass_state, rows(size))
    simigrad_jax.similarity(two_pass_state[1])

  @jax.jit
  def micro_step(params, batch):
    _, grads, halves = simigrad_jax.value_and_half_grads(mean_loss)(params, batch)
    return grads, halves.first, halves.second

  add = jax.jit(lambda sums, more: jax.tree.map(jnp.add, sums, more))

  @jax.jit
  def apply_step(params, opt_state, sums, micro_steps):
    grads, first, second = jax.tree.map(lambda s: s / micro_steps, sums)
    halves = simigrad_jax.HalfGrads(first, second)
    updates, opt_state = local.update(grads, opt_state, params, half_grads=halves)
    return optax.apply_updates(params, updates), opt_state

  def recipe(micro_rows: int) -> Callable[[int], None]:
    state = [copy(params0), local.init(params0)]

    def run(size: int) -> None:
      sums = None
      for start in range(0, size, micro_rows):
        grads = micro_step(
          state[0], {"x": x[start : start + micro_rows], "y": y[start : start + micro_rows]}
        )
        sums = grads if sums is None else add(sums, grads)
      state[:] = apply_step(*state, sums, size // micro_rows)
      simigrad_jax.similarity(state[1])

    return run

  tenth = max(2, 2 * round(args.batch / 16))  # 32 rows at 256: 8 micro-steps
  ways = {
    "adaptive_step": adaptive_step,
    "adaptive_program": adaptive_program,
    "adaptive_step_padded": adaptive_step,
    "adaptive_step_moving": adaptive_step,
    "two_pass": two_pass,
    "recipe_tenth": recipe(tenth),
    "recipe_256": recipe(args.batch),
  }
  return ways, plain, {"adaptive": adaptive, "tenth": tenth}


def _program_alone(adaptive: Any, params: Any, batch: dict[str, Any]) -> Callable[[int], None]:
  """``adaptive``'s compiled program of ``batch``'s size as ``run(batch_size)``, called with
  inputs placed once beforehand (the rows in the step's order, every row of weight 1: a batch
  of one of its shapes), reading the similarity as the step's way does."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  import simigrad_jax  # pylint: disable=import-outside-toplevel
  from simigrad_jax.compile.step_functions import Program  # pylint: disable=import-outside-toplevel
  from simigrad_jax.ingraph import train_step  # pylint: disable=import-outside-toplevel
  from simigrad_jax.shapes.layout import StepLayout  # pylint: disable=import-outside-toplevel

  size = len(next(iter(batch.values())))
  plan = adaptive.plan(size)
  assert plan.padded_examples == 0 and plan.accumulation_steps == 1, plan
  program = adaptive.program((Program.FUSED, plan.micro_batch_size))
  mesh = jax.make_mesh((jax.device_count(),), ("batch",), (jax.sharding.AxisType.Auto,))
  sharded, replicated = NamedSharding(mesh, P("batch")), NamedSharding(mesh, P())
  take = plan.example_layout().reshape(-1)
  rows = jax.device_put({name: np.take(a, take, axis=0) for name, a in batch.items()}, sharded)
  weights = jax.device_put(np.ones(len(take), np.float32), sharded)
  scalars = jax.device_put(
    train_step.StepScalars(
      np.float32(size), np.float32(1.0), np.float32(StepLayout.first_half_weight(size))
    ),
    replicated,
  )
  counters = jax.device_put(np.zeros(2, np.int32), replicated)
  state = list(adaptive.init(params))

  def run(batch_size: int) -> None:
    assert batch_size == size, (batch_size, size)
    params, opt_state, _, _ = program(*state, (), rows, weights, scalars, counters)
    state[:] = params, opt_state
    simigrad_jax.similarity(opt_state)

  return run


def _measure(args: argparse.Namespace) -> dict[str, Any]:
  """Every way, paired with the plain step at the same sizes, in alternating order."""
  ways, plain, extra = _ways(args)
  sizes = _sizes(args.batch)
  rows: dict[str, dict[str, Any]] = {}
  for name in WAYS:
    rows[name] = paired(ways[name], plain, sizes[name], args.rounds, args.steps)
    print(f"{name}: {rows[name]['paired_time_ratio']:.2f}x", flush=True)
  adaptive = extra["adaptive"]
  return {
    "rows": rows,
    "adaptive_step": {
      "compiled": [list(key) for key in adaptive.compiled],
      "batch_shapes": list(adaptive.batch_shapes),
      "halves": adaptive.halves,
    },
    "recipe_tenth_rows": extra["tenth"],
    "device": common.device_record(),
  }


def _child(args: argparse.Namespace) -> None:
  common.configure_host_devices(1)
  results = _measure(args)
  with open(args.out, "w") as f:
    json.dump(results, f)


def met_goal(name: str, row: dict[str, Any]) -> bool | None:
  """Whether the ``AdaptiveStep`` row is within :data:`GOAL` by the wall clock and by CPU
  seconds (None: another row)."""
  if name != "adaptive_step":
    return None
  return max(row["paired_time_ratio"], row["paired_cpu_ratio"]) <= GOAL


def _format_table(results: dict[str, Any]) -> str:
  header = f"{'way':<22}{'sizes':<22}{'vs plain':>9}{'CPU':>7}{'step ms':>9}{'plain ms':>9}  goal"
  lines = [header, "-" * len(header)]
  for name, row in results["rows"].items():
    goal = met_goal(name, row)
    sizes = ",".join(map(str, row["batch_sizes"]))
    lines.append(
      f"{name:<22}{sizes:<22}{row['paired_time_ratio']:>8.2f}x{row['paired_cpu_ratio']:>6.2f}x"
      f"{row['step_seconds'] * 1e3:>9.2f}"
      f"{row['plain_step_seconds'] * 1e3:>9.2f}  "
      + ("" if goal is None else ("met" if goal else "missed"))
    )
  return "\n".join(lines)


def ratio_cell(row: dict[str, Any], clock: str = "time") -> str:
  """A table cell: a row's median ratio by ``clock`` (``"time"``, the wall clock, or ``"cpu"``)
  and, in brackets, its quartiles over rounds."""
  prefix = "paired_time" if clock == "time" else "paired_cpu"
  low, high = row["ratio_quartiles" if clock == "time" else "cpu_ratio_quartiles"]
  return f"{row[prefix + '_ratio']:.2f}x ({low:.2f}-{high:.2f})"


def markdown_table(results: dict[str, Any]) -> str:
  """docs/adaptive_loop.md's table: each way, its batch sizes and its time over the plain step's."""
  lines = [
    "| way | batch sizes | time / plain step | CPU seconds / plain step's |",
    "|---|---|---|---|",
  ]
  for name, row in results["rows"].items():
    sizes = ", ".join(map(str, row["batch_sizes"]))
    lines.append(
      f"| {DESCRIPTIONS[name]} | {sizes} | {ratio_cell(row)} | {ratio_cell(row, 'cpu')} |"
    )
  return "\n".join(lines)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help=f"a tiny MLP, for tests: {QUICK}")
  parser.add_argument("--rounds", type=int, default=None, help="paired timed rounds per way")
  parser.add_argument("--steps", type=int, default=None, help="steps per timed round")
  parser.add_argument("--batch", type=int, default=None, help="the global batch size")
  parser.add_argument("--widths", type=common.integers, default=None, help="hidden widths")
  parser.add_argument("--features", type=int, default=None, help="input features")
  parser.add_argument(
    "--markdown", default=None, help="print the docs table of this JSON, and stop"
  )
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  common.add_out_flag(parser, "adaptive_loop")
  args = parser.parse_args(argv)
  common.apply_preset(
    args, QUICK if args.quick else FULL, ("rounds", "steps", "batch", "widths", "features")
  )
  for name in ("rounds", "steps", "batch", "features"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} {getattr(args, name)}: expected an integer >= 1")
  if args.batch < 16 or args.batch % 16:
    parser.error(
      f"--batch {args.batch}: expected a multiple of 16 (a tenth's micro-steps divide it)"
    )
  if not args.widths or min(args.widths) < 1:
    parser.error(f"--widths {args.widths}: expected positive widths, e.g. 512,512")
  if not args.child:
    args.out = common.out_path(args.out, "adaptive_loop", args.quick)
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the ways in a process of one device; prints the table and writes the JSON.

  Args:
    argv: command-line arguments (``sys.argv[1:]`` when None).

  Returns:
    ``{"rows": {way: {"batch_sizes", "paired_time_ratio", "step_seconds",
    "plain_step_seconds"}}, "adaptive_step": {"compiled", ...}, "device",
    "settings"}``, or ``{}`` with ``--markdown`` or in the child process.
  """
  args = _parse_args(argv)
  if args.markdown:
    with open(args.markdown, encoding="utf-8") as f:
      print(markdown_table(json.load(f)))
    return {}
  if args.child:
    _child(args)
    return {}
  settings = {
    "batch": args.batch,
    "rounds": args.rounds,
    "steps": args.steps,
    "widths": list(args.widths),
    "features": args.features,
  }
  with tempfile.TemporaryDirectory() as folder:
    part = os.path.join(folder, "one_device.json")
    command = [sys.executable, os.path.abspath(__file__), "--child", f"--out={part}"]
    for name, value in settings.items():
      command += [f"--{name}", ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    subprocess.run(command, check=True, env=common.child_environment(own_device_count=True))
    with open(part) as f:
      results = {**json.load(f), "settings": settings}
  return common.report(results, _format_table(results), args.out)


if __name__ == "__main__":
  main(sys.argv[1:])
