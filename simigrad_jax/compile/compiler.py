"""Host: ahead-of-time compiled step functions, one per micro-batch shape.

Python threads around JAX's AOT API (``jax.stages``); nothing here runs under
``jit``.

The global batch size changes at every optimizer step, but the step function
only sees the micro-batch *shape*, drawn from a small grid known up front
(:func:`simigrad_jax.shapes.bucket_shapes`). :class:`StepCompiler` holds one
``jax.stages.Compiled`` per micro-batch size. It compiles the sizes the loop
may need next in background threads (one by default, or as many as the host
affords: :func:`host_compile_threads`) while the current step runs, so that
after warm-up :meth:`StepCompiler.get` finds every variant ready and the loop
never stalls on a compile. Compiles need no data: ``lower(micro)`` lowers the
jitted step on ``jax.ShapeDtypeStruct`` placeholders that carry the input
shardings.

The variants may be keyed otherwise than by a size: a training step's
programs are compiled by one subclass keyed by program and shape
(:class:`~simigrad_jax.compile.program_compiler.StepProgramCompiler`), each
program's variants in a background thread of their own.

With JAX's persistent compilation cache on
(:func:`simigrad_jax.compile.persistent_cache.enable_persistent_cache`), a
compile that finds its executable there loads it; :meth:`StepCompiler.stats`
counts those loads apart.

Compiles run in daemon threads; the interpreter's exit waits for those in
progress (:mod:`simigrad_jax.compile.exit_wait`).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import jax

from simigrad_jax import validation
from simigrad_jax.compile import exit_wait
from simigrad_jax.compile.persistent_cache import counting_cache_hits
from simigrad_jax.errors import SimiGradError

__all__ = [
  "CompileAbandoned",
  "MicroBatchSizes",
  "StepCompileError",
  "StepCompiler",
  "host_compile_threads",
]

# Cores left to the training loop (its Python thread, dispatch and the input pipeline) when the
# compile threads are sized from the host.
MAIN_LOOP_CORES = 1
# The most compile threads a lane gets from the host's cores: XLA's compile of one program uses
# several threads of its own, and a run's grid has a handful of programs.
MAX_HOST_COMPILE_THREADS = 8


def host_compile_threads(cores: int | None = None) -> int:
  """The compile threads this host affords: its cores less :data:`MAIN_LOOP_CORES`, at least 1.

  Args:
    cores: the cores to size from (None: those this process may run on,
      ``os.sched_getaffinity`` where the platform has it, else ``os.cpu_count()``).

  Returns:
    An int in ``[1, MAX_HOST_COMPILE_THREADS]``.

  Example:
    >>> host_compile_threads(2), host_compile_threads(16), host_compile_threads(64)
    (1, 8, 8)
  """
  if cores is None:
    affinity = getattr(os, "sched_getaffinity", None)
    cores = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
  return max(1, min(MAX_HOST_COMPILE_THREADS, cores - MAIN_LOOP_CORES))


class StepCompileError(SimiGradError, RuntimeError):
  """Lowering or compiling the step for one micro-batch size failed.

  Raised by :meth:`StepCompiler.get` for that size; the original exception is
  the ``__cause__``.
  """


class _Job:
  """One variant (a micro-batch size, or another key): queued, compiling, or done (compiled or
  failed); ``what`` names it in errors."""

  __slots__ = ("key", "what", "done", "compiled", "error", "cache_hit")

  def __init__(self, key: Hashable, what: str):
    self.key, self.what = key, what
    self.done = threading.Event()
    self.compiled: jax.stages.Compiled | None = None
    self.error: BaseException | None = None
    self.cache_hit = False  # loaded from the persistent cache

  def compile(self, lower: Callable[[Any], jax.stages.Lowered]) -> None:
    """Lowers and compiles this variant in this thread, keeping the program or the error (an
    ``Exception``; anything else, e.g. ``KeyboardInterrupt``, is raised)."""
    if not exit_wait.IN_FLIGHT.begin():
      self.error = CompileAbandoned(
        f"the compile of {self.what} was not started: the process is exiting"
      )
      return
    try:
      lowered = lower(self.key)
      if not isinstance(lowered, jax.stages.Lowered):
        raise TypeError(
          f"lower({self.key!r}) must return a jax.stages.Lowered (e.g. "
          f"jitted.lower(*placeholders)), got {type(lowered).__name__}: "
          f"{lowered!r:.200}"
        )
      self.compiled, self.cache_hit = _compile(lowered)
    except Exception as err:  # surfaces in result() for this variant
      self.error = err
    finally:
      exit_wait.IN_FLIGHT.end()

  def result(self, compiler: str) -> jax.stages.Compiled:
    """The compiled program of this done job, or :class:`StepCompileError` naming ``compiler``,
    the variant and the error."""
    if self.error is not None:
      first_line = (str(self.error).strip().splitlines() or [""])[0][:300]
      raise StepCompileError(
        f"StepCompiler {compiler!r}: lowering or compiling {self.what} failed with "
        f"{type(self.error).__name__}: {first_line} (the cause is chained below)"
      ) from self.error
    assert self.compiled is not None  # done, without an error
    return self.compiled


class CompileAbandoned(SimiGradError, RuntimeError):
  """A wait for a compile was given up: the ``interrupt`` of its compiler said the run is stopping.

  Raised by :meth:`StepCompiler.get` while it waits; the compile itself goes on in its daemon thread, unawaited (a
  compile in XLA cannot be stopped), and the interpreter's exit after the
  run's stop does not wait for it either. Also the error of a compile asked
  for after the interpreter's exit began: it is not started.
  """


# How often a wait for a compile asks its compiler's interrupt whether to give up (seconds).
_POLL_SECONDS = 0.05


def _wait(done: threading.Event, interrupt: Callable[[], bool] | None, what: str) -> None:
  """Waits for ``done``, asking ``interrupt`` every :data:`_POLL_SECONDS` whether to give up.

  The main thread stays in Python between polls, so a signal's handler runs
  at once (a wait inside XLA would run it only when the compile returns).

  Raises:
    CompileAbandoned: ``interrupt()`` returned True before ``done`` was set.
  """
  while not done.wait(_POLL_SECONDS):
    if interrupt is not None and interrupt():
      raise CompileAbandoned(f"stopped waiting for the compile of {what}: the run is stopping")


def _start_daemon(target: Callable[[], None], name: str) -> None:
  """Runs ``target`` in a new daemon thread (the interpreter's exit waits only for a compile in
  progress: :data:`simigrad_jax.compile.exit_wait.IN_FLIGHT`)."""
  threading.Thread(target=target, name=name, daemon=True).start()


def _compile(lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, bool]:
  """``lowered`` compiled, and whether JAX's persistent cache gave the program back."""
  with counting_cache_hits() as hits:
    compiled = lowered.compile()
  return compiled, hits[0] > 0


