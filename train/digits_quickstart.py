"""A short SimiGrad run on scikit-learn's bundled handwritten digits (no download).

Run: ``python -m train.digits_quickstart [--epochs 8] [--workdir /tmp/simigrad_digits]``.

Every optimizer step: the controller's global batch size is planned onto the
devices (``simigrad_jax.plan_batch``, padded rows weighted 0), one pmapped step
computes each device's gradient, ``simigrad_jax.transform`` averages them and
measures the half-batch similarity, the host reads it, the controller picks the
next batch size and the learning-rate factor follows (sqrt rule) without
recompiling. With no accelerator, 8 CPU devices are simulated.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import tqdm  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import simigrad_jax  # noqa: E402

AXIS = "batch"


class MLP(nn.Module):
  """A two-layer perceptron for 8x8 digit images."""

  hidden: int = 128

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(10)(x)


def load_split(seed: int, test_size: int = 297):
  """Digits as float32 in [0, 1], shuffled once and split into train and test."""
  digits = load_digits()
  images = (digits.data / 16.0).astype(np.float32)
  labels = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(labels))
  test, train = order[:test_size], order[test_size:]
  return (images[train], labels[train]), (images[test], labels[test])


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=8)
  parser.add_argument("--initial-batch-size", type=int, default=32)
  parser.add_argument("--similarity-target", type=float, default=0.1)
  parser.add_argument("--lower", type=int, default=16, help="batch_size_lower_bound")
  parser.add_argument("--upper", type=int, default=512, help="batch_size_upper_bound")
  parser.add_argument("--learning-rate", type=float, default=0.05)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--workdir", default="/tmp/simigrad_digits")
  return parser.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  (x_train, y_train), (x_test, y_test) = load_split(args.seed)
  num_devices = jax.local_device_count()
  model = MLP()
  params = model.init(jax.random.key(args.seed), x_train[:1])["params"]
  optimizer = optax.chain(
      simigrad_jax.transform(AXIS),
      optax.sgd(args.learning_rate, momentum=0.9),
      simigrad_jax.scale_by_lr_factor(),
  )
  controller = simigrad_jax.Controller(
      args.initial_batch_size, args.similarity_target,
      batch_size_lower_bound=args.lower, batch_size_upper_bound=args.upper)
  # One micro-step per optimizer step: every batch up to `upper` fits the largest shape.
  policy = simigrad_jax.BucketPolicy(
      max_micro_batch_size=-(-args.upper // num_devices),
      min_micro_batch_size=max(1, args.lower // num_devices))

  def train_step(params, opt_state, images, labels, weights, total_weight):
    def loss_fn(p):
      logits = model.apply({"params": p}, images)
      losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
      # Sum over this device's real examples over the global count: the
      # transform's mean over devices is then exactly the global mean gradient.
      return jnp.sum(losses * weights) * num_devices / total_weight
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.psum(loss, AXIS) / num_devices

  p_train_step = jax.pmap(train_step, axis_name=AXIS, in_axes=(0, 0, 0, 0, 0, None))
  replicate = lambda tree: jax.device_put(
      jax.tree.map(lambda x: np.stack([np.asarray(x)] * num_devices), tree))
  params_r, opt_state_r = replicate(params), replicate(optimizer.init(params))
  predict = jax.jit(lambda p, x: jnp.argmax(model.apply({"params": p}, x), -1))

  workdir = pathlib.Path(args.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  metrics_path = workdir / "metrics.jsonl"
  rng = np.random.default_rng(args.seed)
  step, examples_seen, shapes_seen = 0, 0, set()
  start = time.time()
  with open(metrics_path, "w") as metrics_file:
    for epoch in range(args.epochs):
      order, offset = rng.permutation(len(y_train)), 0
      progress = tqdm.tqdm(total=len(order), desc=f"epoch {epoch + 1}/{args.epochs}", unit="ex", leave=False)
      while offset < len(order):
        # The last batch of an epoch takes what is left: no example dropped or repeated.
        plan = simigrad_jax.plan_batch(min(controller.batch_size, len(order) - offset), num_devices, policy)
        indices = order[offset:offset + plan.global_batch_size]
        layout = plan.example_layout()[0]  # (devices, micro): example index or -1
        rows = np.where(layout >= 0, indices[np.maximum(layout, 0)], 0)
        shapes_seen.add(plan.micro_batch_size)
        params_r, opt_state_r, loss = p_train_step(
            params_r, opt_state_r, x_train[rows], y_train[rows],
            plan.example_weights()[0], np.float32(plan.global_batch_size))
        stats = simigrad_jax.similarity_stats(opt_state_r)
        batch_size = plan.global_batch_size
        new_batch_size = controller.update(stats["similarity"])
        factor = simigrad_jax.lr_factor(new_batch_size, args.initial_batch_size)
        opt_state_r = simigrad_jax.set_lr_factor(opt_state_r, factor)
        offset += batch_size
        examples_seen += batch_size
        step += 1
        record = {"step": step, "epoch": epoch, "batch_size": batch_size, "similarity": stats["similarity"],
                  "norm_mean": stats["norm_mean"], "loss": float(loss[0]), "lr_factor": factor,
                  "examples_seen": examples_seen, "micro_batch_size": plan.micro_batch_size}
        metrics_file.write(json.dumps(record) + "\n")
        progress.update(batch_size)
        progress.set_postfix(loss=f"{record['loss']:.3f}", batch=batch_size, sim=f"{stats['similarity']:.2f}")
      progress.close()
      params = jax.tree.map(lambda x: x[0], params_r)
      accuracy = float(np.mean(np.asarray(predict(params, x_test)) == y_test))
      metrics_file.write(json.dumps({"step": step, "epoch": epoch, "eval_accuracy": accuracy}) + "\n")
      print(f"epoch {epoch + 1:2d}  test accuracy {accuracy:.4f}  batch size {controller.batch_size:4d}  "
            f"similarity {stats['similarity']:+.3f}  steps {step}")
  summary = {"test_accuracy": accuracy, "steps": step, "examples_seen": examples_seen,
             "average_batch_size": examples_seen / step, "final_batch_size": controller.batch_size,
             "compiled_shapes": sorted(shapes_seen), "devices": num_devices,
             "seconds": round(time.time() - start, 1), "metrics": str(metrics_path)}
  print(json.dumps(summary, indent=2))
  return summary


if __name__ == "__main__":
  main()
