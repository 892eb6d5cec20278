"""Benchmarks: harness and one module per op family (``fastdecode bench ...``)."""
