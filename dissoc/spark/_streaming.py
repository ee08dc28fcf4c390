"""Spark Structured Streaming at both ends of a dissoc live stream (:mod:`dissoc.datasets.live`).

**Source** (``spark.readStream.format("dissoc")``): Spark's offsets are the live stream's batch offsets,
``{"offset": N}`` meaning "the batches before N are read". ``latestOffset`` asks the control plane for the
stream's ``head`` (the ``live-status`` action); a micro-batch ``[start, end)`` is read by tasks that each
fetch ``NAME@S`` over dissoc and hang up after their share of the range, so every offset is read exactly
once per micro-batch and a restarted query resumes from its checkpointed offset. Offsets the server no
longer holds fail the query (``fell_behind``, naming the first offset held): never a silent gap.

**Sink** (``df.writeStream.format("dissoc")``): each write task stages its partition of micro-batch ``B``
as a plain dataset ``NAME/_stream/QUERY/BBBBBBBBBB/PPPPP.A-XXXXXX`` (``QUERY`` is the streaming query's id,
which a checkpoint keeps across restarts); the driver's commit has the server append the staged data, in
partition order, to the live stream (``live-append-staged``: names, no data, cross the driver) with
``producer=spark:QUERY, sequence=B``. The server appends them at most once per (producer, sequence), so a
retried task (only its successful attempt is named in the commit), a retried commit or a batch replayed after
a restart never appends twice. The commit then
removes the staged datasets of batches up to ``B`` (failed, speculative and late attempts included).

Where each method runs: ``DissocStreamReader`` lives in one long-running Python process on the driver
(offsets, partitions, commit) and ``read`` runs in executor tasks; ``DissocStreamWriter`` is made anew for
the tasks' ``write`` and for each driver-side ``commit``/``abort``, so it carries nothing from one to the
other but what its constructor is given and the commit messages.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from dissoc.errors import DissocError, RemoteError
from dissoc.spark._manifest import PLAIN, Access, remove_quietly, served_with_prefix
from dissoc.spark._types import Conformer, arrow_target

__all__ = [
    "DissocStreamReader",
    "DissocStreamWriter",
    "LivePartition",
    "StagedPart",
    "live_target",
    "parse_starting_offsets",
    "stage_prefix",
]

log = logging.getLogger(__name__)

EARLIEST, LATEST = "earliest", "latest"
#: The local properties Spark sets on every task of a streaming query's micro-batch.
QUERY_ID_PROPERTY = "sql.streaming.queryId"
BATCH_ID_PROPERTY = "streaming.sql.batchId"
#: Seconds an aborted micro-batch waits before looking again for staged data its killed tasks made late.
DEFAULT_CLEANUP_GRACE = 3.0


def parse_starting_offsets(text: str | None) -> str | int:
    """The ``startingOffsets`` option: ``earliest`` (the default), ``latest`` or an offset >= 0."""
    if text is None:
        return EARLIEST
    value = str(text).strip().lower()
    if value in (EARLIEST, LATEST):
        return value
    if value.isdigit():
        return int(value)
    raise DissocError(f"option startingOffsets: expected earliest, latest or an offset >= 0, got {text!r}")


def _offset(value: Mapping[str, Any] | None, what: str) -> int:
    """The batch offset in Spark's offset ``{"offset": N}``."""
    raw = None if value is None else value.get("offset")
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 0:
        raise DissocError(
            f"the dissoc streaming source's {what} offset should be {{'offset': N >= 0}}, got {value!r}"
        )
    return raw


def _not_live(location: str, name: str, e: RemoteError) -> DissocError:
    if e.code == "unknown_ticket":
        return DissocError(
            f"no live stream {name!r} at {location}: the server must serve one first (dissoc serve --flight "
            f"PORT --live {name}[=SCHEMA_FILE], or server.publish({name!r}, schema) in the server's process)"
        )
    if e.code == "not_live":
        return DissocError(
            f"{name!r} at {location} is a plain dataset, not a live stream: Structured Streaming reads "
            "and appends to live streams (server.publish); read or write plain datasets with spark.read and "
            "df.write"
        )
    return e


