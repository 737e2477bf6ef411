"""Benchmarks behind `nitrobrew bench`: one module per loss family."""
