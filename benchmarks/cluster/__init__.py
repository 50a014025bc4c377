"""Does adapting the batch pay on a cluster: the step-time model that answers it, fitted and checked.

Script: ``python benchmarks/cluster/cluster_time.py``: the Trainer's step
time on 1 to 8 simulated devices, the CPU step model of
``simigrad_jax.cluster_time`` fitted to it and checked out of sample; its
JSON is the calibration ``python -m simigrad_jax.cluster_time`` reads.
"""
