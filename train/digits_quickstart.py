"""A short SimiGrad run on scikit-learn's bundled handwritten digits (no download).

Run: ``python -m train.digits_quickstart [--epochs 8] [--workdir /tmp/simigrad_digits]``.

Trains a small MLP with :class:`simigrad_jax.Trainer`: at every optimizer step
the global batch size comes from the SimiGrad controller, the gradient is
averaged over the devices by ``simigrad_jax.transform`` (which also measures the
half-batch similarity), and the learning rate follows the batch size (sqrt
rule). With no accelerator, 8 CPU devices are simulated. Writes
``metrics.jsonl``, TensorBoard events, checkpoints and ``metrics.png`` to the
workdir; re-running the same command resumes from the newest checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys

if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import simigrad_jax  # noqa: E402
from simigrad_jax import plot  # noqa: E402


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
  return {"image": images[train], "label": labels[train]}, {"image": images[test], "label": labels[test]}


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=float, default=8)
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
  train, test = load_split(args.seed)
  model = MLP()
  params = model.init(jax.random.key(args.seed), train["image"][:1])["params"]

  def loss_fn(params, model_state, batch, weights, rng):
    del weights, rng
    logits = model.apply({"params": params}, batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]), model_state

  predict = jax.jit(lambda p, x: model.apply({"params": p}, x).argmax(-1))

  def eval_fn(params, model_state):
    del model_state
    return {"accuracy": float(np.mean(np.asarray(predict(params, test["image"])) == test["label"]))}

  optimizer = optax.chain(
      simigrad_jax.transform("batch"),
      optax.sgd(args.learning_rate, momentum=0.9),
      simigrad_jax.scale_by_lr_factor(),
  )
  controller = simigrad_jax.Controller(
      args.initial_batch_size, args.similarity_target,
      batch_size_lower_bound=args.lower, batch_size_upper_bound=args.upper)
  num_devices = jax.device_count()
  trainer = simigrad_jax.Trainer(
      loss_fn=loss_fn, params=params, optimizer=optimizer,
      source=simigrad_jax.ArraySource(train), controller=controller, workdir=args.workdir,
      max_micro_batch_size=-(-args.upper // num_devices), eval_fn=eval_fn, seed=args.seed)
  with trainer:
    summary = trainer.train(num_epochs=args.epochs)
  metrics_path = os.path.join(args.workdir, "metrics.jsonl")
  for record in simigrad_jax.read_metrics(metrics_path):
    if "eval_accuracy" in record:
      print(f"epoch {record['epoch'] + 1:3d}  test accuracy {record['eval_accuracy']:.4f}  "
            f"step {record['step']:4d}  examples seen {record['examples_seen']}")
  png = plot.plot_metrics(metrics_path, os.path.join(args.workdir, "metrics.png"),
                          title="SimiGrad on scikit-learn digits")
  rows = [
      ("final test accuracy", f"{summary.get('eval_accuracy', float('nan')):.4f}"),
      ("optimizer steps", summary["steps"]),
      ("examples seen", summary["examples_seen"]),
      ("average batch size", f"{summary['average_batch_size']:.1f}"),
      ("final batch size", summary["final_batch_size"]),
      ("devices", num_devices),
      ("compiles", summary["compiles"]),
      ("compile seconds (waited)", f"{summary['compile_seconds']:.1f} ({summary['compile_wait_seconds']:.1f})"),
      ("metrics", metrics_path),
      ("plot", str(png)),
  ]
  width = max(len(name) for name, _ in rows)
  print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))
  return summary


if __name__ == "__main__":
  main()
