"""Does an adaptive batch reach a small fixed batch's accuracy at a larger average batch?

SimiGrad's Pareto comparison at small scale, with the real Trainer: test
accuracy against average batch size, fixed batches (their learning rates
tuned on validation) against SimiGrad, the noise-scale controller and the
ramps.

Script: ``python benchmarks/pareto/pareto.py`` (``--task images``: an MLP on
MNIST or scikit-learn's digits; ``--task mlm``: a small BERT's masked LM).

Its parts: ``flags.py`` (the command line and the grid it gives),
``protocol.py`` (run specs, the grid of runs, one run's record, reusing runs;
the causal-LM comparison in ``benchmarks/lm/`` follows it too),
``analysis.py`` (mean over seeds, selection by validation, the fixed front),
``report.py`` (the table, the plot, the docs' markdown) and the tasks,
``images.py`` and ``mlm.py``.
"""