def live_status(location: str, name: str, timeout: float, access: Access = PLAIN) -> dict[str, Any]:
    """The live stream's state (``head``, ``first``, ``ended``...), or a DissocError saying what is wrong."""
    from dissoc import flight

    try:
        status = flight.live_status(location, name, timeout=timeout, **access.flight())
    except RemoteError as e:
        raise _not_live(location, name, e) from None
    for key in ("head", "first"):
        if not isinstance(status.get(key), int):
            raise DissocError(f"live-status of {name!r} at {location}: no {key!r} in the answer {status!r}")
    return status


# ------------------------------------------------------------------------------------------------- source


class LivePartition(InputPartition):
    """One task's share of a micro-batch: ``count`` batches of the stream from offset ``start``."""

    def __init__(
        self, index: int, uri: str, data_uri: str, ticket: bytes, name: str, start: int, count: int
    ) -> None:
        super().__init__(index)
        self.uri = uri
        self.data_uri = data_uri
        self.ticket = ticket
        self.name = name
        self.start = start
        self.count = count


def split_range(start: int, end: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into at most ``parts`` contiguous, nearly equal ``(start, count)`` ranges."""
    total = end - start
    if total <= 0:
        return []
    parts = max(1, min(parts, total))
    size, extra = divmod(total, parts)
    ranges = []
    at = start
    for i in range(parts):
        count = size + (1 if i < extra else 0)
        ranges.append((at, count))
        at += count
    return ranges


class DissocStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Reads a live stream micro-batch by micro-batch (see the module docstring)."""

    def __init__(
        self,
        location: str,
        name: str,
        schema: StructType,
        *,
        starting: str | int = EARLIEST,
        timeout: float = 30.0,
        validate: bool = True,
        access: Access = PLAIN,
        max_batches_per_trigger: int | None = None,
        max_partitions: int = 1,
    ) -> None:
        self.location = location
        self.name = name
        self.schema = schema
        self.starting = starting
        self.timeout = timeout
        self.validate = validate
        self.access = access
        self.max_batches_per_trigger = max_batches_per_trigger
        self.max_partitions = max(1, max_partitions)
        #: The head when ``trigger(availableNow=True)`` started: the query ends there.
        self._available_now: int | None = None

    def _status(self) -> dict[str, Any]:
        return live_status(self.location, self.name, self.timeout, self.access)

    def initialOffset(self) -> dict[str, int]:
        """Where a new query starts (``startingOffsets``): the first offset held, the head, or a number."""
        status = self._status()
        head = int(status["head"])
        if isinstance(self.starting, int):
            offset = self.starting
            if offset > head:
                raise DissocError(
                    f"option startingOffsets: offset {offset} is past the head of live stream {self.name!r} "
                    f"at {self.location} ({head}, the offset of the next batch appended); use 'latest' to "
                    "start there"
                )
        else:
            offset = int(status["first"]) if self.starting == EARLIEST else head
        log.info("streaming %r at %s: a new query starts at offset %d", self.name, self.location, offset)
        return {"offset": offset}

    def getDefaultReadLimit(self) -> ReadLimit:
        """``maxBatchesPerTrigger``: at most that many of the stream's batches per micro-batch (expressed as
        Spark's ``ReadMaxRows``, as Kafka's ``maxOffsetsPerTrigger`` is: one offset, one batch here)."""
        if self.max_batches_per_trigger is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.max_batches_per_trigger)

    def prepareForTriggerAvailableNow(self) -> None:
        """``trigger(availableNow=True)``: read up to the head as it is now, then stop."""
        self._available_now = int(self._status()["head"])

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, int]:
        """The stream's head (capped by the read limit and ``availableNow``), never before ``start``."""
        begin = _offset(start, "start")
        # asked afresh every time (processAllAvailable relies on it): while a query waits for data, Spark
        # asks every spark.sql.streaming.pollingDelay (10 ms), and a live-status call takes about 1 ms
        head = int(self._status()["head"])
        if head < begin:
            raise DissocError(
                f"live stream {self.name!r} at {self.location} has {head} batches, but this query has read "
                f"up to offset {begin}: the stream was made anew (a restarted server?). Start the query with "
                "a new checkpointLocation to read the new stream"
            )
        end = head
        if self._available_now is not None:
            end = min(end, self._available_now)
        if isinstance(limit, ReadMaxRows):
            end = min(end, begin + max(1, int(limit.max_rows)))
        return {"offset": max(end, begin)}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        """Up to ``maxPartitions`` tasks, each reading a contiguous part of ``[start, end)``."""
        from dissoc import flight

        begin, stop = _offset(start, "start"), _offset(end, "end")
        ranges = split_range(begin, stop, self.max_partitions)
        if not ranges:
            return []
        first = int(self._status()["first"])
        if begin < first:
            raise RemoteError("fell_behind", self._fell_behind(begin, stop, first))
        partitions: list[InputPartition] = []
        for index, (at, count) in enumerate(ranges):
            # resolved per range: with a token, the ticket is one the control plane signs for NAME@OFFSET
            endpoints = flight.resolve(
                self.location, f"{self.name}@{at}", timeout=self.timeout, **self.access.flight()
            )
            if len(endpoints) != 1:
                raise DissocError(
                    f"live stream {self.name!r} at {self.location}: expected one endpoint, got "
                    f"{len(endpoints)}"
                )
            uri, data_uri, ticket = endpoints[0]
            partitions.append(LivePartition(index, uri, data_uri, ticket, self.name, at, count))
        return partitions

    def _fell_behind(self, begin: int, stop: int, first: int) -> str:
        return (
            f"live stream {self.name!r} at {self.location}: this query needs offsets {begin}..{stop - 1}, "
            f"but the first offset the server still holds is {first}; the query fell behind the stream's "
            "retention (max_batches, max_bytes). Restart it with a new checkpointLocation (startingOffsets "
            "earliest or latest), or give the stream more retention (or on_full='block')"
        )

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """This task's batches, cast to Spark's Arrow schema; hangs up after the last (runs in a task)."""
        from dissoc.client import open_stream

        assert isinstance(partition, LivePartition)
        conform = Conformer(arrow_target(self.schema))
        options = self.access.options(timeout=self.timeout, validate=self.validate)
        taken = 0
        if partition.count <= 0:
            return
        try:
            with open_stream(
                partition.uri, partition.ticket, data_uri=partition.data_uri, options=options
            ) as stream:
                for batch in stream:
                    taken += 1
                    if batch.num_rows:
                        yield conform(batch)
                    if taken >= partition.count:
                        break
        except RemoteError as e:
            if e.code != "fell_behind":
                raise
            raise RemoteError(
                "fell_behind",
                f"reading offsets {partition.start}..{partition.start + partition.count - 1} of live stream "
                f"{partition.name!r}: {e.message} (the query fell behind the stream's retention: restart it "
                "with a new checkpointLocation, or give the stream more retention)",
            ) from None
        if taken < partition.count:
            raise DissocError(
                f"live stream {partition.name!r} ended after {taken} of the {partition.count} batches from "
                f"offset {partition.start} this task was to read"
            )

    def commit(self, end: dict[str, Any]) -> None:
        """Spark has processed every batch before ``end``: nothing to free (the retention decides)."""
        log.debug("streaming %r: committed up to offset %s", self.name, end.get("offset"))


