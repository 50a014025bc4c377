"""What does the Trainer cost around the step it compiles?

The host's work between steps, adapting the batch size against holding it,
feeding the devices their input, and switching among compiled shapes.

Scripts (``python benchmarks/trainer_overhead/NAME.py``):

* ``overhead.py``: the Trainer, fixed and adaptive, and a user's own loop
  with the transform, against the plain data-parallel loop.
* ``overhead_adaptive.py``: the adaptive Trainer against the same Trainer
  fixed at the adaptive run's average batch, and where the difference goes.
* ``adaptive_loop.py``: an own adaptive loop's step (``AdaptiveStep``, a
  hand-written two-half step, the former recipe of host-accumulated
  micro-steps) against the plain step.
* ``measure_every.py``: a step that measures every k-th step (k = 1, 2, 4)
  against the plain step, on 1 and 8 devices.
* ``input.py``: how fast the host decodes ImageNet-style images, and whether
  the Trainer waits for them.
* ``switching.py``: the batch size switched every step, a compiled shape per
  bucket against one padded shape, in one process and in two.

Their helpers: ``overhead_loops.py`` (the loops and models ``overhead.py``
times, which ``overhead_adaptive.py`` shares) and ``switching_models.py``,
``switching_modes.py`` and ``switching_report.py`` (what ``switching.py``
trains, its runs and its report).
"""
