"""Host: ahead-of-time compiled step functions, one per micro-batch shape.

Python threads around JAX's AOT API (``jax.stages``); nothing here runs under
``jit``.

The global batch size changes at every optimizer step, but the step function
only sees the micro-batch *shape*, drawn from a small grid known up front
(:func:`simigrad_jax.shapes.bucket_shapes`). :class:`StepCompiler` holds one
``jax.stages.Compiled`` per micro-batch size. It compiles the sizes the loop
may need next in one background thread while the current step runs, so that
after warm-up :meth:`StepCompiler.get` finds every variant ready and the loop
never stalls on a compile. Compiles need no data: ``lower(micro)`` lowers the
jitted step on ``jax.ShapeDtypeStruct`` placeholders that carry the input
shardings.

A program that has one shape only (the update of accumulated steps) is a
:class:`ProgramCompiler`: compiled once, in a background thread or at once.

With JAX's persistent compilation cache on
(:func:`simigrad_jax.compile.persistent_cache.enable_persistent_cache`), a
compile that finds its executable there loads it; :meth:`StepCompiler.stats`
counts those loads apart.

Compiles run in daemon threads; the interpreter's exit waits for those in
progress (:mod:`simigrad_jax.compile.exit_wait`).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax

from simigrad_jax import validation
from simigrad_jax.compile import exit_wait
from simigrad_jax.compile.persistent_cache import counting_cache_hits
from simigrad_jax.errors import SimiGradError

__all__ = [
  "CompileAbandoned",
  "ProgramCompiler",
  "StepCompileError",
  "StepCompiler",
]


class StepCompileError(SimiGradError, RuntimeError):
  """Lowering or compiling the step for one micro-batch size failed.

  Raised by :meth:`StepCompiler.get` for that size; the original exception is
  the ``__cause__``.
  """


class _Job:
  """One micro-batch size: queued, compiling, or done (compiled or failed)."""

  __slots__ = ("size", "done", "compiled", "error", "cache_hit")

  def __init__(self, size: int):
    self.size = size
    self.done = threading.Event()
    self.compiled: jax.stages.Compiled | None = None
    self.error: BaseException | None = None
    self.cache_hit = False  # loaded from the persistent cache

  def compile(self, lower: Callable[[int], jax.stages.Lowered]) -> None:
    """Lowers and compiles this size in this thread, keeping the program or the error (an
    ``Exception``; anything else, e.g. ``KeyboardInterrupt``, is raised)."""
    if not exit_wait.IN_FLIGHT.begin():
      self.error = CompileAbandoned(
        f"the compile of size {self.size} was not started: the process is exiting"
      )
      return
    try:
      lowered = lower(self.size)
      if not isinstance(lowered, jax.stages.Lowered):
        raise TypeError(
          f"lower({self.size}) must return a jax.stages.Lowered (e.g. "
          f"jitted.lower(*placeholders)), got {type(lowered).__name__}: "
          f"{lowered!r:.200}"
        )
      self.compiled, self.cache_hit = _compile(lowered)
    except Exception as err:  # surfaces in result() for this size
      self.error = err
    finally:
      exit_wait.IN_FLIGHT.end()

  def result(self, compiler: str) -> jax.stages.Compiled:
    """The compiled program of this done job, or :class:`StepCompileError` naming ``compiler``,
    the size and the error."""
    if self.error is not None:
      first_line = (str(self.error).strip().splitlines() or [""])[0][:300]
      raise StepCompileError(
        f"StepCompiler {compiler!r}: lowering or compiling the step for "
        f"micro_batch_size={self.size} failed with "
        f"{type(self.error).__name__}: {first_line} (the cause is chained "
        "below)"
      ) from self.error
    assert self.compiled is not None  # done, without an error
    return self.compiled


class CompileAbandoned(SimiGradError, RuntimeError):
  """A wait for a compile was given up: the ``interrupt`` of its compiler said the run is stopping.

  Raised by :meth:`StepCompiler.get` and :meth:`ProgramCompiler.get` while
  they wait; the compile itself goes on in its daemon thread, unawaited (a
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


class _Queue:
  """The sizes a :class:`StepCompiler` was asked for: each one's job, and the order of those not
  started yet. Its compiler holds its lock around every call."""

  __slots__ = ("jobs", "waiting")

  def __init__(self):
    self.jobs: dict[int, _Job] = {}  # every size asked for, in any state
    self.waiting: collections.deque[int] = collections.deque()  # not started, in order

  def add(self, sizes: list[int], first: bool) -> None:
    """Queues the sizes not asked for before, after those waiting; with ``first``, ahead of
    them, the waiting sizes among ``sizes`` moved ahead too (in the order given)."""
    waiting = [s for s in dict.fromkeys(sizes) if s not in self.jobs or s in self.waiting]
    for size in waiting:
      if size not in self.jobs:
        self.jobs[size] = _Job(size)
        if not first:
          self.waiting.append(size)
    if first:
      ahead = set(waiting)
      self.waiting = collections.deque(waiting + [s for s in self.waiting if s not in ahead])

  def claim(self, size: int) -> tuple[_Job, bool]:
    """``size``'s job, and whether the caller is to compile it: a size never asked for, or one
    still waiting (taken off the queue: it does not wait for those queued before it)."""
    job = self.jobs.get(size)
    if job is None:
      job = self.jobs[size] = _Job(size)
      return job, True
    if size in self.waiting:  # not started, so not done
      self.waiting.remove(size)
      return job, True
    return job, False

  def next(self) -> _Job | None:
    """The next waiting job, taken off the queue; None when none waits."""
    return self.jobs[self.waiting.popleft()] if self.waiting else None

  def cancel(self) -> None:
    """Forgets the sizes not started (nobody waits on them)."""
    for size in self.waiting:
      del self.jobs[size]
    self.waiting.clear()

  def forget(self, job: _Job) -> None:
    """Forgets ``job`` (interrupted: a later request compiles its size again)."""
    if self.jobs.get(job.size) is job:
      del self.jobs[job.size]

  def done_sizes(self, failed: bool) -> list[int]:
    """The sizes compiled, or with ``failed`` those whose compile failed, sorted."""
    return sorted(
      size
      for size, job in self.jobs.items()
      if job.done.is_set() and (job.error is not None) == failed
    )


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
  nothing needs real data. :meth:`prefetch` queues sizes for one background
  worker thread, which lowers and compiles them in the order given;
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
    self, lower: Callable[[int], jax.stages.Lowered], *, background: bool = True, name: str = "step"
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
    self._queue = _Queue()
    self._worker: threading.Thread | None = None
    self._closed = False
    self._tally = _Tally()
    self.interrupt: Callable[[], bool] | None = None  # True: a waiting get() gives up
    exit_wait.IN_FLIGHT.track(self)

  @property
  def name(self) -> str:
    """The label given at construction."""
    return self._name

  def __repr__(self) -> str:
    stats = self.stats()
    return (
      f"StepCompiler(name={self._name!r}, background={self._background},"
      f" compiled_sizes={stats['compiled_sizes']}, closed={self._closed})"
    )

  def prefetch(self, micro_batch_sizes: Iterable[int], *, first: bool = False) -> None:
    """Schedules background compiles of the sizes not compiled or in flight.

    Returns at once. Sizes are compiled one at a time in the order given,
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
    sizes = _check_sizes(micro_batch_sizes)
    with self._lock:
      if self._closed:
        raise RuntimeError(f"StepCompiler {self._name!r} is closed: prefetch is not allowed")
      if not self._background:
        return
      self._queue.add(sizes, first)
      if self._queue.waiting and self._worker is None:
        self._worker = threading.Thread(
          target=self._work, name=f"{self._name}-compiler", daemon=True
        )
        self._worker.start()

  def get(self, micro_batch_size: int) -> jax.stages.Compiled:
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
    size = validation.check_int("micro_batch_size", micro_batch_size)
    with self._lock:
      job, compile_here = self._queue.claim(size)
      blocked = not job.done.is_set()
    if blocked:
      start = time.perf_counter()
      try:
        if compile_here and self.interrupt is None:
          self._run(job)
        else:
          if compile_here:  # in a thread of its own, so that this wait can be given up
            _start_daemon(lambda: self._run(job), f"{self._name}-compile-{size}")
          _wait(job.done, self.interrupt, f"{self._name} micro_batch_size={size}")
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
        "compiled_sizes": self._queue.done_sizes(failed=False),
        "failed_sizes": self._queue.done_sizes(failed=True),
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

  def _work(self) -> None:
    """Worker loop: compiles queued sizes in order; exits when none are left."""
    while True:
      with self._lock:
        job = None if self._closed else self._queue.next()
        if job is None:
          self._worker = None
          return
      self._run(job)

  def _run(self, job: _Job) -> None:
    """Lowers and compiles ``job.size`` in this thread; always marks it done."""
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
      with self._lock:
        self._tally.count(elapsed, compiled=job.error is None, cache_hit=job.cache_hit)
      job.done.set()


class ProgramCompiler:
  """One program compiled ahead of time, once: in a background thread, or at once.

  The program of one shape only, such as the update of a step that
  accumulated micro-batches. :meth:`prefetch` starts its compile (in a
  background thread, or with ``background=False`` at once in the calling
  thread); :meth:`get` returns it, waiting for the compile if it is still
  running. Time spent blocked in :meth:`get` is compile wait, reported by
  :meth:`stats`.

  Args:
    lower: returns the ``jax.stages.Lowered`` program (e.g.
      ``jitted.lower(*placeholders)``); runs in the background thread, so the
      placeholders carry their shardings.
    background: compile in a background thread.
    name: a label for the thread's name.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> def lower():
    ...   return jax.jit(lambda x: 2 * x).lower(jax.ShapeDtypeStruct((3,), jnp.float32))
    >>> compiler = ProgramCompiler(lower, background=True, name="double")
    >>> compiler.prefetch()  # returns at once
    >>> compiler.get()(jnp.ones(3)).tolist()
    [2.0, 2.0, 2.0]
    >>> compiler.stats()["compiled"]
    True
    >>> compiler.close()
  """

  def __init__(
    self, lower: Callable[[], jax.stages.Lowered], *, background: bool, name: str
  ) -> None:
    if not callable(lower):
      raise ValueError(f"lower must be a callable () -> jax.stages.Lowered, got {lower!r}")
    if not isinstance(name, str):
      raise ValueError(f"name must be a str, got {name!r}")
    self._lower = lower
    self._background = validation.check_bool("background", background)
    self._name = name
    self._job: _Job | None = None
    self._closed = False
    self._lock = threading.Lock()
    self._tally = _Tally()
    self.interrupt: Callable[[], bool] | None = None  # True: a waiting get() gives up
    exit_wait.IN_FLIGHT.track(self)

  def prefetch(self) -> None:
    """Starts the compile unless started before (or closed); with ``background=False``
    compiles now.

    Raises:
      Exception: without background, what lowering or compiling raised (the
        next call tries again).
    """
    with self._lock:
      if self._job is not None or (self._closed and self._background):
        return
      job = self._job = _Job(0)
    if self._background:
      _start_daemon(lambda: self._run(job), f"simigrad-{self._name}-compiler")
      return
    self._run(job)
    if job.error is not None:
      with self._lock:
        self._job = None
      raise job.error

  def get(self) -> jax.stages.Compiled:
    """The compiled program, starting its compile or waiting for it as needed.

    Raises:
      Exception: what lowering or compiling raised.
      CompileAbandoned: :attr:`interrupt` said to give up while this waited.
    """
    with self._lock:
      if self._closed and self._job is None:
        self._closed = False  # (on demand after close, as StepCompiler.get)
    self.prefetch()
    job = self._job
    assert job is not None
    if not job.done.is_set():
      start = time.perf_counter()
      try:
        _wait(job.done, self.interrupt, self._name)
      finally:
        with self._lock:
          self._tally.wait_seconds += time.perf_counter() - start
    if job.error is not None:
      raise job.error
    assert job.compiled is not None
    return job.compiled

  @property
  def done(self) -> bool:
    """Whether the compile has finished, compiled or failed."""
    job = self._job
    return job is not None and job.done.is_set()

  @property
  def wait_seconds(self) -> float:
    """Total time :meth:`get` has blocked so far (``stats()["compile_wait_seconds"]``)."""
    with self._lock:
      return self._tally.wait_seconds

  def stats(self) -> dict[str, Any]:
    """``compiled`` (finished without an error), ``compiles`` (0 or 1), ``compile_seconds``,
    ``compile_wait_seconds``, ``cache_hits`` and ``cache_hit_seconds``, as
    :meth:`StepCompiler.stats` counts them (a failed compile's seconds are not counted)."""
    job = self._job
    compiled = job is not None and job.done.is_set() and job.error is None
    with self._lock:
      return {**self._tally.stats(), "compiled": compiled}

  def close(self) -> None:
    """Cancels a compile not started; one in progress goes on in its daemon thread, unawaited
    (the interpreter's normal exit waits for it). Returns at once."""
    with self._lock:
      self._closed = True

  def _run(self, job: _Job) -> None:
    start = time.perf_counter()
    try:
      job.compile(lambda _size: self._lower())
    finally:
      if job.error is None:
        with self._lock:
          self._tally.count(time.perf_counter() - start, compiled=True, cache_hit=job.cache_hit)
      job.done.set()


def _check_sizes(micro_batch_sizes: Any) -> list[int]:
  """Returns the sizes as a list of ints, or raises ValueError."""
  if isinstance(micro_batch_sizes, (str, bytes)) or not isinstance(micro_batch_sizes, Iterable):
    raise ValueError(
      f"micro_batch_sizes must be an iterable of ints >= 1, got {micro_batch_sizes!r}"
    )
  return [validation.check_int("micro_batch_size", size) for size in micro_batch_sizes]
