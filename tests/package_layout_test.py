"""The package's rooms and its public face.

Imports go down the floors only, never between two rooms of a floor, with no
import cycle anywhere in the library, the training scripts or the benchmarks
(an import inside a function or under ``if TYPE_CHECKING:`` counts as much as
one at the top), and the core install is light. Floors (docs/layout.md): the
ground floor (``ingraph/`` on ``reductions/`` and ``validation``: pure code that runs under jit;
``errors``, ``validation``, ``files``: the base error, the checks and the safe
file writes everything shares); the host rooms that need only it
(``controllers/``, ``shapes/``, ``multihost/``, ``optimizer_state``); the rooms
built on those (``ramps/``, ``data/``, ``checkpoint/``, ``flax_nnx``);
``compile/`` and ``registry`` (the controllers and ramps by name); the
``trainer/``; the command-line tools (``plot``, ``replay``, ``cluster_time/``);
the package's ``__init__`` on top. The training scripts (``train/``) stand on
the library and the benchmarks on both.

The public face: ``simigrad_jax.__all__`` is a sorted list of the names a user
types; every other name is imported from its room, whose ``__init__``
documents it; every error from the room that raises it. The training scripts
and the benchmarks use those, or a module's own names where they need an
internal.
"""

import ast
import doctest
import importlib
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
  "reductions": 0,
  "controllers": 1,
  "shapes": 1,
  "multihost": 1,
  "optimizer_state": 1,
  "ramps": 2,
  "data": 2,
  "checkpoint": 2,
  "flax_nnx": 2,
  "compile": 3,
  "registry": 3,
  "trainer": 4,
  "plot": 5,
  "replay": 5,
  "cluster_time": 5,
  "__init__": 6,
}
# The ground floor's rooms import none of each other but in the directions docs/layout.md draws:
# ingraph/ stands on reductions/ and on validation (the argument checks every room shares).
GROUND_FLOOR_DIRECTIONS = {("ingraph", "reductions"), ("ingraph", "validation")}
# errors.py holds SimiGradError, the base class of every room's errors: every room imports it.
BASE_OF_EVERY_ERROR = "errors"
# The project's folders of Python code, each standing on those before it.
FOLDERS = ("simigrad_jax", "train", "benchmarks")


def room(module: str) -> str:
  """``simigrad_jax.trainer.trainer`` -> ``trainer``; the package itself -> ``__init__``."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else "__init__"


def modules(folder: str = "simigrad_jax") -> dict[str, pathlib.Path]:
  """``{dotted name: file}`` of a folder's modules (a package named by its ``__init__.py``)."""
  found = {}
  for path in sorted((ROOT / folder).rglob("*.py")):
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    found[name] = path
  return found


def project_modules() -> dict[str, pathlib.Path]:
  return {name: path for folder in FOLDERS for name, path in modules(folder).items()}


def imports(path: pathlib.Path, known: set[str]) -> set[str]:
  """The project's modules a file imports, at its top, inside functions and under
  ``if TYPE_CHECKING:`` alike (each one of ``known``, the modules that exist)."""

  def module_of(dotted: str) -> str:  # the longest known prefix: `a.b.C` names module `a.b`
    while dotted not in known and "." in dotted:
      dotted = dotted.rpartition(".")[0]
    return dotted

  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      if node.module.split(".")[0] in FOLDERS:
        for alias in node.names:  # `from simigrad_jax.shapes import layout` imports a module
          names.add(module_of(f"{node.module}.{alias.name}"))
    elif isinstance(node, ast.Import):
      names.update(module_of(a.name) for a in node.names if a.name.split(".")[0] in FOLDERS)
  return names & known


def test_every_module_lives_in_a_known_room():
  assert {room(name) for name in modules()} <= set(FLOORS)


def test_imports_go_down_the_floors_only():
  known = set(project_modules())
  wrong = []
  for name, path in modules().items():
    here = room(name)
    for imported in imports(path, known):
      if not imported.startswith("simigrad_jax"):
        wrong.append(f"{name} imports {imported}, outside the library")
        continue
      there = room(imported)
      if there == here or there == BASE_OF_EVERY_ERROR:
        continue
      if FLOORS[there] > FLOORS[here] or (
        FLOORS[there] == FLOORS[here] and (here, there) not in GROUND_FLOOR_DIRECTIONS
      ):
        wrong.append(f"{name} imports {imported}")
  assert not wrong, "imports that go up a floor or across a room:\n" + "\n".join(wrong)


