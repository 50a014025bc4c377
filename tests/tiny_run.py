"""A tiny Trainer run for the tests: a small MLP on 120 random examples, 8 devices."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax

import simigrad_jax
from simigrad_jax.data import data_loader


class TinyMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.tanh(nn.Dense(8)(x)))


def dataset(num_examples=200, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(num_examples, 5)).astype(np.float32)
  y = rng.integers(0, 3, size=num_examples).astype(np.int32)
  return {"x": x, "y": y, "index": np.arange(num_examples, dtype=np.int32)}


def mlp_loss(params, model_state, batch, weights, rng):
  del weights, rng
  logits = TinyMLP().apply({"params": params}, batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), model_state


def trainer_objects(workdir) -> dict[str, Any]:
  """Everything a Trainer takes but its settings."""
  rng = np.random.default_rng(0)
  data = {
    "x": rng.normal(size=(120, 5)).astype(np.float32),
    "y": rng.integers(0, 3, size=120).astype(np.int32),
  }
  return dict(
    loss_fn=mlp_loss,
    params=TinyMLP().init(jax.random.key(0), data["x"][:1])["params"],
    optimizer=optax.chain(
      simigrad_jax.transform("batch"), optax.sgd(0.1), simigrad_jax.scale_by_lr_factor()
    ),
    source=simigrad_jax.ArraySource(data),
    controller=simigrad_jax.Controller(
      20, 0.5, batch_size_lower_bound=8, batch_size_upper_bound=64
    ),
    workdir=workdir,
  )


def make_trainer(workdir, **settings: Any) -> simigrad_jax.Trainer:
  """A quiet Trainer of the tiny run (no progress bar, no TensorBoard; ``settings`` on top)."""
  settings = {
    "max_micro_batch_size": 4,
    "seed": 3,
    "progress": False,
    "tensorboard": False,
    **settings,
  }
  return trainer_with(**trainer_objects(workdir), **settings)


def trainer_with(**arguments: Any) -> simigrad_jax.Trainer:
  """A Trainer of ``arguments``: the TrainerConfig fields among them as its ``config``, the rest
  as its own arguments."""
  fields = {field.name for field in dataclasses.fields(simigrad_jax.TrainerConfig)}
  config = simigrad_jax.TrainerConfig(**{k: v for k, v in arguments.items() if k in fields})
  return simigrad_jax.Trainer(
    **{k: v for k, v in arguments.items() if k not in fields}, config=config
  )


def train_records(
  workdir, cache_dir, num_steps: int, **overrides: Any
) -> tuple[dict[str, Any], Any, list[dict[str, Any]]]:
  """Trains the tiny run for ``num_steps`` steps (resuming from ``workdir``'s checkpoint).

  ``overrides`` replace :func:`trainer_objects`' entries (``optimizer``,
  ``controller``, ...), add Trainer arguments (``lr_schedule``) or settings
  (``compile=CompileConfig(fallback=False)``); the compilation cache in
  ``cache_dir`` (set into the ``compile`` settings) is shared between the
  runs of a test.

  Returns:
    The summary, the optimizer state on the host, and the metrics records of
    every step.
  """
  with simigrad_jax.compile.persistent_cache_settings():  # the Trainer's cache is process-wide
    settings = dict(
      max_micro_batch_size=4,
      seed=2,
      progress=False,
      tensorboard=False,
    )
    compiling = overrides.pop("compile", simigrad_jax.CompileConfig())
    overrides["compile"] = compiling.replace(cache_dir=cache_dir)
    trainer = trainer_with(**(trainer_objects(workdir) | settings | overrides))
    with trainer:
      summary = trainer.train(num_steps=num_steps)
      opt_state = jax.device_get(trainer.state["opt_state"])
  records = simigrad_jax.read_metrics(pathlib.Path(workdir) / "metrics.jsonl")
  return summary, opt_state, [r for r in records if "batch_size" in r]


@contextlib.contextmanager
def recording_placements() -> Iterator[list[tuple[int, bool]]]:
  """Records every plan the data loader places: ``(global batch size, placed ahead)``, ahead
  meaning in the data thread, while the step before ran."""
  placed: list[tuple[int, bool]] = []
  place = data_loader.StepDataLoader.place

  def recording(self, plan, loaded, step):
    ahead = threading.current_thread() is not threading.main_thread()
    placed.append((plan.global_batch_size, ahead))
    return place(self, plan, loaded, step)

  data_loader.StepDataLoader.place = recording
  try:
    yield placed
  finally:
    data_loader.StepDataLoader.place = place
