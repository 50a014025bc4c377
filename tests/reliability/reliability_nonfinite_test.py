"""Non-finite gradients: NaN and Inf injected through the loss skip the step and change nothing.

Some examples carry a ``poison`` value (NaN or +Inf) that multiplies their
loss, so every step that trains one of them has a non-finite loss and
gradient on one device. Such a step must leave the parameters and the whole
optimizer state as they were (momentum, weight decay and Adam's counters
would otherwise still move them: the transform alone only zeroes the
update), keep the controller's batch size, count the event in the metrics,
the summary and the final report, name the first in a warning, and training
must go on with finite numbers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import simigrad_jax
import tiny_run
from simigrad_jax.ingraph.transform import SimilarityState
from simigrad_jax.trainer.run_totals import RunTotals
from simigrad_jax.trainer.skipped_steps import MAX_SKIPPED_IN_A_ROW
from simigrad_jax.trainer.skipped_steps import NonFiniteRunError
from simigrad_jax.trainer.step_record import StepRecord
from tiny_run import TinyMLP
from train import report

pytestmark = pytest.mark.reliability

POISON = {7: np.nan, 130: np.inf}  # example index -> loss multiplier


def poisoned_data(num_examples=200):
  rng = np.random.default_rng(0)
  poison = np.zeros(num_examples, np.float32)
  for index, value in POISON.items():
    poison[index] = value
  return {
    "x": rng.normal(size=(num_examples, 5)).astype(np.float32),
    "y": rng.integers(0, 3, size=num_examples).astype(np.int32),
    "poison": poison,
    "index": np.arange(num_examples, dtype=np.int32),
  }


def poisoned_loss(params, model_state, batch, weights, rng):
  del weights, rng
  logits = TinyMLP().apply({"params": params}, batch["x"])
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
  return losses * (1.0 + batch["poison"]), model_state  # NaN or Inf for the poisoned examples


def host(tree):
  return jax.tree.map(
    lambda x: np.asarray(
      jax.random.key_data(x)
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
      else x.addressable_data(0)
    ).copy(),
    tree,
  )


OPTIMIZERS = {
  "sgd-momentum-weight-decay": lambda: optax.chain(
    simigrad_jax.transform("batch"),
    optax.add_decayed_weights(5e-4),
    optax.sgd(0.1, momentum=0.9),
    simigrad_jax.scale_by_lr_factor(),
  ),
  "adam": lambda: optax.chain(
    simigrad_jax.transform("batch"), optax.adam(1e-2), simigrad_jax.scale_by_lr_factor()
  ),
}


@pytest.mark.parametrize(
  "name, num_devices", [(name, 8) for name in OPTIMIZERS] + [("sgd-momentum-weight-decay", 3)]
)  # 3 devices: the local split, NaN or Inf in one half
def test_nonfinite_steps_are_skipped_and_counted(name, num_devices, tmp_path, caplog):
  data = poisoned_data()
  controller = simigrad_jax.Controller(24, 0.3, batch_size_lower_bound=8, batch_size_upper_bound=64)
  trainer = simigrad_jax.Trainer(
    loss_fn=poisoned_loss,
    params=TinyMLP().init(jax.random.key(0), data["x"][:1])["params"],
    optimizer=OPTIMIZERS[name](),
    source=simigrad_jax.ArraySource(data),
    controller=controller,
    workdir=tmp_path,
    devices=jax.devices()[:num_devices],
    config=simigrad_jax.TrainerConfig(
      max_micro_batch_size=4, seed=3, progress=False, tensorboard=False
    ),
  )
  runs = []  # per step: the state before and after, and the controller's size before
  original_run = trainer._programs.runner.run

  def recording_run(state, data, step_inputs, *how):
    before = host({"params": state["params"], "opt_state": state["opt_state"]})  # not donated yet
    size_before = controller.batch_size
    new_state, stats = original_run(state, data, step_inputs, *how)
    runs.append(
      (
        before,
        host({"params": new_state["params"], "opt_state": new_state["opt_state"]}),
        size_before,
      )
    )
    return new_state, stats

  trainer._programs.runner.run = recording_run
  decided = []  # the step records as the trainer built them (NaN and Inf losses intact)

  class Decided:
    runs_at_once = True

    def on_step(self, record):
      decided.append(record)

  trainer.add_hook(Decided())
  with trainer, caplog.at_level(logging.WARNING, logger="simigrad_jax"):
    summary = trainer.train(num_epochs=3)

  snapshots = [(record.as_dict(), *run) for record, run in zip(decided, runs, strict=True)]
  records = [r for r in simigrad_jax.read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
  bad = [s for s in snapshots if not s[0]["grads_finite"]]
  # Every epoch trains each poisoned example once: 2 bad steps per epoch (1 if both share a step).
  assert 3 <= len(bad) <= 6, [s[0]["step"] for s in bad]
  assert {np.isnan(r["loss"]) for r, *_ in bad} == {True, False}  # NaN and Inf losses alike
  for record, before, after, size_before in bad:
    assert record["decision"] == "nonfinite" and np.isnan(record["similarity"])
    assert record["next_batch_size"] == size_before  # the controller's size held
    # Parameters and optimizer state are as before the step, except the similarity record.
    for path, old in jax.tree_util.tree_flatten_with_path(before)[0]:
      new = dict(jax.tree_util.tree_flatten_with_path(after)[0])[path]
      if "SimilarityState" not in jax.tree_util.keystr(path) and not any(
        getattr(k, "name", None) in SimilarityState._fields for k in path
      ):
        np.testing.assert_array_equal(new, old, err_msg=jax.tree_util.keystr(path))
  good = [s for s in snapshots if s[0]["grads_finite"]]
  assert len(good) > len(bad)
  moved = [
    s
    for s in good
    if not np.array_equal(s[1]["params"]["Dense_0"]["kernel"], s[2]["params"]["Dense_0"]["kernel"])
  ]
  assert len(moved) == len(good)  # finite steps do train
  # Counted: in the metrics, the controller and the transform's state; and all is finite.
  assert records[-1]["nonfinite_steps"] == len(bad)
  assert [r["step"] for r in records if r["grads_finite"] is False] == [s[0]["step"] for s in bad]
  assert controller.nonfinite_count == len(bad)
  assert simigrad_jax.similarity_stats(trainer.state["opt_state"])["nonfinite_count"] == len(bad)
  # Said: the summary counts them, and a warning names the first (and only the first).
  first = bad[0][0]
  assert summary["run_nonfinite_steps"] == summary["nonfinite_steps"] == len(bad)
  assert summary["first_nonfinite_step"] == first["step"]
  assert (
    f"step {first['step']} (batch size {first['batch_size']}, epoch {first['epoch']}): "
    "the gradient was NaN or infinite" in caplog.text
  )
  assert caplog.text.count("the gradient was NaN or infinite") == 1
  for leaf in jax.tree.leaves(host(trainer.state)):
    assert np.all(np.isfinite(leaf))
  assert all(np.isfinite(r["loss"]) for r in records if r["grads_finite"])
  print(f"\n{name}: {len(bad)} of {len(records)} steps non-finite (NaN and Inf), all skipped")


def test_the_final_report_counts_the_nonfinite_steps_and_names_the_first(tmp_path, capsys):
  """``python -m train``'s summary table, from a run's metrics file."""
  steps = [
    {
      "step": step,
      "epoch": 0,
      "examples_seen": 24 * step,
      "batch_size": 24,
      "loss": 1.0,
      "grads_finite": step not in (3, 5),
    }
    for step in range(1, 7)
  ]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
  run = {
    "examples_seen": 144,
    "steps": 6,
    "final_batch_size": 24,
    "run_steps": 6,
    "compiles": 1,
    "compile_seconds": 1.0,
    "compile_wait_seconds": 0.5,
    "compile_cache_hits": 0,
    "compile_cache_hit_seconds": 0.0,
    "compile_fallback_steps": 0,
    "compiled_micro_batch_sizes": [4],
  }
  summary = report.summarize(tmp_path, run, jax.devices(), 2.0, "device")
  assert summary["nonfinite_steps"] == 2
  assert summary["first_nonfinite_step"] == {"step": 3, "batch_size": 24}
  report.print_summary(summary)
  assert re.search(
    r"\nnon-finite steps +2 skipped \(the first: step 3, batch size 24\)\n", capsys.readouterr().out
  )
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps[:2]))
  report.print_summary(report.summarize(tmp_path, run, jax.devices(), 2.0, "device"))
  assert re.search(r"\nnon-finite steps +none\n", capsys.readouterr().out)


def initial_params(objects):
  return jax.tree.map(np.asarray, objects["params"])


def run_to_the_streak(tmp_path, **objects):
  """Trains the tiny run with ``objects`` replaced until the streak of skipped steps stops it."""
  arguments = {**tiny_run.trainer_objects(tmp_path), **objects}
  trainer = tiny_run.trainer_with(
    **arguments, max_micro_batch_size=4, seed=3, progress=False, tensorboard=False
  )
  with trainer, pytest.raises(NonFiniteRunError) as raised:
    trainer.train(num_steps=MAX_SKIPPED_IN_A_ROW + 5)
  records = [r for r in simigrad_jax.read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
  return trainer, raised.value, records, MAX_SKIPPED_IN_A_ROW


def _nan_learning_rate(count):
  """A learning-rate schedule that turns NaN (a constant NaN is refused before the first step)."""
  return jnp.full((), jnp.nan) * (count + 1)


def test_a_nan_learning_rate_skips_step_one_for_its_update_and_stops_the_run(tmp_path):
  """The gradient is finite and the update NaN: step 1 writes nothing and says why."""
  objects = tiny_run.trainer_objects(tmp_path)
  before = initial_params(objects)
  optimizer = optax.chain(
    simigrad_jax.transform("batch"),
    optax.sgd(_nan_learning_rate),
    simigrad_jax.scale_by_lr_factor(),
  )
  trainer, error, records, limit = run_to_the_streak(tmp_path, optimizer=optimizer)
  assert [r["nonfinite_cause"] for r in records] == ["update"] * limit
  assert {r["decision"] for r in records} == {"nonfinite"}  # the controller held the size
  assert {r["batch_size"] for r in records} == {20}
  assert all(r["grads_finite"] for r in records)  # the gradient was not what failed
  assert records[0]["nonfinite_steps"] == 1 and records[-1]["nonfinite_steps"] == limit
  assert error.cause == "update" and error.step == limit
  assert str(error).startswith(f"steps 1 to {limit}, {limit} in a row, were all skipped")
  assert "a learning rate, schedule or other setting of the optimizer" in str(error)
  for old, new in zip(
    jax.tree.leaves(before), jax.tree.leaves(host(trainer.state["params"])), strict=True
  ):
    np.testing.assert_array_equal(new, old)  # nothing was written into the weights


def test_labels_out_of_range_are_a_loss_nan_on_every_row_and_an_error_naming_them(tmp_path):
  """optax's integer-label cross-entropy gives NaN for a label past the classes, with a finite
  gradient: every step is skipped for its loss, and the error names the labels."""
  rng = np.random.default_rng(0)
  data = {
    "x": rng.normal(size=(120, 5)).astype(np.float32),
    "y": rng.integers(3, 6, size=120).astype(np.int32),  # the model has 3 classes
  }
  _, error, records, limit = run_to_the_streak(tmp_path, source=simigrad_jax.ArraySource(data))
  assert [r["nonfinite_cause"] for r in records] == ["loss"] * limit
  assert all(r["grads_finite"] and r["loss"] is None for r in records)  # NaN is null in JSON
  assert error.cause == "loss"
  assert "labels outside the classes the model outputs" in str(error)
  assert "check num_classes against the data" in str(error)


def test_new_parameters_that_overflow_their_dtype_skip_the_step(tmp_path):
  """A float16 weight near its dtype's largest value, pushed past it by a finite update."""

  def overflow_loss(params, model_state, batch, weights, rng):
    del weights, rng
    # The gradient, -6e3, is finite in float16; the update, 0.1 times it, takes w past 65504.
    return -params["w"].astype(jnp.float32) * jnp.full(batch["x"].shape[0], 6e3), model_state

  _, error, records, limit = run_to_the_streak(
    tmp_path, loss_fn=overflow_loss, params={"w": jnp.full([], 65000, jnp.float16)}
  )
  assert [r["nonfinite_cause"] for r in records] == ["parameters"] * limit
  assert error.cause == "parameters" and "overflow their dtype" in str(error)


def test_skipped_steps_are_counted_by_cause_and_the_first_named_with_it(caplog):
  fields = dataclasses.fields(StepRecord)
  required = [f.name for f in fields if f.default is f.default_factory is dataclasses.MISSING]
  base = StepRecord(
    **{
      **{name: 0 for name in required},
      **{"batch_size": 64, "grads_finite": True, "host_seconds": math.nan, "step_seconds": 1.0},
    }
  )
  totals = RunTotals()
  with caplog.at_level(logging.WARNING, logger="simigrad_jax"):
    for step, cause in enumerate([None, "update", None, "loss", "update"], start=1):
      totals.on_step(dataclasses.replace(base, step=step, nonfinite_cause=cause))
  summary = totals.summary()
  assert summary["run_nonfinite_steps"] == 3
  assert summary["nonfinite_causes"] == {"update": 2, "loss": 1}
  assert summary["first_nonfinite_step"] == 2
  assert "step 2 (batch size 64, epoch 0): the optimizer's update was NaN or infinite" in (
    caplog.text
  )
