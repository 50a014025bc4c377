"""The base class of every error simigrad-jax defines.

Each error also keeps the built-in parent it always had (``ValueError`` for a
bad input or a checkpoint of another run, ``RuntimeError`` for a failure while
running), so code that catches those keeps working; ``except
simigrad_jax.SimiGradError`` catches every one of them.

Example:
  >>> import simigrad_jax
  >>> issubclass(simigrad_jax.CheckpointMismatchError, simigrad_jax.SimiGradError)
  True
  >>> issubclass(simigrad_jax.CheckpointMismatchError, ValueError)
  True
"""

from __future__ import annotations

__all__ = ["SimiGradError"]


class SimiGradError(Exception):
  """An error raised by simigrad-jax (every error class it defines derives from this one)."""