class MicroBatchSizes:
  """How a :class:`StepCompiler` names its variants: by micro-batch size, all compiled in one
  background thread.

  A compiler of other variants is given another object with these three
  methods (:class:`~simigrad_jax.compile.program_compiler.ProgramShapes`
  names a training step's programs).
  """

  def check(self, key: Any) -> Hashable:
    """The variant ``key`` names, checked: a micro-batch size, an int ``>= 1``.

    Raises:
      ValueError: when it names none.
    """
    return validation.check_int("micro_batch_size", key)

  def describe(self, key: Any) -> str:
    """The variant ``key`` in words, for errors."""
    return f"the step for micro_batch_size={key}"

  def lane(self, key: Any) -> str:
    """The background thread that compiles ``key`` (its name's middle part; "": the one)."""
    del key
    return ""


class _Queue:
  """The variants a :class:`StepCompiler` was asked for: each one's job, and the order of those
  not started yet, in each lane (a lane's variants compile one after the other, in its own
  thread). Its compiler holds its lock around every call."""

  __slots__ = ("jobs", "waiting", "_lane", "_describe")

  def __init__(self, keys: MicroBatchSizes):
    self.jobs: dict[Hashable, _Job] = {}  # every variant asked for, in any state
    self.waiting: dict[str, collections.deque[Hashable]] = {}  # not started, in order, by lane
    self._lane, self._describe = keys.lane, keys.describe

  def add(self, keys: list[Hashable], first: bool) -> None:
    """Queues the variants not asked for before, after those waiting in their lane; with
    ``first``, ahead of them, the waiting variants among ``keys`` moved ahead too (in the order
    given)."""
    waiting = [k for k in dict.fromkeys(keys) if k not in self.jobs or self._is_waiting(k)]
    for key in waiting:
      if key not in self.jobs:
        self.jobs[key] = _Job(key, self._describe(key))
        if not first:
          self.waiting.setdefault(self._lane(key), collections.deque()).append(key)
    if first:
      for lane in dict.fromkeys(self._lane(key) for key in waiting):
        ahead = [key for key in waiting if self._lane(key) == lane]
        rest = [key for key in self.waiting.get(lane, ()) if key not in set(ahead)]
        self.waiting[lane] = collections.deque(ahead + rest)

  def claim(self, key: Hashable) -> tuple[_Job, bool]:
    """``key``'s job, and whether the caller is to compile it: a variant never asked for, or
    one still waiting (taken off the queue: it does not wait for those queued before it)."""
    job = self.jobs.get(key)
    if job is None:
      job = self.jobs[key] = _Job(key, self._describe(key))
      return job, True
    if self._is_waiting(key):  # not started, so not done
      self.waiting[self._lane(key)].remove(key)
      return job, True
    return job, False

  def next(self, lane: str) -> _Job | None:
    """The next job waiting in ``lane``, taken off the queue; None when none waits."""
    waiting = self.waiting.get(lane)
    return self.jobs[waiting.popleft()] if waiting else None

  def lanes_waiting(self) -> list[str]:
    """The lanes with a variant waiting."""
    return [lane for lane, waiting in self.waiting.items() if waiting]

  def cancel(self) -> None:
    """Forgets the variants not started (nobody waits on them)."""
    for waiting in self.waiting.values():
      for key in waiting:
        del self.jobs[key]
      waiting.clear()

  def forget(self, job: _Job) -> None:
    """Forgets ``job`` (interrupted: a later request compiles its variant again)."""
    if self.jobs.get(job.key) is job:
      del self.jobs[job.key]

  def done_keys(self, failed: bool) -> list[Any]:
    """The variants compiled, or with ``failed`` those whose compile failed, sorted."""
    return sorted(
      key  # (the keys of one compiler are of one sortable type)
      for key, job in self.jobs.items()
      if job.done.is_set() and (job.error is not None) == failed
    )

  def _is_waiting(self, key: Hashable) -> bool:
    return key in self.waiting.get(self._lane(key), ())


