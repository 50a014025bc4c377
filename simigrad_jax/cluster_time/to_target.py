"""Host: each setting's wall-clock to its target on a cluster, and where adapting starts to pay.

A setting's time to target on ``N`` devices over a link is the sum, over its
trajectory's segments, of the steps times the step time
(:meth:`StepTimeModel.seconds`), averaged over the runs that reached the
target. Per family (constant batches, ramps, SimiGrad, other adaptive
controllers) the answer keeps the fastest setting; the crossover is where
SimiGrad's fastest beats the fastest constant batch: the fewest devices, per
link, from which on it is faster at every larger count, and, per device
count, the highest bandwidth at which it is faster (the link's latency held).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from simigrad_jax import validation
from simigrad_jax.cluster_time.model import Link
from simigrad_jax.cluster_time.model import StepTimeModel
from simigrad_jax.cluster_time.runs import Setting
from simigrad_jax.cluster_time.runs import Trajectory

__all__ = [
  "DEVICE_COUNTS",
  "KINDS",
  "answer",
  "format_answer",
  "plot_answers",
  "time_to_target",
]

DEVICE_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024)
KINDS = ("constant", "ramp", "simigrad", "adaptive")
# The bandwidths the crossover is looked for at, bytes per second (10 MB/s to 10 TB/s).
_BANDWIDTHS = np.logspace(7, 13, 61)


def trajectory_seconds(
  trajectory: Trajectory, model: StepTimeModel, devices: int, link: Link
) -> float:
  """One run's seconds: its segments' steps times their step time."""
  return sum(steps * model.seconds(size, devices, link) for steps, size in trajectory)


def time_to_target(setting: Setting, model: StepTimeModel, devices: int, link: Link) -> float:
  """A setting's wall-clock to its target, the mean over its runs that reached it (nan: none did).

  Raises:
    ValueError: for ``devices`` that is not an integer >= 1 (NumPy's integers
      are taken as Python's).

  Example:
    >>> from simigrad_jax.cluster_time.model import DeviceCurve
    >>> model = StepTimeModel(DeviceCurve(1e-3, 0.0), 0.0)
    >>> time_to_target(Setting("B=16", "constant", [[(100, 16)]], 1), model, 8, Link(1e9, 0.0))
    0.1
  """
  devices = validation.check_int("devices", devices, 1)
  if not setting.trajectories:
    return math.nan
  times = [trajectory_seconds(t, model, devices, link) for t in setting.trajectories]
  return float(sum(times) / len(times))


def _best(settings: Sequence[Setting], model: StepTimeModel, devices: int, link: Link) -> dict:
  """Per family, the fastest setting that reached the target: ``{kind: (seconds, label)}``."""
  best: dict[str, tuple[float, str]] = {}
  for s in settings:
    seconds = time_to_target(s, model, devices, link)
    if not math.isnan(seconds) and (s.kind not in best or seconds < best[s.kind][0]):
      best[s.kind] = (seconds, s.label)
  return best


def _pays(
  settings: Sequence[Setting], model: StepTimeModel, devices: int, link: Link
) -> bool | None:
  best = _best(settings, model, devices, link)
  if "simigrad" not in best or "constant" not in best:
    return None
  return best["simigrad"][0] < best["constant"][0]


def _crossover(
  settings: Sequence[Setting], model: StepTimeModel, devices: Sequence[int], link: Link
) -> dict[str, Any]:
  pays = [_pays(settings, model, n, link) for n in devices]
  if any(p is None for p in pays):
    return {
      "devices": None,
      "bandwidth_by_devices": None,
      "note": "no SimiGrad or no constant setting reached the target",
    }
  first = None
  for i in range(len(devices)):
    if all(pays[i:]):
      first = devices[i]
      break
  by_devices: dict[str, float | None] = {}
  for n in devices:
    paying = [
      bw
      for bw in _BANDWIDTHS
      if _pays(settings, model, n, Link(float(bw), link.latency, link.source))
    ]
    if not paying:
      by_devices[str(n)] = None  # at no bandwidth
    elif paying[-1] == _BANDWIDTHS[-1]:
      by_devices[str(n)] = math.inf  # at every bandwidth
    else:
      by_devices[str(n)] = float(paying[-1])
  return {"devices": first, "bandwidth_by_devices": by_devices}


def answer(
  settings: Sequence[Setting],
  model: StepTimeModel,
  links: dict[str, Link],
  devices: Sequence[int] = DEVICE_COUNTS,
) -> dict[str, Any]:
  """Every reaching setting's time to target per device count and link, the fastest per family
  and the crossover.

  Args:
    settings: the comparison's settings (:mod:`simigrad_jax.cluster_time.runs`).
    model: the step-time model of the comparison's model on the cluster's devices.
    links: the links to answer for, by name.
    devices: the device counts, a non-empty sequence of integers >= 1 (NumPy's
      integers are taken as Python's).

  Returns:
    ``{"devices", "links", "settings": [{label, kind, reached, seconds: {link: [...]}}],
    "best": {link: {kind: [{"label", "seconds"}, ...]}} (per device count), "crossover": {link:
    ...}, "fewest_seconds": {link: {kind: {"devices", "seconds"}}}}`` (the device count at which
    each family's fastest time is least);
    JSON's ``Infinity`` for a crossover at every bandwidth.

  Raises:
    ValueError: for ``devices`` that is empty or holds a count that is not an
      integer >= 1, naming it.
  """
  devices = _checked_device_counts(devices)
  rows = []
  for s in settings:
    if not s.trajectories:
      continue
    rows.append(
      {
        "label": s.label,
        "kind": s.kind,
        "reached": s.reached,
        "steps": sum(sum(n for n, _ in t) for t in s.trajectories) / len(s.trajectories),
        "seconds": {
          name: [time_to_target(s, model, n, link) for n in devices] for name, link in links.items()
        },
      }
    )
  best: dict[str, dict[str, list[Any]]] = {}
  for name, link in links.items():
    per_n = [_best(settings, model, n, link) for n in devices]
    best[name] = {
      kind: [{"label": b[kind][1], "seconds": b[kind][0]} if kind in b else None for b in per_n]
      for kind in KINDS
      if any(kind in b for b in per_n)
    }
  return {
    "devices": list(devices),
    "links": {name: link.as_dict() for name, link in links.items()},
    "model": {
      "device": model.device.as_dict(),
      "gradient_bytes": model.gradient_bytes,
      "host_s": model.host_s,
    },
    "settings": rows,
    "best": best,
    "crossover": {name: _crossover(settings, model, devices, link) for name, link in links.items()},
    "fewest_seconds": {
      name: {
        kind: min(
          (
            {"devices": n, "seconds": e["seconds"]}
            for n, e in zip(devices, entries, strict=True)
            if e
          ),
          key=lambda x: x["seconds"],
        )
        for kind, entries in families.items()
      }
      for name, families in best.items()
    },
  }


def _checked_device_counts(devices: Any) -> list[int]:
  """``devices`` as a list of ints, each >= 1; a ValueError naming the first that is not."""
  is_sequence = isinstance(devices, (Sequence, np.ndarray)) and not isinstance(devices, str)
  if not is_sequence or len(devices) == 0:
    raise ValueError(f"devices must be a non-empty sequence of integers >= 1, got {devices!r:.200}")
  return [validation.check_int(f"devices[{i}]", n, 1) for i, n in enumerate(devices)]


def _bandwidth(value: float | None) -> str:
  if value is None:
    return "at no bandwidth"
  if math.isinf(value):
    return "at every bandwidth"
  return f"below {value / 1e9:.3g} GB/s"


def format_answer(result: dict[str, Any]) -> str:
  """The answer as a table: the fastest of each family's time to target, and the crossover."""
  devices = result["devices"]
  lines = []
  for name, families in result["best"].items():
    link = result["links"][name]
    lines.append(
      f"{name}: {link['bandwidth'] / 1e9:g} GB/s, {link['latency'] * 1e6:g} us a ring step"
    )
    lines.append(f"  {'devices':>8s} " + " ".join(f"{n:>9d}" for n in devices))
    for kind, entries in families.items():
      cells = " ".join("        -" if e is None else f"{e['seconds']:9.3g}" for e in entries)
      lines.append(f"  {kind:>8s} {cells}  s")
    for kind, entries in families.items():
      labels = sorted({e["label"] for e in entries if e is not None})
      lines.append(f"    fastest {kind}: {'; '.join(labels)}")
    fewest = result["fewest_seconds"][name]
    lines.append(
      "  least time at: "
      + ", ".join(
        f"{kind} {f['devices']} devices ({f['seconds']:.3g} s)" for kind, f in fewest.items()
      )
    )
    cross = result["crossover"][name]
    if cross.get("bandwidth_by_devices") is None:
      lines.append(f"  crossover: none ({cross['note']})")
      continue
    first = cross["devices"]
    where = f"from {first} devices on" if first is not None else "not at every count from any on"
    lines.append(f"  SimiGrad beats the fastest constant batch {where}; by devices, it pays:")
    lines.append(
      "    " + ", ".join(f"{n}: {_bandwidth(v)}" for n, v in cross["bandwidth_by_devices"].items())
    )
  return "\n".join(lines)


def plot_answers(answers: dict[str, dict[str, Any]], path: str, links: Sequence[str]) -> None:
  """Time to target against device count, one panel per comparison, a line style per link.

  Args:
    answers: ``{title: answer(...)}``.
    path: the PNG to write.
    links: the links to draw (two: solid and dashed).
  """
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  colors = {
    "constant": "tab:gray",
    "ramp": "tab:orange",
    "simigrad": "tab:blue",
    "adaptive": "tab:green",
  }
  styles = ["-", "--", ":"]
  fig, axes = plt.subplots(1, len(answers), figsize=(5.5 * len(answers), 4.2), squeeze=False)
  for ax, (title, result) in zip(axes[0], answers.items(), strict=True):
    for style, name in zip(styles, links, strict=False):
      for kind, entries in result["best"][name].items():
        xs = [n for n, e in zip(result["devices"], entries, strict=True) if e is not None]
        ys = [e["seconds"] for e in entries if e is not None]
        ax.plot(xs, ys, style, color=colors[kind], marker="o", ms=3, label=f"{kind}, {name}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices")
    ax.set_ylabel("seconds to the target (fastest setting)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
