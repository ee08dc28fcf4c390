"""Smoke tests of the benchmarks/ scripts (each run at a tiny size, or their pure parts)."""
