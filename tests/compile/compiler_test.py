"""Tests for simigrad_jax.compile.compiler on a tiny shard_map step over 8 CPU devices."""

import doctest
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from simigrad_jax.compile import compiler
from simigrad_jax.compile.compiler import CompileAbandoned
from simigrad_jax.compile.compiler import StepCompileError
from simigrad_jax.compile.compiler import StepCompiler
from waiting import wait_until

N = 8  # devices, from conftest
FEATURES, OUT = 4, 3
TIMEOUT = 20.0  # seconds; generous upper bound for anything we wait on
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def mesh(devices):
  return Mesh(np.array(devices), ("batch",))


def _body(w, x):
  return jax.lax.psum(x @ w, "batch")


class Lowerer:
  """``lower(micro)`` for a tiny data-parallel step; records every call.

  The step maps global ``x`` of shape ``(N * micro, FEATURES)`` (sharded by
  rows) and replicated ``w`` to ``sum_d x_d @ w`` of shape ``(micro, OUT)``.
  ``fail`` sizes raise; ``gates[m]`` blocks ``lower(m)`` until set;
  ``started[m]`` is set when ``lower(m)`` begins.
  """

  def __init__(self, mesh, fail=(), gated=()):
    self.mesh = mesh
    self.step = jax.jit(jax.shard_map(_body, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P()))
    self.fail = set(fail)
    self.gates = {m: threading.Event() for m in gated}
    self.started = {m: threading.Event() for m in gated}
    self.calls = []
    self.threads = []
    self._lock = threading.Lock()

  def __call__(self, micro):
    with self._lock:
      self.calls.append(micro)
      self.threads.append(threading.current_thread())
    if micro in self.gates:
      self.started[micro].set()
      assert self.gates[micro].wait(TIMEOUT)
    if micro in self.fail:
      raise ValueError(f"no step for {micro}")
    w = jax.ShapeDtypeStruct((FEATURES, OUT), jnp.float32, sharding=NamedSharding(self.mesh, P()))
    x = jax.ShapeDtypeStruct(
      (N * micro, FEATURES), jnp.float32, sharding=NamedSharding(self.mesh, P("batch"))
    )
    return self.step.lower(w, x)


def check_runs(compiled, micro, seed=0):
  """Runs ``compiled`` on real data of the ``micro`` shape against NumPy."""
  rng = np.random.default_rng(seed + micro)
  w = rng.normal(size=(FEATURES, OUT)).astype(np.float32)
  x = rng.normal(size=(N * micro, FEATURES)).astype(np.float32)
  out = np.asarray(compiled(jnp.asarray(w), jnp.asarray(x)))
  expected = x.reshape(N, micro, FEATURES).sum(0) @ w
  assert out.shape == (micro, OUT)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------- threads


def test_threads_compile_that_many_at_once_in_the_order_queued(mesh):
  lower = Lowerer(mesh, gated=(1, 2, 3))
  with StepCompiler(lower, name="toy", threads=2) as compiler:
    compiler.prefetch([1, 2, 3, 4])
    # The first two start together; the third waits for a free thread, whatever the timing.
    assert lower.started[1].wait(TIMEOUT) and lower.started[2].wait(TIMEOUT)
    assert not lower.started[3].is_set() and sorted(lower.calls) == [1, 2]
    lower.gates[2].set()
    assert lower.started[3].wait(TIMEOUT)
    lower.gates[1].set()
    lower.gates[3].set()
    # A get() of a size still queued would compile it in this thread: let the workers finish.
    wait_until(lambda: compiler.stats()["compiled_sizes"] == [1, 2, 3, 4], TIMEOUT)
    for micro in [1, 2, 3, 4]:
      check_runs(compiler.get(micro), micro)
    stats = compiler.stats()
  assert sorted(lower.calls[:2]) == [1, 2] and lower.calls[2] == 3
  assert sorted(lower.calls) == [1, 2, 3, 4]
  assert len(set(lower.threads)) >= 2 and all(t.name == "toy-compiler" for t in lower.threads)
  assert stats["compiles"] == 4 and stats["compiled_sizes"] == [1, 2, 3, 4]


def test_threads_must_be_a_positive_int(mesh):
  with pytest.raises(ValueError, match="threads must be an integer >= 1, got 0"):
    StepCompiler(Lowerer(mesh), threads=0)


