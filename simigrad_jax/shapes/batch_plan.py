"""Realising a global batch size as devices x micro-batch x accumulation steps.

Host side: plain Python and NumPy, pure functions, no JAX.

The controller asks for a global batch size ``B`` (any integer, changing about
10% per optimizer step). A data-parallel step over ``n`` devices runs
``k`` accumulation steps of ``micro`` rows per device, ``n * k * micro`` rows in
all. JAX compiles one step function per micro-batch shape, so the shapes come
from a small grid fixed up front by a :class:`BucketPolicy`: ``max``,
``ceil(max / 2)``, ``ceil(max / 4)``, ... down to ``min``, i.e. about
``log2(max / min) + 1`` shapes (at most ``log2(max / min) + 2``); or with
``shapes_per_octave=s``, ``ceil(max / 2^(i / s))`` for ``i = 0, 1, ...``, about
``s * log2(max / min) + 1`` shapes whose neighbours differ by a factor of
``2^(1/s)`` (or by one row). Every one of them can be compiled ahead of time
(:func:`bucket_shapes` lists those a range of batch sizes needs). ``k = ceil(B / (n * max))`` is always the fewest
accumulation steps that fit ``B``.

How the realised size relates to the requested one:

* ``padding=True`` (exact): the realised size *equals* the request. ``micro``
  is the smallest grid shape with ``n * k * micro >= B`` and the
  ``n * k * micro - B`` spare rows are padding with weight 0. With
  ``min == max`` this is the single-shape "pad" mode (one compiled shape, up
  to ``n * max - 1`` padded rows); with a grid, fewer than half the rows are
  padding whenever ``B >= n * min``, and with ``s`` shapes per octave fewer
  than ``1 - 2^(-1/s)`` of them (8.3% at ``s = 8``) plus the rounding to
  whole rows per device; about half that over a run whose size moves.
* ``padding=False`` (round): nothing is ever padded; the realised size is a
  *representable* size ``S = n * k * g`` (``g`` a grid shape,
  ``k = ceil(S / (n * max))``) next to the request, rounded in the direction of
  the change from the previous size as the reference does: a grow never ends
  below the previous size, a shrink never above it.

:func:`plan_batch` first clamps the request to optional bounds
``[lower, upper]``; with ``padding=False`` it then rounds only to sizes inside
them (and raises if there are none).

With ``shapes_per_step=p > 1`` (padding only) a step's micro-steps may be of
different shapes: ``k - 1`` micro-steps of ``max`` and the rest of the batch
(``R = ceil(B / n) - (k - 1) * max`` rows per device) on at most ``p``
micro-steps, the largest shapes that fit first and then the smallest that
holds what remains (or one shape, when that pads no more). A coarse grid then
pads little: a step pads less than the smallest shape it uses, per device,
instead of a factor of the grid's spacing.

Examples are laid out so that every device holds the same number of real rows,
give or take one (the two device halves measured for similarity stay balanced);
padding sits at the end of each device's rows.
"""

import dataclasses
import math

import numpy as np

from simigrad_jax import validation

__all__ = [
  "BatchPlan",
  "BucketPolicy",
  "bucket_shapes",
  "plan_batch",
  "representable_batch_sizes",
  "round_to_whole_rows",
]

# The most shapes per factor of two a grid may have (the compiles grow with it).
MAX_SHAPES_PER_OCTAVE = 16
# The most micro-steps a plan may split the rest of a batch into (each a dispatch of its own).
MAX_SHAPES_PER_STEP = 4


def _check_bounds(lower: int | None, upper: int | None) -> tuple[int, int | None]:
  """Validates optional bounds; returns ``(lower or 1, upper or None)``."""
  lo = 1 if lower is None else validation.check_int("lower", lower)
  hi = None if upper is None else validation.check_int("upper", upper)
  if hi is not None and hi < lo:
    raise ValueError(f"upper must be an int >= lower={lo}, got {hi!r}")
  return lo, hi


def _check_policy(policy: object) -> tuple[int, ...]:
  """Returns the policy's shape grid, or raises ValueError if not a policy."""
  if not isinstance(policy, BucketPolicy):
    raise ValueError(f"policy must be a BucketPolicy, got {policy!r}")
  return policy.micro_batch_sizes()