def test_the_training_scripts_do_not_import_the_benchmarks():
  known = set(project_modules())
  wrong = [
    f"{name} imports {imported}"
    for name, path in modules("train").items()
    for imported in imports(path, known)
    if imported.split(".")[0] == "benchmarks"
  ]
  assert not wrong, wrong


def _cycles(graph: dict[str, set[str]]) -> list[str]:
  """Every import cycle of ``graph`` that a depth-first search meets, as ``a -> b -> a``."""
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
  return cycles


def _import_graph() -> dict[str, set[str]]:
  """Who imports whom, between the modules of the library, the scripts and the benchmarks.

  A package's ``__init__`` imports its own modules, and a module the package it belongs to
  (which Python has imported first): only the edges between modules count.
  """
  found = project_modules()
  known = set(found)
  return {
    name: {
      m
      for m in imports(path, known) - {name}
      if not name.startswith(m + ".") and not m.startswith(name + ".")
    }
    for name, path in found.items()
  }


def test_no_import_cycle():
  cycles = _cycles(_import_graph())
  assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_cycle_check_sees_imports_in_functions_and_under_type_checking(tmp_path):
  first = tmp_path / "first.py"
  first.write_text("def f():\n  from simigrad_jax.data import stream_reader\n")
  second = tmp_path / "second.py"
  second.write_text(
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  from simigrad_jax.data.sources import X\n"
  )
  known = {"simigrad_jax.data.stream_reader", "simigrad_jax.data.sources"}
  assert imports(first, known) == {"simigrad_jax.data.stream_reader"}
  assert imports(second, known) == {"simigrad_jax.data.sources"}
  assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == ["a -> b -> a"]


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
      with simigrad_jax.trainer.MetricsWriter("{tmp_path}/run") as writer:
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


ROOM_PACKAGES = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
# The rooms a user imports from: the subpackages and the modules of the package's own folder.
ROOMS = sorted(set(FLOORS) - {"__init__"})


def _room(name: str):
  return importlib.import_module(f"simigrad_jax.{name}")


def test_the_public_face_is_sorted_and_whole():
  names = simigrad_jax.__all__
  assert names == sorted(set(names)), "simigrad_jax.__all__ is not sorted, or repeats a name"
  # Held by the package itself: it has no __getattr__ that makes up names.
  assert "__getattr__" not in vars(simigrad_jax)
  missing = [name for name in names if name not in vars(simigrad_jax)]
  assert not missing, f"simigrad_jax.__all__ lists {missing}, which the package does not hold"


def test_the_package_docstring_names_every_export_and_room():
  doc = simigrad_jax.__doc__
  missing = [name for name in simigrad_jax.__all__ if not re.search(rf"\b{name}\b", doc)]
  assert not missing, f"the package docstring does not mention {missing}"
  rooms = [room for room in ROOM_PACKAGES if f"simigrad_jax.{room}" not in doc]
  assert not rooms, f"the package docstring does not name the rooms {rooms}"


@pytest.mark.parametrize("room", ROOM_PACKAGES)
def test_each_room_documents_its_api(room):
  """A room's ``__all__`` is sorted, held, named in its docstring, and hides none of its modules."""
  package = _room(room)
  names = package.__all__
  assert names == sorted(set(names))
  submodules = {path.stem for path in (PACKAGE / room).glob("*.py")}
  for name in names:
    assert name in vars(package), (
      f"simigrad_jax.{room}.__all__ lists {name}, which it does not hold"
    )
    assert re.search(rf"\b{name}\b", package.__doc__), (
      f"simigrad_jax.{room}'s docstring omits {name}"
    )
    # `from simigrad_jax.ingraph import transform` would give the function, not the module.
    assert name not in submodules, f"simigrad_jax.{room}.{name} hides the module of that name"
  assert doctest.testmod(package).failed == 0


def test_the_rooms_hide_no_module_behind_a_name():
  """After the rooms' re-exports, each module is still its room's attribute of that name."""
  for name in modules():
    if "." in name.removeprefix("simigrad_jax."):
      parent, _, child = name.rpartition(".")
      assert getattr(importlib.import_module(parent), child) is importlib.import_module(name), name


