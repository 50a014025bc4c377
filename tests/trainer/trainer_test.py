"""The Trainer: exact gradients through padding and accumulation, data coverage, compile fallback.

Resume after SIGKILL and two processes: ``trainer_processes_test.py``.
"""

import threading
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import simigrad_jax
from simigrad_jax.compile.step_functions import Program
from simigrad_jax.compile.step_functions import StepFunctions
from tiny_run import TinyMLP
from tiny_run import dataset
from tiny_run import mlp_loss
from tiny_run import trainer_with


def make_trainer(
  workdir,
  data,
  controller,
  *,
  loss_fn=mlp_loss,
  params=None,
  model_state=None,
  learning_rate=0.1,
  **kwargs,
):
  if params is None:
    params = TinyMLP().init(jax.random.key(0), np.zeros((1, 5), np.float32))["params"]
  optimizer = optax.chain(
    simigrad_jax.transform("batch"), optax.sgd(learning_rate), simigrad_jax.scale_by_lr_factor()
  )
  kwargs.setdefault("max_micro_batch_size", 8)
  return trainer_with(
    loss_fn=loss_fn,
    params=params,
    model_state=model_state,
    optimizer=optimizer,
    source=simigrad_jax.ArraySource(data),
    controller=controller,
    workdir=workdir,
    progress=False,
    tensorboard=False,
    seed=3,
    **kwargs,
  )


# (devices, halves, mode, max_micro_batch_size, micro-batch rows per device, micro-steps[,
# shapes_per_octave]): a grid of 8 shapes per octave plans 45 examples on 6 rows of 8 devices
# (3 padded), the halving grid on 8 rows (19 padded).
EXACT_CASES = {
  "8-device-one-micro-step": (8, "device", "recompile", 8, 6, 1, 8),
  "8-device-halving-grid": (8, "device", "recompile", 8, 8, 1, 1),
  "8-device-accumulate-3": (8, "device", "recompile", 2, 2, 3),
  "8-device-accumulate-2-finer-grid": (8, "device", "recompile", 4, 3, 2, 8),
  "8-device-pad-one-shape": (8, "device", "pad", 16, 16, 1),
  "8-local": (8, "local", "recompile", 8, 6, 1, 8),
  "3-local-one-micro-step": (3, "auto", "recompile", 64, 16, 1),
  "3-local-accumulate-4": (3, "auto", "recompile", 4, 4, 4),
  "3-local-pad-odd-max": (3, "local", "pad", 9, 10, 2),
  "1-local-one-micro-step-default-grid": (1, "auto", "recompile", 64, 50, 1),  # its chosen grid
  "1-local-accumulate-6": (1, "auto", "recompile", 8, 8, 6),
}


