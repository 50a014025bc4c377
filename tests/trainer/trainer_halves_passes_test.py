"""TrainerConfig(halves_passes=...): how the local split takes its halves' gradients, recorded.

The passes compute the same numbers to float rounding, so a run of each
measures the same similarities; a checkpoint of the local split records a
value other than the default, and a resume with another is refused.
"""

import numpy as np
import pytest

import simigrad_jax
from simigrad_jax.checkpoint import CheckpointMismatchError
from tests import tiny_run

EVERY_2 = simigrad_jax.CheckpointConfig(every_steps=2)


def similarities(workdir):
  return [r["similarity"] for r in simigrad_jax.read_metrics(str(workdir / "metrics.jsonl"))]


def test_a_run_s_passes_measure_the_same_and_another_on_resume_is_refused(tmp_path):
  runs = {}
  for passes in ("sequential", "stacked"):
    workdir = tmp_path / passes
    with tiny_run.make_trainer(
      workdir, halves="local", halves_passes=passes, checkpoints=EVERY_2
    ) as trainer:
      trainer.train(num_steps=2)
    runs[passes] = similarities(workdir)
  assert len(runs["stacked"]) == 2 and None not in runs["stacked"]
  np.testing.assert_allclose(runs["stacked"], runs["sequential"], atol=1e-5)
  with pytest.raises(CheckpointMismatchError, match="halves_passes"):
    tiny_run.make_trainer(tmp_path / "stacked", halves="local", checkpoints=EVERY_2).train(
      num_steps=4
    )
