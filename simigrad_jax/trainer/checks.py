"""Host: the Trainer's checks of its model, data, devices and controller, before any step.

Every object is checked before anything is created, compiled or trained, so
that a bad value fails in seconds, not after the first GPU-hour; each error
names the value and what would be valid. The settings are checked by
:class:`simigrad_jax.trainer.config.TrainerConfig`.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from simigrad_jax import validation
from simigrad_jax.controllers import interface as controller_interface
from simigrad_jax.ingraph import transform
from simigrad_jax.ingraph.lr_scaling import LrFactorState
from simigrad_jax.ingraph.transform import SimilarityState

# What the Trainer reads from a controller: simigrad_jax.controllers.BatchSizeController.
_CONTROLLER_ATTRIBUTES = controller_interface.CONTROLLER_MEMBERS
_CONTROLLER_METHODS = controller_interface.CONTROLLER_METHODS
_CONTROLLER_CONFIG_KEYS = controller_interface.REQUIRED_CONFIG_KEYS


@contextlib.contextmanager
def transform_named_for(axis_name: str) -> Iterator[None]:
  """Traces the block with the step mapped over ``axis_name``; a transform not named so is refused.

  The transform raises :class:`simigrad_jax.ingraph.AxisNameError` while the step is
  traced; the program's trace reports it as a failing ``loss_fn``, so the
  error is raised again here, naming the fix, with the transform's as its cause.
  The block only refuses: a transform named ``axis_name`` computes inside it
  what it computes outside (:func:`simigrad_jax.ingraph.transform.step_mapped_over`).
  """
  try:
    with transform.step_mapped_over(axis_name):
      yield
  except ValueError as error:
    original = error if isinstance(error, transform.AxisNameError) else error.__cause__
    if not isinstance(original, transform.AxisNameError):
      raise
    raise transform.AxisNameError(
      f"the optimizer's simigrad_jax.transform must use the Trainer's axis_name={axis_name!r}, "
      f"got axis_name={original.axis_name!r}: build it with "
      f"simigrad_jax.transform(axis_name={axis_name!r}) (transform() without an axis name is "
      "for a plain jax.jit step, given half_grads from simigrad_jax.value_and_half_grads)",
      original.axis_name,
      axis_name,
    ) from original


def check_callable(name: str, fn: Any) -> None:
  if not callable(fn):
    raise ValueError(f"{name} must be callable, got {fn!r:.200} ({type(fn).__name__})")


def check_controller(controller: Any) -> None:
  """Refuses anything that is not a :class:`simigrad_jax.controllers.BatchSizeController`."""
  if isinstance(controller, (str, Mapping)):
    raise ValueError(
      f"controller must be a controller object, got {controller!r:.200}; build one with "
      "simigrad_jax.make_controller(name, **options) or simigrad_jax.Controller(...)"
    )
  missing = [
    m
    for m in _CONTROLLER_ATTRIBUTES
    if not hasattr(controller, m)
    or (m in _CONTROLLER_METHODS and not callable(getattr(controller, m)))
  ]
  if missing or not isinstance(controller, controller_interface.BatchSizeController):
    raise ValueError(
      f"controller {controller!r:.200} lacks {missing}; a controller needs "
      f"{list(_CONTROLLER_ATTRIBUTES)}, the methods callable (the members of "
      "simigrad_jax.controllers.BatchSizeController)"
    )
  config = controller.config
  if not isinstance(config, Mapping) or any(k not in config for k in _CONTROLLER_CONFIG_KEYS):
    raise ValueError(
      f"controller.config must be a dict with the keys {list(_CONTROLLER_CONFIG_KEYS)} "
      f"(None where one does not apply), got {config!r:.300}"
    )
  for name in ("batch_size", "initial_batch_size"):
    validation.check_int(f"controller.{name}", getattr(controller, name), 1)


def check_source(source: Any) -> int:
  """Refuses anything that is not a random-access source; returns its length."""
  missing = [a for a in ("__len__", "get_batch", "element_spec") if not hasattr(source, a)]
  if missing:
    raise ValueError(
      f"source must be a random-access source (len(), get_batch(indices), "
      f"element_spec) such as simigrad_jax.ArraySource; {source!r:.200} lacks {missing}"
    )
  num_examples = len(source)
  if not validation.is_int(num_examples) or num_examples < 1:
    raise ValueError(f"the source must hold at least 1 example, got len(source)={num_examples!r}")
  spec = source.element_spec
  if not isinstance(spec, Mapping) or not spec:
    raise ValueError(
      f"source.element_spec must be a non-empty dict of name -> (shape, dtype), got {spec!r:.200}"
    )
  return int(num_examples)


def check_devices(devices: Any) -> list[jax.Device]:
  """The training devices: all by default; at least one, each once."""
  devices = list(jax.devices() if devices is None else devices)
  if not all(isinstance(d, jax.Device) for d in devices):
    raise ValueError(f"devices must be a list of jax.Device, got {devices!r:.200}")
  if not devices:
    raise ValueError("devices is empty: give at least one jax.Device (None: all of them)")
  if len(set(devices)) != len(devices):
    raise ValueError(f"devices must be distinct, got {devices}")
  return devices


def check_finite_params(params: Any) -> None:
  """Refuses initial parameters with NaN or infinite entries (every step would be skipped)."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  if not leaves:
    raise ValueError("params holds no arrays: there is nothing to train")
  inexact = [
    (path, leaf) for path, leaf in leaves if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)
  ]
  finite = np.asarray(_all_finite([leaf for _, leaf in inexact])) if inexact else np.ones(0, bool)
  for (path, _), ok in zip(inexact, finite, strict=True):
    if not ok:
      raise ValueError(
        f"params{jax.tree_util.keystr(path)} holds NaN or infinite values: every "
        "step would be skipped; initialise the model with finite values"
      )