# --------------------------------------------------------------------------------------------------- sink


def stage_prefix(name: str, query: str, batch: int | None = None) -> str:
    """The prefix of what a streaming query stages under live stream ``name`` (for one batch, if given)."""
    prefix = f"{name}/_stream/{query}/"
    return prefix if batch is None else f"{prefix}{batch:010d}/"


@dataclass(frozen=True, slots=True)
class StagedPart:
    """One write task's partition of a micro-batch: staged as ``ticket`` (None when it had no rows)."""

    query: str
    batch: int
    partition: int
    attempt: int
    ticket: str | None
    rows: int


class StreamCommitMessage(WriterCommitMessage):
    """What one successful write task reports to the driver."""

    def __init__(self, part: StagedPart) -> None:
        self.part = part


def live_target(location: str, name: str, schema: StructType, timeout: float, access: Access) -> pa.Schema:
    """The Arrow schema the sink writes: the live stream's (its columns found by name in Spark's), or, for a
    stream with no schema yet, Spark's. A DissocError when the stream is missing, not live, or its columns
    are not the query's."""
    from dissoc import flight

    status = live_status(location, name, timeout, access)
    if status.get("ended"):
        raise DissocError(f"live stream {name!r} at {location} is closed: nothing more can be appended to it")
    spark_target = arrow_target(schema)
    try:
        stream_schema: pa.Schema | None = flight.describe(
            location, name, timeout=timeout, **access.flight()
        ).schema
    except RemoteError:
        if int(status["head"]) > 0:
            raise
        stream_schema = None  # nothing appended and no schema declared: the first append sets it
    if stream_schema is None:
        return spark_target
    if sorted(stream_schema.names) != sorted(spark_target.names):
        raise DissocError(
            f"live stream {name!r} at {location} has columns ({', '.join(stream_schema.names)}); this query "
            f"writes ({', '.join(spark_target.names)}): select the stream's columns, by name"
        )
    return stream_schema