@pytest.mark.parametrize("case", EXACT_CASES)
def test_one_step_is_the_exact_mean_gradient_step(tmp_path, case):
  """Padding rows, accumulation, the shape grid and the split change nothing: one step equals
  plain SGD on the 45 examples (in float64), and the similarity is that of the even- and
  odd-numbered examples."""
  num_devices, halves, mode, max_micro, rows, steps, *per_octave = EXACT_CASES[case]
  data = dataset()
  controller = simigrad_jax.Controller(45, 0.0, enable_adjust=False)
  trainer = make_trainer(
    tmp_path,
    data,
    controller,
    max_micro_batch_size=max_micro,
    devices=jax.devices()[:num_devices],
    halves=halves,
    compile=simigrad_jax.CompileConfig(
      mode=mode, background=False, shapes_per_octave=per_octave[0] if per_octave else None
    ),
  )
  params0 = jax.tree.map(np.asarray, TinyMLP().init(jax.random.key(0), data["x"][:1])["params"])
  summary = trainer.train(num_steps=1)
  trainer.close()
  (record,) = [r for r in simigrad_jax.read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
  assert (record["micro_batch_size"], record["accumulation_steps"]) == (rows, steps)
  assert trainer.halves == ("device" if num_devices % 2 == 0 and halves != "local" else "local")

  indices = simigrad_jax.data.EpochSampler(len(data["y"]), 3).indices_at(0, 45)
  with jax.enable_x64(True):
    params64 = jax.tree.map(lambda a: np.asarray(a, np.float64), params0)
    x, y = np.asarray(data["x"][indices], np.float64), data["y"][indices]
    per_example = lambda p: optax.softmax_cross_entropy_with_integer_labels(
      TinyMLP().apply({"params": p}, x), y
    )
    loss, grads = jax.value_and_grad(lambda p: jnp.mean(per_example(p)))(params64)
    expected = jax.tree.map(lambda p, g: np.asarray(p - 0.1 * g), params64, grads)
    jac = jax.jacobian(per_example)(params64)
  got = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), trainer.state["params"])
  for want, have in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
    np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(summary["loss"], loss, rtol=1e-5)
  # The halves: the step's even-numbered examples (23) against its odd-numbered ones (22).
  flat = np.concatenate([np.asarray(j).reshape(45, -1) for j in jax.tree.leaves(jac)], axis=1)
  g_a, g_b = flat[0::2].mean(0), flat[1::2].mean(0)
  cos = g_a @ g_b / np.linalg.norm(g_a) / np.linalg.norm(g_b)
  np.testing.assert_allclose(summary["similarity"], cos, rtol=1e-4, atol=1e-5)
  if trainer.halves == "local":  # each half normalised by its own count
    np.testing.assert_allclose(
      [record["norm_a"], record["norm_b"]], [np.linalg.norm(g_a), np.linalg.norm(g_b)], rtol=1e-5
    )
  np.testing.assert_allclose(
    record["norm_mean"], np.linalg.norm(23 / 45 * g_a + 22 / 45 * g_b), rtol=1e-5
  )


@pytest.mark.parametrize("num_devices", [8, 3, 1])
def test_every_example_once_per_epoch_while_the_batch_size_moves(tmp_path, num_devices):
  data = dataset(num_examples=120)
  controller = simigrad_jax.Controller(20, 0.5, batch_size_lower_bound=8, batch_size_upper_bound=64)
  schedule = lambda epochs: 1.0 if epochs < 1 else 0.5  # step decay after the first epoch
  trainer = make_trainer(
    tmp_path,
    data,
    controller,
    max_micro_batch_size=4,
    lr_schedule=schedule,
    devices=jax.devices()[:num_devices],
  )
  trained = []  # per optimizer step: the indices of the real rows placed on the devices
  take = trainer._data.take

  def recording_take(plan, start, step):
    step_data, seconds = take(plan, start, step)
    rows = [
      np.asarray(batch["index"])[np.asarray(weights) > 0]
      for batch, weights in step_data.micro_batches
    ]
    trained.append(np.sort(np.concatenate(rows)))
    return step_data, seconds

  trainer._data.take = recording_take
  summary = trainer.train(num_epochs=3)
  trainer.close()
  records = [r for r in simigrad_jax.read_metrics(tmp_path / "metrics.jsonl") if "batch_size" in r]
  assert sum(len(t) for t in trained) == summary["examples_seen"] == 360
  start = 0
  for step_rows, record in zip(trained, records, strict=True):
    expected = trainer.sampler.indices_at(start, record["batch_size"])
    np.testing.assert_array_equal(step_rows, np.sort(expected))
    start += record["batch_size"]
  for epoch in range(3):  # the per-step sets tile each epoch's permutation exactly
    assert sorted(trainer.sampler.indices_at(epoch * 120, 120)) == list(range(120))
  assert len({r["batch_size"] for r in records}) >= 4  # the batch size really moved
  # A step runs its shape's program for the first time, or the micro-step and the update of
  # accumulated steps: flagged in its record, counted in the summary.
  programs_run = set()
  for record in records:
    if record["accumulation_steps"] == 1:
      programs = {("step", record["micro_batch_size"])}
    else:
      programs = {("micro_step", record["micro_batch_size"]), ("update",)}
    assert record["first_run"] == (not programs <= programs_run), record["step"]
    programs_run |= programs
  first_runs = [r for r in records if r["first_run"]]
  assert summary["first_run_steps"] == len(first_runs) and records[0]["first_run"]
  assert summary["first_run_seconds"] == pytest.approx(sum(r["step_seconds"] for r in first_runs))
  # The learning-rate factor: sqrt(B / B0) times the schedule at the examples seen before the step.
  for record in records:
    seen_before_step = record["examples_seen"] - record["batch_size"]
    assert record["schedule_factor"] == schedule(seen_before_step / 120)
  requested = [20] + [r["next_batch_size"] for r in records[:-1]]
  for record, size in zip(records, requested):
    np.testing.assert_allclose(
      record["lr_factor"], np.sqrt(size / 20) * record["schedule_factor"], rtol=1e-6
    )
  stats = trainer.compile_stats()
  # Every program is compiled once, whatever the order of visits: one per shape for steps of
  # one micro-batch, a micro-step per shape that accumulated, and the update after those.
  assert stats["compiles"] == (
    len(stats["compiled_step_sizes"])
    + len(stats["compiled_accumulation_sizes"])
    + stats["update_compiled"]
  )
  assert set(stats["compiled_micro_batch_sizes"]) <= set(trainer.shapes)


