"""The entry point: ``python -m train --config train/configs/<name>.py [--workdir DIR] [--config.KEY=VALUE ...]``.

Trains the experiment of the config file in ``--workdir`` (default
``$XDG_CACHE_HOME/simigrad/<config name>``, i.e. ``~/.cache/simigrad/<config
name>``: a folder of this user's, created ``0700``; see :func:`default_workdir`),
resuming from the newest checkpoint there,
with JAX's persistent compilation cache that every run of this user shares
(``$SIMIGRAD_JAX_CACHE_DIR``, else
``$XDG_CACHE_HOME/simigrad_jax/compilation_cache``;
``--config.compilation_cache_dir`` to put it elsewhere,
``--config.compilation_cache=False`` to turn it off).
Any config value can be overridden, e.g. ``--config.num_epochs=2
--config.similarity_target=0.2 --config.seed=3``.

Several hosts: start the same command on every host with ``--distributed``
(or ``SIMIGRAD_DISTRIBUTED=1``); it calls ``jax.distributed.initialize()``,
which finds the coordinator by itself on Cloud TPU, SLURM and Open MPI, or
takes ``--coordinator_address``, ``--num_processes`` and ``--process_id``.
The workdir must be on a file system every host sees. When a process dies, the
others end with a ``ProcessLostError`` that names it (exit status 1, within
``config.agreement_timeout_seconds``); start the same command again on every
host to resume from the newest checkpoint.

SIGTERM (a scheduler's preemption), SIGINT (Ctrl-C) or SIGHUP (a closed
terminal, a dropped SSH session) finishes the step under way on every
process, saves its checkpoint, prints where it stopped and exits 0 for
SIGTERM (a clean stop, as schedulers expect), 130 for SIGINT or 129 for SIGHUP;
the same command resumes from there. A second signal exits at once, without
the checkpoint. A SIGTERM or SIGHUP before the first step (while JAX starts, the data
loads, the checkpoint is read) ends the start at once with exit status 0:
no step was done, so there is nothing to save; one after the last step lets
the run finish its report. The process ends without waiting for compiles
still under way in the background (they are abandoned, never awaited).

An expected failure (a bad config or a config typo, the workdir in use,
unsafe or not writable, changed settings, a full disk, a file-size limit, no
readable checkpoint, ...) ends with one line on stderr that names the cause,
the file and the fix, and exit status 1 (2 for a bad command line); the
traceback only with ``--verbose`` or ``SIMIGRAD_VERBOSE=1``, and in
``<workdir>/failure.log`` (:mod:`train.failures`). Any other error is a bug:
its whole traceback is printed, then a line saying so, exit status 1. Every
file and folder the run makes is private (``0600``/``0700``) whatever the umask.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import sys
import threading
import traceback
from collections.abc import Iterable


def _exit_before_start(signum: int, frame: object) -> None:
  """SIGTERM or SIGHUP while the entry point imports its libraries: nothing was done, exit 0."""
  del signum, frame
  os._exit(0)  # pylint: disable=protected-access


if __name__ == "__main__":  # (until stop_before_training replaces it, below)
  for _signum in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(_signum, _exit_before_start)

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
  "config", None, "An experiment config file, e.g. train/configs/digits_demo.py.", lock_config=True
)
flags.DEFINE_string(
  "workdir",
  None,
  "Checkpoints, metrics and plots (default: "
  "$XDG_CACHE_HOME/simigrad/<config name>, ~/.cache/simigrad/<config name> "
  "without it). A run resumes from the newest checkpoint here.",
)
flags.DEFINE_bool(
  "distributed",
  os.environ.get("SIMIGRAD_DISTRIBUTED", "") not in ("", "0"),
  "Call jax.distributed.initialize() first (multi-host; default from $SIMIGRAD_DISTRIBUTED).",
)
flags.DEFINE_string("coordinator_address", None, "jax.distributed: host:port of process 0.")
flags.DEFINE_integer("num_processes", None, "jax.distributed: the number of processes.")
flags.DEFINE_integer("process_id", None, "jax.distributed: this process's id.")
flags.DEFINE_bool(
  "verbose",
  False,
  "Print the traceback of a failure (default: one line; also $SIMIGRAD_VERBOSE=1).",
)
flags.mark_flags_as_required(["config"])


def stop_before_training(signum: int, frame: object) -> None:
  """SIGTERM's and SIGHUP's handler from the start of ``python -m train`` until the loop's own.

  Before the loop (:func:`simigrad_jax.multihost.preemption.training_started`)
  the start ends at once, exit status 0: no step was done, so there is nothing
  to save, and whatever the start was doing (importing JAX, loading the data,
  reading the checkpoint, compiling) is left as a SIGKILL would leave it, which
  a run survives. After the loop (its checkpoint saved, the report under way)
  the signal is only noted: the run is finishing.
  """
  del frame
  name = signal.Signals(signum).name
  preemption = sys.modules.get("simigrad_jax.multihost.preemption")
  if preemption is not None and preemption.training_started():
    print(f"simigrad: {name} after training: finishing the report", flush=True)
    return
  with contextlib.suppress(OSError):  # (after a SIGHUP the terminal may be gone)
    print(
      f"simigrad: {name} before the first step of this start: no step was done, nothing to "
      "save; run the same command to start (or resume from the newest checkpoint)",
      flush=True,
    )
  os._exit(0)  # pylint: disable=protected-access  (no exception: a library could swallow it)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a bad flag or config override as one line (exit status 2)."""
  try:
    return FLAGS(argv)
  except Exception as error:  # pylint: disable=broad-except  (flags.Error, a config's own)
    from train import failures  # pylint: disable=import-outside-toplevel

    if failures.verbose_requested("--verbose" in argv):
      traceback.print_exc()
    print(f"simigrad: {flag_error_line(error, argv)}", file=sys.stderr)
    sys.exit(2)


