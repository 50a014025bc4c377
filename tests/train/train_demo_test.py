"""The README's main command: the digits demo trains for real, adapts its batch size and reports."""

import json
import pathlib
import re

import simigrad_jax
from train import train
from train.configs import digits_demo

STEP_KEYS = {"step", "batch_size", "similarity", "lr_factor", "loss", "examples_seen", "epoch"}
README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def line_names(output: str) -> list[str]:
  """The names of a run's start lines and summary rows: ``devices``, ..., ``final test accuracy``, ...."""
  lines = output.splitlines()
  start = [line.split(":")[0].strip() for line in lines if line.startswith("  ") and ":" in line]
  last_epoch = max(i for i, line in enumerate(lines) if line.startswith("epoch "))
  rows = [re.split(r"\s{2,}", line)[0] for line in lines[last_epoch + 1 :] if line.strip()]
  return start + rows


def readme_output() -> str:
  """The demo's output that README's Quick start shows."""
  return re.search(r"^```text\n(simigrad-jax: .*?)^```", README.read_text(), re.S | re.M).group(1)


def test_digits_demo_reaches_its_accuracy_and_writes_its_files(tmp_path, capsys, monkeypatch):
  config = digits_demo.get_config()
  config.progress = False
  cache = tmp_path / "cache"
  monkeypatch.setenv("SIMIGRAD_JAX_CACHE_DIR", str(cache))  # the user's shared cache, by default
  with (
    simigrad_jax.compile.persistent_cache_settings()
  ):  # the run's cache settings are process-wide
    summary = train.train_and_evaluate(config, tmp_path)
  # Measured with the default config on 8 simulated CPU devices: final test accuracy
  # 0.976 (seed 0), 0.976 (1), 0.970 (2), 0.980 (3), 0.980 (4) of 297 images (README's
  # Quick start shows one whole run of seed 0). The margin allows a different CPU's
  # rounding to take another path.
  assert summary["eval_accuracy"] >= 0.95

  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in records if "batch_size" in r]
  evals = [r for r in records if "eval_accuracy" in r]
  assert all(STEP_KEYS <= set(r) for r in steps)
  assert (
    [r["step"] for r in steps]
    == list(range(1, len(steps) + 1))
    == list(range(1, summary["steps"] + 1))
  )
  assert sum(r["batch_size"] for r in steps) == summary["examples_seen"] == 15 * 1500
  assert [r["epoch"] for r in evals] == list(range(15))
  sizes = [r["batch_size"] for r in steps]
  assert len(set(sizes)) > 20 and max(sizes) > 4 * 32  # SimiGrad grew the batch as it trained
  assert summary["average_batch_size"] > 32
  assert 0.0 <= summary["padding_fraction"] < 0.25  # of the rows computed, on the shape grid
  # Each program runs a first time in the run (the fallback's too): a step whose programs (one
  # fused step, or a micro-step per shape and the update) did not all run before.
  run_before: set = set()
  for r in steps:
    shapes = r["micro_batch_sizes"]
    assert r["micro_batch_size"] == shapes[0] and r["accumulation_steps"] == len(shapes)
    programs = {("fused", shapes[0])} if len(shapes) == 1 else {("micro", g) for g in shapes}
    assert r["first_run"] == (not programs <= run_before), r["step"]
    run_before |= programs
  assert summary["first_run_steps"] == sum(r["first_run"] for r in steps) > 0
  assert all(-1.0 <= r["similarity"] <= 1.0 for r in steps)
  assert (tmp_path / "metrics.png").stat().st_size > 20_000
  assert list((tmp_path / "tensorboard").iterdir())
  starts = json.loads((tmp_path / "config.json").read_text())["starts"]
  assert len(starts) == 1 and starts[0]["config"]["similarity_target"] == 0.5
  assert list(cache.iterdir())  # on by default, outside the workdir
  assert not (tmp_path / "compilation_cache").exists()

  out = capsys.readouterr().out
  epoch_lines = [line for line in out.splitlines() if line.startswith("epoch ")]
  assert len(epoch_lines) == 15 and epoch_lines[-1].startswith("epoch 15/15  test accuracy ")
  assert all("batch size" in line and "similarity" in line for line in epoch_lines)
  assert f"compilation cache: {cache}" in out
  for row in (
    "final test accuracy",
    "average batch size",
    "final batch size",
    "optimizer steps",
    "examples seen",
    "compiles",
    "padding",
    "first runs",
    "runtime",
    str(tmp_path / "metrics.jsonl"),
    str(tmp_path / "metrics.png"),
  ):
    assert row in out, row
  # README shows every line the run prints (its epochs 3 to 14 left out), as the run names them.
  assert line_names(readme_output()) == line_names(out)
