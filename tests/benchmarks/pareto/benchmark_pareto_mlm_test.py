"""benchmarks/pareto/pareto.py --task mlm: the text split, the held-out scoring and a tiny run end to end."""

import json
import math

import numpy as np
import pytest

from benchmarks.pareto import flags as pareto_flags
from benchmarks.pareto import mlm as pareto_mlm
from benchmarks.pareto import pareto
from train import text_data


def _experiment(tmp_path, text=None, **overrides):
  if text is not None:
    (tmp_path / "tinyshakespeare.txt").write_text(text)
  settings = (
    dict(
      hidden=32,
      seq_length=32,
      train_windows=64,
      eval_examples=16,
      epochs=1.0,
      lr_schedule="warmup_cosine",
      root=tmp_path,
      data_dir=tmp_path,
    )
    | overrides
  )
  return pareto_mlm.MlmExperiment(**settings)


def test_split_train_from_the_start_validation_and_test_from_the_end(tmp_path):
  # 9,000 bytes of letters, then 1,000 of digits: the held-out 10% is exactly the digits.
  text = "".join(chr(97 + i % 26) for i in range(9000)) + "".join(str(i % 10) for i in range(1000))
  exp = _experiment(tmp_path, text)
  assert (exp.num_train, exp.num_val, exp.num_test) == (64, 15, 15)  # 500 bytes / 32 each
  train = text_data.decode_bytes(exp.train.get_batch(np.arange(64))["tokens"])
  assert train == text[: 64 * 32]
  info = exp.info()
  assert info["dataset_note"] is None and info["seq_length"] == 32 and "lamb" in info["optimizer"]
  scores = exp.eval_fn(exp.init_params(0), None)
  assert sorted(scores) == ["test_accuracy", "test_loss", "val_accuracy", "val_loss"]
  assert all(0.0 <= scores[k] <= 1.0 for k in ("val_accuracy", "test_accuracy"))
  # Untrained, the loss is near log(vocabulary): the held-out text is really scored.
  assert abs(scores["val_loss"] - math.log(text_data.BYTE_VOCAB_SIZE)) < 0.5
  assert exp.eval_fn(exp.init_params(0), None) == scores  # a fixed mask: the same every time
  assert exp.eval_fn(exp.init_params(1), None) != scores


def test_missing_text_falls_back_with_a_note_and_refuses_too_many_windows(tmp_path):
  exp = _experiment(tmp_path)
  assert "tinyshakespeare.txt not found" in exp.info()["dataset_note"]
  with pytest.raises(ValueError, match=r"train_windows=10000000 exceeds the \d+ windows"):
    _experiment(tmp_path, train_windows=10_000_000)


def test_mlm_only_flags_and_profile_are_refused():
  with pytest.raises(SystemExit):
    pareto_flags.parse_args(["--task", "mlm", "--dataset", "mnist"])
  with pytest.raises(SystemExit):
    pareto_flags.parse_args(["--train-windows", "64"])
  args = pareto_flags.parse_args(["--task", "mlm", "--quick"])
  assert args.lr_schedule == "warmup_cosine" and args.grid["dataset"] == "text"
  with pytest.raises(ValueError, match="--profile is for --task images"):
    pareto.main(["--task", "mlm", "--quick", "--profile"])


def test_tiny_mlm_run(tmp_path):
  out = tmp_path / "mlm.json"
  results = pareto.main(
    [
      "--task",
      "mlm",
      "--quick",
      "--seeds",
      "0",
      "--fixed",
      "32",
      "--lr-multipliers",
      "1",
      "--targets",
      "",
      "--gns",
      "",
      "--bounds",
      "32:32",
      "--hidden",
      "32",
      "--train-windows",
      "192",
      "--eval-examples",
      "32",
      "--out",
      str(out),
    ]
  )
  written = json.loads(out.read_text())
  assert written["task"] == "mlm" and written["dataset"] == "text"
  # One fixed run (the test's time; adaptive runs go through the same train_run as the images').
  [run] = written["runs"]
  assert run["controller"] == "fixed" and run["steps"] == 6
  assert run["examples"] == 192 and 0.0 <= run["test_accuracy"] <= 1.0
  assert math.isfinite(run["test_loss"]) and math.isfinite(run["val_loss"])
  assert run["trace"]["similarity"][0] is not None  # the half-batch similarity was measured
  assert results["summary"]["best_fixed"]["batch_size"] == 32
  # Reusing the result needs the same split.
  again = pareto.main(
    [
      "--task",
      "mlm",
      "--quick",
      "--seeds",
      "0",
      "--fixed",
      "32",
      "--lr-multipliers",
      "1",
      "--targets",
      "",
      "--gns",
      "",
      "--bounds",
      "32:32",
      "--hidden",
      "32",
      "--train-windows",
      "192",
      "--eval-examples",
      "32",
      "--reuse",
      str(out),
      "--out",
      str(tmp_path / "again.json"),
    ]
  )
  assert again["reused_runs"] == 1
  with pytest.raises(ValueError, match="num_train is 192, this run has 256"):
    pareto.main(
      [
        "--task",
        "mlm",
        "--quick",
        "--seeds",
        "0",
        "--fixed",
        "32",
        "--hidden",
        "32",
        "--bounds",
        "32:32",
        "--train-windows",
        "256",
        "--eval-examples",
        "32",
        "--reuse",
        str(out),
      ]
    )
