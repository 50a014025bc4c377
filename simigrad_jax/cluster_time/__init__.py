"""Host: training time against cluster size and bandwidth, and whether adapting the batch pays.

Documented API:
  StepTimeModel: a step's time on ``N`` devices: one device's compute of its
    rows (a DeviceCurve), a ring all-reduce of the gradient over a Link, and
    the host path; LINKS and DEVICES are the presets of links and devices.
  Setting: a setting's batch-size trajectories up to the target, read from a
    Pareto comparison or runs' metrics by load_settings.
  time_to_target: a setting's wall-clock to the target on ``N`` devices, and
    answer: the fastest setting per family (constant, ramp, SimiGrad) at each
    device count, and the crossover.

Modules: ``model`` (the step-time model, and the CPU stand-in fitted to a
measured sweep), ``runs`` (the settings' trajectories), ``to_target`` (the
wall-clock to the target, the answer printed and plotted) and ``__main__``
(the command line, ``python -m simigrad_jax.cluster_time``).

Example:
  >>> from simigrad_jax.cluster_time import LINKS, DeviceCurve, StepTimeModel
  >>> model = StepTimeModel(DeviceCurve(1e-3, 1e-5), gradient_bytes=4e5, host_s=5e-4)
  >>> model.seconds(256, 64, LINKS["ethernet"]) > model.seconds(256, 64, LINKS["nvlink"])
  True
"""

import importlib
from types import ModuleType

from simigrad_jax.cluster_time.model import DEVICES
from simigrad_jax.cluster_time.model import LINKS
from simigrad_jax.cluster_time.model import DeviceCurve
from simigrad_jax.cluster_time.model import Link
from simigrad_jax.cluster_time.model import StepTimeModel
from simigrad_jax.cluster_time.runs import Setting
from simigrad_jax.cluster_time.runs import load_settings
from simigrad_jax.cluster_time.to_target import answer
from simigrad_jax.cluster_time.to_target import time_to_target

__all__ = [
  "DEVICES",
  "DeviceCurve",
  "LINKS",
  "Link",
  "Setting",
  "StepTimeModel",
  "answer",
  "load_settings",
  "time_to_target",
]


def __getattr__(name: str) -> ModuleType:
  """The command line's module, ``simigrad_jax.cluster_time.__main__``, imported when asked
  for: importing it with the package would make ``python -m`` run a second copy."""
  if name == "__main__":
    return importlib.import_module(f"{__name__}.__main__")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