class BatchNormModel(nn.Module):
  @nn.compact
  def __call__(self, x, mask):
    x = nn.BatchNorm(use_running_average=False, momentum=0.9, axis_name="batch")(x, mask=mask)
    return nn.Dense(3)(x)


def bn_loss(params, model_state, batch, weights, rng):
  """The BatchNormModel's per-example losses, padding rows masked out of the statistics."""
  del rng
  logits, updates = BatchNormModel().apply(
    {"params": params, **model_state}, batch["x"], (weights > 0)[:, None], mutable=["batch_stats"]
  )
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), updates


def make_bn_trainer(workdir, data, controller, **kwargs):
  # init outside the mapped step: BatchNorm needs the axis only when it runs inside it.
  variables = BatchNormModel().init(jax.random.key(0), data["x"][:2], np.ones((2, 1), bool))
  return make_trainer(
    workdir,
    data,
    controller,
    loss_fn=bn_loss,
    params=variables["params"],
    model_state={"batch_stats": variables["batch_stats"]},
    **kwargs,
  )


def test_batchnorm_statistics_cover_all_devices_and_skip_padding(tmp_path):
  data = dataset()
  controller = simigrad_jax.Controller(44, 0.0, enable_adjust=False)
  trainer = make_bn_trainer(tmp_path, data, controller)
  trainer.train(num_steps=1)
  trainer.close()
  indices = simigrad_jax.data.EpochSampler(len(data["y"]), 3).indices_at(0, 44)
  mean = np.asarray(
    trainer.state["model_state"]["batch_stats"]["BatchNorm_0"]["mean"].addressable_data(0)
  )
  # Flax's cross-device BatchNorm averages the devices' masked means (example e sits on
  # device e % 8; here 6 or 5 real rows each, padding excluded): running mean = 0.1 * that.
  x = data["x"][indices]
  device_means = np.stack([x[np.arange(44) % 8 == d].mean(axis=0) for d in range(8)])
  np.testing.assert_allclose(mean, 0.1 * device_means.mean(axis=0), rtol=1e-5, atol=1e-6)
  assert not np.allclose(mean, 0.1 * x[:40].mean(axis=0), atol=1e-4)  # padding rows would shift it


def test_batchnorm_statistics_of_the_local_split_are_per_half(tmp_path):
  """3 devices, 45 examples in 6 slots of 8 rows: each half's pass normalises with its own rows
  over all devices (padding excluded), and the running mean averages the two halves'."""
  data = dataset()
  controller = simigrad_jax.Controller(45, 0.0, enable_adjust=False)
  trainer = make_bn_trainer(
    tmp_path,
    data,
    controller,
    devices=jax.devices()[:3],
    max_micro_batch_size=64,
    compile=simigrad_jax.CompileConfig(background=False),
  )
  trainer.train(num_steps=1)
  trainer.close()
  x = data["x"][simigrad_jax.data.EpochSampler(len(data["y"]), 3).indices_at(0, 45)]
  slot = np.arange(45) % 6  # example e: device slot // 2, half slot % 2
  half_means = [
    np.mean([x[slot == 2 * d + h].mean(axis=0) for d in range(3)], axis=0) for h in (0, 1)
  ]
  mean = np.asarray(
    trainer.state["model_state"]["batch_stats"]["BatchNorm_0"]["mean"].addressable_data(0)
  )
  np.testing.assert_allclose(mean, 0.1 * np.mean(half_means, axis=0), rtol=1e-5, atol=1e-6)


