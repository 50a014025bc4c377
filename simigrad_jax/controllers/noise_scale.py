"""Host: the gradient-noise-scale controller (McCandlish et al. 2018), registered as ``"gns"``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from simigrad_jax import validation
from simigrad_jax.controllers.base import BaseController
from simigrad_jax.controllers.state import check_finite_float


def noise_scale_estimates(
  norm_a: float, norm_b: float, norm_mean: float, batch_size: float
) -> tuple[float, float]:
  """One step's unbiased estimates of |G|^2 and tr(Sigma) from the half-batch norms.

  McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training",
  appendix A.1): with gradients measured at a small batch b and a big batch B,
  ``E|g_b|^2 = |G|^2 + tr(Sigma) / b``, so

  * ``|G|^2 ~ (B |g_B|^2 - b |g_b|^2) / (B - b)``,
  * ``tr(Sigma) ~ (|g_b|^2 - |g_B|^2) / (1/b - 1/B)``.

  Here B is the global batch, b = B / 2 the half batch, ``|g_b|^2`` the mean
  of the two halves' squared norms ``(|g_A|^2 + |g_B|^2) / 2`` and ``|g_B|^2``
  the full mean's squared norm. With b = B / 2 these reduce to
  ``|G|^2 ~ 2 |g_B|^2 - |g_b|^2`` and ``tr(Sigma) ~ B (|g_b|^2 - |g_B|^2)``.

  Args:
    norm_a: |g_A|, the norm of the first half's mean gradient.
    norm_b: |g_B|, the norm of the second half's mean gradient.
    norm_mean: the norm of the full mean gradient ``(g_A + g_B) / 2``.
    batch_size: the realised global batch size B (> 1).

  Returns:
    ``(g2, trace)``: the estimates of |G|^2 and tr(Sigma). Either can be
    negative on a single step; average them over steps before dividing. A
    NaN or infinite norm (a step without a finite gradient) gives non-finite
    estimates, which :class:`GnsController` never averages.

  Raises:
    ValueError: naming the argument, for a norm that is not a number >= 0
      (NaN and the infinities taken) or a batch size that is not a finite
      number > 1 (a bool is neither; NumPy's numbers and 0-d arrays are taken
      as Python's).

  Note:
    When the halves' row counts differ (B not a multiple of the device count),
    the trainer still divides each half's sum by B / 2; the tr(Sigma) estimate
    stays unbiased and the |G|^2 estimate is biased up by ``(2d / B)^2`` of
    |G|^2 for a difference of 2d rows, e.g. 4% for 12 and 8 rows.
  """
  big = validation.as_real(batch_size)
  if big is None or not 1.0 < big < math.inf:  # NaN fails too
    raise ValueError(
      f"batch_size must be a finite number > 1 (the global batch B, whose halves hold B / 2 "
      f"examples each), got {batch_size!r}"
    )
  norms = {"norm_a": norm_a, "norm_b": norm_b, "norm_mean": norm_mean}
  for name, norm in norms.items():
    number = validation.as_real(norm)
    # NaN and the infinities pass, as in the controller's stats: a step without a measurement.
    if number is None or (number < 0 and not math.isinf(number)):
      raise ValueError(
        f"{name} must be a norm, a number >= 0 (NaN or inf: a step without a finite gradient), "
        f"got {norm!r}"
      )
  small = big / 2.0
  g_small = (float(norm_a) ** 2 + float(norm_b) ** 2) / 2.0
  g_big = float(norm_mean) ** 2
  g2 = (big * g_big - small * g_small) / (big - small)
  trace = (g_small - g_big) / (1.0 / small - 1.0 / big)
  return g2, trace


def paced(size: int, new: float, max_change: float | None) -> int:
  """``new`` (may be inf) moved to within one step of ``max_change`` from ``size``.

  Growing, at most to ``max(size + 1, int(size * max_change))``; shrinking, at
  least to ``min(size - 1, ceil(size / max_change))`` (and 1); None: any
  distance (``new`` must then be finite).

  Example:
    >>> paced(16, 100.0, 2.0), paced(16, 3.0, 2.0), paced(16, 20.0, None)
    (32, 8, 20)
  """
  if max_change is not None:
    if new > size:
      new = min(new, max(size + 1, int(size * max_change)))
    elif new < size:
      new = max(new, min(size - 1, math.ceil(size / max_change)), 1)
  return int(new)


def check_pacing(max_change: Any, batch_size_lower_bound: Any) -> float | None:
  """A noise-scale controller's ``max_change`` (None or > 1), checked with its lower bound (>= 2).

  Raises:
    ValueError: naming the value and the valid range.
  """
  if batch_size_lower_bound is not None:
    validation.check_int("batch_size_lower_bound", batch_size_lower_bound, 2)
  if max_change is None:
    return None
  return validation.check_real("max_change", max_change, "(1, inf)", lambda x: 1.0 < x < math.inf)


class GnsController(BaseController):
  """Keeps the batch size near a multiple of the gradient noise scale.

  The simple noise scale of McCandlish et al. 2018 is
  ``B_simple = tr(Sigma) / |G|^2``, with Sigma the per-example gradient
  covariance and G the true gradient; training is most efficient in examples
  and in steps together around ``B ~ B_simple`` (their B_crit). Each step, the
  controller estimates ``|G|^2`` and ``tr(Sigma)`` from the half-batch norms
  (:func:`noise_scale_estimates`), smooths each with an exponential moving
  average (as the paper's appendix recommends: the ratio of averages, not the
  average of ratios, since single-step estimates are noisy and can be
  negative),

    ``S_t = d S_{t-1} + (1 - d) trace_t``,  ``G_t = d G_{t-1} + (1 - d) g2_t``,
    ``B_simple = S_t / G_t``,

  and moves the batch to ``round(multiple * B_simple)``, at most by a factor
  ``max_change`` per step, within the bounds. ``G_t <= 0`` (noise dominates)
  counts as an infinite noise scale (grow as far as allowed) and ``S_t <= 0``
  as zero (shrink as far as allowed).

  Relation to SimiGrad: with E[cos] ~ |G|^2 / (|G|^2 + 2 tr(Sigma) / B)
  (SPEC.md), holding the similarity at s holds ``B ~ 2 s / (1 - s) B_simple``,
  so the multiple m corresponds to the similarity target ``m / (2 + m)``
  (e.g. s = 0.1 ~ m = 0.22, s = 0.2 ~ m = 0.5, s = 1/3 ~ m = 1).

  Args:
    initial_batch_size: B_0, the size of the first steps.
    multiple: m > 0, the multiple of the noise scale to hold.
    ema_decay: d in [0, 1), the moving averages' decay per step (0: no
      smoothing). The averages start at zero and are bias-corrected
      (divided by ``1 - d^t``), which cancels in the ratio.
    max_change: optional factor > 1: per step the size changes at most to
      ``max(B + 1, int(B * max_change))`` when growing and to
      ``min(B - 1, ceil(B / max_change))`` when shrinking; None jumps straight
      to the target.
    batch_size_lower_bound: optional smallest batch size (integer >= 2; the
      halves must both hold examples).
    batch_size_upper_bound: optional largest batch size.
    warmup_steps: the first this many updates never change the size (the
      averages still learn).
    verbose: log each decision (logger ``"simigrad_jax"``, level INFO).

  Note:
    Needs ``stats`` with ``norm_a``, ``norm_b``, ``norm_mean`` and
    ``batch_size`` (the realised size) in :meth:`update`
    (:class:`simigrad_jax.Trainer` passes them). A step with a non-finite
    norm, a NaN similarity (a half without a measurable gradient) or a batch
    below 2 leaves the averages alone, keeps the size and is counted in
    ``nonfinite_count``. The noise scale an unbounded controller chases can be
    infinite: with no ``batch_size_upper_bound`` and no ``max_change``, an
    infinite estimate holds the size. A negative norm, which no measurement
    gives, is refused (``ValueError``, :func:`simigrad_jax.controllers.base.check_stats`).
  """

  KIND = "gns"
  REQUIRED_STATS = ("norm_a", "norm_b", "norm_mean", "batch_size")

  def __init__(
    self,
    initial_batch_size: int,
    multiple: float = 1.0,
    *,
    ema_decay: float = 0.9,
    max_change: float | None = 2.0,
    batch_size_lower_bound: int | None = None,
    batch_size_upper_bound: int | None = None,
    warmup_steps: int = 0,
    verbose: bool = False,
  ):
    self._multiple = validation.check_real(
      "multiple", multiple, "(0, inf)", lambda x: 0.0 < x < math.inf
    )
    self._decay = validation.check_real("ema_decay", ema_decay, "[0, 1)", lambda x: 0.0 <= x < 1.0)
    self._max_change = check_pacing(max_change, batch_size_lower_bound)
    super().__init__(
      initial_batch_size,
      batch_size_lower_bound=batch_size_lower_bound,
      batch_size_upper_bound=batch_size_upper_bound,
      warmup_steps=warmup_steps,
      verbose=verbose,
    )
    self._ema_trace = 0.0
    self._ema_g2 = 0.0
    self._ema_count = 0
    self._last_estimates: tuple[float, float] | None = None

  @property
  def trace_estimate(self) -> float | None:
    """The bias-corrected moving average of tr(Sigma) (None before a measurement)."""
    return None if self._ema_count == 0 else self._ema_trace / self._debias()

  @property
  def g2_estimate(self) -> float | None:
    """The bias-corrected moving average of |G|^2 (None before a measurement)."""
    return None if self._ema_count == 0 else self._ema_g2 / self._debias()

  @property
  def noise_scale(self) -> float | None:
    """B_simple = tr(Sigma) / |G|^2 from the moving averages (inf if |G|^2 <= 0, 0 if tr <= 0)."""
    if self._ema_count == 0:
      return None
    if self._ema_g2 <= 0:
      return math.inf
    return max(self._ema_trace, 0.0) / self._ema_g2

  @property
  def target_batch_size(self) -> float | None:
    """``multiple * noise_scale`` (before rounding, pacing and bounds)."""
    scale = self.noise_scale
    return None if scale is None else self._multiple * scale

  def _debias(self) -> float:
    return 1.0 - self._decay**self._ema_count

  def observe(
    self, similarity: float, stats: Mapping[str, Any] | None, finite: bool
  ) -> bool | None:
    assert stats is not None  # update() refuses a step without the REQUIRED_STATS
    if not finite:
      return False
    values = [stats[k] for k in ("norm_a", "norm_b", "norm_mean", "batch_size")]
    if not all(validation.is_real(v) and math.isfinite(float(v)) for v in values):
      return False
    if float(stats["batch_size"]) < 2:
      return False
    g2, trace = noise_scale_estimates(*values)
    if not (math.isfinite(g2) and math.isfinite(trace)):
      return False
    d = self._decay
    self._ema_trace = d * self._ema_trace + (1.0 - d) * trace
    self._ema_g2 = d * self._ema_g2 + (1.0 - d) * g2
    self._ema_count += 1
    self._last_estimates = (g2, trace)
    return True

  def decide(self) -> int:
    b = self._batch_size
    target = self.target_batch_size
    if target is None:  # no estimate yet
      return b
    if math.isinf(target):
      if self._max_change is None:
        return b if self._upper is None else self._upper
      new: float = math.inf
    else:
      new = max(int(round(target)), 1)
    return self._paced(new)

  def likely_batch_sizes(self, examples_seen: int, epochs: float) -> list[int]:
    """What the averages as they stand decide: the likeliest next size.

    A step whose estimates are what the averages expect keeps their ratio,
    the noise scale, and one step moves each average by ``1 - ema_decay`` of
    a sample, so the size they decide now is the likeliest; naming the
    farthest a step can go as well (``max_change``) would load that many
    rows ahead every step. Before the first estimate, which may move the
    size anywhere within one step, the farthest it can go either way; the
    size itself during the warm-up.
    """
    del examples_seen, epochs
    if self._holds_next():
      return [self._batch_size]
    if self._ema_count == 0 and self._max_change is not None:
      sizes = [self._paced(math.inf), self._paced(1)]
    else:
      sizes = [self.decide()]
    return list(dict.fromkeys(self._clamp(size) for size in sizes))

  def _paced(self, new: float) -> int:
    return paced(self._batch_size, new, self._max_change)

  def settings(self) -> dict[str, Any]:
    return {
      "multiple": self._multiple,
      "ema_decay": self._decay,
      "max_change": self._max_change,
      "warmup_steps": self._warmup,
    }

  def extra_state(self) -> dict[str, Any]:
    return {"ema_trace": self._ema_trace, "ema_g2": self._ema_g2, "ema_count": self._ema_count}

  def parse_extra_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
    return {
      "_ema_trace": check_finite_float("ema_trace", state["ema_trace"]),
      "_ema_g2": check_finite_float("ema_g2", state["ema_g2"]),
      "_ema_count": validation.check_int("ema_count", state["ema_count"], 0),
      "_last_estimates": None,
    }

  def _log_details(self, before: int) -> str:
    return f"noise scale {self.noise_scale}, target {self.target_batch_size}"
