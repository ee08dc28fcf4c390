"""Spark Structured Streaming at both ends of a dissoc live stream (one local Spark session for the module).

A dissoc server with its Flight control plane runs in this process, on its own event loop in a thread; the
tests publish live streams on it and append to them from the test's thread while Spark's Python workers (other
processes) read and append over TCP. The source: a query reads what was appended and then only what is new;
a query restarted from its checkpoint reads every batch once; a query whose offsets the server no longer holds
fails naming the first offset held. The sink: micro-batches land in a live stream exactly once, through a task
that fails once and is retried, and through a micro-batch Spark replays after a restart. Spark is slow to
start a query (seconds each on two busy cores): the tests use few, small batches and few queries.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from helpers.e2e import REPO, ServerThread

from dissoc.errors import DissocError

pytestmark = [
    pytest.mark.spark,
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas:FutureWarning"),
    # PySpark's note that a UDF's type hints do not make it an Arrow UDF (it is a plain one here)
    pytest.mark.filterwarnings("ignore:Cannot infer the eval type from type hints:UserWarning"),
]

SCHEMA = pa.schema([pa.field("k", pa.int64()), pa.field("v", pa.string())])


def _batch(start: int, rows: int = 3) -> pa.RecordBatch:
    keys = list(range(start, start + rows))
    return pa.record_batch({"k": keys, "v": [f"r{k}" for k in keys]}, schema=SCHEMA)


# ------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def plane() -> Iterator[ServerThread]:
    """``serve_with_flight({})`` in a thread: ``.location``, ``.server``."""
    pytest.importorskip("pyarrow.flight")
    with ServerThread({}, flight=True, host="127.0.0.1") as running:
        yield running


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    """One session for the module: two task slots, and a task may fail once (``local[2,2]``)."""
    from pyspark import cloudpickle
    from pyspark.sql import SparkSession

    import dissoc.spark

    # Spark's Python workers import the dissoc under test, and the functions defined here by value.
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = path
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    session = (
        SparkSession.builder.master("local[2,2]")
        .appName("dissoc-streaming-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.driver.memory", "1g")
        .config("spark.python.worker.reuse", "true")
        .config("spark.executorEnv.PYTHONPATH", path)
        .config("spark.sql.streaming.pollingDelay", "50ms")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    dissoc.spark.register(session)
    try:
        yield session
    finally:
        session.stop()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def _collect_batches(store: list[tuple[int, list[tuple[int, str]]]]) -> Any:
    """A ``foreachBatch`` function (it runs in this process) recording ``(batch id, rows)``."""

    def record(df: Any, batch_id: int) -> None:
        store.append((batch_id, sorted((int(r.k), str(r.v)) for r in df.collect())))

    return record


def _rows(*batches: pa.RecordBatch) -> list[tuple[int, str]]:
    return sorted(
        (k, v) for b in batches for k, v in zip(b["k"].to_pylist(), b["v"].to_pylist(), strict=True)
    )


def _read_stream(location: str, name: str) -> list[tuple[int, str]]:
    """Every row a dissoc client reads from the live stream ``name`` (offsets 0 to its head)."""
    from dissoc import flight
    from dissoc.client import ClientOptions, open_stream

    head = flight.live_status(location, name)["head"]
    rows: list[tuple[int, str]] = []
    if head == 0:
        return rows
    taken = 0
    with open_stream(location, f"{name}@0", options=ClientOptions(timeout=10)) as stream:
        for batch in stream:
            assert isinstance(batch, pa.RecordBatch)
            rows += zip(batch["k"].to_pylist(), batch["v"].to_pylist(), strict=True)
            taken += 1
            if taken == head:
                break
    return rows


def _staged(location: str, name: str) -> list[str]:
    from dissoc import flight

    return sorted(i.name for i in flight.list_datasets(location) if i.name.startswith(f"{name}/"))


# ------------------------------------------------------------------------------------- without a session


def test_ranges_offsets_and_options_without_spark() -> None:
    pytest.importorskip("pyspark")
    from dissoc.spark._streaming import parse_starting_offsets, split_range, stage_prefix

    assert split_range(3, 3, 4) == []
    assert split_range(0, 10, 3) == [(0, 4), (4, 3), (7, 3)]
    assert split_range(5, 7, 8) == [(5, 1), (6, 1)]
    assert parse_starting_offsets(None) == "earliest"
    assert parse_starting_offsets(" Latest ") == "latest"
    assert parse_starting_offsets("12") == 12
    with pytest.raises(DissocError, match="startingOffsets"):
        parse_starting_offsets("-1")
    assert stage_prefix("out", "q", 7) == "out/_stream/q/0000000007/"


def test_the_sink_appends_a_batch_once_and_removes_what_was_staged(plane: ServerThread) -> None:
    """The driver's commit, called as Spark calls it, twice for one batch id: one append."""
    pytest.importorskip("pyspark")
    from dissoc import flight
    from dissoc.spark._streaming import DissocStreamWriter, StagedPart, StreamCommitMessage, stage_prefix

    plane.server.publish("unit_out", SCHEMA)
    staged = []
    for partition in (1, 0):
        ticket = f"{stage_prefix('unit_out', 'q1', 4)}{partition:05d}.0-x"
        flight.publish(plane.location, ticket, pa.Table.from_batches([_batch(10 * partition)]))
        staged.append(StreamCommitMessage(StagedPart("q1", 4, partition, 0, ticket, 3)))
    late = f"{stage_prefix('unit_out', 'q1', 3)}00000.1-y"  # an earlier batch's late attempt
    flight.publish(plane.location, late, pa.Table.from_batches([_batch(99)]))
    writer = DissocStreamWriter(plane.location, "unit_out", SCHEMA, fallback_producer=None)
    writer.commit([*staged, StreamCommitMessage(StagedPart("q1", 4, 2, 0, None, 0))], 4)
    assert _read_stream(plane.location, "unit_out") == [*_rows(_batch(0)), *_rows(_batch(10))]
    assert _staged(plane.location, "unit_out") == []
    writer.commit([], 4)  # nothing reported: nothing appended
    # the same batch again (a replay): staged anew, skipped, removed
    again = f"{stage_prefix('unit_out', 'q1', 4)}00000.0-z"
    flight.publish(plane.location, again, pa.Table.from_batches([_batch(0)]))
    writer.commit([StreamCommitMessage(StagedPart("q1", 4, 0, 0, again, 3))], 4)
    assert flight.live_status(plane.location, "unit_out")["head"] == 2
    assert _staged(plane.location, "unit_out") == []


