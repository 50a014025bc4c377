"""Host: similarity-versus-batch-size profiles, for any controller.

A profile visits a list of batch sizes, a few steps each, records the
similarity measured at each, then returns to the size it started from: a
picture of how the gradient noise depends on the batch at this point of
training (the reference's ``batch_sizes_to_profile``).

* :class:`SimilarityProfile` is the plan and the record (plain data, no
  controller).
* :class:`ProfilingController` wraps any controller with a profile.
* :class:`ProfileMethods` gives both it and :class:`simigrad_jax.Controller`
  (``batch_sizes_to_profile=``) the same methods: :meth:`start_profile`,
  :attr:`profiling`, :attr:`profile`, :meth:`profile_summary`,
  :meth:`save_profile`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from simigrad_jax import files
from simigrad_jax import validation
from simigrad_jax.controllers import interface
from simigrad_jax.controllers.base import check_similarity
from simigrad_jax.controllers.base import check_stats
from simigrad_jax.controllers.base import step_is_finite
from simigrad_jax.controllers.base import unmeasured_but_finite
from simigrad_jax.controllers.interface import BatchSizeController
from simigrad_jax.controllers.interface import ProfilesBatchSizes
from simigrad_jax.controllers.state import STATE_VERSION
from simigrad_jax.controllers.state import check_finite_float
from simigrad_jax.controllers.state import check_state_header
from simigrad_jax.controllers.state import parse_last_decision
from simigrad_jax.controllers.state import saved_section
from simigrad_jax.controllers.wrapper import ControllerWrapper

SizeCheck = Callable[[str, Any], int]  # (name, value) -> the size, or raises ValueError


class SimilarityProfile:
  """The sizes a profile visits, where it stands, and every similarity it recorded.

  The plan is ``{"sizes", "steps_per_size", "position", "count",
  "return_to"}``; ``return_to`` (the size to go back to) is None until the
  profile begins. Samples are ``{"batch_size", "similarity", "step"}`` and
  accumulate over profiles.
  """

  def __init__(
    self, plan: dict[str, Any] | None = None, samples: list[dict[str, Any]] | None = None
  ):
    self._plan = plan
    self._samples = [] if samples is None else samples

  @property
  def active(self) -> bool:
    """Whether a profile is in progress or waiting to begin."""
    return self._plan is not None

  @property
  def started(self) -> bool:
    """Whether a profile is in progress (it has begun)."""
    return self._plan is not None and self._plan["return_to"] is not None

  @property
  def sizes(self) -> tuple[int, ...]:
    """The sizes of the active profile, in the order visited; () if none."""
    return () if self._plan is None else tuple(self._plan["sizes"])

  @property
  def samples(self) -> list[dict[str, Any]]:
    """A copy of every sample so far."""
    return [dict(s) for s in self._samples]

  def plan(self, batch_sizes: Sequence[int], steps_per_size: int, check_size: SizeCheck) -> None:
    """Plans a profile of ``batch_sizes``, ``steps_per_size`` samples each (:meth:`begin` begins it).

    Raises:
      ValueError: for an empty list or a size ``check_size`` refuses.
      RuntimeError: if a profile is already active.
    """
    if (
      isinstance(batch_sizes, (str, bytes))
      or not isinstance(batch_sizes, (Sequence, np.ndarray))
      or len(batch_sizes) == 0
    ):
      raise ValueError(
        f"batch_sizes_to_profile must be a non-empty sequence of batch sizes, got {batch_sizes!r}"
      )
    sizes = [check_size(f"batch_sizes_to_profile[{i}]", b) for i, b in enumerate(batch_sizes)]
    steps_per_size = validation.check_int("profile_steps_per_size", steps_per_size, 1)
    if self._plan is not None:
      raise RuntimeError(f"a profile of {self._plan['sizes']} is already in progress")
    self._plan = {
      "sizes": sizes,
      "steps_per_size": steps_per_size,
      "position": 0,
      "count": 0,
      "return_to": None,
    }

  def begin(self, current_size: int) -> int:
    """Begins the planned profile from ``current_size``; returns the first size to run."""
    plan = self._active_plan()
    plan["return_to"] = current_size
    return plan["sizes"][0]

  def record(self, batch_size: int, similarity: float, step: int) -> int:
    """Records one finite sample; returns the size of the next step (:meth:`upcoming`).

    After ``steps_per_size`` samples the profile moves to the next size; after
    the last, it ends and returns the size it began from.
    """
    plan = self._active_plan()
    upcoming = self.upcoming()
    self._samples.append({"batch_size": batch_size, "similarity": similarity, "step": step})
    plan["count"] += 1
    if plan["count"] == plan["steps_per_size"]:
      plan["position"] += 1
      plan["count"] = 0
      if plan["position"] == len(plan["sizes"]):
        self._plan = None
    return upcoming

  def upcoming(self) -> int:
    """The size of the step after one more finite sample (the first size, before it begins)."""
    plan = self._active_plan()
    if plan["return_to"] is None:
      return plan["sizes"][0]
    if plan["count"] + 1 < plan["steps_per_size"]:
      return plan["sizes"][plan["position"]]
    if plan["position"] + 1 < len(plan["sizes"]):
      return plan["sizes"][plan["position"] + 1]
    return plan["return_to"]

  def _active_plan(self) -> dict[str, Any]:
    if self._plan is None:
      raise RuntimeError("no profile is planned (plan() plans one)")
    return self._plan

  def summary(self) -> dict[int, dict[str, float | int]]:
    """Per batch size, in increasing order: ``{"mean", "std", "count"}`` of the similarities."""
    by_size: dict[int, list[float]] = {}
    for sample in self._samples:
      by_size.setdefault(sample["batch_size"], []).append(sample["similarity"])
    summary = {}
    for size in sorted(by_size):
      values = np.asarray(by_size[size], dtype=np.float64)
      summary[size] = {
        "mean": float(values.mean()),
        "std": float(values.std()),
        "count": int(values.size),
      }
    return summary

  def save(self, path: str | os.PathLike, similarity_target: float | None) -> None:
    """Writes ``{"version", "similarity_target", "samples", "summary"}`` to ``path`` as JSON."""
    data = {
      "version": STATE_VERSION,
      "similarity_target": similarity_target,
      "samples": self.samples,
      "summary": {str(b): v for b, v in self.summary().items()},
    }
    files.write_atomic(path, json.dumps(data, indent=2))

  def state_dict(self) -> dict[str, Any]:
    """``{"profile_plan", "profile"}`` as plain JSON data."""
    return {
      "profile_plan": None
      if self._plan is None
      else {**self._plan, "sizes": list(self._plan["sizes"])},
      "profile": self.samples,
    }

  @classmethod
  def from_state(cls, state: Mapping[str, Any], check_size: SizeCheck) -> SimilarityProfile:
    """A profile from :meth:`state_dict`'s entries in ``state``, checked (raises ValueError, KeyError)."""
    plan = saved_section(state, "profile_plan", dict, optional=True)
    if plan is not None:
      plan = {
        "sizes": [check_size("profile size", b) for b in plan["sizes"]],
        "steps_per_size": validation.check_int("steps_per_size", plan["steps_per_size"], 1),
        "position": validation.check_int("position", plan["position"], 0),
        "count": validation.check_int("count", plan["count"], 0),
        "return_to": None
        if plan["return_to"] is None
        else check_size("return_to", plan["return_to"]),
      }
      if plan["position"] >= len(plan["sizes"]):
        raise ValueError(f"profile position {plan['position']} is past the end")
    samples = []
    for i, sample in enumerate(saved_section(state, "profile", list)):
      if not isinstance(sample, Mapping):
        raise ValueError(
          f"malformed controller state: profile[{i}] must be a dict, got {sample!r:.200}"
        )
      samples.append(
        {
          "batch_size": validation.check_int("sample batch_size", sample["batch_size"], 1),
          "similarity": check_finite_float("sample similarity", sample["similarity"]),
          "step": validation.check_int("sample step", sample["step"], 1),
        }
      )
    return cls(plan, samples)


