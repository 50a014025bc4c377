"""0.3.0 removed the spellings 0.2.0 deprecated: each is gone, what replaces it works, and
CHANGELOG.md's 0.3.0 lists every one beside its replacement.

The old spellings were 0.1.0's names and module paths that 0.2.0 moved to rooms
(``simigrad_jax.plan_batch``, ``simigrad_jax.engine.trainer``), served by
``simigrad_jax.moved`` with a ``DeprecationWarning``, and the Trainer's settings as
its keywords. 0.3.0 also took the rooms' internals out of their ``__init__``
and moved controllers by name to ``simigrad_jax.registry``.
"""

import importlib
import pathlib
import re
import sys

import pytest

import simigrad_jax
from package_layout_test import resolves

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _release_notes(version: str) -> str:
  changelog = (ROOT / "CHANGELOG.md").read_text()
  return changelog.split(f"\n## [{version}]", 1)[1].split("\n## [", 1)[0]


def _removed() -> list[tuple[str, str]]:
  """``(removed, replacement)`` of every row of the 0.3.0 tables."""
  return re.findall(r"^\| `([^`]+)` \| `([^`]+)` \|$", _release_notes("0.3.0"), re.M)


def test_the_changelog_lists_every_removed_spelling_with_its_replacement():
  removed = dict(_removed())
  assert len(removed) == len(_removed()), "a spelling listed twice"
  # 0.2.0's tables of what moved, each row removed now.
  moved = re.findall(r"^\| `([^`]+)` \| `[^`]+` \|$", _release_notes("0.2.0"), re.M)
  assert len(moved) == 75 and set(moved) <= set(removed)
  assert "simigrad_jax.controllers.base.BatchSizeController" in removed
  notes = _release_notes("0.3.0")
  for words in ("simigrad_jax.moved", "config=TrainerConfig(", "TrainerConfig.from_settings"):
    assert words in notes, words


@pytest.mark.parametrize("old, new", _removed())
def test_each_removed_spelling_is_gone_and_its_replacement_works(old, new):
  assert not resolves(old) and resolves(new)


def test_no_finder_or_getattr_makes_up_names():
  assert "simigrad_jax.moved" not in sys.modules
  assert not any("Moved" in type(finder).__name__ for finder in sys.meta_path)
  assert "__getattr__" not in vars(simigrad_jax)
  assert "__getattr__" not in vars(importlib.import_module("simigrad_jax.controllers"))


def test_a_name_that_never_was_is_still_an_attribute_error():
  with pytest.raises(AttributeError, match="module 'simigrad_jax' has no attribute 'plan_btach'"):
    simigrad_jax.plan_btach  # noqa: B018
  with pytest.raises(ImportError, match="ProportionalController"):
    exec("from simigrad_jax.controllers import ProportionalController", {})


def test_the_trainer_takes_no_settings_as_keywords():
  import inspect

  parameters = inspect.signature(simigrad_jax.Trainer).parameters.values()
  assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
  assert not hasattr(simigrad_jax.TrainerConfig, "from_settings")
