"""dissoc.spark against a real local Spark 4 session (local[2], started once for the module).

The data source reads streams listed by ``endpoints`` (combined and split servers in this process) and
datasets resolved through a Flight control plane (a ``dissoc serve --flight`` subprocess); Spark's schema is
exact for awkward Arrow types; the writer publishes partitions and a manifest that dissoc clients and the
reader can use, and leaves nothing behind when a job fails; the barrier exchange routes every row once, to
the task its key hashes to. Spark's Python workers are separate processes: they reach the servers over TCP.
"""

from __future__ import annotations

import datetime
import decimal
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.e2e import PYTHON, REPO, ServerThread, cli_server, ordered_table

from dissoc.errors import DissocError

pytestmark = [
    pytest.mark.timeout(240),
    # PySpark's own notice when pandas 3 is installed (pandas is optional here: only mapInArrow uses it)
    pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas:FutureWarning"),
]
spark_only = pytest.mark.spark


# ------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    """One local[2] session for the module (starting one takes ~10 s); stopped at the end."""
    from pyspark import cloudpickle
    from pyspark.sql import SparkSession

    import dissoc.spark

    # Functions defined here run in Spark's Python workers, which cannot import this test module.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    session = (
        SparkSession.builder.master("local[2]")
        .appName("dissoc-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.memory", "1g")
        .config("spark.python.worker.reuse", "true")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    dissoc.spark.register(session, check=True)
    try:
        yield session
    finally:
        session.stop()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def flight_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, pa.Table]]:
    """``dissoc serve --flight 0`` serving ``ordered.parquet`` (ticket ``ordered``): (location, table)."""
    pytest.importorskip("pyarrow.flight")
    root = tmp_path_factory.mktemp("spark-flight")
    table = ordered_table(4, 250)
    path = root / "ordered.parquet"
    pq.write_table(table, path, row_group_size=250)
    with cli_server(str(path), "--flight", "0", count=1) as (_proc, lines):
        yield lines[0]["flight"], pq.read_table(path)


def _endpoints(*servers: tuple[ServerThread, str]) -> str:
    return json.dumps([[s.uri, s.data_uri, ticket] for s, ticket in servers])


def _served(location: str, prefix: str) -> list[str]:
    from dissoc import flight

    return sorted(i.name for i in flight.list_datasets(location) if i.name.startswith(prefix))


# --------------------------------------------------------------------------------------- without a session


def test_import_dissoc_and_dissoc_spark_never_import_pyspark() -> None:
    code = "import sys, dissoc, dissoc.spark; assert 'pyspark' not in sys.modules, 'pyspark imported'"
    subprocess.run([PYTHON, "-c", code], cwd=REPO, check=True, timeout=60)


def test_missing_pyspark_names_the_spark_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import dissoc.spark

    monkeypatch.setitem(sys.modules, "pyspark", None)  # import pyspark -> ImportError
    with pytest.raises(DissocError, match=r"pip install 'dissoc\[spark\]'"):
        not_a_session: Any = object()  # deliberately not a SparkSession
        dissoc.spark.register(not_a_session)
    with pytest.raises(DissocError, match=r"dissoc\[spark\]"):
        dissoc.spark.spark_schema(pa.schema([("a", pa.int64())]))