class ProfileMethods:
  """The public face of a profile, for a class that holds a :class:`SimilarityProfile` in ``_profile``.

  The class provides ``_check_size(name, value)`` (a size within its bounds)
  and ``_profile_planned()`` (begin the planned profile now, or later).
  """

  _profile: SimilarityProfile

  if TYPE_CHECKING:  # What the class provides, declared for the type checker only.

    def _check_size(self, name: str, value: Any) -> int: ...

    def _profile_planned(self) -> None: ...

    @property
    def config(self) -> dict[str, Any]: ...

  def _init_profile(self, batch_sizes: Sequence[int] | None, steps_per_size: int) -> None:
    """Starts with no samples, and a profile of ``batch_sizes`` if given (steps checked either way)."""
    self._profile = SimilarityProfile()
    if batch_sizes is not None:
      self.start_profile(batch_sizes, steps_per_size)
    else:
      validation.check_int("profile_steps_per_size", steps_per_size, 1)

  @property
  def profiling(self) -> bool:
    """Whether a profile is in progress or waiting to begin."""
    return self._profile.active

  @property
  def profile(self) -> list[dict[str, Any]]:
    """Every profile sample so far: ``{"batch_size", "similarity", "step"}``.

    ``step`` is the update count of the update that measured it.
    """
    return self._profile.samples

  @property
  def profile_batch_sizes(self) -> tuple[int, ...]:
    """The sizes of the profile in progress or waiting to begin (visited or not); () if none."""
    return self._profile.sizes

  def start_profile(self, batch_sizes: Sequence[int], steps_per_size: int = 1) -> None:
    """Visits each size in turn, recording the similarity measured there.

    The next step runs at ``batch_sizes[0]`` (:class:`simigrad_jax.Controller`
    in its warm-up: the first step after it does; the similarity that update
    receives, measured at the previous size, is not used). After
    ``steps_per_size`` finite samples at each size the controller returns to
    the size it had before and resumes adapting. Samples go to
    :attr:`profile`; non-finite similarities are not samples, so the size is
    kept until enough finite ones arrive.

    Args:
      batch_sizes: a non-empty sequence of integers >= 1 within the bounds,
        visited in this order (the reference visits its list in reverse).
      steps_per_size: the number of samples taken at each size (>= 1).

    Raises:
      ValueError: for an empty list or a size out of range.
      RuntimeError: if a profile is already in progress.
    """
    self._profile.plan(batch_sizes, steps_per_size, self._check_size)
    self._profile_planned()

  def profile_summary(self) -> dict[int, dict[str, float | int]]:
    """Per profiled batch size: ``{"mean", "std", "count"}`` of similarities.

    ``std`` is the population standard deviation (0 for a single sample).
    Sizes are in increasing order.
    """
    return self._profile.summary()

  def save_profile(self, path: str | os.PathLike) -> None:
    """Writes the profile samples and their summary to ``path`` as JSON.

    The file holds ``{"version", "similarity_target", "samples", "summary"}``;
    summary keys are the batch sizes as strings (JSON keys are strings).
    """
    self._profile.save(path, self.config.get("similarity_target"))


