"""Host: unreadable checkpoints moved aside, so that a resumed run can save their steps again.

A restore that skips damaged checkpoints for an older one moves the skipped
ones from ``<directory>/<step>`` to ``<directory>.unreadable/<step>.<n>``
(``n`` the first number not taken there), where they can be examined, instead
of deleting them. Nothing is moved before every process has finished reading,
and only process 0 moves: the checkpoints live on storage every process sees.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import jax
from jax.experimental import multihost_utils

from simigrad_jax import files


def quarantine(directory: str, steps: Sequence[int]) -> list[str]:
  """Moves the checkpoints of ``steps`` in ``directory`` to ``<directory>.unreadable/``.

  Every process must call it (multi-host runs), with the same ``steps``. The
  folder is created private (mode 0o700), as the checkpoints are; a step
  whose folder is gone is not moved.

  Raises:
    UnsafePathError: ``<directory>.unreadable`` is a link or a file (it is
      never followed: nothing is moved).

  Args:
    directory: the checkpoints' directory.
    steps: the steps of the checkpoints to move.

  Returns:
    The folders the checkpoints were moved to, one per step, in order.

  Example:
    >>> quarantine("/tmp/run/checkpoints", [3])  # doctest: +SKIP
    ['/tmp/run/checkpoints.unreadable/3.0']
  """
  multi = jax.process_count() > 1
  if multi:  # every process has finished reading before anything moves
    multihost_utils.sync_global_devices("simigrad_jax:quarantine:read")
  root = unreadable_root(directory)
  if os.path.islink(root) or (os.path.lexists(root) and not os.path.isdir(root)):
    # Followed, a link would take the run's checkpoints out of its workdir.
    raise files.UnsafePathError(
      f"{root}, where unreadable checkpoints are moved, is "
      f"{'a link to ' + repr(os.readlink(root)) if os.path.islink(root) else 'not a folder'}: "
      f"nothing was moved, the run never moves its checkpoints through a link or onto a file; "
      f"remove it (rm {root}), then run again"
    )
  taken = os.listdir(root) if os.path.isdir(root) else []
  names = free_names(steps, taken)
  moves = [
    (os.path.join(directory, str(s)), os.path.join(root, n))
    for s, n in zip(steps, names, strict=True)
  ]
  if multi:
    multihost_utils.sync_global_devices("simigrad_jax:quarantine:named")
  if jax.process_index() == 0:
    for source, destination in moves:
      if os.path.isdir(source):
        os.makedirs(root, mode=0o700, exist_ok=True)  # private, as the checkpoints
        os.replace(source, destination)
  if multi:
    multihost_utils.sync_global_devices("simigrad_jax:quarantine:moved")
  return [destination for _, destination in moves]


def unreadable_root(directory: str) -> str:
  """Where the unreadable checkpoints of ``directory`` are moved: ``<directory>.unreadable``."""
  return directory + ".unreadable"


def free_names(steps: Iterable[int], taken: Iterable[str]) -> list[str]:
  """``<step>.<n>`` for each of ``steps``, ``n`` the lowest number that no name taken has.

  Args:
    steps: the steps to name (a step may come more than once).
    taken: the names already in use.

  Returns:
    One name per step, in order, none of them taken and no two the same.

  Example:
    >>> free_names([3, 2, 3], taken=["3.0", "3.2"])
    ['3.1', '2.0', '3.3']
  """
  used = set(taken)
  names = []
  for step in steps:  # the same names on every process
    n = 0
    while f"{step}.{n}" in used:
      n += 1
    used.add(f"{step}.{n}")
    names.append(f"{step}.{n}")
  return names