def test_the_reader_offsets_and_partitions_without_spark(plane: ServerThread) -> None:
    """The stream reader's methods called in this process, as Spark's driver and tasks call them."""
    pytest.importorskip("pyspark")
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from dissoc.errors import RemoteError
    from dissoc.spark._streaming import DissocStreamReader, LivePartition

    schema = StructType([StructField("k", LongType()), StructField("v", StringType())])
    stream = plane.server.publish("unit_in", SCHEMA, max_batches=4)
    for b in (_batch(0), _batch(3, 0), _batch(3), _batch(6)):
        stream.append(b)

    def reader(**options: Any) -> DissocStreamReader:
        return DissocStreamReader(plane.location, "unit_in", schema, **options)

    assert reader().initialOffset() == {"offset": 0}
    assert reader(starting="latest").initialOffset() == {"offset": 4}
    assert reader(starting=2).initialOffset() == {"offset": 2}
    with pytest.raises(DissocError, match="past the head"):
        reader(starting=5).initialOffset()
    every = reader(max_partitions=3)
    assert every.latestOffset({"offset": 1}, ReadAllAvailable()) == {"offset": 4}
    assert every.latestOffset({"offset": 1}, ReadMaxRows(2)) == {"offset": 3}
    parts = [p for p in every.partitions({"offset": 0}, {"offset": 4}) if isinstance(p, LivePartition)]
    assert [(p.start, p.count) for p in parts] == [(0, 2), (2, 1), (3, 1)]
    assert [b.num_rows for p in parts for b in every.read(p)] == [3, 3, 3]  # the empty batch is skipped
    assert every.partitions({"offset": 4}, {"offset": 4}) == []
    planned = reader().partitions({"offset": 0}, {"offset": 2})  # its task runs once offset 0 is gone
    every.prepareForTriggerAvailableNow()
    stream.append(_batch(9))  # offset 0 goes
    assert every.latestOffset({"offset": 4}, ReadAllAvailable()) == {"offset": 4}  # availableNow: no further
    assert reader().latestOffset({"offset": 4}, ReadAllAvailable()) == {"offset": 5}
    with pytest.raises(DissocError, match="made anew"):
        reader().latestOffset({"offset": 9}, ReadAllAvailable())
    # offset 0 is no longer held: planning fails on the driver, and so does a task planned before it went
    with pytest.raises(RemoteError, match="first offset the server still holds is 1"):
        reader().partitions({"offset": 0}, {"offset": 2})
    with pytest.raises(RemoteError, match="fell behind") as failed:
        list(reader().read(planned[0]))
    assert failed.value.code == "fell_behind"
    assert "first offset held is 1" in str(failed.value), str(failed.value)


