"""Tests of dissoc.spark: the data source, writer and barrier exchange (most need pyspark and Java)."""
