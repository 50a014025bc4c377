"""The README's first command: a real SimiGrad run on scikit-learn's digits."""

import json

from train import digits_quickstart


def test_quickstart_trains_and_adapts_the_batch(tmp_path):
  summary = digits_quickstart.main(["--epochs", "3", "--workdir", str(tmp_path)])
  # Measured after 3 epochs on 8 simulated devices: 0.943 (seed 0), 0.923 (1), 0.953 (2).
  assert summary["eval_accuracy"] >= 0.90
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in records if "batch_size" in r]
  evals = [r for r in records if "eval_accuracy" in r]
  assert len(steps) == summary["steps"] and len(evals) == 3
  assert sum(r["batch_size"] for r in steps) == summary["examples_seen"] == 3 * 1500
  assert len({r["batch_size"] for r in steps}) > 3  # the batch size moved
  assert all(-1.0 <= r["similarity"] <= 1.0 for r in steps)
  assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
  assert (tmp_path / "metrics.png").stat().st_size > 10_000
  assert list((tmp_path / "tensorboard").iterdir())
  # Re-running the same command resumes: nothing to do, no step duplicated.
  digits_quickstart.main(["--epochs", "3", "--workdir", str(tmp_path)])
  again = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in again if "batch_size" in r] == [r["step"] for r in steps]
