"""Host: the names and module paths 0.2.0 moved, still importable from their old places until 0.3.

0.2.0 gave the package a small public face (``simigrad_jax.__all__``) and
split ``simigrad_jax.engine`` and ``simigrad_jax.runtime`` into rooms by what
they do (CHANGELOG.md, 0.2.0). For one release each old spelling still gives
the same object as the new one, with a ``DeprecationWarning`` that names the
new place:

* a name that left the top level, ``simigrad_jax.plan_batch``: the package's
  ``__getattr__`` returns ``simigrad_jax.shapes.plan_batch``
  (:func:`moved_attribute`, :data:`MOVED_NAMES`);
* a ramp that 0.1.0 exported from ``simigrad_jax.controllers``, now in
  ``simigrad_jax.ramps``: likewise, through the ``__getattr__`` that
  :func:`install` gives ``simigrad_jax.controllers`` (the controllers' room
  itself knows nothing of the ramps, a floor above it);
* a module path, ``import simigrad_jax.engine.layout`` or ``from
  simigrad_jax.runtime.metrics import MetricsWriter``: a finder at the end of
  ``sys.meta_path`` (:class:`MovedModuleFinder`) hands out the moved module
  object itself (``simigrad_jax.shapes.layout``), so that monkeypatching
  either name patches both (:data:`MOVED_MODULES`). ``simigrad_jax.engine``
  and ``simigrad_jax.runtime`` import as empty packages whose attributes are
  their old modules.

Example:
  >>> import warnings
  >>> import simigrad_jax
  >>> with warnings.catch_warnings(record=True) as caught:
  ...   warnings.simplefilter("always")
  ...   plan_batch = simigrad_jax.plan_batch
  >>> plan_batch is simigrad_jax.shapes.plan_batch
  True
  >>> print(caught[0].message)
  simigrad_jax.plan_batch moved to simigrad_jax.shapes.plan_batch; the old name goes in 0.3
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
  "GONE_PACKAGES",
  "MOVED_MODULES",
  "MOVED_NAMES",
  "REMOVED_IN",
  "MovedModuleFinder",
  "install",
  "moved_attribute",
]

# The release that drops the old spellings.
REMOVED_IN = "0.3"

# The names a package exported in 0.1.0 that live elsewhere now: {package: {name: new package}}.
MOVED_NAMES: dict[str, dict[str, str]] = {
  "simigrad_jax": {
    "AxisNameError": "simigrad_jax.ingraph",
    "BadRecordError": "simigrad_jax.data",
    "BatchCouplingState": "simigrad_jax.ingraph",
    "BatchPlan": "simigrad_jax.shapes",
    "BucketPolicy": "simigrad_jax.shapes",
    "CheckpointMismatchError": "simigrad_jax.checkpoint",
    "CheckpointSaveError": "simigrad_jax.checkpoint",
    "Checkpointer": "simigrad_jax.checkpoint",
    "EpochSampler": "simigrad_jax.data",
    "HalvesContractError": "simigrad_jax.ingraph",
    "LossContractError": "simigrad_jax.ingraph",
    "LrFactorState": "simigrad_jax.ingraph",
    "MetricsWriter": "simigrad_jax.trainer",
    "OneStepLateController": "simigrad_jax.controllers",
    "ProcessDisagreementError": "simigrad_jax.multihost",
    "ProcessLostError": "simigrad_jax.multihost",
    "ProfilingController": "simigrad_jax.controllers",
    "ProgressBar": "simigrad_jax.trainer",
    "StepCompileError": "simigrad_jax.compile",
    "StepCompiler": "simigrad_jax.compile",
    "UnsafePathError": "simigrad_jax.files",
    "WorkdirLockedError": "simigrad_jax.multihost",
    "bucket_shapes": "simigrad_jax.shapes",
    "controller_options": "simigrad_jax.controllers",
    "deal_to_devices": "simigrad_jax.data",
    "enable_persistent_cache": "simigrad_jax.compile",
    "exit_on_lost_process": "simigrad_jax.multihost",
    "persistent_cache_settings": "simigrad_jax.compile",
    "plan_batch": "simigrad_jax.shapes",
    "replay_controller": "simigrad_jax.ramps",
    "replay_schedule": "simigrad_jax.ramps",
    "representable_batch_sizes": "simigrad_jax.shapes",
  },
  "simigrad_jax.controllers": {
    "DoublingWarmupController": "simigrad_jax.ramps",
    "LinearRampController": "simigrad_jax.ramps",
    "LossPlateauController": "simigrad_jax.ramps",
    "ScheduleController": "simigrad_jax.ramps",
    "SeesawController": "simigrad_jax.ramps",
    "StepScheduleController": "simigrad_jax.ramps",
    "replay_controller": "simigrad_jax.ramps",
    "replay_schedule": "simigrad_jax.ramps",
  },
}

# 0.1.0's module paths and the module each one is now.
MOVED_MODULES: dict[str, str] = {
  "simigrad_jax.controllers.replay": "simigrad_jax.ramps.replay",
  "simigrad_jax.ingraph.data_blocks": "simigrad_jax.reductions.data_blocks",
  "simigrad_jax.ingraph.group_reduction": "simigrad_jax.reductions.group_reduction",
  "simigrad_jax.ingraph.half_statistics": "simigrad_jax.reductions.half_statistics",
  "simigrad_jax.ingraph.halves_reduction": "simigrad_jax.reductions.halves_reduction",
  "simigrad_jax.controllers.schedules": "simigrad_jax.ramps.schedules",
  "simigrad_jax.controllers.seesaw": "simigrad_jax.ramps.seesaw",
  "simigrad_jax.controllers.token_schedules": "simigrad_jax.ramps.token_schedules",
  "simigrad_jax.engine.batch_plan": "simigrad_jax.shapes.batch_plan",
  "simigrad_jax.engine.compile_fallback": "simigrad_jax.compile.fallback",
  "simigrad_jax.engine.compiler": "simigrad_jax.compile.compiler",
  "simigrad_jax.engine.config": "simigrad_jax.trainer.config",
  "simigrad_jax.engine.data_loader": "simigrad_jax.data.data_loader",
  "simigrad_jax.engine.hooks": "simigrad_jax.trainer.hooks",
  "simigrad_jax.engine.layout": "simigrad_jax.shapes.layout",
  "simigrad_jax.engine.mesh_sharding": "simigrad_jax.shapes.mesh_sharding",
  "simigrad_jax.engine.persistent_cache": "simigrad_jax.compile.persistent_cache",
  "simigrad_jax.engine.preemption": "simigrad_jax.multihost.preemption",
  "simigrad_jax.engine.programs": "simigrad_jax.compile.programs",
  "simigrad_jax.engine.run_setup": "simigrad_jax.trainer.run_setup",
  "simigrad_jax.engine.run_totals": "simigrad_jax.trainer.run_totals",
  "simigrad_jax.engine.step_inputs": "simigrad_jax.trainer.step_inputs",
  "simigrad_jax.engine.step_record": "simigrad_jax.trainer.step_record",
  "simigrad_jax.engine.train_step": "simigrad_jax.ingraph.train_step",
  "simigrad_jax.engine.trainer": "simigrad_jax.trainer.trainer",
  "simigrad_jax.engine.trainer_checks": "simigrad_jax.trainer.checks",
  "simigrad_jax.runtime.checkpoint_integrity": "simigrad_jax.checkpoint.integrity",
  "simigrad_jax.runtime.checkpointer": "simigrad_jax.checkpoint.checkpointer",
  "simigrad_jax.runtime.cpu_devices": "simigrad_jax.multihost.cpu_devices",
  "simigrad_jax.runtime.metrics": "simigrad_jax.trainer.metrics",
  "simigrad_jax.runtime.process_agreement": "simigrad_jax.multihost.process_agreement",
  "simigrad_jax.runtime.progress": "simigrad_jax.trainer.progress",
  "simigrad_jax.runtime.run_checkpoints": "simigrad_jax.checkpoint.run_checkpoints",
  "simigrad_jax.runtime.run_record": "simigrad_jax.checkpoint.run_record",
  "simigrad_jax.runtime.workdir": "simigrad_jax.multihost.workdir",
}

# 0.1.0's packages that 0.2.0 split into rooms; each imports as an empty package of its old modules.
GONE_PACKAGES: tuple[str, ...] = ("simigrad_jax.engine", "simigrad_jax.runtime")


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_IMPORTLIB_DIR = os.path.dirname(os.path.abspath(importlib.__file__ or ""))


def _on_the_way(frame: types.FrameType) -> bool:
  """Whether ``frame`` is on the way from an old spelling to its warning, not where it is written.

  This module, a package's ``__getattr__`` and the import system.
  """
  code = frame.f_code
  return (
    code.co_filename == __file__
    or (code.co_name == "__getattr__" and code.co_filename.startswith(_PACKAGE_DIR))
    or code.co_filename.startswith(("<frozen importlib.", _IMPORTLIB_DIR))
  )


def _bootstrap(frame: types.FrameType) -> bool:
  """Whether ``frame`` is the import system's bootstrap, whose frames warnings.warn does not count."""
  filename = frame.f_code.co_filename
  return "importlib" in filename and "_bootstrap" in filename