def test_batchnorm_with_accumulation_never_sees_a_device_of_padding_alone(tmp_path):
  """35 examples as 2 micro-steps of 4 rows x 8 devices: filling micro-steps in order left the
  second with 3 real rows, so 5 devices normalised padding alone (NaN statistics) and every
  step was skipped. Dealt round-robin, each micro-step has real rows on every device."""
  data = dataset()
  controller = simigrad_jax.Controller(35, 0.0, enable_adjust=False)
  trainer = make_bn_trainer(tmp_path, data, controller, max_micro_batch_size=4)
  summary = trainer.train(num_steps=3)
  trainer.close()
  records = [r for r in simigrad_jax.read_metrics(tmp_path / "metrics.jsonl") if "batch_size" in r]
  assert [r["accumulation_steps"] for r in records] == [2, 2, 2]
  assert summary["steps"] == 3
  assert all(r["grads_finite"] for r in records), [r["decision"] for r in records]
  for leaf in jax.tree.leaves(trainer.state["model_state"]):
    assert np.all(np.isfinite(np.asarray(leaf.addressable_data(0))))


def test_nonfinite_step_is_skipped_and_counted(tmp_path):
  data = dataset(num_examples=64)
  data["x"][5] = np.nan
  # Index 5 lands in a middle step of the epoch for seed 3 (checked below: not the first).
  controller = simigrad_jax.Controller(16, 0.3, batch_size_lower_bound=8, batch_size_upper_bound=32)
  trainer = make_trainer(tmp_path, data, controller)
  trainer.train(num_epochs=1)
  trainer.close()
  records = [r for r in simigrad_jax.read_metrics(tmp_path / "metrics.jsonl") if "batch_size" in r]
  bad = [r for r in records if not r["grads_finite"]]
  assert len(bad) == 1 and bad[0]["similarity"] is None  # NaN is written as null
  assert bad[0]["decision"] == "nonfinite"
  assert records.index(bad[0]) > 0
  before = records[records.index(bad[0]) - 1]  # the controller's size did not move
  assert bad[0]["next_batch_size"] == before["next_batch_size"]
  assert records[-1]["nonfinite_steps"] == 1
  for leaf in jax.tree.leaves(trainer.state):
    assert np.all(np.isfinite(np.asarray(leaf.addressable_data(0))))


class ConfigCountingController(simigrad_jax.Controller):
  """SimiGrad's controller that counts the reads of its config."""

  config_reads = 0

  @property
  def config(self):
    self.config_reads += 1
    return super().config


def test_the_controllers_config_is_read_per_run_not_per_step(tmp_path):
  """A schedule's config lists every threshold (a replay's, one a step): reading it each step
  would cost the host's critical path more as the run gets longer."""
  reads = {}
  for steps in (2, 8):
    controller = ConfigCountingController(
      16, 0.3, batch_size_lower_bound=8, batch_size_upper_bound=32
    )
    # Within one epoch: a checkpoint (each epoch's end, the end of train()) reads it too.
    with make_trainer(tmp_path / str(steps), dataset(num_examples=400), controller) as trainer:
      trainer.train(num_steps=steps)
    reads[steps] = controller.config_reads
  assert reads[2] == reads[8] > 0


