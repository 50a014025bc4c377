"""What every benchmark script does before JAX starts. Imports nothing heavy at import time."""

from __future__ import annotations

import os
import sys

REPOSITORY_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def configure_host_devices(count: int = 8) -> None:
  """Asks XLA for ``count`` CPU devices unless the user already chose a count.

  Must run before JAX starts its backend; keeps any existing ``XLA_FLAGS``,
  adds the thread pool size and collective timeouts of
  ``simigrad_jax.simulated_cpu_devices_env`` (which see), and defaults
  ``JAX_PLATFORMS`` to ``cpu`` (set it yourself to benchmark GPUs).
  """
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # read when JAX is imported, so first
  import simigrad_jax  # pylint: disable=import-outside-toplevel

  os.environ.update(simigrad_jax.simulated_cpu_devices_env(count))


def prepare_script() -> None:
  """When a benchmark runs as a script: the repository on the import path, and simulated devices."""
  if REPOSITORY_ROOT not in sys.path:
    sys.path.insert(0, REPOSITORY_ROOT)
  configure_host_devices()


def apply_preset(args, preset: dict, keys=None) -> None:
  """Sets every flag of ``args`` left unset (None) to its preset value.

  Args:
    args: the parsed ``argparse.Namespace``; flags the user gave win.
    preset: the ``--quick`` or the full preset, ``{key: value}``.
    keys: which keys to fill: an iterable of names shared by flag and preset,
      or a mapping ``{flag name: preset key}``; all of ``preset`` when None.
  """
  pairs = (
    keys.items()
    if isinstance(keys, dict)
    else ((key, key) for key in (preset if keys is None else keys))
  )
  for name, key in pairs:
    if getattr(args, name) is None:
      setattr(args, name, preset[key])


def device_record() -> dict:
  """The first JAX device's platform and kind, the devices visible and the host's CPUs."""
  import jax  # pylint: disable=import-outside-toplevel

  device = jax.devices()[0]
  return {
    "platform": device.platform,
    "device_kind": device.device_kind,
    "devices_visible": jax.device_count(),
    "host_cpus": os.cpu_count(),
  }


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
