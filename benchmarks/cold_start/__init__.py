"""What does a run's cold start cost, and does adapting the batch make it wait longer?

The README's demo and the LM recipe run as a user runs them
(``python -m train``), each in a new process, with a cold compilation cache
and again in a new workdir on the same cache: the adaptive run with today's
compile settings, with the settings before them, and with its batch held at
its initial size.

Scripts (``python benchmarks/cold_start/NAME.py``):

* ``cold_start.py``: programs compiled, compile seconds, seconds waited,
  runtime, padding and the final accuracy or loss of each, paired seeds.

``run_gpu.sh`` runs ``cold_start.py`` on one GPU within 8 minutes (the
adaptive and the fixed variant of both recipes, seed 0, cold and warm), each
run saved as it ends; ``DEVICE=cpu STEPS=5`` tries it on a CPU.
"""
