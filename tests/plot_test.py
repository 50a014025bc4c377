"""Tests for simigrad_jax.plot: metrics.jsonl to PNG, from Python and the command line."""

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from simigrad_jax import plot
from simigrad_jax.plot import plot_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def write_jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


def synthetic_records(steps=60, seed=0):
  """A small run: steps with every plotted key and an evaluation every 20 steps."""
  rng = np.random.default_rng(seed)
  records, batch, seen = [], 32, 0
  for step in range(1, steps + 1):
    similarity = batch / (batch + 300) + 0.05 * rng.normal()
    seen += batch
    records.append(
      {
        "step": step,
        "batch_size": batch,
        "similarity": float(similarity),
        "lr_factor": math.sqrt(batch / 32),
        "loss": 2.0 * math.exp(-seen / 3000),
        "examples_seen": seen,
        "similarity_target": 0.1,
        "decision": "grow",
      }
    )
    batch = max(batch + 1, int(batch * 1.1)) if similarity < 0.1 else max(1, int(batch * 0.9))
    if step % 20 == 0:
      records.append({"step": step, "eval_accuracy": 1 - math.exp(-seen / 2000)})
  return records


def check_png(path):
  data = pathlib.Path(path).read_bytes()
  assert data[:8] == PNG_MAGIC
  assert len(data) > 10_000  # a drawing, not an empty canvas
  with Image.open(path) as image:
    image.verify()
  with Image.open(path) as image:
    pixels = np.asarray(image.convert("L"))
  assert pixels.std() > 5  # not a blank image
  return image.size


def panel_axes(monkeypatch):
  """Records the figure of the next plot_metrics call."""
  from matplotlib.figure import Figure

  figures = []
  original = Figure.savefig

  def savefig(self, *args, **kwargs):
    figures.append(self)
    return original(self, *args, **kwargs)

  monkeypatch.setattr(Figure, "savefig", savefig)
  return figures


def test_png_written(tmp_path):
  metrics = write_jsonl(tmp_path / "metrics.jsonl", synthetic_records())
  out = plot_metrics(metrics, tmp_path / "sub" / "plot.png", title="test run")
  assert out == tmp_path / "sub" / "plot.png"
  width, height = check_png(out)
  assert height > width  # four stacked panels


def test_panels_and_data(tmp_path, monkeypatch):
  figures = panel_axes(monkeypatch)
  records = synthetic_records()
  metrics = write_jsonl(tmp_path / "metrics.jsonl", records)
  plot_metrics(metrics, tmp_path / "plot.png", title="my title")
  (figure,) = figures
  assert figure.get_suptitle() == "my title"
  axes = [ax for ax in figure.axes if ax.get_visible()]
  labels = [ax.get_ylabel() for ax in axes]
  assert labels == [
    "global batch size",
    "similarity",
    "lr factor",
    "training loss",
    "eval accuracy",
  ]
  steps = [r for r in records if "batch_size" in r]
  batch_line = axes[0].get_lines()[0]
  np.testing.assert_array_equal(batch_line.get_xdata(), [r["examples_seen"] for r in steps])
  np.testing.assert_array_equal(batch_line.get_ydata(), [r["batch_size"] for r in steps])
  # The target from the records, as a horizontal line.
  target = [line for line in axes[1].get_lines() if line.get_label() == "target 0.1"]
  assert len(target) == 1 and list(target[0].get_ydata()) == [0.1, 0.1]
  # Evaluations are placed at the examples seen by their step.
  accuracy_line = axes[4].get_lines()[0]
  by_step = {r["step"]: r["examples_seen"] for r in steps}
  np.testing.assert_array_equal(accuracy_line.get_xdata(), [by_step[20], by_step[40], by_step[60]])
  assert axes[3].get_xlabel() == "examples seen"


