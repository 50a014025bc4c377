"""The compilers of a step's three programs: what they compiled, their totals, a program's memory."""

import jax
import jax.numpy as jnp
import pytest

from simigrad_jax.compile.step_compilers import StepCompilers
from simigrad_jax.shapes.layout import StepLayout


class TinyFunctions:
  """Lowerings of tiny programs in place of a step's (``fail``: shapes whose lowering fails)."""

  def __init__(self, fail=()):
    self.fail = set(fail)
    self.double = jax.jit(lambda x: 2 * x)

  def lower_fused(self, micro):
    if micro in self.fail:
      raise RuntimeError(f"out of memory at {micro} (injected)")
    return self.double.lower(jax.ShapeDtypeStruct((micro, 3), jnp.float32))

  def lower_micro(self, micro):
    return self.double.lower(jax.ShapeDtypeStruct((micro, 5), jnp.float32))

  def lower_apply(self):
    return self.double.lower(jax.ShapeDtypeStruct((7,), jnp.float32))


def layout(halves):
  return StepLayout.create(
    halves, 4, mode="recompile", max_micro=16, min_micro=2, lower=8, upper=64
  )


@pytest.fixture
def compilers():
  compilers = StepCompilers(TinyFunctions(fail={8}), layout("local"), background=True)
  yield compilers
  compilers.close()


def test_the_view_holds_what_is_compiled_and_what_failed(compilers):
  assert compilers.view() == {
    "fused": set(),
    "micro": set(),
    "apply": False,
    "failed_fused": set(),
    "failed_micro": set(),
  }
  compilers.fused.get(2)
  compilers.micro.get(4)
  compilers.update.get()
  with pytest.raises(Exception, match="injected"):
    compilers.fused.get(8)
  assert compilers.view() == {
    "fused": {2},
    "micro": {4},
    "apply": True,
    "failed_fused": {8},
    "failed_micro": set(),
  }


def test_the_stats_add_up_the_three_compilers_in_rows_per_device(compilers):
  compilers.fused.get(2)
  compilers.fused.get(4)
  compilers.micro.get(4)
  stats = compilers.stats()
  assert stats["compiles"] == 3 and not stats["update_compiled"]
  compilers.update.get()
  stats = compilers.stats()
  assert stats["compiles"] == 4 and stats["update_compiled"]
  parts = [compilers.fused.stats(), compilers.micro.stats(), compilers.update.stats()]
  assert stats["compile_seconds"] == pytest.approx(sum(p["compile_seconds"] for p in parts))
  assert stats["compile_cache_hits"] == 0 and stats["compile_cache_hit_seconds"] == 0
  # The local split: two slots a device, so rows per device are twice the shapes.
  assert stats["compiled_step_sizes"] == [4, 8]
  assert stats["compiled_accumulation_sizes"] == [8]
  assert stats["compiled_micro_batch_sizes"] == [4, 8]


def test_the_wait_counts_every_compiler_a_caller_blocked_on(compilers):
  assert compilers.wait_seconds() == 0
  compilers.fused.get(2)  # compiled in this thread, so waited for
  compilers.update.get()
  waited = compilers.wait_seconds()
  assert waited > 0 and waited == compilers.stats()["compile_wait_seconds"]
  assert waited == pytest.approx(compilers.fused.wait_seconds + compilers.update.wait_seconds)


def test_memory_is_reported_in_rows_per_device():
  compilers = StepCompilers(TinyFunctions(), layout("device"), background=False)
  memory = compilers.memory(4)
  compilers.close()
  assert memory["micro_batch_size"] == 4
  assert memory["argument_bytes"] == 4 * 3 * 4 and memory["output_bytes"] == 4 * 3 * 4
  assert set(memory) == {
    "micro_batch_size",
    "argument_bytes",
    "output_bytes",
    "alias_bytes",
    "temp_bytes",
  }


def test_close_closes_every_compiler_and_keeps_what_is_compiled():
  compilers = StepCompilers(TinyFunctions(), layout("device"), background=True)
  compilers.fused.get(2)
  compilers.micro.prefetch([2, 4, 8])
  compilers.close()
  for compiler in (compilers.fused, compilers.micro):
    with pytest.raises(RuntimeError, match="closed"):
      compiler.prefetch([4])
  assert 2 in compilers.view()["fused"]