def test_hash_partition_is_the_same_in_every_process() -> None:
    import dissoc.spark

    batch = pa.record_batch(
        {
            "i": pa.array([1, 2, None, -5, 2**40], pa.int64()),
            "s": pa.array(["a", "bb", None, "a", "z"]),
            "d": pa.array(["x", "y", "x", None, "y"]).dictionary_encode(),
        }
    )
    here = [dissoc.spark.hash_partition(batch, k, 7).tolist() for k in ("i", "s", "d", ["i", "s"])]
    code = (
        "import json, pyarrow as pa, dissoc.spark as s\n"
        "b = pa.record_batch({'i': pa.array([1, 2, None, -5, 2**40], pa.int64()),"
        " 's': pa.array(['a', 'bb', None, 'a', 'z']),"
        " 'd': pa.array(['x', 'y', 'x', None, 'y']).dictionary_encode()})\n"
        "print(json.dumps([s.hash_partition(b, k, 7).tolist() for k in ('i', 's', 'd', ['i', 's'])]))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([PYTHON, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == here
    assert here[1][0] == here[1][3]  # equal keys, equal destinations
    assert here[2][0] == here[2][2]  # dictionary keys hash by value
    assert all(0 <= d < 7 for row in here for d in row)


# ------------------------------------------------------------------------------------------ type mapping


def _awkward_table() -> pa.Table:
    """Columns Spark has no exact Arrow form for, with nulls; and a non-nullable one."""
    d = pa.array(["a", "b", None, "a"]).dictionary_encode()
    columns: dict[str, pa.Array] = {
        "ls": pa.array(["x", "y", None, "zz"], pa.large_string()),
        "sv": pa.array(["p", None, "q", "r"], pa.string_view()),
        "lb": pa.array([b"\x00", None, b"", b"xy"], pa.large_binary()),
        "u8": pa.array([1, 2, 255, None], pa.uint8()),
        "u16": pa.array([0, 65535, None, 7], pa.uint16()),
        "u32": pa.array([0, 2**32 - 1, None, 7], pa.uint32()),
        "u64": pa.array([0, 1, 2**64 - 1, None], pa.uint64()),
        "d": d,
        "ts_ns": pa.array([1_000_000_123, 2_000, 3, None], pa.timestamp("ns")),
        "ts_tz": pa.array([1, 2, 3, None], pa.timestamp("ms", "Europe/Paris")),
        "ts_s": pa.array([0, 86_400, None, 1], pa.timestamp("s", "UTC")),
        "date64": pa.array([86_400_000, 0, None, 0], pa.date64()),
        "dur": pa.array([1, 2, 3, None], pa.duration("ms")),
        "f16": pa.array([1.5, None, 2.0, 0.0], pa.float32()).cast(pa.float16()),
        "fsb": pa.array([b"ab", b"cd", None, b"ef"], pa.binary(2)),
        "l": pa.array([[1, None], [], None, [3]], pa.large_list(pa.int32())),
        "fsl": pa.array([[1, 2], [3, 4], None, [5, 6]], pa.list_(pa.int16(), 2)),
        "ld": pa.array([["u", None], None, [], ["v"]], pa.list_(pa.large_string())),
        "st": pa.array(
            [{"a": 1, "b": "x"}, None, {"a": None, "b": None}, {"a": 4, "b": "w"}],
            pa.struct([("a", pa.uint16()), ("b", pa.large_string())]),
        ),
        "m": pa.array([[("k", 1)], None, [], [("a", 2), ("b", None)]], pa.map_(pa.string(), pa.int64())),
        "nul": pa.nulls(4),
    }
    fields = [pa.field(k, v.type) for k, v in columns.items()]
    fields.append(pa.field("nn", pa.int64(), nullable=False))
    return pa.Table.from_arrays([*columns.values(), pa.array([1, 2, 3, 4])], schema=pa.schema(fields))


@spark_only
def test_spark_schema_maps_every_awkward_type() -> None:
    from pyspark.sql import types as T

    import dissoc.spark

    schema = dissoc.spark.spark_schema(_awkward_table().schema)
    expected = {
        "ls": T.StringType(),
        "sv": T.StringType(),
        "lb": T.BinaryType(),
        "u8": T.ShortType(),
        "u16": T.IntegerType(),
        "u32": T.LongType(),
        "u64": T.DecimalType(20, 0),
        "d": T.StringType(),
        "ts_ns": T.TimestampNTZType(),
        "ts_tz": T.TimestampType(),
        "ts_s": T.TimestampType(),
        "date64": T.DateType(),
        "dur": T.DayTimeIntervalType(),
        "f16": T.FloatType(),
        "fsb": T.BinaryType(),
        "l": T.ArrayType(T.IntegerType(), True),
        "fsl": T.ArrayType(T.ShortType(), True),
        "ld": T.ArrayType(T.StringType(), True),
        "st": T.StructType([T.StructField("a", T.IntegerType()), T.StructField("b", T.StringType())]),
        "m": T.MapType(T.StringType(), T.LongType(), True),
        "nul": T.NullType(),
        "nn": T.LongType(),
    }
    assert {f.name: f.dataType for f in schema.fields} == expected
    assert [f.nullable for f in schema.fields] == [True] * (len(expected) - 1) + [False]
    with pytest.raises(dissoc.spark.SparkTypeError, match="38 digits"):
        dissoc.spark.spark_type(pa.decimal256(40, 0))
    with pytest.raises(dissoc.spark.SparkTypeError, match="no type"):
        dissoc.spark.spark_type(pa.dense_union([pa.field("a", pa.int8())]))


# ------------------------------------------------------------------------------------------ registering


@spark_only
def test_check_workers_finds_the_drivers_interpreter(spark: Any) -> None:
    """A classic local session: ``register`` (in the fixture) pointed the workers at this interpreter."""
    import dissoc.spark

    assert not dissoc.spark._is_connect(spark)
    assert dissoc.spark.check_workers(spark) == [(sys.executable, dissoc.__version__)]


# ---------------------------------------------------------------------------------------------- reading


@spark_only
@pytest.mark.parametrize("split", [False, True], ids=["combined", "split"])
def test_read_listed_endpoints_one_partition_each(spark: Any, split: bool) -> None:
    first, second = ordered_table(3, 100), ordered_table(2, 50)
    second = second.set_column(0, "id", pa.array(range(1000, 1100), pa.int64()))
    with ServerThread({"a": first}, split=split) as s1, ServerThread({"b": second}, split=split) as s2:
        if split:
            assert s1.uri != s1.data_uri
        df = spark.read.format("dissoc").option("endpoints", _endpoints((s1, "a"), (s2, "b"))).load()
        assert df.rdd.getNumPartitions() == 2
        assert df.schema.simpleString() == "struct<id:bigint>"
        ids = sorted(r.id for r in df.collect())
        assert ids == list(range(300)) + list(range(1000, 1100))
        # a second endpoint on the same server: three partitions, one per stream
        df3 = (
            spark.read.format("dissoc")
            .option("endpoints", _endpoints((s1, "a"), (s1, "a"), (s2, "b")))
            .load()
        )
        assert df3.rdd.getNumPartitions() == 3
        assert df3.count() == 700


@spark_only
def test_read_schema_and_values_are_exact_for_awkward_types(spark: Any) -> None:
    import dissoc.spark
    from dissoc.spark import _types

    table = _awkward_table()
    with ServerThread({"t": table}) as server:
        df = spark.read.format("dissoc").option("endpoints", _endpoints((server, "t"))).load()
        assert df.schema == dissoc.spark.spark_schema(table.schema)
        got = df.toArrow()
        rows = df.orderBy("nn").collect()
    # Spark's Arrow form of the same schema, with the values cast as the source did
    assert got.schema.equals(_types.arrow_target(df.schema))
    expected = dissoc.spark.conform(table.combine_chunks().to_batches()[0], df.schema)
    assert got.sort_by("nn").equals(pa.Table.from_batches([expected]))
    first, third = rows[0], rows[2]
    assert first.ls == "x" and first.sv == "p" and first.lb == bytearray(b"\x00") and first.d == "a"
    assert third.u8 == 255 and third.u64 == decimal.Decimal(2**64 - 1) and third.d is None
    assert first.ts_ns == datetime.datetime(1970, 1, 1, 0, 0, 1)  # 1_000_000_123 ns, truncated to µs
    assert first.ts_tz == datetime.datetime(1970, 1, 1, 0, 0, 0, 1000)  # shown in the session's UTC
    assert first.dur == datetime.timedelta(milliseconds=1) and first.date64 == datetime.date(1970, 1, 2)
    assert first.l == [1, None] and first.fsl == [1, 2] and first.ld == ["u", None]
    assert first.st.a == 1 and first.st.b == "x" and rows[1].st is None
    assert rows[3].m == {"a": 2, "b": None} and first.nul is None and first.f16 == 1.5


@spark_only
def test_read_through_a_flight_location(spark: Any, flight_server: tuple[str, pa.Table]) -> None:
    location, table = flight_server
    df = spark.read.format("dissoc").option("location", location).load("ordered")
    assert df.rdd.getNumPartitions() == 1  # one FlightEndpoint
    assert df.schema.simpleString() == "struct<id:bigint>"
    got = df.toArrow()
    assert got.sort_by("id").column("id").to_pylist() == table.column("id").to_pylist()


@spark_only
def test_read_errors_say_what_is_missing(spark: Any) -> None:
    with pytest.raises(Exception, match=r"needs \.option"):
        spark.read.format("dissoc").load().schema  # noqa: B018
    with pytest.raises(Exception, match="endpoints"):
        spark.read.format("dissoc").option("endpoints", "[1, 2]").load()


# ---------------------------------------------------------------------------------------------- writing


@spark_only
def test_write_publishes_partitions_and_a_manifest(spark: Any, flight_server: tuple[str, pa.Table]) -> None:
    import dissoc.spark

    location, _ = flight_server
    df = spark.range(0, 1000, numPartitions=3).selectExpr("id", "cast(id as string) as s", "id % 7 as k")
    df.write.format("dissoc").option("location", location).mode("append").save("out")

    parts = dissoc.spark.last_write(location, "out")
    assert [p.partition for p in parts] == [0, 1, 2]
    assert all(p.ticket == f"out/{p.job}/{p.partition:05d}.{p.attempt}" for p in parts)
    assert sum(p.rows for p in parts) == 1000
    fetched = pa.concat_tables([dissoc.fetch(p.uri, p.ticket, data_uri=p.data_uri) for p in parts])
    assert fetched.schema.names == ["id", "s", "k"]
    assert sorted(fetched.column("id").to_pylist()) == list(range(1000))
    assert fetched.column("s").to_pylist() == [str(i) for i in fetched.column("id").to_pylist()]

    back = spark.read.format("dissoc").option("location", location).load("out")
    assert back.rdd.getNumPartitions() == 3
    assert back.schema == df.schema
    assert sorted(r.id for r in back.collect()) == list(range(1000))

    # append: a second job adds its parts; the manifest keeps both
    spark.range(1000, 1100, numPartitions=2).selectExpr(
        "id", "cast(id as string) as s", "id % 7 as k"
    ).write.format("dissoc").option("location", location).mode("append").save("out")
    assert len(dissoc.spark.written(location, "out")) == 5
    second = dissoc.spark.last_write(location, "out")
    assert len(second) == 2 and second[0].job != parts[0].job
    assert spark.read.format("dissoc").option("location", location).load("out").count() == 1100

    # overwrite: only the new job remains, the old parts are no longer served
    spark.range(5, numPartitions=1).selectExpr("id", "'x' as s", "id as k").write.format("dissoc").option(
        "location", location
    ).mode("overwrite").save("out")
    assert [p.rows for p in dissoc.spark.written(location, "out")] == [5]
    assert len(_served(location, "out/")) == 1
    assert spark.read.format("dissoc").option("location", location).load("out").count() == 5


@spark_only
def test_failed_write_leaves_no_ticket_behind(spark: Any, flight_server: tuple[str, pa.Table]) -> None:
    from pyspark.sql.functions import udf

    import dissoc.spark

    location, _ = flight_server

    def fail_late(i: Any) -> Any:
        if i >= 150:  # only the second partition
            import time

            time.sleep(0.5)  # the first partition usually publishes before the job fails
            raise ValueError("boom")
        return i

    explode_late = udf(fail_late, "long", useArrow=False)
    df = spark.range(0, 200, numPartitions=2).select(explode_late("id").alias("id"))
    with pytest.raises(Exception, match="boom"):
        df.write.format("dissoc").option("location", location).option("cleanupGrace", "2.5").mode(
            "append"
        ).save("failing")
    assert _served(location, "failing") == []
    assert dissoc.spark.written(location, "failing") == []


class _FakeTask:
    def __init__(self, partition: int, attempt: int) -> None:
        self.partition, self.attempt = partition, attempt

    def partitionId(self) -> int:
        return self.partition

    def attemptNumber(self) -> int:
        return self.attempt


@spark_only
def test_commit_removes_stray_attempts_and_late_attempts_remove_themselves(
    flight_server: tuple[str, pa.Table], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's protocol, driven directly (Spark rarely runs speculative attempts on demand)."""
    from pyspark import TaskContext
    from pyspark.sql import types as T

    import dissoc.spark
    from dissoc.spark import _source

    location, _ = flight_server
    schema = T.StructType([T.StructField("x", T.LongType())])
    writer = _source.DissocWriter(location, "spec", "job1", schema, overwrite=False, timeout=10)
    task = _FakeTask(0, 0)
    monkeypatch.setattr(TaskContext, "get", staticmethod(lambda: task))  # the class _source uses

    def write(partition: int, attempt: int, values: list[int]) -> Any:
        task.partition, task.attempt = partition, attempt
        return writer.write(iter([pa.record_batch({"x": pa.array(values, pa.int64())})]))

    winners = [write(0, 0, [1, 2]), write(1, 0, [3])]
    write(1, 1, [3])  # a speculative copy that lost: never committed
    assert _served(location, "spec/") == ["spec/job1/00000.0", "spec/job1/00001.0", "spec/job1/00001.1"]
    writer.commit(winners)
    assert _served(location, "spec") == ["spec", "spec/job1/00000.0", "spec/job1/00001.0"]
    write(0, 1, [1, 2])  # an attempt that publishes after the commit removes itself
    assert _served(location, "spec") == ["spec", "spec/job1/00000.0", "spec/job1/00001.0"]
    assert [(p.partition, p.rows) for p in dissoc.spark.last_write(location, "spec")] == [(0, 2), (1, 1)]

    aborted = _source.DissocWriter(
        location, "spec", "job2", schema, overwrite=False, timeout=10, cleanup_grace=0
    )
    writer = aborted
    messages = [write(0, 0, [7]), None]
    aborted.abort(messages)
    assert _served(location, "spec/job2") == []
    assert [p.job for p in dissoc.spark.written(location, "spec")] == ["job1", "job1"]


@spark_only
def test_write_refuses_a_plain_dataset_name(spark: Any, flight_server: tuple[str, pa.Table]) -> None:
    location, _ = flight_server
    with pytest.raises(Exception, match="plain dataset"):
        spark.range(3).write.format("dissoc").option("location", location).mode("append").save("ordered")


# ---------------------------------------------------------------------------------------------- exchange


def _keyed_batches(index: int, _: Iterator[Any]) -> Iterator[pa.RecordBatch]:
    """Partition ``index`` of the exchange input: 2500 rows, keys 0..96, values unique over both."""
    values = np.arange(index * 2500, (index + 1) * 2500)
    yield pa.record_batch({"k": pa.array(values % 97, pa.int64()), "v": pa.array(values, pa.int64())})


def _check_routed(out: pa.Table, n_rows: int) -> None:
    import dissoc.spark

    assert out.num_rows == n_rows
    assert sorted(out.column("v").to_pylist()) == list(range(n_rows))  # every row exactly once
    combined = out.combine_chunks().to_batches()[0]
    expected = dissoc.spark.hash_partition(combined, "k", 2)
    assert combined.column("task").to_pylist() == expected.tolist()  # each row at its key's task
    assert set(expected.tolist()) == {0, 1}


def _route(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Exchange by key, then tag each received row with the task that received it."""
    from pyspark import TaskContext

    import dissoc.spark

    context = TaskContext.get()
    assert context is not None
    me = context.partitionId()
    for batch in dissoc.spark.exchange(batches, key="k"):
        yield batch.append_column("task", pa.array([me] * batch.num_rows, pa.int32()))


@spark_only
def test_barrier_exchange_hash_partitions_every_row_once(spark: Any) -> None:
    rdd = spark.sparkContext.parallelize([0, 1], 2).mapPartitionsWithIndex(_keyed_batches)
    batches = rdd.barrier().mapPartitions(_route).collect()
    _check_routed(pa.Table.from_batches(batches), 5000)


@spark_only
def test_barrier_exchange_in_map_in_arrow(spark: Any) -> None:
    pytest.importorskip("pandas", reason="PySpark's mapInArrow needs pandas")
    source = pa.Table.from_batches([b for i in (0, 1) for b in _keyed_batches(i, iter(()))])
    df = spark.createDataFrame(source).repartition(2)
    out = df.mapInArrow(_route, "k long, v long, task int", barrier=True).toArrow()
    _check_routed(out, 5000)


@spark_only
def test_barrier_exchange_over_an_rdd_without_key_gathers_everything(spark: Any) -> None:
    import dissoc.spark

    def make(index: int, _: Iterator[Any]) -> Iterator[pa.RecordBatch]:
        yield pa.record_batch({"x": pa.array(range(index * 10, index * 10 + 10), pa.int64())})

    def gather(batches: Iterator[pa.RecordBatch]) -> Iterator[int]:
        got = [x for b in dissoc.spark.exchange(batches) for x in b.column("x").to_pylist()]
        yield len(got)
        yield sum(got)

    rdd = spark.sparkContext.parallelize([0, 1], 2).mapPartitionsWithIndex(make)
    assert rdd.barrier().mapPartitions(gather).collect() == [20, sum(range(20))] * 2


@spark_only
def test_exchange_outside_a_barrier_stage_is_a_clear_error(spark: Any) -> None:
    import dissoc.spark

    def run(_: Iterator[Any]) -> Iterator[str]:
        try:
            dissoc.spark.exchange([pa.record_batch({"x": [1]})], key="x")
        except DissocError as e:
            yield str(e)

    (message,) = spark.sparkContext.parallelize([0], 1).mapPartitions(run).collect()
    assert "barrier stage" in message


def test_manifest_round_trips_without_spark() -> None:
    import dissoc.spark
    from dissoc.spark._manifest import (
        decode_manifest,
        encode_manifest,
        is_manifest,
        manifest_data_schema,
        manifest_jobs,
    )

    part = dissoc.spark.WrittenPart(
        "j", 3, 1, "tcp://h:1?want_data=1", "tcp://h:1?want_data=1", "n/j/00003.1", 9
    )
    data_schema = pa.schema([("a", pa.string())])
    table = encode_manifest([part], data_schema, ["i", "j"])
    assert is_manifest(table.schema) and manifest_data_schema(table.schema).equals(data_schema)
    assert manifest_jobs(table.schema) == ["i", "j"]
    assert not is_manifest(data_schema)
    assert decode_manifest(table) == [part]