def _unrealisable(n: int, grid: tuple[int, ...], lo: int, hi: int | None) -> ValueError:
  """The error for ``padding=False`` bounds that hold no representable size."""
  return ValueError(
    f"no batch size in [lower={lo}, upper={hi}] is realisable without "
    f"padding on {n} devices with micro-batch sizes {grid}: the "
    "representable sizes are n * k * g with k = ceil(size / (n * max)); "
    "widen the bounds or use padding=True"
  )


def _check_count(name: str, value: object, most: int, meaning: str) -> int:
  """Returns ``value`` as an int if it is one in ``[1, most]``, else raises ValueError naming
  ``name`` and what it means."""
  if not validation.is_int(value) or not 1 <= value <= most:
    raise ValueError(f"{name} must be an int in [1, {most}] ({meaning}), got {value!r}")
  return int(value)


def check_shapes_per_octave(value: object) -> int:
  """Returns ``value`` as an int if it is one in ``[1, MAX_SHAPES_PER_OCTAVE]``, else raises ValueError."""
  meaning = "shapes per factor of two in the micro-batch grid; 1 halves"
  return _check_count("shapes_per_octave", value, MAX_SHAPES_PER_OCTAVE, meaning)


def check_shapes_per_step(value: object) -> int:
  """Returns ``value`` as an int if it is one in ``[1, MAX_SHAPES_PER_STEP]``, else raises ValueError."""
  meaning = "the micro-steps that may hold the rest of a batch; 1 plans a step on one shape"
  return _check_count("shapes_per_step", value, MAX_SHAPES_PER_STEP, meaning)


@dataclasses.dataclass(frozen=True)
class BucketPolicy:
  """The grid of micro-batch shapes a run compiles, and whether it pads.

  Attributes:
    max_micro_batch_size: rows per device per micro-step of the largest
      compiled shape (what fits in device memory).
    min_micro_batch_size: smallest compiled shape; ``None`` means equal to
      ``max_micro_batch_size`` (a single shape).
    padding: ``True`` realises every requested size exactly by padding the
      last rows of each device with weight-0 rows; ``False`` never pads and
      rounds the request to a size the shapes realise exactly.
    shapes_per_octave: shapes per factor of two, 1 to
      :data:`MAX_SHAPES_PER_OCTAVE`: 1 is the grid of halvings; more shapes
      pad less and compile more.
    shapes_per_step: the most micro-steps, 1 to :data:`MAX_SHAPES_PER_STEP`,
      that hold a step's rows beyond its micro-steps of the largest shape
      (padding only): 1 plans every micro-step of a step on one shape; 2 the
      largest shape that fits and the remainder on a smaller one; more, a
      finer sum of shapes. More pad less on a coarse grid, at the price of
      more micro-steps per step.
  """

  max_micro_batch_size: int
  min_micro_batch_size: int | None = None
  padding: bool = True
  shapes_per_octave: int = 1
  shapes_per_step: int = 1

  def __post_init__(self):
    top = validation.check_int("max_micro_batch_size", self.max_micro_batch_size)
    if self.min_micro_batch_size is not None:
      low = self.min_micro_batch_size
      if not validation.is_int(low) or not 1 <= low <= top:
        raise ValueError(
          "min_micro_batch_size must be None or an int in "
          f"[1, max_micro_batch_size={top}], got {low!r}"
        )
    validation.check_bool("padding", self.padding)
    check_shapes_per_octave(self.shapes_per_octave)
    check_shapes_per_step(self.shapes_per_step)
    if self.shapes_per_step > 1 and not self.padding:
      raise ValueError(
        f"shapes_per_step={self.shapes_per_step} needs padding=True (a step of several shapes "
        "realises any size exactly); use shapes_per_step=1 with padding=False"
      )

  def micro_batch_sizes(self) -> tuple[int, ...]:
    """Returns the grid of compiled micro-batch shapes, ascending.

    ``ceil(max / 2^(i / s))`` for ``i = 0, 1, ...`` (``s`` the shapes per
    octave; with ``s = 1`` the halvings ``g -> ceil(g / 2)``), so every entry
    is an integer and ``max`` is always in the grid, while the result stays
    ``>= min``; equal entries (small shapes, one row apart) count once. When
    ``min`` is not hit exactly, the smallest entry is the last one ``>= min``.

    Returns:
      A tuple of ``len <= s * log2(max / min) + 2`` ints, ending with ``max``.

    Example:
      >>> BucketPolicy(96, 10).micro_batch_sizes()
      (12, 24, 48, 96)
      >>> BucketPolicy(100, 10).micro_batch_sizes()
      (13, 25, 50, 100)
      >>> BucketPolicy(32, 16, shapes_per_octave=4).micro_batch_sizes()
      (16, 20, 23, 27, 32)
    """
    top = int(self.max_micro_batch_size)
    low = top if self.min_micro_batch_size is None else int(self.min_micro_batch_size)
    per_octave = int(self.shapes_per_octave)
    sizes = {top}
    step = 1
    while min(sizes) > 1:
      # Whole octaves divide exactly: ceil(top / 2^j) is the iterated halving.
      size = math.ceil(top / 2 ** (step / per_octave))
      if size < low:
        break
      sizes.add(size)
      step += 1
    return tuple(sorted(sizes))


