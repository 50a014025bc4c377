"""Host: the gradient noise scale read from a moving average of measured similarities.

Under SimiGrad's noise model (SPEC.md), the cosine similarity of the two
half-batch gradients measured at global batch B follows

  ``s(B) ~ 1 / (1 + 2 B_simple / B) = w B / (1 + w B)``,  ``w = 1 / (2 B_simple)``,

with ``B_simple`` McCandlish et al.'s simple noise scale. Rearranged,
``s = w * B (1 - s)``: every step's pair (s_t, B_t) is one noisy look at the
same batch-independent w, whatever size it was measured at. One step's
similarity is noisy (its spread is 0.1 to 0.2 at small batches on MNIST), so
:class:`SimilarityModel` keeps exponential moving averages of both sides and
takes their ratio,

  ``S_t = d S_{t-1} + (1 - d) s_t``,  ``X_t = d X_{t-1} + (1 - d) B_t (1 - s_t)``,
  ``w = S_t / X_t``,  ``B_simple = X_t / (2 S_t)``,

the ratio of averages rather than the average of ratios, as for the noise-scale
controller: single-step ratios are unbounded near s = 0. The averages start at
zero; their bias correction (dividing by ``1 - d^t``) cancels in the ratio.
Because the samples are normalised by the size they were measured at, a
batch size that moves does not drag the estimate with it, which a plain
average of the similarity would do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from simigrad_jax import validation


class SimilarityModel:
  """A moving-average estimate of the noise scale from (similarity, batch size) pairs.

  Args:
    decay: d in [0, 1), the moving averages' decay per observation (0: the
      last observation alone).

  Example:
    >>> m = SimilarityModel(0.0)
    >>> m.observe(0.5, 64)  # s = 1 / (1 + 2 * 32 / 64): B_simple = 32
    >>> m.noise_scale, m.similarity_at(192), m.batch_size_for(0.2)
    (32.0, 0.75, 16.0)
  """

  def __init__(self, decay: float):
    self._decay = validation.check_real("ema_decay", decay, "[0, 1)", lambda x: 0.0 <= x < 1.0)
    self._ema_similarity = 0.0
    self._ema_noise = 0.0
    self._count = 0

  @property
  def decay(self) -> float:
    """The moving averages' decay per observation."""
    return self._decay

  @property
  def count(self) -> int:
    """How many observations the averages hold."""
    return self._count

  @property
  def noise_scale(self) -> float | None:
    """``B_simple = X / (2 S)``: inf while ``S <= 0`` (noise dominates), None before any observation."""
    if self._count == 0:
      return None
    if self._ema_similarity <= 0:
      return math.inf
    return max(self._ema_noise, 0.0) / (2.0 * self._ema_similarity)

  def observe(self, similarity: float, batch_size: float) -> None:
    """Adds one step's similarity ``s`` measured at global batch ``batch_size`` (both finite)."""
    s, b = float(similarity), float(batch_size)
    d = self._decay
    self._ema_similarity = d * self._ema_similarity + (1.0 - d) * s
    self._ema_noise = d * self._ema_noise + (1.0 - d) * b * (1.0 - s)
    self._count += 1

  def similarity_at(self, batch_size: float) -> float | None:
    """The similarity the model predicts at ``batch_size``: ``1 / (1 + 2 B_simple / B)``."""
    scale = self.noise_scale
    if scale is None:
      return None
    return 0.0 if math.isinf(scale) else 1.0 / (1.0 + 2.0 * scale / float(batch_size))

  def batch_size_for(self, similarity: float) -> float | None:
    """The batch size at which the model predicts ``similarity`` (in (0, 1)): ``2 s / (1 - s) B_simple``.

    inf while the noise scale is; None before any observation.
    """
    scale = self.noise_scale
    if scale is None:
      return None
    return math.inf if math.isinf(scale) else 2.0 * similarity / (1.0 - similarity) * scale

  def state_dict(self) -> dict[str, Any]:
    """The averages and their count as plain JSON data."""
    return {
      "ema_similarity": self._ema_similarity,
      "ema_noise": self._ema_noise,
      "count": self._count,
    }

  @staticmethod
  def parse_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """Checks a :meth:`state_dict`; returns it with plain types (raises ValueError, KeyError)."""
    if not isinstance(state, Mapping):
      raise ValueError(
        f"malformed controller state: similarity_model must be a dict, got {state!r:.200}"
      )
    out: dict[str, Any] = {
      "count": validation.check_int("similarity model count", state["count"], 0)
    }
    for key in ("ema_similarity", "ema_noise"):
      value = state[key]
      if not validation.is_real(value) or not math.isfinite(float(value)):
        raise ValueError(f"similarity model {key} must be a finite number, got {value!r}")
      out[key] = float(value)
    return out

  def load_parsed_state(self, state: Mapping[str, Any]) -> None:
    """Adopts a state :meth:`parse_state` checked."""
    self._ema_similarity, self._ema_noise = state["ema_similarity"], state["ema_noise"]
    self._count = state["count"]
