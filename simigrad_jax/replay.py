"""Host: prints a run's realised batch sizes as a step schedule, to replay or hand to another trainer.

From the command line::

  python -m simigrad_jax.replay /tmp/run/metrics.jsonl
  # 0:20,140:22,404:24
  python -m simigrad_jax.replay /tmp/run/metrics.jsonl --tokens-per-example 256

The output is Megatron-LM's threshold form, which the ``"step_schedule"``
controller takes (``make_controller("step_schedule", thresholds=...)``, or
``--config.controller=step_schedule`` in the training scripts); see
:mod:`simigrad_jax.ramps.replay`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Sequence

from simigrad_jax.ramps.replay import replay_schedule
from simigrad_jax.trainer.metrics import read_metrics

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
  """The command line: ``python -m simigrad_jax.replay METRICS.jsonl [--tokens-per-example N]``."""
  parser = argparse.ArgumentParser(
    prog="python -m simigrad_jax.replay",
    description="Print a run's realised batch sizes (from its metrics.jsonl) as a step schedule "
    "'count:size,...' for the step_schedule controller.",
  )
  parser.add_argument("metrics", type=pathlib.Path, help="the run's metrics.jsonl")
  parser.add_argument(
    "--tokens-per-example",
    type=int,
    default=None,
    help="give the counts in tokens, this many per example (default: examples)",
  )
  args = parser.parse_args(argv)
  try:
    print(replay_schedule(read_metrics(args.metrics), args.tokens_per_example))
  except (OSError, ValueError) as e:
    parser.exit(2, f"{parser.prog}: error: {e}\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
