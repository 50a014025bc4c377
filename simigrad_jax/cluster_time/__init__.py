"""Host: training time against cluster size and bandwidth, and whether adapting the batch pays.

* :mod:`~simigrad_jax.cluster_time.model`: a step's time on ``N`` devices,
  ``StepTimeModel`` (one device's compute of its rows, ``DeviceCurve``; a
  ring all-reduce of the gradient over a ``Link``,
  ``ring_allreduce_seconds``; the host path), the presets ``LINKS`` and
  ``DEVICES``, and the CPU stand-in ``CpuStepModel`` fitted to a measured
  sweep (``fit_cpu_model``); ``step_model``, a model
  from the sweep's calibration;
* :mod:`~simigrad_jax.cluster_time.runs`: each ``Setting``'s batch-size
  trajectories up to the target, from a Pareto comparison or runs' metrics
  (``load_settings``);
* :mod:`~simigrad_jax.cluster_time.to_target`: each setting's
  ``time_to_target``, and ``answer``: the fastest per family at each of the
  ``DEVICE_COUNTS`` and the crossover (``format_answer`` prints it,
  ``plot_answers`` draws it);
* ``python -m simigrad_jax.cluster_time``: the tool.

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
from simigrad_jax.cluster_time.model import CpuStepModel
from simigrad_jax.cluster_time.model import DeviceCurve
from simigrad_jax.cluster_time.model import Link
from simigrad_jax.cluster_time.model import StepTimeModel
from simigrad_jax.cluster_time.model import fit_cpu_model
from simigrad_jax.cluster_time.model import ring_allreduce_seconds
from simigrad_jax.cluster_time.model import step_model
from simigrad_jax.cluster_time.runs import Setting
from simigrad_jax.cluster_time.runs import load_settings
from simigrad_jax.cluster_time.to_target import DEVICE_COUNTS
from simigrad_jax.cluster_time.to_target import answer
from simigrad_jax.cluster_time.to_target import format_answer
from simigrad_jax.cluster_time.to_target import plot_answers
from simigrad_jax.cluster_time.to_target import time_to_target

__all__ = [
  "CpuStepModel",
  "DEVICES",
  "DEVICE_COUNTS",
  "DeviceCurve",
  "LINKS",
  "Link",
  "Setting",
  "StepTimeModel",
  "answer",
  "fit_cpu_model",
  "format_answer",
  "load_settings",
  "plot_answers",
  "ring_allreduce_seconds",
  "step_model",
  "time_to_target",
]


def __getattr__(name: str) -> ModuleType:
  """The command line's module, ``simigrad_jax.cluster_time.__main__``, imported when asked
  for: importing it with the package would make ``python -m`` run a second copy."""
  if name == "__main__":
    return importlib.import_module(f"{__name__}.__main__")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
