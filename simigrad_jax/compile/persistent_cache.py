"""Host: JAX's persistent (on-disk) compilation cache: where it lives, turning it on, putting it
back, counting its hits, and the record of what it holds from a run.

Nothing here runs under ``jit``. :func:`default_cache_dir` is where the
cache lives unless a run says otherwise: one folder in the user's cache
directory, shared by every run of this user, so that a new experiment on the
same model loads its executables instead of compiling them again.
:func:`enable_persistent_cache` turns the cache on in a folder, as a
:class:`SharedCache` (size-capped, least recently used entries evicted first,
safe for several processes at once);
:func:`persistent_cache_settings` puts the process-wide settings it changes
back afterwards; :func:`counting_cache_hits` counts the compiles of a thread
that loaded their executable from it. :func:`cache_record` writes down which
of a run's programs the cache holds, for its checkpoints, and
:func:`cached_view` reads that record back when the run resumes, and
:func:`nearest_cached` finds in it the shape nearest to one it lacks.
"""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import logging
import math
import os
import pathlib
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import jax
from jax._src import compilation_cache as jax_compilation_cache
from jax.experimental.compilation_cache import compilation_cache

from simigrad_jax import files
from simigrad_jax import validation

logger = logging.getLogger("simigrad_jax")

__all__ = [
  "CACHE_DIR_VARIABLE",
  "DEFAULT_MAX_BYTES",
  "SharedCache",
  "cache_record",
  "cached_view",
  "counting_cache_hits",
  "default_cache_dir",
  "enable_persistent_cache",
  "nearest_cached",
  "persistent_cache_settings",
]


CACHE_DIR_VARIABLE = "SIMIGRAD_JAX_CACHE_DIR"
"""The environment variable that moves the default cache (:func:`default_cache_dir`); an empty
value turns it off."""

DEFAULT_MAX_BYTES = 2 * 2**30
"""The default cap of a :class:`SharedCache` (2 GiB), unless JAX's
``jax_compilation_cache_max_size`` (``JAX_COMPILATION_CACHE_MAX_SIZE``) sets one."""


def default_cache_dir() -> str | None:
  """Where the persistent compilation cache lives when a run does not say: shared by every run.

  The first of:

  - ``$SIMIGRAD_JAX_CACHE_DIR`` when it is set (an empty value: None, no cache);
  - ``$JAX_COMPILATION_CACHE_DIR``, JAX's own variable, when it is set;
  - ``$XDG_CACHE_HOME/simigrad_jax/compilation_cache``, or
    ``~/.cache/simigrad_jax/compilation_cache`` without it (``$XDG_CACHE_HOME``
    counts only when absolute, as the XDG specification says).

  Returns:
    An absolute path (``~`` expanded), or None when the variable turns the cache off.

  Example:
    >>> from unittest import mock
    >>> with mock.patch.dict(os.environ, {CACHE_DIR_VARIABLE: "/tmp/my_cache"}):
    ...   default_cache_dir()
    '/tmp/my_cache'
    >>> with mock.patch.dict(os.environ, {CACHE_DIR_VARIABLE: ""}):
    ...   default_cache_dir() is None
    True
  """
  if CACHE_DIR_VARIABLE in os.environ:
    chosen = os.environ[CACHE_DIR_VARIABLE]
    return os.path.abspath(os.path.expanduser(chosen)) if chosen else None
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.path.abspath(os.path.expanduser(os.environ["JAX_COMPILATION_CACHE_DIR"]))
  return os.path.join(files.user_cache_home(), "simigrad_jax", "compilation_cache")


def cache_max_bytes() -> int:
  """The cap of the caches :func:`enable_persistent_cache` opens: JAX's
  ``jax_compilation_cache_max_size`` when set (not -1), else :data:`DEFAULT_MAX_BYTES`."""
  configured = jax.config.jax_compilation_cache_max_size  # type: ignore[attr-defined]  # a flag
  return DEFAULT_MAX_BYTES if configured == -1 else int(configured)


