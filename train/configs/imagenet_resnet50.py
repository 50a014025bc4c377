"""ImageNet (ILSVRC 2012), ResNet-50: the reference's ImageNet experiment.

Standard recipe (Goyal et al. 2017, "Accurate, Large Minibatch SGD"):
initial global batch 256 at learning rate 0.1, SGD with Nesterov momentum
0.9, weight decay 1e-4, a linear warm-up over the first 5 epochs, step decay
x0.1 at epochs 30, 60 and 80, 90 epochs; the last BatchNorm of each residual
branch starts at zero. Augmentation: Inception-style random-resized crop to
224 (8-100% of the area, aspect 3/4-4/3) and horizontal flip, drawn in-graph
from a 256x256 center square the host decodes (so resumes are exact; the
crop cannot reach the corners of the long side beyond that square);
evaluation: shorter side 256, central 224x224 crop. SimiGrad: target 0.1
within [256, 32768], learning rate x sqrt(B / 256). Compute in bfloat16,
parameters in float32.

Data: TFDS ``imagenet2012`` (manual download of the ILSVRC 2012 archives into
``<data_dir>/downloads/manual``, then ``tfds build imagenet2012
--file_format=array_record``; train 1,281,167, validation 50,000 images),
read through ``tfds.data_source`` and decoded with Pillow in ``num_workers``
grain worker processes (default: the cores minus one).

Hardware: 8 GPUs with >= 40 GB each per host, or several hosts with
``--distributed`` (the workdir on a shared file system). Runtime: expected
about 1-2 days for 90 epochs on one 8-GPU host; one core decodes about 600
images/s (``benchmarks/trainer_overhead/input.py``), so a host needs about 35-45 cores to feed
the 8 GPUs' estimated 20,000 images/s. Not measured here.
"""

from train.configs import default


def get_config():
  """The ImageNet ResNet-50 run."""
  config = default.get_config()
  config.dataset = "tfds_resized"
  config.tfds_name = "imagenet2012"
  config.train_split = "train"
  config.eval_split = "validation"
  config.num_classes = 1000
  config.host_image_size = 256
  config.image_size = 224
  config.image_mean = (123.675, 116.28, 103.53)  # train/preprocess.py: IMAGENET_MEAN
  config.image_std = (58.395, 57.12, 57.375)
  config.augment = "inception"

  config.model = "resnet50"
  config.resnet_stem = "imagenet"
  config.resnet_filters = 64
  config.sync_batchnorm = True
  config.dtype = "bfloat16"

  config.num_epochs = 90.0
  config.optimizer = "sgd"
  config.learning_rate = 0.1
  config.momentum = 0.9
  config.nesterov = True
  config.weight_decay = 1e-4
  config.lr_schedule = "step"
  config.lr_decay_epochs = (30, 60, 80)
  config.lr_decay_factor = 0.1
  config.warmup_epochs = 5.0

  config.controller = "simigrad"
  config.initial_batch_size = 256
  config.similarity_target = 0.1
  config.batch_size_lower_bound = 256
  config.batch_size_upper_bound = 32768
  config.lr_rule = "sqrt"
  config.max_micro_batch_size = 128
  config.eval_batch_size = 250
  config.checkpoint_every_steps = 1000
  return config
