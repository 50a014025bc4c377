"""Grain-style random-access rows of in-memory arrays, importable by grain's worker processes."""

import numpy as np


class Rows:
  """Row ``i`` of a dict of equal-length arrays (``__len__``, ``__getitem__``); pickles.

  Args:
    arrays: ``{name: array}``, all of the same length.
  """

  def __init__(self, arrays: dict[str, np.ndarray]):
    self.arrays = arrays

  def __len__(self) -> int:
    return len(next(iter(self.arrays.values())))

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return {name: array[index] for name, array in self.arrays.items()}
