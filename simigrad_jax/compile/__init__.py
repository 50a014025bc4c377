"""Host: a step's compiled programs: its jitted functions, ahead-of-time and background compiles
and their order, the fallback shape while one compiles, agreement on compiles across hosts, JAX's
persistent compilation cache, and running a step on the programs.

Documented API:
  StepCompiler: one compiled step per micro-batch shape, compiled ahead of
    time in a background thread; a compile that fails raises StepCompileError,
    a wait for one that its interrupt gives up CompileAbandoned.
  enable_persistent_cache: JAX's persistent (on-disk) compilation cache, so
    that a second or resumed run loads its programs instead of compiling them;
    persistent_cache_settings puts the process-wide settings it changes back.

Modules: ``programs`` (a training step's compiled programs, composing the
others), ``step_functions`` (the step's jitted functions and its programs,
``Program``), ``compiler``, ``program_compiler`` (the one compiler of the
step's programs, keyed by program and shape), ``first_program`` (the first
step's program, started while a run is set up), ``policy`` (the compile
policy, what a step runs while its programs compile: its protocol, and the
policy without a fallback), ``prefetch``, ``fallback`` (the timed
fallback), ``schedule`` (the fallback by the step count), ``agreement``,
``persistent_cache`` and ``step_runner``.

Example:
  >>> import simigrad_jax.compile
  >>> with simigrad_jax.compile.persistent_cache_settings():
  ...   pass  # an enable_persistent_cache(...) in here is undone on the way out
"""

from simigrad_jax.compile.compiler import CompileAbandoned
from simigrad_jax.compile.compiler import StepCompileError
from simigrad_jax.compile.compiler import StepCompiler
from simigrad_jax.compile.persistent_cache import enable_persistent_cache
from simigrad_jax.compile.persistent_cache import persistent_cache_settings

__all__ = [
  "CompileAbandoned",
  "StepCompileError",
  "StepCompiler",
  "enable_persistent_cache",
  "persistent_cache_settings",
]
