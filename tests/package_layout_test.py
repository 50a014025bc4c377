"""The package's rooms: imports go down the floors only, no import cycle, and a light core install.

Floors (docs/layout.md): the ground floor (``errors``, ``validation``,
``files``, ``ingraph/``: pure code that runs under jit, the checks and the
safe file writes everything shares); the host rooms that need only it
(``controllers/``, ``shapes/``, ``multihost/``, ``optimizer_state``); the rooms
built on those (``ramps/``, ``data/``, ``checkpoint/``, ``flax_nnx``);
``compile/``; the ``trainer/``; the command-line tools (``plot``, ``replay``);
the package's ``__init__`` on top.
"""

import ast
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import tomllib

import pytest
from packaging.requirements import Requirement

import simigrad_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "simigrad_jax"
FLOORS = {
  "errors": 0,
  "validation": 0,
  "files": 0,
  "ingraph": 0,
  "controllers": 1,
  "shapes": 1,
  "multihost": 1,
  "optimizer_state": 1,
  "ramps": 2,
  "data": 2,
  "checkpoint": 2,
  "flax_nnx": 2,
  "compile": 3,
  "trainer": 4,
  "plot": 5,
  "replay": 5,
  "__init__": 6,
}


def room(module: str) -> str:
  """``simigrad_jax.trainer.trainer`` -> ``engine``; the package itself -> ``__init__``."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else "__init__"


def modules() -> dict[str, pathlib.Path]:
  found = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    found[name] = path
  return found


def imports(path: pathlib.Path, top_level_only: bool) -> set[str]:
  """The simigrad_jax modules a file imports (``if TYPE_CHECKING:`` blocks excluded)."""
  tree = ast.parse(path.read_text())
  names = set()
  skip = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      skip.update(id(n) for n in ast.walk(node))
  body = tree.body if top_level_only else list(ast.walk(tree))
  for node in body:
    if id(node) in skip:
      continue
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("simigrad_jax"):
      for alias in node.names:  # `from simigrad_jax.engine import layout` imports a module
        full = f"{node.module}.{alias.name}"
        names.add(full if full in modules() else node.module)
    elif isinstance(node, ast.Import):
      names.update(a.name for a in node.names if a.name.startswith("simigrad_jax"))
  return names


def test_every_module_lives_in_a_known_room():
  assert {room(name) for name in modules()} <= set(FLOORS)


def test_imports_go_down_the_floors_only():
  wrong = []
  for name, path in modules().items():
    here = room(name)
    for imported in imports(path, top_level_only=False):
      there = room(imported)
      if there == here:
        continue
      if FLOORS[there] > FLOORS[here] or (FLOORS[there] == FLOORS[here] and FLOORS[here] > 0):
        wrong.append(f"{name} imports {imported}")
  assert not wrong, "imports that go up a floor or across a room:\n" + "\n".join(wrong)


def test_no_import_cycle():
  graph = {
    name: imports(path, top_level_only=False) & set(modules()) - {name}
    for name, path in modules().items()
  }
  # A package imports its own modules; only cycles between modules count.
  graph = {
    name: {
      m
      for m in deps
      if not name.startswith(m + ".") and not m.startswith(name + ".") or name == "simigrad_jax"
    }
    for name, deps in graph.items()
  }
  state: dict[str, int] = {}
  cycles = []

  def visit(node: str, path: list[str]) -> None:
    state[node] = 1
    for dep in sorted(graph[node]):
      if state.get(dep) == 1:
        cycles.append(" -> ".join(path[path.index(dep) :] + [dep]) if dep in path else dep)
      elif dep not in state:
        visit(dep, path + [dep])
    state[node] = 2

  for name in sorted(graph):
    if name not in state:
      visit(name, [name])
  assert not cycles, "import cycles:\n" + "\n".join(cycles)


# The limits that keep each room small enough to hold in one's head (docs/layout.md).
MAX_MODULES_PER_ROOM = 12
MAX_LINES_PER_ROOM = 3000
MAX_CLASS_LINES = 250


def test_every_room_is_small_enough_to_hold_in_ones_head():
  too_big = []
  for directory in sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").exists()):
    files = sorted(directory.rglob("*.py"))
    modules = [f for f in files if f.name != "__init__.py"]
    lines = sum(len(f.read_text().splitlines()) for f in files)
    if len(modules) > MAX_MODULES_PER_ROOM or lines > MAX_LINES_PER_ROOM:
      too_big.append(f"{directory.name}/: {len(modules)} modules, {lines} lines")
  assert not too_big, (
    f"rooms over {MAX_MODULES_PER_ROOM} modules or {MAX_LINES_PER_ROOM} lines: {too_big}"
  )


def test_no_class_is_over_250_lines():
  long = [
    f"{node.name} ({path.relative_to(ROOT)}: {node.end_lineno - node.lineno + 1} lines)"
    for path in modules().values()
    for node in ast.walk(ast.parse(path.read_text()))
    if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
  ]
  assert not long, f"classes over {MAX_CLASS_LINES} lines: {long}"


def test_simigrads_grow_and_shrink_factors_live_in_the_controllers_only():
  """The rule's 1.1 and 0.9 (the reference's grow and shrink) are the controllers' knowledge."""
  found = [
    f"{name} line {node.lineno}: {node.value}"
    for name, path in modules().items()
    if room(name) != "controllers"
    for node in ast.walk(ast.parse(path.read_text()))
    if isinstance(node, ast.Constant) and node.value in (1.1, 0.9) and type(node.value) is float
  ]
  assert not found, f"SimiGrad's factors outside controllers/: {found}"


