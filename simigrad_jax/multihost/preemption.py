"""Host: a clean stop on SIGTERM, SIGINT or SIGHUP: the step under way finishes and is saved.

While :meth:`~simigrad_jax.Trainer.train` runs in the main thread, the first
SIGTERM (a scheduler's preemption), SIGINT (Ctrl-C) or SIGHUP (a closed
terminal, a dropped SSH session) is only recorded (:class:`StopSignals`).
The step under way finishes; at its agreement every
process learns whether any of them received a signal, so all of them stop
after the same step; that step's records and checkpoint are written and
waited for, and ``train()`` raises :class:`Preempted`. A one-process run that
is waiting for a step's compile when the signal comes gives the wait up and
stops before that step (:meth:`RunStop.stop_alone`): the compile is
abandoned, never awaited. A second signal ends
the process at once, by the signal's default action, without a checkpoint.
After a SIGHUP the terminal is gone, and a write to it would fail: the
process's standard output and error, where they are a terminal, are sent to
``/dev/null`` from then on (as ``nohup`` would have done), so that the stop
can finish and save; output redirected to a file or a pipe is kept.

The same per-step exchange (:func:`step_report`, read by :class:`Agreed`)
carries process 0's seconds since the last checkpoint, so that
``checkpoint_every_seconds`` saves at the same step on every process, and
whether a process's last background save failed, so that every process
stops at the same step then too. :class:`RunStop` holds a ``train()`` call's
part of it: the signals received, the stop every process agreed on, and the
:class:`Preempted` raised at the end.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

from simigrad_jax.errors import SimiGradError

logger = logging.getLogger("simigrad_jax")

SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

# Whether a StopSignals was entered in this process: a training loop has taken over the signals.
_entered = threading.Event()


def training_started() -> bool:
  """Whether a training loop of this process has taken over its stop signals (:class:`StopSignals`).

  A script's own early handler reads it: before, a signal can end the start
  at once (no step was done, nothing to save); after, the loop has saved its
  checkpoint or is finishing, and the signal needs no action.

  Example:
    >>> with StopSignals():
    ...   pass
    >>> training_started()
    True
  """
  return _entered.is_set()


class Preempted(SimiGradError, RuntimeError):
  """``Trainer.train`` stopped on a signal (:data:`SIGNALS`), after saving its last step's checkpoint.

  Run the same code again to resume from that checkpoint: no step is done
  twice. A script exits with :attr:`exit_code` (``sys.exit(error.exit_code)``).

  Attributes:
    signal: the signal that stopped the run (``signal.SIGTERM``,
      ``signal.SIGINT`` or ``signal.SIGHUP``; with several processes, the
      first process's that received one).
    step: the last optimizer step done, whose checkpoint was saved.
    checkpoint: the folder of that checkpoint.
    summary: what ``train()`` would have returned for the steps it did.
    exit_code: 0 for SIGTERM (a scheduler expects a clean stop), 128 + the
      signal's number (the shell's convention) for the others: 130 for
      SIGINT, 129 for SIGHUP.

  Example:
    >>> try:  # doctest: +SKIP
    ...   summary = trainer.train(num_epochs=90)
    ... except simigrad_jax.Preempted as stop:
    ...   print(stop)
    ...   sys.exit(stop.exit_code)
  """

  def __init__(self, signal_name: str, step: int, checkpoint: str, summary: dict[str, Any]):
    self.signal = signal.Signals[signal_name]
    self.step, self.checkpoint, self.summary = step, checkpoint, summary
    if step == 0:  # stopped while its first step's program compiled
      saved = "no step was done, nothing to save: run the same command again to start"
    else:
      saved = (
        f"its checkpoint is saved in {checkpoint}: run the same command again to resume from it"
      )
    super().__init__(f"training stopped by {signal_name} after step {step}; {saved}")

  @property
  def exit_code(self) -> int:
    """0 for SIGTERM, 128 + the signal's number otherwise (130 for SIGINT)."""
    return 0 if self.signal == signal.SIGTERM else 128 + int(self.signal)

  def __reduce__(self):  # (pickled with its fields, e.g. from a worker process)
    return type(self), (self.signal.name, self.step, self.checkpoint, self.summary)


