"""``python -m train``: config files and overrides, the workdir, resume without duplicated steps, errors."""

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

import command_line

# ml_collections loads config files with importlib's deprecated load_module().
pytestmark = pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "train" / "configs"
CONFIGS = sorted(p for p in CONFIG_DIR.glob("*.py") if p.stem != "__init__")
DOCS = "".join(path.read_text() for path in [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))])
DOCS_COMMANDS = [
  line
  for block in re.findall(r"^```bash\n(.*?)^```", DOCS, re.S | re.M)
  for line in block.replace("\\\n", " ").splitlines()  # backslash-continued: one line
  if "python -m train " in line
]
MAIN_FLAGS = set(
  re.findall(r'DEFINE_\w+\(\s*"(\w+)"', (ROOT / "train" / "__main__.py").read_text())
)
# The digits demo at a size that compiles once and trains in seconds.
SMALL = [
  "--config.mode=pad",
  "--config.cnn_features=(4, 8)",
  "--config.cnn_dense=16",
  "--config.tensorboard=False",
]


def parse(config_path, *overrides):
  """Parses a config file and overrides the way ``python -m train`` does, in a fresh flag set."""
  return command_line.parse(config_path, *overrides)[0]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_config_file_takes_command_line_overrides(path):
  config = parse(
    path,
    "--config.num_epochs=2",
    "--config.seed=3",
    "--config.similarity_target=0.25",
    "--config.batch_size_upper_bound=4096",
    "--config.smooth_factor=0.5",
    "--config.batch_sizes_to_profile=(64, 128)",
    "--config.lr_adjust_factor=0.5",
    "--config.controller=fixed",
  )
  assert (config.num_epochs, config.seed, config.similarity_target) == (2, 3, 0.25)
  assert (config.batch_size_upper_bound, config.smooth_factor) == (4096, 0.5)
  assert tuple(config.batch_sizes_to_profile) == (64, 128) and config.controller == "fixed"
  with pytest.raises(Exception, match="similarity_targt"):  # a typo is refused
    parse(path, "--config.similarity_targt=0.1")


def run_train(workdir, *args, env=None):
  env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
  env.pop("XLA_FLAGS", None)  # python -m train sets up its simulated devices itself
  command = [
    sys.executable,
    "-m",
    "train",
    "--config",
    "train/configs/digits_demo.py",
    "--workdir",
    str(workdir),
    *args,
  ]
  return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_runs_resumes_and_appends_without_duplicating_steps(tmp_path):
  first = run_train(tmp_path, *SMALL, "--config.num_epochs=1", "--config.seed=3")
  assert first.returncode == 0, first.stderr[-3000:]
  assert "devices: 8 x cpu" in first.stdout and "epoch 1/1" in first.stdout
  assert "final test accuracy" in first.stdout and str(tmp_path / "metrics.png") in first.stdout
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  steps_before = [json.loads(x)["step"] for x in lines if "batch_size" in x]

  second = run_train(tmp_path, *SMALL, "--config.num_epochs=2", "--config.seed=3")
  assert second.returncode == 0, second.stderr[-3000:]
  assert f"resuming from the checkpoint at step {steps_before[-1]}" in second.stdout
  assert "epoch 2/2" in second.stdout and "epoch 1/2" not in second.stdout
  records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert (tmp_path / "metrics.jsonl").read_text().splitlines()[: len(lines)] == lines
  steps = [r["step"] for r in records if "batch_size" in r]
  assert steps == list(range(1, len(steps) + 1)) and len(steps) > len(steps_before)
  assert [r["epoch"] for r in records if "eval_accuracy" in r] == [0, 1]
  assert records[-1]["examples_seen"] == 2 * 1500

  again = run_train(tmp_path, *SMALL, "--config.num_epochs=2", "--config.seed=3")
  assert again.returncode == 0, again.stderr[-3000:]
  assert "nothing to train" in again.stdout
  assert [
    json.loads(x)["step"]
    for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
    if "batch_size" in x
  ] == steps


def test_a_resume_and_a_run_in_a_new_workdir_load_every_executable_from_the_shared_cache(
  tmp_path,
):
  """On by default in the user's shared cache: a resume, and a second run of the same recipe in a
  new workdir, compile nothing."""
  cache = tmp_path / "shared_cache"  # (the user's: $SIMIGRAD_JAX_CACHE_DIR, else ~/.cache/...)
  # JAX logs every persistent-cache miss and hit as a warning (stderr).
  logged = {
    "JAX_EXPLAIN_CACHE_MISSES": "1",
    "JAX_LOG_COMPILES": "1",
    "SIMIGRAD_JAX_CACHE_DIR": str(cache),
  }
  runs = []
  for workdir, num_steps in [("run", 3), ("run", 6), ("new", 3)]:  # all in the first epoch
    result = run_train(tmp_path / workdir, *SMALL, f"--config.num_steps={num_steps}", env=logged)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"compilation cache: {cache}" in result.stdout
    summary = json.loads((tmp_path / workdir / "summary.json").read_text())
    runs.append(
      {
        "misses": result.stderr.count("PERSISTENT COMPILATION CACHE MISS"),
        "hits": result.stderr.count("Persistent compilation cache hit"),
        "entries": sorted(e for e in os.listdir(cache) if e.endswith("-cache")),
        "resumed": "resuming from the checkpoint at step 3" in result.stdout,
        "compile_seconds": summary["compile_seconds"],
        "compiles": summary["compiles"],
        "loaded": summary["compile_cache_hits"],
        "loaded_seconds": summary["compile_cache_hit_seconds"],
        "row": next(x for x in result.stdout.splitlines() if x.startswith("step programs ")),
      }
    )
  cold, warm, new = runs
  assert warm["resumed"] and not new["resumed"]
  assert not (tmp_path / "run" / "compilation_cache").exists()
  # Measured: 59 misses and 59 entries, then 0 misses and 59 hits; step compile 1.4 s -> 0.09 s.
  assert cold["hits"] == 0 and cold["misses"] >= len(cold["entries"]) > 0
  for again in (warm, new):
    assert again["misses"] == 0 and again["hits"] > 0
    assert again["entries"] == cold["entries"]  # nothing new written
    assert again["compile_seconds"] < 0.5 * cold["compile_seconds"]
    # The Trainer counts the step programs it loaded, and says so.
    assert again["loaded"] == again["compiles"] > 0
    assert 0 < again["loaded_seconds"] <= again["compile_seconds"]
    # The summary says what happened: nothing compiled, every program loaded.
    assert f"0 compiled, {again['loaded']} loaded from the compilation cache" in again["row"]
    assert "tracing, lowering and loading" in again["row"]
  assert (cold["loaded"], cold["loaded_seconds"]) == (0, 0.0)
  assert f"{cold['compiles']} compiled, 0 loaded from the compilation cache" in cold["row"]
  assert "s compiling, in the background" in cold["row"]
  print(
    f"compilation cache: cold {cold['misses']} misses, {cold['compile_seconds']:.2f} s "
    f"compiling steps; warm {warm['misses']} misses, {warm['hits']} hits, "
    f"{warm['compile_seconds']:.2f} s"
  )


