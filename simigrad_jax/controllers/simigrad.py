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

Measurements every ``k``-th step (``measure_every``): the controller is
updated on the measuring steps only, and the batch size holds over the plain
steps between; its counters count updates (measurements). Two readings of a
measurement, chosen by ``steps_per_update``: 1 (the default) moves the rule
once per measurement, so the batch moves at ``1/k`` of the rule's rate per
optimizer step; ``k`` makes each update the decisions of ``k`` updates at
that similarity (:func:`compounded`: a grow to ``move^k(B)``, the model
rule's step towards ``B*`` capped at ``k`` of the reference's), so the rule
keeps its rate per optimizer step and rests each ``k``-fold move on one
similarity. ``k`` is the reading to use with ``measure_every=k``: it keeps
the run's steps and loss at ``k = 1``'s, where one move per measurement
grows the batch more slowly and, at larger ``k``, takes more steps; 1 stays
the default, the one value valid at every ``measure_every``.
docs/controllers.md, "Measuring every k-th step".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from simigrad_jax import validation
from simigrad_jax.controllers.base import BaseController
from simigrad_jax.controllers.profiling import ProfileMethods
from simigrad_jax.controllers.profiling import SimilarityProfile
from simigrad_jax.controllers.similarity_model import SimilarityModel

# A move of the rule: (grow?, the new size), or None to hold.
Move = tuple[bool, int] | None


def reference_move(batch_size: int, grow: bool) -> int:
  """SimiGrad's step from ``batch_size`` B: the one place its factors live.

  A grow goes to ``max(B + 1, int(B * 1.1))``, a shrink to
  ``max(1, min(B - 1, int(B * 0.9)))``. ``int(B * 1.1)`` is a Python float
  product truncated by ``int``, as in the reference, so size sequences match
  it bit for bit.

  Args:
    batch_size: the current global batch size B (an int >= 1).
    grow: grow (the similarity is below the target) or shrink.

  Returns:
    The new size, before the bounds.

  Example:
    >>> reference_move(100, True), reference_move(100, False), reference_move(5, True)
    (110, 90, 6)
  """
  if grow:
    return max(batch_size + 1, int(batch_size * 1.1))
  return max(1, min(batch_size - 1, int(batch_size * 0.9)))


def reference_step(batch_size: int, similarity: float, target: float, dead_band: float) -> Move:
  """The reference rule's move from this step's similarity (a shrink needs B > 1)."""
  if abs(similarity - target) <= dead_band:
    return None
  if similarity < target:
    return True, reference_move(batch_size, True)
  if batch_size > 1:
    return False, reference_move(batch_size, False)
  return None


def model_step(model: SimilarityModel, batch_size: int, target: float, dead_band: float) -> Move:
  """The model rule's move towards ``B*`` (at most the reference's step), None before any sample."""
  b = batch_size
  predicted, goal = model.similarity_at(b), model.batch_size_for(target)
  if predicted is None or goal is None:  # no observation yet
    return None
  if abs(predicted - target) <= dead_band:
    return None
  goal = goal if math.isinf(goal) else round(goal)
  if goal > b:  # goal may be inf: the reference's step is the finite bound
    return True, int(min(goal, reference_move(b, True)))
  if goal < b and b > 1:
    return False, int(max(goal, reference_move(b, False)))
  return None


def grow_move(batch_size: int) -> Move:
  """The reference's grow from ``batch_size``, whatever the similarity."""
  return True, reference_move(batch_size, True)


def shrink_move(batch_size: int) -> Move:
  """The reference's shrink from ``batch_size`` (a hold at 1), whatever the similarity."""
  return (False, reference_move(batch_size, False)) if batch_size > 1 else None


def hold_move(batch_size: int) -> Move:
  """No move (a similarity within the dead band)."""
  del batch_size
  return None


def smoothed(batch_size: int, move: Move, smooth_factor: float | None) -> int:
  """The size a move decides: blended with ``batch_size`` by ``smooth_factor`` f, if any,
  ``int(f * B + (1 - f) * new)``, keeping the move's direction (a grow is at least B + 1, a
  shrink at most B - 1); ``batch_size`` for None (hold)."""
  b = batch_size
  if move is None:
    return b
  grow, new = move
  if smooth_factor is not None:
    blended = b * smooth_factor + new * (1 - smooth_factor)
    new = max(b + 1, int(blended)) if grow else max(1, min(b - 1, int(blended)))
  return new


