"""Host: JAX's persistent (on-disk) compilation cache: turning it on, putting it back, counting
its hits, and the record of what it holds from a run.

Nothing here runs under ``jit``. :func:`enable_persistent_cache`
turns the cache on, so that a second run of the same script (or a resumed
one) loads its executables instead of compiling them again;
:func:`persistent_cache_settings` puts the process-wide settings it changes
back afterwards; :func:`counting_cache_hits` counts the compiles of a thread
that loaded their executable from it. :func:`cache_record` writes down which
of a run's programs the cache holds, for its checkpoints, and
:func:`cached_view` reads that record back when the run resumes, and
:func:`nearest_cached` finds in it the shape nearest to one it lacks.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pathlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import jax
from jax._src import compilation_cache as jax_compilation_cache
from jax.experimental.compilation_cache import compilation_cache

from simigrad_jax import files

logger = logging.getLogger("simigrad_jax")

__all__ = [
  "cache_record",
  "cached_view",
  "counting_cache_hits",
  "enable_persistent_cache",
  "nearest_cached",
  "persistent_cache_settings",
]


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


# What JAX records when a compile loads its executable from the persistent cache.
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_cache_hit_counts = threading.local()  # .hits: a list of one count while a thread compiles
_cache_hit_listener_lock = threading.Lock()
_cache_hit_listener_registered = False


def _note_cache_hit(event: str, **kwargs: Any) -> None:
  """JAX's event listener: counts a cache hit for the compile under way in this thread."""
  del kwargs
  hits = getattr(_cache_hit_counts, "hits", None)
  if event == _CACHE_HIT_EVENT and hits is not None:
    hits[0] += 1


@contextlib.contextmanager
def counting_cache_hits() -> Iterator[list[int]]:
  """Counts the compiles in this thread that load their executable from JAX's persistent cache.

  JAX records an event for each executable its persistent compilation cache
  gives back (a hit); one process-wide listener, registered the first time,
  counts those of the thread inside the block, whatever other threads
  compile meanwhile.

  Yields:
    A list of one int: the hits so far in the block (read it after the block).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> with counting_cache_hits() as hits:
    ...   _ = jax.jit(lambda x: x + 1).lower(jnp.ones(2)).compile()
    >>> hits[0]  # no persistent cache is on here
    0
  """
  global _cache_hit_listener_registered  # pylint: disable=global-statement
  with _cache_hit_listener_lock:
    if not _cache_hit_listener_registered:
      jax.monitoring.register_event_listener(_note_cache_hit)
      _cache_hit_listener_registered = True
  outer = getattr(_cache_hit_counts, "hits", None)
  hits = [0]
  _cache_hit_counts.hits = hits
  try:
    yield hits
  finally:
    _cache_hit_counts.hits = outer
    if outer is not None:
      outer[0] += hits[0]


def cache_record(
  cache_dir: str, compiled: Mapping[str, Any], cached: Mapping[str, Any] | None
) -> dict[str, Any]:
  """What the persistent cache in ``cache_dir`` holds from a run, for its checkpoints.

  Args:
    cache_dir: the cache's folder (absolute).
    compiled: the view of what this process compiled
      (:meth:`simigrad_jax.compile.program_compiler.StepProgramCompiler.view`).
    cached: the view of what the earlier processes of the run left in the
      cache (:func:`cached_view`), or None.

  Returns:
    ``{"compilation_cache_dir", "fused", "micro", "apply"}``: the folder,
    the shapes (rows per slot) with a one-micro-batch program and with a
    micro-step, sorted, and whether the update is, compiled by this process
    or by the earlier ones. :func:`cached_view` reads it back.

  Example:
    >>> here = {"fused": {4}, "micro": set(), "apply": False}
    >>> cache_record("/cache", here, {"fused": {2}, "micro": {2}, "apply": True})
    {'compilation_cache_dir': '/cache', 'fused': [2, 4], 'micro': [2], 'apply': True}
  """
  before = cached or {"fused": set(), "micro": set(), "apply": False}
  return {
    "compilation_cache_dir": cache_dir,
    "fused": sorted(set(compiled["fused"]) | set(before["fused"])),
    "micro": sorted(set(compiled["micro"]) | set(before["micro"])),
    "apply": bool(compiled["apply"] or before["apply"]),
  }


def cached_view(
  record: Mapping[str, Any] | None, cache_dir: str | None, grid: set[int]
) -> dict[str, Any] | None:
  """The view of what a checkpoint's record says the cache in ``cache_dir`` holds.

  Args:
    record: ``{"compilation_cache_dir", "fused", "micro", "apply"}``, as
      :func:`cache_record` wrote it, or None.
    cache_dir: this run's cache folder (absolute), or None.
    grid: this run's shapes.

  Returns:
    ``{"fused", "micro", "apply"}`` of the record's shapes in ``grid``; None
    when the record is missing, malformed or names another folder (such a
    record only costs the first step a compile).

  Example:
    >>> record = {"compilation_cache_dir": "/cache", "fused": [4, 9], "micro": [], "apply": True}
    >>> cached_view(record, "/cache", {2, 4})
    {'fused': {4}, 'micro': set(), 'apply': True}
    >>> cached_view(record, "/elsewhere", {2, 4}) is None
    True
  """
  if not isinstance(record, Mapping) or cache_dir is None:
    return None
  if record.get("compilation_cache_dir") != cache_dir:
    return None
  shapes = {}
  for kind in ("fused", "micro"):
    sizes = record.get(kind)
    if not isinstance(sizes, list) or not all(isinstance(size, int) for size in sizes):
      return None
    shapes[kind] = set(sizes) & grid
  return {**shapes, "apply": record.get("apply") is True}


def nearest_cached(kind: str, micro: int, cached: Mapping[str, Any] | None) -> int:
  """``micro``, or the nearest shape (log scale; ties: the larger) whose ``kind`` program
  (``"fused"`` or ``"micro"``) ``cached`` holds, when it holds some but not ``micro``'s."""
  sizes = set() if cached is None else cached[kind]
  if not sizes or micro in sizes:
    return micro
  return min(sizes, key=lambda size: (abs(math.log(size / micro)), -size))