def test_host_compile_threads_leave_the_training_loop_a_core():
  assert [compiler.host_compile_threads(cores) for cores in (1, 2, 3, 9, 64)] == [1, 1, 2, 8, 8]
  assert 1 <= compiler.host_compile_threads() <= compiler.MAX_HOST_COMPILE_THREADS


# ------------------------------------------------------------------- compile


def test_get_returns_a_working_step_per_size_compiled_once(mesh):
  lower = Lowerer(mesh)
  with StepCompiler(lower) as compiler:
    compiler.prefetch([1, 2, 4])
    for micro in [1, 2, 4, 2, 1, 4]:
      compiled = compiler.get(micro)
      assert isinstance(compiled, jax.stages.Compiled)
      check_runs(compiled, micro)
    assert compiler.get(2) is compiler.get(2)
    with pytest.raises(TypeError):  # compiled for one shape only
      compiler.get(2)(jnp.ones((FEATURES, OUT)), jnp.ones((N, FEATURES)))
    stats = compiler.stats()
  assert sorted(lower.calls) == [1, 2, 4]
  assert stats["compiles"] == 3
  assert stats["compiled_sizes"] == [1, 2, 4]
  assert stats["compile_seconds"] > 0


def test_prefetch_compiles_in_one_background_thread_in_order(mesh):
  lower = Lowerer(mesh)
  with StepCompiler(lower, name="toy") as compiler:
    compiler.prefetch([4, 1, 2])
    wait_until(lambda: compiler.stats()["compiled_sizes"] == [1, 2, 4], TIMEOUT)
    assert lower.calls == [4, 1, 2]
    main = threading.current_thread()
    assert all(t is not main and t.name == "toy-compiler" for t in lower.threads)
    assert len(set(lower.threads)) == 1
    for micro in [4, 1, 2]:  # all ready: no stall
      check_runs(compiler.get(micro), micro)
    stats = compiler.stats()
  assert stats["compile_wait_seconds"] < 1e-3
  assert stats["compile_seconds"] > 0
  assert stats["compiles"] == 3


def test_prefetch_first_moves_queued_sizes_ahead_in_the_order_given(mesh):
  lower = Lowerer(mesh)
  gate = threading.Event()
  gated = lambda size: (gate.wait(timeout=30), lower(size))[1]
  with StepCompiler(gated, name="toy") as compiler:
    compiler.prefetch([1, 2, 3])  # 1 starts (and waits at the gate); 2 and 3 queued
    wait_until(lambda: list(compiler._queue.waiting[""]) == [2, 3], TIMEOUT)  # (its one lane)
    compiler.prefetch([4, 3], first=True)  # 4 new, 3 moved ahead of 2
    compiler.prefetch([2, 5])  # 2 stays where it is; 5 last
    gate.set()
    wait_until(lambda: compiler.stats()["compiled_sizes"] == [1, 2, 3, 4, 5], TIMEOUT)
  assert lower.calls == [1, 4, 3, 2, 5]


def test_get_of_unknown_size_compiles_synchronously_and_counts_wait(mesh):
  lower = Lowerer(mesh)
  with StepCompiler(lower) as compiler:
    check_runs(compiler.get(3), 3)
    stats = compiler.stats()
  assert lower.calls == [3]
  assert lower.threads == [threading.current_thread()]
  assert stats["compiles"] == 1
  assert stats["compile_wait_seconds"] > 0
  # The wait includes the whole lower + compile, done in this thread.
  assert stats["compile_wait_seconds"] >= stats["compile_seconds"]


def test_prefetch_skips_compiled_and_duplicate_sizes(mesh):
  lower = Lowerer(mesh)
  with StepCompiler(lower) as compiler:
    compiler.get(2)
    compiler.prefetch([2])
    compiler.prefetch([2, 5, 5, 2])
    wait_until(lambda: compiler.stats()["compiled_sizes"] == [2, 5], TIMEOUT)
    compiler.prefetch([5, 2])
    time.sleep(0.05)
    assert lower.calls == [2, 5]
    assert compiler.stats()["compiles"] == 2


