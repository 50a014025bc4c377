"""A soak run in its own process: thousands of tiny steps with the batch size moving at every step.

python tests/soak_driver.py --workdir DIR --steps N [--warmup W] [--sample-every S]

A linear softmax model on a synthetic set of 2048 examples, 8 simulated CPU
devices, SimiGrad's controller with bounds [8, 64] and a similarity target
near the similarity this problem shows, so that nearly every step grows or
shrinks the batch (four micro-batch shapes, one or two accumulation steps).
Metrics go to JSONL and TensorBoard, a checkpoint is saved every 500 steps.
The resident set size (VmRSS) and its peak (VmHWM) are sampled after the
warm-up and then every ``S`` steps. Prints one JSON line: the samples, the
compile counts, the number of live Python objects at the first and last
sample, how often the batch size changed and the run's seconds.
"""

import argparse
import gc
import json
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--workdir", required=True)
parser.add_argument("--steps", type=int, default=3000)
parser.add_argument("--warmup", type=int, default=300)
parser.add_argument("--sample-every", type=int, default=250)
args = parser.parse_args()

os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simigrad_jax.multihost.cpu_devices import simulated_cpu_devices_env  # noqa: E402

os.environ.update(simulated_cpu_devices_env(8))

import numpy as np  # noqa: E402
import optax  # noqa: E402

import simigrad_jax  # noqa: E402


def memory_mb():
  """(VmRSS, VmHWM) of this process, in MiB."""
  values = {}
  with open("/proc/self/status", encoding="ascii") as f:
    for line in f:
      key, _, rest = line.partition(":")
      if key in ("VmRSS", "VmHWM"):
        values[key] = int(rest.split()[0]) / 1024
  return values["VmRSS"], values["VmHWM"]


rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 4)).astype(np.float32)
y = (x @ rng.normal(size=(4, 3)) + 2.0 * rng.normal(size=(2048, 3))).argmax(-1).astype(np.int32)
params = {"w": np.zeros((4, 3), np.float32), "b": np.zeros(3, np.float32)}


def loss_fn(params, model_state, batch, weights, rng_key):
  del weights, rng_key
  logits = batch["x"] @ params["w"] + params["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), model_state


optimizer = optax.chain(
  simigrad_jax.transform("batch"), optax.sgd(1e-4, momentum=0.9), simigrad_jax.scale_by_lr_factor()
)
controller = simigrad_jax.Controller(24, 0.45, batch_size_lower_bound=8, batch_size_upper_bound=128)
trainer = simigrad_jax.Trainer(
  loss_fn=loss_fn,
  params=params,
  optimizer=optimizer,
  source=simigrad_jax.ArraySource({"x": x, "y": y}),
  controller=controller,
  workdir=args.workdir,
  config=simigrad_jax.TrainerConfig(
    max_micro_batch_size=4,
    seed=0,
    progress=False,
    tensorboard=True,
    checkpoints=simigrad_jax.CheckpointConfig(every_steps=500, max_to_keep=2),
  ),
)

samples = []  # (step, rss, hwm, live objects)
sizes = []


class Sampling:
  """Samples the process's memory as soon as a step is decided, before the next is dispatched."""

  runs_at_once = True

  def on_step(self, record):
    sample(record)


def sample(record):
  sizes.append(record.batch_size)
  step = record.step
  if step >= args.warmup and (step - args.warmup) % args.sample_every == 0 or step == args.steps:
    gc.collect()
    rss, hwm = memory_mb()
    samples.append(
      {
        "step": step,
        "rss_mb": rss,
        "hwm_mb": hwm,
        "objects": len(gc.get_objects()),
        "compiles": trainer.compile_stats()["compiles"],
      }
    )


trainer.add_hook(Sampling())
start = time.perf_counter()
with trainer:
  summary = trainer.train(num_steps=args.steps)
seconds = time.perf_counter() - start
changes = sum(a != b for a, b in zip(sizes, sizes[1:]))
metrics_lines = sum(1 for _ in open(os.path.join(args.workdir, "metrics.jsonl"), encoding="utf-8"))
print(
  json.dumps(
    {
      "steps": summary["steps"],
      "seconds": seconds,
      "samples": samples,
      "distinct_batch_sizes": len(set(sizes)),
      "batch_size_changes": changes,
      "compiled_micro_batch_sizes": summary["compiled_micro_batch_sizes"],
      "compiles": summary["compiles"],
      "metrics_lines": metrics_lines,
      "sampler_cached_epochs": len(trainer.sampler._cache),
    }
  )
)
