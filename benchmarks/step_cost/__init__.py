"""What does a SimiGrad step cost against the plain step it replaces?

Time, temporary memory and the bytes its collectives send, for every way a
user can write the step and for the Trainer's, on one device and on a mesh.

Scripts (``python benchmarks/step_cost/NAME.py``):

* ``halves.py``: a ResNet-18 step with the two half-batch gradients against
  the plain step, on one device.
* ``halves_steps.py``: every SimiGrad step a user can write (two passes,
  device halves, Flax NNX, ``pmap``) against its plain step, on 1 and 8
  devices.
* ``one_device_steps.py``: on one device, the plain step against
  ``value_and_half_grads`` and the Trainer's step with each way of taking
  the halves' gradients (``passes``), for an LM, CNNs, a ResNet-18 and an
  MLP; ``run_gpu.sh`` runs it and ``halves_steps.py`` on one GPU within 8
  minutes.
* ``reduction.py``: the transform's reduction against ``lax.pmean``: time,
  bytes on the wire and memory traffic.
* ``sharded.py``: the SimiGrad steps against the plain step on a mesh whose
  parameters are sharded (FSDP, tensor parallelism), and the similarity's
  error.
* ``sharded_memory.py``: the sharded steps' temporary memory over batch sizes.
* ``trainer_mesh.py``: the Trainer's memory per device by parameter layout.

Their helpers: ``hlo_collectives.py`` (the collectives and their bytes, read
from compiled HLO text), ``sharded_models.py`` (the models, layouts and
steps of ``sharded.py`` and ``sharded_memory.py``) and ``timing.py`` (a
compiled step's time and temporary memory, against a plain step in paired
rounds).
"""
