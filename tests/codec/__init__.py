"""Tests of dissoc.codec against pyarrow (the oracle); conftest.py says where the Arrow test data is."""