def test_a_last_step_of_one_example_is_trained_with_the_local_split(tmp_path):
  """The second half of a one-example step is empty: the step trains, unmeasured, not skipped."""
  data = dataset()
  controller = simigrad_jax.Controller(16, 0.0, enable_adjust=False)
  trainer = make_trainer(
    tmp_path,
    data,
    controller,
    devices=jax.devices()[:3],
    compile=simigrad_jax.CompileConfig(background=False),
  )
  trainer.train(num_epochs=32 / 200)
  before = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), trainer.state["params"])
  summary = trainer.train(num_epochs=33 / 200)
  trainer.close()
  last = [r for r in simigrad_jax.read_metrics(tmp_path / "metrics.jsonl") if "loss" in r][-1]
  assert (summary["examples_seen"], last["batch_size"]) == (33, 1)
  assert last["grads_finite"] and last["similarity"] is None and last["norm_b"] == 0.0
  after = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), trainer.state["params"])
  assert any(
    not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))
  )


def test_refuses_a_data_set_smaller_than_the_largest_batch(tmp_path):
  controller = simigrad_jax.Controller(16, 0.3, batch_size_upper_bound=500)
  with pytest.raises(ValueError, match="200 examples, fewer than the largest batch size 500"):
    make_trainer(tmp_path, dataset(), controller)


def test_a_loss_fn_returning_a_bare_scalar_is_told_the_contract(tmp_path):
  def mean_only(params, model_state, batch, weights, rng):
    return mlp_loss(params, model_state, batch, weights, rng)[0].mean()

  controller = simigrad_jax.Controller(16, 0.3, batch_size_lower_bound=8, batch_size_upper_bound=64)
  with pytest.raises(simigrad_jax.ingraph.LossContractError) as refused:
    make_trainer(tmp_path, dataset(), controller, loss_fn=mean_only).train(num_steps=1)
  message = str(refused.value)
  assert "must return the pair (per_example_losses, new_model_state), got a single scalar" in (
    message
  )
  assert "`return losses, model_state`" in message and "Tracer" not in message


def test_refuses_an_optimizer_without_the_transform(tmp_path):
  params = TinyMLP().init(jax.random.key(0), np.zeros((1, 5), np.float32))["params"]
  with pytest.raises(ValueError, match="no SimilarityState: chain simigrad_jax.transform"):
    simigrad_jax.Trainer(
      loss_fn=mlp_loss,
      params=params,
      optimizer=optax.sgd(0.1),
      source=simigrad_jax.ArraySource(dataset()),
      controller=simigrad_jax.Controller(16, 0.3),
      workdir=tmp_path,
      config=simigrad_jax.TrainerConfig(max_micro_batch_size=8),
    )