class DissocStreamWriter(DataSourceStreamArrowWriter):
    """Appends each micro-batch to a live stream exactly once (see the module docstring)."""

    def __init__(
        self,
        location: str,
        name: str,
        target: pa.Schema,
        *,
        fallback_producer: str | None,
        timeout: float = 30.0,
        cleanup_grace: float = DEFAULT_CLEANUP_GRACE,
        access: Access = PLAIN,
    ) -> None:
        self.location = location
        self.name = name
        self.target = target
        #: Who this query is when a task cannot tell its query id (from the checkpoint location).
        self.fallback_producer = fallback_producer
        self.timeout = timeout
        self.cleanup_grace = cleanup_grace
        self.access = access

    def _query(self, context: TaskContext) -> str:
        query = context.getLocalProperty(QUERY_ID_PROPERTY)
        if query:
            return str(query)
        if self.fallback_producer:
            return self.fallback_producer
        raise DissocError(
            "the dissoc streaming sink cannot tell which streaming query this task belongs to (no "
            f"{QUERY_ID_PROPERTY} local property and no checkpointLocation option)"
        )

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        """Stage this task's partition of the micro-batch and report it (runs in a task)."""
        from dissoc import flight

        context = TaskContext.get()
        if context is None:
            raise DissocError("DissocStreamWriter.write must run in a Spark task")
        query = self._query(context)
        raw_batch = context.getLocalProperty(BATCH_ID_PROPERTY)
        if raw_batch is None or not str(raw_batch).isdigit():
            raise DissocError(
                f"the dissoc streaming sink found no micro-batch id ({BATCH_ID_PROPERTY}) in its task"
            )
        batch_id = int(raw_batch)
        partition, attempt = context.partitionId(), context.attemptNumber()
        conform = Conformer(self.target)
        # gathered before anything is sent: a task failing upstream stages nothing
        batches = [conform(b) for b in iterator if b.num_rows]
        rows = sum(b.num_rows for b in batches)
        if not rows:
            return StreamCommitMessage(StagedPart(query, batch_id, partition, attempt, None, 0))
        # a random tail: a restarted query's attempts never collide with a dead run's leftovers
        ticket = f"{stage_prefix(self.name, query, batch_id)}{partition:05d}.{attempt}-{uuid.uuid4().hex[:8]}"
        table = pa.Table.from_batches(batches, schema=self.target)
        try:
            flight.publish(self.location, ticket, table, timeout=None, **self.access.flight())
        except BaseException:
            remove_quietly(self.location, ticket, self.access)  # the upload may have landed
            raise
        log.info(
            "micro-batch %d partition %d (attempt %d): staged %d rows as %r",
            batch_id,
            partition,
            attempt,
            rows,
            ticket,
        )
        return StreamCommitMessage(StagedPart(query, batch_id, partition, attempt, ticket, rows))

    @staticmethod
    def _parts(messages: Sequence[WriterCommitMessage | None]) -> list[StagedPart]:
        return sorted(
            (m.part for m in messages if isinstance(m, StreamCommitMessage)), key=lambda p: p.partition
        )

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Append the micro-batch to the live stream at most once, then remove what was staged (driver)."""
        from dissoc import flight

        parts = self._parts(messages)
        if not parts:
            log.info("micro-batch %d: no task reported to the dissoc sink; nothing to append", batchId)
            return
        queries = {p.query for p in parts}
        if len(queries) != 1:
            raise DissocError(
                f"micro-batch {batchId}: commit messages from several queries {sorted(queries)}"
            )
        query = parts[0].query
        staged = [p for p in parts if p.ticket is not None]
        rows = sum(p.rows for p in staged)
        if staged:
            # The server appends the staged datasets itself: the micro-batch's data never cross the driver.
            ack = flight.append_staged(
                self.location,
                self.name,
                [p.ticket for p in staged if p.ticket is not None],
                producer=f"spark:{query}",
                sequence=batchId,
                **self.access.flight(),
            )
            if ack.get("duplicate"):
                log.info(
                    "micro-batch %d of query %s was appended to %r before (a replay): skipped",
                    batchId,
                    query,
                    self.name,
                )
            else:
                log.info(
                    "micro-batch %d of query %s: %d rows appended to %r at offsets %s..%s",
                    batchId,
                    query,
                    rows,
                    self.name,
                    ack.get("first"),
                    ack.get("head", 0) - 1,
                )
        swept = self._sweep(query, batchId)
        log.debug("micro-batch %d: removed %d staged dataset(s)", batchId, swept)

    def _sweep(self, query: str, through: int) -> int:
        """Remove what this query staged for micro-batches up to ``through`` (committed, failed, speculative
        or late attempts alike); how many were removed."""
        prefix = stage_prefix(self.name, query)
        removed = 0
        for ticket in served_with_prefix(self.location, prefix, self.access):
            batch_text = ticket[len(prefix) :].partition("/")[0]
            if batch_text.isdigit() and int(batch_text) <= through:
                remove_quietly(self.location, ticket, self.access)
                removed += 1
        return removed

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Remove what this micro-batch staged, again after ``cleanup_grace`` seconds (driver)."""
        parts = self._parts(messages)
        for part in parts:
            if part.ticket is not None:
                remove_quietly(self.location, part.ticket, self.access)
        # (a batch whose every task failed names no query: its leftovers go with the query's next commit)
        queries = {p.query for p in parts}
        try:
            for query in queries:
                self._sweep_batch(query, batchId)
            if queries and self.cleanup_grace > 0:
                time.sleep(self.cleanup_grace)  # tasks being killed may still stage meanwhile
                for query in queries:
                    self._sweep_batch(query, batchId)
        except DissocError as e:
            log.warning("micro-batch %d: cleaning up after the abort failed: %s", batchId, e)
        log.info("micro-batch %d aborted: nothing appended to %r", batchId, self.name)

    def _sweep_batch(self, query: str, batch: int) -> None:
        prefix = stage_prefix(self.name, query, batch)
        for ticket in served_with_prefix(self.location, prefix, self.access):
            remove_quietly(self.location, ticket, self.access)


def checkpoint_producer(checkpoint: str | None) -> str | None:
    """A stable stand-in for the query id, from the checkpoint location (None without one)."""
    if not checkpoint:
        return None
    return "checkpoint-" + hashlib.sha256(checkpoint.encode("utf-8")).hexdigest()[:24]
