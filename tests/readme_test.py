"""Every Python code block in README.md runs as written, and the Quick start is what CI runs."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PYTHON_BLOCKS = re.findall(r"^```python\n(.*?)^```", README, re.S | re.M)


def test_quick_start_has_two_commands_and_ci_runs_the_test_line():
  block = re.search(r"^## Quick start\n.*?^```bash\n(.*?)^```", README, re.S | re.M).group(1)
  lines = [line for line in block.splitlines() if line.strip()]
  assert len(lines) == 2
  assert lines[1] in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_readme_python_block_runs(index, tmp_path):
  assert PYTHON_BLOCKS, "README has no Python code block"
  script = tmp_path / f"block_{index}.py"
  script.write_text(PYTHON_BLOCKS[index])
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  env.pop("XLA_FLAGS", None)  # the block sets what it needs, as a user's fresh shell would
  result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
