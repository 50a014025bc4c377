"""Host: checks of user-given settings, with errors that name the value and the valid range."""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeGuard

import numpy as np


def is_bool(value: Any) -> bool:
  return isinstance(value, (bool, np.bool_))


def is_int(value: Any) -> TypeGuard[int | np.integer]:
  """An integer that is not a bool (NumPy integers included)."""
  return isinstance(value, (int, np.integer)) and not is_bool(value)


def is_real(value: Any) -> TypeGuard[int | float | np.integer | np.floating]:
  """A real number that is not a bool (NumPy numbers included)."""
  return isinstance(value, (int, float, np.integer, np.floating)) and not is_bool(value)


def check_int(name: str, value: Any, minimum: int = 1) -> int:
  """Returns ``value`` as an int, or raises ValueError naming it and the valid range."""
  if not is_int(value):
    raise ValueError(
      f"{name} must be an integer >= {minimum}, got {value!r} ({type(value).__name__})"
    )
  if int(value) < minimum:
    raise ValueError(f"{name} must be an integer >= {minimum}, got {int(value)}")
  return int(value)


SEED_MAX = 2**32 - 1


def check_seed(value: Any, name: str = "seed") -> int:
  """Returns a random seed as an int: an integer in ``[0, SEED_MAX]`` (``2**32 - 1``).

  ``jax.random.key`` keeps a seed's low 32 bits unless ``jax_enable_x64`` is
  on, so a larger seed would silently train as a smaller one does
  (``2**32`` as ``0``); and beyond int64 it fails with an ``OverflowError``.

  Example:
    >>> check_seed(3)
    3
    >>> try:
    ...   check_seed(2**32)
    ... except ValueError as error:
    ...   print(error)  # doctest: +ELLIPSIS
    seed must be an integer in [0, 4294967295], got 4294967296: ... the key of seed 0
  """
  seed = check_int(name, value, 0)
  if seed > SEED_MAX:
    why = (
      f"jax.random.key keeps a seed's low 32 bits, so it would give the key of seed {seed % 2**32}"
      if seed < 2**63
      else "jax.random.key takes no seed beyond int64"
    )
    raise ValueError(f"{name} must be an integer in [0, {SEED_MAX}], got {seed}: {why}")
  return seed


def check_bool(name: str, value: Any) -> bool:
  """Returns ``value`` as a bool; refuses anything but True and False."""
  if not is_bool(value):
    raise ValueError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
  return bool(value)


def check_real(name: str, value: Any, valid: str, ok: Callable[[float], bool]) -> float:
  """Returns ``float(value)`` if it is a real, non-NaN number with ``ok(value)``.

  ``valid`` describes the accepted range for the error message, e.g. ``"[-1, 1]"``.
  """
  if not is_real(value) or math.isnan(float(value)) or not ok(float(value)):
    raise ValueError(f"{name} must be a number in {valid}, got {value!r}")
  return float(value)


FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_lr_factor(value: Any, name: str = "lr_factor") -> float:
  """Returns a learning-rate factor as a float: a real number (or 0-d array) > 0, finite in float32.

  Refuses bools, strings and arrays of other shapes (``float()`` would take
  ``True`` and ``"2"``), NaN, 0, negative numbers (an ascent) and numbers
  beyond float32's range (the factor lives in a float32 scalar).
  """
  array = np.asarray(value) if not isinstance(value, (str, bytes)) else None
  if array is None or array.ndim != 0 or array.dtype.kind not in "iuf":
    raise ValueError(
      f"{name} must be a finite number > 0 (a Python or NumPy number or a 0-d array), got "
      f"{value!r} ({type(value).__name__})"
    )
  factor = float(array)
  if not 0.0 < factor <= FLOAT32_MAX:  # NaN fails too
    raise ValueError(f"{name} must be a finite number > 0 (within float32's range), got {value!r}")
  return factor


