"""The environment for simulated CPU devices: merged XLA flags, thread pool size, a new process."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import simigrad_jax
from simigrad_jax.multihost import cpu_devices
from simigrad_jax.multihost.cpu_devices import simulated_cpu_devices_env

REPOSITORY_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COUNT = "--xla_force_host_platform_device_count"
WARN = "--xla_cpu_collective_call_warn_stuck_timeout_seconds"
TERMINATE = "--xla_cpu_collective_call_terminate_timeout_seconds"


def flag_names(xla_flags):
  return [token.split("=")[0] for token in xla_flags.split()]


def test_empty_environment_gets_the_count_and_the_protective_flags():
  env = simulated_cpu_devices_env(8, environ={})
  assert env["XLA_FLAGS"].split() == [f"{COUNT}=8", f"{WARN}=60", f"{TERMINATE}=300"]
  assert int(env["PJRT_NPROC"]) == max(32, cpu_devices._schedulable_cpus())


def test_user_flags_are_kept_first_and_never_added_twice():
  user = f"--xla_dump_to=/tmp/hlo {TERMINATE}=900"
  env = simulated_cpu_devices_env(8, environ={"XLA_FLAGS": f"  {user} "})
  assert env["XLA_FLAGS"] == f"{user} {COUNT}=8 {WARN}=60"  # the user's 900 s wins
  names = flag_names(env["XLA_FLAGS"])
  assert len(names) == len(set(names))
  again = simulated_cpu_devices_env(4, environ={**env, "PJRT_NPROC": env["PJRT_NPROC"]})
  assert again == env  # applying it twice changes nothing, even with another count


def test_an_existing_device_count_is_respected_and_sizes_the_threads(monkeypatch):
  monkeypatch.setattr(cpu_devices, "_schedulable_cpus", lambda: 2)
  env = simulated_cpu_devices_env(8, environ={"XLA_FLAGS": f"{COUNT}=4"})
  assert env["XLA_FLAGS"].split() == [f"{COUNT}=4", f"{WARN}=60", f"{TERMINATE}=300"]
  assert env["PJRT_NPROC"] == "16"


@pytest.mark.parametrize(
  "cpus, user, expected", [(2, None, "32"), (64, None, "64"), (2, "100", "100"), (2, "4", "32")]
)
def test_thread_count_never_drops_below_the_default_or_the_users(monkeypatch, cpus, user, expected):
  monkeypatch.setattr(cpu_devices, "_schedulable_cpus", lambda: cpus)
  environ = {} if user is None else {"PJRT_NPROC": user}
  assert simulated_cpu_devices_env(8, environ=environ)["PJRT_NPROC"] == expected


def test_reads_os_environ_by_default(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/hlo")
  assert simulated_cpu_devices_env(2)["XLA_FLAGS"].startswith(f"--xla_dump_to=/tmp/hlo {COUNT}=2 ")


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_refuses_a_bad_device_count(bad):
  with pytest.raises(ValueError, match="num_devices must be an integer >= 1"):
    simulated_cpu_devices_env(bad, environ={})


def test_exported_from_the_package():
  assert simigrad_jax.simulated_cpu_devices_env is simulated_cpu_devices_env


def run_fresh_python(code, environ, timeout):
  """Runs ``code`` in a new interpreter with ``environ``; returns its last stdout line as JSON."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
  env.update(environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPOSITORY_ROOT)
  result = subprocess.run(
    [sys.executable, "-c", textwrap.dedent(code)],
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_fresh_process_gets_8_devices_the_threads_and_runs_a_collective():
  code = """
      import collections, glob, json, os
      from simigrad_jax.multihost.cpu_devices import simulated_cpu_devices_env
      os.environ.update(simulated_cpu_devices_env(8))  # after importing jax, before using it
      import jax, jax.numpy as jnp
      total = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")(jnp.arange(8.0))
      threads = collections.Counter(open(f).read().strip()
                                    for f in glob.glob("/proc/self/task/*/comm"))
      print(json.dumps({"devices": jax.device_count(), "psum": total.tolist(),
                        "eigen_threads": threads["tf_XLAEigen"],
                        "pjrt_nproc": os.environ["PJRT_NPROC"]}))
  """
  out = run_fresh_python(code, {}, timeout=120)
  assert out["devices"] == 8
  assert out["psum"] == [28.0] * 8
  assert out["eigen_threads"] == int(out["pjrt_nproc"]) >= 32  # XLA sized its pools by it


def test_a_full_dispatch_queue_does_not_starve_a_collective():
  """300 steps dispatched with a host batch each and nothing read back: the queue fills.

  With XLA's default thread pool (8 threads for 8 devices on 2 cores) this
  program aborted in 3 runs out of 3 here ("only 6 of them arrived"); the
  user's 20 s terminate timeout (kept by the function) makes a regression fail
  within a minute or two instead of five.
  """
  code = """
      import json, os
      from simigrad_jax.multihost.cpu_devices import simulated_cpu_devices_env
      os.environ.update(simulated_cpu_devices_env(8))
      import jax, jax.numpy as jnp, numpy as np
      def step(w, x):
        return w - 1e-6 * jax.lax.psum(x.T @ jnp.tanh(x @ w), "i")
      pstep = jax.pmap(step, axis_name="i")
      rng = np.random.default_rng(0)
      xs = [rng.normal(size=(8, 64, 512)).astype(np.float32) for _ in range(4)]
      w = jnp.zeros((8, 512, 512), jnp.float32)
      for i in range(300):
        w = pstep(w, xs[i % 4])
      print(json.dumps({"finite": bool(jnp.isfinite(w).all()),
                        "xla_flags": os.environ["XLA_FLAGS"]}))
  """
  out = run_fresh_python(code, {"XLA_FLAGS": f"{TERMINATE}=20"}, timeout=300)
  assert out["finite"]
  assert out["xla_flags"].split()[0] == f"{TERMINATE}=20"
