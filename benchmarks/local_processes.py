"""Runs a benchmark script as several ``jax.distributed`` processes on this host, as on a pod.

Each process gets its share of simulated CPU devices and the flags
``--coordinator``, ``--num-processes``, ``--process-id`` and
``--result-file``; the script joins the others with
``jax.distributed.initialize`` and process 0 writes its results, as JSON, to
the result file. Import it after the devices are set up (it imports JAX).
"""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import common
from simigrad_jax import simulated_cpu_devices_env


def run_local_processes(
  script_args: Sequence[str],
  *,
  num_processes: int,
  devices_per_process: int,
  workdir: pathlib.Path,
  timeout: float,
  what: str,
) -> dict[str, Any]:
  """Runs ``python *script_args`` as ``num_processes`` processes; returns what process 0 wrote.

  Args:
    script_args: the script's path and its own arguments.
    num_processes: how many processes to start.
    devices_per_process: simulated CPU devices in each.
    workdir: an existing directory for the result file and each process's
      log (``process<i>.log``).
    timeout: seconds after which every process still running is killed.
    what: the run's name, for the error message.

  Returns:
    The JSON object that process 0 wrote to its ``--result-file``.

  Raises:
    RuntimeError: a process failed, ran past ``timeout`` or process 0 wrote
      no result; with each process's exit status and last output.
  """
  result_file = workdir / "result.json"
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    coordinator = f"127.0.0.1:{probe.getsockname()[1]}"
  env = common.child_environment(own_device_count=True)
  env.update(simulated_cpu_devices_env(devices_per_process, environ=env))
  command = [
    sys.executable,
    *map(str, script_args),
    "--coordinator",
    coordinator,
    "--num-processes",
    str(num_processes),
    "--result-file",
    str(result_file),
  ]
  logs = [workdir / f"process{i}.log" for i in range(num_processes)]
  processes = []
  for i, log in enumerate(logs):
    with open(log, "w") as out:
      processes.append(
        subprocess.Popen(
          command + ["--process-id", str(i)], env=env, stdout=out, stderr=subprocess.STDOUT
        )
      )
  deadline = time.monotonic() + timeout
  codes = []
  for process in processes:
    try:
      codes.append(process.wait(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
      process.kill()
      codes.append(f"killed after {timeout} s")
  if any(code != 0 for code in codes) or not result_file.exists():
    tails = "\n".join(
      f"--- process {i} (exit {code}):\n{log.read_text()[-2000:]}"
      for i, (code, log) in enumerate(zip(codes, logs))
    )
    raise RuntimeError(f"{what}: the {num_processes} processes did not finish\n{tails}")
  return json.loads(result_file.read_text())