# Trace-time context that only refuses misuse (docs/layout.md, "ingraph/"): the step's axis
# (a transform named for another axis) and a step that promises half gradients.
REFUSING_CONTEXT_VARIABLES = {"_STEP_AXIS", "_EXPECTING_HALF_GRADS"}


def test_no_context_variable_changes_what_the_package_computes():
  """optax's rule: a transformation's behaviour comes from its arguments and state only."""
  found = {
    target.id
    for path in modules().values()
    for node in ast.walk(ast.parse(path.read_text()))
    if isinstance(node, ast.Assign) and "ContextVar" in ast.unparse(node.value)
    for target in node.targets
    if isinstance(target, ast.Name)
  }
  assert found <= REFUSING_CONTEXT_VARIABLES, sorted(found - REFUSING_CONTEXT_VARIABLES)


def _dist_names(requirements: list[str], extras: tuple[str, ...] = ()) -> set[str]:
  """The installed distributions these requirements pull in, transitively (extras of others not)."""
  seen: set[str] = set()
  todo = [Requirement(r) for r in requirements]
  while todo:
    req = todo.pop()
    if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
      continue
    name = re.sub(r"[-_.]+", "-", req.name).lower()
    if name in seen or name == "simigrad-jax":
      continue
    seen.add(name)
    try:
      todo.extend(Requirement(r) for r in importlib.metadata.requires(name) or [])
    except importlib.metadata.PackageNotFoundError:
      pass
    todo = [r for r in todo if r.marker is None or r.marker.evaluate({"extra": ""})]
  return seen


def _project() -> dict:
  return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _extras_only_dists() -> set[str]:
  """What the extras install and the core install does not (the TensorFlow extra aside)."""
  project = _project()
  extra = _dist_names(
    [
      r
      for name, reqs in project["optional-dependencies"].items()
      for r in reqs
      if name != "tensorflow" and not r.startswith("simigrad-jax")
    ]
  )
  return extra - _dist_names(project["dependencies"])


def _core_site(directory: pathlib.Path) -> pathlib.Path:
  """A site directory holding only the core install's distributions (links to the installed files)."""
  directory.mkdir()
  for name in _dist_names(_project()["dependencies"]):
    dist = importlib.metadata.distribution(name)
    for top in {pathlib.PurePath(f).parts[0] for f in dist.files or []}:
      source = pathlib.Path(dist.locate_file(top))
      if not top.startswith("..") and source.exists() and not (directory / top).exists():
        (directory / top).symlink_to(source)
  return directory


def test_the_extras_are_not_needed_by_the_core():
  extras_only = _extras_only_dists()
  for dist in (
    "flax",
    "tensorflow-datasets",
    "grain",
    "matplotlib",
    "tensorboardx",
    "scikit-learn",
    "ml-collections",
    "pytest",
  ):
    assert dist in extras_only, f"{dist} comes with the core install; it belongs to an extra"