def _errors() -> dict[str, str]:
  """``{error class: module}`` of the package's errors: its public classes named ``...Error``
  and every class that derives from one of them."""
  classes = {}
  for module, path in modules().items():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
        classes[node.name] = (module, {ast.unparse(base) for base in node.bases})
  errors = {name for name in classes if name.endswith("Error")}
  while grown := {n for n, (_, bases) in classes.items() if bases & errors} - errors:
    errors |= grown
  return {name: classes[name][0] for name in sorted(errors)}


def test_every_error_derives_from_simigrad_error_and_is_exported_by_its_room():
  errors = _errors()
  assert len(errors) >= 13 and "Preempted" in errors
  for name, module in errors.items():
    home = room(module)
    package = _room(home)
    assert name in package.__all__, f"{name} is not exported by simigrad_jax.{home}"
    error = vars(package)[name]
    assert issubclass(error, simigrad_jax.SimiGradError)
    # A bad value, a failed run, or (OSError, with its errno) a file system that failed under it.
    builtin = (ValueError, RuntimeError, OSError)
    assert error is simigrad_jax.SimiGradError or issubclass(error, builtin), name
    assert f"simigrad_jax.{home}.{name}" in simigrad_jax.errors.__doc__, (
      f"simigrad_jax.errors does not say where {name} is imported from"
    )
  # The top level holds the base class and the error a run ends with on a signal.
  top = [name for name in simigrad_jax.__all__ if name in errors]
  assert top == ["Preempted", "SimiGradError"]
  assert doctest.testmod(simigrad_jax.errors).failed == 0


def resolves(spelled: str) -> bool:
  """Whether ``a.b.c`` names something that exists (a module, or an attribute of the longest
  module that imports), none of its parts private."""
  parts = spelled.split(".")
  if any(part.startswith("_") and not part.startswith("__") for part in parts):
    return False
  for i in range(len(parts), 0, -1):
    try:
      found: object = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    for attr in parts[i:]:
      if not hasattr(found, attr):
        return False
      found = getattr(found, attr)
    return True
  return False


def _spelling_errors(source: str, label: str) -> list[str]:
  """Where ``source`` imports or uses a simigrad_jax name that does not exist, or a private one."""
  wrong: list[tuple[int, str]] = []

  def check(line: int, spelled: str) -> None:
    if not resolves(spelled):
      wrong.append((line, f"{label}:{line}: {spelled}"))

  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("simigrad_jax"):
      for alias in node.names:
        check(node.lineno, f"{node.module}.{alias.name}")
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.startswith("simigrad_jax."):
          check(node.lineno, alias.name)
    elif isinstance(node, ast.Attribute):
      spelled = ast.unparse(node)
      inner = node.value
      if isinstance(inner, ast.Name) and inner.id == "simigrad_jax":
        check(node.lineno, spelled)
      elif (
        isinstance(inner, ast.Attribute)
        and ast.unparse(inner.value) == "simigrad_jax"
        and inner.attr in set(ROOMS) - set(simigrad_jax.__all__)
      ):
        check(node.lineno, spelled)
  return [message for _, message in sorted(wrong)]


def test_the_scripts_and_benchmarks_use_names_that_exist():
  wrong = []
  for folder in ("train", "benchmarks"):
    for path in sorted((ROOT / folder).rglob("*.py")):
      wrong += _spelling_errors(path.read_text(), str(path.relative_to(ROOT)))
  assert not wrong, "names that do not exist, or private ones:\n" + "\n".join(wrong)


def test_the_spelling_check_sees_missing_and_private_names():
  source = textwrap.dedent("""
    import simigrad_jax
    import simigrad_jax.shapes
    from simigrad_jax import Trainer
    from simigrad_jax.shapes import plan_batch
    from simigrad_jax.shapes.layout import StepLayout
    import simigrad_jax.trainer.metrics
    simigrad_jax.transform, simigrad_jax.compile.StepCompiler, simigrad_jax.Checkpointer
    simigrad_jax.shapes.layout.StepLayout
    from simigrad_jax.engine import layout
    from simigrad_jax.controllers import make_controller
    from simigrad_jax.shapes.layout import _private
    """)
  assert _spelling_errors(source, "script.py") == [
    "script.py:8: simigrad_jax.Checkpointer",
    "script.py:10: simigrad_jax.engine.layout",
    "script.py:11: simigrad_jax.controllers.make_controller",
    "script.py:12: simigrad_jax.shapes.layout._private",
  ]