@pytest.mark.parametrize("num_devices, max_micro", [(8, 8), (3, 16)])
def test_a_step_whose_shape_is_compiling_runs_on_a_compiled_shape(tmp_path, num_devices, max_micro):
  """The timed fallback: same examples, same update, no compile wait after the first step."""
  data = dataset()

  def run(workdir, fallback, gate=None):
    # Sizes 44, 44, then back to 16: micro-batch shapes (rows per slot) 8 and 2 on 8 devices,
    # 8 and 4 on the 6 slots of 3 devices (the local split).
    controller = simigrad_jax.Controller(
      16,
      0.0,
      enable_adjust=False,
      batch_size_lower_bound=16,
      batch_size_upper_bound=44,
      batch_sizes_to_profile=(44,),
      profile_steps_per_size=2,
    )
    trainer = make_trainer(
      workdir,
      data,
      controller,
      compile=simigrad_jax.CompileConfig(fallback=fallback, timed_fallback=True),
      devices=jax.devices()[:num_devices],
      max_micro_batch_size=max_micro,
    )
    first = trainer.layout.plan(controller.batch_size).micro_batch_size
    if gate is not None:  # every shape but the first step's compiles once the gate opens
      compiler = trainer._programs.compiler

      def gated_lower(key, lower=compiler._lower):
        if key.program is not Program.APPLY and key.micro != first:
          gate.wait(timeout=30)  # (without a fallback the steps would wait this long, then fail)
        return lower(key)

      compiler._lower = gated_lower
    try:
      summary = trainer.train(num_steps=5)
    finally:
      if gate is not None:
        gate.set()
      trainer.close()
    records = [r for r in simigrad_jax.read_metrics(workdir / "metrics.jsonl") if "batch_size" in r]
    params = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), trainer.state["params"])
    return first, summary, records, params, trainer.layout

  first, summary, records, params, layout = run(tmp_path / "fallback", True, threading.Event())
  _, _, exact_records, exact_params, _ = run(tmp_path / "exact", False)
  sizes = [r["batch_size"] for r in records]
  assert sizes == [r["batch_size"] for r in exact_records] and {16, 44} <= set(sizes)
  assert len({r["micro_batch_size"] for r in exact_records}) == 2  # two shapes when exact
  rows = layout.device_rows(first)  # the only shape compiled, in rows per device
  for record, exact in zip(records, exact_records):
    assert record["micro_batch_size"] == rows
    assert record["compile_fallback"] == (exact["micro_batch_size"] != rows)
    assert not exact["compile_fallback"]
    steps = -(-record["batch_size"] // (layout.num_slots * first))
    assert record["accumulation_steps"] == steps
    assert record["padded_examples"] == layout.num_slots * first * steps - record["batch_size"]
    np.testing.assert_allclose(record["loss"], exact["loss"], rtol=1e-5)
    np.testing.assert_allclose(record["similarity"], exact["similarity"], rtol=1e-4, atol=1e-5)
  assert summary["compile_fallback_steps"] == sum(r["compile_fallback"] for r in records) >= 2
  assert all(r["compile_wait_step_seconds"] == 0 for r in records[1:])
  for want, have in zip(jax.tree.leaves(exact_params), jax.tree.leaves(params), strict=True):
    np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)


def test_the_first_step_waits_for_the_programs_the_fallback_needs(tmp_path):
  """A slow micro-step compile of the first shape is waited for at step 1, not at step 2.

  Step 2's batch (44) outgrows one micro-batch of the first shape (16 = 8 devices x 2 rows),
  and its own shape never compiles here; it can only accumulate on the first shape, whose
  micro-step and update the first step must have waited for.
  """
  controller = simigrad_jax.Controller(
    16,
    0.0,
    enable_adjust=False,
    batch_size_lower_bound=16,
    batch_size_upper_bound=44,
    batch_sizes_to_profile=(16, 44),
    profile_steps_per_size=1,
  )
  trainer = make_trainer(
    tmp_path, dataset(), controller, compile=simigrad_jax.CompileConfig(timed_fallback=True)
  )
  first = trainer.layout.plan(16).micro_batch_size
  gate = threading.Event()
  delay_seconds = 1.0
  compiler = trainer._programs.compiler

  def slow_lower(key, lower=compiler._lower):
    if key.program is not Program.APPLY and key.micro != first:
      gate.wait(timeout=30)
    elif key.program is Program.MICRO:
      time.sleep(delay_seconds)
    return lower(key)

  compiler._lower = slow_lower
  try:
    trainer.train(num_steps=2)
  finally:
    gate.set()
    trainer.close()
  records = [r for r in simigrad_jax.read_metrics(tmp_path / "metrics.jsonl") if "batch_size" in r]
  assert [r["batch_size"] for r in records] == [16, 44]
  assert [r["compile_fallback"] for r in records] == [False, True]
  assert [r["accumulation_steps"] for r in records] == [1, 3]  # 44 rows on 16-row micro-steps
  assert records[0]["compile_wait_step_seconds"] > 0
  assert records[1]["compile_wait_step_seconds"] == 0


