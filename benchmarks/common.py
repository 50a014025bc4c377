"""What every benchmark script does before JAX starts. Imports nothing heavy at import time."""

from __future__ import annotations

import argparse
import os
import sys

REPOSITORY_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPOSITORY_ROOT, "benchmarks", "results")  # the benchmarks' JSON
PLOTS_DIR = os.path.join(REPOSITORY_ROOT, "docs")  # their plots, beside the pages that show them


def child_environment(*, own_device_count: bool = False) -> dict[str, str]:
  """This process's environment for a benchmark's child process.

  The repository goes first on ``PYTHONPATH``, before what was there (a
  machine whose packages come from ``PYTHONPATH`` keeps them).

  Args:
    own_device_count: the child sets its own simulated device count, so none
      is inherited (``XLA_FLAGS``' device count and ``PJRT_NPROC``, sized for
      this process's count, are left out).

  Returns:
    The child's environment, a new dict.
  """
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPOSITORY_ROOT, env.get("PYTHONPATH")]))
  if own_device_count:
    flags = env.get("XLA_FLAGS", "").split()
    device_count = "--xla_force_host_platform_device_count"
    env["XLA_FLAGS"] = " ".join(flag for flag in flags if not flag.startswith(device_count))
    env.pop("PJRT_NPROC", None)
  return env


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


def integers(text: str) -> tuple[int, ...]:
  """A comma-separated list of integers, as an ``argparse`` type: ``"16,64"`` is ``(16, 64)``."""
  return tuple(int(part) for part in text.split(",") if part.strip())


def floats(text: str) -> tuple[float, ...]:
  """A comma-separated list of numbers, as an ``argparse`` type: ``"0.1,0.3"`` is ``(0.1, 0.3)``."""
  return tuple(float(part) for part in text.split(",") if part.strip())


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


def code_version() -> dict | None:
  """The repository's commit that holds the running code, and whether its code differs from it.

  ``{"commit": <40 hex digits>, "changed": bool}``: ``changed`` is True where a
  tracked file outside ``benchmarks/results/`` (where the results themselves
  change as runs append) differs from the commit. None where git or the
  repository is not at hand (an installed copy, a machine without git).

  Example:
    >>> version = code_version()
    >>> version is None or len(version["commit"]) == 40
    True
  """
  import subprocess  # pylint: disable=import-outside-toplevel

  def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
      ["git", *args], cwd=REPOSITORY_ROOT, capture_output=True, text=True, timeout=30, check=False
    )

  try:
    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
      return None
    diff = git("diff", "--quiet", "HEAD", "--", ".", ":(exclude)benchmarks/results")
  except (OSError, subprocess.SubprocessError):
    return None
  return {"commit": head.stdout.strip(), "changed": diff.returncode != 0}


def add_out_flag(parser: argparse.ArgumentParser, name: str, *, quick: bool = True) -> None:
  """Adds ``--out``, the results' JSON: by default ``benchmarks/results/NAME.json``.

  Args:
    parser: the benchmark's parser.
    name: the result's name, e.g. ``"halves"``; see :func:`out_path`.
    quick: whether the benchmark has ``--quick`` (its help names that run's file).
  """
  quick_file = f", {name}_quick.json with --quick" if quick else ""
  parser.add_argument(
    "--out",
    default=None,
    metavar="JSON",
    help=f"write the results as JSON here (default: benchmarks/results/{name}.json"
    f"{quick_file}; '' writes none)",
  )


def out_path(out: str | None, name: str, quick: bool = False) -> str:
  """Where a benchmark writes its results' JSON.

  Args:
    out: the ``--out`` flag: a path, ``""`` for no file, or None for the default.
    name: the result's name (``"pareto_mnist"``, ``"halves"``, ...).
    quick: a ``--quick`` run, whose default file is ``NAME_quick.json`` so
      that it never replaces the full run's.

  Returns:
    ``out`` when given, else ``benchmarks/results/NAME.json`` (or
    ``NAME_quick.json``) in this repository, as an absolute path.

  Example::

    out_path(None, "halves", quick=True)  # .../benchmarks/results/halves_quick.json
  """
  if out is not None:
    return out
  return os.path.join(RESULTS_DIR, f"{name}_quick.json" if quick else f"{name}.json")


def plot_path(png: str | None, out: str) -> str | None:
  """Where a benchmark draws its plot.

  Args:
    png: the ``--png`` flag, or None for the default.
    out: the results' JSON (:func:`out_path`), ``""`` for none.

  Returns:
    ``png`` when given; for a JSON in ``benchmarks/results/``, ``docs/STEM.png``
    (the docs keep the plots they show); else the JSON's path with ``.png``;
    None without either.

  Example::

    plot_path(None, "benchmarks/results/pareto_mnist.json")  # .../docs/pareto_mnist.png
    plot_path(None, "/tmp/lm.json")  # /tmp/lm.png
  """
  if png:
    return png
  if not out:
    return None
  stem = os.path.splitext(out)[0]
  if os.path.dirname(os.path.abspath(stem)) == RESULTS_DIR:
    return os.path.join(PLOTS_DIR, os.path.basename(stem) + ".png")
  return stem + ".png"


def repository_path(path: str | os.PathLike) -> str:
  """``path`` as a result records it: relative to the repository root when inside it.

  Args:
    path: a file a benchmark wrote, e.g. its plot.

  Returns:
    The path from the repository root (``docs/pareto_mnist.png``), so that a
    committed result names no machine's folders; any other path as given.
  """
  absolute = os.path.abspath(path)
  if os.path.commonpath([absolute, REPOSITORY_ROOT]) == REPOSITORY_ROOT:
    return os.path.relpath(absolute, REPOSITORY_ROOT).replace(os.sep, "/")
  return os.fspath(path)


def report(results: dict, table: str, out: str | None) -> dict:
  """Prints ``table``, writes ``results`` as JSON to ``out`` when given, and returns ``results``."""
  import json  # pylint: disable=import-outside-toplevel

  print()
  print(table)
  if out:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
      json.dump(results, f, indent=2)
    print(f"\nwrote {out}")
  return results