def test_get_waits_for_a_size_compiling_in_the_background(mesh):
  lower = Lowerer(mesh, gated=[2])
  results = []
  waiting = threading.Event()
  with StepCompiler(lower) as compiler:
    # A get() blocked on a compile asks its interrupt every 50 ms: the first ask says the getter
    # waits (a sleep alone would not: on a loaded machine the getter may reach get() late).
    compiler.interrupt = lambda: (waiting.set(), False)[1]
    compiler.prefetch([2])
    assert lower.started[2].wait(TIMEOUT)
    getter = threading.Thread(target=lambda: results.append(compiler.get(2)))
    getter.start()
    assert waiting.wait(TIMEOUT)
    time.sleep(0.2)
    assert getter.is_alive()  # blocked on the background compile
    lower.gates[2].set()
    getter.join(TIMEOUT)
    assert not getter.is_alive()
    check_runs(results[0], 2)
    stats = compiler.stats()
  assert lower.calls == [2]  # waited, did not compile again
  assert stats["compiles"] == 1
  assert stats["compile_wait_seconds"] >= 0.2


def test_get_takes_over_a_queued_size_instead_of_waiting(mesh):
  lower = Lowerer(mesh, gated=[1])
  with StepCompiler(lower) as compiler:
    compiler.prefetch([1, 2])
    assert lower.started[1].wait(TIMEOUT)
    check_runs(compiler.get(2), 2)  # 1 is still blocked in the worker
    assert lower.calls == [1, 2]
    assert lower.threads[1] is threading.current_thread()
    assert compiler.stats()["compiled_sizes"] == [2]
    lower.gates[1].set()
    check_runs(compiler.get(1), 1)
  assert lower.calls == [1, 2]


def test_concurrent_gets_of_one_size_compile_it_once(mesh):
  lower = Lowerer(mesh, gated=[3])
  results = []
  barrier = threading.Barrier(4)

  def fetch():
    barrier.wait()
    results.append(compiler.get(3))

  with StepCompiler(lower) as compiler:
    getters = [threading.Thread(target=fetch) for _ in range(4)]
    for t in getters:
      t.start()
    assert lower.started[3].wait(TIMEOUT)
    time.sleep(0.1)  # let the other three reach get()
    lower.gates[3].set()
    for t in getters:
      t.join(TIMEOUT)
    stats = compiler.stats()
  assert lower.calls == [3]
  assert len(results) == 4 and all(r is results[0] for r in results)
  assert stats["compiles"] == 1


# -------------------------------------------------------------------- errors


def test_background_failure_surfaces_in_get_for_that_size_only(mesh):
  lower = Lowerer(mesh, fail=[3])
  with StepCompiler(lower) as compiler:
    compiler.prefetch([2, 3, 4])
    wait_until(lambda: compiler.stats()["compiled_sizes"] == [2, 4], TIMEOUT)
    for _ in range(2):  # raised every time, not retried
      with pytest.raises(StepCompileError, match="micro_batch_size=3") as err:
        compiler.get(3)
      assert isinstance(err.value.__cause__, ValueError)
      assert "no step for 3" in str(err.value)
    compiler.prefetch([3])
    check_runs(compiler.get(2), 2)
    check_runs(compiler.get(4), 4)
    stats = compiler.stats()
  assert sorted(lower.calls) == [2, 3, 4]
  assert stats["compiles"] == 2
  assert stats["compiled_sizes"] == [2, 4] and stats["failed_sizes"] == [3]


def test_synchronous_failure_and_bad_lower_result(mesh):
  lower = Lowerer(mesh, fail=[1])
  with StepCompiler(lower, background=False, name="sync") as compiler:
    with pytest.raises(StepCompileError, match="'sync'.*micro_batch_size=1"):
      compiler.get(1)
    check_runs(compiler.get(2), 2)
  # lower() returning the jitted function instead of its Lowered.
  with StepCompiler(lambda micro: lower.step) as compiler:
    compiler.prefetch([5])
    with pytest.raises(StepCompileError, match="micro_batch_size=5") as err:
      compiler.get(5)
    assert isinstance(err.value.__cause__, TypeError)
    assert "jax.stages.Lowered" in str(err.value)
    assert compiler.stats()["compiles"] == 0


def test_background_false_compiles_only_on_demand(mesh):
  lower = Lowerer(mesh)
  with StepCompiler(lower, background=False) as compiler:
    compiler.prefetch([1, 2])
    time.sleep(0.05)
    assert lower.calls == []
    check_runs(compiler.get(1), 1)
    stats = compiler.stats()
  assert lower.calls == [1]
  assert lower.threads == [threading.current_thread()]
  assert stats["compiled_sizes"] == [1]
  assert stats["compile_wait_seconds"] > 0


