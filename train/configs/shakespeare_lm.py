"""A character-level causal language model on tinyshakespeare, trained with AdamW and SimiGrad.

A decoder-only transformer (2 layers, width 64, 4 heads, MLP 256, context
64 characters) reads 64 characters and predicts the next one at every
position; the loss is the mean cross-entropy in nats per character. Data:
``tinyshakespeare.txt`` in ``config.local_data_dir`` (``--config.local_data_dir``
names another folder), else TFDS ``tiny_shakespeare`` (``--config.text_source``
chooses); the last 10% of the characters is the validation text. AdamW
(weight decay 0.1 on matrices, b2 0.99) with a linear warm-up over the first
5% and a cosine decay to zero; the learning rate follows the batch size by
the square-root rule. SimiGrad from 16 sequences (1,024 tokens) within
[16, 256].

The summary reports the validation loss in nats per character next to the
unigram entropy of the training text (3.309 nats: a model that ignores the
context), the tokens seen and tokens per second.

Hardware: a CPU (8 simulated devices) or any number of accelerators.
Runtime: about a minute on a shared 2-core CPU (measured: 60 s for the
epoch, 1.0M characters, 741 optimizer steps at an average batch of 21).
Result: validation loss 1.92 nats/char (accuracy 0.43) after the epoch; the
batch-size comparison on this model is in docs/results.md.
"""

from train.configs import default


def get_config():
  """shakespeare_lm: a small GPT-style character model, AdamW with warm-up and cosine decay."""
  config = default.get_config()
  config.platform = "auto"
  config.dataset = "chars"
  config.text_source = "auto"
  config.eval_fraction = 0.1
  config.eval_examples = 256

  config.model = "causal_lm"
  config.seq_length = 64
  config.bert_hidden = 64
  config.bert_layers = 2
  config.bert_heads = 4
  config.bert_mlp = 256
  config.dropout = 0.0

  config.num_epochs = 1.0
  config.optimizer = "adamw"
  config.learning_rate = 3e-3
  config.b1 = 0.9
  config.b2 = 0.99
  config.eps = 1e-8
  config.weight_decay = 0.1
  config.grad_clip_norm = 1.0
  config.lr_schedule = "cosine"
  config.warmup_epochs = 0.05

  config.controller = "simigrad"
  config.initial_batch_size = 16
  config.similarity_target = 0.1
  config.batch_size_lower_bound = 16
  config.batch_size_upper_bound = 256
  config.max_micro_batch_size = 32
  # A fused step of this transformer takes hundreds of its steps' time to compile, on a CPU
  # as on a GPU: the schedule gives each program 256 steps, run on the fallback (the same
  # batch, in micro-steps), where 64 left most of the compile to wait out (docs/compiling.md).
  config.steps_per_compile = 256.0
  config.eval_batch_size = 256
  return config
