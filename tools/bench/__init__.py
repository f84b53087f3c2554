"""Benchmarks: `python tools/bench/x.py --help`; measured numbers live in docs/benchmarks.md."""
