"""Host: every process of a multi-host run must hold the same settings and decisions.

A difference between processes would deadlock the next collective, so the
Trainer compares, through JAX's multi-process runtime, what the processes set
up and what they decided at every step, and raises
:class:`ProcessDisagreementError` naming each difference.
"""

from __future__ import annotations

import itertools
import json
import zlib
from typing import Any, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils


class ProcessDisagreementError(RuntimeError):
  """The processes of a multi-host run set up or decided differently (a collective would deadlock)."""


_TEXT_WIDTH = 512  # bytes per compared value in the agreement check (longer ones: a CRC prefix)
# How long a process waits at set-up for the others to reach the same point (multi-host).
AGREEMENT_TIMEOUT_SECONDS = 300.0
_agreement_rounds = itertools.count()


def agree(what: str, values: Mapping[str, Any], set_up: bool = False, *,
          report: Any = None) -> list[Any] | None:
  """Raises :class:`ProcessDisagreementError` unless every process holds the same ``values``.

  Nothing is compared with one process. Each value is compared as JSON; the
  error names each differing key with every process's value. Per step, one
  small all-gather over the processes; at set-up (``set_up=True``) the
  values go through jax.distributed's key-value store instead, so that a
  process that failed before reaching this point is reported after
  :data:`AGREEMENT_TIMEOUT_SECONDS` rather than leaving the others waiting.

  Args:
    what: what is compared, for the error message.
    values: the values every process must hold, by name.
    set_up: go through the key-value store, with a timeout (see above).
    report: optional: this process's own value, NOT compared, sent along in
      the same exchange (JSON of at most 512 bytes).

  Returns:
    None without ``report``; else every process's ``report``, by process
    index (the same list on every process).
  """
  texts = [json.dumps(values[key], sort_keys=True, default=str) for key in values]
  report_text = None if report is None else json.dumps(report, sort_keys=True)
  if report_text is not None and len(report_text.encode()) > _TEXT_WIDTH:
    raise ValueError(f"a report of {len(report_text.encode())} bytes does not fit the "
                     f"{_TEXT_WIDTH} bytes that the exchange sends per value: {report_text[:80]}...")
  if jax.process_count() == 1:
    return None if report is None else [report]
  sent = texts + ([] if report_text is None else [report_text])
  gathered = _gather_texts_with_timeout(sent, what) if set_up else _gather_texts(sent)
  reports = None if report is None else [json.loads(row[len(texts)]) for row in gathered]
  differing = [i for i in range(len(texts)) if len({row[i] for row in gathered}) > 1]
  if not differing:
    return reports
  details = "; ".join(
      f"{key}: " + ", ".join(f"process {p} has {row[i]}" for p, row in enumerate(gathered))
      for i, key in enumerate(values) if i in differing)
  raise ProcessDisagreementError(
      f"the {jax.process_count()} processes disagree on the {what} ({details}). All processes "
      "must run with the same settings and take the same decisions, or the next collective "
      "would deadlock; build the Trainer with the same settings, data set and code on every "
      "process")


def _gather_texts_with_timeout(texts: list[str], what: str) -> list[list[str]]:
  """Every process's ``texts`` through jax.distributed's key-value store, waiting at most
  :data:`AGREEMENT_TIMEOUT_SECONDS` for each process (falls back to an all-gather)."""
  try:
    from jax._src import distributed  # pylint: disable=import-outside-toplevel
    client = distributed.global_state.client
  except (ImportError, AttributeError):
    client = None
  if client is None:
    return _gather_texts(texts)
  key = f"simigrad_jax/agreement/{next(_agreement_rounds)}"
  client.key_value_set(f"{key}/{jax.process_index()}", json.dumps(texts))
  gathered = []
  for process in range(jax.process_count()):
    try:
      gathered.append(json.loads(client.blocking_key_value_get(
          f"{key}/{process}", int(AGREEMENT_TIMEOUT_SECONDS * 1000))))
    except Exception as error:  # pylint: disable=broad-except  (a timeout, as the runtime reports it)
      raise ProcessDisagreementError(
          f"process {process} did not reach the Trainer's check of the {what} within "
          f"{AGREEMENT_TIMEOUT_SECONDS:g} s: it failed before it (see its log) or is far behind "
          f"({type(error).__name__}: {_first_line(error)})") from error
  return gathered


def _first_line(error: BaseException) -> str:
  return (str(error).strip().splitlines() or [""])[0][:300]


def _gather_texts(texts: list[str]) -> list[list[str]]:
  """Every process's ``texts`` (same length on all), via one all-gather of fixed-width bytes."""
  rows = np.zeros((len(texts), _TEXT_WIDTH), np.uint8)
  for i, text in enumerate(texts):
    data = text.encode()
    if len(data) > _TEXT_WIDTH:
      data = f"crc32={zlib.crc32(data):08x} ".encode() + data[:_TEXT_WIDTH - 24] + b"..."
    rows[i, :len(data)] = np.frombuffer(data, np.uint8)
  gathered = np.asarray(multihost_utils.process_allgather(rows))  # (processes, texts, width)
  return [[bytes(row).rstrip(b"\0").decode(errors="replace") for row in process]
          for process in gathered]