def enable_persistent_cache(
  cache_dir: str | os.PathLike, *, allow_shared: bool = False, max_bytes: int | None = None
) -> None:
  """Turns on JAX's persistent (on-disk) compilation cache in ``cache_dir``, as a :class:`SharedCache`.

  Every compile from then on (``jax.jit`` calls and AOT ``.compile()`` alike,
  :class:`StepCompiler` included) first looks for the executable in
  ``cache_dir`` and writes it there after compiling, so a second run of the
  same program starts warm, in any workdir. Sets ``jax_compilation_cache_dir``,
  ``jax_enable_compilation_cache=True``,
  ``jax_persistent_cache_min_compile_time_secs=0`` (cache every executable,
  however fast it compiled; JAX's default is 1 s) and
  ``jax_persistent_cache_min_entry_size_bytes=-1`` (no size threshold, no
  filesystem-specific override).

  This is *process-wide*: it changes global ``jax.config`` settings for every
  thread and every later compile, not just this library's. Call it early,
  before the first compile you want cached. Calling it again with another
  directory switches the cache (the one already open is dropped).

  The folder may be shared by any number of runs, at once too: entries are
  written whole (a reader never sees half of one), and when the folder would
  grow past ``max_bytes`` the least recently used entries are evicted
  (:class:`SharedCache`). An entry JAX cannot read (a process killed while
  writing it with another tool, a damaged disk) is compiled again and
  replaced, with a warning, where JAX alone would warn and compile it again
  on every later run.

  Args:
    cache_dir: a directory path; created if missing (``0700``). Treat it as
      trusted code: whoever can write to it can make this process run
      arbitrary executables. So it must belong to this user and be writable
      by no other (nor its parents: see
      :func:`simigrad_jax.files.check_private_dir`), and the group's and
      other users' permissions are taken off it: they could read the programs.
    allow_shared: skip those checks and leave its mode as it is: for a
      cache on a shared file system whose users you trust.
    max_bytes: the cap of the folder's entries, in bytes (default:
      :func:`cache_max_bytes`).

  Raises:
    ValueError: if ``cache_dir`` is not a non-empty path or exists and is
      not a directory, or ``max_bytes`` is not an integer >= 0.
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
  cap = cache_max_bytes() if max_bytes is None else max_bytes
  if not validation.is_int(cap) or cap < 0:
    raise ValueError(f"max_bytes must be None or an integer >= 0, got {max_bytes!r}")
  path = os.path.abspath(raw)
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(
      f"the compilation cache must be a folder, and {path!r} is a file: move it away, or give "
      f"another folder (${CACHE_DIR_VARIABLE}, or the training scripts' "
      "--config.compilation_cache_dir)"
    )
  files.make_private_dir(path, what="compilation cache", allow_shared=allow_shared, tighten=True)
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  jax.config.update("jax_compilation_cache_dir", path)
  _open_cache(SharedCache(path, int(cap)))


def _open_cache(cache: jax_compilation_cache.CacheInterface | None) -> None:
  """Makes ``cache`` the one JAX reads and writes from the next compile on (None: the one JAX
  opens itself from its settings).

  Uses JAX's private module (checked for here): with another JAX where it
  differs, the cache stays as JAX makes it (its own, without the cap unless
  ``jax_compilation_cache_max_size`` sets one).
  """
  compilation_cache.reset_cache()  # JAX opens its cache once; drop the one already open
  if cache is None or not all(
    hasattr(jax_compilation_cache, name)
    for name in ("_cache", "_cache_initialized", "_cache_initialized_mutex")
  ):
    return
  with jax_compilation_cache._cache_initialized_mutex:  # pylint: disable=protected-access
    jax_compilation_cache._cache = cache  # pylint: disable=protected-access
    jax_compilation_cache._cache_initialized = True  # pylint: disable=protected-access


# The files of one entry, as JAX's own LRU cache names them: the executable, and the time it was
# last used (nanoseconds, little-endian), which orders the eviction.
_ENTRY_SUFFIX = "-cache"
_USED_SUFFIX = "-atime"
_LOCK_NAME = ".lockfile"
_STALE_TEMPORARY_SECONDS = 3600.0  # a temporary file this old was left by a killed writer


class SharedCache(jax_compilation_cache.CacheInterface):
  """JAX's on-disk compilation cache for a folder that several processes share, size-capped.

  The files are JAX's own LRU cache's (``<key>-cache``, ``<key>-atime``),
  but written otherwise: an entry is written to a temporary file and renamed
  into place, so that a reader (another process, without a lock) sees a whole
  entry or none; writes and evictions hold an exclusive ``flock`` on the
  folder's ``.lockfile``, so that two processes never evict at once. JAX's
  own LRU cache needs the ``filelock`` package for its cap, writes entries in
  place, and keeps an entry it could not read; this one needs neither,
  writes whole files, and replaces an unreadable entry with a warning.

  Eviction: when an entry would take the folder's entries past
  ``max_bytes``, the least recently used ones (by their ``-atime``) are
  deleted first; an entry larger than the cap is not written (a warning says
  so). A process that loses an entry to another's eviction compiles it again.

  Args:
    path: the cache's folder (it exists).
    max_bytes: the cap of its entries, in bytes.

  Example:
    >>> import tempfile
    >>> cache = SharedCache(tempfile.mkdtemp(), max_bytes=10)
    >>> cache.put("a", b"123456"); cache.put("b", b"7890")
    >>> cache.put("c", b"xyz")  # over the cap: "a", the least recently used, goes
    >>> cache.get("a") is None, cache.get("c")
    (True, b'xyz')
  """

  def __init__(self, path: str | os.PathLike, max_bytes: int):
    self._path = pathlib.Path(path)
    self.max_bytes = max_bytes

  def get(self, key: str) -> bytes | None:
    """The entry of ``key``, or None; marks it as used now (if no eviction took it meanwhile)."""
    try:
      value = (self._path / f"{key}{_ENTRY_SUFFIX}").read_bytes()
    except FileNotFoundError:
      return None
    with self._locked():  # no eviction between the check and the mark
      if (self._path / f"{key}{_ENTRY_SUFFIX}").exists():
        self._mark_used(key)
    return value

  def put(self, key: str, value: bytes) -> None:
    """Writes the entry of ``key`` (whole), evicting the least recently used ones to fit the cap.

    An entry already there is kept if it is readable (another process wrote it
    meanwhile) and replaced, with a warning, if not (JAX could not read it).
    """
    if len(value) > self.max_bytes:
      logger.warning(
        "not caching the compiled program %s: %d bytes, more than the compilation cache's "
        "cap of %d bytes (jax_compilation_cache_max_size)",
        key,
        len(value),
        self.max_bytes,
      )
      return
    entry = self._path / f"{key}{_ENTRY_SUFFIX}"
    with self._locked():
      if entry.exists():
        if _readable(entry):
          return
        logger.warning("replacing the unreadable compilation cache entry %s", entry)
      self._evict(len(value), keep=entry.name)
      files.write_atomic(entry, value)
      self._mark_used(key)

  def _mark_used(self, key: str) -> None:
    """Writes the entry's time of use (the lock held: an eviction in between would leave a time
    without its entry)."""
    (self._path / f"{key}{_USED_SUFFIX}").write_bytes(time.time_ns().to_bytes(8, "little"))

  @contextlib.contextmanager
  def _locked(self) -> Iterator[None]:
    """Holds the folder's lock (exclusive, between processes) while the block runs."""
    fd = os.open(self._path / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX)
      yield
    finally:
      os.close(fd)  # releases the lock

  def _evict(self, incoming: int, keep: str) -> None:
    """Deletes the least recently used entries until ``incoming`` more bytes fit the cap (the
    lock held), and what killed writers and evictions left behind."""
    entries: list[tuple[int, str, int]] = []  # (last used, name, bytes)
    total = 0
    now = time.time()
    for item in os.scandir(self._path):
      try:
        if item.name.endswith(_ENTRY_SUFFIX) and item.name != keep:
          size = item.stat().st_size
          entries.append((_last_used(item.path), item.name, size))
          total += size
        elif item.name.endswith(_USED_SUFFIX):
          if not os.path.exists(item.path[: -len(_USED_SUFFIX)] + _ENTRY_SUFFIX):
            os.unlink(item.path)  # its entry was evicted while a reader marked it used
        elif item.name.endswith(".tmp") and now - item.stat().st_mtime > _STALE_TEMPORARY_SECONDS:
          os.unlink(item.path)
      except FileNotFoundError:
        continue
    heapq.heapify(entries)
    while entries and total + incoming > self.max_bytes:
      _, name, size = heapq.heappop(entries)
      logger.info("evicting the compilation cache entry %s (%d bytes)", name, size)
      for suffix in (_ENTRY_SUFFIX, _USED_SUFFIX):
        with contextlib.suppress(FileNotFoundError):
          os.unlink(self._path / (name[: -len(_ENTRY_SUFFIX)] + suffix))
      total -= size


