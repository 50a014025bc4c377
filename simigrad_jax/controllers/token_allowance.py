"""Host: the token-allowance controller, registered as ``"allowance"``: the fewest steps for a token budget.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training") model
the progress a batch of B examples makes against the noise scale
``B_noise``: to make the progress that ``dE_min`` examples make at a
vanishing batch (the fewest examples) takes

  ``dE = dE_min (1 + B / B_noise)`` examples in ``dS = dS_min (1 + B_noise / B)`` steps,

with ``dS_min = dE_min / B_noise``: their trade-off
``(S / S_min - 1)(E / E_min - 1) = 1``. Against the constant batch ``B_0`` a
run would otherwise use, a batch B spends ``(1 + B / B_noise) / (1 + B_0 /
B_noise)`` times its examples for the same progress. Spending at most ``a``
times them at every point of training, the fewest steps are those of the
largest B within the allowance:

  ``B = a B_0 + (a - 1) B_noise``.

That is the rule (per step, not over the run: the best schedule over a run,
``B ~ sqrt(B_noise)``, needs the future noise scale, which a run does not
know). ``B_noise`` is the simple noise scale ``B_simple``, read from the
similarities as SimiGrad's model rule reads it
(:class:`~simigrad_jax.controllers.similarity_model.SimilarityModel`:
``s(B) = 1 / (1 + 2 B_simple / B)``, moving averages of both sides).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from simigrad_jax import validation
from simigrad_jax.controllers.base import BaseController
from simigrad_jax.controllers.noise_scale import check_pacing
from simigrad_jax.controllers.noise_scale import paced
from simigrad_jax.controllers.similarity_model import SimilarityModel


def allowance_batch_size(
  noise_scale: float, allowance: float, reference_batch_size: float
) -> float:
  """The largest batch that spends at most ``allowance`` x the reference batch's examples.

  From McCandlish et al.'s model, ``E = E_min (1 + B / B_noise)``: a batch B
  spends ``(1 + B / B_noise) / (1 + B_0 / B_noise)`` times the examples of
  the constant batch ``B_0`` for the same progress, so the batch that spends
  ``a`` times them is ``a B_0 + (a - 1) B_noise``.

  Args:
    noise_scale: ``B_noise`` (>= 0; inf when noise dominates).
    allowance: ``a`` >= 1.
    reference_batch_size: ``B_0``, the constant batch compared with (0: the
      fewest-examples path, ``E_min``).

  Returns:
    The batch size (a float; inf when ``B_noise`` is and ``a > 1``).

  Example:
    >>> allowance_batch_size(100.0, 1.5, 16)  # 1.5 * 16 + 0.5 * 100
    74.0
  """
  if allowance == 1.0:
    return float(reference_batch_size)
  return allowance * reference_batch_size + (allowance - 1.0) * noise_scale


class AllowanceController(BaseController):
  """The batch that reaches a loss in the fewest steps on a stated token allowance.

  Each step, the similarity measured at the size that ran updates a moving
  estimate of the noise scale ``B_noise``
  (:class:`~simigrad_jax.controllers.similarity_model.SimilarityModel`), and
  the next size is the largest batch that spends at most
  ``token_allowance`` times the examples that the constant
  ``initial_batch_size`` would spend for the same progress
  (:func:`allowance_batch_size`, McCandlish et al. 2018):

    ``B = a B_0 + (a - 1) B_noise``,

  rounded, moved at most by a factor ``max_change`` per step, within the
  bounds. It has no similarity target to tune: the allowance is the budget
  (1.10: at most 10% more tokens than the constant batch, for as few steps
  as the noise scale allows). docs/controllers.md derives it and states
  its assumptions.

  Args:
    initial_batch_size: B_0, the size of the first steps and the constant
      batch the allowance is counted against.
    token_allowance: a >= 1, the examples (tokens) the run may spend per
      unit of progress, as a multiple of B_0's (1: stay at B_0).
    ema_decay: d in [0, 1), the moving averages' decay per step (0: the last
      step alone).
    max_change: optional factor > 1 by which one step may change the size at
      most (see :func:`~simigrad_jax.controllers.noise_scale.paced`); None
      jumps straight to the rule's size.
    batch_size_lower_bound: optional smallest batch size (integer >= 2).
    batch_size_upper_bound: optional largest batch size.
    warmup_steps: the first this many updates never change the size (the
      averages still learn).
    verbose: log each decision (logger ``"simigrad_jax"``, level INFO).

  Example:
    >>> c = AllowanceController(16, 1.1, ema_decay=0.0, max_change=None)
    >>> c.update(0.5)  # s = 0.5 at B = 16: B_noise = 8; B = 1.1 * 16 + 0.1 * 8
    18
    >>> c.noise_scale
    8.0

  Note:
    A step with a non-finite similarity leaves the averages alone, keeps the
    size and is counted in ``nonfinite_count``. While the averaged
    similarity is at or below 0 the noise scale counts as infinite: the size
    grows as fast as ``max_change`` allows, up to the upper bound (without
    ``max_change``, straight to the upper bound; without either, it holds).
  """

  KIND = "allowance"

  def __init__(
    self,
    initial_batch_size: int,
    token_allowance: float = 1.1,
    *,
    ema_decay: float = 0.9,
    max_change: float | None = 2.0,
    batch_size_lower_bound: int | None = None,
    batch_size_upper_bound: int | None = None,
    warmup_steps: int = 0,
    verbose: bool = False,
  ):
    self._allowance = validation.check_real(
      "token_allowance", token_allowance, "[1, inf)", lambda x: 1.0 <= x < math.inf
    )
    self._max_change = check_pacing(max_change, batch_size_lower_bound)
    self._model = SimilarityModel(ema_decay)
    super().__init__(
      initial_batch_size,
      batch_size_lower_bound=batch_size_lower_bound,
      batch_size_upper_bound=batch_size_upper_bound,
      warmup_steps=warmup_steps,
      verbose=verbose,
    )

  @property
  def token_allowance(self) -> float:
    """a, the examples the run may spend per unit of progress, as a multiple of B_0's."""
    return self._allowance

  @property
  def noise_scale(self) -> float | None:
    """The moving estimate of ``B_noise`` (inf: noise dominates; None before a finite step)."""
    return self._model.noise_scale

  @property
  def target_batch_size(self) -> float | None:
    """``a B_0 + (a - 1) B_noise`` (before rounding, pacing and bounds; None before a finite step)."""
    scale = self.noise_scale
    if scale is None:
      return None
    return allowance_batch_size(scale, self._allowance, self._initial)

  def observe(
    self, similarity: float, stats: Mapping[str, Any] | None, finite: bool
  ) -> bool | None:
    del stats
    if not (finite and math.isfinite(similarity)):
      return False
    self._model.observe(similarity, self._batch_size)
    return True

  def decide(self) -> int:
    b, target = self._batch_size, self.target_batch_size
    if target is None:
      return b
    if math.isinf(target):
      if self._max_change is None:
        return b if self._upper is None else self._upper
      return paced(b, math.inf, self._max_change)
    return paced(b, max(int(round(target)), 1), self._max_change)

  def likely_batch_sizes(self, examples_seen: int, epochs: float) -> list[int]:
    """The size the averages as they stand decide (the size itself during the warm-up).

    Before the first finite step, the farthest the first estimate may move
    the size either way (with ``max_change``), and the size.
    """
    del examples_seen, epochs
    b = self._batch_size
    if self._holds_next():
      return [b]
    if self._model.count == 0:
      if self._max_change is None:
        return [b]
      sizes = [paced(b, math.inf, self._max_change), paced(b, 1, self._max_change), b]
    else:
      sizes = [self.decide()]
    return list(dict.fromkeys(self._clamp(size) for size in sizes))

  def settings(self) -> dict[str, Any]:
    return {
      "token_allowance": self._allowance,
      "ema_decay": self._model.decay,
      "max_change": self._max_change,
      "warmup_steps": self._warmup,
    }

  def extra_state(self) -> dict[str, Any]:
    return {"similarity_model": self._model.state_dict()}

  def parse_extra_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
    model = SimilarityModel(self._model.decay)
    model.load_parsed_state(SimilarityModel.parse_state(state["similarity_model"]))
    return {"_model": model}

  def _log_details(self, before: int) -> str:
    return f"noise scale {self.noise_scale}, allowance size {self.target_batch_size}"
