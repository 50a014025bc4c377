"""What every benchmark script does before importing JAX. Imports nothing heavy."""

from __future__ import annotations

import os
import sys

REPOSITORY_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def configure_host_devices(count: int = 8) -> None:
  """Asks XLA for ``count`` CPU devices unless the user already chose a count.

  Must run before JAX is imported; appends to any existing ``XLA_FLAGS`` and
  defaults ``JAX_PLATFORMS`` to ``cpu`` (set it yourself to benchmark GPUs).
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


def prepare_script() -> None:
  """When a benchmark runs as a script: simulated devices, and the repository on the import path."""
  configure_host_devices()
  if REPOSITORY_ROOT not in sys.path:
    sys.path.insert(0, REPOSITORY_ROOT)


def report(results: dict, table: str, out: str | None) -> dict:
  """Prints ``table``, writes ``results`` as JSON to ``out`` when given, and returns ``results``."""
  import json  # pylint: disable=import-outside-toplevel
  print()
  print(table)
  if out:
    with open(out, "w") as f:
      json.dump(results, f, indent=2)
    print(f"\nwrote {out}")
  return results