class _Tally:
  """The counts and seconds of a compiler's compiles (its owner holds its lock around them)."""

  __slots__ = ("compiles", "compile_seconds", "wait_seconds", "cache_hits", "cache_hit_seconds")

  def __init__(self):
    self.compiles = 0  # successful compiles
    self.compile_seconds = 0.0  # lowering and compiling, failed attempts included
    self.wait_seconds = 0.0  # callers blocked for a compile
    self.cache_hits = 0  # the compiles (of ``compiles``) the persistent cache gave back
    self.cache_hit_seconds = 0.0  # their seconds (of ``compile_seconds``)

  def count(self, seconds: float, compiled: bool, cache_hit: bool) -> None:
    """Counts one compile attempt of ``seconds``."""
    self.compile_seconds += seconds
    if compiled:
      self.compiles += 1
      if cache_hit:
        self.cache_hits += 1
        self.cache_hit_seconds += seconds

  def stats(self) -> dict[str, Any]:
    """``compiles``, ``compile_seconds``, ``compile_wait_seconds``, ``cache_hits`` and
    ``cache_hit_seconds``."""
    return {
      "compiles": self.compiles,
      "compile_seconds": self.compile_seconds,
      "compile_wait_seconds": self.wait_seconds,
      "cache_hits": self.cache_hits,
      "cache_hit_seconds": self.cache_hit_seconds,
    }


