"""0.1.0's names and module paths still work in 0.2.0: the same objects, with a warning naming the new place.

0.2.0 kept 32 of the 64 names ``simigrad_jax`` exported and moved the rest to
their rooms; it split ``simigrad_jax.engine`` and ``simigrad_jax.runtime``
into rooms and moved four controllers' modules to ``simigrad_jax.ramps``. Each
old spelling resolves to the object itself (so that monkeypatching one
patches the other) with a ``DeprecationWarning`` until 0.3; a name that stayed
gives none.
"""

import importlib
import json
import os
import pathlib
import re
import subprocess
import sys
import warnings

import pytest

import simigrad_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
OLD_NAME = r"simigrad_jax\.{name} moved to simigrad_jax\.(\w+)\.{name}; the old name goes in 0\.3$"

# Every name simigrad_jax exported before the package was split into rooms: 0.1.0's __all__.
NAMES_BEFORE_THE_ROOMS = (
  "ArraySource",
  "AxisNameError",
  "BadRecordError",
  "BaseController",
  "BatchCouplingState",
  "BatchPlan",
  "BatchSizeController",
  "BucketPolicy",
  "CheckpointMismatchError",
  "CheckpointSaveError",
  "Checkpointer",
  "Controller",
  "EpochSampler",
  "GrainSource",
  "HalfGrads",
  "HalvesContractError",
  "LossContractError",
  "LrFactorState",
  "MetricsWriter",
  "OneStepLateController",
  "Preempted",
  "ProcessDisagreementError",
  "ProcessLostError",
  "ProfilingController",
  "ProgressBar",
  "SimiGradError",
  "SimilarityState",
  "StepCompileError",
  "StepCompiler",
  "StepHook",
  "StepRecord",
  "TfdsSource",
  "Trainer",
  "TrainerConfig",
  "UnsafePathError",
  "WorkdirLockedError",
  "bucket_shapes",
  "controller_names",
  "controller_options",
  "couple_to_batch_size",
  "deal_to_devices",
  "device_halves_step",
  "enable_persistent_cache",
  "exit_on_lost_process",
  "lr_factor",
  "lr_factor_of",
  "make_controller",
  "nnx_value_and_half_grads",
  "persistent_cache_settings",
  "plan_batch",
  "read_metrics",
  "register_controller",
  "replay_controller",
  "replay_schedule",
  "representable_batch_sizes",
  "scale_by_lr_factor",
  "set_coupled_batch_size",
  "set_lr_factor",
  "set_nnx_lr_factor",
  "similarity",
  "similarity_stats",
  "simulated_cpu_devices_env",
  "transform",
  "value_and_half_grads",
)

# The top-level names 0.3 added: the groups of TrainerConfig, which users type beside it.
NAMES_ADDED_IN_0_3 = ("CheckpointConfig", "CompileConfig", "LearningRateConfig")

# simigrad_jax.controllers.__all__ of 0.1.0; the ramps among them moved to simigrad_jax.ramps.
CONTROLLERS_BEFORE_THE_ROOMS = (
  "AnticipatesBatchSizes",
  "BaseController",
  "BatchSizeController",
  "Controller",
  "DoublingWarmupController",
  "GnsController",
  "LinearRampController",
  "LossPlateauController",
  "OneStepLateController",
  "ProfilesBatchSizes",
  "ProfilingController",
  "ScheduleController",
  "SeesawController",
  "StepScheduleController",
  "controller_names",
  "controller_options",
  "make_controller",
  "register_controller",
  "replay_controller",
  "replay_schedule",
)

# Every module of 0.1.0 that 0.2.0 moved, by its package then. Each kept its file name but three;
# engine/step_decision.py (StepDecider, internal) was folded into trainer/trainer.py's StepLoop.
MODULES_BEFORE_THE_ROOMS = {
  "simigrad_jax.controllers": "replay schedules seesaw token_schedules".split(),
  "simigrad_jax.ingraph": "data_blocks group_reduction half_statistics halves_reduction".split(),
  "simigrad_jax.engine": (
    "batch_plan compile_fallback compiler config data_loader hooks layout mesh_sharding "
    "persistent_cache preemption programs run_setup run_totals step_inputs "
    "step_record train_step trainer trainer_checks"
  ).split(),
  "simigrad_jax.runtime": (
    "checkpoint_integrity checkpointer cpu_devices metrics process_agreement progress "
    "run_checkpoints run_record workdir"
  ).split(),
}
RENAMED = {
  "compile_fallback": "fallback",
  "trainer_checks": "checks",
  "checkpoint_integrity": "integrity",
}
OLD_PATHS = sorted(
  f"{package}.{name}" for package, names in MODULES_BEFORE_THE_ROOMS.items() for name in names
)