# ---------------------------------------------------------------------------------------------- the source


def test_the_source_reads_what_is_appended_and_a_restarted_query_every_batch_once(
    spark: Any, plane: ServerThread, tmp_path: Path
) -> None:
    stream = plane.server.publish("events", SCHEMA)
    first = [_batch(0), _batch(3, 0), _batch(3)]  # an empty batch takes an offset too
    for b in first:
        stream.append(b)
    got: list[tuple[int, list[tuple[int, str]]]] = []
    checkpoint = str(tmp_path / "checkpoint")
    df = spark.readStream.format("dissoc").option("location", plane.location).load("events")
    assert df.schema.fieldNames() == ["k", "v"]
    query = (
        df.writeStream.foreachBatch(_collect_batches(got)).option("checkpointLocation", checkpoint).start()
    )
    try:
        query.processAllAvailable()
        assert sorted(r for _, rows in got for r in rows) == _rows(*first)
        seen = len(got)
        more = [_batch(6), _batch(9, 1)]
        for b in more:
            stream.append(b)
        query.processAllAvailable()  # only the new batches
        assert sorted(r for _, rows in got[seen:] for r in rows) == _rows(*more)
        end = query.lastProgress["sources"][0]["endOffset"]
        assert (json.loads(end) if isinstance(end, str) else end) == {"offset": 5}
    finally:
        query.stop()
    # Stopped after its micro-batches committed; more is appended; the query restarts from its checkpoint,
    # a batch or two per micro-batch, each read by up to two tasks.
    batches = len(got)
    later = [_batch(100), _batch(103), _batch(106, 2)]
    for b in later:
        stream.append(b)
    restarted = (
        spark.readStream.format("dissoc")
        .option("location", plane.location)
        .option("maxBatchesPerTrigger", 2)
        .option("maxPartitions", 2)
        .load("events")
        .writeStream.foreachBatch(_collect_batches(got))
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    restarted.awaitTermination(120)
    assert [len(rows) for _, rows in got[batches:]] == [6, 2]  # offsets 5..6, then 7
    ids = [batch_id for batch_id, _ in got]
    assert ids == sorted(set(ids))  # no micro-batch twice
    every = [r for _, rows in got for r in rows]
    assert sorted(every) == _rows(*first, *more, *later)
    assert len(every) == len(set(every))


def test_a_query_behind_the_retention_fails_naming_the_first_offset_held(
    spark: Any, plane: ServerThread, tmp_path: Path
) -> None:
    from pyspark.errors import StreamingQueryException

    stream = plane.server.publish("short", SCHEMA, max_batches=2)
    for i in range(5):
        stream.append(_batch(i))
    assert stream.first == 3
    query = (
        spark.readStream.format("dissoc")
        .option("location", plane.location)
        .option("startingOffsets", "1")
        .load("short")
        .writeStream.format("noop")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    with pytest.raises(
        StreamingQueryException, match=r"fell_behind.*first offset the server still holds is 3"
    ):
        query.awaitTermination(120)


def test_the_sink_says_how_to_make_a_missing_stream(plane: ServerThread) -> None:
    """Checked where Spark asks for the sink (on the driver), before any micro-batch runs."""
    pytest.importorskip("pyspark")
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from dissoc.spark._source import DissocDataSource

    schema = StructType([StructField("k", LongType()), StructField("v", StringType())])
    plane.server.add("plain", pa.table({"k": [1]}))
    plane.server.publish("other_columns", pa.schema([("x", pa.int64())]))
    cases = {
        "absent": r"no live stream 'absent'.*dissoc serve --flight PORT --live absent",
        "plain": r"'plain'.* is a plain dataset, not a live stream",
        "other_columns": r"has columns \(x\); this query writes \(k, v\)",
    }
    for name, expected in cases.items():
        source = DissocDataSource({"location": plane.location, "path": name})
        with pytest.raises(DissocError, match=expected):
            source.streamWriter(schema, False)
    plane.server.publish("closed", SCHEMA).close()
    with pytest.raises(DissocError, match="is closed"):
        DissocDataSource({"location": plane.location, "path": "closed"}).streamWriter(schema, False)
    with pytest.raises(DissocError, match="append-only"):
        DissocDataSource({"location": plane.location, "path": "closed"}).streamWriter(schema, True)


# ------------------------------------------------------------------------------------------------ the sink


def _fail_once(marker: str) -> Any:
    """A UDF that fails the first attempt of partition 1's task (once: ``marker`` remembers)."""
    from pyspark.sql.functions import udf

    def check(k: int) -> int:
        from pyspark import TaskContext

        context = TaskContext.get()
        if context is not None and context.partitionId() == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            raise RuntimeError("injected failure (first attempt of partition 1)")
        return k

    return udf(check, "long")


def test_the_sink_appends_every_row_exactly_once_through_failures_and_replays(
    spark: Any, plane: ServerThread, tmp_path: Path
) -> None:
    source = plane.server.publish("sink_in", SCHEMA)
    out = plane.server.publish("sink_out", SCHEMA)
    commits: list[int] = []  # the sequence (micro-batch id) of every commit that reached the stream
    append_once = out.append_once

    def spy(batches: Any, **kwargs: Any) -> Any:
        commits.append(kwargs["sequence"])
        return append_once(batches, **kwargs)

    out.append_once = spy
    appended = [_batch(10 * i, 4) for i in range(4)]
    for b in appended[:2]:
        source.append(b)
    checkpoint = tmp_path / "checkpoint"
    marker = str(tmp_path / "failed-once")

    def run() -> str:
        df = (
            spark.readStream.format("dissoc")
            .option("location", plane.location)
            .option("maxPartitions", 2)
            .load("sink_in")
        )
        query = (
            df.select(_fail_once(marker)(df.k).alias("k"), df.v)
            .writeStream.format("dissoc")
            .option("location", plane.location)
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start("sink_out")
        )
        query.awaitTermination(120)
        return str(query.id)

    query_id = run()  # micro-batch 0: offsets 0..1, in two tasks, the second failing once
    assert os.path.exists(marker)
    assert sorted(_read_stream(plane.location, "sink_out")) == _rows(*appended[:2])
    head = out.head
    # Spark replays a micro-batch whose commit it did not record (as after a crash between the sink's commit
    # and the commit log): the same batch id reaches the sink again, which must not append it twice; then
    # micro-batch 1 reads what was appended meanwhile.
    for path in (checkpoint / "commits" / "0", checkpoint / "commits" / ".0.crc"):
        path.unlink(missing_ok=True)
    for b in appended[2:]:
        source.append(b)
    assert run() == query_id  # the checkpoint keeps the query's id: the sink's producer
    assert commits == [0, 0, 1]  # batch 0 committed, replayed (and skipped), then batch 1
    assert out.last_sequence(f"spark:{query_id}") == 1
    assert out.head == head + 2
    assert sorted(_read_stream(plane.location, "sink_out")) == _rows(*appended)
    assert _staged(plane.location, "sink_out") == []
