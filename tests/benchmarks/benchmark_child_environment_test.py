"""benchmarks.common.child_environment: what a benchmark's child process inherits."""

import os

from benchmarks import common


def test_the_repository_goes_first_and_the_callers_path_stays(monkeypatch):
  monkeypatch.setenv("PYTHONPATH", "/opt/site")
  env = common.child_environment()
  assert env["PYTHONPATH"] == os.pathsep.join([common.REPOSITORY_ROOT, "/opt/site"])
  monkeypatch.delenv("PYTHONPATH")
  assert common.child_environment()["PYTHONPATH"] == common.REPOSITORY_ROOT


def test_a_child_with_its_own_device_count_inherits_none(monkeypatch):
  flags = "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8 --xla_bar=2"
  monkeypatch.setenv("XLA_FLAGS", flags)
  monkeypatch.setenv("PJRT_NPROC", "8")
  env = common.child_environment(own_device_count=True)
  assert env["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_bar=2" and "PJRT_NPROC" not in env
  inherited = common.child_environment()
  assert inherited["XLA_FLAGS"] == flags and inherited["PJRT_NPROC"] == "8"
  assert os.environ["XLA_FLAGS"] == flags  # this process's own is left alone
