"""The models, data and optimizer that ``benchmarks/trainer_overhead/switching.py`` trains.

Import it after the devices are set up (it imports JAX).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax

import simigrad_jax
from train import image_data

AXIS = "batch"


class SmallCNN(nn.Module):
  """Two 3x3 convolutions and two dense layers for 8x8x1 digit images."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(16, (3, 3))(x))
    x = nn.relu(nn.Conv(32, (3, 3), strides=(2, 2))(x))
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(64)(x))
    return nn.Dense(10)(x)


class MLP(nn.Module):
  """One hidden layer over the flattened 8x8 image."""

  @nn.compact
  def __call__(self, x):
    x = x.reshape((x.shape[0], -1))
    return nn.Dense(10)(nn.relu(nn.Dense(64)(x)))


MODELS = {"cnn": SmallCNN, "mlp": MLP}


def load_digits_data() -> dict[str, np.ndarray]:
  """scikit-learn's digits: float32 images (N, 8, 8, 1) in [0, 1], int32 labels."""
  images, labels = image_data.digits_arrays()
  return {"image": images, "label": labels}


def make_loss_fn(model: nn.Module):

  def loss_fn(params, model_state, batch, weights, rng):
    del weights, rng
    logits = model.apply({"params": params}, batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]), model_state

  return loss_fn


def make_optimizer() -> optax.GradientTransformation:
  """SimiGrad's transform, SGD with momentum and the learning-rate factor, as a Trainer needs."""
  return optax.chain(
    simigrad_jax.transform(AXIS), optax.sgd(0.05, momentum=0.9), simigrad_jax.scale_by_lr_factor()
  )


def init_params(model_name: str, data: dict[str, np.ndarray], seed: int = 0) -> Any:
  """The model's initial parameters as NumPy arrays (each Trainer copies them to the devices)."""
  model = MODELS[model_name]()
  return jax.tree.map(np.asarray, model.init(jax.random.key(seed), data["image"][:1])["params"])