def _last_used(entry_path: str) -> int:
  """When an entry was last used (ns): its ``-atime`` file, else its file's time."""
  try:
    with open(entry_path[: -len(_ENTRY_SUFFIX)] + _USED_SUFFIX, "rb") as f:
      return int.from_bytes(f.read(8), "little")
  except FileNotFoundError:
    return os.stat(entry_path).st_mtime_ns


def _readable(entry: pathlib.Path) -> bool:
  """Whether JAX can read the entry: it decompresses (JAX's own check comes after that)."""
  try:
    jax_compilation_cache.decompress_executable(entry.read_bytes())
  except Exception:  # pylint: disable=broad-except  (zstd's and zlib's errors alike)
    return False
  return True


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
  sets are restored to the values they had on entry, and so is the cache JAX
  had open (a :class:`SharedCache`; otherwise JAX's cache is reset, so that
  the next compile opens the restored directory, or none).
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
  opened = getattr(jax_compilation_cache, "_cache", None)
  try:
    yield
  finally:
    for name, value in saved.items():
      jax.config.update(name, value)
    _open_cache(opened if isinstance(opened, SharedCache) else None)


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

  A hint, not a promise: the cache is shared, and another run may have
  evicted an entry since; the resumed run then compiles that program again,
  slower but with the same steps (the record, not the cache's content,
  decides which program a step runs).

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
