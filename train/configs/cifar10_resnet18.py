"""CIFAR-10, ResNet-18: the reference's CIFAR experiment.

Reference settings (SimiGrad's scripts): ResNet-18 for 32x32 inputs (3x3
stem, no max pool), initial global batch 128, SGD with learning rate 0.1,
momentum 0.9 and weight decay 5e-4, step decay x0.1 at epochs 80 and 120,
200 epochs; random crop (zero padding 4) and horizontal flip. The reference
swept similarity targets 0.00-0.20 and lower bounds 32-1024; this file takes
target 0.1 within [128, 16384] (``--config.similarity_target=0.05`` etc. to
sweep). The learning rate follows sqrt(B / 128).

Data: TFDS ``cifar10`` (train 50,000, test 10,000), read through
``tfds.data_source``: prepare it once in ArrayRecord format (preparing the
image builder needs TensorFlow: ``pip install -e ".[tensorflow]"``, then
``tfds build cifar10 --file_format=array_record``), or set ``--config.download=True``
where TFDS can download.

Hardware: one host with 8 GPUs (any number works; 2 x 4 hosts with
``--distributed``). Memory: up to 256 images per GPU per micro-step, well
under 16 GB. Runtime: expected about 1-3 hours on 8 current GPUs for the
200 epochs (10M images); the host decodes images in ``num_workers`` grain
worker processes (default: the cores minus one). Not measured here (no GPU
host with the data).
"""

from train.configs import default


def get_config():
  """The reference CIFAR-10 ResNet-18 run."""
  config = default.get_config()
  config.dataset = "tfds"
  config.tfds_name = "cifar10"
  config.train_split = "train"
  config.eval_split = "test"
  config.num_classes = 10
  config.image_mean = (125.31, 122.95, 113.87)  # train/preprocess.py: CIFAR10_MEAN
  config.image_std = (62.99, 62.09, 66.70)
  config.augment = "crop_flip"
  config.crop_padding = 4

  config.model = "resnet18"
  config.resnet_stem = "cifar"
  config.resnet_filters = 64
  config.sync_batchnorm = True

  config.num_epochs = 200.0
  config.optimizer = "sgd"
  config.learning_rate = 0.1
  config.momentum = 0.9
  config.weight_decay = 5e-4
  config.lr_schedule = "step"
  config.lr_decay_epochs = (80, 120)
  config.lr_decay_factor = 0.1

  config.controller = "simigrad"
  config.initial_batch_size = 128
  config.similarity_target = 0.1
  config.batch_size_lower_bound = 128
  config.batch_size_upper_bound = 16384
  config.lr_rule = "sqrt"
  config.max_micro_batch_size = 256
  config.eval_batch_size = 1000
  return config
