"""Host: the batch-size trajectories up to a target, of a comparison's settings or of runs' metrics.

A trajectory is a list of ``(steps, batch_size)`` segments: the steps a run
took at each batch size until it reached the target. A setting
(:class:`Setting`) holds the trajectories of its seeds that reached it.

* A Pareto JSON of the image task (``benchmarks/pareto/pareto.py``,
  ``pareto_mnist.json``): every run trains the same epochs; of the settings
  the comparison reports (``groups`` marked ``selected``: each one's
  learning rate chosen by validation accuracy), one reaches the target when
  its seeds' mean test accuracy is within the comparison's tolerance of the
  best constant batch's (``summary``), and
  its trajectory is the whole run, from the run's ``trace`` (the batch
  size averaged over each stretch of epochs: a stretch's steps are its
  examples over that average), or its steps at its average batch where the
  run kept no trace.
* A Pareto JSON of the LM (``pareto_lm.json``): a seed reaches the target at
  its ``steps_to_target`` (the validation loss's target); its trajectory is
  its ``batch_sizes`` trace (``[step, size]`` points) up to that step.
* ``metrics.jsonl`` files (:func:`settings_from_metrics`): each run a
  setting, its every step up to its last (the run's end is its target),
  and, for a run whose batch moved, the same examples at a constant batch of
  its average, assuming (which only a run can show) that it would reach the
  same target.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any

from simigrad_jax.trainer.metrics import read_metrics

__all__ = [
  "Setting",
  "kind_of",
  "load_settings",
  "settings_from_metrics",
  "settings_from_pareto",
]

Trajectory = list[tuple[float, float]]  # (steps, batch size) segments

_RAMPS = {
  "geometric",
  "linear",
  "loss_plateau",
  "step_schedule",
  "linear_ramp",
  "doubling_warmup",
  "seesaw",
}


def kind_of(controller: str) -> str:
  """A controller's family in the answer: ``constant``, ``ramp``, ``simigrad`` or ``adaptive``.

  Example:
    >>> [kind_of(c) for c in ("fixed", "seesaw", "simigrad", "gns")]
    ['constant', 'ramp', 'simigrad', 'adaptive']
  """
  if controller == "fixed":
    return "constant"
  if controller in _RAMPS:
    return "ramp"
  return "simigrad" if controller == "simigrad" else "adaptive"


@dataclasses.dataclass
class Setting:
  """One setting of a comparison and the trajectories of its runs that reached the target.

  Attributes:
    label: the setting as the comparison names it.
    kind: ``constant``, ``ramp``, ``simigrad`` or ``adaptive`` (:func:`kind_of`).
    trajectories: each reaching run's ``(steps, batch_size)`` segments.
    runs: the setting's runs, reached or not.
  """

  label: str
  kind: str
  trajectories: list[Trajectory]
  runs: int

  @property
  def reached(self) -> str:
    """``"k/n"``: of its ``n`` runs, ``k`` reached the target."""
    return f"{len(self.trajectories)}/{self.runs}"


def _segments(points: Sequence[tuple[float, float]], end: float) -> Trajectory:
  """``(position, size)`` points, each size holding until the next point, cut at ``end``."""
  segments = []
  for (start, size), (stop, _) in zip(points, [*points[1:], (end, 0.0)], strict=True):
    stop = min(stop, end)
    if stop > start:
      segments.append((stop - start, size))
  return segments


def _image_settings(result: dict[str, Any]) -> list[Setting]:
  summary = result["summary"]
  target = summary["best_fixed"]["test_accuracy"] - summary["tolerance_points"] / 100
  key = lambda r: json.dumps([r["controller"], r["label"], r.get("settings")], sort_keys=True)
  groups: dict[str, list[dict[str, Any]]] = {}
  for run in result["runs"]:
    groups.setdefault(key(run), []).append(run)
  # The settings the comparison reports: each one's learning rate chosen by validation.
  chosen = {key(g): g for g in result.get("groups", []) if g.get("selected")}
  settings = []
  for name, runs in groups.items():
    if chosen and name not in chosen:
      continue
    accuracy = sum(r["test_accuracy"] for r in runs) / len(runs)
    first = runs[0]
    trajectories = []
    if accuracy >= target:
      for run in runs:
        trace = run.get("trace")
        if not trace:  # a run recorded without its trace: its average batch throughout
          trajectories.append([(run["steps"], run["avg_batch_size"])])
          continue
        examples_per_epoch = run["examples"] / trace["epochs"][-1]
        epochs = [0.0, *trace["epochs"]]
        trajectories.append(
          [
            ((b - a) * examples_per_epoch / size, size)
            for a, b, size in zip(epochs[:-1], epochs[1:], trace["batch_size"], strict=True)
          ]
        )
    settings.append(Setting(first["label"], kind_of(first["controller"]), trajectories, len(runs)))
  return settings


def _lm_settings(result: dict[str, Any]) -> list[Setting]:
  groups: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
  for run in result["runs"]:
    groups.setdefault((run["controller"], run["setting"], run["learning_rate"]), []).append(run)
  settings = []
  for (controller, setting, lr), runs in groups.items():
    trajectories = [
      _segments([(float(s - 1), float(b)) for s, b in run["batch_sizes"]], run["steps_to_target"])
      for run in runs
      if run.get("steps_to_target") is not None
    ]
    settings.append(Setting(f"{setting} lr={lr:.3g}", kind_of(controller), trajectories, len(runs)))
  return settings


def settings_from_pareto(result: dict[str, Any]) -> list[Setting]:
  """A Pareto comparison's settings (the image task's or the LM's, told by their keys).

  Raises:
    ValueError: for a JSON that holds no runs with batch-size trajectories.
  """
  runs = result.get("runs") if isinstance(result, dict) else None
  if runs and "summary" in result and all("label" in r and "steps" in r for r in runs):
    return _image_settings(result)
  if runs and all("batch_sizes" in r and "steps_to_target" in r for r in runs):
    return _lm_settings(result)
  raise ValueError(
    "it holds no runs with batch-size trajectories: give a Pareto comparison's JSON "
    "(benchmarks/results/pareto_mnist.json or pareto_lm.json) or a run's metrics.jsonl"
  )


def settings_from_metrics(paths: Iterable[pathlib.Path]) -> list[Setting]:
  """Each run's metrics a setting, and a run whose batch moved also at its average, constant."""
  settings = []
  for path in paths:
    try:
      records = read_metrics(path)
    except ValueError as e:
      raise ValueError(f"{e}: give a Pareto JSON or the metrics.jsonl a Trainer wrote") from None
    sizes = [float(r["batch_size"]) for r in records if "batch_size" in r]
    if not sizes:
      raise ValueError(
        f"{path} holds no step records with a batch_size: give the metrics.jsonl a Trainer wrote"
      )
    name = pathlib.Path(path).parent.name or str(path)
    if len(set(sizes)) == 1:
      settings.append(
        Setting(f"{name} (B={sizes[0]:g})", "constant", [[(len(sizes), sizes[0])]], 1)
      )
      continue
    trajectory = [(1.0, size) for size in sizes]
    average = sum(sizes) / len(sizes)
    settings.append(Setting(name, "adaptive", [trajectory], 1))
    settings.append(
      Setting(
        f"{name} held at its average B={average:.1f}", "constant", [[(len(sizes), average)]], 1
      )
    )
  return settings


def load_settings(paths: Sequence[pathlib.Path]) -> list[Setting]:
  """The settings of one Pareto JSON, or of one or more ``metrics.jsonl`` files.

  Raises:
    ValueError: for a file that holds no trajectories, named with what to give instead.
  """
  if len(paths) == 1 and pathlib.Path(paths[0]).suffix == ".json":
    try:
      result = json.loads(pathlib.Path(paths[0]).read_text())
    except json.JSONDecodeError as e:
      raise ValueError(f"{paths[0]} is not JSON ({e})") from None
    try:
      return settings_from_pareto(result)
    except ValueError as e:
      raise ValueError(f"{paths[0]}: {e}") from None
  return settings_from_metrics(paths)