@dataclasses.dataclass(frozen=True)
class BatchPlan:
  """How one optimizer step realises its global batch.

  Attributes:
    requested_batch_size: the size the controller asked for.
    global_batch_size: the realised size: the number of real examples this
      optimizer step trains on.
    num_devices: data-parallel devices.
    micro_batch_size: rows per device of the step's largest micro-step (the
      compiled shape of every micro-step when they share one).
    accumulation_steps: micro-steps per optimizer step.
    padded_examples: rows of padding (weight 0), all devices and micro-steps
      together; always 0 with ``padding=False``.
    micro_batch_sizes: each micro-step's rows per device, largest first;
      None (when made): ``accumulation_steps`` micro-steps of
      ``micro_batch_size``, which is what it then holds.
  """

  requested_batch_size: int
  global_batch_size: int
  num_devices: int
  micro_batch_size: int
  accumulation_steps: int
  padded_examples: int
  micro_batch_sizes: tuple[int, ...] | None = None

  def __post_init__(self):
    for name in (
      "requested_batch_size",
      "global_batch_size",
      "num_devices",
      "micro_batch_size",
      "accumulation_steps",
    ):
      validation.check_int(name, getattr(self, name))
    validation.check_int("padded_examples", self.padded_examples, minimum=0)
    sizes = self.micro_batch_sizes
    if sizes is None:
      sizes = (self.micro_batch_size,) * self.accumulation_steps
    sizes = tuple(sizes)
    if (
      len(sizes) != self.accumulation_steps
      or not all(validation.is_int(g) and g >= 1 for g in sizes)
      or sizes[0] != self.micro_batch_size
      or list(sizes) != sorted(sizes, reverse=True)
    ):
      raise ValueError(
        f"micro_batch_sizes must be {self.accumulation_steps} ints >= 1, largest first, the "
        f"first micro_batch_size={self.micro_batch_size}, got {self.micro_batch_sizes!r}"
      )
    object.__setattr__(self, "micro_batch_sizes", tuple(int(g) for g in sizes))
    if self.global_batch_size + self.padded_examples != self.rows_per_step:
      raise ValueError(
        "global_batch_size + padded_examples must equal num_devices * "
        f"sum(micro_batch_sizes) = {self.rows_per_step}, got "
        f"{self.global_batch_size} + {self.padded_examples}"
      )

  @property
  def shapes(self) -> tuple[int, ...]:
    """Each micro-step's rows per device, largest first (:attr:`micro_batch_sizes`, never None)."""
    assert self.micro_batch_sizes is not None  # (filled in when made)
    return self.micro_batch_sizes

  @property
  def is_mixed(self) -> bool:
    """Whether the micro-steps are of more than one shape."""
    return self.shapes[-1] != self.micro_batch_size

  @property
  def rows_per_step(self) -> int:
    """Rows computed per optimizer step, real and padding."""
    return self.num_devices * sum(self.shapes)

  @property
  def padding_fraction(self) -> float:
    """Fraction of the computed rows that are padding, in ``[0, 1)``."""
    return self.padded_examples / self.rows_per_step

  def example_layout(self) -> np.ndarray:
    """Returns which example sits in each row of the step.

    Example ``e`` goes to device ``d = e % n`` at position ``p = e // n`` of
    that device's rows, and a device deals its positions round-robin over the
    micro-steps that still have rows: row 0 of every micro-step, then row 1,
    and so on (with one shape: micro-step ``p % accumulation_steps``, row
    ``p // accumulation_steps``). Every device uses the same positions, so
    real counts per device differ by at most one, in every micro-step too,
    and padding ends each device's rows in every micro-step. So when the
    batch holds at least one example per device and each device at least one
    position per micro-step, every device has real rows in every micro-step
    (a masked BatchNorm never sees a device of padding alone).

    Returns:
      An int64 array of shape ``(accumulation_steps, num_devices,
      micro_batch_size)`` holding the example index in
      ``[0, global_batch_size)``, or ``-1`` for a padding row; micro-step
      ``j`` is its first ``micro_batch_sizes[j]`` rows (the rows beyond, in
      a smaller micro-step, are ``-1`` and not part of it).

    Example:
      >>> plan = plan_batch(5, 2, BucketPolicy(2))
      >>> plan.example_layout().tolist()
      [[[0, 4], [1, -1]], [[2, -1], [3, -1]]]
    """
    n, k, top = self.num_devices, self.accumulation_steps, self.micro_batch_size
    layout = np.full((k, n, top), -1, np.int64)
    # The (row, micro-step) of each position: row-major over the rows each micro-step has.
    row_of, step_of = np.nonzero(np.arange(top)[:, None] < np.asarray(self.shapes)[None, :])
    e = np.arange(self.global_batch_size, dtype=np.int64)
    p = e // n
    layout[step_of[p], e % n, row_of[p]] = e
    return layout

  def example_weights(self) -> np.ndarray:
    """Returns the weight of each row: 1 for a real example, 0 for padding.

    Returns:
      A float32 array shaped like :meth:`example_layout`; it sums to
      ``global_batch_size``.
    """
    return (self.example_layout() >= 0).astype(np.float32)


