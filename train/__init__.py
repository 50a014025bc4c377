"""Training scripts for SimiGrad's experiments: ``python -m train --config train/configs/<name>.py``.

Laid out like the flax examples: ``configs/`` (one file per experiment, data
only), ``input_pipeline.py`` (data sources, host side, with
``image_data.py`` and ``text_data.py``), ``preprocess.py``
(augmentation and masking, in-graph), ``models.py``, ``optimizers.py``,
``train.py`` (the loop, on :class:`simigrad_jax.Trainer`), ``report.py``
(console output), ``run_settings.py`` (the options checked on resume) and
``__main__.py`` (flags). Importing this package does not
import JAX, so that the entry point can set up simulated CPU devices first.
"""
