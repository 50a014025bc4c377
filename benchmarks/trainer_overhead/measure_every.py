"""Benchmark: a SimiGrad step that measures every k-th step, against the plain step.

:class:`simigrad_jax.AdaptiveStep` with ``measure_every=k`` (k = 1, 2, 4)
at a global batch of 256, against the plain data-parallel step (``jax.grad``
of the mean loss and the update in one ``jax.jit`` program, the rows in
blocks over the devices), for the MLP of
``benchmarks/trainer_overhead/adaptive_loop.py`` (784-512-512-10), on 1 and
8 devices, each device count in a process of its own. Every step takes NumPy
rows and waits for its outputs; a measuring step reads the similarity (as the
controller does), a plain one waits for its parameters. A timed round is 4
steps (a multiple of every k), paired with 4 plain steps, the order
alternating every round.

Per row: ``paired_time_ratio`` (the median over rounds of the k-step
rounds' time over the plain rounds'), the seconds per step of each, and
whether it meets the goal: at most 1.05x the plain step for ``k = 4``.

Per device count, ``programs`` holds what the compiler says each program
costs, the same on any machine and under any load: the plain ``jax.jit``
step, and ``AdaptiveStep``'s plain and measuring programs (the ``Trainer``'s
own), each with its ``bytes_accessed`` (``cost_analysis()``, the memory
traffic a memory-bound accelerator's time follows), ``flops`` and
``temp_bytes`` (``memory_analysis()``); ``load_average`` the machine's
one-minute load average (``os.getloadavg()``) as the device count's part
began and as it ended.

Usage::

  python benchmarks/trainer_overhead/measure_every.py          # benchmarks/results/measure_every.json
  python benchmarks/trainer_overhead/measure_every.py --quick  # a tiny MLP: measure_every_quick.json
  python benchmarks/trainer_overhead/measure_every.py --markdown benchmarks/results/measure_every.json
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.trainer_overhead import adaptive_loop  # noqa: E402

FULL = {"batch": 256, "rounds": 15, "widths": (512, 512), "features": 784, "devices": (1, 8)}
QUICK = {"batch": 32, "rounds": 2, "widths": (16,), "features": 8, "devices": (1, 8)}
EVERY = (1, 2, 4)
STEPS_PER_ROUND = 4  # a multiple of every k: each round holds whole cycles
# The goal: measure_every=4 at most 1.05x the plain step.
GOAL = {4: 1.05}
PROGRAMS = {
  "plain_jit": "the plain `jax.jit` step",
  "adaptive_step_plain": "`AdaptiveStep`'s plain step",
  "adaptive_step_fused": "`AdaptiveStep`'s measuring step",
}


def _measure(args: argparse.Namespace) -> dict[str, Any]:
  """Each k against the plain step on this process's devices."""
  import jax  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  import simigrad_jax  # pylint: disable=import-outside-toplevel

  load_before = os.getloadavg()[0]
  mesh = jax.make_mesh((jax.device_count(),), ("batch",), (jax.sharding.AxisType.Auto,))
  params, row_losses, batch_of = adaptive_loop.mlp(args.features, args.widths, args.batch)
  plain = adaptive_loop.plain_step(params, row_losses, batch_of, mesh)
  optimizer = optax.chain(
    simigrad_jax.transform("batch"),
    optax.sgd(adaptive_loop.LEARNING_RATE),
    simigrad_jax.scale_by_lr_factor(),
  )
  rows: dict[str, Any] = {}
  for every in EVERY:
    step = simigrad_jax.AdaptiveStep(
      row_losses, optimizer, max_batch_size=args.batch, measure_every=every, mesh=mesh
    )
    state = list(step.init(params))

    def run(size: int, step=step, state=state) -> None:
      measures = step.measuring(step.steps)
      state[:] = step(*state, batch_of(size))[:2]
      if measures:
        simigrad_jax.similarity(state[1])  # the controller reads it
      else:
        jax.block_until_ready(state[0])

    row = adaptive_loop.paired(run, plain, [args.batch], args.rounds, STEPS_PER_ROUND)
    rows[str(every)] = {**row, "halves": step.halves}
    print(f"{jax.device_count()} device(s), k={every}: {row['paired_time_ratio']:.2f}x", flush=True)
  # Placed as the plain step places them: the parameters replicated, the rows in blocks.
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  blocks = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
  placed = jax.device_put(params, replicated)
  plain_jit = adaptive_loop.plain_program(row_losses).lower(
    placed,
    optax.sgd(adaptive_loop.LEARNING_RATE).init(placed),
    jax.device_put(batch_of(args.batch), blocks),
  )
  programs = {"plain_jit": program_cost(plain_jit.compile())}
  for key in step.compiled:  # the last k's: its measuring and its plain program
    programs[f"adaptive_step_{key.program}"] = program_cost(step.program(key))
  return {
    "rows": rows,
    "programs": programs,
    "device": common.device_record(),
    "load_average": [load_before, os.getloadavg()[0]],
  }


