"""Host: how a global batch lies on the devices: its plan (devices x micro-batch x accumulation
steps) on a grid of compiled shapes, the two halves, and a mesh's shardings.

Documented API:
  plan_batch: a global batch size realised as devices x micro-batch x
    accumulation steps (a BatchPlan), on the grid of micro-batch shapes a
    BucketPolicy fixes; bucket_shapes lists the shapes a range of batch sizes
    needs, representable_batch_sizes the sizes a grid can realise exactly.

Modules: ``batch_plan`` (the plans and the grid), ``layout`` (the split of
the halves and the Trainer's grid of shapes) and ``mesh_sharding`` (the
Trainer on a mesh).

Example:
  >>> from simigrad_jax import shapes
  >>> plan = shapes.plan_batch(100, 4, shapes.BucketPolicy(max_micro_batch_size=16))
  >>> plan.global_batch_size, plan.micro_batch_size, plan.accumulation_steps
  (100, 16, 2)
"""

from simigrad_jax.shapes.batch_plan import BatchPlan
from simigrad_jax.shapes.batch_plan import BucketPolicy
from simigrad_jax.shapes.batch_plan import bucket_shapes
from simigrad_jax.shapes.batch_plan import plan_batch
from simigrad_jax.shapes.batch_plan import representable_batch_sizes

__all__ = [
  "BatchPlan",
  "BucketPolicy",
  "bucket_shapes",
  "plan_batch",
  "representable_batch_sizes",
]
