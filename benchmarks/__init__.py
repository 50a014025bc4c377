"""Benchmark scripts: each prints a table and writes JSON (``python benchmarks/NAME.py --out F``)."""
