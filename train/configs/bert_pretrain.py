"""BERT-Large masked-language-model pretraining with LAMB: the reference's BERT experiment.

Reference settings: LAMB, initial global batch 128, similarity target 0.8,
upper bound 256k. Here: BERT-Large (24 layers, hidden 1024, 16 heads, MLP
4096, dropout 0.1) with the MLM head only (no next-sentence task, as RoBERTa),
15% of tokens masked (80% MASK, 10% random, 10% kept), drawn in-graph;
LAMB with weight decay 0.01 on weight matrices; learning rate 1e-4 at batch
128 times sqrt(B / 128), warm-up over the first 0.1 epoch, cosine decay;
batch within [128, 65536] (raise ``batch_size_upper_bound`` to 262144 for the
reference's bound, data permitting). bfloat16 compute.

Tokenization is byte-level (train/input_pipeline.py): 256 byte tokens plus
PAD and MASK, no vocabulary file; 512 bytes per sequence hold about as much
English as BERT's 128 WordPiece tokens. The learning rate is not from the
reference (which SPEC.md does not give); tune it.

Data: TFDS ``lm1b`` (30M sentences; 4 consecutive sentences per example,
7.5M examples), prepared in ArrayRecord format (its features are text only,
so ``tfds build lm1b --file_format=array_record`` needs no TensorFlow), or
local text with ``--config.dataset=text --config.text_files=/data/*.txt``.

Hardware: 8 GPUs with >= 40 GB each per host, or several hosts with
``--distributed``. Runtime: days for one epoch on one 8-GPU host; not
measured here.
"""

from train.configs import default


def get_config():
  """BERT-Large MLM pretraining with LAMB and SimiGrad (target 0.8)."""
  config = default.get_config()
  config.dataset = "tfds_text"
  config.tfds_name = "lm1b"
  config.text_feature = "text"
  config.records_per_example = 4
  config.train_split = "train"
  config.eval_split = "test"
  config.eval_examples = 10000

  config.model = "bert"
  config.seq_length = 512
  config.bert_hidden = 1024
  config.bert_layers = 24
  config.bert_heads = 16
  config.bert_mlp = 4096
  config.dropout = 0.1
  config.mask_rate = 0.15
  config.dtype = "bfloat16"

  config.num_epochs = 1.0
  config.optimizer = "lamb"
  config.learning_rate = 1e-4
  config.b1 = 0.9
  config.b2 = 0.999
  config.eps = 1e-6
  config.weight_decay = 0.01
  config.lr_schedule = "cosine"
  config.warmup_epochs = 0.1

  config.controller = "simigrad"
  config.initial_batch_size = 128
  config.similarity_target = 0.8
  config.batch_size_lower_bound = 128
  config.batch_size_upper_bound = 65536
  config.lr_rule = "sqrt"
  config.max_micro_batch_size = 32
  config.eval_batch_size = 256
  config.checkpoint_every_steps = 500
  return config
