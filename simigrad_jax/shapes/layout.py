"""Host: how a step's batch is laid out: the two halves the similarity compares, and its shapes.

Under both splits, half A holds the step's even-numbered examples (0, 2, 4,
... in the order the sampler serves them, a random order) and half B the
odd-numbered ones, so half A has ``ceil(B / 2)`` real examples and half B
``floor(B / 2)``. What differs is where the rows sit and how the halves'
gradients are formed:

* ``"device"`` (the reference implementation's split; needs an even number of
  devices): example ``e`` of a step goes to device ``e % n``, so the even
  devices hold half A and the odd devices half B. Each device takes one
  gradient, and :func:`simigrad_jax.transform` compares the even devices'
  mean with the odd devices'.
* ``"local"`` (any number of devices, 1 included): every device holds rows of
  both halves. The step is planned over ``2 n`` slots, two per device: slot
  ``2 d`` is the first block of device ``d``'s rows in a micro-step, slot
  ``2 d + 1`` the second block, both of the same size, so a device's rows
  are even in number (a zero-weight row pads an odd count). Example ``e`` goes
  to slot ``e % 2n``: device ``(e % 2n) // 2``, block ``e % 2``. The device
  takes one gradient per block, and the transform compares the first blocks'
  mean with the second blocks'. Slot counts differ by at most one, so each
  device holds as many real rows of one half as of the other, give or take
  one, in every micro-step.

With an even number of devices the two splits put the same examples in each
half; only the devices that hold them differ.

:class:`StepLayout` holds the split and the grid of compiled shapes, and plans
each batch size onto the slots (:func:`simigrad_jax.shapes.plan_batch`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from simigrad_jax.shapes import batch_plan
from simigrad_jax.shapes import grid_costs

HALVES: tuple[str, ...] = ("auto", "device", "local")
# With the compile fallback, the shapes within this many octaves of the current batch's compile
# ahead (the rest as the batch comes near them): SimiGrad moves the batch by about one shape of
# the default grid per step, so a run compiles the shapes it visits, not the whole grid.
COMPILE_WINDOW_OCTAVES = 0.5


@dataclasses.dataclass(frozen=True)
class StepLayout:
  """The split of a run's batches into two halves, the shape grid, and the plan of a batch.

  Attributes:
    halves: ``"device"`` or ``"local"`` (see the module docstring).
    num_devices: the data-parallel devices.
    policy: the grid of compiled shapes, in rows per slot.
  """

  halves: str
  num_devices: int
  policy: batch_plan.BucketPolicy

  @classmethod
  def create(
    cls,
    halves: str,
    num_devices: int,
    *,
    mode: str,
    max_micro: int,
    min_micro: int | None,
    lower: int,
    upper: int,
    shapes_per_octave: int | None = 1,
    shapes_per_step: int = 1,
  ) -> StepLayout:
    """The layout of a run whose global batch sizes lie in ``[lower, upper]``.

    ``"pad"`` mode has one shape; ``"recompile"`` steps down from the largest
    (by factors of ``2^(1 / shapes_per_octave)``, rounded up to whole rows)
    to the smallest one that batch sizes in ``[lower, upper]`` need (smaller
    requests, such as a run's last step, pad up to it). ``max_micro`` and
    ``min_micro`` are rows per device: with the local split a device's rows
    per micro-step are twice a slot's, so an odd count is rounded up to even
    (each of the two passes over a device's rows holds half of them).

    Args:
      halves: ``"device"`` or ``"local"`` (from :func:`resolve_halves`).
      num_devices: the data-parallel devices.
      mode: ``"recompile"`` or ``"pad"``.
      max_micro: the most rows per device per micro-step.
      min_micro: the smallest shape, in rows per device (None: 1).
      lower: the smallest global batch size of the run.
      upper: the largest.
      shapes_per_octave: the grid's shapes per factor of two (``"recompile"``);
        None: the coarsest grid whose padding over ``[lower, upper]`` stays
        within 6% of the rows computed
        (:func:`~simigrad_jax.shapes.grid_costs.choose_shapes_per_octave`, for
        ``shapes_per_step``).
      shapes_per_step: the most micro-steps that hold a step's rows beyond its
        micro-steps of the largest shape (``"recompile"``;
        :class:`~simigrad_jax.shapes.BucketPolicy`): 1 plans a step on one shape.

    Returns:
      A :class:`StepLayout`.
    """
    per = blocks_per_device(halves)
    top = _ceil_div(max_micro, per)
    if mode == "pad":
      return cls(halves, num_devices, batch_plan.BucketPolicy(top, top, padding=True))
    low = _ceil_div(min_micro or 1, per)
    if shapes_per_octave is None:
      shapes_per_octave = grid_costs.choose_shapes_per_octave(
        num_devices * per, top, lower, upper, low, shapes_per_step=shapes_per_step
      )
    grid = batch_plan.BucketPolicy(
      top,
      low,
      padding=True,
      shapes_per_octave=shapes_per_octave,
      shapes_per_step=shapes_per_step,
    )
    needed = batch_plan.bucket_shapes(grid, num_devices * per, lower, upper)
    return cls(halves, num_devices, dataclasses.replace(grid, min_micro_batch_size=min(needed)))

  @property
  def slots_per_device(self) -> int:
    """Blocks of rows per device per micro-step: 1 (device split) or 2 (local split)."""
    return blocks_per_device(self.halves)

  @property
  def num_slots(self) -> int:
    """The slots a batch is planned over (:func:`simigrad_jax.shapes.plan_batch`'s ``num_devices``)."""
    return self.num_devices * self.slots_per_device

  def device_rows(self, slot_rows: int) -> int:
    """Rows per device per micro-step for ``slot_rows`` rows per slot."""
    return slot_rows * self.slots_per_device

  def slot_rows(self, device_rows: int) -> int:
    """Rows per slot that hold ``device_rows`` rows per device (an odd count rounded up)."""
    return _ceil_div(device_rows, self.slots_per_device)

  def slot_positions(self, device_positions: np.ndarray) -> np.ndarray:
    """The slots of the devices at ``device_positions`` on the mesh, in row order."""
    per = self.slots_per_device
    return (np.asarray(device_positions)[:, None] * per + np.arange(per)).reshape(-1)

  @staticmethod
  def first_half_weight(batch_size: int) -> int:
    """Real examples of half A (the even-numbered ones) in a step of ``batch_size``."""
    return (batch_size + 1) // 2

  @property
  def grid(self) -> tuple[int, ...]:
    """The compiled shapes, in rows per slot, ascending."""
    return self.policy.micro_batch_sizes()

  @property
  def device_grid(self) -> tuple[int, ...]:
    """The compiled shapes, in rows per device, ascending."""
    return tuple(self.device_rows(g) for g in self.grid)

  def plan(self, batch_size: int) -> batch_plan.BatchPlan:
    """``batch_size`` (exactly) on the slots: shape, micro-steps, padding."""
    return batch_plan.plan_batch(batch_size, self.num_slots, self.policy, lower=1, upper=None)

  def accumulation_shapes(self, upper: int) -> list[int]:
    """The shapes a step of several micro-batches can plan up to ``upper`` examples, largest first.

    Empty when ``upper`` fits one micro-batch of the largest shape.
    """
    one_micro_batch = self.num_slots * max(self.grid)
    if upper <= one_micro_batch:
      return []
    shapes = batch_plan.bucket_shapes(self.policy, self.num_slots, one_micro_batch + 1, upper)
    return sorted(shapes, reverse=True)

  def shapes_by_distance(self, batch_size: int, within_octaves: float | None = None) -> list[int]:
    """The grid, nearest (in log scale) to ``batch_size``'s shape first: the compile order.

    Args:
      batch_size: a global batch size.
      within_octaves: only the shapes at most this many factors of two from
        ``batch_size``'s shape (None: the whole grid).
    """
    return self.shapes_near(self.plan(batch_size).micro_batch_size, within_octaves)

  def shapes_near(self, shape: int, within_octaves: float | None = None) -> list[int]:
    """The grid, nearest (in log scale) to ``shape`` (rows per slot) first, optionally only
    those at most ``within_octaves`` factors of two from it."""
    distance = lambda m: abs(math.log2(m / shape))
    near = [m for m in self.grid if within_octaves is None or distance(m) <= within_octaves + 1e-9]
    return sorted(near, key=lambda m: (distance(m), m))


def resolve_halves(halves: str, num_devices: int) -> str:
  """The split ``halves`` names for ``num_devices`` devices: ``"device"`` or ``"local"``.

  Args:
    halves: ``"auto"`` (the device split on an even number of devices, else
      the local split), ``"device"`` or ``"local"``.
    num_devices: the data-parallel devices, at least 1.

  Raises:
    ValueError: for another name, or ``"device"`` on an odd number of devices.

  Example:
    >>> resolve_halves("auto", 3)
    'local'
  """
  if check_halves(halves) == "auto":
    halves = "device" if num_devices % 2 == 0 else "local"
  if halves == "device" and num_devices % 2:
    raise ValueError(
      f"halves='device' compares the even devices with the odd ones, which needs an even "
      f"number of devices, got {num_devices}; use halves='local' (each device's rows split "
      "in two) or 'auto', or an even number of devices"
    )
  return halves


def check_halves(halves: str) -> str:
  """Returns ``halves`` if it names a split (one of :data:`HALVES`), else raises ValueError."""
  if halves not in HALVES:
    raise ValueError(f"halves={halves!r} is not valid; choose one of {HALVES}")
  return halves


def blocks_per_device(halves: str) -> int:
  """Blocks of rows per device per micro-step under the split ``halves``: 2 if local, else 1."""
  return 2 if halves == "local" else 1


def _ceil_div(a: int, b: int) -> int:
  return -(-a // b)
