"""Flax (linen) models for the training configs: MLP, small CNN, ResNet, BERT-style MLM encoder, causal LM.

In-graph code: every module here runs inside the Trainer's data-parallel step.
Image models take ``(images, train, mask)``: ``mask`` (True for real rows,
False for padding) goes to every BatchNorm so padding rows never enter the
batch statistics. BatchNorm averages its statistics over ``bn_axis_name``
(the Trainer's data-parallel axis, ``"batch"``) when given, else it uses each
device's own rows, as PyTorch's DistributedDataParallel without SyncBatchNorm
(the reference's set-up) does.

:func:`create_model` builds the model named in a config.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import ml_collections

ModuleDef = Any


class MLP(nn.Module):
  """A perceptron on flattened inputs: ``hidden`` ReLU layers, then ``num_classes`` logits."""

  num_classes: int
  hidden: Sequence[int] = (128,)

  @nn.compact
  def __call__(self, x, train: bool = True, mask=None):
    del train, mask
    x = x.reshape(x.shape[0], -1)
    for width in self.hidden:
      x = nn.relu(nn.Dense(width)(x))
    return nn.Dense(self.num_classes)(x)


class CNN(nn.Module):
  """A small convnet: 3x3 conv + ReLU + 2x2 average pool per entry of ``features``, then two dense layers."""

  num_classes: int
  features: Sequence[int] = (32, 64)
  dense: int = 128

  @nn.compact
  def __call__(self, x, train: bool = True, mask=None):
    del train, mask
    for width in self.features:
      x = nn.relu(nn.Conv(width, (3, 3))(x))
      if min(x.shape[1:3]) >= 2:
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(self.dense)(x))
    return nn.Dense(self.num_classes)(x)


class ResNetBlock(nn.Module):
  """The basic two-conv residual block (ResNet-18/34)."""

  filters: int
  conv: ModuleDef
  norm: ModuleDef
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.conv(self.filters, (3, 3), self.strides)(x)
    y = nn.relu(self.norm()(y))
    y = self.conv(self.filters, (3, 3))(y)
    y = self.norm(scale_init=nn.initializers.zeros_init())(y)
    if residual.shape != y.shape:
      residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
      residual = self.norm(name="norm_proj")(residual)
    return nn.relu(residual + y)


class BottleneckResNetBlock(nn.Module):
  """The 1x1-3x3-1x1 bottleneck residual block (ResNet-50 and deeper)."""

  filters: int
  conv: ModuleDef
  norm: ModuleDef
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    residual = x
    y = nn.relu(self.norm()(self.conv(self.filters, (1, 1))(x)))
    y = nn.relu(self.norm()(self.conv(self.filters, (3, 3), self.strides)(y)))
    y = self.conv(self.filters * 4, (1, 1))(y)
    y = self.norm(scale_init=nn.initializers.zeros_init())(y)
    if residual.shape != y.shape:
      residual = self.conv(self.filters * 4, (1, 1), self.strides, name="conv_proj")(residual)
      residual = self.norm(name="norm_proj")(residual)
    return nn.relu(residual + y)


class ResNet(nn.Module):
  """ResNet v1.5 (stride in the 3x3 conv), as in the flax ImageNet example.

  ``stem="imagenet"``: 7x7/2 conv and 3x3/2 max pool (224x224 inputs);
  ``stem="cifar"``: one 3x3/1 conv and no pooling (32x32 inputs, the usual
  CIFAR ResNet-18). The last block of each residual branch starts at zero
  scale, so every block starts as the identity.
  """

  stage_sizes: Sequence[int]
  block_cls: ModuleDef
  num_classes: int
  num_filters: int = 64
  stem: str = "imagenet"
  bn_axis_name: str | None = None
  bn_momentum: float = 0.9
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = True, mask=None):
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
    bn_mask = None if mask is None or not train else mask.reshape((-1, 1, 1, 1))
    base_norm = functools.partial(
      nn.BatchNorm,
      use_running_average=not train,
      momentum=self.bn_momentum,
      epsilon=1e-5,
      dtype=self.dtype,
      axis_name=self.bn_axis_name if train else None,
    )

    def norm(**kwargs):
      module = base_norm(**kwargs)
      return lambda y: module(y, mask=bn_mask)

    if self.stem == "imagenet":
      x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
      x = nn.relu(norm(name="bn_init")(x))
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    elif self.stem == "cifar":
      x = conv(self.num_filters, (3, 3), name="conv_init")(x)
      x = nn.relu(norm(name="bn_init")(x))
    else:
      raise ValueError(f"stem={self.stem!r} is not valid; choose 'imagenet' or 'cifar'")
    for i, block_size in enumerate(self.stage_sizes):
      for j in range(block_size):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = self.block_cls(self.num_filters * 2**i, conv=conv, norm=norm, strides=strides)(x)
    x = jnp.mean(x.astype(jnp.float32), axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


RESNETS: dict[str, tuple[tuple[int, ...], ModuleDef]] = {
  "resnet18": ((2, 2, 2, 2), ResNetBlock),
  "resnet34": ((3, 4, 6, 3), ResNetBlock),
  "resnet50": ((3, 4, 6, 3), BottleneckResNetBlock),
  "resnet101": ((3, 4, 23, 3), BottleneckResNetBlock),
}


class TransformerLayer(nn.Module):
  """A post-LayerNorm transformer encoder layer, as in BERT."""

  hidden: int
  heads: int
  mlp: int
  dropout: float
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, attention_mask, train: bool):
    drop = nn.Dropout(self.dropout, deterministic=not train)
    y = nn.MultiHeadDotProductAttention(
      num_heads=self.heads, dropout_rate=self.dropout, deterministic=not train, dtype=self.dtype
    )(x, x, mask=attention_mask)
    x = nn.LayerNorm(epsilon=1e-12, dtype=self.dtype)(x + drop(y))
    y = nn.Dense(self.mlp, dtype=self.dtype)(x)
    y = nn.Dense(self.hidden, dtype=self.dtype)(nn.gelu(y, approximate=False))
    return nn.LayerNorm(epsilon=1e-12, dtype=self.dtype)(x + drop(y))


class _Transformer(nn.Module):
  """The settings BERT's encoder and the causal LM share (the causal LM's defaults: a small model).

  Attributes:
    vocab_size: the tokens' vocabulary.
    max_length: the longest window (the learned position embeddings).
    hidden: the width.
    layers: the :class:`TransformerLayer` s.
    heads: the attention heads of each layer.
    mlp: the width of each layer's MLP.
    dropout: the dropout rate (embeddings, attention, MLP).
    dtype: the compute dtype (parameters stay float32).
  """

  vocab_size: int
  max_length: int
  hidden: int = 128
  layers: int = 2
  heads: int = 4
  mlp: int = 512
  dropout: float = 0.0
  dtype: Any = jnp.float32


def _encode(
  module: _Transformer, tokens: Any, attention_mask: Any, train: bool
) -> tuple[Any, nn.Embed]:
  """The transformers' body, called inside ``module``'s compact call: token and position
  embeddings, a LayerNorm and dropout, then ``module.layers`` :class:`TransformerLayer` s under
  ``attention_mask``. Returns the hidden states and the token embedding (for a tied head)."""
  init = nn.initializers.normal(0.02)
  embed = nn.Embed(
    module.vocab_size, module.hidden, embedding_init=init, dtype=module.dtype, name="token_embed"
  )
  positions = module.param("position_embed", init, (module.max_length, module.hidden))
  x = embed(tokens) + positions[None, : tokens.shape[1]].astype(module.dtype)
  x = nn.LayerNorm(epsilon=1e-12, dtype=module.dtype)(x)
  x = nn.Dropout(module.dropout, deterministic=not train)(x)
  for i in range(module.layers):
    x = TransformerLayer(
      module.hidden, module.heads, module.mlp, module.dropout, module.dtype, name=f"layer_{i}"
    )(x, attention_mask, train)
  return x, embed


class BertMLM(_Transformer):
  """A BERT encoder with its masked-language-model head (no next-sentence head).

  Token and learned position embeddings, ``layers`` post-LayerNorm transformer
  layers, then the MLM head (dense + GELU + LayerNorm) whose output layer is
  tied to the token embedding. Positions holding ``pad_id`` are masked out of
  attention. Its defaults are BERT-base's.

  Returns logits of shape ``[batch, length, vocab_size]``.
  """

  hidden: int = 768
  layers: int = 12
  heads: int = 12
  mlp: int = 3072
  dropout: float = 0.1
  pad_id: int = 0

  @nn.compact
  def __call__(self, tokens, train: bool = True):
    attention_mask = nn.make_attention_mask(tokens != self.pad_id, tokens != self.pad_id)
    x, embed = _encode(self, tokens, attention_mask, train)
    x = nn.Dense(self.hidden, dtype=self.dtype, name="mlm_dense")(x)
    x = nn.LayerNorm(epsilon=1e-12, dtype=self.dtype, name="mlm_norm")(
      nn.gelu(x, approximate=False)
    )
    bias = self.param("mlm_bias", nn.initializers.zeros_init(), (self.vocab_size,))
    return embed.attend(x).astype(jnp.float32) + bias


class CausalLM(_Transformer):
  """A decoder-only transformer language model: the next token's logits at every position.

  Token and learned position embeddings and a LayerNorm, then ``layers`` of
  BERT's post-LayerNorm :class:`TransformerLayer` under a causal mask (each
  position attends to itself and the positions before it), then a dense
  output layer.

  Returns logits of shape ``[batch, length, vocab_size]`` (float32).
  """

  @nn.compact
  def __call__(self, tokens, train: bool = True):
    x, _ = _encode(self, tokens, nn.make_causal_mask(tokens), train)
    return nn.Dense(self.vocab_size, dtype=self.dtype, name="head")(x).astype(jnp.float32)


MODELS: tuple[str, ...] = ("mlp", "cnn", *RESNETS, "bert", "causal_lm")


def create_model(
  config: ml_collections.ConfigDict,
  *,
  num_classes: int | None = None,
  vocab_size: int | None = None,
  dtype: Any = jnp.float32,
) -> nn.Module:
  """Builds the model named by ``config.model``.

  Args:
    config: the experiment config (``model`` and its ``model_*`` fields).
    num_classes: the number of classes, for image models.
    vocab_size: the vocabulary size, for ``"bert"`` and ``"causal_lm"``.
    dtype: the compute dtype of ResNets and the transformers (parameters stay float32).

  Returns:
    An unbound flax module.

  Raises:
    ValueError: for an unknown model name.
  """
  name = config.model
  if name == "mlp":
    return MLP(num_classes=num_classes, hidden=tuple(config.mlp_hidden))
  if name == "cnn":
    return CNN(num_classes=num_classes, features=tuple(config.cnn_features), dense=config.cnn_dense)
  if name in RESNETS:
    stages, block = RESNETS[name]
    stages = tuple(config.resnet_stage_sizes) or stages
    return ResNet(
      stage_sizes=stages,
      block_cls=block,
      num_classes=num_classes,
      num_filters=config.resnet_filters,
      stem=config.resnet_stem,
      bn_axis_name="batch" if config.sync_batchnorm else None,
      bn_momentum=config.bn_momentum,
      dtype=dtype,
    )
  if name in ("bert", "causal_lm"):  # the causal LM takes BERT's layer options
    transformer = BertMLM if name == "bert" else CausalLM
    return transformer(
      vocab_size=vocab_size,
      max_length=config.seq_length,
      hidden=config.bert_hidden,
      layers=config.bert_layers,
      heads=config.bert_heads,
      mlp=config.bert_mlp,
      dropout=config.dropout,
      dtype=dtype,
    )
  raise ValueError(f"unknown model {name!r}; choose one of {MODELS}")