@jax.jit
def _all_finite(leaves: list[jax.Array]) -> jax.Array:
  """One bool per leaf: all its entries are finite (one compiled call for the whole tree)."""
  return jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves])


def _profile_sizes(controller: Any) -> list[int]:
  """The batch sizes a controller's profile will visit (its ``profile_batch_sizes``, if it has one)."""
  if not isinstance(controller, controller_interface.ProfilesBatchSizes):
    return []
  return [int(b) for b in controller.profile_batch_sizes]


def check_bounds(controller: Any, num_examples: int, halves: str) -> tuple[int, int]:
  """The smallest and largest global batch sizes of the run, after checking them.

  Refuses sizes the data set cannot fill, an adaptive controller without an
  upper bound, and, for a controller that needs the similarity, sizes so small
  that the second half holds no example (the similarity is then never
  measured and the size never moves again). Under either split (``halves``)
  half B holds the step's odd-numbered examples, so a batch needs 2.
  """
  lower, upper = controller_interface.batch_size_bounds(controller)
  adapting = controller_interface.adapts(controller)
  profile = _profile_sizes(controller)
  sizes = [controller.batch_size, controller.initial_batch_size, *profile]
  if upper is None and adapting:
    raise ValueError(
      f"batch_size_upper_bound=None lets the controller grow the global batch without limit, "
      f"past the data set's {num_examples} examples (a step would repeat examples); set "
      f"batch_size_upper_bound to at most {num_examples}"
    )
  largest = max(sizes + ([upper] if upper is not None else []))
  if largest > num_examples:
    what = "batch_size_upper_bound" if largest == upper else "the controller's batch size"
    raise ValueError(
      f"the data set has {num_examples} examples, fewer than the largest batch size {largest} "
      f"({what}): a step would repeat examples; lower the bound"
    )
  # Half B holds the odd-numbered examples of a step (simigrad_jax.shapes.layout):
  # a batch of 1 leaves it without an example.
  floor = 2
  second_half = (
    "the odd devices (the second half)"
    if halves == "device"
    else "the second half (the step's odd-numbered examples)"
  )
  if controller_interface.similarity_target(controller) is not None:
    smallest = min([lower if lower is not None else 1] if adapting else sizes)
    smallest = min([smallest] + profile)
    if smallest < floor:
      what = (
        f"batch_sizes_to_profile holds {min(profile)}"
        if profile and min(profile) == smallest
        else f"batch_size_lower_bound={lower!r} lets the global batch shrink to {smallest}"
        if adapting
        else f"the batch size is {smallest}"
      )
      if adapting or profile:
        raise ValueError(
          f"{what}, but a batch below {floor} leaves {second_half} "
          f"without an example: the similarity cannot be measured and the batch size would "
          f"stay there; use sizes >= {floor} (set batch_size_lower_bound >= {floor})"
        )
  return (lower if lower is not None else 1), largest


def check_workdir(workdir: str | os.PathLike) -> pathlib.Path:
  """The absolute workdir; its parent must exist, and it must be a directory if it exists."""
  workdir = pathlib.Path(workdir).absolute()
  if not workdir.parent.is_dir():
    raise ValueError(f"the workdir's parent {str(workdir.parent)!r} does not exist")
  if workdir.exists() and not workdir.is_dir():
    raise ValueError(f"workdir {str(workdir)!r} exists and is not a directory")
  return workdir


def checked_optimizer_state(optimizer: Any, params: Any) -> Any:
  """``optimizer.init(params)``, refusing an optimizer without the two SimiGrad transformations."""
  if not (
    callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
  ):
    raise ValueError(
      f"optimizer must be an optax GradientTransformation (with init and update), "
      f"got {optimizer!r:.200}"
    )
  state = optimizer.init(params)
  for state_type, name in (
    (SimilarityState, "simigrad_jax.transform"),
    (LrFactorState, "simigrad_jax.scale_by_lr_factor()"),
  ):
    if not optax.tree_utils.tree_get_all_with_path(state, state_type.__name__):
      raise ValueError(f"the optimizer has no {state_type.__name__}: chain {name} into it")
  return state