def test_the_compilation_cache_can_be_turned_off(tmp_path):
  result = run_train(tmp_path, *SMALL, "--config.num_steps=1", "--config.compilation_cache=False")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "compilation cache: off" in result.stdout
  assert not (tmp_path / "compilation_cache").exists()


def test_a_bad_controller_name_fails_before_training(tmp_path):
  result = run_train(tmp_path, "--config.controller=simigard")
  assert result.returncode != 0
  assert "unknown controller 'simigard'" in result.stderr
  assert not (tmp_path / "metrics.jsonl").exists()


def test_a_seed_beyond_int64_is_one_line_before_jax_starts(tmp_path):
  result = run_train(tmp_path, "--config.seed=99999999999999999999")
  assert result.returncode == 1
  assert result.stderr.strip() == (
    "simigrad: --config.seed must be an integer in [0, 4294967295], got 99999999999999999999: "
    "jax.random.key takes no seed beyond int64"
  )


@pytest.mark.parametrize("name", ["summary.json", "similarity_profile.json"])
def test_a_folder_where_a_last_file_goes_is_refused_before_training(tmp_path, name):
  # Found after every step had trained, it ended the run with exit status 1 and no summary.
  (tmp_path / name).mkdir()
  result = run_train(tmp_path, *SMALL, "--config.num_steps=1")
  assert result.returncode == 1
  assert f"{tmp_path / name} is a folder, where the run keeps a plain file" in result.stderr
  assert f"(rm -r {tmp_path / name})" in result.stderr
  assert not (tmp_path / "checkpoints").exists()


BUG = """
import runpy, sys
import train.train
def train_and_evaluate(*args, **kwargs):
  raise RuntimeError("an injected bug")
train.train.train_and_evaluate = train_and_evaluate
sys.argv = ["train", "--config", "train/configs/digits_demo.py", "--workdir", sys.argv[1]]
runpy.run_module("train", run_name="__main__", alter_sys=True)
"""


def test_a_bug_prints_its_traceback_past_the_filter(tmp_path):
  # The filter that hides background threads' tracebacks once hid the run's own unexpected error
  # too: exit status 1 and nothing on stderr.
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  env.pop("XLA_FLAGS", None)
  env.pop("SIMIGRAD_VERBOSE", None)
  result = subprocess.run(
    [sys.executable, "-c", BUG, str(tmp_path)],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 1
  lines = result.stderr.strip().splitlines()
  assert lines[0] == "Traceback (most recent call last):"
  assert "RuntimeError: an injected bug" in lines
  assert lines[-1].startswith(
    "simigrad: the run stopped on an unexpected RuntimeError: an injected bug; this is a bug"
  )


@pytest.mark.parametrize("command", DOCS_COMMANDS)
def test_docs_train_commands_name_real_configs_options_and_flags(command):
  """The ``python -m train`` lines of README and docs/ (GPU ones included) parse: config, overrides, flags."""
  args = shlex.split(command.split("python -m train ", 1)[1])
  config_path = ROOT / args[args.index("--config") + 1]
  overrides = [a for a in args if a.startswith("--config.")]
  parse(config_path, *overrides)
  for arg in args:
    if arg.startswith("--") and not arg.startswith("--config"):
      assert arg[2:].split("=")[0] in MAIN_FLAGS, arg


def test_a_config_typo_is_one_line_with_the_suggestion():
  from train import __main__ as main  # pylint: disable=import-outside-toplevel

  error = AttributeError(
    '\'learning_rat\'\\nDid you mean "learning_rate" instead of "learning_rat"?'
  )
  line = main.flag_error_line(error, ["train", "--config", "c.py", "--config.learning_rat=0.1"])
  assert line == (
    "the config has no key 'learning_rat' (--config.learning_rat=0.1); did you mean "
    "--config.learning_rate? (the keys: c.py)"
  )


def test_failure_lines_and_the_traceback_filter():
  import doctest  # pylint: disable=import-outside-toplevel

  from train import failures  # pylint: disable=import-outside-toplevel

  result = doctest.testmod(failures, optionflags=doctest.ELLIPSIS)
  assert result.attempted and not result.failed
  line = failures.one_line(
    ValueError("no readable checkpoint in /w: step 3: x <bound method a.b of <c>> y"), None
  )
  assert "bound method" not in line
