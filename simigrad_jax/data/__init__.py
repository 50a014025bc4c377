"""Host: data sources, the epoch sampler and readers that decode examples ahead.

Documented API:
  Sources, each ``len(source)``, ``source.element_spec`` and
  ``source.get_batch(indices)``: ArraySource (NumPy arrays in memory),
  TfdsSource (a TFDS data set, random access) and GrainSource (grain-style
  data, decoded ahead in worker processes); the three are on the top level
  too (a source of your own checks its indices with
  ``sources.check_indices``). open_tfds opens a TFDS split for random access;
  default_num_workers is GrainSource's default count of worker processes.
  EpochSampler: the order of the examples, a pure function of the examples
    served so far, whatever the batch sizes.
  deal_to_devices: a global batch ordered so that the even and odd devices of
    a mesh's data axis hold its even- and odd-numbered examples (for
    ``simigrad_jax.device_halves_step``).
  BadRecordError: a record could not be read or decoded, or does not match
    the element spec.

Modules: ``sources``, ``grain_source``, ``sampler``, ``device_order``,
``data_loader`` (a step's examples loaded and placed on the devices ahead),
``record_reader`` and ``stream_reader`` (what GrainSource's workers run).

Example:
  >>> import numpy as np
  >>> from simigrad_jax import data
  >>> source = data.ArraySource({"x": np.arange(6.0)})
  >>> source.get_batch(np.array([4, -1]))["x"].tolist()  # -1: a padding row
  [4.0, 0.0]
"""

from simigrad_jax.data.device_order import deal_to_devices
from simigrad_jax.data.grain_source import GrainSource
from simigrad_jax.data.grain_source import default_num_workers
from simigrad_jax.data.record_reader import BadRecordError
from simigrad_jax.data.sampler import EpochSampler
from simigrad_jax.data.sources import ArraySource
from simigrad_jax.data.sources import TfdsSource
from simigrad_jax.data.sources import open_tfds

__all__ = [
  "ArraySource",
  "BadRecordError",
  "EpochSampler",
  "GrainSource",
  "TfdsSource",
  "deal_to_devices",
  "default_num_workers",
  "open_tfds",
]