def program_cost(compiled: Any) -> dict[str, float]:
  """A compiled program's ``bytes_accessed`` and ``flops`` (``cost_analysis()``) and
  ``temp_bytes`` (``memory_analysis()``)."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost  # a list of one per program in older JAX
  return {
    "bytes_accessed": float(cost["bytes accessed"]),
    "flops": float(cost["flops"]),
    "temp_bytes": float(compiled.memory_analysis().temp_size_in_bytes),
  }


def _child(args: argparse.Namespace) -> None:
  common.configure_host_devices(args.child)
  results = _measure(args)
  with open(args.out, "w") as f:
    json.dump(results, f)


def met_goal(every: str, row: dict[str, Any]) -> bool | None:
  """Whether a row meets :data:`GOAL` by the wall clock and by CPU seconds (None: no goal for
  this k)."""
  goal = GOAL.get(int(every))
  return None if goal is None else max(row["paired_time_ratio"], row["paired_cpu_ratio"]) <= goal


def _format_table(results: dict[str, Any]) -> str:
  header = f"{'devices':>7}  {'k':>3}{'vs plain':>10}{'CPU':>8}{'step ms':>9}{'plain ms':>9}  goal"
  lines = [header, "-" * len(header)]
  for devices, part in results["devices"].items():
    for every, row in part["rows"].items():
      goal = met_goal(every, row)
      lines.append(
        f"{devices:>7}  {every:>3}{row['paired_time_ratio']:>9.2f}x{row['paired_cpu_ratio']:>7.2f}x"
        f"{row['step_seconds'] * 1e3:>9.2f}{row['plain_step_seconds'] * 1e3:>9.2f}  "
        + ("" if goal is None else ("met" if goal else "missed"))
      )
  return "\n".join(lines)


def programs_table(results: dict[str, Any]) -> str:
  """The docs' table of the programs' costs: per device count, each program's bytes accessed
  and temporary bytes, and their ratios to the plain ``jax.jit`` step's."""
  lines = [
    "| devices | program | bytes accessed | / plain | temporary bytes | / plain |",
    "|---|---|---|---|---|---|",
  ]
  for devices, part in results["devices"].items():
    plain = part["programs"]["plain_jit"]
    for name, cost in part["programs"].items():
      lines.append(
        f"| {devices} | {PROGRAMS.get(name, name)} | {cost['bytes_accessed'] / 1e6:.1f} MB | "
        f"{cost['bytes_accessed'] / plain['bytes_accessed']:.2f}x | "
        f"{cost['temp_bytes'] / 1e6:.2f} MB | {_ratio(cost['temp_bytes'], plain['temp_bytes'])} |"
      )
  return "\n".join(lines)


def _ratio(value: float, plain: float) -> str:
  """``value / plain`` as a table cell; "-" where the plain step has none."""
  return f"{value / plain:.2f}x" if plain else "-"


