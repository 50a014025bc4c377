"""Host: a global batch ordered so that device halves hold its even- and odd-numbered examples.

A batch sharded over a mesh's data axis (``P("data")``) lies in contiguous
blocks of rows, one per data position. The device split of
:func:`simigrad_jax.transform` compares the even data positions with the odd
ones, so with the batch as it comes each half is a set of blocks. Dealt with
:func:`deal_to_devices`, example ``e`` lies on data position ``e % n``, as
the ``Trainer`` and a ``jax.pmap`` loop that deals its examples place them:
the even positions then hold the batch's even-numbered examples (half A) and
the odd positions its odd-numbered ones (half B), the one statement of the
halves on every path.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from simigrad_jax import validation


def deal_to_devices(batch: Any, num_devices: int) -> Any:
  """Orders a global batch so that, cut into ``num_devices`` blocks, example ``e`` is in block ``e % num_devices``.

  Args:
    batch: a pytree of arrays whose leading axis is the example axis, the
      same size ``B`` in every leaf; ``B`` a multiple of ``num_devices``.
    num_devices: the size of the mesh's data axis.

  Returns:
    The batch as NumPy arrays, rows reordered: block ``d`` (rows ``d * B / n``
    to ``(d + 1) * B / n``) holds examples ``d, d + n, d + 2n, ...``. Shard it
    over the data axis (``P("data")``) as usual.

  Example:
    >>> import numpy as np, simigrad_jax
    >>> simigrad_jax.data.deal_to_devices({"x": np.arange(8)}, 4)["x"].tolist()
    [0, 4, 1, 5, 2, 6, 3, 7]
  """
  if not validation.is_int(num_devices) or num_devices < 1:
    raise ValueError(f"num_devices={num_devices!r} is not valid: give the data axis's size (>= 1)")
  num_devices = int(num_devices)
  leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(batch)]
  sizes = sorted({leaf.shape[0] if leaf.ndim else -1 for leaf in leaves})
  if len(sizes) != 1 or sizes[0] < 0:
    raise ValueError(
      f"every array in the batch needs the same leading (example) axis; got sizes {sizes}"
    )
  rows = sizes[0]
  if rows % num_devices:
    raise ValueError(
      f"the batch has {rows} examples, not a multiple of num_devices={num_devices}: "
      "every data position needs the same number of rows"
    )
  order = np.arange(rows).reshape(rows // num_devices, num_devices).T.ravel()
  return jax.tree.map(lambda leaf: np.asarray(leaf)[order], batch)