def test_a_shape_that_fails_to_compile_is_raised_not_replaced(tmp_path, monkeypatch):
  """The fallback covers a shape still compiling, never one whose compile failed."""
  controller = simigrad_jax.Controller(
    16,
    0.0,
    enable_adjust=False,
    batch_size_lower_bound=16,
    batch_size_upper_bound=44,
    batch_sizes_to_profile=(44,),
  )
  lower = StepFunctions.lower

  def failing_lower(self, key):  # (from the Trainer's construction on: it queues the first plan)
    if key == (Program.FUSED, self.layout.plan(44).micro_batch_size):
      raise RuntimeError("out of memory (injected)")
    return lower(self, key)

  monkeypatch.setattr(StepFunctions, "lower", failing_lower)
  trainer = make_trainer(tmp_path, dataset(), controller)
  first = trainer.layout.plan(16).micro_batch_size
  broken = trainer.layout.plan(44).micro_batch_size
  compiler = trainer._programs.compiler
  compiler.prefetch([(Program.FUSED, first), (Program.FUSED, broken)])
  while broken not in compiler.view()["failed_fused"]:
    time.sleep(0.01)
  with pytest.raises(
    simigrad_jax.compile.StepCompileError,
    match=f"micro_batch_size={broken} failed with "
    r"RuntimeError: out of memory \(injected\)",
  ):
    trainer.train(num_steps=3)
  trainer.close()


def test_compiles_follow_the_batch_rather_than_the_whole_grid(tmp_path):
  """With the fallback, the shapes near the batch's compile ahead, further ones as it comes near."""
  # Bounds 16-512 on 8 devices: rows per device 2 to 64 (the default grid, 6 per octave here: 25
  # shapes); 24 -> 3 rows.
  controller = simigrad_jax.Controller(
    24, 0.0, enable_adjust=False, batch_size_lower_bound=16, batch_size_upper_bound=512
  )
  trainer = make_trainer(
    tmp_path,
    dataset(1200),
    controller,
    max_micro_batch_size=64,
    compile=simigrad_jax.CompileConfig(fallback=True),
  )
  try:
    layout, compiler = trainer.layout, trainer._programs.compiler
    assert len(layout.grid) == 25
    trainer.train(num_steps=2)
    window = layout.shapes_near(3, 0.5)
    for shape in window:
      compiler.get((Program.FUSED, shape))  # (waits for the window's compiles)
    compiled = compiler.view()["fused"]
    assert compiled == set(window)  # and nothing beyond it: 64 rows are 4 octaves away
    # The batch moves to 96 (12 rows per device): the shapes near it follow.
    controller.set_batch_size(96)
    trainer.train(num_steps=4)
    for shape in layout.shapes_near(12, 0.5):
      compiler.get((Program.FUSED, shape))
    compiled = compiler.view()["fused"]
    assert compiled == set(window) | set(layout.shapes_near(12, 0.5))
    assert max(layout.grid) not in compiled
  finally:
    trainer.close()


def test_the_grid_changes_the_shapes_not_the_run(tmp_path):
  """The halving grid and the default one: the same batch sizes, losses and parameters."""

  def run(workdir, shapes_per_octave=None):
    controller = simigrad_jax.Controller(
      20, 0.5, batch_size_lower_bound=8, batch_size_upper_bound=64
    )
    grid = simigrad_jax.CompileConfig(background=False, shapes_per_octave=shapes_per_octave)
    trainer = make_trainer(workdir, dataset(120), controller, max_micro_batch_size=8, compile=grid)
    trainer.train(num_steps=12)
    trainer.close()
    records = [r for r in simigrad_jax.read_metrics(workdir / "metrics.jsonl") if "loss" in r]
    params = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), trainer.state["params"])
    return records, params, trainer.layout.grid

  halving, halving_params, halving_grid = run(tmp_path / "halving", shapes_per_octave=1)
  finer, finer_params, finer_grid = run(tmp_path / "default")
  assert len(finer_grid) > len(halving_grid)
  assert [r["batch_size"] for r in finer] == [r["batch_size"] for r in halving]
  assert len({r["batch_size"] for r in finer}) >= 4  # the batch size really moved
  assert sum(r["padded_examples"] for r in finer) < sum(r["padded_examples"] for r in halving)
  for a, b in zip(finer, halving, strict=True):
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
    np.testing.assert_allclose(a["similarity"], b["similarity"], rtol=1e-4, atol=1e-5)
  for a, b in zip(jax.tree.leaves(finer_params), jax.tree.leaves(halving_params), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
