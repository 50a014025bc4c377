"""README.md and docs/*.md: every Python block runs as written, links and named paths resolve, the layout is whole."""

import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = {
  path.relative_to(ROOT).as_posix(): path.read_text()
  for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
}
PYTHON_BLOCKS = {
  f"{name}:{number}": block
  for name, text in PAGES.items()
  for number, block in enumerate(re.findall(r"^```python\n(.*?)^```", text, re.S | re.M), start=1)
}
LINK = re.compile(r"\]\(([^)\s]+)\)")
REPOSITORY_JSON = re.compile(
  r"(?<![\w/.~<>{}-])((?:[\w-]+/)+[\w-]+\.json)\b"
)  # benchmarks/x/y.json
RESULTS = ROOT / "benchmarks" / "results"


def test_quick_start_has_two_commands_and_ci_runs_the_test_line():
  block = re.search(r"^## Quick start\n.*?^```bash\n(.*?)^```", README, re.S | re.M).group(1)
  lines = [line for line in block.splitlines() if line.strip()]
  assert len(lines) == 2
  assert lines[1] in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("block_id", sorted(PYTHON_BLOCKS))
def test_python_block_runs(block_id, tmp_path):
  script = tmp_path / "block.py"
  script.write_text(PYTHON_BLOCKS[block_id])
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  env.pop("XLA_FLAGS", None)  # the block sets what it needs, as a user's fresh shell would
  result = subprocess.run(
    [sys.executable, str(script)],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-3000:]


def heading_anchors(text: str) -> set[str]:
  """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as '-'."""
  anchors, seen = set(), {}
  for heading in re.findall(
    r"^#+ (.*)$", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), re.M
  ):
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
    seen[slug] = seen.get(slug, 0) + 1
  return anchors


@pytest.mark.parametrize("page", sorted(PAGES))
def test_relative_links_and_anchors_resolve(page):
  broken = []
  for target in LINK.findall(re.sub(r"^```.*?^```", "", PAGES[page], flags=re.S | re.M)):
    if re.match(r"[a-z]+:", target):
      continue
    path, _, anchor = target.partition("#")
    file = (ROOT / page).parent / path if path else ROOT / page
    if not file.exists():
      broken.append(target)
    elif anchor and anchor not in heading_anchors(file.read_text()):
      broken.append(target)
  assert not broken, f"{page}: links that lead nowhere: {broken}"


@pytest.mark.parametrize("page", sorted(PAGES))
def test_result_json_is_referenced_where_it_lies_in_benchmarks_results(page):
  """A link to a JSON file, a repository path to one, or a command's input names a result there."""
  text = PAGES[page]
  prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
  linked = [
    ((ROOT / page).parent / target).resolve()
    for target in LINK.findall(prose)
    if target.partition("#")[0].endswith(".json") and not re.match(r"[a-z]+:", target)
  ]
  read = re.findall(r"--(?:reuse|markdown) ([\w-]+/\S+\.json)\b", text)  # a command reads it
  named = [ROOT / path for path in REPOSITORY_JSON.findall(prose) + read]
  wrong = [
    path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    for path in linked + named
    if path.parent != RESULTS or not path.exists()
  ]
  assert not wrong, f"{page}: result JSON not found in benchmarks/results/: {wrong}"


def resolves(dotted: str) -> bool:
  """Whether ``a.b.c`` is a module, or attributes of the longest prefix of it that imports."""
  parts = dotted.split(".")
  for end in range(len(parts), 0, -1):
    try:
      value = importlib.import_module(".".join(parts[:end]))
    except ImportError:
      continue
    for name in parts[end:]:
      if not hasattr(value, name):
        return False
      value = getattr(value, name)
    return True
  return False


@pytest.mark.parametrize("page", sorted(PAGES))
def test_repository_paths_and_modules_named_in_prose_exist(page):
  """`simigrad_jax/...`, `tests/...`, `train/...`, `benchmarks/...` and `simigrad_jax.x.y` are there."""
  prose = re.sub(r"^```.*?^```", "", PAGES[page], flags=re.S | re.M)
  paths = re.findall(r"`((?:simigrad_jax|tests|train|benchmarks)/[\w./-]*)`", prose)
  missing = [path for path in paths if not (ROOT / path).exists()]
  names = set(re.findall(r"\bsimigrad_jax(?:\.\w+)+", prose))
  missing += sorted(
    name
    for name in names
    if not any(part.isupper() for part in name.split("."))  # simigrad_jax.NAME stands for one
    and not resolves(name)
  )
  assert not missing, f"{page} names what is not there (moved or renamed?): {missing}"


def test_layout_page_names_every_module_of_the_package():
  layout = PAGES["docs/layout.md"]
  package = ROOT / "simigrad_jax"
  modules = [
    path.relative_to(package).as_posix()
    for path in package.rglob("*.py")
    if path.parent == package or path.name != "__init__.py"
  ]
  missing = [module for module in sorted(modules) if f"`{module}`" not in layout]
  assert not missing, f"docs/layout.md does not describe {missing}"
