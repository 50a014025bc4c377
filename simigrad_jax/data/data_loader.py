"""Host: load a step's examples and lay them out on the devices, ahead of the step.

The examples of a step are the next ones of the epoch's permutation, whatever
the batch size (:class:`simigrad_jax.data.EpochSampler`); each process loads only
its own devices' rows. Rows are laid out per slot: a slot is a device, or
with the local split one of the two blocks of a device's rows
(:mod:`simigrad_jax.shapes.layout`). While the devices run a step, a data thread loads the
rows for the next one, as many as the largest plan the caller expects, and
places them on the devices for each of those plans (the Trainer expects the
sizes its controller says it may decide next:
:func:`simigrad_jax.controllers.interface.likely_batch_sizes`). If the step
runs one of them, it starts with no host work; if not, the loaded rows are
laid out for its plan at once. With several processes
every transfer to the devices stays in the main thread, in the same order on
every process (a transfer to a global sharding must not race the per-step
agreement's collectives), so only the loading runs ahead.

A source with a ``reader(sampler)`` method (:class:`simigrad_jax.GrainSource`)
serves a one-process run's rows by stream position through that reader, whose
worker processes decode ahead along the sampler's order; with several
processes each one reads only its rows, through ``get_batch``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from simigrad_jax.data.sampler import EpochSampler
from simigrad_jax.shapes import batch_plan

# This process's rows among a step's examples: their offsets in the step, and the rows by feature.
LoadedRows = tuple[np.ndarray, dict[str, np.ndarray]]

# The plans whose row weights stay on the devices (a few kilobytes each): a moving batch comes
# back to the sizes near it, and each step places the weights of two or three plans.
WEIGHTS_KEPT = 64


@dataclasses.dataclass
class StepBatch:
  """One optimizer step's inputs, already on the devices."""

  plan: batch_plan.BatchPlan
  micro_batches: list[tuple[Any, Any]]  # (batch, weights) per accumulation step (plan.shapes)
  counters: list[jax.Array]  # int32 [optimizer_step, micro_step] per accumulation step


@dataclasses.dataclass
class _Pending:
  """A load (and an expected placement) under way in the data thread."""

  start: int  # the first example (position in the run's example stream)
  count: int  # examples loaded from there
  step: int  # the optimizer step the placement is for
  future: concurrent.futures.Future  # -> (local examples and rows, {plan: StepBatch} placed)