def _fit(size: int, n: int, grid: tuple[int, ...]) -> tuple[int, int]:
  """Fewest steps ``k``, then the smallest shape ``g``: ``n*k*g >= size``."""
  k = -(-size // (n * grid[-1]))
  return k, next(g for g in grid if n * k * g >= size)


def split_rows(rows: int, grid: tuple[int, ...], parts: int) -> tuple[int, ...]:
  """``rows`` per device on at most ``parts`` shapes of ``grid``, padding least.

  The candidates take the largest shapes that fit (none, one, ...) and then the
  smallest shape that holds what remains; of them the one of the fewest rows,
  then of the fewest micro-steps.

  Args:
    rows: rows per device to hold, at least 1 and at most ``max(grid)``.
    grid: the shapes, ascending.
    parts: the most micro-steps, at least 1.

  Returns:
    The shapes, largest first.

  Example:
    >>> split_rows(11, (2, 4, 8, 16), 1), split_rows(11, (2, 4, 8, 16), 2)
    ((16,), (8, 4))
    >>> split_rows(13, (1, 2, 4, 8, 16), 3)
    (8, 4, 1)
  """
  best: tuple[int, ...] = ()
  taken: list[int] = []
  rest = rows
  while len(taken) < parts:
    candidate = (*taken, next(g for g in grid if g >= rest))
    if not best or (sum(candidate), len(candidate)) < (sum(best), len(best)):
      best = candidate
    fitting = [g for g in grid if g <= rest]
    if not fitting:
      break
    taken.append(fitting[-1])
    rest -= fitting[-1]
    if rest == 0:
      best = tuple(taken)  # exact: no candidate pads less, none after has fewer steps
      break
  return tuple(sorted(best, reverse=True))


def step_shapes(rows: int, grid: tuple[int, ...], parts: int) -> tuple[int, ...]:
  """The micro-steps (rows per device each, largest first) of a step of ``rows`` per device.

  With ``parts == 1`` the fewest micro-steps ``k = ceil(rows / max)`` of the
  smallest shape that holds them; else ``k - 1`` micro-steps of ``max`` and
  the rest on at most ``parts`` shapes (:func:`split_rows`).

  Example:
    >>> step_shapes(40, (4, 8, 16), 1), step_shapes(40, (4, 8, 16), 2)
    ((16, 16, 16), (16, 16, 8))
  """
  top = grid[-1]
  k = -(-rows // top)
  if parts == 1:
    return (next(g for g in grid if k * g >= rows),) * k
  return (top,) * (k - 1) + split_rows(rows - (k - 1) * top, grid, parts)


def _round_up(size: int, n: int, grid: tuple[int, ...]) -> int:
  """Smallest representable size ``>= size``."""
  k, g = _fit(size, n, grid)
  return n * k * g


def _round_down(size: int, n: int, grid: tuple[int, ...]) -> int | None:
  """Largest representable size ``<= size``, or None if there is none."""
  top = grid[-1]
  k = -(-size // (n * top))
  for g in reversed(grid):
    if k * (top - g) >= top:  # n*k*g would need fewer steps: not in band k.
      break
    if n * k * g <= size:
      return n * k * g
  return n * (k - 1) * top if k > 1 else None


def _round(
  size: int, previous: int | None, n: int, grid: tuple[int, ...], lo: int, hi: int | None
) -> int:
  """Rounds ``size`` (already in bounds) to a representable size in bounds."""
  rounded_up = _round_up(size, n, grid)
  up = None if hi is not None and rounded_up > hi else rounded_up
  down = _round_down(size, n, grid)
  down = None if down is not None and down < lo else down
  if up is None:  # only rounding down stays in bounds, if that does
    if down is None:
      raise _unrealisable(n, grid, lo, hi)
    return down
  if down is None:
    return up
  if previous is None or size == previous:  # nearest, ties to the larger
    return up if up - size <= size - down else down
  return up if size > previous else down  # grow: never below previous; shrink: never above


def plan_batch(
  batch_size: int,
  num_devices: int,
  policy: BucketPolicy,
  *,
  previous_batch_size: int | None = None,
  lower: int | None = None,
  upper: int | None = None,
) -> BatchPlan:
  """Plans how to realise a requested global batch size on the shape grid.

  The request is first clamped to ``[lower, upper]``. With
  ``policy.padding`` it is then realised exactly: ``k = ceil(B / (n * max))``
  micro-steps of the smallest grid shape that fits, spare rows padded (with
  ``policy.shapes_per_step > 1``, ``k - 1`` of ``max`` and the rest on at most
  that many shapes: :func:`step_shapes`). Without
  padding it is rounded to a representable size ``S = n * k * g`` in bounds:

  * request above ``previous_batch_size`` (grow): the smallest representable
    size ``>= request``; if none is ``<= upper``, the largest one in bounds.
  * request below ``previous_batch_size`` (shrink): the largest representable
    size ``<= request``; if none is ``>= lower`` (e.g. the request is below
    ``n * min``), the smallest one in bounds.
  * ``previous_batch_size`` None or equal: the nearest representable size in
    bounds, ties to the larger.

  Args:
    batch_size: requested global batch size, an int ``>= 1``.
    num_devices: data-parallel devices, an int ``>= 1``.
    policy: the shape grid and padding mode.
    previous_batch_size: the realised size of the previous step, which sets
      the direction of rounding; ignored with ``padding=True``.
    lower: smallest allowed global batch size (default 1).
    upper: largest allowed global batch size (default unbounded).

  Returns:
    A :class:`BatchPlan`.

  Raises:
    ValueError: on a bad argument, or with ``padding=False`` when no
      representable size lies in ``[lower, upper]``.

  Example:
    >>> plan_batch(100, 8, BucketPolicy(16, 4)).micro_batch_size
    16
    >>> plan = plan_batch(100, 8, BucketPolicy(16, 4, padding=False),
    ...                   previous_batch_size=90)
    >>> plan.global_batch_size, plan.accumulation_steps
    (128, 1)

  .. note::
    Rounding keeps the direction when ``previous_batch_size`` is itself
    representable and in bounds (as every realised size is): a grow never
    ends below it, a shrink never above it, and the size stays at
    ``previous_batch_size`` only when no representable size in bounds lies
    beyond it in that direction. A previous size that is not representable
    (say an unrepresentable initial batch) gives no such guarantee. Pass the
    same bounds to :func:`bucket_shapes` and every call here.
  """
  size = validation.check_int("batch_size", batch_size)
  n = validation.check_int("num_devices", num_devices)
  grid = _check_policy(policy)
  previous = (
    None
    if previous_batch_size is None
    else validation.check_int("previous_batch_size", previous_batch_size)
  )
  lo, hi = _check_bounds(lower, upper)
  target = max(size, lo) if hi is None else min(max(size, lo), hi)
  if not policy.padding:
    target = _round(target, previous, n, grid, lo, hi)
  return plan_on_shapes(size, target, n, step_shapes(-(-target // n), grid, policy.shapes_per_step))


def plan_on_shapes(
  requested: int, batch_size: int, num_devices: int, shapes: tuple[int, ...]
) -> BatchPlan:
  """The plan of ``batch_size`` examples on micro-steps of ``shapes`` rows per device (largest
  first), the spare rows padded.

  Example:
    >>> plan_on_shapes(100, 100, 8, (8, 4, 1)).padded_examples
    4
  """
  return BatchPlan(
    requested_batch_size=requested,
    global_batch_size=batch_size,
    num_devices=num_devices,
    micro_batch_size=shapes[0],
    accumulation_steps=len(shapes),
    padded_examples=num_devices * sum(shapes) - batch_size,
    micro_batch_sizes=shapes,
  )


def bucket_shapes(
  policy: BucketPolicy, num_devices: int, lower: int, upper: int
) -> tuple[int, ...]:
  """Returns every micro-batch shape a run within ``[lower, upper]`` can use.

  Exactly the set of :func:`plan_batch` ``(..., lower=lower, upper=upper)``
  micro-batch sizes over all requests and previous sizes in ``[lower, upper]``:
  the shapes to compile ahead of time. Computed per accumulation count ``k``,
  stopping once the remaining ``k`` can only use ``max``, so it is fast for any
  ``upper``; with ``shapes_per_step > 1``, per remainder (at most ``max`` of
  them).

  Args:
    policy: the shape grid and padding mode.
    num_devices: data-parallel devices, an int ``>= 1``.
    lower: smallest global batch size, an int ``>= 1``.
    upper: largest global batch size, an int ``>= lower``.

  Returns:
    The shapes, ascending; a subset of ``policy.micro_batch_sizes()``.

  Raises:
    ValueError: on a bad argument, or with ``padding=False`` when no
      representable size lies in ``[lower, upper]``.

  Example:
    >>> bucket_shapes(BucketPolicy(64, 8), 8, 32, 4096)
    (8, 16, 32, 64)
    >>> bucket_shapes(BucketPolicy(64, 8), 8, 100, 4096)
    (16, 32, 64)
  """
  n = validation.check_int("num_devices", num_devices)
  lo, hi = validation.check_int("lower", lower), validation.check_int("upper", upper)
  _check_bounds(lo, hi)
  grid = _check_policy(policy)
  top = grid[-1]
  if policy.shapes_per_step > 1:
    return _mixed_shapes(grid, policy.shapes_per_step, -(-lo // n), -(-hi // n))
  shapes = set()
  for k in range(-(-lo // (n * top)), -(-hi // (n * top)) + 1):
    start = n * (k - 1) * top + 1  # band k: sizes that need exactly k steps
    a, b = max(start, lo), min(n * k * top, hi)
    if policy.padding:  # every shape between those of the band's two ends
      g_a, g_b = _fit(a, n, grid)[1], _fit(b, n, grid)[1]
      band = [g for g in grid if g_a <= g <= g_b]
    else:  # start > n*(k-1)*top keeps only sizes that need k steps
      band = [g for g in grid if a <= n * k * g <= b]
    shapes.update(band)
    if a == start and all(g == top for g in band):
      break  # later bands need fewer shapes still: only ``top``
  if not shapes:
    raise _unrealisable(n, grid, lo, hi)
  return tuple(sorted(shapes))


def _mixed_shapes(grid: tuple[int, ...], parts: int, low: int, high: int) -> tuple[int, ...]:
  """The shapes the steps of ``low`` to ``high`` rows per device use, ``parts`` shapes a step."""
  top = grid[-1]
  # A step's shapes depend on its rows beyond its micro-steps of ``top`` alone.
  rests = (
    range(1, top + 1)
    if high - low + 1 >= top
    else {(r - 1) % top + 1 for r in range(low, high + 1)}
  )
  shapes = {g for rest in rests for g in split_rows(rest, grid, parts)}
  if high > top:
    shapes.add(top)
  return tuple(sorted(shapes))


def representable_batch_sizes(
  policy: BucketPolicy, num_devices: int, lower: int, upper: int
) -> list[int]:
  """Returns the sizes in ``[lower, upper]`` a ``padding=False`` run realises.

  ``S`` is representable iff ``S == n * k * g`` for a grid shape ``g`` and
  ``k = ceil(S / (n * max))``, the fewest micro-steps.

  Args:
    policy: a policy with ``padding=False``.
    num_devices: data-parallel devices, an int ``>= 1``.
    lower: smallest size, an int ``>= 1``.
    upper: largest size, an int ``>= lower``.

  Returns:
    The representable sizes, ascending (possibly empty).

  Example:
    >>> representable_batch_sizes(BucketPolicy(4, 1, padding=False), 2, 1, 20)
    [2, 4, 8, 16]
  """
  n = validation.check_int("num_devices", num_devices)
  lo, hi = validation.check_int("lower", lower), validation.check_int("upper", upper)
  _check_bounds(lo, hi)
  grid = _check_policy(policy)
  if policy.padding:
    raise ValueError(
      "representable_batch_sizes needs a policy with padding=False, got "
      f"{policy!r}; with padding every size is realised exactly"
    )
  top = grid[-1]
  return [
    n * k * g
    for k in range(-(-lo // (n * top)), -(-hi // (n * top)) + 1)
    for g in grid
    if k * (top - g) < top and lo <= n * k * g <= hi
  ]


def round_to_whole_rows(
  batch_size: int,
  previous_batch_size: int,
  num_devices: int,
  lower: int | None,
  upper: int | None,
) -> int:
  """Rounds a requested batch size to whole rows per device, in the direction of the change.

  Every device computes the same number of rows, so a size that is not a
  multiple of ``num_devices`` pads the rest of a row on each device short of
  one. The reference implementation realises its sizes as workers x
  micro-batch x accumulation and rounds in the direction of the change; this
  rounds only to a multiple of ``num_devices`` (the grid's shapes still pad
  the rest, as :func:`plan_batch` plans it): a grow from ``previous_batch_size``
  to the next multiple at or above the request, a shrink to the one at or
  below it, within ``[lower, upper]``. A grow never rounds back to the
  previous size and a shrink never above it, unless the bounds hold no
  multiple beyond it in that direction: then the multiple in bounds nearest
  the request. An unchanged size is kept as it is (a first size that is no
  multiple stays until the size moves).

  Args:
    batch_size: the requested size, an int ``>= 1`` within the bounds.
    previous_batch_size: the size of the step before (the direction of the change).
    num_devices: the data-parallel devices (slots), an int ``>= 1``.
    lower: the smallest allowed size (None: 1).
    upper: the largest allowed size (None: unbounded); ``[lower, upper]``
      must hold a multiple of ``num_devices`` (:func:`check_whole_rows_bounds`).

  Returns:
    A multiple of ``num_devices`` in ``[lower, upper]``, or ``batch_size``
    when it equals ``previous_batch_size``.

  Example:
    >>> round_to_whole_rows(17, 16, 8, 16, 256), round_to_whole_rows(21, 24, 8, 16, 256)
    (24, 16)
    >>> round_to_whole_rows(250, 240, 8, 16, 252)  # no multiple above 248 is in bounds
    248
  """
  if batch_size == previous_batch_size:
    return batch_size
  n = num_devices
  low = -(-(lower or 1) // n) * n  # the smallest multiple in bounds
  rounded = -(-batch_size // n) * n if batch_size > previous_batch_size else batch_size // n * n
  rounded = max(rounded, low)
  return rounded if upper is None else min(rounded, upper // n * n)


def check_whole_rows_bounds(num_devices: int, lower: int, upper: int | None) -> None:
  """Raises ValueError unless ``[lower, upper]`` holds a multiple of ``num_devices`` (what
  :func:`round_to_whole_rows` rounds to).

  Example:
    >>> check_whole_rows_bounds(8, 16, 256)
  """
  if upper is not None and -(-lower // num_devices) * num_devices > upper:
    raise ValueError(
      f"whole_rows=True rounds batch sizes to multiples of the {num_devices} data-parallel "
      f"devices (slots), but the bounds [{lower}, {upper}] hold none; widen the bounds or "
      "use whole_rows=False"
    )
