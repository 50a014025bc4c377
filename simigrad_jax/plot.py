"""Plots a run's metrics.jsonl: batch size, similarity, learning-rate factor, loss.

Host side; uses Matplotlib's Agg canvas directly (no pyplot, no display, and
the process's Matplotlib backend is left alone).

From the command line::

  python -m simigrad_jax.plot /tmp/run/metrics.jsonl --target 0.1
  # wrote /tmp/run/metrics.png

Keys read (each optional; a panel is drawn for those present): ``batch_size``
(or ``global_batch_size``), ``similarity`` (and ``similarity_target``),
``lr_factor``, ``loss`` and ``eval_accuracy``, against ``examples_seen``.
Records without ``examples_seen`` (e.g. evaluations) are placed at the
``examples_seen`` of the last record with the same or an earlier step; a file
without any ``examples_seen`` is plotted against ``step``.
"""

from __future__ import annotations

import argparse
import bisect
import io
import math
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

from simigrad_jax import files
from simigrad_jax import validation
from simigrad_jax.trainer.metrics import read_metrics

__all__ = ["main", "plot_metrics"]

BATCH_KEYS: tuple[str, ...] = ("batch_size", "global_batch_size")
PLOTTED_KEYS: tuple[str, ...] = (*BATCH_KEYS, "similarity", "lr_factor", "loss", "eval_accuracy")


def _number(value: Any) -> float | None:
  """A record value as a float (None, the file's NaN, becomes NaN), else None."""
  if value is None:
    return math.nan
  if validation.is_bool(value) or not validation.is_real(value):
    return None
  return float(value)


def _series(
  records: list[dict[str, Any]], xs: list[float], key: str
) -> tuple[list[float], list[float]]:
  """The (x, value) pairs of the records that have a numeric ``key``."""
  pairs = [(x, _number(r[key])) for r, x in zip(records, xs, strict=True) if key in r]
  points = [(x, y) for x, y in pairs if y is not None]
  return [x for x, _ in points], [y for _, y in points]


def _examples_seen(record: dict[str, Any]) -> float | None:
  value = record.get("examples_seen")
  return float(value) if validation.is_real(value) else None


def _x_positions(records: list[dict[str, Any]]) -> tuple[list[float], str]:
  """Each record's position on the x axis, and the axis label."""
  known = sorted(
    (r["step"], _examples_seen(r))
    for r in records
    if validation.is_int(r.get("step")) and _examples_seen(r) is not None
  )
  if not known:
    return [
      float(r["step"]) if validation.is_int(r.get("step")) else math.nan for r in records
    ], "step"
  steps = [step for step, _ in known]
  xs = []
  for r in records:
    seen = _examples_seen(r)
    if seen is None and validation.is_int(r.get("step")):
      i = bisect.bisect_right(steps, r["step"])  # the last known step <= this one
      seen = known[i - 1][1] if i else 0.0
    xs.append(math.nan if seen is None else seen)
  return xs, "examples seen"


def _similarity_target(
  records: list[dict[str, Any]], similarity_target: float | None
) -> float | None:
  if similarity_target is not None:
    return validation.check_real(
      "similarity_target", similarity_target, "[-1, 1]", lambda x: -1.0 <= x <= 1.0
    )
  for r in reversed(records):
    value = _number(r.get("similarity_target"))
    if value is not None and math.isfinite(value):
      return value
  return None


