"""Test set-up: 8 simulated CPU devices, configured before JAX starts its backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # read when JAX is imported
# No test writes to the user's compilation cache, the default of every Trainer and of python -m
# train (subprocesses inherit this): the suite runs without a persistent cache unless a test
# names its own (a temporary folder), so that no test finds another's programs there.
os.environ["SIMIGRAD_JAX_CACHE_DIR"] = ""

from simigrad_jax.multihost.cpu_devices import simulated_cpu_devices_env  # noqa: E402

os.environ.update(simulated_cpu_devices_env(8))  # read when the CPU backend starts

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def devices():
  """The 8 simulated CPU devices every multi-device test runs on."""
  devs = jax.devices()
  assert len(devs) == 8, f"expected 8 simulated devices, got {len(devs)}"
  return devs
