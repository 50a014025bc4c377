"""In-graph: code that runs inside jit / pmap / shard_map: pure, traced, no host decisions.

Documented API:
  SimilarityState, HalfGrads: the state of ``simigrad_jax.transform`` (the
    optax transformation that replaces ``lax.pmean(grads)`` and measures the
    similarity of the two halves' gradients) and a step's own halves handed
    to it. StackedGrads: the update's argument that says its gradients are
    every device's, stacked along a leading dimension over a mesh axis.
    RecordedOutputs: the transforms' outputs of one trace of an optimizer's
    update, handed back to a second trace of it in the same program.
  value_and_half_grads: the gradients of a batch's even- and odd-numbered
    examples, one pass after the other (the local split).
  scale_by_lr_factor: the updates scaled by a learning-rate factor the host
    sets between steps (its state an LrFactorState).
  couple_to_batch_size: Adam's beta2 and weight decay that follow the batch
    size held in the optimizer state (its state a BatchCouplingState).
  Errors: AxisNameError (a transform not named for the axis the step is
    mapped over), HalvesContractError (an optimizer that does not pass
    ``half_grads`` on to the transform), LossContractError (a Trainer's loss
    function that returned something other than floating-point per-example
    losses and a model state), ChainOrderError (an optimizer chain without
    the transform first and ``scale_by_lr_factor`` last),
    HalfBatchArgumentError (arguments or settings ``value_and_half_grads``
    cannot split into halves), all ValueErrors.
  ``transform`` and ``device_halves_step`` (a plain ``jax.jit`` step whose
  halves are the even and odd devices of a mesh's data axis) are imported
  from the top level, ``simigrad_jax.transform``: here those names are
  their modules.

Modules: ``transform``, ``half_batch``, ``device_halves_step``,
``lr_scaling``, ``batch_coupling`` and ``train_step`` (the Trainer's steps);
the collectives they share are :mod:`simigrad_jax.reductions`.

Example:
  >>> import optax
  >>> import simigrad_jax
  >>> from simigrad_jax import ingraph
  >>> optimizer = optax.chain(simigrad_jax.transform("batch"), optax.sgd(0.1),
  ...                         ingraph.scale_by_lr_factor())
  >>> state = optimizer.init({"w": 0.0})
  >>> isinstance(state[0], ingraph.SimilarityState), isinstance(state[-1], ingraph.LrFactorState)
  (True, True)
"""

from simigrad_jax.ingraph.batch_coupling import BatchCouplingState
from simigrad_jax.ingraph.batch_coupling import couple_to_batch_size
from simigrad_jax.ingraph.half_batch import HalfBatchArgumentError
from simigrad_jax.ingraph.half_batch import value_and_half_grads
from simigrad_jax.ingraph.lr_scaling import ChainOrderError
from simigrad_jax.ingraph.lr_scaling import LrFactorState
from simigrad_jax.ingraph.lr_scaling import scale_by_lr_factor
from simigrad_jax.ingraph.train_step import LossContractError
from simigrad_jax.ingraph.transform import AxisNameError
from simigrad_jax.ingraph.transform import HalfGrads
from simigrad_jax.ingraph.transform import HalvesContractError
from simigrad_jax.ingraph.transform import RecordedOutputs
from simigrad_jax.ingraph.transform import SimilarityState
from simigrad_jax.ingraph.transform import StackedGrads

__all__ = [
  "AxisNameError",
  "BatchCouplingState",
  "ChainOrderError",
  "HalfBatchArgumentError",
  "HalfGrads",
  "HalvesContractError",
  "LossContractError",
  "LrFactorState",
  "RecordedOutputs",
  "SimilarityState",
  "StackedGrads",
  "couple_to_batch_size",
  "scale_by_lr_factor",
  "value_and_half_grads",
]
