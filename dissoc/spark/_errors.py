"""The errors of :mod:`dissoc.spark` that need no pyspark to be named."""

from __future__ import annotations

from dissoc.errors import DissocError

__all__ = ["SparkTypeError"]


class SparkTypeError(DissocError, TypeError):
    """An Arrow type has no Spark counterpart, or a column cannot be converted to the one Spark expects."""