class StepCompiler:
  """Ahead-of-time compiled variants of one step function, one per micro-batch size, compiled in the background.

  ``lower(micro_batch_size)`` returns the ``jax.stages.Lowered`` step for that
  shape, typically ``jitted_step.lower(*placeholders)`` with
  ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` placeholders, so that
  nothing needs real data. :meth:`prefetch` queues sizes for the background
  worker threads (``threads`` of them), which lower and compile them in the
  order given;
  :meth:`get` returns the compiled step, waiting for (or doing) the compile
  only if it is not ready yet. Time spent blocked in :meth:`get` is the
  *compile wait*, a stall of the training loop, reported by :meth:`stats`.

  Each size is compiled at most once, whichever threads ask for it: a size
  being compiled is waited for, and a size still queued behind other compiles
  is taken off the queue and compiled at once in the thread that called
  :meth:`get` (it does not wait for the compiles queued before it). A failed
  compile is not retried: :meth:`get` for that size raises
  :class:`StepCompileError` (naming the size, the original exception as its
  cause) every time, and :meth:`prefetch` skips it; other sizes are
  unaffected.

  Args:
    lower: maps a micro-batch size (an int ``>= 1``) to the
      ``jax.stages.Lowered`` step for that shape. It runs in the worker
      thread, so it must not rely on thread-local JAX context set by the
      caller (``with mesh:``, ``jax.sharding.use_mesh``,
      ``jax.default_device``, ...): put the shardings on the placeholders.
    background: ``True`` compiles prefetched sizes in a background thread;
      ``False`` makes :meth:`prefetch` a no-op, so every compile happens on
      demand in :meth:`get` (handy for debugging and for one-shape runs).
    name: a label for thread names and error messages.
    keys: what names a variant (:class:`MicroBatchSizes`, the default): the
      compiler of a training step's programs names them by program and
      shape, each program's compiled in a background thread of its own
      (:class:`~simigrad_jax.compile.program_compiler.StepProgramCompiler`).
    threads: the compiles a lane runs at once, each in a background thread
      of its own (an int ``>= 1``; :func:`host_compile_threads` sizes it
      from the host's cores). They start in the order queued; XLA's compile
      releases the GIL, so they overlap where the host has cores to spare.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> step = jax.jit(lambda w, x: x @ w)
    >>> def lower(micro):
    ...   return step.lower(jax.ShapeDtypeStruct((4, 2), jnp.float32),
    ...                     jax.ShapeDtypeStruct((micro, 4), jnp.float32))
    >>> with StepCompiler(lower) as compiler:
    ...   compiler.prefetch([8, 16])  # returns at once
    ...   compiled = compiler.get(8)  # waits only if 8 is still compiling
    ...   compiled(jnp.ones((4, 2)), jnp.ones((8, 4))).shape
    ...   _ = compiler.get(16)  # 16 compiled in the background; leaving the block cancels none
    (8, 2)
    >>> compiler.stats()["compiled_sizes"]
    [8, 16]

  .. note::
    Lowering (tracing) is Python and holds the GIL; XLA's compile releases
    it, so a compile overlaps the running step well when the host has spare
    cores and little on a 2-core machine. Call the returned ``Compiled``
    objects, not the jitted function: a jitted function keeps its own cache
    and would compile again. :meth:`close` (or leaving the ``with`` block)
    cancels queued compiles and returns at once, leaving the one in progress
    to its daemon thread; the interpreter's normal exit waits for it (see the
    module's docstring). While
    :attr:`interrupt` is set, a :meth:`get` that waits asks it every 50 ms
    whether to give up (:class:`CompileAbandoned`): a compile of a step the
    run no longer needs is never awaited.

  """

  def __init__(
    self,
    lower: Callable[[Any], jax.stages.Lowered],
    *,
    background: bool = True,
    name: str = "step",
    keys: MicroBatchSizes | None = None,
    threads: int = 1,
  ):
    if not callable(lower):
      raise ValueError(
        f"lower must be a callable micro_batch_size -> jax.stages.Lowered, got {lower!r}"
      )
    if not isinstance(name, str):
      raise ValueError(f"name must be a str, got {name!r}")
    self._lower = lower
    self._background = validation.check_bool("background", background)
    self._name = name
    self._lock = threading.Lock()
    self._keys = MicroBatchSizes() if keys is None else keys
    self._queue = _Queue(self._keys)
    self._threads = validation.check_int("threads", threads)
    self._workers: dict[str, int] = {}  # worker threads by lane, while they have work
    self._closed = False
    self._tally = _Tally()
    self.interrupt: Callable[[], bool] | None = None  # True: a waiting get() gives up
    exit_wait.IN_FLIGHT.track(self)

  @property
  def name(self) -> str:
    """The label given at construction."""
    return self._name

  @property
  def threads(self) -> int:
    """The compiles of one lane (one kind of program) that run at once."""
    return self._threads

  def __repr__(self) -> str:
    stats = self.stats()
    return (
      f"{type(self).__name__}(name={self._name!r}, background={self._background},"
      f" compiled_sizes={stats['compiled_sizes']}, closed={self._closed})"
    )

  def prefetch(self, micro_batch_sizes: Iterable[Any], *, first: bool = False) -> None:
    """Schedules background compiles of the sizes not compiled or in flight.

    Returns at once. Sizes start compiling in the order given, up to
    ``threads`` at once,
    after any already queued (``first``: before them); sizes compiled,
    compiling or failed before are skipped, and so are those queued unless
    ``first`` moves them ahead. With ``background=False`` nothing is
    scheduled (the sizes are still validated).

    Args:
      micro_batch_sizes: an iterable of ints ``>= 1``, e.g. the result of
        :func:`simigrad_jax.shapes.bucket_shapes`.
      first: queue these sizes, in the order given, ahead of those queued
        before (for the shapes a run needs soonest).

    Raises:
      ValueError: if ``micro_batch_sizes`` is not an iterable of ints
        ``>= 1`` (nothing is scheduled then).
      RuntimeError: if the compiler is closed.
    """
    keys = _check_sizes(micro_batch_sizes, self._keys)
    with self._lock:
      if self._closed:
        raise RuntimeError(f"StepCompiler {self._name!r} is closed: prefetch is not allowed")
      if not self._background:
        return
      self._queue.add(keys, first)
      for lane in self._queue.lanes_waiting():
        # A worker per variant waiting, up to ``threads``: idle workers have left.
        wanted = min(self._threads, self._workers.get(lane, 0) + len(self._queue.waiting[lane]))
        while self._workers.get(lane, 0) < wanted:
          self._workers[lane] = self._workers.get(lane, 0) + 1
          threading.Thread(
            target=self._work, args=(lane,), name=_thread_name(self._name, lane), daemon=True
          ).start()

  def get(self, micro_batch_size: Any) -> jax.stages.Compiled:
    """Returns the compiled step for one micro-batch size.

    Ready variants return at once. A size compiling in the background is
    waited for; a size never requested, or still queued, is compiled now in
    the calling thread (with :attr:`interrupt` set, in a daemon thread of its
    own, waited for as the others). The time this call blocks counts as compile wait in
    :meth:`stats`. Still works after :meth:`close` (compiling synchronously).

    Args:
      micro_batch_size: rows per device per micro-step, an int ``>= 1``.

    Returns:
      The ``jax.stages.Compiled`` step for that shape.

    Raises:
      ValueError: if ``micro_batch_size`` is not an int ``>= 1``.
      StepCompileError: if lowering or compiling that size failed (now or in
        the background); the original exception is the ``__cause__``.
      CompileAbandoned: :attr:`interrupt` said to give up while this waited
        (the compile goes on unawaited; a later call waits for it again).
    """
    key = self._keys.check(micro_batch_size)
    with self._lock:
      job, compile_here = self._queue.claim(key)
      blocked = not job.done.is_set()
    if blocked:
      start = time.perf_counter()
      try:
        if compile_here and self.interrupt is None:
          self._run(job)
        else:
          if compile_here:  # in a thread of its own, so that this wait can be given up
            lane = self._keys.lane(key)
            _start_daemon(lambda: self._run(job), _thread_name(self._name, lane, "compile"))
          _wait(job.done, self.interrupt, f"{job.what} ({self._name})")
      finally:
        with self._lock:
          self._tally.wait_seconds += time.perf_counter() - start
    return job.result(self._name)

  @property
  def wait_seconds(self) -> float:
    """Total time :meth:`get` has blocked so far (``stats()["compile_wait_seconds"]``)."""
    with self._lock:
      return self._tally.wait_seconds

  def stats(self) -> dict[str, Any]:
    """Returns compile counts and times so far.

    Returns:
      A dict with ``compiles`` (successful compiles), ``compile_seconds``
      (total lower + compile time in any thread, failed attempts included),
      ``compile_wait_seconds`` (total time :meth:`get` blocked),
      ``compiled_sizes`` (sorted list of the sizes ready to use),
      ``failed_sizes`` (those whose lowering or compile failed; :meth:`get`
      raises for them), ``cache_hits`` (the compiles, of ``compiles``, that
      loaded their executable from JAX's persistent compilation cache) and
      ``cache_hit_seconds`` (their lower + load time, of
      ``compile_seconds``).
    """
    with self._lock:
      return {
        **self._tally.stats(),
        "compiled_sizes": self._queue.done_keys(failed=False),
        "failed_sizes": self._queue.done_keys(failed=True),
      }

  def close(self) -> None:
    """Stops the worker: cancels the queued compiles and abandons the one in progress.

    Returns at once: the compile in progress finishes in its daemon thread
    unawaited (XLA's compile cannot be stopped; the interpreter's normal
    exit waits for it). Idempotent. Compiled variants stay available through
    :meth:`get` (a size still compiling is waited for); cancelled sizes are
    compiled on demand if asked for later.
    """
    with self._lock:
      self._closed = True
      self._queue.cancel()

  def __enter__(self) -> StepCompiler:
    return self

  def __exit__(self, *exc_info: object) -> None:
    self.close()

  def _work(self, lane: str) -> None:
    """A lane's worker loop: compiles its queued variants in order; exits when none are left."""
    while True:
      with self._lock:
        job = None if self._closed else self._queue.next(lane)
        if job is None:
          self._workers[lane] -= 1
          return
      self._run(job)

  def _run(self, job: _Job) -> None:
    """Lowers and compiles ``job``'s variant in this thread; always marks it done."""
    start = time.perf_counter()
    try:
      job.compile(self._lower)
    except BaseException as err:  # e.g. KeyboardInterrupt: do not keep it
      job.error = err
      with self._lock:
        self._queue.forget(job)
      raise
    finally:
      elapsed = time.perf_counter() - start
      with self._lock:  # (one snapshot: stats() never counts a compile not yet in its sizes)
        self._tally.count(elapsed, compiled=job.error is None, cache_hit=job.cache_hit)
        job.done.set()


def _check_sizes(micro_batch_sizes: Any, keys: MicroBatchSizes) -> list[Hashable]:
  """Returns the variants ``micro_batch_sizes`` names, checked by ``keys``, or raises
  ValueError."""
  if isinstance(micro_batch_sizes, (str, bytes)) or not isinstance(micro_batch_sizes, Iterable):
    raise ValueError(
      f"micro_batch_sizes must be an iterable of ints >= 1, got {micro_batch_sizes!r}"
    )
  return [keys.check(key) for key in micro_batch_sizes]


def _thread_name(compiler: str, lane: str, role: str = "compiler") -> str:
  """The name of a compiler's thread: ``<compiler>-<lane>-<role>``, without an empty lane."""
  return "-".join(part for part in (compiler, lane, role) if part)
