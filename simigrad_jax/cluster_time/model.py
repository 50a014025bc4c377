"""Host: a data-parallel step's time on N devices over a link, and its CPU stand-in fitted to a sweep.

The cluster model (:class:`StepTimeModel`): a step of global batch ``B`` on
``N`` devices takes

  ``host_s + device.seconds(ceil(B / N)) + ring_allreduce_seconds(bytes, N, link)``

* the device term: one device's compute of its ``ceil(B / N)`` rows (the
  Trainer pads a batch to a multiple of the devices), a fixed overhead plus
  a cost per example (:class:`DeviceCurve`), fitted from measured step times
  at several per-device batch sizes, or a preset's FLOP rate;
* the all-reduce of the gradient's bytes over a ring (Patarasuk and Yuan,
  2009; NCCL's ring): a reduce-scatter then an all-gather, ``2 (N - 1)``
  steps each moving ``bytes / N``: ``2 (N - 1) / N x bytes / bandwidth +
  2 (N - 1) x latency`` (:func:`ring_allreduce_seconds`); every setting's
  step reduces the same gradient, so this term is the same for all of them;
* the host path (``host_s``): the Trainer's critical path between steps
  (the step record's ``host_seconds``), taken as a constant.

Assumptions: compute does not overlap the all-reduce (where it would, a
step takes less); a device's batch fits its memory in one
micro-step; the link is the slowest one on the ring.

The CPU stand-in (:class:`CpuStepModel`) is what the sweep on simulated
devices can check. Simulated devices share the machine's ``cores``, so the
devices' compute does not run side by side as on a cluster: the ``N``
devices' work (each its fixed overhead and its rows) is serialised over
``min(N, cores)`` cores, and their collective is a copy in memory whose cost
grows with the devices taking part:

  ``host_s + N x c(B / N) / min(N, cores) + (N - 1) x collective_s``

with one device's curve ``c(rows) = overhead_s + rows x seconds_per_example
+ rows^2 x seconds_per_example_squared``: the sweep on this machine found
an example's cost growing with the rows a device holds (a 2-layer LM's
activations outgrowing the CPU's caches), which a line through the points
misses by up to 50%. ``cores`` is the parallelism the sweep's points
support (on a machine loaded by other users, fewer than its cores).

Its ``overhead_s``, ``seconds_per_example`` and ``seconds_per_example_squared``
are one device's curve
(:meth:`CpuStepModel.device_curve`), the part the cluster prediction takes;
``collective_s`` is the CPU's own and is not carried over.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
  "CpuStepModel",
  "DEVICES",
  "DeviceCurve",
  "LINKS",
  "Link",
  "StepTimeModel",
  "fit_cpu_model",
  "leave_one_out",
  "ring_allreduce_seconds",
  "step_model",
]


@dataclasses.dataclass(frozen=True)
class Link:
  """The slowest link on the all-reduce's ring.

  Attributes:
    bandwidth: bytes per second one way.
    latency: seconds per ring step (a message's fixed cost).
    source: where the figures come from.
  """

  bandwidth: float
  latency: float
  source: str = "given"

  def as_dict(self) -> dict[str, float | str]:
    return dataclasses.asdict(self)


# Figures per device, one way; the presets a user names with --link.
LINKS = {
  "nvlink": Link(
    450e9,
    2e-6,
    "NVLink 4 (H100 SXM): 900 GB/s per GPU both ways, NVIDIA H100 datasheet; latency "
    "2 us a ring step, assumed from NCCL's small-message all-reduce on one node (tens of us)",
  ),
  "infiniband": Link(
    50e9,
    5e-6,
    "InfiniBand NDR, 400 Gb/s a port (NVIDIA ConnectX-7 datasheet); latency 5 us a step, assumed",
  ),
  "ethernet": Link(
    3.125e9,
    30e-6,
    "25 Gigabit Ethernet (IEEE 802.3by), 3.125 GB/s; latency 30 us a step, assumed for TCP in "
    "one data centre",
  ),
}


@dataclasses.dataclass(frozen=True)
class DeviceCurve:
  """One device's compute time of ``rows`` examples: ``overhead_s + rows x seconds_per_example
  + rows^2 x seconds_per_example_squared``.

  The square term is 0 for a device that computes each example at the same
  cost; a CPU's cost per example grows with the rows once their activations
  outgrow its caches, which the measured curve's square term holds.

  Attributes:
    overhead_s: the fixed part of a step on the device (launches, the update).
    seconds_per_example: what each more example costs.
    source: where the figures come from (a measured sweep, a preset).
    seconds_per_example_squared: the growth of an example's cost with the rows.
  """

  overhead_s: float
  seconds_per_example: float
  source: str = "given"
  seconds_per_example_squared: float = 0.0

  def seconds(self, rows: float) -> float:
    """The device's time for ``rows`` examples."""
    return (
      self.overhead_s
      + rows * self.seconds_per_example
      + rows * rows * self.seconds_per_example_squared
    )

  def as_dict(self) -> dict[str, float | str]:
    return dataclasses.asdict(self)

  @classmethod
  def from_flops(
    cls,
    flops_per_example: float,
    peak_flops: float,
    utilization: float,
    overhead_s: float,
    source: str,
  ) -> DeviceCurve:
    """A device that runs the model's FLOPs at ``utilization`` of its peak, after ``overhead_s``.

    Example:
      >>> DeviceCurve.from_flops(1e9, 1e12, 0.5, 1e-3, "x").seconds(10)
      0.021
    """
    return cls(overhead_s, flops_per_example / (peak_flops * utilization), source)


# Device presets: (peak FLOP/s, assumed utilization, assumed fixed overhead a step, source).
DEVICES = {
  "h100": (
    494e12,
    0.25,
    5e-4,
    "H100 SXM, 494 TFLOP/s dense TF32 (NVIDIA H100 datasheet); assumed: 25% of it, and 0.5 ms "
    "a step of kernel launches and the update, not measured (no GPU in the sweep)",
  ),
  "a100": (
    156e12,
    0.25,
    5e-4,
    "A100, 156 TFLOP/s dense TF32 (NVIDIA A100 datasheet); assumed: 25% of it, and 0.5 ms a step",
  ),
}


def ring_allreduce_seconds(nbytes: float, devices: int, link: Link) -> float:
  """One ring all-reduce of ``nbytes`` over ``devices``: ``2(N-1)/N x bytes/bw + 2(N-1) x lat``.

  Args:
    nbytes: the bytes every device holds and all of them sum.
    devices: the devices on the ring (1: no communication).
    link: the ring's slowest link.

  Returns:
    Seconds; 0 on one device.

  Example:
    >>> ring_allreduce_seconds(1e6, 4, Link(1e9, 1e-5))  # 1.5 ms + 60 us
    0.00156
  """
  if devices < 1:
    raise ValueError(f"devices must be >= 1, got {devices}")
  steps = 2 * (devices - 1)
  return round(steps / devices * nbytes / link.bandwidth + steps * link.latency, 15)


@dataclasses.dataclass(frozen=True)
class StepTimeModel:
  """A data-parallel step's seconds on a cluster (see the module).

  Attributes:
    device: one device's compute curve.
    gradient_bytes: the bytes of the gradient every step all-reduces.
    host_s: the host's critical path a step.
  """

  device: DeviceCurve
  gradient_bytes: float
  host_s: float = 0.0

  def seconds(self, batch_size: float, devices: int, link: Link) -> float:
    """A step of ``batch_size`` examples on ``devices`` over ``link``.

    Example:
      >>> model = StepTimeModel(DeviceCurve(1e-3, 1e-4), 1e6, host_s=2e-4)
      >>> round(model.seconds(64, 4, Link(1e9, 1e-5)), 6)  # 0.2 + 1 + 1.6 + 1.56 ms
      0.00436
    """
    rows = math.ceil(batch_size / devices - 1e-9)
    return (
      self.host_s
      + self.device.seconds(rows)
      + ring_allreduce_seconds(self.gradient_bytes, devices, link)
    )


@dataclasses.dataclass(frozen=True)
class CpuStepModel:
  """A step's seconds on ``N`` simulated CPU devices sharing ``cores`` (see the module).

  Attributes:
    overhead_s: one device's fixed time a step.
    seconds_per_example: one device's time an example.
    collective_s: the collective's time per device beyond the first.
    cores: the cores the devices' work is spread over.
    seconds_per_example_squared: the growth of an example's cost with the rows.
  """

  overhead_s: float
  seconds_per_example: float
  collective_s: float
  cores: int
  seconds_per_example_squared: float = 0.0

  def seconds(self, batch_size: float, devices: int, host_s: float) -> float:
    """A step of ``batch_size`` examples on ``devices`` simulated devices.

    Example:
      >>> CpuStepModel(1e-3, 1e-4, 5e-4, cores=2).seconds(64, 4, host_s=0.0)  # (4 + 6.4)/2 + 1.5 ms
      0.0067
    """
    row = _cpu_row(batch_size, devices, self.cores)
    terms = row @ np.array(
      [
        self.overhead_s,
        self.seconds_per_example,
        self.collective_s,
        self.seconds_per_example_squared,
      ]
    )
    return round(host_s + float(terms), 15)

  def device_curve(self) -> DeviceCurve:
    """One device's curve, the part a cluster prediction takes."""
    return DeviceCurve(
      self.overhead_s,
      self.seconds_per_example,
      "measured: one simulated CPU device of the sweep",
      self.seconds_per_example_squared,
    )

  def as_dict(self) -> dict[str, float]:
    return dataclasses.asdict(self)


def _cpu_row(batch_size: float, devices: int, cores: int) -> np.ndarray:
  """The CPU model's terms for one point, the coefficients of its four parameters."""
  parallel = min(devices, cores)
  rows = batch_size / devices
  return np.array(
    [devices / parallel, batch_size / parallel, devices - 1.0, devices * rows * rows / parallel]
  )


def step_model(calibration: dict[str, Any], name: str, device: str) -> StepTimeModel:
  """The step-time model of calibration model ``name`` on ``device`` (``measured`` or a preset).

  Args:
    calibration: ``benchmarks/cluster_time.py``'s JSON (its ``models``).
    name: the model in it (``"lm"``, ``"mnist"``).
    device: ``"measured"`` (the sweep's device curve) or a key of :data:`DEVICES`.

  Returns:
    The :class:`StepTimeModel`.

  Raises:
    ValueError: for a model the calibration lacks or an unknown device preset.

  Example:
    >>> calibration = {"models": {"m": {"gradient_bytes": 4e5, "host_s": 1e-3,
    ...   "flops_per_example": 1e6, "device_curve": {"overhead_s": 1e-3,
    ...   "seconds_per_example": 1e-5}}}}
    >>> step_model(calibration, "m", "measured").seconds(16, 1, LINKS["nvlink"])
    0.00216
  """
  models = calibration.get("models", {})
  if name not in models:
    raise ValueError(
      f"the calibration has no model {name!r}: use --model with one of {sorted(models)}"
    )
  figures = models[name]
  if device == "measured":
    curve = DeviceCurve(**{**figures["device_curve"], "source": "measured"})
  elif device in DEVICES:
    peak, utilization, overhead, source = DEVICES[device]
    curve = DeviceCurve.from_flops(
      figures["flops_per_example"], peak, utilization, overhead, source
    )
  else:
    raise ValueError(f"unknown --device {device!r}: use measured or one of {', '.join(DEVICES)}")
  return StepTimeModel(curve, figures["gradient_bytes"], figures["host_s"])


Point = tuple[int, int, float, float]  # (devices, batch size, measured seconds, host seconds)


def fit_cpu_model(points: Sequence[Point], cores: int) -> CpuStepModel:
  """The CPU model nearest ``points`` in relative error (least squares, parameters >= 0).

  Args:
    points: ``(devices, batch_size, measured_s, host_s)`` of each measured step time.
    cores: the cores the simulated devices share.

  Returns:
    The fitted :class:`CpuStepModel`.

  Example:
    >>> truth = CpuStepModel(1e-3, 1e-4, 5e-4, cores=2)
    >>> points = [(n, b, truth.seconds(b, n, 0.0), 0.0) for n in (1, 2, 4) for b in (8, 64)]
    >>> fit = fit_cpu_model(points, cores=2)
    >>> [round(v, 6) for v in (fit.overhead_s, fit.seconds_per_example, fit.collective_s)]
    [0.001, 0.0001, 0.0005]
    >>> round(fit.seconds_per_example_squared, 9)
    0.0
  """
  if len(points) < 4:
    raise ValueError(f"fitting the CPU model needs at least 4 points, got {len(points)}")
  rows = np.array([_cpu_row(b, n, cores) for n, b, _, _ in points])
  target = np.array([t - h for _, _, t, h in points])
  weights = 1.0 / np.array([t for _, _, t, _ in points])
  free = [0, 1, 2, 3]
  while True:  # least squares, a parameter that comes out negative held at 0
    solution = np.zeros(4)
    coef, *_ = np.linalg.lstsq(rows[:, free] * weights[:, None], target * weights, rcond=None)
    solution[free] = coef
    negative = [i for i in free if solution[i] < 0]
    if not negative:
      break
    free.remove(min(negative, key=lambda i: solution[i]))
  overhead, per_example, collective, squared = map(float, solution)
  return CpuStepModel(overhead, per_example, collective, cores, squared)


def leave_one_out(points: Sequence[Point], cores: int) -> list[float]:
  """Each point's step time predicted by the CPU model fitted to the other points.

  Example:
    >>> truth = CpuStepModel(1e-3, 1e-4, 5e-4, cores=2)
    >>> points = [(n, b, truth.seconds(b, n, 0.0), 0.0) for n in (1, 2, 4) for b in (8, 64)]
    >>> [round(p / q[2], 6) for p, q in zip(leave_one_out(points, 2), points, strict=True)]
    [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
  """
  predictions = []
  for i, (devices, batch, _, host) in enumerate(points):
    others = [p for j, p in enumerate(points) if j != i]
    predictions.append(fit_cpu_model(others, cores).seconds(batch, devices, host))
  return predictions
