"""The three tasks of the training scripts: their loss, prediction and evaluation functions.

* image classification (``mlp``, ``cnn``, ``resnet*``): softmax cross-entropy,
  in-graph augmentation, BatchNorm statistics as model state, evaluated for
  accuracy and loss;
* masked language modelling (``bert``): BERT's 15% masking drawn in-graph,
  cross-entropy on the masked positions (averaged per example), evaluated for
  masked-token accuracy and loss with a fixed mask.

The loss functions run in-graph on one device's rows inside the Trainer's step
and return per-example losses; the Trainer weights them (padding rows 0) into
the exact mean over the global batch. The evaluation runs on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from train import input_pipeline
from train import preprocess

AUGMENTATIONS: tuple[str, ...] = ("none", "crop_flip", "inception")


# ------------------------------------------------------------------ image classification


def image_fns(
  config: ml_collections.ConfigDict, model: Any, datasets: input_pipeline.Datasets
) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
  """Image classification's ``(loss_fn, predict, eval_step)``; ``eval_step`` sums correct, loss, count.

  The images are augmented in-graph as ``config.augment`` says and normalised.
  """
  if config.augment not in AUGMENTATIONS:
    raise ValueError(
      f"config.augment={config.augment!r} is not valid; choose one of {AUGMENTATIONS}"
    )
  mean, std = datasets.image_mean, datasets.image_std

  def prepare(images, rng, train: bool):
    if config.augment == "crop_flip" and train:
      images = preprocess.random_crop_and_flip(rng, images, config.crop_padding)
    elif config.augment == "inception":
      images = (
        preprocess.random_resized_crop_and_flip(rng, images, config.image_size)
        if train
        else preprocess.center_crop(images, config.image_size)
      )
    if images.dtype == jnp.uint8 or mean is not None:
      return preprocess.normalize(images, mean, std)
    return images.astype(jnp.float32)

  def loss_fn(params, model_state, batch, weights, rng):
    images = prepare(batch["image"], rng, True)
    variables = {"params": params, **(model_state or {})}
    mask = weights > 0
    if model_state:
      logits, new_state = model.apply(
        variables, images, train=True, mask=mask, mutable=list(model_state)
      )
    else:
      logits, new_state = model.apply(variables, images, train=True, mask=mask), model_state
    labels = jax.nn.one_hot(batch["label"].astype(jnp.int32), datasets.num_classes)
    if config.label_smoothing:
      labels = optax.smooth_labels(labels, config.label_smoothing)
    return optax.softmax_cross_entropy(logits.astype(jnp.float32), labels), new_state

  def predict(variables, batch):
    return model.apply(variables, prepare(batch["image"], None, False), train=False)

  @jax.jit
  def eval_step(variables, batch, weights):
    logits = predict(variables, batch)
    labels = batch["label"].astype(jnp.int32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    return jnp.sum(correct * weights), jnp.sum(losses * weights), jnp.sum(weights)

  return loss_fn, predict, eval_step


# ------------------------------------------------------------------ masked language modelling


def mlm_fns(
  config: ml_collections.ConfigDict, model: Any, datasets: input_pipeline.Datasets
) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
  """BERT's masked-LM ``(loss_fn, predict, eval_step)``; ``eval_step`` sums correct, loss, masked.

  Used by :func:`train.train.create_experiment` and by ``benchmarks/pareto/mlm.py``.
  """
  mask_args = dict(
    mask_rate=config.mask_rate,
    mask_id=input_pipeline.MASK_ID,
    pad_id=input_pipeline.PAD_ID,
    first_regular_id=input_pipeline.FIRST_BYTE_ID,
    vocab_size=datasets.vocab_size,
  )

  def masked_losses(params, tokens, rng, train: bool):
    mask_rng, dropout_rng = jax.random.split(rng)
    inputs, targets = preprocess.mask_tokens(mask_rng, tokens, **mask_args)
    logits = model.apply(
      {"params": params}, inputs, train=train, rngs={"dropout": dropout_rng} if train else None
    )
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens)
    correct = jnp.argmax(logits, -1) == tokens
    return losses, correct, targets.astype(jnp.float32)

  def loss_fn(params, model_state, batch, weights, rng):
    del weights
    losses, _, targets = masked_losses(params, batch["tokens"], rng, True)
    per_example = jnp.sum(losses * targets, -1) / jnp.maximum(jnp.sum(targets, -1), 1.0)
    return per_example, model_state

  def predict(variables, batch):
    return model.apply({"params": variables["params"]}, batch["tokens"], train=False)

  @jax.jit
  def eval_step(variables, batch, weights, rng):
    losses, correct, targets = masked_losses(variables["params"], batch["tokens"], rng, False)
    targets = targets * weights[:, None]
    return (jnp.sum(correct * targets), jnp.sum(losses * targets), jnp.sum(targets))

  return loss_fn, predict, eval_step


# ------------------------------------------------------------------ causal language modelling


def causal_lm_fns(
  config: ml_collections.ConfigDict, model: Any, datasets: input_pipeline.Datasets
) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
  """The causal LM's ``(loss_fn, predict, eval_step)``; ``eval_step`` sums correct, loss, tokens.

  Each example holds ``L + 1`` tokens (:class:`train.char_data.NextTokenWindows`):
  the model reads the first ``L`` and is scored on the last ``L``. An
  example's loss is the mean cross-entropy of its ``L`` next tokens, in nats;
  as every example predicts ``L`` tokens, the Trainer's mean over examples is
  the mean per token.

  Example:
    >>> loss_fn, predict, eval_step = causal_lm_fns(config, model, datasets)  # doctest: +SKIP
  """
  del datasets

  def token_losses(params, tokens, train: bool, rng):
    logits = model.apply(
      {"params": params},
      tokens[:, :-1],
      train=train,
      rngs={"dropout": rng} if train and config.dropout else None,
    )
    targets = tokens[:, 1:]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return losses, jnp.argmax(logits, -1) == targets

  def loss_fn(params, model_state, batch, weights, rng):
    del weights
    losses, _ = token_losses(params, batch["tokens"], True, rng)
    return jnp.mean(losses, -1), model_state

  def predict(variables, batch):
    return model.apply({"params": variables["params"]}, batch["tokens"][:, :-1], train=False)

  @jax.jit
  def eval_step(variables, batch, weights):
    losses, correct = token_losses(variables["params"], batch["tokens"], False, None)
    per_token = jnp.broadcast_to(weights[:, None], losses.shape)
    return jnp.sum(correct * per_token), jnp.sum(losses * per_token), jnp.sum(per_token)

  return loss_fn, predict, eval_step


def make_evaluate(
  config: ml_collections.ConfigDict,
  datasets: input_pipeline.Datasets,
  eval_step: Callable[..., Any],
  text: bool,
) -> Callable[[Any, Any], dict[str, float]] | None:
  """``evaluate(params, model_state, progress=None) -> {"accuracy", "loss"}`` over ``datasets.eval``.

  For text, each evaluation batch gets a fixed mask (from ``config.seed``), the
  same at every evaluation and for every run with that seed setting.
  ``progress``, if given, is called after each batch with its number of
  examples (a progress bar's ``update``).
  """
  if datasets.eval is None:
    return None

  def evaluate(params, model_state, progress=None):
    variables = jax.device_put({"params": params, **(model_state or {})}, jax.local_devices()[0])
    totals = np.zeros(3)
    for i, (batch, weights) in enumerate(
      input_pipeline.eval_batches(datasets.eval, config.eval_batch_size)
    ):
      args = (variables, batch, weights)
      if text:  # a fixed mask per batch, the same at every evaluation
        args += (jax.random.fold_in(jax.random.key(config.seed + 1), i),)
      totals += np.array(jax.device_get(eval_step(*args)), np.float64)
      if progress is not None:
        progress(int(np.sum(weights)))
    count = max(totals[2], 1.0)
    return {"accuracy": totals[0] / count, "loss": totals[1] / count}

  return evaluate
