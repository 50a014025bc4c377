"""Every docstring example of the package runs and prints what it says.

The modules' own tests run some of them beside the code they describe; this
runs all of them, so that an example no test reads cannot rot. The examples
run on the 8 CPU devices of ``conftest.py``; those that write files are
given a ``workdir``, and the environment is put back after each module.
"""

from __future__ import annotations

import doctest
import importlib
import os
import pkgutil
from unittest import mock

import pytest

import simigrad_jax

PACKAGE = sorted(
  name
  for _, name, _ in pkgutil.walk_packages(simigrad_jax.__path__, "simigrad_jax.")
  if not name.endswith("__main__")
)


def _has_examples(name: str) -> bool:
  """Whether the module has an example to run (one not marked ``+SKIP``)."""
  tests = doctest.DocTestFinder().find(importlib.import_module(name))
  return any(not e.options.get(doctest.SKIP) for test in tests for e in test.examples)


MODULES = [name for name in PACKAGE if _has_examples(name)]


def test_the_sweep_sees_the_package():
  assert len(PACKAGE) > 80 and len(MODULES) > 60
  assert "simigrad_jax.controllers.token_allowance" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_run(name, tmp_path):
  module = importlib.import_module(name)
  with mock.patch.dict(os.environ):  # an example that sets a variable leaves no trace
    result = doctest.testmod(
      module, extraglobs={"workdir": str(tmp_path)}, optionflags=doctest.ELLIPSIS, verbose=False
    )
  assert result.attempted > 0, f"{name}: no example ran"
  assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
