"""Host: SimiGrad's batch-size controller, run between optimizer steps.

Plain Python and NumPy; nothing here is traced. The in-graph side measures the
cosine similarity of the two half-batch gradients; this module turns that number
into the global batch size of the next optimizer step.

What the reference does (the SimiGrad fork of DeepSpeed, engine file, class
``DeepSpeedLight``, methods ``step`` and ``change_gradient_accumulation_steps``),
in our words:

* Rule: below the similarity target the batch grows to the larger of B + 1 and
  ``int(B * 1.1)``; above it (and B > 1) it shrinks to the smaller of B - 1 and
  ``int(B * 0.9)``, never below 1; an equal similarity keeps B. The result is
  clamped to the upper bound, then to the lower bound.
* ``smooth_factor`` f: no state is kept across steps. Each requested size T is
  blended once with the present value, ``int(f * present + (1 - f) * T)``, before
  clamping. Because the present value is itself the previous output, the size
  follows an exponential smoothing of the rule's targets. Two oddities that we do
  not copy: (1) the "present value" the reference blends with is the number of
  gradient-accumulation steps, not the global batch size, so the units only agree
  when workers x micro-batch is 1; (2) the truncation can leave a grow at B (for
  example B=10, f=0.5: int(10.5) = 10), so small batches stop growing. We blend
  in batch-size units and keep the rule's direction: a smoothed grow is at least
  B + 1 and a smoothed shrink at most B - 1. With f = 0 the sequence is exactly
  the unsmoothed reference. The reference also applies the blend to the sizes
  it profiles and to the size it restores afterwards; we visit and restore the
  exact sizes.
* ``batch_sizes_to_profile``: every adaptive step records the similarity
  measured at the current size in a dict keyed by batch size (last value wins).
  While the list is non-empty, a step remembers the pre-profile size (on the
  first such step) and switches to the next size taken off the END of the list
  (so sizes are visited in reverse order, one step each); the rule is not
  applied meanwhile. On the step after the last size, it restores the
  remembered size, writes the dict (profiled and ordinary sizes alike) to
  ``batch_size_profiled{i}.npy``, empties it and resumes adapting. Profiling only
  happens when ``enable_adjust`` is on. We visit sizes in the order given,
  ``profile_steps_per_size`` steps each, keep every sample (not only the last
  per size), profile whether or not ``enable_adjust`` is on, and save JSON on
  request (:meth:`Controller.save_profile`).
* The adaptive state is saved in the reference's checkpoints; here
  :meth:`Controller.state_dict` / :meth:`Controller.load_state_dict`.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from simigrad_jax import validation
from simigrad_jax.controllers.similarity_model import SimilarityModel

logger = logging.getLogger("simigrad_jax")

STATE_VERSION = 1
DECISIONS: tuple[str, ...] = (
    "grow", "shrink", "hold", "clamped", "warmup", "disabled", "profile",
    "nonfinite")


class BoundedBatchSize:
  """What every controller shares: a batch size within optional bounds, and its counters.

  Holds the validated bounds, B_0, the current size, the update count, the
  non-finite count and the last decision and similarity; gives them as
  read-only properties, and :meth:`set_batch_size`. Subclasses call
  :meth:`_init_bounded_batch_size` first and keep ``_batch_size``,
  ``_step``, ``_nonfinite``, ``_last_decision`` and ``_last_similarity`` up
  to date in ``update``.
  """

  def _init_bounded_batch_size(self, initial_batch_size: Any, lower: Any, upper: Any) -> None:
    self._lower = None if lower is None else validation.check_int(
        "batch_size_lower_bound", lower, 1)
    self._upper = None if upper is None else validation.check_int(
        "batch_size_upper_bound", upper, 1)
    if None not in (self._lower, self._upper) and self._lower > self._upper:
      raise ValueError(
          f"batch_size_lower_bound ({self._lower}) must not exceed "
          f"batch_size_upper_bound ({self._upper})")
    self._initial = self._check_size("initial_batch_size", initial_batch_size)
    self._batch_size = self._initial
    self._step = 0
    self._nonfinite = 0
    self._last_decision: str | None = None
    self._last_similarity: float | None = None

  @property
  def batch_size(self) -> int:
    """The global batch size to use for the next optimizer step."""
    return self._batch_size

  @property
  def initial_batch_size(self) -> int:
    """B_0, the size the learning rate is tuned for."""
    return self._initial

  @property
  def step(self) -> int:
    """The number of :meth:`update` calls so far."""
    return self._step

  @property
  def nonfinite_count(self) -> int:
    """How many updates were non-finite (and kept the size)."""
    return self._nonfinite

  @property
  def last_decision(self) -> str | None:
    """Why the last update kept or moved the size (one of the module's ``DECISIONS``)."""
    return self._last_decision

  @property
  def last_similarity(self) -> float | None:
    """The similarity passed to the last update (None before the first)."""
    return self._last_similarity

  def set_batch_size(self, batch_size: int) -> None:
    """Adopts a batch size chosen elsewhere (e.g. the size a plan realised).

    Args:
      batch_size: an integer >= 1 within the bounds.
    """
    self._batch_size = self._check_size("batch_size", batch_size)

  def _check_saved_config(self, saved: Mapping[str, Any]) -> None:
    """Raises a ValueError naming every setting in which a saved ``config`` differs from ours."""
    ours = self.config
    differing = [k for k in ours if saved.get(k, "<missing>") != ours[k]]
    if differing:
      details = ", ".join(f"{k} (saved {saved.get(k, '<missing>')!r}, here {ours[k]!r})"
                          for k in differing)
      raise ValueError(f"state config differs from this controller's in: {details}")

  def _parse_counters(self, state: Mapping[str, Any],
                      decisions: tuple[str, ...]) -> tuple[int, int, int, str | None]:
    """A saved state's ``(batch_size, step, nonfinite_count, last_decision)``, checked.

    Raises ValueError for a value out of range, KeyError or TypeError for a
    malformed state.
    """
    batch_size = self._check_size("batch_size", state["batch_size"])
    step = validation.check_int("step", state["step"], 0)
    nonfinite = validation.check_int("nonfinite_count", state["nonfinite_count"], 0)
    decision = state["last_decision"]
    if decision is not None and decision not in decisions:
      raise ValueError(f"last_decision must be one of {decisions}, got {decision!r}")
    return batch_size, step, nonfinite, decision

  def _check_size(self, name: str, value: Any) -> int:
    size = validation.check_int(name, value, 1)
    lower = 1 if self._lower is None else self._lower
    upper = math.inf if self._upper is None else self._upper
    if not lower <= size <= upper:
      raise ValueError(
          f"{name} must lie within [batch_size_lower_bound, "
          f"batch_size_upper_bound] = [{lower}, {upper}], got {size}")
    return size


class Controller(BoundedBatchSize):
  """Turns each step's gradient similarity into the next global batch size.

  This is SimiGrad's rule (see the module docstring for the reference): with
  the current global batch B and the similarity s measured at B,

  * s < similarity_target: B -> max(B + 1, int(B * 1.1))  (noisy: grow);
  * s > similarity_target and B > 1: B -> max(1, min(B - 1, int(B * 0.9)))
    (shrink);
  * otherwise B is kept; the result is clamped to the bounds.

  ``int(B * 1.1)`` is a Python float product truncated by ``int``, as in the
  reference, so size sequences match it bit for bit. Beyond the reference:
  ``dead_band`` (hysteresis), ``warmup_steps``, non-finite similarities held
  and counted, profiling for several steps per size, exact save/resume and,
  with ``ema_decay``, a rule that acts on a moving average instead of each
  step's similarity (below).

  Args:
    initial_batch_size: the global batch size of the first step (B_0).
    similarity_target: the cosine similarity to hold, in [-1, 1].
    batch_size_lower_bound: optional smallest batch size (integer >= 1).
    batch_size_upper_bound: optional largest batch size (integer >= lower).
    enable_adjust: if False the batch size stays fixed (similarities are still
      counted); profiling still runs when asked for.
    smooth_factor: optional f in [0, 1): each rule step is blended with the
      present size, ``int(f * B + (1 - f) * B_rule)``, keeping the rule's
      direction (a grow is at least B + 1, a shrink at most B - 1).
    dead_band: no change while ``|s - similarity_target| <= dead_band``; 0 is
      the reference's behaviour.
    warmup_steps: the first this many updates never change the batch size.
    ema_decay: None (the reference rule, the default) or d in [0, 1): the
      model rule. Every finite similarity, measured at whatever size, feeds a
      :class:`~simigrad_jax.controllers.similarity_model.SimilarityModel` (moving
      averages with decay d of s and of B (1 - s), whose ratio gives the noise
      scale ``B_simple``), and the batch moves towards the size where the
      model predicts the target, ``B* = 2 t / (1 - t) B_simple``: by at most
      the reference's step (to ``max(B + 1, int(B * 1.1))`` or
      ``min(B - 1, int(B * 0.9))``), by less when B* is nearer, not at all
      when ``round(B*) == B``. ``dead_band`` then compares the model's
      similarity at B with the target. Needs a target in (0, 1).
    batch_sizes_to_profile: optional sizes to visit first (see
      :meth:`start_profile`); starts at once, or after the warm-up.
    profile_steps_per_size: steps spent at each profiled size.
    verbose: log each decision (logger ``"simigrad_jax"``, level INFO).

  Example:
    >>> c = Controller(128, similarity_target=0.1, batch_size_upper_bound=1024)
    >>> c.update(0.05)  # noisier than the target: grow
    140
    >>> c.update(0.3)  # cleaner than the target: shrink
    126
    >>> c.last_decision
    'shrink'

  Note:
    The controller decides sizes only; realising them (workers x micro-batch
    x accumulation, bucket grids) happens elsewhere. If that realises a
    different size than asked for, report it back with :meth:`set_batch_size`
    so the next rule step starts from the size that actually ran.
  """

  def __init__(
      self,
      initial_batch_size: int,
      similarity_target: float,
      *,
      batch_size_lower_bound: int | None = None,
      batch_size_upper_bound: int | None = None,
      enable_adjust: bool = True,
      smooth_factor: float | None = None,
      dead_band: float = 0.0,
      warmup_steps: int = 0,
      ema_decay: float | None = None,
      batch_sizes_to_profile: Sequence[int] | None = None,
      profile_steps_per_size: int = 1,
      verbose: bool = False,
  ):
    self._target = validation.check_real(
        "similarity_target", similarity_target, "[-1, 1]",
        lambda x: -1.0 <= x <= 1.0)
    self._init_bounded_batch_size(initial_batch_size, batch_size_lower_bound,
                                  batch_size_upper_bound)
    self._enable_adjust = validation.check_bool("enable_adjust", enable_adjust)
    self._smooth = None if smooth_factor is None else validation.check_real(
        "smooth_factor", smooth_factor, "[0, 1)", lambda x: 0.0 <= x < 1.0)
    self._dead_band = validation.check_real(
        "dead_band", dead_band, "[0, inf) (finite)",
        lambda x: 0.0 <= x < math.inf)
    self._warmup = validation.check_int("warmup_steps", warmup_steps, 0)
    self._model = None if ema_decay is None else SimilarityModel(ema_decay)
    if self._model is not None and not 0.0 < self._target < 1.0:
      raise ValueError(f"ema_decay (the model rule) needs a similarity_target in (0, 1), got "
                       f"{self._target!r}; the model reaches 0 and 1 only at B = 0 and B = inf")
    self._verbose = validation.check_bool("verbose", verbose)
    # The profile in progress: {"sizes", "steps_per_size", "position",
    # "count", "return_to"}; return_to is None while it waits for warm-up.
    self._plan: dict[str, Any] | None = None
    self._samples: list[dict[str, Any]] = []
    if batch_sizes_to_profile is not None:
      self.start_profile(batch_sizes_to_profile, profile_steps_per_size)
    else:
      validation.check_int("profile_steps_per_size", profile_steps_per_size, 1)

  # ---------------------------------------------------------------- read-only

  @property
  def profiling(self) -> bool:
    """Whether a profile is in progress or waiting for the warm-up to end."""
    return self._plan is not None

  @property
  def profile(self) -> list[dict[str, Any]]:
    """Every profile sample so far: ``{"batch_size", "similarity", "step"}``.

    ``step`` is the :attr:`step` count of the update that measured it.
    """
    return [dict(s) for s in self._samples]

  @property
  def config(self) -> dict[str, Any]:
    """The settings that determine future sizes (plain JSON data)."""
    return {
        "initial_batch_size": self._initial,
        "similarity_target": self._target,
        "batch_size_lower_bound": self._lower,
        "batch_size_upper_bound": self._upper,
        "enable_adjust": self._enable_adjust,
        "smooth_factor": self._smooth,
        "dead_band": self._dead_band,
        "warmup_steps": self._warmup,
        "ema_decay": None if self._model is None else self._model.decay,
    }

  @property
  def noise_scale(self) -> float | None:
    """With ``ema_decay``: the model's ``B_simple`` (inf: noise dominates); else None."""
    return None if self._model is None else self._model.noise_scale

  @property
  def model_similarity(self) -> float | None:
    """With ``ema_decay``: the similarity the model predicts at :attr:`batch_size`; else None."""
    return None if self._model is None else self._model.similarity_at(self._batch_size)

  # ------------------------------------------------------------------ actions

  def update(self, similarity: float, stats: Mapping[str, Any] | None = None) -> int:
    """Takes the similarity measured at this step; returns the next batch size.

    Call once after every optimizer step, with the similarity measured at the
    current :attr:`batch_size`. Non-finite values keep the size and are
    counted in :attr:`nonfinite_count`.

    Args:
      similarity: the cosine similarity of the two half-batch gradients (any
        value ``float()`` accepts: Python, NumPy or 0-d JAX scalars).
      stats: the step's other measurements (loss, half norms, ...), which
        :class:`simigrad_jax.Trainer` passes to every controller; SimiGrad's
        rule uses the similarity alone and ignores them.

    Returns:
      The batch size for the next step (also :attr:`batch_size`).
    """
    del stats
    s = float(similarity)
    self._step += 1
    self._last_similarity = s
    before = self._batch_size
    finite = math.isfinite(s)
    if finite and self._model is not None:
      self._model.observe(s, before)  # Measured at the size that ran: every finite step counts.
    if not finite:
      self._nonfinite += 1
      decision = "nonfinite"
    elif self._step <= self._warmup:
      decision = "warmup"
    elif self._plan is not None:
      self._advance_profile(s)
      decision = "profile"
    elif not self._enable_adjust:
      decision = "disabled"
    else:
      decision = self._adapt(s)
    self._last_decision = decision
    if self._verbose:
      model = "" if self._model is None else (
          f" (model: noise scale {self.noise_scale!r}, similarity at {before} "
          f"{self._model.similarity_at(before)!r})")
      logger.info(
          "simigrad step %d: similarity %r (target %r): %s, batch size %d -> %d%s",
          self._step, s, self._target, decision, before, self._batch_size, model)
    return self._batch_size

  def start_profile(
      self, batch_sizes: Sequence[int], steps_per_size: int = 1) -> None:
    """Visits each size in turn, recording the similarity measured there.

    The next step runs at ``batch_sizes[0]`` (or, during the warm-up, the first
    step after it does; the similarity that update receives, measured at the
    previous size, is not used). After ``steps_per_size`` finite
    samples at each size the controller returns to the size it had before and
    resumes adapting. Samples go to :attr:`profile`; non-finite similarities are
    not samples, so the size is kept until enough finite ones arrive.

    Args:
      batch_sizes: a non-empty sequence of integers >= 1 within the bounds,
        visited in this order (the reference visits its list in reverse).
      steps_per_size: the number of samples taken at each size (>= 1).

    Raises:
      ValueError: for an empty list or a size out of range.
      RuntimeError: if a profile is already in progress.
    """
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(
        batch_sizes, (Sequence, np.ndarray)) or len(batch_sizes) == 0:
      raise ValueError(
          "batch_sizes_to_profile must be a non-empty sequence of batch sizes, "
          f"got {batch_sizes!r}")
    sizes = [
        self._check_size(f"batch_sizes_to_profile[{i}]", b)
        for i, b in enumerate(batch_sizes)]
    steps_per_size = validation.check_int("profile_steps_per_size", steps_per_size, 1)
    if self._plan is not None:
      raise RuntimeError(
          f"a profile of {self._plan['sizes']} is already in progress")
    self._plan = {"sizes": sizes, "steps_per_size": steps_per_size,
                  "position": 0, "count": 0, "return_to": None}
    if self._step >= self._warmup:
      self._begin_profile()

  def profile_summary(self) -> dict[int, dict[str, float | int]]:
    """Per profiled batch size: ``{"mean", "std", "count"}`` of similarities.

    ``std`` is the population standard deviation (0 for a single sample).
    Sizes are in increasing order.
    """
    by_size: dict[int, list[float]] = {}
    for sample in self._samples:
      by_size.setdefault(sample["batch_size"], []).append(sample["similarity"])
    summary = {}
    for size in sorted(by_size):
      values = np.asarray(by_size[size], dtype=np.float64)
      summary[size] = {"mean": float(values.mean()), "std": float(values.std()),
                       "count": int(values.size)}
    return summary

  def save_profile(self, path: str | os.PathLike) -> None:
    """Writes the profile samples and their summary to ``path`` as JSON.

    The file holds ``{"version", "similarity_target", "samples", "summary"}``;
    summary keys are the batch sizes as strings (JSON keys are strings).
    """
    data = {
        "version": STATE_VERSION,
        "similarity_target": self._target,
        "samples": self.profile,
        "summary": {str(b): v for b, v in self.profile_summary().items()},
    }
    with open(path, "w", encoding="utf-8") as f:
      json.dump(data, f, indent=2)

  # -------------------------------------------------------------- checkpoints

  def state_dict(self) -> dict[str, Any]:
    """Returns the controller's state as plain JSON data.

    Loading it into a controller built with the same settings continues the
    run exactly: same sizes, same decisions, same profile, mid-profile too.
    """
    return {
        "version": STATE_VERSION,
        "config": self.config,
        "batch_size": self._batch_size,
        "step": self._step,
        "nonfinite_count": self._nonfinite,
        "last_decision": self._last_decision,
        "profile_plan": None if self._plan is None else {
            **self._plan, "sizes": list(self._plan["sizes"])},
        "profile": self.profile,
        "similarity_model": None if self._model is None else self._model.state_dict(),
    }

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restores a state from :meth:`state_dict` (e.g. after ``json.loads``).

    All dynamic state is replaced, including any profile the constructor
    started. Nothing changes if the state is refused.

    Args:
      state: the dict :meth:`state_dict` returned.

    Raises:
      ValueError: for an unknown version, a ``config`` section that differs
        from this controller's settings (the message names the keys; drop the
        section to load anyway), or a malformed or out-of-bounds state.
    """
    if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
      got = state.get("version") if isinstance(state, Mapping) else state
      raise ValueError(
          f"state version must be {STATE_VERSION}, got {got!r}")
    if state.get("config") is not None:
      # States saved before ema_decay existed used the reference rule.
      self._check_saved_config({"ema_decay": None, **state["config"]})
    try:
      batch_size, step, nonfinite, decision = self._parse_counters(state, DECISIONS)
      plan = state["profile_plan"]
      if plan is not None:
        plan = {
            "sizes": [self._check_size("profile size", b) for b in plan["sizes"]],
            "steps_per_size": validation.check_int(
                "steps_per_size", plan["steps_per_size"], 1),
            "position": validation.check_int("position", plan["position"], 0),
            "count": validation.check_int("count", plan["count"], 0),
            "return_to": None if plan["return_to"] is None else self._check_size(
                "return_to", plan["return_to"]),
        }
        if plan["position"] >= len(plan["sizes"]):
          raise ValueError(f"profile position {plan['position']} is past the end")
      samples = [
          {"batch_size": validation.check_int("sample batch_size", s["batch_size"], 1),
           "similarity": float(s["similarity"]),
           "step": validation.check_int("sample step", s["step"], 1)}
          for s in state["profile"]]
      model = state.get("similarity_model")
      if (model is None) != (self._model is None):
        raise ValueError(
            f"the state {'lacks' if model is None else 'has'} a similarity model; this "
            f"controller {'uses' if self._model is not None else 'does not use'} ema_decay")
      model = None if model is None else SimilarityModel.parse_state(model)
    except (KeyError, TypeError) as e:
      raise ValueError(f"malformed controller state: {e!r}") from e
    self._batch_size, self._step, self._nonfinite = batch_size, step, nonfinite
    self._last_decision, self._last_similarity = decision, None
    self._plan, self._samples = plan, samples
    if model is not None:
      self._model.load_parsed_state(model)

  # ---------------------------------------------------------------- internals

  def _adapt(self, s: float) -> str:
    """Applies the rule (with dead band, smoothing, bounds); returns why."""
    b = self._batch_size
    step = self._model_step() if self._model is not None else self._reference_step(s)
    if step is None:
      return "hold"
    grow, new = step
    if self._smooth is not None:
      blended = b * self._smooth + new * (1 - self._smooth)
      new = max(b + 1, int(blended)) if grow else max(1, min(b - 1, int(blended)))
    clamped = new
    if self._upper is not None:
      clamped = min(clamped, self._upper)
    if self._lower is not None:
      clamped = max(clamped, self._lower)
    self._batch_size = clamped
    if clamped != new:
      return "clamped"
    return "grow" if grow else "shrink"

  def _reference_step(self, s: float) -> tuple[bool, int] | None:
    """The reference's step from this step's similarity: (grow?, new size), or None to hold."""
    b = self._batch_size
    if abs(s - self._target) <= self._dead_band:
      return None
    if s < self._target:
      return True, max(b + 1, int(b * 1.1))
    if b > 1:
      return False, max(1, min(b - 1, int(b * 0.9)))
    return None

  def _model_step(self) -> tuple[bool, int] | None:
    """The model rule's step towards ``B*`` (at most the reference's step), or None to hold."""
    b = self._batch_size
    if abs(self._model.similarity_at(b) - self._target) <= self._dead_band:
      return None
    goal = self._model.batch_size_for(self._target)
    goal = goal if math.isinf(goal) else round(goal)
    if goal > b:
      return True, min(goal, max(b + 1, int(b * 1.1)))
    if goal < b and b > 1:
      return False, max(goal, 1, min(b - 1, int(b * 0.9)))
    return None

  def _begin_profile(self) -> None:
    self._plan["return_to"] = self._batch_size
    self._batch_size = self._plan["sizes"][0]

  def _advance_profile(self, s: float) -> None:
    plan = self._plan
    if plan["return_to"] is None:  # Waited for the warm-up; starts now.
      self._begin_profile()
      return
    self._samples.append(
        {"batch_size": self._batch_size, "similarity": s, "step": self._step})
    plan["count"] += 1
    if plan["count"] < plan["steps_per_size"]:
      return
    plan["position"] += 1
    plan["count"] = 0
    if plan["position"] < len(plan["sizes"]):
      self._batch_size = plan["sizes"][plan["position"]]
    else:
      self._batch_size = plan["return_to"]
      self._plan = None
