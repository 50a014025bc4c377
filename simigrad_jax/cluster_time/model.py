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
devices' compute does not run side by side as on a cluster. One device alone
already spreads its examples over ``device_parallelism`` cores (XLA:CPU's
intra-op threads), so ``N`` devices compute their examples only
``speedup = min(N x device_parallelism, cores) / device_parallelism`` times
as fast as one; their fixed times are serialised over ``min(N, cores)``
cores; their collective is a copy in memory whose cost grows with the
devices taking part; and a step has a fixed launch that does not:

  ``host_s + launch_s + N x overhead_s / min(N, cores)
  + (B x seconds_per_example + B x (B / N) x seconds_per_example_squared) / speedup
  + (N - 1) x collective_s``

The square term holds an example's cost growing with the rows a device
holds (a 2-layer LM's activations outgrowing the CPU's caches).

One device alone takes ``launch_s + overhead_s + rows x seconds_per_example
+ rows^2 x seconds_per_example_squared`` (:meth:`CpuStepModel.device_curve`),
the part the cluster prediction takes; ``collective_s`` is the CPU's own and
is not carried over.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.optimize

from simigrad_jax import validation

__all__ = [
  "CpuStepModel",
  "DEVICES",
  "DeviceCurve",
  "LINKS",
  "Link",
  "StepTimeModel",
  "fit_cpu_model",
  "ring_allreduce_seconds",
  "step_model",
]


def _check_figures(figures: Any, names: Sequence[str], above_zero: bool = False) -> None:
  """Sets each of ``names`` on the frozen dataclass ``figures`` to its value as a float, if it is
  a finite number >= 0 (> 0 with ``above_zero``); else a ValueError naming it (``Link.bandwidth``).
  """
  for name in names:
    value = validation.check_interval(
      f"{type(figures).__name__}.{name}", getattr(figures, name), 0, low_open=above_zero
    )
    object.__setattr__(figures, name, value)


@dataclasses.dataclass(frozen=True)
class Link:
  """The slowest link on the all-reduce's ring.

  Attributes:
    bandwidth: bytes per second one way, a finite number > 0.
    latency: seconds per ring step (a message's fixed cost), a finite number >= 0.
    source: where the figures come from.

  Raises:
    ValueError: naming the figure, for one out of its range (NumPy's numbers
      are taken as Python's floats).
  """

  bandwidth: float
  latency: float
  source: str = "given"

  def __post_init__(self) -> None:
    _check_figures(self, ("bandwidth",), above_zero=True)
    _check_figures(self, ("latency",))

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

  Raises:
    ValueError: naming the figure, for one that is not a finite number >= 0
      (NumPy's numbers are taken as Python's floats).
  """

  overhead_s: float
  seconds_per_example: float
  source: str = "given"
  seconds_per_example_squared: float = 0.0

  def __post_init__(self) -> None:
    _check_figures(self, ("overhead_s", "seconds_per_example", "seconds_per_example_squared"))

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

  Raises:
    ValueError: for ``devices`` that is not an integer >= 1.

  Example:
    >>> ring_allreduce_seconds(1e6, 4, Link(1e9, 1e-5))  # 1.5 ms + 60 us
    0.00156
  """
  devices = validation.check_int("devices", devices, 1)
  steps = 2 * (devices - 1)
  return round(float(steps / devices * nbytes / link.bandwidth + steps * link.latency), 15)


@dataclasses.dataclass(frozen=True)
class StepTimeModel:
  """A data-parallel step's seconds on a cluster (see the module).

  Attributes:
    device: one device's compute curve.
    gradient_bytes: the bytes of the gradient every step all-reduces.
    host_s: the host's critical path a step.

  Raises:
    ValueError: naming the figure, for a ``gradient_bytes`` or ``host_s``
      that is not a finite number >= 0 (NumPy's numbers are taken as
      Python's floats).
  """

  device: DeviceCurve
  gradient_bytes: float
  host_s: float = 0.0

  def __post_init__(self) -> None:
    _check_figures(self, ("gradient_bytes", "host_s"))

  def seconds(self, batch_size: float, devices: int, link: Link) -> float:
    """A step of ``batch_size`` examples on ``devices`` over ``link``.

    Raises:
      ValueError: for ``devices`` that is not an integer >= 1.

    Example:
      >>> model = StepTimeModel(DeviceCurve(1e-3, 1e-4), 1e6, host_s=2e-4)
      >>> round(model.seconds(64, 4, Link(1e9, 1e-5)), 6)  # 0.2 + 1 + 1.6 + 1.56 ms
      0.00436
    """
    devices = validation.check_int("devices", devices, 1)
    rows = math.ceil(batch_size / devices - 1e-9)
    return float(
      self.host_s
      + self.device.seconds(rows)
      + ring_allreduce_seconds(self.gradient_bytes, devices, link)
    )


