"""A tiny BERT trained with LAMB and SimiGrad on a few MB of text, on a CPU in minutes.

The ``bert_pretrain`` recipe (MLM head, 15% masking, LAMB, similarity target
0.8, initial batch 128) at toy size: 2 layers, hidden 128, 2 heads, MLP 512,
128-byte sequences, no dropout. Text: tinyshakespeare (1.1 MB) from
``config.local_data_dir`` when present, else the Python documentation shipped
with every Python (``pydoc_data.topics``, about 0.5 MB); ``--config.text_files``
for your own. The last 5% of the text is held out for evaluation (masked-token
accuracy). Tokenization is byte-level (see ``bert_pretrain``).

Hardware: a CPU (8 simulated devices) or any number of accelerators.
Runtime: about 3 minutes on a 2-core CPU (measured on tinyshakespeare: 314 s
of CPU time, 126 optimizer steps, average batch 131 growing to 300-600).
Result: held-out masked-byte accuracy 0.230 and loss 3.09 after 2 epochs,
past the byte-frequency baseline (always guessing a space: 0.152; unigram
entropy 3.31 nats) but not far: it has learned the byte statistics and a
little context; learning more takes more epochs (not measured here).
"""

from train.configs import default


def get_config():
  """bert_tiny: the BERT recipe at a size a laptop trains in minutes."""
  config = default.get_config()
  config.platform = "auto"
  config.dataset = "text"
  config.text_files = ""
  config.eval_fraction = 0.05
  config.eval_examples = 512

  config.model = "bert"
  config.seq_length = 128
  config.bert_hidden = 128
  config.bert_layers = 2
  config.bert_heads = 2
  config.bert_mlp = 512
  config.dropout = 0.0
  config.mask_rate = 0.15

  config.num_epochs = 2.0
  config.optimizer = "lamb"
  config.learning_rate = 1e-2
  config.weight_decay = 0.01
  config.lr_schedule = "constant"
  config.warmup_epochs = 0.1

  config.controller = "simigrad"
  config.initial_batch_size = 128
  config.similarity_target = 0.8
  config.batch_size_lower_bound = 32
  config.batch_size_upper_bound = 1024
  config.max_micro_batch_size = 64
  config.eval_batch_size = 256
  return config
