"""Benchmarks behind ``prefill-server bench ...``."""
