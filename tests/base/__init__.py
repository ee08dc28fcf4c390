"""Tests of the floor-0 modules every room stands on: uri, tokens, logs, metrics."""