def test_the_lists_are_0_1_0s():
  assert len(NAMES_BEFORE_THE_ROOMS) == 64 and len(set(NAMES_BEFORE_THE_ROOMS)) == 64
  assert set(simigrad_jax.__all__) <= set(NAMES_BEFORE_THE_ROOMS) | set(NAMES_ADDED_IN_0_3), (
    "a new top-level name"
  )
  assert len(OLD_PATHS) == 35  # engine/ had 20 modules; step_decision was folded in
  for old in OLD_PATHS:
    relative = pathlib.Path(*old.split(".")).with_suffix(".py")
    assert not (ROOT / relative).exists(), f"{old} is a module again"


def _read(package, name: str) -> tuple[object, list[warnings.WarningMessage]]:
  """``package.name`` read both ways, attribute and ``from ... import``, each with its warnings."""
  with warnings.catch_warnings(record=True) as by_attribute:
    warnings.simplefilter("always")
    value = getattr(package, name)
  namespace: dict = {}
  with warnings.catch_warnings(record=True) as by_import:
    warnings.simplefilter("always")
    exec(f"from {package.__name__} import {name}", namespace)
  assert namespace[name] is value
  assert [str(w.message) for w in by_import] == [str(w.message) for w in by_attribute]
  return value, by_attribute


def _check_old_name(package, name: str) -> None:
  value, caught = _read(package, name)
  if name in package.__all__:
    assert not caught, [str(w.message) for w in caught]
    assert value is vars(package)[name]
    return
  pattern = OLD_NAME.format(name=name).replace("simigrad_jax", re.escape(package.__name__), 1)
  assert len(caught) == 1 and caught[0].category is DeprecationWarning, caught
  message = str(caught[0].message)
  found = re.match(pattern, message)
  assert found, message
  room = importlib.import_module(f"simigrad_jax.{found.group(1)}")
  assert name in room.__all__, f"{message}, but simigrad_jax.{found.group(1)} does not export it"
  assert value is vars(room)[name]
  assert caught[0].filename == __file__, "the warning names the line that spelled the old name"


@pytest.mark.parametrize("name", NAMES_BEFORE_THE_ROOMS)
def test_every_name_of_0_1_0_resolves_to_the_same_object(name):
  _check_old_name(simigrad_jax, name)


@pytest.mark.parametrize("name", CONTROLLERS_BEFORE_THE_ROOMS)
def test_every_controllers_name_of_0_1_0_resolves_to_the_same_object(name):
  _check_old_name(importlib.import_module("simigrad_jax.controllers"), name)


def test_a_name_that_never_was_is_still_an_attribute_error():
  with pytest.raises(AttributeError, match="module 'simigrad_jax' has no attribute 'plan_btach'"):
    simigrad_jax.plan_btach  # noqa: B018
  with pytest.raises(ImportError, match="ProportionalController"):
    exec("from simigrad_jax.controllers import ProportionalController", {})


# Run in a fresh interpreter: an import warns once, when the old path first enters sys.modules.
OLD_PATHS_SCRIPT = """
import json, sys, warnings

import simigrad_jax

found = {}
for old in json.loads(sys.argv[1]):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    exec(f"import {old}")
    exec(f"import {old}")  # a second import: the module is in sys.modules, no warning
  module = sys.modules[old]
  found[old] = {
    "warnings": [[w.category.__name__, str(w.message), w.filename] for w in caught],
    "name": module.__name__,
    "spec": module.__spec__.name,
    "real": module is sys.modules.get(module.__name__),
    "file": module.__file__,
  }
print(json.dumps(found))
"""


def _run(script: str, *args: str):
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  result = subprocess.run(
    [sys.executable, "-c", script, *args],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.splitlines()[-1])


def test_every_module_path_of_0_1_0_is_the_moved_module():
  found = _run(OLD_PATHS_SCRIPT, json.dumps(OLD_PATHS))
  for old in OLD_PATHS:
    new = found[old]["name"]
    short = old.rpartition(".")[2]
    assert new.startswith("simigrad_jax.") and new.rpartition(".")[2] == RENAMED.get(short, short)
    assert found[old]["warnings"] == [
      ["DeprecationWarning", f"{old} moved to {new}; the old path goes in 0.3", "<string>"]
    ], old
    # The moved module itself, which keeps its own spec (its name, its file).
    assert found[old]["real"] and found[old]["spec"] == new, found[old]
    assert found[old]["file"] == str(ROOT / pathlib.Path(*new.split(".")).with_suffix(".py"))


