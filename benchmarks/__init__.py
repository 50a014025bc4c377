"""Benchmarks: scripts that each answer one question about SimiGrad, in folders by question.

* ``step_cost/``: what a SimiGrad step costs against the plain step (time,
  temporary memory, collective bytes), for a user's own step and the Trainer's.
* ``trainer_overhead/``: what the Trainer costs around the step: its host
  path, adapting the batch, feeding the input, switching the batch size.
* ``pareto/``: test accuracy against average batch size, an adaptive batch
  against fixed ones, on images (MNIST, digits) and a small BERT's masked LM.
* ``lm/``: a causal LM's serial steps and tokens to the best constant batch's
  validation loss.
* ``cluster/``: the step-time model of ``python -m simigrad_jax.cluster_time``,
  fitted to a sweep over device counts.

Beside them, what the scripts share: ``common.py`` (the devices set up before
JAX starts, the ``--out`` flag, the result's and plot's paths, the report)
and ``local_processes.py`` (a script run as several ``jax.distributed``
processes on this host).

``python benchmarks/ROOM/NAME.py`` writes ``benchmarks/results/NAME.json``
(``NAME_quick.json`` with ``--quick``), and the Pareto benchmarks draw their
plots into ``docs/``, beside the pages that show them; ``--out F`` writes the
JSON elsewhere, ``--out ''`` none.
"""
