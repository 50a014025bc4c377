"""Host: agreeing across processes on what every one of them has compiled.

When several processes run the steps together, a step whose program is still
compiling may only fall back to a shape compiled on EVERY process, or their
collectives would not match. At each step's agreement every process sends a
report of its compiled shapes (:func:`report_bitmasks`: a few small integers
however long the run) and receives every process's; :func:`agreed_view`
makes of them the same view on every process, which the compile fallback
(:mod:`simigrad_jax.compile.fallback`) then reads. The views are those of
:meth:`simigrad_jax.compile.program_compiler.StepProgramCompiler.view`. Nothing here
runs under ``jit``.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def report_bitmasks(view: Mapping[str, Any], grid: Sequence[int]) -> dict[str, int]:
  """``view`` as bitmasks over ``grid`` (bit ``i``: its ``i``-th shape), ``apply`` as 0 or 1.

  Args:
    view: ``{"fused", "micro", "apply", "failed_fused", "failed_micro"}``:
      sets of shapes, and whether the update is compiled.
    grid: the run's shapes, in the same order on every process.

  Returns:
    The same keys, as ints.

  Example:
    >>> report_bitmasks({"fused": {4, 8}, "micro": set(), "apply": True}, [2, 4, 8])
    {'fused': 6, 'micro': 0, 'apply': 1}
  """
  mask = lambda sizes: sum(1 << i for i, size in enumerate(grid) if size in sizes)
  return {key: (int(value) if key == "apply" else mask(value)) for key, value in view.items()}


def agreed_view(reports: Sequence[Mapping[str, int]], grid: Sequence[int]) -> dict[str, Any]:
  """The view of what EVERY process reported compiled, and what ANY process failed to compile.

  Args:
    reports: one :func:`report_bitmasks` per process (at least one).
    grid: the shapes the bitmasks index.

  Returns:
    ``{"fused", "micro", "apply", "failed_fused", "failed_micro"}``: the
    same on every process that is given the same reports.

  Raises:
    ValueError: when ``reports`` is empty.

  Example:
    >>> one = {"fused": 0b11, "micro": 0, "apply": 1, "failed_fused": 0, "failed_micro": 0}
    >>> two = {"fused": 0b10, "micro": 0, "apply": 0, "failed_fused": 0b01, "failed_micro": 0}
    >>> view = agreed_view([one, two], [2, 4])
    >>> view["fused"], view["apply"], view["failed_fused"]
    ({4}, False, {2})
  """
  if not reports:
    raise ValueError("reports must hold one report per process, got none")
  sizes = lambda mask: {size for i, size in enumerate(grid) if mask >> i & 1}
  every = lambda key: functools.reduce(operator.and_, (r[key] for r in reports))
  anyone = lambda key: functools.reduce(operator.or_, (r[key] for r in reports))
  return {
    "fused": sizes(every("fused")),
    "micro": sizes(every("micro")),
    "apply": bool(every("apply")),
    "failed_fused": sizes(anyone("failed_fused")),
    "failed_micro": sizes(anyone("failed_micro")),
  }


class CompileAgreement:
  """The last view every process agreed on, over the run's grid of shapes.

  Args:
    grid: the run's shapes (rows per slot); sorted here, so that every
      process indexes its bitmasks alike.

  Example:
    >>> agreement = CompileAgreement([8, 2, 4])
    >>> agreement.view is None  # nothing agreed yet
    True
    >>> view = {"fused": {4}, "micro": set(), "apply": False,
    ...         "failed_fused": set(), "failed_micro": set()}
    >>> report = agreement.report(view)
    >>> agreement.agree([report, report])
    >>> agreement.view["fused"]
    {4}
  """

  def __init__(self, grid: Iterable[int]):
    self._grid = sorted(grid)
    self.view: dict[str, Any] | None = None  # what every process has compiled, once agreed

  def report(self, view: Mapping[str, Any]) -> dict[str, int]:
    """This process's ``view``, for the other processes (:func:`report_bitmasks`)."""
    return report_bitmasks(view, self._grid)

  def agree(self, reports: Sequence[Mapping[str, int]]) -> None:
    """Sets :attr:`view` from every process's report (:func:`agreed_view`).

    Every process passes the same ``reports`` (one per process, gathered at
    a step's agreement), so every process takes the same fallback decision
    at the next step and the collectives of the step match.
    """
    self.view = agreed_view(reports, self._grid)
