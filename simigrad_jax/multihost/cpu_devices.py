"""Host: the environment for simulated CPU devices whose collectives cannot starve for threads.

Imports no JAX: it runs before JAX starts its CPU backend.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from simigrad_jax import validation

DEVICE_COUNT_FLAG = "xla_force_host_platform_device_count"

# XLA aborts the process when a device waits at a collective longer than the
# terminate timeout (40 s by default). Eight simulated devices time-share the
# host's cores, so one device can legitimately reach a collective minutes after
# the others on a small, busy machine.
COLLECTIVE_TIMEOUT_FLAGS: tuple[tuple[str, int], ...] = (
  ("xla_cpu_collective_call_warn_stuck_timeout_seconds", 60),
  ("xla_cpu_collective_call_terminate_timeout_seconds", 300),
)

# Client threads per simulated device: one to run each device's share of a
# multi-device program, one for each device's launch that may block while that
# device's queue of in-flight programs is full, and room for two more threads
# dispatching programs at the same time.
THREADS_PER_DEVICE = 4


def _flag_values(xla_flags: str) -> dict[str, str]:
  """The ``--name=value`` (or ``--name``) flags in an ``XLA_FLAGS`` string, by name."""
  values = {}
  for token in xla_flags.split():
    name, _, value = token.lstrip("-").partition("=")
    values[name] = value
  return values


def _schedulable_cpus() -> int:
  """The CPUs this process may run on, the thread count XLA's CPU client picks by default."""
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def simulated_cpu_devices_env(
  num_devices: int = 8, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
  """Returns ``XLA_FLAGS`` and ``PJRT_NPROC`` for ``num_devices`` simulated CPU devices.

  Asks XLA for ``num_devices`` CPU devices
  (``--xla_force_host_platform_device_count``) and guards their collectives
  (``psum``, ``psum_scatter``, ``all_gather``, ... under ``pmap`` or
  ``shard_map``) against the abort "Termination timeout ... exceeded ... only 7
  of them arrived". XLA's CPU client runs each device's share of a
  multi-device program on a thread of one pool, sized to the larger of the
  core count and the device count (8 threads for 8 devices on a 2-core
  machine), and a program with collectives finishes only when every device's
  share runs at once. Launching a program on a device whose queue already
  holds 32 programs (after about 32 steps dispatched ahead of the host) blocks
  a thread of the same pool until that device finishes one; two such launches
  leave 6 threads for the 8 devices of the oldest program, which then waits
  at its collective forever, and XLA aborts the process after 40 s. So:

  * ``PJRT_NPROC`` (read by XLA's CPU client for its thread pools) gets
    ``4 * num_devices`` threads, or the CPU count if that is larger: the
    devices of one program and the launches of one dispatch call can all hold
    threads at once, with room for two more dispatching threads;
  * ``--xla_cpu_collective_call_terminate_timeout_seconds=300`` (and a stuck
    warning after 60 s instead of 20 s): with 8 devices time-sharing a few
    cores, one device may reach a collective long after the others.

  Flags already in ``XLA_FLAGS`` are kept and never added twice; a device
  count already there is respected (and sizes the thread pool), as is a
  larger ``PJRT_NPROC``. Set the result in ``os.environ`` before JAX starts
  its backend (its first device query or computation): XLA reads both
  variables once, when it creates the CPU client. Set ``JAX_PLATFORMS``, if
  needed, before importing JAX (importing this module imports ``jax``
  through the package, which reads it).

  Args:
    num_devices: how many CPU devices to simulate (>= 1) unless ``XLA_FLAGS``
      already sets a count.
    environ: the environment to start from; ``os.environ`` when None.

  Returns:
    ``{"XLA_FLAGS": ..., "PJRT_NPROC": ...}``, to update the environment of
    this process (before JAX starts) or of a subprocess.

  Example:
    >>> import os
    >>> from simigrad_jax.multihost.cpu_devices import simulated_cpu_devices_env
    >>> env = simulated_cpu_devices_env(8, environ={"XLA_FLAGS": "--xla_dump_to=/tmp/hlo"})
    >>> env["XLA_FLAGS"].split()[:2]
    ['--xla_dump_to=/tmp/hlo', '--xla_force_host_platform_device_count=8']
    >>> os.environ.update(env)  # then import jax: its 8 CPU devices  # doctest: +SKIP
  """
  environ = os.environ if environ is None else environ
  num_devices = validation.check_int("num_devices", num_devices)
  xla_flags = environ.get("XLA_FLAGS", "").strip()
  present = _flag_values(xla_flags)
  wanted = ((DEVICE_COUNT_FLAG, num_devices),) + COLLECTIVE_TIMEOUT_FLAGS
  added = [f"--{name}={value}" for name, value in wanted if name not in present]
  given = present.get(DEVICE_COUNT_FLAG, "")
  count = int(given) if given.isdigit() else num_devices
  threads = max(THREADS_PER_DEVICE * count, _schedulable_cpus())
  user_threads = environ.get("PJRT_NPROC", "").strip()
  if user_threads.isdigit():
    threads = max(threads, int(user_threads))
  return {"XLA_FLAGS": " ".join([xla_flags, *added]).strip(), "PJRT_NPROC": str(threads)}
