"""Host: what several processes share: their agreement on settings and decisions, a clean stop on
a signal at the same step, the workdir's lock, and simulated CPU devices.

Documented API:
  simulated_cpu_devices_env: the environment for simulated CPU devices, set
    before JAX starts its backend (also ``simigrad_jax.simulated_cpu_devices_env``).
  ProcessAgreement: a run's agreement between processes (its timeout and its
    watchdog), handed to what must agree; exit_on_lost_process ends this
    process at once after a ProcessLostError, instead of waiting for the lost one.
  open_workdir: a run's workdir checked, made private and locked (a WorkdirLock).
  Errors: ProcessDisagreementError (the processes' settings or decisions
    differ) and its ProcessLostError (a process is gone), WorkdirLockedError
    (another run holds the workdir), Preempted (a SIGTERM or SIGINT stopped the
    run after saving its checkpoint; also ``simigrad_jax.Preempted``).

Modules: ``process_agreement``, ``preemption``, ``workdir`` and ``cpu_devices``.

Example:
  >>> from simigrad_jax import multihost
  >>> multihost.simulated_cpu_devices_env(8)["XLA_FLAGS"].count("device_count=8")
  1
"""

from simigrad_jax.multihost.cpu_devices import simulated_cpu_devices_env
from simigrad_jax.multihost.preemption import Preempted
from simigrad_jax.multihost.process_agreement import ProcessAgreement
from simigrad_jax.multihost.process_agreement import ProcessDisagreementError
from simigrad_jax.multihost.process_agreement import ProcessLostError
from simigrad_jax.multihost.process_agreement import exit_on_lost_process
from simigrad_jax.multihost.workdir import WorkdirLock
from simigrad_jax.multihost.workdir import WorkdirLockedError
from simigrad_jax.multihost.workdir import open_workdir

__all__ = [
  "Preempted",
  "ProcessAgreement",
  "ProcessDisagreementError",
  "ProcessLostError",
  "WorkdirLock",
  "WorkdirLockedError",
  "exit_on_lost_process",
  "open_workdir",
  "simulated_cpu_devices_env",
]
