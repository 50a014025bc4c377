"""Every option of ``python -m train``, with its default; each experiment's config starts from these.

Override any of them on the command line, e.g. ``--config.similarity_target=0.1
--config.num_epochs=2 --config.batch_size_upper_bound=4096``. An unknown name
or a value of the wrong type is refused by ml_collections before anything
runs; bad values are refused with a message naming the option.
"""

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
  """The default config (an MLP on scikit-learn's digits, 8 simulated CPU devices)."""
  config = ml_collections.ConfigDict()

  # ---------------------------------------------------------------- run
  config.seed = 0  # data order, initialisation, augmentation and masking keys.
  config.num_epochs = 8.0  # may be fractional.
  config.num_steps = config_dict.placeholder(int)  # stop earlier, after this optimizer step.
  # Devices: "default" or "auto" = the default backend's devices: every accelerator, however
  # many, or the CPU's simulated devices when there is none; "cpu" = the CPU's.
  config.platform = "default"
  config.num_cpu_devices = 8  # simulated CPU devices, set before JAX starts (python -m train).
  # The two halves the similarity compares (half A: each step's even-numbered examples, B: the
  # odd ones): "device" = the even devices against the odd ones (the reference's split; an even
  # number of devices); "local" = two blocks of rows on every device, one gradient pass each
  # (any number of devices); "auto" = "device" on an even number of devices, else "local".
  config.halves = "auto"
  # Measure the similarity on every k-th step only, plain steps (one gradient pass) between; the
  # controller decides on the measuring steps and holds its batch size between them.
  config.measure_every = 1
  # With the local split, how each device takes its two halves' gradients: "sequential" (one
  # pass of each half's rows after the other), "stacked" (one pass of both halves) or "signed"
  # (one pass of the whole rows, two cotangents); the same numbers to float rounding.
  config.halves_passes = "sequential"
  # A mesh "DATAxMODEL" (e.g. "4x2": the batch sharded over 4 data positions, parameters over
  # 2 model shards; the product is the device count); "" = data-parallel on every device.
  config.mesh_shape = ""
  # Which parameters shard over the mesh's "model" axis (train/mesh.py): "" none; "megatron"
  # (2-D kernels alternately column- and row-parallel); or rules "REGEX=SPEC;..." on the
  # parameter's path, e.g. "Dense_0/kernel=None,model;Dense_1/kernel=model,None".
  config.param_sharding = ""

  # ---------------------------------------------------------------- data
  # "digits" | "mnist" | "tfds" | "tfds_resized" | "text" | "tfds_text" | "chars"
  # (train/input_pipeline.py, train/text_data.py).
  config.dataset = "digits"
  config.data_seed = 0  # the digits' fixed train/test split.
  config.tfds_name = ""  # e.g. "cifar10", "imagenet2012", "lm1b".
  config.train_split = "train"
  config.eval_split = "test"
  config.data_dir = config_dict.placeholder(str)  # TFDS data_dir (None: TFDS's default).
  config.download = False  # let TFDS download and prepare missing data.
  config.num_classes = 10
  config.image_mean = ()  # per-channel mean on the 0-255 scale; () = divide by 255.
  config.image_std = ()
  config.host_image_size = 256  # "tfds_resized": the square the host decodes and crops to.
  # TFDS image sets: grain worker processes that decode the training examples ahead (one
  # process only; None: the available cores minus one; 0: in the training process).
  config.num_workers = config_dict.placeholder(int)
  config.decode_threads = 16  # TFDS image sets: threads that decode evaluation batches.
  config.on_bad_record = "raise"  # a record that cannot be decoded: "raise" | "skip" (and log).
  # Local files (MNIST, tinyshakespeare); a relative path starts at the repository root.
  config.local_data_dir = "../shared/data"
  config.mnist_source = "auto"  # "auto" (local files when present, else TFDS) | "local" | "tfds".
  config.text_files = ""  # comma-separated paths or globs; "" = tinyshakespeare or pydoc_data.
  # "chars": tinyshakespeare from "local" (local_data_dir) | "tfds" (tiny_shakespeare) | "auto".
  config.text_source = "auto"
  config.eval_fraction = 0.05  # "text", "chars": the held-out tail of the text.
  config.text_feature = "text"  # "tfds_text": the feature holding the text.
  config.records_per_example = 1  # "tfds_text": records packed into one example.
  config.eval_examples = config_dict.placeholder(int)  # evaluate on the first N only.
  config.eval_batch_size = 512

  # ---------------------------------------------------------------- augmentation (in-graph)
  config.augment = "none"  # "none" | "crop_flip" (CIFAR) | "inception" (ImageNet).
  config.crop_padding = 4  # "crop_flip": zero padding before the random crop.
  config.image_size = 224  # "inception": the crop's side (eval: the central crop).

  # ---------------------------------------------------------------- model
  # "mlp" | "cnn" | "resnet18" | "resnet34" | "resnet50" | "resnet101" | "bert" | "causal_lm".
  config.model = "mlp"
  # Compute dtype of ResNets and BERT ("bfloat16" on GPUs); parameters stay float32.
  config.dtype = "float32"
  config.mlp_hidden = (128,)
  config.cnn_features = (32, 64)
  config.cnn_dense = 128
  config.resnet_filters = 64
  config.resnet_stage_sizes = ()  # blocks per stage; () = the named ResNet's, e.g. (2, 2, 2, 2).
  config.resnet_stem = "imagenet"  # "imagenet" (7x7/2 + max pool) | "cifar" (3x3/1).
  config.sync_batchnorm = True  # BatchNorm statistics over all devices; False: per device.
  config.bn_momentum = 0.9  # running average: new = momentum * old + (1 - momentum) * batch.
  config.label_smoothing = 0.0
  config.seq_length = 128  # BERT: tokens (bytes) per example; causal_lm: tokens predicted.
  # The transformers' sizes: BERT's, and the causal LM's (one decoder layer each).
  config.bert_hidden = 768
  config.bert_layers = 12
  config.bert_heads = 12
  config.bert_mlp = 3072
  config.dropout = 0.0
  config.mask_rate = 0.15  # BERT: share of tokens to predict.

  # ---------------------------------------------------------------- optimizer
  config.optimizer = "sgd"  # "sgd" | "adamw" | "lamb".
  config.learning_rate = 0.05  # at the initial batch size; scaled by the lr rule.
  config.momentum = 0.9
  config.nesterov = False
  config.weight_decay = 0.0
  config.b1 = 0.9  # adamw, lamb.
  config.b2 = 0.999
  config.eps = 1e-6
  config.grad_clip_norm = 0.0  # 0: no clipping.
  # adamw, lamb: "beta2", "weight_decay" or "beta2,weight_decay" follow the batch size
  # (simigrad_jax.couple_to_batch_size: b2^(B/B_0); weight_decay * (B/B_0) / lr rule); "" off.
  config.adam_coupling = ""
  config.lr_schedule = "constant"  # "constant" | "step" | "cosine", a function of epochs.
  config.lr_decay_epochs = ()  # "step": epochs at which the lr is multiplied by lr_decay_factor.
  config.lr_decay_factor = 0.1
  config.warmup_epochs = 0.0  # linear warm-up, in epochs (fractional).
  # simigrad_jax.transform's collectives: "hierarchical" (the library's default, the bytes of
  # one all-reduce) | "scatter" (1.5x) | "stacked" (2x).
  config.reduction = "hierarchical"

  # ---------------------------------------------------------------- batch-size controller
  config.controller = "simigrad"  # "simigrad" | "fixed" (the baseline) | any registered name.
  config.initial_batch_size = 32  # B_0, the global batch the learning rate is set for.
  config.similarity_target = 0.1  # cosine similarity to hold, in [-1, 1].
  config.batch_size_lower_bound = config_dict.placeholder(int)  # None: the number of devices.
  config.batch_size_upper_bound = config_dict.placeholder(int)  # None: the data set's size.
  config.enable_adjust = True  # "simigrad": False keeps the batch fixed (similarity still logged).
  config.smooth_factor = config_dict.placeholder(float)  # exponential smoothing of B, in [0, 1).
  config.dead_band = 0.0  # no change while |similarity - target| <= dead_band.
  # The model rule's moving-average decay, in [0, 1) (docs/design.md: "the model rule"); None: the reference.
  config.similarity_ema_decay = config_dict.placeholder(float)
  config.controller_warmup_steps = 0  # no change for the first steps.
  config.batch_sizes_to_profile = ()  # visit these sizes first, e.g. "(64, 128, 256)".
  config.profile_steps_per_size = 1
  config.verbose = False  # log every decision (logger "simigrad_jax").
  # Each decision takes effect a step later (OneStepLateController): each step's size is known
  # while the step before it runs, so its rows are placed once (docs/controllers.md).
  config.one_step_late = False
  # More keyword arguments for the controller, as a JSON object, e.g. for "gns":
  # --config.controller_options='{"multiple": 0.5}' (not those the options above set).
  config.controller_options = ""
  config.lr_rule = "sqrt"  # lr factor sqrt(B / B_0) | "linear" B / B_0 | "none".
  config.lr_adjust_factor = config_dict.placeholder(float)  # factor r -> (r - 1) * f + 1.

  # ---------------------------------------------------------------- engine
  config.max_micro_batch_size = 64  # rows per device per micro-step (accumulate beyond).
  config.min_micro_batch_size = config_dict.placeholder(int)  # smallest compiled shape.
  config.mode = "recompile"  # "recompile" (power-of-two shapes) | "pad" (one shape).
  # Run a step whose shape is still compiling on a compiled one (one process only).
  config.compile_fallback = True
  # The grid's shapes per factor of two, the micro-steps that may hold a step's rest, the
  # schedule's steps per compile and the compiles of a program at once (None: the library's
  # defaults; docs/compiling.md).
  config.shapes_per_octave = config_dict.placeholder(int)
  config.shapes_per_step = 3  # steps of up to 3 shapes: few programs on a coarse grid
  config.steps_per_compile = 64.0  # steps of milliseconds: a compile takes seconds
  # Round each decided batch size to whole rows per device, in the direction of the change.
  config.whole_rows = False
  config.compile_threads = config_dict.placeholder(int)
  config.checkpoint_every_steps = config_dict.placeholder(int)  # None: at epoch ends only.
  # Also save 15 minutes after the last checkpoint: the most work a SIGKILL can cost (None: off).
  config.checkpoint_every_seconds = config_dict.placeholder(float)
  config.checkpoint_every_seconds = 900.0
  config.max_checkpoints = 3
  # Resume from a checkpoint made with other settings (optimizer, model definition, data,
  # controller, ...; train/run_settings.py) instead of refusing it; the change is logged and
  # recorded in the checkpoints. A changed device count is always allowed.
  config.allow_changed_settings = False
  # JAX's persistent compilation cache: a second run (in any workdir) or a resume loads its
  # executables from here instead of compiling them. False leaves JAX's own cache settings as
  # they are. None: the one every run shares ($SIMIGRAD_JAX_CACHE_DIR, else
  # $XDG_CACHE_HOME/simigrad_jax/compilation_cache, capped at 2 GiB); "": none.
  config.compilation_cache = True
  config.compilation_cache_dir = config_dict.placeholder(str)
  # Use a workdir (and compilation cache) that other users can change: one that is not this
  # user's, or that a group or others can write to. Only for a shared file system whose users
  # you trust: they could change the checkpoints or, through the cache, run code in this run.
  config.allow_shared_workdir = False
  # Several hosts: seconds a process waits for the others before it names a lost one.
  config.agreement_timeout_seconds = 300.0
  config.tensorboard = True
  config.progress = True
  config.plot = True  # draw <workdir>/metrics.png at the end.
  return config