def check_interval(
  name: str,
  value: Any,
  low: float = -math.inf,
  high: float = math.inf,
  *,
  low_open: bool = False,
  high_open: bool = False,
) -> float:
  """Returns ``float(value)`` if it is a finite real number in the interval from ``low`` to ``high``.

  NaN and the infinities are always refused; an infinite bound only says that
  the interval has no bound on that side.

  Args:
    name: the setting as the user types it (``"learning_rate"``, ``"--config.momentum"``).
    value: the value given.
    low, high: the bounds (``-inf``, ``inf``: none).
    low_open, high_open: exclude the bound itself.

  Raises:
    ValueError: naming ``name``, the valid interval and ``value``.

  Example:
    >>> check_interval("momentum", 0.9, 0, 1, high_open=True)
    0.9
    >>> try:
    ...   check_interval("learning_rate", float("nan"), 0)
    ... except ValueError as error:
    ...   print(error)
    learning_rate must be a number in [0, inf) (finite), got nan
  """
  opening = "(" if low_open or low == -math.inf else "["
  closing = ")" if high_open or high == math.inf else "]"
  valid = f"{opening}{low:g}, {high:g}{closing}"
  if math.inf in (-low, high):
    valid += " (finite)"

  def inside(x: float) -> bool:
    above = low < x if low_open else low <= x
    below = x < high if high_open else x <= high
    return math.isfinite(x) and above and below

  return check_real(name, value, valid, inside)


def check_path(name: str, value: Any) -> str | os.PathLike:
  """Returns ``value`` if it is a non-empty path (str or os.PathLike).

  An empty path would mean the current folder (``pathlib.Path("")`` is
  ``"."``), which a user who typed ``--workdir ""`` did not ask for.

  Raises:
    ValueError: naming ``name`` and the value.

  Example:
    >>> try:
    ...   check_path("workdir", "")
    ... except ValueError as error:
    ...   print(error)
    workdir must be a non-empty path, got ''
  """
  if not isinstance(value, (str, os.PathLike)) or not os.fspath(value).strip():
    raise ValueError(f"{name} must be a non-empty path, got {value!r}")
  return value


def scalar_kind(value: Any) -> str | None:
  """The NumPy kind of a scalar: Python's, NumPy's or a 0-d NumPy or JAX array; else None.

  ``"b"`` for a bool, ``"i"`` or ``"u"`` for an integer, ``"f"`` for a float.

  Example:
    >>> scalar_kind(True), scalar_kind(np.int64(3)), scalar_kind(np.asarray(0.5)), scalar_kind([1])
    ('b', 'i', 'f', None)
  """
  if isinstance(value, (bool, int, float)):
    return "b" if isinstance(value, bool) else "i" if isinstance(value, int) else "f"
  if hasattr(value, "__array__") or hasattr(value, "dtype"):
    array = np.asarray(value)
    return array.dtype.kind if array.ndim == 0 else None
  return None


def is_flag(value: Any) -> bool:
  """A bool: Python's, NumPy's or a 0-d array of one (``float(True)`` would read it as 1.0)."""
  return scalar_kind(value) == "b"


def as_real(value: Any) -> float | None:
  """A real scalar that is not a bool (Python's, NumPy's or 0-d) as a float, else None.

  Example:
    >>> as_real(np.float32(0.5)), as_real(True), as_real("0.5")
    (0.5, None, None)
  """
  return float(value) if scalar_kind(value) in ("i", "u", "f") else None


def as_float(value: Any) -> float | None:
  """A numeric scalar (bool, int, float, or a 0-d NumPy or JAX array) as a float, else None.

  Example:
    >>> as_float(np.float32(0.5)), as_float("0.5")
    (0.5, None)
  """
  return float(value) if scalar_kind(value) in ("b", "i", "u", "f") else None


def unknown_names(unknown: Iterable[str], valid: Sequence[str]) -> str:
  """Each of ``unknown`` quoted, with the name of ``valid`` it resembles, for an error message.

  Example:
    >>> unknown_names(["sed", "colour"], ["seed", "mode"])
    "'sed' (did you mean 'seed'?), 'colour'"
  """
  return ", ".join(
    f"{name!r} (did you mean {close[0]!r}?)"
    if (close := difflib.get_close_matches(name, valid, n=1))
    else repr(name)
    for name in unknown
  )
