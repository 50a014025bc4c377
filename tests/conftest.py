"""Test set-up: 8 simulated CPU devices, configured before JAX is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def devices():
  """The 8 simulated CPU devices every multi-device test runs on."""
  devs = jax.devices()
  assert len(devs) == 8, f"expected 8 simulated devices, got {len(devs)}"
  return devs