def flag_error_line(error: Exception, argv: list[str]) -> str:
  """What was wrong on the command line, the suggestion of ml_collections included, in one line.

  Example:
    >>> flag_error_line(AttributeError("'lr'\\nDid you mean \\"lr2\\" instead of \\"lr\\"?"),
    ...                 ["train", "--config=c.py", "--config.lr=1"])
    "the config has no key 'lr' (--config.lr=1); did you mean --config.lr2? (the keys: c.py)"
  """
  config = next(
    (a.split("=", 1)[1] for a in argv if a.startswith("--config=")),
    next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"), "the config file"),
  )
  text = str(error.args[0] if error.args else error)
  text = " ".join(text.replace("\\n", "\n").replace("\\'", "'").replace('\\"', '"').split())
  typo = re.search(r'Did you mean "([\w.]+)" instead of "([\w.]+)"', text)
  if typo:
    wanted, given = typo.groups()
    override = next((a for a in argv if a.startswith(f"--config.{given}")), f"--config.{given}")
    return (
      f"the config has no key {given!r} ({override}); did you mean --config.{wanted}? "
      f"(the keys: {config})"
    )
  if isinstance(error, AttributeError):
    return f"the config has no key {text.strip(chr(34))} (the keys: {config})"
  return f"bad command line: {text.rstrip('.')}; python -m train --help lists the flags"


def command_line_spelling(line: str, options: Iterable[str]) -> str:
  """``line`` with the config's options and the settings it suggests as the command line types them.

  Errors of the training scripts name an option as Python reads it
  (``config.learning_rate``), the library's a Trainer setting by its own name
  (``allow_changed_settings=True``); on the command line both are flags.

  Args:
    line: the failure's line.
    options: the config's option names (a ``config.json`` stays as it is).

  Example:
    >>> command_line_spelling(
    ...   "config.seed=-1 is bad; see config.json or CheckpointConfig(allow_changed_settings=True)",
    ...   ["seed"])
    '--config.seed=-1 is bad; see config.json or --config.allow_changed_settings=True'
  """
  names = "|".join(sorted(map(re.escape, options), key=len, reverse=True))
  if names:
    line = re.sub(rf"(?<![\w.-])config\.({names})\b", r"--config.\1", line)
  return re.sub(
    r"(?<![\w.-])(?:CheckpointConfig\(allow_changed_settings=True\)"
    r"|(?:checkpoints\.)?allow_changed_settings=True)",
    "--config.allow_changed_settings=True",
    line,
  )


def simulate_cpu_devices(count: int) -> None:
  """Asks XLA for ``count`` CPU devices (or the count already in XLA_FLAGS), unless JAX is running.

  Uses ``simigrad_jax.simulated_cpu_devices_env``: the device count plus the
  thread pool size and collective timeouts that keep collectives on simulated
  devices from deadlocking.
  """
  if "jax" in sys.modules or count <= 1:
    return
  import simigrad_jax  # pylint: disable=import-outside-toplevel

  os.environ.update(simigrad_jax.simulated_cpu_devices_env(count))


def default_workdir(config_name: str) -> str:
  """``$XDG_CACHE_HOME/simigrad/<config_name>``, or ``~/.cache/simigrad/<config_name>``.

  A folder of this user's (:func:`simigrad_jax.files.user_cache_home`).
  """
  from simigrad_jax import files  # pylint: disable=import-outside-toplevel

  return os.path.join(files.user_cache_home(), "simigrad", config_name)


