"""The release's habits: one version, written once and reported everywhere, and a changelog that names it."""

import ast
import datetime
import importlib.metadata
import json
import pathlib
import re
import tomllib

import pytest

import simigrad_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHANGE_TYPES = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")


def _pyproject() -> dict:
  return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _written_version() -> str:
  """The string literal simigrad_jax/__init__.py assigns to __version__ (read, not imported)."""
  tree = ast.parse((ROOT / "simigrad_jax" / "__init__.py").read_text())
  values = [
    node.value
    for node in tree.body
    if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__version__"]
  ]
  assert len(values) == 1 and isinstance(values[0], ast.Constant), "__version__ is not one literal"
  return values[0].value


def test_the_version_is_written_once_and_read_by_the_build():
  pyproject = _pyproject()
  assert "version" not in pyproject["project"], "pyproject.toml writes the version a second time"
  assert "version" in pyproject["project"]["dynamic"]
  assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {
    "attr": "simigrad_jax.__version__"
  }
  assert simigrad_jax.__version__ == _written_version()
  assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.dev\d+)?", simigrad_jax.__version__)


def test_an_install_of_this_checkout_reports_the_same_version():
  try:
    dist = importlib.metadata.distribution("simigrad-jax")
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("simigrad-jax is not installed (the tests run from the checkout)")
  # An editable install leaves its metadata in the checkout; a wheel's names where it came from.
  here = pathlib.Path(dist.locate_file("")).resolve() == ROOT
  origin = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
  if not here and origin.removeprefix("file://") != str(ROOT):
    pytest.skip(f"the installed simigrad-jax comes from {origin or 'elsewhere'}, not this checkout")
  assert dist.version == simigrad_jax.__version__, (
    "the install is older than the checkout's version"
  )


def _changelog_sections() -> list[tuple[str, str | None, str]]:
  """``(version, date, body)`` of each ``## [version] - date`` section, in the file's order."""
  text = (ROOT / "CHANGELOG.md").read_text()
  assert text.startswith("# Changelog\n")
  parts = re.split(r"^## (.*)$", text, flags=re.M)[1:]
  sections = []
  for heading, body in zip(parts[::2], parts[1::2], strict=True):
    match = re.fullmatch(r"\[(Unreleased|[^\]]+)\](?: - (\d{4}-\d{2}-\d{2}))?", heading)
    assert match, f"CHANGELOG.md heading {heading!r} is not '[version] - YYYY-MM-DD'"
    sections.append((match.group(1), match.group(2), body))
  return sections


def test_the_changelog_keeps_a_changelog_and_names_this_version():
  sections = _changelog_sections()
  assert sections[0][:2] == ("Unreleased", None), "the first section is [Unreleased]"
  releases = sections[1:]
  assert releases, "the changelog names no release"
  assert releases[0][0] == simigrad_jax.__version__, (
    f"the newest release in CHANGELOG.md is {releases[0][0]}, the package is "
    f"{simigrad_jax.__version__}"
  )
  dates = [datetime.date.fromisoformat(date) for version, date, _ in releases if date]
  assert len(dates) == len(releases), "every release has a date"
  assert dates == sorted(dates, reverse=True), "releases go from the newest down"
  for version, _, body in sections:
    kinds = re.findall(r"^### (.*)$", body, flags=re.M)
    assert (kinds or version == "Unreleased") and set(kinds) <= set(CHANGE_TYPES), (
      f"[{version}] has the subsections {kinds}; Keep a Changelog's are {CHANGE_TYPES}"
    )
    assert len(kinds) == len(set(kinds)), f"[{version}] repeats a subsection"
