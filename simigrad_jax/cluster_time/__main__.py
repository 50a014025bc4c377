"""Host: ``python -m simigrad_jax.cluster_time``: does adapting the batch pay on my cluster?

From the command line::

  python -m simigrad_jax.cluster_time benchmarks/results/pareto_lm.json
  python -m simigrad_jax.cluster_time benchmarks/results/pareto_mnist.json --device h100 \\
      --link nvlink ethernet --png /tmp/mnist.png
  python -m simigrad_jax.cluster_time /tmp/run/metrics.jsonl --model lm --bandwidth 12.5 \\
      --latency-us 10

It reads a comparison's settings (a Pareto JSON) or runs' ``metrics.jsonl``
(:mod:`simigrad_jax.cluster_time.runs`), builds the step-time model of the
model they trained from the calibration (``docs/cluster_time.json``, which
``benchmarks/cluster/cluster_time.py`` writes: the gradient's bytes and FLOPs, the
host path and one measured device's curve) and prints the fastest time to
the target of each family (constant batches, ramps, SimiGrad, other
adaptive controllers) at each device count and link, with the crossover
(:mod:`simigrad_jax.cluster_time.to_target`). The devices' speed is the
measured curve (``--device measured``, the default) or a named preset's FLOP
rate; the links are presets (``--link``) or one given (``--bandwidth``,
``--latency-us``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence

from simigrad_jax.cluster_time.model import DEVICES
from simigrad_jax.cluster_time.model import LINKS
from simigrad_jax.cluster_time.model import Link
from simigrad_jax.cluster_time.model import step_model
from simigrad_jax.cluster_time.runs import load_settings
from simigrad_jax.cluster_time.to_target import DEVICE_COUNTS
from simigrad_jax.cluster_time.to_target import answer
from simigrad_jax.cluster_time.to_target import format_answer
from simigrad_jax.cluster_time.to_target import plot_answers

__all__ = ["main"]

_TASK_MODELS = {"causal_lm": "lm", "images": "mnist"}


def _links(args: argparse.Namespace) -> dict[str, Link]:
  unknown = [name for name in args.link if name not in LINKS]
  if unknown:
    raise ValueError(
      f"unknown --link preset {unknown[0]!r}: use one of {', '.join(LINKS)}, or --bandwidth "
      "(GB/s) and --latency-us for your own"
    )
  links = {name: LINKS[name] for name in args.link}
  if args.bandwidth is not None:
    if not args.bandwidth > 0 or not args.latency_us >= 0:
      raise ValueError(
        f"--bandwidth must be > 0 GB/s and --latency-us >= 0, got {args.bandwidth} and "
        f"{args.latency_us}"
      )
    links["given"] = Link(args.bandwidth * 1e9, args.latency_us * 1e-6, "given on the command line")
  return links


def _model_name(args: argparse.Namespace) -> str:
  if args.model is not None:
    return args.model
  if len(args.runs) == 1 and args.runs[0].suffix == ".json":
    task = json.loads(args.runs[0].read_text()).get("task")
    if task in _TASK_MODELS:
      return _TASK_MODELS[task]
  raise ValueError("say which calibrated model the runs trained: --model lm or --model mnist")


def main(argv: Sequence[str] | None = None) -> int:
  """The command line (see the module)."""
  parser = argparse.ArgumentParser(
    prog="python -m simigrad_jax.cluster_time",
    description="Each setting's wall-clock to its target on a cluster of N devices, and where "
    "adapting the batch starts to pay.",
  )
  parser.add_argument(
    "runs", type=pathlib.Path, nargs="+", help="a Pareto JSON or metrics.jsonl files"
  )
  parser.add_argument(
    "--calibration",
    type=pathlib.Path,
    default=pathlib.Path("docs/cluster_time.json"),
    help="the step-time calibration benchmarks/cluster/cluster_time.py wrote (default: %(default)s)",
  )
  parser.add_argument("--model", default=None, help="the calibrated model (default: the task's)")
  parser.add_argument(
    "--device", default="measured", help=f"measured, or a preset: {', '.join(DEVICES)}"
  )
  parser.add_argument(
    "--link", nargs="*", default=["nvlink", "ethernet"], help=f"presets: {', '.join(LINKS)}"
  )
  parser.add_argument("--bandwidth", type=float, default=None, help="your link's GB/s one way")
  parser.add_argument("--latency-us", type=float, default=10.0, help="your link's us a ring step")
  parser.add_argument("--devices", type=int, nargs="+", default=list(DEVICE_COUNTS))
  parser.add_argument("--png", default=None, help="also plot time to target against devices here")
  parser.add_argument("--json", default=None, help="also write the answer as JSON here")
  args = parser.parse_args(argv)
  try:
    if any(n < 1 for n in args.devices):
      raise ValueError(f"--devices must all be >= 1, got {args.devices}")
    links = _links(args)
    if not links:
      raise ValueError("no link to answer for: give --link presets or --bandwidth")
    settings = load_settings(args.runs)
    try:
      calibration = json.loads(args.calibration.read_text())
    except (OSError, json.JSONDecodeError) as e:
      raise ValueError(
        f"cannot read the calibration {args.calibration} ({e}): run benchmarks/cluster/cluster_time.py "
        "or give --calibration"
      ) from None
    model = step_model(calibration, _model_name(args), args.device)
    result = answer(settings, model, links, args.devices)
  except (OSError, ValueError, KeyError) as e:
    parser.exit(2, f"{parser.prog}: error: {e}\n")
  print(format_answer(result))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(result, indent=2))
  if args.png:
    plot_answers({str(args.runs[0]): result}, args.png, list(links)[:3])
  return 0


if __name__ == "__main__":
  sys.exit(main())
