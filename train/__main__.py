"""The entry point: ``python -m train --config train/configs/<name>.py [--workdir DIR] [--config.KEY=VALUE ...]``.

Trains the experiment of the config file in ``--workdir`` (default
``$XDG_CACHE_HOME/simigrad/<config name>``, i.e. ``~/.cache/simigrad/<config
name>``: a folder of this user's, created ``0700``; see :func:`default_workdir`),
resuming from the newest checkpoint there,
with JAX's persistent compilation cache in ``<workdir>/compilation_cache``
(``--config.compilation_cache_dir`` to put it elsewhere,
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

SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C) finishes the step under
way on every process, saves its checkpoint, prints where it stopped and
exits 0 for SIGTERM (a clean stop, as schedulers expect) or 130 for SIGINT;
the same command resumes from there. A second signal exits at once, without
the checkpoint.
"""

from __future__ import annotations

import os
import pathlib
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

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
flags.mark_flags_as_required(["config"])


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

  A folder of this user's, not a shared one such as ``/tmp`` (where another
  user could make it first); ``$XDG_CACHE_HOME`` counts only when absolute,
  as the XDG specification says.
  """
  cache = os.environ.get("XDG_CACHE_HOME", "")
  if not os.path.isabs(cache):
    cache = os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(cache, "simigrad", config_name)


def main(argv: list[str]) -> None:
  """Sets up the devices (and the multi-host runtime), then trains the config in the workdir."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not FLAGS["verbosity"].present:  # orbax logs every save at INFO
    logging.set_verbosity(logging.WARNING)
  config = FLAGS.config
  simulate_cpu_devices(config.num_cpu_devices)
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
    sys.exit(stop.exit_code)


if __name__ == "__main__":
  app.run(main)