class StepDataLoader:
  """Loads and places the examples of each optimizer step, one step ahead.

  Args:
    source: a random-access source (``get_batch(indices)``).
    sampler: the run's :class:`simigrad_jax.data.EpochSampler` (read, not advanced).
    sharded: the data sharding (leading axis over the devices).
    replicated: the replicated sharding (for the counters).
    local_slots: this process's slots (positions in the plans' device axis),
      in the order of its rows on the devices.
    num_slots: the slots of the mesh (the plans' ``num_devices``).
    place_ahead: also place the expected plans' rows in the data thread (one
      process only).

  Example::

    loader.submit(start=sampler.examples_seen, count=110, step=1, expected=[plan_110, plan_90])
    step_batch, seconds = loader.take(plan_110, sampler.examples_seen, step=1)  # placed already
  """

  def __init__(
    self,
    source: Any,
    sampler: EpochSampler,
    sharded: NamedSharding,
    replicated: NamedSharding,
    local_slots: np.ndarray,
    num_slots: int,
    place_ahead: bool,
  ):
    self.places_ahead = place_ahead
    self._source, self._sampler = source, sampler
    self._sharded, self._replicated = sharded, replicated
    self._local_slots = local_slots
    self._num_slots = num_slots
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="simigrad-data")
    self._pending: _Pending | None = None
    self._placed_counters: dict[tuple[int, int], jax.Array] = {}
    # A plan's row weights depend on the plan alone, and no step donates them: each plan's are
    # placed once and kept while it is among the last WEIGHTS_KEPT plans placed.
    self._weights = functools.lru_cache(maxsize=WEIGHTS_KEPT)(self._place_weights)
    # A one-process run reads along the stream (every row is this process's), decoded ahead.
    streams = hasattr(source, "reader") and len(local_slots) == num_slots
    self._reader = source.reader(sampler) if streams else None

  def submit(
    self,
    start: int,
    count: int,
    step: int,
    expected: Sequence[batch_plan.BatchPlan],
    then: Callable[[], None] | None = None,
  ) -> None:
    """Starts loading ``count`` examples from ``start`` and placing them for each plan of
    ``expected`` that they hold (the likeliest first), for step ``step`` (0-based).

    Args:
      start: the examples served before the step (the sampler's position).
      count: how many examples to load.
      step: the step the rows are for (their counters).
      expected: the plans the step is likely to run, the likeliest first.
      then: called in the data thread after the rows are placed (with
        :attr:`places_ahead` only), e.g. to place the step's scalars too.
    """
    count = max(count, 1)
    ahead = self.places_ahead
    plans = [p for p in expected if p.global_batch_size <= count] if ahead else []

    def load():
      loaded = self._local_rows(start, count)
      placed: dict[batch_plan.BatchPlan, StepBatch] = {}
      for plan in plans:  # the likeliest first
        if plan not in placed:
          placed[plan] = self.place(plan, loaded, step)
      return loaded, placed

    self._pending = _Pending(start, count, step, self._pool.submit(load))
    if then is not None and ahead:
      self._pool.submit(then)  # after the rows, in the same thread

  def take(self, plan: batch_plan.BatchPlan, start: int, step: int) -> tuple[StepBatch, float]:
    """The step's data on the devices, and the seconds the host spent waiting and placing."""
    began = time.perf_counter()
    pending, self._pending = self._pending, None
    if pending is not None and pending.start == start and pending.count >= plan.global_batch_size:
      loaded, placed_ahead = pending.future.result()
      placed = placed_ahead.get(plan) if pending.step == step else None
      # The plans not taken are freed in the data thread: freeing arrays on 8 devices takes
      # the main thread as long as the rest of its work between two steps.
      self._pool.submit(_release, pending)
      del placed_ahead, pending
      if placed is None:
        placed = self.place(plan, loaded, step)
    else:  # nothing loaded for this step (the first one, or after a resume)
      if pending is not None:
        pending.future.result()
      placed = self.place(plan, self._local_rows(start, plan.global_batch_size), step)
    return placed, time.perf_counter() - began

  def _local_rows(self, first_example: int, count: int) -> LoadedRows:
    """Loads this process's rows among the next ``count`` examples (runs in the data thread)."""
    examples = np.arange(count)
    mine = np.isin(examples % self._num_slots, self._local_slots)
    if self._reader is not None:  # by stream position: the reader knows the sampler's order
      return examples[mine], self._reader.read(first_example + examples[mine])
    indices = self._sampler.indices_at(first_example, count)
    return examples[mine], self._source.get_batch(indices[mine])

  def place(self, plan: batch_plan.BatchPlan, loaded: LoadedRows, step: int) -> StepBatch:
    """Arranges loaded rows into the plan's micro-batches on the devices."""
    local_examples, rows = loaded
    layout = plan.example_layout()[:, self._local_slots, :]  # (k, local slots, largest micro)
    where = np.searchsorted(local_examples, np.maximum(layout, 0))
    weights = self._weights(plan)
    micro_batches, counters = [], []
    for j, size in enumerate(plan.shapes):  # micro-step j: its first ``size`` rows per slot
      take = where[j, :, :size].reshape(-1)
      real = layout[j, :, :size].reshape(-1) >= 0
      local = {name: _gather_rows(array, take, real) for name, array in rows.items()}
      micro_batches.append((self._to_devices(local, size), weights[j]))
      counters.append(self._counters(step, j))
    return StepBatch(plan, micro_batches, counters)

  def _place_weights(self, plan: batch_plan.BatchPlan) -> list[jax.Array]:
    """The plan's row weights on the devices, one array a micro-step (1 a real row, 0 padding)."""
    weights = plan.example_weights()[:, self._local_slots, :]
    return [
      self._to_devices(w[:, :size].reshape(-1), size)
      for w, size in zip(weights, plan.shapes, strict=True)
    ]

  def _counters(self, step: int, micro_step: int) -> jax.Array:
    """``[step, micro_step]`` on the devices, placed once for every plan of the step."""
    key = (step, micro_step)
    placed = self._placed_counters.get(key)
    if placed is None:
      if self._placed_counters and next(iter(self._placed_counters))[0] != step:
        self._placed_counters = {}  # a new step: the last one's are not needed again
      placed = jax.device_put(np.array(key, np.int32), self._replicated)
      self._placed_counters[key] = placed
    return placed

  def _to_devices(self, local_tree: Any, micro: int) -> Any:
    rows = self._num_slots * micro
    return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(self._sharded, x, (rows,) + x.shape[1:]),
      local_tree,
    )

  def close(self) -> None:
    """Waits for the load under way, and stops the source's reader (its worker processes)."""
    try:
      self._pool.shutdown(wait=True)
      self._weights.cache_clear()  # frees the kept weights
    finally:
      if self._reader is not None:
        self._reader.close()


def _release(unused: object) -> None:
  """Drops the last reference to ``unused`` (called in the data thread, so it is freed there)."""
  del unused


def _gather_rows(array: np.ndarray, take: np.ndarray, real: np.ndarray) -> np.ndarray:
  """``array[take]`` where ``real``, zero rows elsewhere (padding).

  One gather of every row (a padding row reads some loaded row), then the
  padding zeroed: a masked assignment into zeros took twice as long.
  """
  if not len(array):  # this process loaded no rows: all padding
    return np.zeros((len(take),) + array.shape[1:], array.dtype)
  out = np.take(array, take, axis=0, mode="clip")
  out[~real] = 0
  return out


def local_device_positions(devices: list[jax.Device]) -> np.ndarray:
  """Positions in the mesh of this process's devices (they must be contiguous)."""
  positions = np.array([i for i, d in enumerate(devices) if d.process_index == jax.process_index()])
  if positions.size == 0:
    raise ValueError("none of the training devices belongs to this process")
  if np.any(np.diff(positions) != 1):
    raise ValueError(
      f"this process's devices sit at mesh positions {positions.tolist()}; "
      "they must be contiguous (order the devices by process)"
    )
  return positions
