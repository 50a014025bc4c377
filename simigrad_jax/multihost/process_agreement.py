"""Host: every process of a multi-host run must hold the same settings and decisions, and be there.

A difference between processes would deadlock the next collective, so the
Trainer compares, through JAX's multi-process runtime, what the processes set
up and what they decided at every step, and raises
:class:`ProcessDisagreementError` naming each difference.

The values go through jax.distributed's key-value store and a barrier with a
timeout, not through a collective: a process that died, failed or hangs is
reported by its index (:class:`ProcessLostError`) once the others have waited
:data:`AGREEMENT_TIMEOUT_SECONDS` for it, instead of leaving them waiting in a
collective. A collective that loses a peer mid-step fails with a transport
error that names no process; :func:`roll_call` then finds out which processes
are missing. A collective that never returns (NCCL, or gloo when the peer died
in the middle of it) cannot raise at all: the :class:`Watchdog` then names the
lost process and ends this one.

A run holds one :class:`ProcessAgreement` (its timeout and its watchdog) and
hands it to what needs to agree; with one process every check is a no-op.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import jax
import numpy as np
from jax.experimental import multihost_utils

from simigrad_jax import validation
from simigrad_jax.errors import SimiGradError


class ProcessDisagreementError(SimiGradError, RuntimeError):
  """The processes of a multi-host run set up or decided differently (a collective would deadlock)."""


class ProcessLostError(ProcessDisagreementError):
  """A process of a multi-host run stopped answering: it died, failed, hangs or is far behind.

  The others cannot go on without it; restart all processes, which resume
  from the newest checkpoint.

  Attributes:
    processes: the indices of the processes that did not answer.
  """

  def __init__(self, message: str, processes: Sequence[int] = ()):
    super().__init__(message)
    self.processes = tuple(processes)


_TEXT_WIDTH = 512  # bytes per compared value in the all-gather fallback (longer ones: a CRC prefix)
# How long a process waits for the others at each check (set-up and every step), by default.
AGREEMENT_TIMEOUT_SECONDS = 300.0
_KEY = "simigrad_jax/agreement"
_HEARTBEAT_KEY = "simigrad_jax/heartbeat"
_agreement_rounds = itertools.count()
_lost: set[int] = (
  set()
)  # the processes this one found missing (for good: a lost peer never returns)
_last_check = time.monotonic()  # when this process last entered or left a check


def agree(
  what: str,
  values: Mapping[str, Any],
  set_up: bool = False,
  timeout: float | None = None,
  *,
  report: Any = None,
) -> list[Any] | None:
  """Raises :class:`ProcessDisagreementError` unless every process holds the same ``values``.

  Nothing is compared with one process. Each value is compared as JSON; the
  error names each differing key with every process's value.

  Args:
    what: what is compared, for the messages (e.g. ``"settings"``).
    values: the values every process must hold, by name.
    set_up: the check is part of the set-up (the message of a missing
      process then says it failed before the check).
    timeout: seconds to wait for the other processes (default:
      :data:`AGREEMENT_TIMEOUT_SECONDS`).
    report: optional: this process's own value, NOT compared, sent along in
      the same exchange (JSON of at most 512 bytes).

  Returns:
    None without ``report``; else every process's ``report``, by process
    index (the same list on every process).

  Raises:
    ProcessDisagreementError: the processes hold different values.
    ProcessLostError: a process did not reach this check within ``timeout``.
  """
  texts = [json.dumps(values[key], sort_keys=True, default=str) for key in values]
  report_text = None if report is None else json.dumps(report, sort_keys=True)
  if report_text is not None and len(report_text.encode()) > _TEXT_WIDTH:
    raise ValueError(
      f"a report of {len(report_text.encode())} bytes does not fit the "
      f"{_TEXT_WIDTH} bytes that the exchange sends per value: {report_text[:80]}..."
    )
  if jax.process_count() == 1:
    return None if report is None else [report]
  sent = texts + ([] if report_text is None else [report_text])
  gathered = _gather_texts(sent, what, timeout=timeout, set_up=set_up)
  reports = None if report is None else [json.loads(row[len(texts)]) for row in gathered]
  differing = [i for i in range(len(texts)) if len({row[i] for row in gathered}) > 1]
  if not differing:
    return reports
  details = "; ".join(
    f"{key}: " + ", ".join(f"process {p} has {row[i]}" for p, row in enumerate(gathered))
    for i, key in enumerate(values)
    if i in differing
  )
  raise ProcessDisagreementError(
    f"the {jax.process_count()} processes disagree on the {what} ({details}). All processes "
    "must run with the same settings and take the same decisions, or the next collective "
    "would deadlock; build the Trainer with the same settings, data set and code on every "
    "process"
  )


def gather(what: str, value: Any, timeout: float | None = None) -> list[Any]:
  """Every process's ``value`` (JSON-serialisable), in process order; ``[value]`` with one process.

  Args:
    what: what is exchanged, for the messages; every process must be at the
      same ``what``.
    value: this process's value.
    timeout: seconds to wait for the other processes (default:
      :data:`AGREEMENT_TIMEOUT_SECONDS`).

  Raises:
    ProcessLostError: a process did not come within ``timeout``.
  """
  if jax.process_count() == 1:
    return [value]
  return [
    json.loads(texts[0]) for texts in _gather_texts([json.dumps(value)], what, timeout=timeout)
  ]


def roll_call(what: str, error: BaseException, timeout: float | None = None) -> None:
  """After ``error`` ended this process's ``what``, raises :class:`ProcessLostError` naming the
  processes that do not answer within ``timeout`` seconds; returns when every process answers.

  A collective whose peer died fails with a transport error (gloo: "Connection
  reset by peer") that names no process. Every process that the same loss
  stopped comes here too, so the processes that do not come are the lost ones.
  Nothing happens with one process.
  """
  if jax.process_count() == 1:
    return
  try:
    _gather_texts([], "roll call after a failed step", timeout=timeout)
  except ProcessLostError as lost:
    raise ProcessLostError(
      f"{_processes(lost.processes)} did not answer within {_timeout(timeout):g} s after "
      f"{what} failed on process {jax.process_index()} ({type(error).__name__}: "
      f"{_first_line(error)}): died, or blocked or failing too (see the process's log). "
      f"{_RESTART}",
      lost.processes,
    ) from error


def check_timeout(timeout: Any, name: str = "agreement_timeout_seconds") -> float:
  """Returns ``timeout`` as a float if it is a finite number of seconds > 0, else raises ValueError.

  Args:
    timeout: the seconds a process waits for the others at a check.
    name: the setting's name, for the message.

  Returns:
    ``float(timeout)``.

  Example:
    >>> check_timeout(30)
    30.0
  """
  return validation.check_real(name, timeout, "(0, inf) (finite)", lambda x: 0 < x < math.inf)


class ProcessAgreement:
  """The checks that keep the processes of a run in step, with one timeout; no-ops with one process.

  One object per run, handed to everything that must agree with the other
  processes (the Trainer's set-up and steps, the checkpoints): it holds the
  timeout and, once started, the :class:`Watchdog`. Its methods are
  :func:`agree`, :func:`gather` and :func:`roll_call` with that timeout.

  Args:
    timeout: how long a process waits for the others at a check before it
      raises :class:`ProcessLostError` naming the missing ones (seconds,
      finite, > 0).

  Example:
    >>> agreement = ProcessAgreement(timeout=60.0)
    >>> agreement.agree("decision of step 1", {"batch_size": 48}) is None  # one process
    True
    >>> agreement.gather("checkpoint saved", True)
    [True]
  """

  def __init__(self, timeout: float = AGREEMENT_TIMEOUT_SECONDS):
    self.timeout = check_timeout(timeout, "timeout")
    self._watchdog: Watchdog | None = None

  @property
  def num_processes(self) -> int:
    """The processes of the run (``jax.process_count()``)."""
    return jax.process_count()

  def agree(
    self, what: str, values: Mapping[str, Any], *, set_up: bool = False, report: Any = None
  ) -> list[Any] | None:
    """:func:`agree` with this object's timeout."""
    return agree(what, values, set_up, self.timeout, report=report)

  def gather(self, what: str, value: Any) -> list[Any]:
    """:func:`gather` with this object's timeout."""
    return gather(what, value, self.timeout)

  def roll_call(self, what: str, error: BaseException) -> None:
    """:func:`roll_call` with this object's timeout."""
    roll_call(what, error, self.timeout)

  def lost_processes(self) -> frozenset[int]:
    """The processes found missing at a check (see :func:`lost_processes`)."""
    return lost_processes()

  def start_watchdog(self) -> None:
    """Starts the :class:`Watchdog` (heartbeats; nothing with one process), until :meth:`close`."""
    if self._watchdog is None:
      self._watchdog = Watchdog(self.timeout)

  def close(self) -> None:
    """Stops the watchdog, if it runs."""
    if self._watchdog is not None:
      self._watchdog.close()


_RESTART = (
  "Restart all processes with the same command: they resume from the newest checkpoint "
  "(the wait is the Trainer's agreement_timeout_seconds)"
)


def _gather_texts(
  texts: list[str], what: str = "values", *, timeout: float | None = None, set_up: bool = False
) -> list[list[str]]:
  """Every process's ``texts``, in process order.

  Through jax.distributed's key-value store: each process writes its texts,
  waits at a barrier for the others (at most ``timeout`` seconds, default
  :data:`AGREEMENT_TIMEOUT_SECONDS`) and reads theirs: three small requests to
  the coordinator, no collective. Without jax.distributed's client, one
  all-gather over the processes (no timeout).

  Raises:
    ProcessLostError: a process did not arrive within ``timeout`` (named).
    ProcessDisagreementError: the processes are at different checks.
  """
  global _last_check
  client = _client()
  if client is None:
    return _allgather_texts(texts)
  _last_check = time.monotonic()
  try:
    return _exchange_texts(client, texts, what, _timeout(timeout), set_up)
  finally:
    _last_check = time.monotonic()


def _exchange_texts(
  client: Any, texts: list[str], what: str, timeout: float, set_up: bool
) -> list[list[str]]:
  """:func:`_gather_texts` through the key-value store."""
  # Two slots, used in turn: a process can only write round r + 2 after every process has
  # passed round r + 1's barrier, so after reading round r.
  round_ = next(_agreement_rounds)
  slot = f"{_KEY}/{round_ % 2}"
  client.key_value_set(
    f"{slot}/{jax.process_index()}", json.dumps([round_, what, texts]), allow_overwrite=True
  )
  try:
    client.wait_at_barrier(slot, int(timeout * 1000))
  except Exception as error:  # pylint: disable=broad-except  (a timeout, as the runtime reports it)
    arrived = {p for p, (r, _, _) in _read_slot(client, slot).items() if r == round_}
    missing = [p for p in range(jax.process_count()) if p not in arrived]
    if not missing:  # every process arrived, but another one gave up waiting first
      raise ProcessDisagreementError(
        f"the check of the {what} failed: another process gave up waiting for this one "
        f"({type(error).__name__}: {_first_line(error)})"
      ) from error
    _lost.update(missing)
    reason = "failed before it" if set_up else "died, failed or hangs"
    raise ProcessLostError(
      f"{_processes(missing)} did not reach the Trainer's check of the {what} within "
      f"{timeout:g} s on process {jax.process_index()}: {reason} (see the process's "
      f"log), or far behind. {_RESTART}",
      missing,
    ) from error
  entries = _read_slot(client, slot)
  behind = {p: entry for p, entry in entries.items() if entry[:2] != [round_, what]}
  if behind or len(entries) != jax.process_count():
    raise ProcessDisagreementError(
      f"the processes are at different checks: process {jax.process_index()} at the {what} "
      f"(check {round_}), "
      + ", ".join(f"process {p} at the {w} (check {r})" for p, (r, w, _) in sorted(behind.items()))
    )
  return [entries[p][2] for p in range(jax.process_count())]


class Watchdog:
  """Multi-host: ends this process, naming the lost one, when it waits for a lost process in vain.

  A collective whose peer died may never return (NCCL; gloo when the peer
  died in the middle of it), and Python cannot interrupt it, so no check can
  raise. While a watchdog runs, a thread of every process writes a heartbeat
  to jax.distributed's key-value store about once a second. When this process
  has not been at a check of the processes (every step has one) for
  ``timeout`` seconds, and a peer's heartbeat has not changed for half of
  that, this process waits for a lost one: the watchdog prints the
  :class:`ProcessLostError` that names it and ends the process with status 1
  (a process that lost a peer cannot end by itself: jax.distributed's
  shutdown would wait for the peer). Nothing runs with one process.

  Args:
    timeout: the agreement timeout, in seconds.
  """

  def __init__(self, timeout: float):
    self._timeout = timeout
    self._stopped = threading.Event()
    client = _client() if jax.process_count() > 1 else None
    if client is not None:
      threading.Thread(
        target=self._watch, args=(client,), name="simigrad-watchdog", daemon=True
      ).start()

  def close(self) -> None:
    """Stops the heartbeats and the watching."""
    self._stopped.set()

  def _watch(self, client: Any) -> None:
    period = min(1.0, self._timeout / 5)
    me = jax.process_index()
    peers = [p for p in range(jax.process_count()) if p != me]
    beats = itertools.count()
    seen: dict[int, tuple[str | None, float]] = {}  # peer -> (its last heartbeat, when it changed)
    while not self._stopped.wait(period):
      try:
        client.key_value_set(f"{_HEARTBEAT_KEY}/{me}", str(next(beats)), allow_overwrite=True)
        now = time.monotonic()
        waiting = now - _last_check
        if waiting < self._timeout / 2:  # read the peers' heartbeats only while waiting long
          seen.clear()
          continue
        beat = {
          int(key.rsplit("/", 1)[1]): value
          for key, value in client.key_value_dir_get(f"{_HEARTBEAT_KEY}/")
        }
        for p in peers:
          if p not in seen or seen[p][0] != beat.get(p):
            seen[p] = (beat.get(p), now)
        silent = [p for p in peers if now - seen[p][1] >= self._timeout / 2]
      except Exception:  # pylint: disable=broad-except  (the runtime is going down: JAX reports it)
        continue
      # (A lost process already reported in the main thread needs no second report.)
      if (
        silent
        and waiting >= self._timeout + period
        and not _lost.issuperset(silent)
        and not self._stopped.is_set()
      ):
        _lost.update(silent)
        exit_on_lost_process(
          ProcessLostError(
            f"{_processes(silent)} sent no heartbeat for {self._timeout / 2:g} s, and process "
            f"{me} has waited {waiting:.0f} s since its last check of the processes (in a "
            f"collective that does not return without the lost process): ending process {me}. "
            f"{_RESTART}",
            silent,
          )
        )


def exit_on_lost_process(error: ProcessLostError) -> NoReturn:
  """Prints ``error`` (with its traceback, if it was raised) and ends this process with status 1.

  A process that lost a peer cannot end normally: jax.distributed's shutdown
  at exit, and a checkpoint commit under way, wait for the lost process until
  its heartbeat timeout (``heartbeat_timeout_seconds`` of
  ``jax.distributed.initialize``, 100 s by default), then abort. A script
  calls this on a :class:`ProcessLostError`; the :class:`Watchdog` calls it
  itself.
  """
  sys.stdout.flush()
  sys.stderr.write("".join(traceback.format_exception(error)))
  sys.stderr.flush()
  os._exit(1)


def lost_processes() -> frozenset[int]:
  """The processes this one found missing at a check: a wait for them would not end."""
  return frozenset(_lost)


def _client() -> Any:
  """jax.distributed's client, or None when the runtime was not initialised through it."""
  try:
    from jax._src import distributed  # pylint: disable=import-outside-toplevel

    return distributed.global_state.client
  except (ImportError, AttributeError):
    return None


def _read_slot(client: Any, slot: str) -> dict[int, list[Any]]:
  """``{process: [round, what, texts]}`` of the entries in a slot."""
  return {
    int(key.rsplit("/", 1)[1]): json.loads(value)
    for key, value in client.key_value_dir_get(f"{slot}/")
  }


def _allgather_texts(texts: list[str]) -> list[list[str]]:
  """Every process's ``texts`` (same length on all), via one all-gather of fixed-width bytes."""
  rows = np.zeros((len(texts), _TEXT_WIDTH), np.uint8)
  for i, text in enumerate(texts):
    data = text.encode()
    if len(data) > _TEXT_WIDTH:
      data = f"crc32={zlib.crc32(data):08x} ".encode() + data[: _TEXT_WIDTH - 24] + b"..."
    rows[i, : len(data)] = np.frombuffer(data, np.uint8)
  gathered = np.asarray(multihost_utils.process_allgather(rows))  # (processes, texts, width)
  return [
    [bytes(row).rstrip(b"\0").decode(errors="replace") for row in process] for process in gathered
  ]


def _timeout(timeout: float | None) -> float:
  return AGREEMENT_TIMEOUT_SECONDS if timeout is None else timeout


def _processes(processes: Sequence[int]) -> str:
  """``process 1`` or ``processes 1, 3``."""
  return ("process " if len(processes) == 1 else "processes ") + ", ".join(map(str, processes))


def _first_line(error: BaseException) -> str:
  return (str(error).strip().splitlines() or [""])[0][:300]
