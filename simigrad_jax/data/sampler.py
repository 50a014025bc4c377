"""Host: the order of training examples when the batch size changes every step.

Plain Python and NumPy; nothing here is traced.

SimiGrad changes the global batch size at every optimizer step, so "step t
starts at example t * B" no longer holds. Following Levanter, the data position
is derived from the number of examples served so far, never from a step count:
the stream of example indices is fixed by ``(seed, num_examples)`` alone, epoch
after epoch, and a batch of size ``B`` is simply the next ``B`` entries of that
stream. Hence

* whatever the sequence of batch sizes, every epoch serves each example exactly
  once (a batch that crosses an epoch boundary takes the rest of one epoch's
  order and the start of the next one's);
* the position is the single integer ``examples_seen``; saving it is enough to
  resume exactly (:meth:`EpochSampler.state_dict`), with no iterator state.

The price of a fixed stream: a batch that crosses an epoch boundary holds the
last ``t`` examples of epoch ``e`` and the first ``h`` of epoch ``e + 1``, and
an example can be in both parts (about ``t * h / num_examples`` of them; at
most ``B**2 / (4 * num_examples)`` on average for a batch of ``B``). It then
appears twice in that one step, once for each epoch. Avoiding this would make
the order of an epoch depend on where the previous one was cut, i.e. on the
history of batch sizes, which the position could no longer be derived from.

Indices are *global* example indices in ``[0, num_examples)``. Splitting a
batch over devices and hosts (and padding it) happens elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from simigrad_jax import validation

__all__ = ["EpochSampler", "STATE_VERSION"]

STATE_VERSION = 1
_CACHED_EPOCHS = 2  # a batch touches at most two consecutive epochs


class EpochSampler:
  """Serves batches of any size from a seeded, per-epoch shuffled order.

  The order of epoch ``e`` is ``np.random.default_rng([seed, e]).permutation
  (num_examples)`` (the identity with ``shuffle=False``); the epochs' orders are
  concatenated into one endless stream and each batch is the next
  ``batch_size`` entries of it. The position is a pure function of the number
  of examples served, so resuming needs only :attr:`examples_seen`. Each epoch
  serves every example exactly once; only a batch that crosses an epoch
  boundary can hold an example twice (once from each epoch; see the module
  docstring).

  Args:
    num_examples: size of the data set, an int ``>= 1``.
    seed: an int ``>= 0``; with the epoch number it seeds each epoch's order.
    shuffle: if False, every epoch visits the examples in order ``0, 1, ...``.

  Example:
    >>> sampler = EpochSampler(5, seed=0, shuffle=False)
    >>> sampler.take(3).tolist(), sampler.take(4).tolist()
    ([0, 1, 2], [3, 4, 0, 1])
    >>> sampler.examples_seen, sampler.epoch, sampler.offset
    (7, 1, 2)

  Note:
    The orders come from NumPy's ``Generator.permutation``; NumPy does not
    promise that its random streams never change between versions, so resume
    a run with the NumPy version that started it to get the same order.
  """

  def __init__(self, num_examples: int, seed: int, *, shuffle: bool = True):
    self._num_examples = validation.check_int("num_examples", num_examples, 1)
    self._seed = validation.check_int("seed", seed, 0)
    self._shuffle = validation.check_bool("shuffle", shuffle)
    self._examples_seen = 0
    self._cache: dict[int, np.ndarray] = {}

  def __repr__(self) -> str:
    return (
      f"EpochSampler(num_examples={self._num_examples}, seed={self._seed}, "
      f"shuffle={self._shuffle}, examples_seen={self._examples_seen})"
    )

  # ---------------------------------------------------------------- read-only

  @property
  def num_examples(self) -> int:
    """The size of the data set."""
    return self._num_examples

  @property
  def seed(self) -> int:
    """The seed the epochs' orders are drawn from."""
    return self._seed

  @property
  def shuffle(self) -> bool:
    """Whether epochs are shuffled (False: the identity order)."""
    return self._shuffle

  @property
  def examples_seen(self) -> int:
    """Total examples served by :meth:`take` so far (or restored)."""
    return self._examples_seen

  @property
  def epoch(self) -> int:
    """The epoch the next example comes from: ``examples_seen // num_examples``."""
    return self._examples_seen // self._num_examples

  @property
  def offset(self) -> int:
    """Position within the current epoch: ``examples_seen % num_examples``."""
    return self._examples_seen % self._num_examples

  # ------------------------------------------------------------------- orders

  def permutation(self, epoch: int) -> np.ndarray:
    """Returns the order in which epoch ``epoch`` visits the examples.

    Args:
      epoch: an int ``>= 0``.

    Returns:
      A read-only int64 array holding each of ``0 .. num_examples - 1`` once;
      ``np.random.default_rng([seed, epoch]).permutation(num_examples)``, or
      ``arange(num_examples)`` with ``shuffle=False``.

    Example:
      >>> EpochSampler(4, seed=0, shuffle=False).permutation(3).tolist()
      [0, 1, 2, 3]
    """
    epoch = validation.check_int("epoch", epoch, 0)
    order = self._cache.get(epoch)
    if order is None:
      if self._shuffle:
        rng = np.random.default_rng([self._seed, epoch])
        order = rng.permutation(self._num_examples).astype(np.int64, copy=False)
      else:
        order = np.arange(self._num_examples, dtype=np.int64)
      order.flags.writeable = False
      if len(self._cache) >= _CACHED_EPOCHS:
        self._cache.pop(min(self._cache))
      self._cache[epoch] = order
    return order

  def indices_at(self, examples_seen: int, batch_size: int) -> np.ndarray:
    """Returns the batch that starts after ``examples_seen`` examples.

    Pure: depends only on the arguments and the sampler's settings, not on its
    position.

    Args:
      examples_seen: examples served before this batch, an int ``>= 0``.
      batch_size: an int in ``[1, num_examples]``; a larger batch would hold
        some example twice.

    Returns:
      A new int64 array of ``batch_size`` distinct global example indices.

    Example:
      >>> EpochSampler(5, seed=0, shuffle=False).indices_at(8, 4).tolist()
      [3, 4, 0, 1]
    """
    seen = validation.check_int("examples_seen", examples_seen, 0)
    size = self._check_batch_size(batch_size)
    epoch, offset = divmod(seen, self._num_examples)
    end = offset + size
    head = self.permutation(epoch)[offset:end]
    if end <= self._num_examples:
      return head.copy()
    tail = self.permutation(epoch + 1)[: end - self._num_examples]
    return np.concatenate([head, tail])

  def peek(self, batch_size: int) -> np.ndarray:
    """Returns the next ``batch_size`` example indices without advancing.

    Args:
      batch_size: an int in ``[1, num_examples]``.

    Returns:
      The int64 indices :meth:`take` would return.
    """
    return self.indices_at(self._examples_seen, batch_size)

  def take(self, batch_size: int) -> np.ndarray:
    """Returns the next ``batch_size`` example indices and advances past them.

    Args:
      batch_size: an int in ``[1, num_examples]``.

    Returns:
      ``batch_size`` distinct int64 global example indices.

    Example:
      >>> sampler = EpochSampler(1000, seed=42)
      >>> batch = sampler.take(128)
      >>> batch.shape, sampler.examples_seen
      ((128,), 128)
    """
    indices = self.indices_at(self._examples_seen, batch_size)
    self._examples_seen += len(indices)
    return indices

  # -------------------------------------------------------------- checkpoints

  def state_dict(self) -> dict[str, Any]:
    """Returns the sampler's state as plain JSON data.

    Loading it into a sampler with the same ``num_examples``, ``seed`` and
    ``shuffle`` continues with exactly the indices this one would serve next.
    """
    return {
      "version": STATE_VERSION,
      "num_examples": self._num_examples,
      "seed": self._seed,
      "shuffle": self._shuffle,
      "examples_seen": self._examples_seen,
    }

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restores a position saved by :meth:`state_dict` (e.g. after ``json.loads``).

    Nothing changes if the state is refused.

    Args:
      state: the dict :meth:`state_dict` returned.

    Raises:
      ValueError: for an unknown version, settings (``num_examples``, ``seed``,
        ``shuffle``) that differ from this sampler's (the message names them),
        or a missing or negative ``examples_seen``.
    """
    if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
      got = state.get("version") if isinstance(state, Mapping) else state
      raise ValueError(f"sampler state version must be {STATE_VERSION}, got {got!r}")
    ours = {"num_examples": self._num_examples, "seed": self._seed, "shuffle": self._shuffle}
    differing = [
      k
      for k in ours
      if state.get(k, "<missing>") != ours[k]
      or validation.is_bool(state.get(k)) != validation.is_bool(ours[k])
    ]
    if differing:
      details = ", ".join(
        f"{k} (saved {state.get(k, '<missing>')!r}, here {ours[k]!r})" for k in differing
      )
      raise ValueError(f"sampler state differs from this sampler in: {details}")
    if "examples_seen" not in state:
      raise ValueError("sampler state has no examples_seen")
    self._examples_seen = validation.check_int("examples_seen", state["examples_seen"], 0)

  # ---------------------------------------------------------------- internals

  def _check_batch_size(self, batch_size: Any) -> int:
    n = self._num_examples
    size = validation.check_int("batch_size", batch_size, 1)  # its own message: no batch at all
    if size > n:
      raise ValueError(
        f"batch_size must be an int in [1, num_examples={n}], got "
        f"{batch_size!r}: a batch larger than the data set would repeat "
        "examples within one step"
      )
    return size