def compounded(
  batch_size: int,
  move_from: Callable[[int], Move],
  steps: int,
  smooth_factor: float | None,
  clamp: Callable[[int], int],
) -> int:
  """The size ``steps`` consecutive decisions of a one-step rule reach from ``batch_size``.

  Each decision is :func:`smoothed` from the size the one before it decided,
  brought within the bounds by ``clamp`` (as an update's size is); the last
  is returned as decided, for the caller to clamp and name. With ``steps=1``
  this is ``smoothed(batch_size, move_from(batch_size), smooth_factor)``,
  one move of the rule.

  Args:
    batch_size: the size the decisions start from.
    move_from: the rule's move from a size (:func:`reference_step` or
      :func:`model_step` with the similarity or model fixed): the same
      reading at every size, as ``steps`` updates with one similarity see it.
    steps: how many decisions (an int >= 1).
    smooth_factor: the controller's ``smooth_factor`` (None: unsmoothed).
    clamp: the controller's bounds.

  Returns:
    The last decision's size, before the bounds.

  Example:
    >>> grow = lambda b: (True, reference_move(b, True))
    >>> [compounded(100, grow, k, None, lambda b: min(b, 115)) for k in (1, 2, 3)]
    [110, 121, 126]
  """
  size = smoothed(batch_size, move_from(batch_size), smooth_factor)
  for _ in range(steps - 1):
    previous = clamp(size)
    size = smoothed(previous, move_from(previous), smooth_factor)
  return size


