"""A small Trainer run in its own process, for the resume-after-SIGKILL and multi-host tests.

python tests/train_driver.py --workdir DIR --steps N [--kill-at K]
    [--num-processes P --process-id I --coordinator 127.0.0.1:PORT]

Trains an MLP on a fixed synthetic classification set over 8 devices in all
(8 // P simulated CPU devices per process). With --kill-at K the process
SIGKILLs itself right after step K's metrics line is written: no clean-up, no
final checkpoint. Prints one JSON summary line at the end.
"""

import argparse
import json
import os
import signal
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--workdir", required=True)
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--kill-at", type=int, default=None)
parser.add_argument("--num-processes", type=int, default=1)
parser.add_argument("--process-id", type=int, default=0)
parser.add_argument("--coordinator", default=None)
parser.add_argument("--mode", default="recompile")
parser.add_argument("--checkpoint-every", type=int, default=3)
args = parser.parse_args()

os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // args.num_processes}"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

if args.num_processes > 1:
  jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                             process_id=args.process_id)

import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import simigrad_jax  # noqa: E402
from simigrad_jax.host import metrics as metrics_module  # noqa: E402


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.tanh(nn.Dense(16)(x)))


def synthetic_data(num_examples=600, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(num_examples, 8)).astype(np.float32)
  teacher = rng.normal(size=(8, 4))
  y = np.argmax(x @ teacher + 1.5 * rng.normal(size=(num_examples, 4)), axis=1).astype(np.int32)
  return {"x": x, "y": y, "index": np.arange(num_examples, dtype=np.int32)}


def loss_fn(params, model_state, batch, weights, rng):
  del weights, rng
  logits = MLP().apply({"params": params}, batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), model_state


if args.kill_at is not None:
  original_write = metrics_module.MetricsWriter.write

  def write_then_die(self, record):
    original_write(self, record)
    if record.get("step") == args.kill_at and "loss" in record:
      os.kill(os.getpid(), signal.SIGKILL)

  metrics_module.MetricsWriter.write = write_then_die

params = MLP().init(jax.random.key(0), np.zeros((1, 8), np.float32))["params"]
optimizer = optax.chain(simigrad_jax.transform("batch"), optax.sgd(0.2, momentum=0.9),
                        simigrad_jax.scale_by_lr_factor())
controller = simigrad_jax.Controller(48, 0.3, batch_size_lower_bound=16, batch_size_upper_bound=160)
trainer = simigrad_jax.Trainer(
    loss_fn=loss_fn, params=params, optimizer=optimizer,
    source=simigrad_jax.ArraySource(synthetic_data()), controller=controller,
    workdir=args.workdir, max_micro_batch_size=8, mode=args.mode, seed=1,
    checkpoint_every_steps=args.checkpoint_every, progress=False, tensorboard=False)
summary = trainer.train(num_steps=args.steps)
trainer.close()
if jax.process_index() == 0:
  print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, list)}))
