"""Benchmark scripts: each prints a table and writes its JSON to ``benchmarks/results/NAME.json``.

``python benchmarks/NAME.py`` writes ``benchmarks/results/NAME.json``
(``NAME_quick.json`` with ``--quick``), and the Pareto benchmarks draw their
plots into ``docs/``, beside the pages that show them; ``--out F`` writes the
JSON elsewhere, ``--out ''`` none.
"""