class StopSignals:
  """While entered in the main thread, the first of :data:`SIGNALS` is recorded instead of acted on.

  The first signal is logged and kept in :attr:`received`; every one of them then
  get their default action back, so a second one ends the process at once,
  whatever the main thread is waiting for. Leaving restores the handlers
  found on entering. Outside the main thread nothing is installed (Python
  delivers signals to the main thread only), and a signal that is ignored
  (``SIG_IGN``, e.g. SIGINT in a shell's background job) stays ignored.

  Example:
    >>> with StopSignals() as signals:
    ...   pass  # one step after another, until signals.received
    >>> signals.received is None
    True
  """

  def __init__(self):
    self.received: signal.Signals | None = None
    self._previous: dict[signal.Signals, Any] = {}
    self._terminals: list[int] = []  # standard output and error where they are a terminal

  def __enter__(self) -> StopSignals:
    self.received = None
    if threading.current_thread() is threading.main_thread():
      _entered.set()
      self._terminals = terminal_outputs()
      for signum in SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
          self._previous[signum] = signal.signal(signum, self._on_signal)
    return self

  def __exit__(self, *exc: Any) -> None:
    for signum, handler in self._previous.items():  # (None: a handler not set from Python)
      signal.signal(signum, signal.SIG_DFL if handler is None else handler)
    self._previous.clear()

  def _on_signal(self, signum: int, frame: Any) -> None:
    del frame
    self.received = signal.Signals(signum)
    for other in self._previous:  # a second signal: its default action, at once
      signal.signal(other, signal.SIG_DFL)
    if self.received == signal.SIGHUP:
      leave_the_terminal(self._terminals)
    logger.warning(
      "%s received: finishing the step under way and saving its checkpoint; "
      "send it again to stop at once, without a checkpoint",
      self.received.name,
    )


def terminal_outputs() -> list[int]:
  """This process's standard output and error (file descriptors 1 and 2) that are a terminal."""
  return [fd for fd in (1, 2) if os.isatty(fd)]


def leave_the_terminal(terminals: Sequence[int]) -> None:
  """Points the file descriptors ``terminals`` at ``/dev/null``.

  After a hang-up the terminal is gone: a write to it fails (``EIO``), and
  a run that is saving its last step must not fail on a progress bar. The
  descriptors are found while the terminal is there (:func:`terminal_outputs`:
  after the hang-up it no longer answers as one).
  """
  if not terminals:
    return
  null = os.open(os.devnull, os.O_WRONLY)
  try:
    for fd in terminals:
      os.dup2(null, fd)
  finally:
    os.close(null)


def step_report(
  signals: StopSignals, seconds_since_checkpoint: float, failed_save: str | None
) -> dict[str, Any]:
  """This process's part of a step's agreement: its stop request and checkpoint state (JSON).

  Args:
    signals: the signals received so far in this ``train()`` call.
    seconds_since_checkpoint: this process's seconds since its last checkpoint.
    failed_save: the error of this process's last save if it failed, else None.
  """
  return {
    "signal": None if signals.received is None else signals.received.name,
    "since_checkpoint": round(seconds_since_checkpoint, 3),
    "failed_save": failed_save,
  }


class Agreed(NamedTuple):
  """What every process reads from the same gathered :func:`step_report` of all of them.

  Attributes:
    stop: the name of the first process's signal (by process index), or None.
    seconds_since_checkpoint: process 0's.
    failed_saves: every process's failed save (None where none failed).
  """

  stop: str | None
  seconds_since_checkpoint: float
  failed_saves: list[str | None]

  @classmethod
  def read(cls, reports: Sequence[dict[str, Any]]) -> Agreed:
    """The agreed outcome of ``reports`` (one per process, in process order)."""
    return cls(
      stop=next((r["signal"] for r in reports if r["signal"]), None),
      seconds_since_checkpoint=reports[0]["since_checkpoint"],
      failed_saves=[r["failed_save"] for r in reports],
    )


class RunStop:
  """A ``train()`` call's stop on a signal: the signals received, and the stop the processes agreed.

  While entered, :attr:`signals` records the first SIGTERM, SIGINT or
  SIGHUP (:class:`StopSignals`); :meth:`report` is this process's part of each
  step's agreement, and the step's agreement sets :attr:`agreed` (the
  signal's name, from :class:`Agreed`), after which the run stops.

  Example::

    with run_stop:
      while more_steps and run_stop.agreed is None:
        ...  # a step, whose agreement sets run_stop.agreed
    run_stop.raise_if_agreed(step, checkpoint, summary)
  """

  def __init__(self):
    self.signals = StopSignals()
    self.agreed: str | None = None  # the signal every process stops on

  def __enter__(self) -> RunStop:
    self.agreed = None
    self.signals.__enter__()
    return self

  def __exit__(self, *exc: Any) -> None:
    self.signals.__exit__(*exc)

  def report(self, seconds_since_checkpoint: float, failed_save: str | None) -> dict[str, Any]:
    """This process's part of a step's agreement (:func:`step_report`)."""
    return step_report(self.signals, seconds_since_checkpoint, failed_save)

  def stop_alone(self) -> bool:
    """Stops a one-process run on the signal received, before the step under way ran (a wait
    for its compile given up); False, and no stop, when no signal was received."""
    if self.signals.received is None:
      return False
    self.agreed = self.signals.received.name
    return True

  @property
  def signalled(self) -> bool:
    """Whether this process received a signal in this ``train()`` call."""
    return self.signals.received is not None

  def raise_if_agreed(self, step: int, checkpoint: str, summary: dict[str, Any]) -> None:
    """Raises :class:`Preempted` if the processes agreed to stop on a signal.

    Args:
      step: the last step done, whose checkpoint is saved.
      checkpoint: the folder of that checkpoint.
      summary: what ``train()`` would have returned.
    """
    if self.agreed is not None:
      raise Preempted(self.agreed, step, checkpoint, summary)