def _warn(message: str, *, once_per_from_import: bool = False) -> None:
  """A ``DeprecationWarning`` attributed to the line that wrote the old spelling.

  So that Python's default filters show it when that line is in
  ``__main__``, and a test sees its own line.

  Args:
    message: what moved where.
    once_per_from_import: no warning while ``from package import name``
      checks that the package has the name (the statement then reads it,
      which warns).
  """
  frame: types.FrameType | None = sys._getframe(1)
  level = 2  # warnings.warn's level of the frame that called this function
  while frame is not None and _on_the_way(frame):
    if once_per_from_import and frame.f_code.co_name == "_handle_fromlist":
      return  # `from package import name` asks for the name twice: the second asking warns
    frame = frame.f_back
    # warnings.warn steps over the import system's bootstrap frames without counting them.
    if frame is not None and not _bootstrap(frame):
      level += 1
  warnings.warn(message, DeprecationWarning, stacklevel=level)


def moved_attribute(package: str, name: str) -> Any:
  """``package.name`` spelled as in 0.1.0: the object from its new place, with a ``DeprecationWarning``.

  A package's module-level ``__getattr__`` (PEP 562) calls this for a name
  it does not hold: a name that moved (:data:`MOVED_NAMES`), or an old
  module of the package (:data:`MOVED_MODULES`, :data:`GONE_PACKAGES`),
  which is imported, the import naming its new path.

  Args:
    package: the package the name was asked of, e.g. ``"simigrad_jax"``.
    name: the attribute asked for.

  Returns:
    The object itself (``simigrad_jax.plan_batch`` is
    ``simigrad_jax.shapes.plan_batch``), or the moved module.

  Raises:
    AttributeError: ``package`` never had ``name``, as for any missing attribute.

  Example:
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...   warnings.simplefilter("ignore", DeprecationWarning)
    ...   moved_attribute("simigrad_jax", "BucketPolicy").__module__
    'simigrad_jax.shapes.batch_plan'
  """
  new_package = MOVED_NAMES.get(package, {}).get(name)
  if new_package is not None:
    _warn(
      f"{package}.{name} moved to {new_package}.{name}; the old name goes in {REMOVED_IN}",
      once_per_from_import=True,
    )
    return getattr(importlib.import_module(new_package), name)
  old_module = f"{package}.{name}"
  if old_module in MOVED_MODULES or old_module in GONE_PACKAGES:
    return importlib.import_module(old_module)
  raise AttributeError(f"module {package!r} has no attribute {name!r}")


