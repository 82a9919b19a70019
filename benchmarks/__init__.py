"""Benchmarks and the numeracy study; run each from the repository root as a module:
``python -m benchmarks.bench_loss --quick``. Results go to ``benchmarks/results/`` (``--results_dir``)."""
