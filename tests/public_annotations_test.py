"""Every public function and method of simigrad_jax is annotated whole.

mypy (``.ci/lint``) checks the annotations that exist and refuses a function
annotated in part; this test finds the public ones annotated not at all, which
mypy lets pass: module-level functions and classes without a leading
underscore, their public methods and properties, and ``__init__``,
``__call__``, ``__enter__`` and ``__exit__``.
"""

import importlib
import inspect
import pkgutil

import simigrad_jax

DUNDERS = ("__init__", "__call__", "__enter__", "__exit__")


def _missing(function, *, needs_return: bool) -> list[str]:
  """The parameters (and ``return``) of ``function`` that have no annotation."""
  signature = inspect.signature(function)
  missing = [
    name
    for name, parameter in signature.parameters.items()
    if name not in ("self", "cls") and parameter.annotation is inspect.Parameter.empty
  ]
  if needs_return and signature.return_annotation is inspect.Signature.empty:
    missing.append("return")
  return missing


def _methods(cls: type):
  """``(name, function)`` of the public methods, properties and dunders ``cls`` itself defines."""
  for name, member in vars(cls).items():
    if name.startswith("_") and name not in DUNDERS:
      continue
    if isinstance(member, (staticmethod, classmethod)):
      member = member.__func__
    elif isinstance(member, property):
      member = member.fget
    # Functions the class defines (not, e.g., the __init__ that typing.Protocol puts there).
    if inspect.isfunction(member) and member.__qualname__.startswith(f"{cls.__qualname__}."):
      yield name, member


def _public_modules():
  yield simigrad_jax
  for info in pkgutil.walk_packages(simigrad_jax.__path__, "simigrad_jax."):
    if not info.name.endswith("__main__"):
      yield importlib.import_module(info.name)


def test_every_public_function_and_method_is_annotated():
  unannotated = {}
  for module in _public_modules():
    for name, obj in vars(module).items():
      if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
        continue
      if inspect.isfunction(obj):
        found = {name: _missing(obj, needs_return=True)}
      elif inspect.isclass(obj):
        found = {
          f"{name}.{method}": _missing(function, needs_return=method != "__init__")
          for method, function in _methods(obj)
        }
      else:
        continue
      unannotated.update(
        {f"{module.__name__}.{where}": what for where, what in found.items() if what}
      )
  assert not unannotated, f"not annotated: {unannotated}"


def test_the_check_sees_a_method_left_unannotated():
  class Example:
    def __init__(self, size: int):
      self.size = size

    def grow(self, by):
      return self.size + by

    @property
    def double(self) -> int:
      return 2 * self.size

  assert dict(
    (name, _missing(f, needs_return=name != "__init__")) for name, f in _methods(Example)
  ) == {"__init__": [], "grow": ["by", "return"], "double": []}