def test_the_library_works_without_the_extras(tmp_path):
  """A fresh interpreter that sees only the core install runs the transform, controller and metrics."""
  site = _core_site(tmp_path / "site")
  script = textwrap.dedent(f"""
      import os, sys
      os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
      os.environ["JAX_PLATFORMS"] = "cpu"
      for name in ("flax", "tensorflow_datasets", "grain", "matplotlib", "tensorboardX", "sklearn"):
        try:
          __import__(name)
        except ModuleNotFoundError:
          pass
        else:
          raise AssertionError(name + " is importable: the test sees more than the core install")
      import jax, jax.numpy as jnp, numpy as np, optax
      from jax.sharding import Mesh, PartitionSpec as P
      import simigrad_jax

      mesh = Mesh(np.array(jax.devices()), ("batch",))
      optimizer = optax.chain(simigrad_jax.transform("batch"), optax.sgd(0.1),
                              simigrad_jax.scale_by_lr_factor())
      params = {{"w": jnp.zeros((3,))}}
      opt_state = optimizer.init(params)

      def step(params, opt_state, x, y):
        own = jax.lax.pcast(params, "batch", to="varying")  # this device's own gradient
        grads = jax.grad(lambda p: jnp.mean((x @ p["w"] - y) ** 2))(own)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

      step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("batch"), P("batch")),
                                   out_specs=(P(), P())))
      x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
      params, opt_state = step(params, opt_state, x, x @ np.array([1.0, -2.0, 0.5], np.float32))
      s = simigrad_jax.similarity(opt_state)
      assert -1 <= s <= 1 and s != 1.0, s
      controller = simigrad_jax.Controller(16, 0.5, batch_size_lower_bound=8,
                                           batch_size_upper_bound=64)
      opt_state = simigrad_jax.set_lr_factor(opt_state, simigrad_jax.lr_factor(
          controller.update(s), 16))
      with simigrad_jax.MetricsWriter("{tmp_path}/run") as writer:
        writer.write({{"step": 1, "similarity": s}})
      assert not os.path.exists("{tmp_path}/run/tensorboard")
      print("ok", s)
      """)
  env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{ROOT}")
  env.pop("XLA_FLAGS", None)
  # -S: no site-packages; the interpreter sees the standard library, the core site and the project.
  result = subprocess.run(
    [sys.executable, "-S", "-c", script], env=env, capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith("ok")


def test_tensorboard_true_without_tensorboardx_says_which_extra(tmp_path, monkeypatch):
  from simigrad_jax.trainer import metrics

  monkeypatch.setattr(metrics.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(ModuleNotFoundError, match=r"simigrad-jax\[tensorboard\]"):
    metrics.MetricsWriter(tmp_path, tensorboard=True)
  assert not metrics.tensorboard_available(None)


def test_every_error_derives_from_simigrad_error_and_is_exported():
  errors = []
  for path in modules().values():
    for node in ast.walk(ast.parse(path.read_text())):
      if (
        isinstance(node, ast.ClassDef)
        and node.name.endswith("Error")
        and not node.name.startswith("_")
      ):
        errors.append(node.name)
  assert len(errors) >= 7
  for name in errors:
    assert name in simigrad_jax.__all__, f"{name} is not exported from simigrad_jax"
    error = getattr(simigrad_jax, name)
    assert issubclass(error, simigrad_jax.SimiGradError)
    assert error is simigrad_jax.SimiGradError or issubclass(error, (ValueError, RuntimeError)), (
      name
    )


def test_the_package_docstring_names_every_export():
  doc = simigrad_jax.__doc__
  missing = [name for name in simigrad_jax.__all__ if not re.search(rf"\b{name}\b", doc)]
  assert not missing, f"the package docstring does not mention {missing}"


# Every name simigrad_jax exported before the package was split into rooms (version 0.1.0).
NAMES_BEFORE_THE_ROOMS = (
  "ArraySource",
  "BadRecordError",
  "BatchPlan",
  "BucketPolicy",
  "CheckpointMismatchError",
  "Checkpointer",
  "Controller",
  "EpochSampler",
  "GrainSource",
  "HalfGrads",
  "HalvesContractError",
  "LrFactorState",
  "MetricsWriter",
  "ProcessDisagreementError",
  "ProcessLostError",
  "ProgressBar",
  "SimilarityState",
  "StepCompileError",
  "StepCompiler",
  "TfdsSource",
  "Trainer",
  "bucket_shapes",
  "controller_names",
  "controller_options",
  "enable_persistent_cache",
  "exit_on_lost_process",
  "lr_factor",
  "lr_factor_of",
  "make_controller",
  "persistent_cache_settings",
  "plan_batch",
  "read_metrics",
  "register_controller",
  "representable_batch_sizes",
  "scale_by_lr_factor",
  "set_lr_factor",
  "similarity",
  "similarity_stats",
  "simulated_cpu_devices_env",
  "transform",
  "value_and_half_grads",
)


@pytest.mark.parametrize("name", NAMES_BEFORE_THE_ROOMS)
def test_every_name_exported_before_still_imports(name):
  assert name in simigrad_jax.__all__
  assert getattr(simigrad_jax, name) is not None


def test_all_lists_what_the_package_holds():
  assert sorted(simigrad_jax.__all__) == sorted(set(simigrad_jax.__all__))
  for name in simigrad_jax.__all__:
    assert hasattr(simigrad_jax, name), name