def main(argv: list[str]) -> None:
  """Sets up the devices (and the multi-host runtime), then trains the config in the workdir."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not FLAGS["verbosity"].present:  # orbax logs every save at INFO
    logging.set_verbosity(logging.WARNING)
  os.umask(0o077)  # what JAX, orbax and TensorBoard write is private too: 0600 files, 0700 folders
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit: an error naming the file
  _quiet_threads()
  config = FLAGS.config
  if FLAGS.workdir is not None and not FLAGS.workdir.strip():
    print(
      f"simigrad: --workdir={FLAGS.workdir!r} is empty; give a folder, or leave --workdir out "
      "for the default ($XDG_CACHE_HOME/simigrad/<config name>)",
      file=sys.stderr,
    )
    sys.exit(2)
  simulate_cpu_devices(config.num_cpu_devices)
  from train import config_checks  # pylint: disable=import-outside-toplevel

  try:  # before JAX starts its devices: a bad value fails in seconds
    config_checks.check_config(config)
    config_checks.check_given(config, config_flags.get_override_values(FLAGS["config"]))
  except Exception as error:  # pylint: disable=broad-except  (a bug: its traceback, below)
    _exit_with_one_line(error, None)
  import jax  # pylint: disable=import-outside-toplevel

  if FLAGS.distributed:
    jax.distributed.initialize(
      coordinator_address=FLAGS.coordinator_address,
      num_processes=FLAGS.num_processes,
      process_id=FLAGS.process_id,
    )
  import simigrad_jax  # pylint: disable=import-outside-toplevel
  from simigrad_jax import multihost  # pylint: disable=import-outside-toplevel
  from train import train  # pylint: disable=import-outside-toplevel

  name = pathlib.Path(config_flags.get_config_filename(FLAGS["config"])).stem
  workdir = FLAGS.workdir or default_workdir(name)
  try:
    train.train_and_evaluate(config, workdir, title=f"SimiGrad: {name}")
  except multihost.ProcessLostError as error:  # a normal exit would wait for the lost process
    multihost.exit_on_lost_process(error)
  except simigrad_jax.Preempted as stop:
    print(stop, flush=True)
    exit_now(stop.exit_code)
  except Exception as error:  # pylint: disable=broad-except
    _exit_with_one_line(error, pathlib.Path(workdir).absolute())
  exit_now(0)


def exit_now(code: int) -> None:
  """Ends the process with ``code`` once its output is out, without Python's shutdown.

  A compile abandoned in a background thread (a signal's stop does not wait
  for it, nor does the end of a run) would otherwise meet the interpreter's
  shutdown inside JAX and abort the process (exit status 134). The run's
  files are complete by now: the Trainer waited for its checkpoint and
  closed its files. A multi-host run leaves ``jax.distributed`` first.
  """
  sys.stdout.flush()
  sys.stderr.flush()
  if FLAGS.distributed:
    import jax  # pylint: disable=import-outside-toplevel

    jax.distributed.shutdown()
  os._exit(code)  # pylint: disable=protected-access


def _exit_with_one_line(error: Exception, workdir: pathlib.Path | None) -> None:
  """Ends the run with the failure's one line (and its traceback when asked for); exit status 1.

  The line names the config's options and the settings it suggests as they
  are typed on the command line (:func:`command_line_spelling`). An error
  that is not an expected failure (:func:`train.failures.is_expected`: a bug,
  here or in a library) prints its whole traceback, past the filter that
  hides background threads' tracebacks, and a line saying so.
  """
  from train import failures  # pylint: disable=import-outside-toplevel

  if not failures.is_expected(error):
    _exit_on_a_bug(error)
  verbose = failures.verbose_requested(FLAGS.verbose)
  if verbose:
    traceback.print_exception(error)
  logged = getattr(error, "failure_log", None)
  line = failures.one_line(error, workdir if workdir is not None and workdir.is_dir() else None)
  line = command_line_spelling(line, FLAGS.config.keys())
  if logged and not verbose:
    line += f" (traceback: {logged}, or --verbose)"
  sys.stdout.flush()
  sys.stderr.flush()
  # Past the traceback filter: a background thread's traceback cut off mid-way must not take it.
  print(line, file=sys.__stderr__, flush=True)
  os._exit(1)  # pylint: disable=protected-access  (no background thread's error after the line)


def _exit_on_a_bug(error: Exception) -> None:
  """Ends the run with ``error``'s traceback and one line that calls it a bug; exit status 1."""
  logged = getattr(error, "failure_log", None)
  sys.stdout.flush()
  sys.stderr.flush()
  traceback.print_exception(error, file=sys.__stderr__)
  where = f" (also in {logged})" if logged else ""
  print(
    f"simigrad: the run stopped on an unexpected {type(error).__name__}: {error}; this is a bug, "
    f"not a bad setting: please report it with the traceback above{where}",
    file=sys.__stderr__,
    flush=True,
  )
  os._exit(1)  # pylint: disable=protected-access  (as a failure's line: nothing after it)


def _quiet_threads() -> None:
  """A background thread's error (a save, a compile) reaches the run as its failure: one line then.

  Its own traceback is printed only with ``--verbose``.
  """
  from train import failures  # pylint: disable=import-outside-toplevel

  def hook(args: threading.ExceptHookArgs) -> None:
    if failures.verbose_requested(FLAGS.verbose):
      traceback.print_exception(args.exc_value)

  threading.excepthook = hook
  if not failures.verbose_requested(FLAGS.verbose):
    sys.stderr = failures.TracebackFilter(sys.stderr)  # type: ignore[assignment]
    logging.get_absl_handler().python_handler.stream = sys.stderr


if __name__ == "__main__":
  for _signum in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(_signum, stop_before_training)
  app.run(main, flags_parser=parse_flags)
