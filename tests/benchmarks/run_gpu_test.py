"""benchmarks/run_gpu.sh: the GPU goals' parts first, in one budget, each its own process."""

import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_script(tmp_path, **env):
  """Runs the script with a ``python`` that records its arguments and sleeps ``NAP`` seconds."""
  fake = tmp_path / "bin" / "python"
  fake.parent.mkdir()
  fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\nsleep "${{NAP:-0}}"\n')
  fake.chmod(0o755)
  environment = {
    "PATH": f"{fake.parent}:/usr/bin:/bin",
    "DEVICE": "cpu",
    "RESULTS": str(tmp_path / "results"),
    "RUNS": str(tmp_path / "runs"),
    **env,
  }
  script = ROOT / "benchmarks" / "run_gpu.sh"
  done = subprocess.run(
    ["bash", str(script)], env=environment, capture_output=True, text=True, check=True
  )
  calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
  return calls[1:], done.stdout  # (the first prints the devices)


def test_the_goals_steps_then_the_cold_runs_then_the_rest_then_the_warm_runs(tmp_path):
  calls, out = run_script(tmp_path, SIZE="tiny", STEPS="5")
  assert [c.split()[0] for c in calls] == [
    "benchmarks/step_cost/one_device_steps.py",
    "benchmarks/cold_start/cold_start.py",
    "benchmarks/step_cost/one_device_steps.py",
    "benchmarks/cold_start/cold_start.py",
  ]
  goals, cold, rest, warm = calls
  assert "--workloads lm,cnn4" in goals and "trainer_every_4" in goals and "--size tiny" in goals
  assert "--caches cold" in cold and "--caches warm" in warm and "--steps 5" in cold
  assert f"--workdir {tmp_path / 'runs'}" in cold and f"--workdir {tmp_path / 'runs'}" in warm
  assert "--workloads resnet18,mlp,cnn" in rest
  outs = [c.split("--out ")[1] for c in calls]
  assert len(set(outs)) == 4 and all(o.startswith(str(tmp_path / "results")) for o in outs)
  assert "== done in" in out


def test_a_part_that_would_start_with_under_20_s_left_is_skipped(tmp_path):
  calls, out = run_script(tmp_path, BUDGET="28", NAP="5")
  assert len(calls) == 1 and "== cold_start: cold: skipped" in out
  assert "== cold_start: warm: skipped" in out