@dataclasses.dataclass(frozen=True)
class CpuStepModel:
  """A step's seconds on ``N`` simulated CPU devices sharing ``cores`` (see the module).

  Attributes:
    overhead_s: each device's fixed time a step.
    seconds_per_example: one device's time an example, as it runs alone.
    collective_s: the collective's time per device beyond the first.
    cores: the cores the devices' work is spread over.
    seconds_per_example_squared: the growth of an example's cost with the rows.
    launch_s: the step's fixed time that does not grow with the devices.
    device_parallelism: the cores one device's compute keeps busy alone (XLA:CPU's
      intra-op threads), from 1 to ``cores``.
  """

  overhead_s: float
  seconds_per_example: float
  collective_s: float
  cores: int
  seconds_per_example_squared: float = 0.0
  launch_s: float = 0.0
  device_parallelism: float = 1.0

  def seconds(self, batch_size: float, devices: int, host_s: float) -> float:
    """A step of ``batch_size`` examples on ``devices`` simulated devices.

    Example:
      >>> CpuStepModel(1e-3, 1e-4, 5e-4, cores=2).seconds(64, 4, host_s=0.0)  # (4 + 6.4)/2 + 1.5 ms
      0.0067
    """
    row = _cpu_row(batch_size, devices, self.cores, self.device_parallelism)
    return round(host_s + float(row @ self._coefficients()), 15)

  def _coefficients(self) -> np.ndarray:
    return np.array(
      [
        self.overhead_s,
        self.seconds_per_example,
        self.collective_s,
        self.seconds_per_example_squared,
        self.launch_s,
      ]
    )

  def device_curve(self) -> DeviceCurve:
    """One device's curve as it runs alone, the part a cluster prediction takes."""
    return DeviceCurve(
      self.overhead_s + self.launch_s,
      self.seconds_per_example,
      "measured: one simulated CPU device of the sweep",
      self.seconds_per_example_squared,
    )

  def as_dict(self) -> dict[str, float]:
    return dataclasses.asdict(self)


def _cpu_row(batch_size: float, devices: int, cores: int, device_parallelism: float) -> np.ndarray:
  """The CPU model's terms for one point, the coefficients of its five parameters.

  The devices' fixed times are serialised over ``min(N, cores)`` cores; their
  examples' compute, which one device alone spreads over ``device_parallelism``
  cores, runs ``min(N x device_parallelism, cores) / device_parallelism`` times
  as fast as one device's.
  """
  rows = batch_size / devices
  speedup = min(devices * device_parallelism, cores) / device_parallelism
  return np.array(
    [
      devices / min(devices, cores),
      batch_size / speedup,
      devices - 1.0,
      batch_size * rows / speedup,
      1.0,
    ]
  )


def step_model(calibration: dict[str, Any], name: str, device: str) -> StepTimeModel:
  """The step-time model of calibration model ``name`` on ``device`` (``measured`` or a preset).

  Args:
    calibration: ``benchmarks/cluster/cluster_time.py``'s JSON (its ``models``).
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


def fit_cpu_model(
  points: Sequence[Point], cores: int, device_parallelism: float | None = None
) -> CpuStepModel:
  """The CPU model nearest ``points`` in relative error (non-negative least squares).

  Args:
    points: ``(devices, batch_size, measured_s, host_s)`` of each measured step time.
    cores: the cores the simulated devices share.
    device_parallelism: the cores one device keeps busy; ``None`` tries 1 to ``cores`` in
      quarters and keeps the one whose fit is off least at its worst point.

  Returns:
    The fitted :class:`CpuStepModel`.

  Raises:
    ValueError: for fewer points than the model's 5 parameters, or a ``device_parallelism``
      outside 1 to ``cores``.

  Example:
    >>> truth = CpuStepModel(1e-3, 1e-4, 5e-4, cores=2, launch_s=2e-4, device_parallelism=1.5)
    >>> points = [(n, b, truth.seconds(b, n, 0.0), 0.0) for n in (1, 2, 4) for b in (8, 64)]
    >>> fit = fit_cpu_model(points, cores=2)
    >>> [round(v, 6) for v in (fit.overhead_s, fit.seconds_per_example, fit.collective_s)]
    [0.001, 0.0001, 0.0005]
    >>> round(fit.launch_s, 6), fit.device_parallelism
    (0.0002, 1.5)
  """
  if len(points) < 5:
    raise ValueError(f"fitting the CPU model needs at least 5 points, got {len(points)}")
  if device_parallelism is None:
    fits = [fit_cpu_model(points, cores, p) for p in np.linspace(1, cores, 4 * cores - 3)]
    return min(fits, key=lambda fit: _worst_error(fit, points))
  if not 1 <= device_parallelism <= cores:
    raise ValueError(
      f"device_parallelism must be from 1 to cores={cores}, got {device_parallelism}"
    )
  rows = np.array([_cpu_row(b, n, cores, device_parallelism) for n, b, _, _ in points])
  target = np.array([t - h for _, _, t, h in points])
  weights = 1.0 / np.array([t for _, _, t, _ in points])
  solution, _ = scipy.optimize.nnls(rows * weights[:, None], target * weights)
  overhead, per_example, collective, squared, launch = map(float, solution)
  return CpuStepModel(
    overhead, per_example, collective, cores, squared, launch, float(device_parallelism)
  )


def _worst_error(model: CpuStepModel, points: Sequence[Point]) -> float:
  """The model's largest relative error over ``points``."""
  return max(abs(model.seconds(b, n, h) / t - 1) for n, b, t, h in points)