class Controller(ProfileMethods, BaseController):
  """Turns each step's gradient similarity into the next global batch size.

  This is SimiGrad's rule (see the module docstring for the reference): with
  the current global batch B and the similarity s measured at B,

  * s < similarity_target: B -> max(B + 1, int(B * 1.1))  (noisy: grow);
  * s > similarity_target and B > 1: B -> max(1, min(B - 1, int(B * 0.9)))
    (shrink);
  * otherwise B is kept; the result is clamped to the bounds.

  The step is :func:`reference_move`, bit for bit the reference's. Beyond
  the reference:
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
    steps_per_update: the optimizer steps each update stands for (an int
      >= 1). 1 (the default): one move of the rule per update. ``k``: the
      controller is updated on every ``k``-th step only (``measure_every=k``)
      and each update decides what ``k`` updates with its similarity would
      (:func:`compounded`), so the batch moves at the rule's rate per
      optimizer step: the value to use with ``measure_every=k``, which then
      changes what a step costs and not how many steps a run takes (one move
      per measurement grows the batch more slowly, and at larger ``k``
      takes more steps). ``warmup_steps`` and the profile
      still count updates. Saved in the config; :class:`simigrad_jax.Trainer`
      refuses a value other than 1 or its ``measure_every``.
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

    Before each update the Trainer asks :meth:`likely_batch_sizes` which sizes
    it may decide, to place the next step's rows ahead. The reference rule
    names its grow, then its shrink (smoothed and clamped, as :meth:`update`
    decides them for a similarity below and above the target), then, with a
    ``dead_band``, the size itself; the size alone in the warm-up or with
    ``enable_adjust`` off; a profile its next size, then the size itself (a
    non-finite step stays). The model rule names first what it decides if
    the step measures the similarity the model expects at B: the averages
    then keep their ratio, so ``B*`` stays where it is, and they move by
    ``1 - d`` of a sample a step, so that is the likeliest. Then the
    reference's grow and shrink, the farthest a surprising similarity moves it.
  """

  KIND = "simigrad"

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
    steps_per_update: int = 1,
    verbose: bool = False,
  ):
    self._target = validation.check_real(
      "similarity_target", similarity_target, "[-1, 1]", lambda x: -1.0 <= x <= 1.0
    )
    super().__init__(
      initial_batch_size,
      batch_size_lower_bound=batch_size_lower_bound,
      batch_size_upper_bound=batch_size_upper_bound,
      warmup_steps=warmup_steps,
      verbose=verbose,
    )
    self._enable_adjust = validation.check_bool("enable_adjust", enable_adjust)
    self._smooth = (
      None
      if smooth_factor is None
      else validation.check_real("smooth_factor", smooth_factor, "[0, 1)", lambda x: 0.0 <= x < 1.0)
    )
    self._dead_band = validation.check_real(
      "dead_band", dead_band, "[0, inf) (finite)", lambda x: 0.0 <= x < math.inf
    )
    self._steps_per_update = validation.check_int("steps_per_update", steps_per_update, 1)
    self._model = None if ema_decay is None else SimilarityModel(ema_decay)
    if self._model is not None and not 0.0 < self._target < 1.0:
      raise ValueError(
        f"ema_decay (the model rule) needs a similarity_target in (0, 1), got "
        f"{self._target!r}; the model reaches 0 and 1 only at B = 0 and B = inf"
      )
    # The profile in progress (which waits for the warm-up to end) and every sample so far.
    self._init_profile(batch_sizes_to_profile, profile_steps_per_size)

  # ---------------------------------------------------------------- read-only

  @property
  def noise_scale(self) -> float | None:
    """With ``ema_decay``: the model's ``B_simple`` (inf: noise dominates); else None."""
    return None if self._model is None else self._model.noise_scale

  @property
  def model_similarity(self) -> float | None:
    """With ``ema_decay``: the similarity the model predicts at :attr:`batch_size`; else None."""
    return None if self._model is None else self._model.similarity_at(self._batch_size)

  # ------------------------------------------------------------------ the rule

  def observe(self, similarity: float, stats: Mapping[str, Any] | None, finite: bool) -> bool:
    """Feeds the model (with ``ema_decay``); a step counts when it is finite.

    SimiGrad's rule reads the similarity alone; the other ``stats`` are
    ignored. A step is finite when its similarity is and its ``stats`` do
    not say ``grads_finite`` is False (``finite``, as :meth:`update` found).
    """
    del stats
    if not finite:
      return False
    if self._model is not None:
      self._model.observe(similarity, self._batch_size)  # Every finite step, at the size that ran.
    return True

  def decide(self) -> int | tuple[int, str]:
    """The next size: the profile's while one runs, else the rule's (with dead band and smoothing)."""
    similarity = self._last_similarity
    assert similarity is not None  # update() sets it before deciding
    if self._profile.active:
      if not self._profile.started:  # Waited for the warm-up; starts now.
        return self._profile.begin(self._batch_size), "profile"
      return self._profile.record(self._batch_size, similarity, self._step), "profile"
    if not self._enable_adjust:
      return self._batch_size, "disabled"
    target, band, model = self._target, self._dead_band, self._model
    if model is not None:
      return self._compounded(lambda b: model_step(model, b, target, band))
    return self._compounded(lambda b: reference_step(b, similarity, target, band))

  def likely_batch_sizes(self, examples_seen: int, epochs: float) -> list[int]:
    """The sizes the next update may decide, likeliest first (the class's Note says which)."""
    del examples_seen, epochs
    b = self._batch_size
    if self._holds_next() or (not self._enable_adjust and not self._profile.active):
      return [b]
    if self._profile.active:  # the profile's next size; a non-finite step stays
      return list(dict.fromkeys([self._profile.upcoming(), b]))
    moves: list[Callable[[int], Move]] = [grow_move, shrink_move]
    model = self._model
    if model is not None and model.count:  # first: the averages as they stand
      moves.insert(0, lambda size: model_step(model, size, self._target, self._dead_band))
    elif model is None and self._dead_band > 0:
      moves.append(hold_move)  # within the dead band: hold
    return list(dict.fromkeys(self._clamp(self._compounded(move)) for move in moves))

  def settings(self) -> dict[str, Any]:
    """SimiGrad's settings, for :attr:`config`."""
    return {
      "similarity_target": self._target,
      "enable_adjust": self._enable_adjust,
      "smooth_factor": self._smooth,
      "dead_band": self._dead_band,
      "warmup_steps": self._warmup,
      "ema_decay": None if self._model is None else self._model.decay,
      # Named only where it is not 1, so that configs and states saved before it compare the same.
      **({} if self._steps_per_update == 1 else {"steps_per_update": self._steps_per_update}),
    }

  # -------------------------------------------------------------- checkpoints

  def extra_state(self) -> dict[str, Any]:
    """The profile (mid-profile too) and the model's averages."""
    return {
      **self._profile.state_dict(),
      "similarity_model": None if self._model is None else self._model.state_dict(),
    }

  def parse_extra_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
    """The saved profile (replacing any the constructor started) and model, checked."""
    profile = SimilarityProfile.from_state(state, self._check_size)
    model = state.get("similarity_model")
    if (model is None) != (self._model is None):
      raise ValueError(
        f"the state {'lacks' if model is None else 'has'} a similarity model; this "
        f"controller {'uses' if self._model is not None else 'does not use'} ema_decay"
      )
    if model is not None and self._model is not None:  # both or neither, as checked
      parsed, model = SimilarityModel.parse_state(model), SimilarityModel(self._model.decay)
      model.load_parsed_state(parsed)
    return {"_profile": profile, "_model": model}

  def _check_saved_config(self, saved: Mapping[str, Any]) -> None:
    """Also refuses a state saved with ``steps_per_update`` into a controller without it."""
    theirs = saved.get("steps_per_update", 1)
    if theirs != self._steps_per_update:
      raise ValueError(
        f"state config differs from this controller's in: steps_per_update (saved {theirs!r}, "
        f"here {self._steps_per_update!r})"
      )
    super()._check_saved_config(saved)

  def _complete_old_state(self, state: Mapping[str, Any]) -> Mapping[str, Any]:
    """Older version-1 states lack the kind (before the shared base) and ema_decay (before the model)."""
    state = {"controller": self.KIND, **state}
    if isinstance(state.get("config"), Mapping):
      state["config"] = {"controller": self.KIND, "ema_decay": None, **state["config"]}
    return state

  # ---------------------------------------------------------------- internals

  def _compounded(self, move_from: Callable[[int], Move]) -> int:
    """The size ``steps_per_update`` decisions of ``move_from`` reach from the present size."""
    return compounded(
      self._batch_size, move_from, self._steps_per_update, self._smooth, self._clamp
    )

  def _profile_planned(self) -> None:
    if self._step >= self._warmup:
      self._batch_size = self._profile.begin(self._batch_size)

  def _log_details(self, before: int) -> str:
    details = f"target {self._target!r}"
    if self._model is not None:
      details += (
        f"; model: noise scale {self.noise_scale!r}, similarity at {before} "
        f"{self._model.similarity_at(before)!r}"
      )
    return details
