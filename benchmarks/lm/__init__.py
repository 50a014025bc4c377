"""Does an adaptive batch reach a causal LM's target loss in fewer serial steps?

The best constant batch's validation loss is the target; each adaptive
setting (SimiGrad, the token allowance, the noise scale, the ramps LM
trainers use) is judged by its optimizer steps and tokens to reach it.

Script: ``python benchmarks/lm/pareto_lm.py``; ``benchmarks/lm/run_lm_budgets.sh``
runs both token budgets in the background at low priority.

Its parts: ``experiment.py`` (the model, data and runs, with their loss
curves), ``run_store.py`` (finished runs kept on disk, so that a killed
comparison resumes) and ``report.py`` (the target, the verdict, the table and
the plot). A run is a :class:`benchmarks.pareto.protocol.RunSpec`, as in the
Pareto comparison.
"""