def test_target_argument_overrides_records(tmp_path, monkeypatch):
  figures = panel_axes(monkeypatch)
  metrics = write_jsonl(tmp_path / "metrics.jsonl", synthetic_records())
  plot_metrics(metrics, tmp_path / "plot.png", similarity_target=0.25)
  labels = [line.get_label() for line in figures[0].axes[1].get_lines()]
  assert "target 0.25" in labels and "target 0.1" not in labels


def test_missing_keys_skipped(tmp_path, monkeypatch):
  figures = panel_axes(monkeypatch)
  # Only batch size and similarity, no examples_seen, a NaN written as null.
  records = [
    {"step": s, "batch_size": 10 + s, "similarity": None if s == 3 else 0.1 * s}
    for s in range(1, 6)
  ]
  metrics = write_jsonl(tmp_path / "metrics.jsonl", records)
  check_png(plot_metrics(metrics, tmp_path / "plot.png"))
  axes = figures[0].axes
  assert [ax.get_ylabel() for ax in axes] == ["global batch size", "similarity"]
  assert axes[-1].get_xlabel() == "step"
  similarity = axes[1].get_lines()
  assert len(similarity) == 1  # no target known: no line
  assert math.isnan(similarity[0].get_ydata()[2])


def test_accuracy_alone_gets_its_own_panel(tmp_path, monkeypatch):
  figures = panel_axes(monkeypatch)
  records = [
    {"step": 1, "examples_seen": 10, "eval_accuracy": 0.5},
    {"step": 2, "examples_seen": 20, "eval_accuracy": 0.7},
  ]
  metrics = write_jsonl(tmp_path / "metrics.jsonl", records)
  plot_metrics(metrics, tmp_path / "plot.png")
  axes = [ax for ax in figures[0].axes if ax.get_visible()]
  assert [ax.get_ylabel() for ax in axes] == ["eval accuracy"]


def test_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    plot_metrics(tmp_path / "missing.jsonl", tmp_path / "plot.png")
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  with pytest.raises(ValueError, match="holds no records"):
    plot_metrics(empty, tmp_path / "plot.png")
  other = write_jsonl(tmp_path / "other.jsonl", [{"step": 1, "foo": 2}])
  with pytest.raises(ValueError, match=r"none of the plotted keys.*'foo'"):
    plot_metrics(other, tmp_path / "plot.png")
  metrics = write_jsonl(tmp_path / "metrics.jsonl", synthetic_records(5))
  with pytest.raises(ValueError, match="similarity_target"):
    plot_metrics(metrics, tmp_path / "plot.png", similarity_target=2.0)
  assert not (tmp_path / "plot.png").exists()


def test_main_default_out(tmp_path, capsys):
  metrics = write_jsonl(tmp_path / "metrics.jsonl", synthetic_records())
  assert plot.main([str(metrics), "--target", "0.1", "--title", "cli"]) == 0
  assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'metrics.png'}"
  check_png(tmp_path / "metrics.png")


def test_main_errors(tmp_path, capsys):
  empty = tmp_path / "metrics.jsonl"
  empty.write_text("")
  with pytest.raises(SystemExit) as exit_info:
    plot.main([str(empty)])
  assert exit_info.value.code == 2
  assert "holds no records" in capsys.readouterr().err
  with pytest.raises(SystemExit) as exit_info:
    plot.main([str(tmp_path / "missing.jsonl")])
  assert exit_info.value.code == 2
  assert "does not exist" in capsys.readouterr().err


def test_cli_subprocess(tmp_path):
  metrics = write_jsonl(tmp_path / "metrics.jsonl", synthetic_records(20))
  out = tmp_path / "cli.png"
  env = {
    **os.environ,
    "PYTHONPATH": str(REPO_ROOT),
    "JAX_PLATFORMS": "cpu",
    "MPLBACKEND": "TkAgg",
    "DISPLAY": "",
  }  # no display is needed
  result = subprocess.run(
    [sys.executable, "-m", "simigrad_jax.plot", str(metrics), "--out", str(out)],
    capture_output=True,
    text=True,
    env=env,
    timeout=120,
    check=False,
  )
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == f"wrote {out}"
  check_png(out)
