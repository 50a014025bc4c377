"""A config file and its ``--config.KEY=VALUE`` overrides parsed as ``python -m train`` parses them."""

from __future__ import annotations

import os
from typing import Any

from absl import flags
from ml_collections import config_flags


def parse(config_path: str | os.PathLike, *overrides: str) -> tuple[Any, list[str]]:
  """The config of ``config_path`` with ``overrides`` applied, in a fresh flag set, and the names of
  the options the overrides gave."""
  argv = ["train", "--config", str(config_path), *overrides]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file(
    "config", None, "", flag_values=values, lock_config=True, sys_argv=argv
  )
  values(argv)
  return values.config, list(config_flags.get_override_values(values["config"]))
