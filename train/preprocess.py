"""In-graph preprocessing: image normalisation and augmentation, and BERT's token masking.

Everything here runs inside the Trainer's compiled step on one device's rows,
drawing its randomness from the key the Trainer hands the loss function
(derived from the run's seed, the optimizer step, the micro-step and the
device), so a resumed run draws exactly the same crops, flips and masks. The
host side (``input_pipeline``) only decodes and ships fixed-shape uint8 arrays
and token ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

# Per-channel statistics of the training sets, on the 0-255 scale.
CIFAR10_MEAN = (125.31, 122.95, 113.87)
CIFAR10_STD = (62.99, 62.09, 66.70)
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)


def normalize(
  images: jax.Array, mean: Sequence[float] | None, std: Sequence[float] | None
) -> jax.Array:
  """Images as float32: ``(x - mean) / std`` per channel, or ``x / 255`` when ``mean`` is None."""
  x = images.astype(jnp.float32)
  if mean is None:
    return x / 255.0
  return (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)


def random_crop_and_flip(rng: jax.Array, images: jax.Array, padding: int = 4) -> jax.Array:
  """The CIFAR augmentation: zero-pad by ``padding``, crop back at a random offset, flip half.

  Args:
    rng: a key; each image draws its own offset and flip.
    images: ``[batch, height, width, channels]``.
    padding: pixels of zero padding on each side (4 in the reference).

  Returns:
    Images of the input shape and dtype.
  """
  batch, height, width, _ = images.shape
  crop_key, flip_key = jax.random.split(rng)
  offsets = jax.random.randint(crop_key, (batch, 2), 0, 2 * padding + 1)
  flips = jax.random.bernoulli(flip_key, 0.5, (batch,))
  padded = jnp.pad(images, ((0, 0), (padding, padding), (padding, padding), (0, 0)))

  def one(image, offset, flip):
    crop = jax.lax.dynamic_slice(image, (offset[0], offset[1], 0), (height, width, image.shape[-1]))
    return jnp.where(flip, crop[:, ::-1], crop)

  return jax.vmap(one)(padded, offsets, flips)


def random_resized_crop_and_flip(
  rng: jax.Array,
  images: jax.Array,
  size: int,
  *,
  area_range: tuple[float, float] = (0.08, 1.0),
  aspect_range: tuple[float, float] = (3 / 4, 4 / 3),
) -> jax.Array:
  """The Inception crop: a random box of 8-100% of the area and 3/4-4/3 aspect, resized to ``size``, flipped half.

  Runs in-graph on fixed-shape inputs (the host ships square center crops),
  resampling each box with ``jax.image.scale_and_translate`` (bilinear), so
  every image gets its own box with one compiled shape.

  Args:
    rng: a key.
    images: ``[batch, height, width, channels]`` (any dtype; float32 out).
    size: the output height and width.
    area_range: the box's share of the image area.
    aspect_range: the box's width / height.

  Returns:
    float32 images ``[batch, size, size, channels]``.
  """
  batch, height, width, _ = images.shape
  area_key, aspect_key, y_key, x_key, flip_key = jax.random.split(rng, 5)
  area = jax.random.uniform(area_key, (batch,), minval=area_range[0], maxval=area_range[1])
  log_aspect = jax.random.uniform(
    aspect_key, (batch,), minval=jnp.log(aspect_range[0]), maxval=jnp.log(aspect_range[1])
  )
  aspect = jnp.exp(log_aspect)
  box_w = jnp.clip(jnp.sqrt(area * aspect) * width, 1.0, width)
  box_h = jnp.clip(jnp.sqrt(area / aspect) * height, 1.0, height)
  top = jax.random.uniform(y_key, (batch,)) * (height - box_h)
  left = jax.random.uniform(x_key, (batch,)) * (width - box_w)
  flips = jax.random.bernoulli(flip_key, 0.5, (batch,))

  def one(image, top, left, box_h, box_w, flip):
    scale = jnp.stack([size / box_h, size / box_w])
    translation = jnp.stack([-top * scale[0], -left * scale[1]])
    out = jax.image.scale_and_translate(
      image.astype(jnp.float32),
      (size, size, image.shape[-1]),
      (0, 1),
      scale,
      translation,
      method="linear",
      antialias=True,
    )
    return jnp.where(flip, out[:, ::-1], out)

  return jax.vmap(one)(images, top, left, box_h, box_w, flips)


def center_crop(images: jax.Array, size: int) -> jax.Array:
  """The central ``size`` x ``size`` window of each image."""
  _, height, width, _ = images.shape
  top, left = (height - size) // 2, (width - size) // 2
  return images[:, top : top + size, left : left + size]


def mask_tokens(
  rng: jax.Array,
  tokens: jax.Array,
  *,
  mask_rate: float,
  mask_id: int,
  pad_id: int,
  first_regular_id: int,
  vocab_size: int,
) -> tuple[jax.Array, jax.Array]:
  """BERT's masking: choose ``mask_rate`` of the real tokens; of those 80% become MASK, 10% random, 10% unchanged.

  Args:
    rng: a key.
    tokens: int ``[batch, length]``; ``pad_id`` marks padding, never chosen.
    mask_rate: the share of real tokens to predict (0.15 in BERT).
    mask_id: the id of the MASK token.
    pad_id: the id of padding.
    first_regular_id: random replacements are drawn from
      ``[first_regular_id, vocab_size)`` (no special tokens).
    vocab_size: the vocabulary size.

  Returns:
    ``(inputs, targets)``: the corrupted tokens, and a bool ``[batch, length]``
    marking the positions whose original token the model must predict.
  """
  choose_key, kind_key, random_key = jax.random.split(rng, 3)
  real = tokens != pad_id
  targets = real & jax.random.bernoulli(choose_key, mask_rate, tokens.shape)
  kind = jax.random.uniform(kind_key, tokens.shape)
  random_tokens = jax.random.randint(random_key, tokens.shape, first_regular_id, vocab_size)
  inputs = jnp.where(targets & (kind < 0.8), mask_id, tokens)
  inputs = jnp.where(targets & (kind >= 0.8) & (kind < 0.9), random_tokens, inputs)
  return inputs.astype(tokens.dtype), targets