class ProfilingController(ControllerWrapper, ProfileMethods):
  """Any controller, with a similarity profile before it adapts (or whenever asked).

  While a profile runs, the wrapper chooses the sizes: each of
  ``batch_sizes`` in turn, ``steps_per_size`` finite steps each, then back to
  the size the wrapped controller had when the profile began. The wrapped
  controller still sees every step, at the size that ran (its counters,
  averages and epoch bookkeeping stay whole); only its choice of the next
  size is set aside. Outside a profile the wrapper passes everything through.
  Attributes the wrapper does not define (``step``, ``noise_scale``, ...)
  are read from the wrapped controller.

  Args:
    controller: the controller to wrap (any
      :class:`~simigrad_jax.controllers.interface.BatchSizeController`).
    batch_sizes: optional sizes to visit from the next step on (within the
      wrapped controller's bounds); :meth:`start_profile` starts one later.
    steps_per_size: the samples taken at each size.

  Example:
    >>> import simigrad_jax
    >>> from simigrad_jax.controllers import ProfilingController
    >>> gns = simigrad_jax.make_controller("gns", initial_batch_size=64,
    ...                                    batch_size_upper_bound=512)
    >>> c = ProfilingController(gns, [128, 256])
    >>> stats = {"norm_a": 1.0, "norm_b": 1.1, "norm_mean": 0.8, "batch_size": c.batch_size}
    >>> c.batch_size, c.update(0.2, stats=stats), c.update(0.1, stats=stats)
    (128, 256, 64)
    >>> c.profile_summary()[256]["mean"], c.profiling, c.last_decision
    (0.1, False, 'profile')
  """

  KIND = "profiling"
  OWN_ATTRIBUTES = ("_inner", "_profile")

  def __init__(
    self,
    controller: BatchSizeController,
    batch_sizes: Sequence[int] | None = None,
    steps_per_size: int = 1,
  ):
    super().__init__(controller)
    self._current: int | None = None  # The size of the next step while a profile runs.
    self._step = 0
    self._last_decision: str | None = None
    self._init_profile(batch_sizes, steps_per_size)

  @property
  def batch_size(self) -> int:
    """The global batch size to use for the next optimizer step."""
    return self._inner.batch_size if self._current is None else self._current

  @property
  def config(self) -> dict[str, Any]:
    """The wrapped controller's settings (a profile is state, not a setting)."""
    return dict(self._inner.config)

  @property
  def profile_batch_sizes(self) -> tuple[int, ...]:
    """The sizes of this profile, and of the wrapped controller's own if it has one."""
    inner = self._inner
    return self._profile.sizes + (
      tuple(inner.profile_batch_sizes) if isinstance(inner, ProfilesBatchSizes) else ()
    )

  def likely_batch_sizes(self, examples_seen: int, epochs: float) -> Sequence[int]:
    """During a profile, its next size (or, after a non-finite step, the same); else the
    wrapped controller's (:func:`~simigrad_jax.controllers.interface.likely_batch_sizes`)."""
    if self._current is not None:
      return list(dict.fromkeys([self._profile.upcoming(), self._current]))
    return list(interface.likely_batch_sizes(self._inner, examples_seen, epochs))

  @property
  def last_decision(self) -> str | None:
    """``"profile"``, ``"nonfinite"`` or ``"unmeasured"`` during a profile, else the wrapped one's."""
    return self._last_decision

  def update(self, similarity: float, stats: Mapping[str, Any] | None = None) -> int:
    """Passes the step to the wrapped controller; during a profile, records it and picks the size.

    A step with a non-finite similarity (or ``stats["grads_finite"]`` False)
    is not a sample: the profile stays at its size.
    """
    if self._current is None:
      size = self._inner.update(similarity, stats=stats)
      self._step += 1
      self._last_decision = self._inner.last_decision
      return size
    ran = self._current
    self._inner.set_batch_size(ran)
    self._inner.update(similarity, stats=stats)
    self._step += 1
    s, stats = check_similarity(similarity), check_stats(stats)
    if step_is_finite(s, stats):
      self._current = self._profile.record(ran, s, self._step)
      if not self._profile.active:
        self._inner.set_batch_size(self._current)
        self._current = None
      self._last_decision = "profile"
    else:
      self._last_decision = "unmeasured" if unmeasured_but_finite(s, stats) else "nonfinite"
    return self.batch_size

  def set_batch_size(self, batch_size: int) -> None:
    """Adopts a batch size chosen elsewhere: the profiled step's size during a profile."""
    if self._current is None:
      self._inner.set_batch_size(batch_size)
    else:
      self._current = self._check_size("batch_size", batch_size)

  def state_dict(self) -> dict[str, Any]:
    """The profile's state and the wrapped controller's (under ``"wrapped"``), as plain JSON."""
    return {
      "version": STATE_VERSION,
      "controller": self.KIND,
      "step": self._step,
      "last_decision": self._last_decision,
      "profile_batch_size": self._current,
      **self._profile.state_dict(),
      "wrapped": self._inner.state_dict(),
    }

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restores a :meth:`state_dict`, the wrapped controller's included; nothing changes if refused."""
    check_state_header(state, self.KIND)
    try:
      profile = SimilarityProfile.from_state(state, self._check_size)
      current = state["profile_batch_size"]
      current = None if current is None else self._check_size("profile_batch_size", current)
      if (current is None) == profile.started:
        raise ValueError(
          f"profile_batch_size {current!r} does not fit the profile plan {state['profile_plan']!r}"
        )
      step = validation.check_int("step", state["step"], 0)
      decision = parse_last_decision(state["last_decision"])
      wrapped = state["wrapped"]
    except (KeyError, TypeError) as e:
      raise ValueError(f"malformed controller state: {e!r}") from e
    self._inner.load_state_dict(wrapped)
    self._profile, self._current, self._step, self._last_decision = profile, current, step, decision

  def _profile_planned(self) -> None:
    self._current = self._profile.begin(self._inner.batch_size)
