"""Benchmarks: generation throughput of the engines side by side (`generate.py`), and the HTTP serving
benchmark, speculation on and off at several concurrencies (`serving.py`)."""
