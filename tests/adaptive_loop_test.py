"""docs/adaptive_loop.md: a plain jax.jit loop that adapts its batch, run as documented.

The page's block runs here in the test process (the 8 devices of
``conftest.py``); the tests read what it left: the realised sizes, the
learning-rate factor, the controller and the compile counts. The same block
with the default grid of shapes shows the powers of two the page warns of.
"""

from __future__ import annotations

import math
import pathlib
import re

import numpy as np
import pytest

import simigrad_jax

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "adaptive_loop.md"
ONE_SHAPE = "BucketPolicy(max_micro_batch_size=2, padding=False)"
DEFAULT_GRID = "BucketPolicy(max_micro_batch_size=32, min_micro_batch_size=2, padding=False)"


def run_block(policy: str = ONE_SHAPE) -> dict:
  (block,) = re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.S | re.M)
  assert ONE_SHAPE in block
  scope: dict = {"__name__": "adaptive_loop_block"}
  exec(compile(block.replace(ONE_SHAPE, policy), str(PAGE), "exec"), scope)  # noqa: S102
  return scope


@pytest.fixture(scope="module")
def one_shape():
  return run_block()


def test_the_batch_moves_by_about_ten_percent(one_shape):
  sizes, n = one_shape["sizes"], one_shape["n"]
  assert len(sizes) == 25 and len(set(sizes)) >= 5  # it adapts
  assert all(s % (2 * n) == 0 for s in sizes)  # multiples of 8 devices x 2 rows
  assert any(s & (s - 1) for s in sizes)  # sizes between the powers of two
  for before, after in zip(sizes, sizes[1:]):
    # The rule's 10%, rounded on to the next multiple of 16: never a doubling or a halving.
    assert abs(after - before) <= math.ceil(0.1 * before / 16) * 16, (before, after)


def test_the_controller_and_the_learning_rate_follow_the_realised_size(one_shape):
  controller, opt_state = one_shape["controller"], one_shape["opt_state"]
  last = one_shape["sizes"][-1]
  expected = simigrad_jax.lr_factor(last, one_shape["initial"])
  assert simigrad_jax.lr_factor_of(opt_state) == pytest.approx(expected, rel=1e-6)
  assert controller.step == 25
  # The controller's next request starts from the last realised size, by the rule's 10%.
  assert controller.batch_size in (last, max(last + 1, int(last * 1.1)), int(last * 0.9))
  assert np.isfinite(simigrad_jax.similarity(opt_state))


def test_one_micro_step_and_one_update_are_compiled(one_shape):
  assert one_shape["compiles"] == {"micro_step": 1, "apply_step": 1}


def test_the_default_grid_without_padding_flips_between_powers_of_two():
  scope = run_block(DEFAULT_GRID)
  sizes, n = scope["sizes"], scope["n"]
  small = [s for s in sizes if s <= 32 * n]
  assert small and all(s & (s - 1) == 0 for s in small)  # 8 x g for the shapes g: powers of two
  moves = [max(a, b) / min(a, b) for a, b in zip(sizes, sizes[1:]) if a != b]
  assert moves and all(m >= 1.25 for m in moves)  # none of the rule's 10% steps survives
  assert 2.0 in moves
  assert scope["compiles"]["micro_step"] >= 2  # a micro-step per shape it visits
