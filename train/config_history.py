"""Host: ``<workdir>/config.json``, the history of a run's starts.

Every start of ``python -m train`` in a workdir (the first and each resume)
appends one entry to the file, which is rewritten atomically
(:func:`simigrad_jax.files.write_atomic`)::

  {"starts": [
    {"started": "2026-11-25T10:00:00+00:00", "resumed_at_step": 0,
     "devices": "8 x cpu, device halves", "processes": 1,
     "versions": {"simigrad_jax": "0.1.0", "jax": "0.10.2", ...},
     "config": {...the config as given...}},
    {"started": "2026-11-25T11:00:00+00:00", "resumed_at_step": 30, ...}]}

so a resume with another config leaves the record of the one before. A
``config.json`` of an older version (the config alone) becomes the first
entry, with ``"started": null``.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
from typing import Any

from simigrad_jax import files

CONFIG_FILENAME = "config.json"

# The distributions whose versions each start records.
VERSIONED = ("simigrad-jax", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")


def versions() -> dict[str, str]:
  """The versions of Python and of :data:`VERSIONED` (``"not installed"`` for a missing one)."""
  found = {"python": platform.python_version()}
  for name in VERSIONED:
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      found[name] = "not installed"
  return found


def read_starts(workdir: str | os.PathLike) -> list[dict[str, Any]]:
  """The entries of ``<workdir>/config.json``, oldest first (``[]`` when there is none).

  Raises:
    UnsafePathError: ``config.json`` is a symlink or not a plain file (it
      is never read or written through one, nor read from a FIFO).
    ValueError: ``config.json`` is not JSON, or not a history or a config.
  """
  path = pathlib.Path(workdir) / CONFIG_FILENAME
  if not os.path.lexists(path):
    return []
  try:
    data = json.loads(files.read_plain_file(path))
  except ValueError as error:
    raise ValueError(
      f"{path} is not JSON ({error}); it holds the configs of the run's starts: "
      f"repair it or move it away"
    ) from error
  if not isinstance(data, dict):
    raise ValueError(
      f"{path} holds {type(data).__name__}, not the JSON object of a run's "
      f"history; repair it or move it away"
    )
  if "starts" not in data:  # an older version's file: the last start's config alone
    return [{"started": None, "config": data}]
  if not isinstance(data["starts"], list):
    raise ValueError(
      f"{path}: 'starts' must be a list of the run's starts, got "
      f"{data['starts']!r:.80}; repair it or move it away"
    )
  return data["starts"]


def append_start(
  workdir: str | os.PathLike,
  config: dict[str, Any],
  *,
  resumed_at_step: int,
  devices: str,
  processes: int,
) -> list[dict[str, Any]]:
  """Appends this start to ``<workdir>/config.json`` (rewritten atomically) and returns every entry.

  Args:
    workdir: the run's workdir.
    config: the config of this start, as JSON data.
    resumed_at_step: the optimizer steps the run had done (0 for a new run).
    devices: the devices it trains on, e.g. ``"8 x cpu, device halves"``.
    processes: the number of processes.

  Returns:
    The history, this start last.

  Raises:
    UnsafePathError, ValueError: see :func:`read_starts`.

  Example:
    >>> import tempfile
    >>> workdir = tempfile.mkdtemp()
    >>> starts = append_start(workdir, {"seed": 0}, resumed_at_step=0, devices="1 x cpu",
    ...                       processes=1)
    >>> starts = append_start(workdir, {"seed": 1}, resumed_at_step=30, devices="1 x cpu",
    ...                       processes=1)
    >>> [(s["config"]["seed"], s["resumed_at_step"]) for s in read_starts(workdir)]
    [(0, 0), (1, 30)]
  """
  starts = read_starts(workdir)
  starts.append(
    {
      "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
      "resumed_at_step": resumed_at_step,
      "devices": devices,
      "processes": processes,
      "versions": versions(),
      "config": config,
    }
  )
  files.write_atomic(
    pathlib.Path(workdir) / CONFIG_FILENAME, json.dumps({"starts": starts}, indent=2) + "\n"
  )
  return starts