def markdown_table(results: dict[str, Any]) -> str:
  """The docs' table: per device count, each k's time and CPU seconds over the plain step's
  (median, and its quartiles over rounds)."""
  lines = [
    "| devices | clock | " + " | ".join(f"`measure_every={k}`" for k in EVERY) + " |",
    "|---|---|" + "---|" * len(EVERY),
  ]
  for devices, part in results["devices"].items():
    for clock, label in (("time", "wall"), ("cpu", "CPU seconds")):
      cells = [adaptive_loop.ratio_cell(part["rows"][str(k)], clock) for k in EVERY]
      lines.append(f"| {devices} | {label} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help=f"a tiny MLP, for tests: {QUICK}")
  parser.add_argument("--rounds", type=int, default=None, help="paired timed rounds per k")
  parser.add_argument("--batch", type=int, default=None, help="the global batch size")
  parser.add_argument("--widths", type=common.integers, default=None, help="hidden widths")
  parser.add_argument("--features", type=int, default=None, help="input features")
  parser.add_argument(
    "--devices", type=common.integers, default=None, help="device counts, each in a process"
  )
  parser.add_argument(
    "--markdown", default=None, help="print the docs table of this JSON, and stop"
  )
  parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
  common.add_out_flag(parser, "measure_every")
  args = parser.parse_args(argv)
  common.apply_preset(
    args, QUICK if args.quick else FULL, ("rounds", "batch", "widths", "features", "devices")
  )
  for name in ("rounds", "batch", "features"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} {getattr(args, name)}: expected an integer >= 1")
  if not args.widths or min(args.widths) < 1:
    parser.error(f"--widths {args.widths}: expected positive widths, e.g. 512,512")
  if not args.devices or min(args.devices) < 1:
    parser.error(f"--devices {args.devices}: expected positive device counts, e.g. 1,8")
  if args.batch % (2 * max(args.devices)):
    parser.error(
      f"--batch {args.batch}: expected a multiple of {2 * max(args.devices)}, so that every "
      "device holds an even number of rows in the plain step too"
    )
  if args.child is None:
    args.out = common.out_path(args.out, "measure_every", args.quick)
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs each device count in its own process; prints the table and writes the JSON.

  Args:
    argv: command-line arguments (``sys.argv[1:]`` when None).

  Returns:
    ``{"devices": {"1" | "8": {"rows": {"1" | "2" | "4": {"paired_time_ratio",
    "step_seconds", "plain_step_seconds", ...}}, "programs": {name: {"bytes_accessed",
    "flops", "temp_bytes"}}, "device": {...}, "load_average": [began, ended]}},
    "settings"}``, or ``{}`` with
    ``--markdown`` or in a child process.
  """
  args = _parse_args(argv)
  if args.markdown:
    with open(args.markdown, encoding="utf-8") as f:
      results = json.load(f)
    print(markdown_table(results))
    print()
    print(programs_table(results))
    return {}
  if args.child is not None:
    _child(args)
    return {}
  settings: dict[str, Any] = {
    "batch": args.batch,
    "rounds": args.rounds,
    "steps_per_round": STEPS_PER_ROUND,
    "widths": list(args.widths),
    "features": args.features,
  }
  results: dict[str, Any] = {"devices": {}, "settings": settings}
  with tempfile.TemporaryDirectory() as folder:
    for count in args.devices:
      part = os.path.join(folder, f"{count}.json")
      command = [sys.executable, os.path.abspath(__file__), "--child", str(count), f"--out={part}"]
      command += ["--rounds", str(args.rounds), "--batch", str(args.batch)]
      command += ["--widths", ",".join(map(str, args.widths)), "--features", str(args.features)]
      subprocess.run(command, check=True, env=common.child_environment(own_device_count=True))
      with open(part) as f:
        results["devices"][str(count)] = json.load(f)
  return common.report(results, _format_table(results), args.out)


if __name__ == "__main__":
  main(sys.argv[1:])