def _getattr_of(package: str) -> Callable[[str], Any]:
  """A module-level ``__getattr__`` for ``package`` that resolves its old names."""

  def __getattr__(name: str) -> Any:
    return moved_attribute(package, name)

  return __getattr__


class _MovedModuleLoader(importlib.abc.Loader):
  """Loads an old module path as the moved module object itself."""

  def __init__(self, new_name: str):
    self._new_name = new_name
    self._spec: importlib.machinery.ModuleSpec | None = None

  def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
    _warn(f"{spec.name} moved to {self._new_name}; the old path goes in {REMOVED_IN}")
    module = importlib.import_module(self._new_name)
    self._spec = module.__spec__
    return module

  def exec_module(self, module: types.ModuleType) -> None:
    # The import system set the old path's spec on the module create_module returned; the module
    # keeps its own (its name, its file, what importlib.reload reads).
    module.__spec__ = self._spec


class _GonePackageLoader(importlib.abc.Loader):
  """Loads a package 0.2.0 split into rooms as an empty package whose attributes are its old modules."""

  def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
    return None  # the import system's default module

  def exec_module(self, module: types.ModuleType) -> None:
    module.__doc__ = (
      f"Host: {module.__name__} of 0.1.0, split into rooms by 0.2.0. Each of its old modules "
      f"imports as the moved module, with a DeprecationWarning naming its new path, until "
      f"{REMOVED_IN} (simigrad_jax.moved.MOVED_MODULES)."
    )
    module.__getattr__ = _getattr_of(module.__name__)  # type: ignore[method-assign]


class MovedModuleFinder(importlib.abc.MetaPathFinder):
  """Finds 0.1.0's module paths, on ``sys.meta_path`` after the finders of the modules that exist.

  Example:
    >>> import sys
    >>> any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path)
    True
  """

  def find_spec(
    self,
    fullname: str,
    path: Sequence[str] | None,
    target: types.ModuleType | None = None,
  ) -> importlib.machinery.ModuleSpec | None:
    """A spec that loads ``fullname`` from its new place if 0.1.0 had it, else None."""
    if fullname in MOVED_MODULES:
      return importlib.util.spec_from_loader(fullname, _MovedModuleLoader(MOVED_MODULES[fullname]))
    if fullname in GONE_PACKAGES:
      return importlib.util.spec_from_loader(fullname, _GonePackageLoader(), is_package=True)
    return None


def install() -> None:
  """Makes 0.1.0's module paths and the ramps' old names in ``simigrad_jax.controllers`` resolve.

  ``simigrad_jax/__init__.py`` calls it once its rooms are imported (a
  second call changes nothing); the top level's own old names go through its
  ``__getattr__``, which calls :func:`moved_attribute`.
  """
  if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.append(MovedModuleFinder())
  for package in MOVED_NAMES:
    if package != "simigrad_jax":
      importlib.import_module(package).__getattr__ = _getattr_of(package)  # type: ignore[method-assign]
