"""Arrow types to Spark types, and batches cast to exactly the Arrow schema Spark expects.

PySpark 4's Python Data Source API accepts ``pyarrow.RecordBatch`` from ``DataSourceReader.read()`` only when
its schema equals ``to_arrow_schema(spark_schema, timezone="UTC")`` (names, types and nullability; the JVM
then loads the buffers as they are). :func:`spark_type` chooses the Spark type for an Arrow type, and
:func:`conform` casts a batch to the Arrow form of that Spark type: ``large_string``/``string_view`` to
``string``, the binaries to ``binary``, unsigned integers to the next wider signed type (``uint64`` to
``decimal(20, 0)``), dictionaries to their values, every timestamp to microseconds (UTC when it has a time
zone, none when it has none), durations to microseconds, lists of every kind to ``list<element>``, and so on.

Imported only once pyspark is known to be installed (see :mod:`dissoc.spark`).
"""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import types as T
from pyspark.sql.pandas.types import to_arrow_schema as _to_arrow_schema

from dissoc.spark._errors import SparkTypeError

__all__ = ["SparkTypeError", "arrow_target", "conform", "spark_schema", "spark_type"]

log = logging.getLogger(__name__)


def _time_type() -> type[T.DataType] | None:
    """Spark's TimeType (PySpark 4.1 and later), or None."""
    time_type: type[T.DataType] | None = getattr(T, "TimeType", None)
    return time_type


def spark_type(t: pa.DataType) -> T.DataType:
    """The Spark type that holds values of Arrow type ``t`` (nested nullability follows the Arrow fields).

    Raises :class:`SparkTypeError` for types Spark cannot hold (unions, month-day-nano intervals, decimals
    wider than 38 digits, and time of day before PySpark 4.1).
    """
    types = pa.types
    if isinstance(t, pa.ExtensionType):
        return spark_type(t.storage_type)
    if types.is_dictionary(t):
        return spark_type(t.value_type)
    if types.is_run_end_encoded(t):
        return spark_type(t.value_type)
    if types.is_null(t):
        return T.NullType()
    if types.is_boolean(t):
        return T.BooleanType()
    if types.is_integer(t):
        signed = types.is_signed_integer(t)
        bits = t.bit_width if signed else t.bit_width * 2  # unsigned: the next wider signed type
        if bits > 64:
            return T.DecimalType(20, 0)  # uint64: up to 18446744073709551615
        return {8: T.ByteType(), 16: T.ShortType(), 32: T.IntegerType(), 64: T.LongType()}[bits]
    if types.is_float16(t) or types.is_float32(t):
        return T.FloatType()
    if types.is_float64(t):
        return T.DoubleType()
    if types.is_decimal(t):
        if t.precision > 38:
            raise SparkTypeError(f"{t}: Spark decimals hold at most 38 digits, this type has {t.precision}")
        return T.DecimalType(t.precision, t.scale)
    if types.is_string(t) or types.is_large_string(t) or types.is_string_view(t):
        return T.StringType()
    if (
        types.is_binary(t)
        or types.is_large_binary(t)
        or types.is_binary_view(t)
        or types.is_fixed_size_binary(t)
    ):
        return T.BinaryType()
    if types.is_date(t):
        return T.DateType()
    if types.is_timestamp(t):
        return T.TimestampType() if t.tz is not None else T.TimestampNTZType()
    if types.is_duration(t):
        return T.DayTimeIntervalType()
    if types.is_time(t):
        time_type = _time_type()
        if time_type is None:
            raise SparkTypeError(f"{t}: time of day needs PySpark 4.1 or later (TimeType)")
        return time_type()
    if (
        types.is_list(t)
        or types.is_large_list(t)
        or types.is_fixed_size_list(t)
        or types.is_list_view(t)
        or types.is_large_list_view(t)
    ):
        return T.ArrayType(spark_type(t.value_type), containsNull=t.value_field.nullable)
    if types.is_map(t):
        return T.MapType(
            spark_type(t.key_type), spark_type(t.item_type), valueContainsNull=t.item_field.nullable
        )
    if types.is_struct(t):
        return T.StructType([T.StructField(f.name, spark_type(f.type), nullable=f.nullable) for f in t])
    raise SparkTypeError(f"{t}: Spark has no type for it")


def spark_schema(schema: pa.Schema) -> T.StructType:
    """The Spark schema for an Arrow schema: one field per column, same names, same nullability."""
    fields = []
    for f in schema:
        try:
            fields.append(T.StructField(f.name, spark_type(f.type), nullable=f.nullable))
        except SparkTypeError as e:
            raise SparkTypeError(f"column {f.name!r}: {e}") from None
    return T.StructType(fields)


def arrow_target(schema: T.StructType) -> pa.Schema:
    """The Arrow schema PySpark requires of batches for Spark schema ``schema`` (PySpark's own conversion)."""
    return _to_arrow_schema(schema, timezone="UTC")


def _cast(column: pa.Array, target: pa.DataType, name: str) -> pa.Array:
    if column.type == target:
        return column
    src = column.type
    try:
        if isinstance(src, pa.ExtensionType):
            return _cast(column.storage, target, name)
        if pa.types.is_run_end_encoded(src):
            return _cast(pc.run_end_decode(column), target, name)
        return pc.cast(column, options=pc.CastOptions(target, allow_time_truncate=True))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
        raise SparkTypeError(f"column {name!r}: cannot convert {src} to Spark's {target}: {e}") from None


class Conformer:
    """Casts batches to one target schema; the column plan is worked out once per source schema."""

    def __init__(self, target: pa.Schema) -> None:
        self.target = target
        self._plans: dict[pa.Schema, list[tuple[int, bool]] | None] = {}

    def _plan(self, schema: pa.Schema) -> list[tuple[int, bool]] | None:
        """Per target field: the source column index and whether it needs a cast; None: nothing to do."""
        plan = self._plans.get(schema)
        if plan is not None or schema in self._plans:
            return plan
        if schema.equals(self.target):
            self._plans[schema] = None
            return None
        names = schema.names
        if all(f.name in names for f in self.target) and len(set(names)) == len(names):
            indices = [names.index(f.name) for f in self.target]
        elif len(names) == len(self.target):
            indices = list(range(len(names)))  # columns by position (e.g. a user-given schema renames)
        else:
            raise SparkTypeError(
                f"a batch's columns ({', '.join(names)}) do not match Spark's schema "
                f"({', '.join(self.target.names)})"
            )
        plan = [(i, schema.field(i).type != f.type) for i, f in zip(indices, self.target, strict=True)]
        self._plans[schema] = plan
        return plan

    def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        plan = self._plan(batch.schema)
        if plan is None:
            return batch
        columns = [
            _cast(batch.column(i), f.type, f.name) if cast else batch.column(i)
            for (i, cast), f in zip(plan, self.target, strict=True)
        ]
        return pa.RecordBatch.from_arrays(columns, schema=self.target)


def conform(batch: pa.RecordBatch, target: pa.Schema | T.StructType) -> pa.RecordBatch:
    """``batch`` cast to ``target`` (an Arrow schema, or a Spark schema taken through :func:`arrow_target`).

    Columns are matched by name (by position when the names differ but the counts agree).
    """
    if isinstance(target, T.StructType):
        target = arrow_target(target)
    return Conformer(target)(batch)
