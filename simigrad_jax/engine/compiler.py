"""Ahead-of-time compiled step functions, one per micro-batch shape.

Host side: Python threads around JAX's AOT API (``jax.stages``); nothing here
runs under ``jit``.

The global batch size changes at every optimizer step, but the step function
only sees the micro-batch *shape*, drawn from a small grid known up front
(:func:`simigrad_jax.bucket_shapes`). :class:`StepCompiler` holds one
``jax.stages.Compiled`` per micro-batch size. It compiles the sizes the loop
may need next in one background thread while the current step runs, so that
after warm-up :meth:`StepCompiler.get` finds every variant ready and the loop
never stalls on a compile. Compiles need no data: ``lower(micro)`` lowers the
jitted step on ``jax.ShapeDtypeStruct`` placeholders that carry the input
shardings.

:func:`enable_persistent_cache` turns on JAX's on-disk compilation cache, so a
second run of the same script (or a resumed one) loads the executables instead
of compiling them again; :func:`persistent_cache_settings` puts the
process-wide settings it changes back afterwards.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import pathlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
from jax._src import compilation_cache as jax_compilation_cache
from jax.experimental.compilation_cache import compilation_cache

from simigrad_jax import files
from simigrad_jax import validation
from simigrad_jax.errors import SimiGradError

logger = logging.getLogger("simigrad_jax")

__all__ = [
  "StepCompileError",
  "StepCompiler",
  "enable_persistent_cache",
  "persistent_cache_settings",
]


class StepCompileError(SimiGradError, RuntimeError):
  """Lowering or compiling the step for one micro-batch size failed.

  Raised by :meth:`StepCompiler.get` for that size; the original exception is
  the ``__cause__``.
  """


class _Job:
  """One micro-batch size: queued, compiling, or done (compiled or failed)."""

  __slots__ = ("size", "done", "compiled", "error")

  def __init__(self, size: int):
    self.size = size
    self.done = threading.Event()
    self.compiled: jax.stages.Compiled | None = None
    self.error: BaseException | None = None


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
    (8, 2)
    >>> compiler.stats()["compiled_sizes"]
    [8, 16]

  .. note::
    Lowering (tracing) is Python and holds the GIL; XLA's compile releases
    it, so a compile overlaps the running step well when the host has spare
    cores and little on a 2-core machine. Call the returned ``Compiled``
    objects, not the jitted function: a jitted function keeps its own cache
    and would compile again. :meth:`close` (or leaving the ``with`` block)
    cancels queued compiles; a process that exits without it first finishes
    the compiles already queued (the worker is not a daemon thread, and it
    only exists while compiles are queued).
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
    self._jobs: dict[int, _Job] = {}  # every size asked for, in any state
    self._queue: collections.deque[int] = collections.deque()  # not started
    self._worker: threading.Thread | None = None
    self._closed = False
    self._compiles = 0
    self._compile_seconds = 0.0
    self._wait_seconds = 0.0

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
        :func:`simigrad_jax.bucket_shapes`.
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
      waiting = [s for s in dict.fromkeys(sizes) if s not in self._jobs or s in self._queue]
      for size in waiting:
        if size not in self._jobs:
          self._jobs[size] = _Job(size)
          if not first:
            self._queue.append(size)
      if first:
        ahead = set(waiting)
        self._queue = collections.deque(waiting + [s for s in self._queue if s not in ahead])
      if self._queue and self._worker is None:
        self._worker = threading.Thread(
          target=self._work, name=f"{self._name}-compiler", daemon=False
        )
        self._worker.start()

  def get(self, micro_batch_size: int) -> jax.stages.Compiled:
    """Returns the compiled step for one micro-batch size.

    Ready variants return at once. A size compiling in the background is
    waited for; a size never requested, or still queued, is compiled now in
    the calling thread. The time this call blocks counts as compile wait in
    :meth:`stats`. Still works after :meth:`close` (compiling synchronously).

    Args:
      micro_batch_size: rows per device per micro-step, an int ``>= 1``.

    Returns:
      The ``jax.stages.Compiled`` step for that shape.

    Raises:
      ValueError: if ``micro_batch_size`` is not an int ``>= 1``.
      StepCompileError: if lowering or compiling that size failed (now or in
        the background); the original exception is the ``__cause__``.
    """
    size = validation.check_int("micro_batch_size", micro_batch_size)
    with self._lock:
      job = self._jobs.get(size)
      if job is not None and job.done.is_set():
        compile_here = False
      elif job is None:
        job = self._jobs[size] = _Job(size)
        compile_here = True
      elif size in self._queue:  # queued, not started: take it over
        self._queue.remove(size)
        compile_here = True
      else:  # compiling in another thread
        compile_here = False
      blocked = not job.done.is_set()
    if blocked:
      start = time.perf_counter()
      if compile_here:
        self._run(job)
      else:
        job.done.wait()
      waited = time.perf_counter() - start
      with self._lock:
        self._wait_seconds += waited
    if job.error is not None:
      first_line = (str(job.error).strip().splitlines() or [""])[0][:300]
      raise StepCompileError(
        f"StepCompiler {self._name!r}: lowering or compiling the step for "
        f"micro_batch_size={size} failed with "
        f"{type(job.error).__name__}: {first_line} (the cause is chained "
        "below)"
      ) from job.error
    assert job.compiled is not None  # done, without an error
    return job.compiled

  @property
  def wait_seconds(self) -> float:
    """Total time :meth:`get` has blocked so far (``stats()["compile_wait_seconds"]``)."""
    with self._lock:
      return self._wait_seconds

  def stats(self) -> dict[str, Any]:
    """Returns compile counts and times so far.

    Returns:
      A dict with ``compiles`` (successful compiles), ``compile_seconds``
      (total lower + compile time in any thread, failed attempts included),
      ``compile_wait_seconds`` (total time :meth:`get` blocked),
      ``compiled_sizes`` (sorted list of the sizes ready to use) and
      ``failed_sizes`` (those whose lowering or compile failed; :meth:`get`
      raises for them).
    """
    with self._lock:
      return {
        "compiles": self._compiles,
        "compile_seconds": self._compile_seconds,
        "compile_wait_seconds": self._wait_seconds,
        "compiled_sizes": sorted(
          size for size, job in self._jobs.items() if job.done.is_set() and job.error is None
        ),
        "failed_sizes": sorted(
          size for size, job in self._jobs.items() if job.done.is_set() and job.error is not None
        ),
      }

  def close(self) -> None:
    """Stops the worker: waits for the compile in progress, cancels the rest.

    Idempotent. Compiled variants stay available through :meth:`get`;
    cancelled sizes are compiled on demand if asked for later.
    """
    with self._lock:
      self._closed = True
      for size in self._queue:  # never started, so nobody waits on them
        del self._jobs[size]
      self._queue.clear()
      worker = self._worker
    if worker is not None and worker is not threading.current_thread():
      worker.join()

  def __enter__(self) -> StepCompiler:
    return self

  def __exit__(self, *exc_info: object) -> None:
    self.close()

  def _work(self) -> None:
    """Worker loop: compiles queued sizes in order; exits when none are left."""
    while True:
      with self._lock:
        if self._closed or not self._queue:
          self._worker = None
          return
        job = self._jobs[self._queue.popleft()]
      self._run(job)

  def _run(self, job: _Job) -> None:
    """Lowers and compiles ``job.size`` in this thread; always marks it done."""
    start = time.perf_counter()
    try:
      lowered = self._lower(job.size)
      if not isinstance(lowered, jax.stages.Lowered):
        raise TypeError(
          f"lower({job.size}) must return a jax.stages.Lowered (e.g. "
          f"jitted.lower(*placeholders)), got {type(lowered).__name__}: "
          f"{lowered!r:.200}"
        )
      job.compiled = lowered.compile()
    except Exception as err:  # surfaces in get() for this size
      job.error = err
    except BaseException as err:  # e.g. KeyboardInterrupt: do not keep it
      job.error = err
      with self._lock:
        if self._jobs.get(job.size) is job:
          del self._jobs[job.size]
      raise
    finally:
      elapsed = time.perf_counter() - start
      with self._lock:
        self._compile_seconds += elapsed
        if job.error is None:
          self._compiles += 1
      job.done.set()


def _check_sizes(micro_batch_sizes: Any) -> list[int]:
  """Returns the sizes as a list of ints, or raises ValueError."""
  if isinstance(micro_batch_sizes, (str, bytes)) or not isinstance(micro_batch_sizes, Iterable):
    raise ValueError(
      f"micro_batch_sizes must be an iterable of ints >= 1, got {micro_batch_sizes!r}"
    )
  return [validation.check_int("micro_batch_size", size) for size in micro_batch_sizes]


def enable_persistent_cache(cache_dir: str | os.PathLike, *, allow_shared: bool = False) -> None:
  """Turns on JAX's persistent (on-disk) compilation cache in ``cache_dir``.

  Every compile from then on (``jax.jit`` calls and AOT ``.compile()`` alike,
  :class:`StepCompiler` included) first looks for the executable in
  ``cache_dir`` and writes it there after compiling, so a second run of the
  same program starts warm. Sets ``jax_compilation_cache_dir``,
  ``jax_enable_compilation_cache=True``,
  ``jax_persistent_cache_min_compile_time_secs=0`` (cache every executable,
  however fast it compiled; JAX's default is 1 s) and
  ``jax_persistent_cache_min_entry_size_bytes=-1`` (no size threshold, no
  filesystem-specific override).

  This is *process-wide*: it changes global ``jax.config`` settings for every
  thread and every later compile, not just this library's. Call it early,
  before the first compile you want cached. Calling it again with another
  directory switches the cache (the one already open is dropped).

  An entry JAX cannot read (a process killed while writing it, a damaged
  disk) is compiled again and replaced, where JAX alone would warn and
  compile it again on every later run.

  Args:
    cache_dir: a directory path; created if missing (``0700``). Treat it as
      trusted code: whoever can write to it can make this process run
      arbitrary executables. So it must belong to this user and be writable
      by no other (nor its parents: see
      :func:`simigrad_jax.files.check_private_dir`), and the group's and
      other users' permissions are taken off it: they could read the programs.
    allow_shared: skip those checks and leave its mode as it is: for a
      cache on a shared file system whose users you trust.

  Raises:
    ValueError: if ``cache_dir`` is not a non-empty path or exists and is
      not a directory.
    UnsafePathError: (a ValueError) another user could change the cache.

  Example:
    >>> import tempfile
    >>> enable_persistent_cache(tempfile.mkdtemp())  # doctest: +SKIP
  """
  if not isinstance(cache_dir, (str, os.PathLike)):
    raise ValueError(f"cache_dir must be a str or os.PathLike, got {cache_dir!r}")
  raw = os.fspath(cache_dir)
  if not isinstance(raw, str) or not raw:
    raise ValueError(f"cache_dir must be a non-empty path, got {cache_dir!r}")
  path = os.path.abspath(raw)
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"cache_dir must be a directory, got the file {path!r}")
  files.make_private_dir(path, what="compilation cache", allow_shared=allow_shared, tighten=True)
  previous = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # a flag
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  jax.config.update("jax_compilation_cache_dir", path)
  if previous is not None and os.path.abspath(previous) != path:
    # JAX opens its cache once, on the first compile after a directory is
    # set; without a reset it would keep writing to the previous directory.
    compilation_cache.reset_cache()
  _replace_unreadable_entries()


class _ReplacingCache(jax_compilation_cache.CacheInterface):
  """JAX's cache, but an entry that exists when JAX writes it is replaced.

  JAX writes an entry only after its read found none or could not use the one
  there (it warns "Error reading persistent compilation cache entry" and
  compiles again); its own cache then keeps the unreadable entry ("if a cache
  item with the same key already exists, no action will be taken"), and
  every later run warns and compiles again.
  """

  def __init__(self, cache: jax_compilation_cache.CacheInterface):
    self._cache = cache
    self._path = cache._path  # pylint: disable=protected-access

  def get(self, key: str) -> bytes | None:
    return self._cache.get(key)

  def put(self, key: str, value: bytes) -> None:
    entry = pathlib.Path(self._path) / f"{key}-cache"
    if entry.exists():  # JAX could not read it (or another thread wrote it meanwhile)
      logger.warning("replacing the unreadable compilation cache entry %s", entry)
      entry.unlink(missing_ok=True)
    self._cache.put(key, value)


def _replace_unreadable_entries() -> None:
  """Opens JAX's cache now, inside a :class:`_ReplacingCache`.

  Uses JAX's private module (checked for here): with another JAX where it
  differs, the cache stays as JAX makes it.
  """
  if not all(
    hasattr(jax_compilation_cache, name)
    for name in ("_initialize_cache", "_cache", "CacheInterface", "LRUCache")
  ):
    return
  jax_compilation_cache._initialize_cache()  # pylint: disable=protected-access
  cache = jax_compilation_cache._cache  # pylint: disable=protected-access
  if isinstance(cache, jax_compilation_cache.LRUCache):
    jax_compilation_cache._cache = _ReplacingCache(cache)  # pylint: disable=protected-access


# The process-wide ``jax.config`` settings that enable_persistent_cache changes.
_CACHE_SETTINGS = (
  "jax_enable_compilation_cache",
  "jax_compilation_cache_dir",
  "jax_persistent_cache_min_compile_time_secs",
  "jax_persistent_cache_min_entry_size_bytes",
)


@contextlib.contextmanager
def persistent_cache_settings() -> Iterator[None]:
  """Puts JAX's persistent-cache settings back as they were when the block exits.

  :func:`enable_persistent_cache` (and so a :class:`simigrad_jax.Trainer`
  given ``compilation_cache_dir``) changes process-wide ``jax.config``
  settings. Run it inside this block when the process goes on to compile
  other things afterwards (tests, benchmarks, notebooks), so that later
  compiles do not write into that directory, which may be gone by then.

  On exit, normal or not, the four settings :func:`enable_persistent_cache`
  sets are restored to the values they had on entry and JAX's cache is reset,
  so that the next compile opens the restored directory (or none).
  Executables already compiled stay in memory.

  Yields:
    Nothing.

  Example:
    >>> import tempfile
    >>> before = jax.config.jax_compilation_cache_dir
    >>> with tempfile.TemporaryDirectory() as cache_dir, persistent_cache_settings():
    ...   enable_persistent_cache(cache_dir)
    >>> jax.config.jax_compilation_cache_dir == before
    True
  """
  saved = {name: getattr(jax.config, name) for name in _CACHE_SETTINGS}
  try:
    yield
  finally:
    for name, value in saved.items():
      jax.config.update(name, value)
    compilation_cache.reset_cache()