OLD_SPELLINGS_SCRIPT = """
import importlib, json, warnings

import simigrad_jax
import simigrad_jax.trainer.metrics as metrics

result = {}
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  import simigrad_jax.engine.trainer
  from simigrad_jax.engine import layout
  hooks = simigrad_jax.engine.hooks  # an old module as an attribute, not yet imported
  from simigrad_jax.runtime.metrics import MetricsWriter
  import simigrad_jax.runtime.metrics as old_metrics
result["lines"] = sorted({w.lineno for w in caught})
result["warned"] = sorted(str(w.message).split(" moved")[0] for w in caught)
result["attribute"] = simigrad_jax.engine.trainer.Trainer is simigrad_jax.Trainer
result["from_package"] = layout is importlib.import_module("simigrad_jax.shapes.layout")
result["hooks"] = hooks is importlib.import_module("simigrad_jax.trainer.hooks")
result["class"] = MetricsWriter is simigrad_jax.trainer.MetricsWriter
old_metrics.METRICS_FILENAME = "patched.jsonl"  # a monkeypatch through the old path
result["patched"] = metrics.METRICS_FILENAME
result["reloaded"] = importlib.reload(metrics) is metrics
try:
  import simigrad_jax.engine.no_such_module
except ModuleNotFoundError as error:
  result["missing"] = str(error)
result["engine"] = simigrad_jax.engine.__doc__.split(",")[0]
print(json.dumps(result))
"""


def test_old_spellings_of_modules_work_as_0_1_0s_did():
  found = _run(OLD_SPELLINGS_SCRIPT)
  assert found == {
    "lines": [10, 11, 12, 13],  # each warning names the line that spelled the old path
    "warned": [
      "simigrad_jax.engine.hooks",
      "simigrad_jax.engine.layout",
      "simigrad_jax.engine.trainer",
      "simigrad_jax.runtime.metrics",
    ],
    "attribute": True,
    "from_package": True,
    "hooks": True,
    "class": True,
    "patched": "patched.jsonl",
    "reloaded": True,
    "missing": "No module named 'simigrad_jax.engine.no_such_module'",
    "engine": "Host: simigrad_jax.engine of 0.1.0",
  }


def test_the_finder_comes_after_the_finders_of_modules_that_exist():
  from simigrad_jax import moved

  ours = [
    i for i, finder in enumerate(sys.meta_path) if isinstance(finder, moved.MovedModuleFinder)
  ]
  assert len(ours) == 1 and ours[0] > sys.meta_path.index(importlib.machinery.PathFinder)
  moved.install()  # again: still one finder
  assert sum(isinstance(finder, moved.MovedModuleFinder) for finder in sys.meta_path) == 1


def test_the_old_names_are_the_same_as_in_the_changelog_and_the_module():
  from simigrad_jax import moved

  changelog = (ROOT / "CHANGELOG.md").read_text()
  release = changelog.split("\n## [0.2.0]", 1)[1].split("\n## [", 1)[0]
  assert sorted(moved.MOVED_MODULES) == OLD_PATHS
  for old, new in moved.MOVED_MODULES.items():
    assert f"`{old}` | `{new}`" in release, f"CHANGELOG's 0.2.0 does not list {old} -> {new}"
  for package, names in moved.MOVED_NAMES.items():
    for name, room in names.items():
      assert f"`{package}.{name}` | `{room}.{name}`" in release, (
        f"CHANGELOG's 0.2.0 does not list {package}.{name}"
      )


def test_the_module_examples_run():
  import doctest

  from simigrad_jax import moved

  assert doctest.testmod(moved).failed == 0


def test_the_module_moves_exactly_the_names_that_left():
  from simigrad_jax import moved

  controllers = importlib.import_module("simigrad_jax.controllers")
  assert set(moved.MOVED_NAMES) == {"simigrad_jax", "simigrad_jax.controllers"}
  assert set(moved.MOVED_NAMES["simigrad_jax"]) == set(NAMES_BEFORE_THE_ROOMS) - set(
    simigrad_jax.__all__
  )
  assert set(moved.MOVED_NAMES["simigrad_jax.controllers"]) == set(
    CONTROLLERS_BEFORE_THE_ROOMS
  ) - set(controllers.__all__)
