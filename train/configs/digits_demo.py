"""The README's demo: SimiGrad on scikit-learn's bundled handwritten digits (no download).

1,500 training and 297 test images of 8x8 pixels, 10 classes; a small CNN
(conv 32 - conv 64 - dense 128) trained for 15 epochs with SGD (lr 0.1,
momentum 0.9); the SimiGrad controller from a batch of 32 within [16, 512]
with similarity target 0.5, the learning rate following sqrt(B / 32). Its
accuracy, batch sizes and runtime as measured: README.md's Quick start.

Hardware: any; on the machine's accelerators, however many, or on 8 simulated
CPU devices when it has none (``--config.platform=cpu
--config.num_cpu_devices=N`` for N CPU devices, 1 included; an odd count
uses the local split). Runtime: under a minute on a 2-core machine, with
compiling the micro-batch shapes in the background a good part of it.
"""

from train.configs import default


def get_config():
  """The demo's config."""
  config = default.get_config()
  config.platform = "auto"
  config.dataset = "digits"
  config.model = "cnn"
  config.cnn_features = (32, 64)
  config.cnn_dense = 128
  config.num_epochs = 15.0
  config.optimizer = "sgd"
  config.learning_rate = 0.1
  config.momentum = 0.9

  config.controller = "simigrad"
  config.initial_batch_size = 32
  config.similarity_target = 0.5
  config.batch_size_lower_bound = 16
  config.batch_size_upper_bound = 512
  config.max_micro_batch_size = 64  # 8 devices x 64 = 512: one micro-step per optimizer step
  config.eval_batch_size = 297
  return config
