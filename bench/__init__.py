"""Benchmarks that print side-by-side ratios: `python -m bench.run` (see bench/run.py)."""