def plot_metrics(
  metrics_path: str | os.PathLike,
  png_path: str | os.PathLike,
  *,
  similarity_target: float | None = None,
  title: str | None = None,
) -> pathlib.Path:
  """Draws a run's batch size, similarity, learning-rate factor and loss to a PNG.

  One panel per quantity present, against examples seen: the global batch
  size; the similarity with its target as a dashed line; the learning-rate
  factor; the training loss with the evaluation accuracy on a twin axis (its
  own panel if there is no loss). Missing keys are skipped; NaN values
  (written as null) leave gaps.

  Args:
    metrics_path: a metrics.jsonl (see :class:`simigrad_jax.trainer.metrics.MetricsWriter`).
    png_path: the PNG to write; its folder is created if missing.
    similarity_target: the target to draw; by default the last
      ``similarity_target`` found in the records, if any.
    title: the figure title (default: the metrics file's path).

  Returns:
    ``png_path`` as a :class:`pathlib.Path`.

  Raises:
    FileNotFoundError: if ``metrics_path`` does not exist.
    ValueError: if it holds no records, or none of the keys plotted.

  Example:
    >>> plot_metrics("run/metrics.jsonl", "run/plot.png", title="run")  # doctest: +SKIP
    PosixPath('run/plot.png')
  """
  metrics_path = pathlib.Path(metrics_path)
  png_path = pathlib.Path(png_path)
  if not metrics_path.is_file():
    raise FileNotFoundError(f"metrics file {str(metrics_path)!r} does not exist")
  records = read_metrics(metrics_path)
  if not records:
    raise ValueError(f"metrics file {str(metrics_path)!r} holds no records")
  target = _similarity_target(records, similarity_target)
  xs, x_label = _x_positions(records)

  series = {key: _series(records, xs, key) for key in PLOTTED_KEYS}
  batch_key = next((k for k in BATCH_KEYS if series[k][0]), None)
  panels = [
    name
    for name, present in (
      ("batch", batch_key is not None),
      ("similarity", bool(series["similarity"][0])),
      ("lr_factor", bool(series["lr_factor"][0])),
      ("loss", bool(series["loss"][0] or series["eval_accuracy"][0])),
    )
    if present
  ]
  if not panels:
    found = sorted({k for r in records for k in r})
    raise ValueError(
      f"metrics file {str(metrics_path)!r} has none of the plotted keys "
      f"{list(PLOTTED_KEYS)}; its keys are {found}"
    )

  # Imported here so that importing this module stays cheap.
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  figure = Figure(figsize=(9, 1.0 + 2.3 * len(panels)), layout="constrained")
  FigureCanvasAgg(figure)
  axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
  for ax, panel in zip(axes, panels, strict=True):
    ax.grid(True, alpha=0.3)
    if panel == "batch" and batch_key is not None:
      x, y = series[batch_key]
      ax.plot(x, y, drawstyle="steps-post", color="tab:blue")
      ax.set_ylabel("global batch size")
    elif panel == "similarity":
      x, y = series["similarity"]
      ax.plot(x, y, color="tab:orange", linewidth=0.8, label="similarity")
      if target is not None:
        ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target:g}")
        ax.legend(loc="best", fontsize="small")
      ax.set_ylabel("similarity")
    elif panel == "lr_factor":
      x, y = series["lr_factor"]
      ax.plot(x, y, drawstyle="steps-post", color="tab:green")
      ax.set_ylabel("lr factor")
    else:
      accuracy_ax = ax
      if series["loss"][0]:
        x, y = series["loss"]
        ax.plot(x, y, color="tab:red", linewidth=0.8, label="loss")
        ax.set_ylabel("training loss", color="tab:red")
        finite = [v for v in y if math.isfinite(v)]
        if finite and min(finite) > 0 and max(finite) / min(finite) > 100:
          ax.set_yscale("log")
        accuracy_ax = ax.twinx()
      if series["eval_accuracy"][0]:
        x, y = series["eval_accuracy"]
        accuracy_ax.plot(x, y, color="tab:purple", marker="o", markersize=3, label="eval accuracy")
        accuracy_ax.set_ylabel("eval accuracy", color="tab:purple")
      elif accuracy_ax is not ax:
        accuracy_ax.set_visible(False)
  axes[-1].set_xlabel(x_label)
  figure.suptitle(str(metrics_path) if title is None else title)
  png_path.parent.mkdir(parents=True, exist_ok=True)
  image = io.BytesIO()
  figure.savefig(image, dpi=110, format="png")
  return files.write_atomic(png_path, image.getvalue())


def main(argv: Sequence[str] | None = None) -> int:
  """The command line: ``python -m simigrad_jax.plot METRICS.jsonl [--out PNG]``."""
  parser = argparse.ArgumentParser(
    prog="python -m simigrad_jax.plot",
    description="Plot a SimiGrad run's metrics.jsonl (batch size, similarity, "
    "learning-rate factor, loss) to a PNG.",
  )
  parser.add_argument("metrics", type=pathlib.Path, help="the metrics.jsonl to plot")
  parser.add_argument(
    "--out",
    type=pathlib.Path,
    default=None,
    help="the PNG to write (default: the metrics file with a "
    ".png suffix, i.e. metrics.png next to metrics.jsonl)",
  )
  parser.add_argument(
    "--target",
    type=float,
    default=None,
    help="the similarity target to draw (default: from the records)",
  )
  parser.add_argument("--title", default=None, help="the figure title")
  args = parser.parse_args(argv)
  out = args.out if args.out is not None else args.metrics.with_suffix(".png")
  try:
    written = plot_metrics(args.metrics, out, similarity_target=args.target, title=args.title)
  except (OSError, ValueError) as e:
    parser.exit(2, f"{parser.prog}: error: {e}\n")
  print(f"wrote {written}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
