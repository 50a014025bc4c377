"""MNIST with the flax examples' small CNN: the same data as ``mnist_mlp``.

Hardware: a CPU (8 simulated devices) or any number of accelerators.
Runtime: about 2 minutes for 10 epochs of the 5,000 local images on a 2-core
CPU (measured: 121 s of CPU time; test accuracy 0.974, average batch 71);
seconds per epoch of the full 60,000 on a GPU host.
"""

from train.configs import mnist_mlp


def get_config():
  """MNIST, CNN (conv 32 - conv 64 - dense 256), SGD, SimiGrad from batch 64 within [32, 2048]."""
  config = mnist_mlp.get_config()
  config.model = "cnn"
  config.cnn_features = (32, 64)
  config.cnn_dense = 256
  config.learning_rate = 0.05
  return config