# --------------------------------------------------------------------- close and interrupt


def test_a_wait_gives_up_when_its_interrupt_says_so_and_a_later_get_waits_again(mesh):
  lower = Lowerer(mesh, gated=[1, 2])
  compiler = StepCompiler(lower)
  stop = threading.Event()
  compiler.interrupt = stop.is_set
  compiler.prefetch([1])
  assert lower.started[1].wait(TIMEOUT)
  threading.Timer(0.2, stop.set).start()
  with pytest.raises(CompileAbandoned, match="micro_batch_size=1"):
    compiler.get(1)  # compiling in the background
  with pytest.raises(CompileAbandoned, match="micro_batch_size=2"):
    compiler.get(2)  # never asked for: compiles in a daemon thread, not in this one
  assert lower.started[2].wait(TIMEOUT)
  assert [t.daemon for t in lower.threads] == [True, True]
  stop.clear()
  lower.gates[1].set()
  lower.gates[2].set()
  check_runs(compiler.get(1), 1)
  check_runs(compiler.get(2), 2)
  assert lower.calls == [1, 2]  # each compiled once
  compiler.close()


def test_close_abandons_the_running_compile_and_cancels_the_rest(mesh):
  lower = Lowerer(mesh, gated=[1])
  compiler = StepCompiler(lower)
  compiler.prefetch([1, 2, 4])
  assert lower.started[1].wait(TIMEOUT)
  start = time.perf_counter()
  compiler.close()  # returns at once: the compile of 1 is not awaited
  assert time.perf_counter() - start < 1.0
  # The thread lowering 1 (another compiler's worker of the same name may not have ended yet).
  worker = lower.threads[0]
  assert worker.name == "step-compiler" and worker.daemon  # a process exits without waiting for it
  lower.gates[1].set()
  worker.join(TIMEOUT)
  assert lower.calls == [1]  # 2 and 4 were cancelled
  assert compiler.stats()["compiled_sizes"] == [1]
  compiler.close()  # idempotent
  compiler.close()
  with pytest.raises(RuntimeError, match="closed"):
    compiler.prefetch([2])
  check_runs(compiler.get(1), 1)  # compiled variants stay usable
  check_runs(compiler.get(2), 2)  # cancelled ones compile on demand
  assert lower.calls == [1, 2]


def test_context_manager_closes(mesh):
  lower = Lowerer(mesh)
  with StepCompiler(lower) as compiler:
    compiler.prefetch([1])
    compiler.get(1)
  with pytest.raises(RuntimeError, match="closed"):
    compiler.prefetch([2])
  assert "compiled_sizes=[1]" in repr(compiler)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "2", None])
def test_get_refuses_bad_sizes(mesh, bad):
  lower = Lowerer(mesh)
  with StepCompiler(lower) as compiler:
    with pytest.raises(ValueError, match="micro_batch_size"):
      compiler.get(bad)
  assert lower.calls == []


@pytest.mark.parametrize("bad", [[1, 0], [2, 1.5], 4, "12", None])
def test_prefetch_refuses_bad_sizes_and_schedules_nothing(mesh, bad):
  lower = Lowerer(mesh)
  with StepCompiler(lower) as compiler:
    with pytest.raises(ValueError, match=r"micro_batch_size|must be an"):
      compiler.prefetch(bad)
    time.sleep(0.05)
  assert lower.calls == []
  assert compiler.stats()["compiled_sizes"] == []


def test_constructor_refuses_bad_arguments():
  with pytest.raises(ValueError, match="lower must be a callable"):
    StepCompiler(3)
  with pytest.raises(ValueError, match="background"):
    StepCompiler(lambda m: None, background="yes")
  with pytest.raises(ValueError, match="name"):
    StepCompiler(lambda m: None, name=7)


def test_numpy_sizes_are_accepted(mesh):
  lower = Lowerer(mesh)
  with StepCompiler(lower, background=False) as compiler:
    compiler.prefetch(np.array([1, 2]))
    check_runs(compiler.get(np.int64(2)), 2)
  assert lower.calls == [2]


def test_doctests():
  result = doctest.testmod(compiler)
  assert result.attempted > 0 and result.failed == 0
