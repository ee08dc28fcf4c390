"""The ``dissoc`` Spark data source: reader and writer classes (imported once pyspark is known present).

See :mod:`dissoc.spark` for how to use it. Where each method runs matters:

* ``DissocDataSource.schema()`` and ``.reader()``/``.writer()`` run on the driver's machine, in Python
  worker processes that Spark starts for planning (not in the driver's own Python process); what
  ``schema()`` stores on the instance (the resolved endpoints) travels on to ``reader()``, because Spark
  pickles the instance after calling it.
* ``DissocReader.read()`` and ``DissocWriter.write()`` run in executor Python workers, one call per task.
* ``DissocWriter.commit()``/``.abort()`` run on the driver's machine in a Python worker, once per job.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator, MutableMapping, Sequence

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from dissoc.errors import DissocError
from dissoc.spark._manifest import (
    PLAIN,
    Access,
    WrittenPart,
    decode_manifest,
    describe_manifest,
    encode_manifest,
    is_manifest,
    job_prefix,
    manifest_data_schema,
    manifest_jobs,
    part_ticket,
    read_manifest,
    remove_quietly,
    served_with_prefix,
)
from dissoc.spark._streaming import (
    DissocStreamReader,
    DissocStreamWriter,
    checkpoint_producer,
    live_target,
    parse_starting_offsets,
)
from dissoc.spark._types import Conformer, arrow_target, spark_schema

__all__ = [
    "DissocCommitMessage",
    "DissocDataSource",
    "DissocPartition",
    "DissocReader",
    "DissocWriter",
    "Endpoint",
]

log = logging.getLogger(__name__)

#: (metadata URI, data URI, ticket): one stream, one Spark partition.
Endpoint = tuple[str, str, bytes]

DEFAULT_WRITE_NAME = "spark"
#: Seconds an aborted job waits before looking again for datasets its killed tasks published late. Spark
#: kills a task's Python worker spark.python.task.killTimeout (2 s) after interrupting it.
DEFAULT_CLEANUP_GRACE = 3.0


def _truthy(value: str | None, default: bool) -> bool:
    if value is None:
        return default
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise DissocError(f"expected a boolean option (true/false), got {value!r}")


def parse_endpoints(text: str) -> list[Endpoint]:
    """The ``endpoints`` option: JSON ``[[uri, data_uri, ticket], ...]`` (``data_uri`` may be null)."""
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise DissocError(f"option endpoints: expected JSON [[uri, data_uri, ticket], ...]: {e}") from None
    if not isinstance(raw, list) or not raw:
        raise DissocError(
            f"option endpoints: expected a non-empty JSON list of [uri, data_uri, ticket], got {text!r}"
        )
    endpoints: list[Endpoint] = []
    for i, item in enumerate(raw):
        if isinstance(item, dict):
            item = [item.get("uri"), item.get("data_uri"), item.get("ticket")]
        if not isinstance(item, list) or len(item) != 3:
            raise DissocError(f"option endpoints: entry {i} should be [uri, data_uri, ticket], got {item!r}")
        uri, data_uri, ticket = item
        if not isinstance(uri, str) or not isinstance(ticket, str) or not isinstance(data_uri, str | None):
            raise DissocError(
                f"option endpoints: entry {i} should hold strings (data_uri may be null), got {item!r}"
            )
        endpoints.append((uri, data_uri or uri, ticket.encode("utf-8")))
    return endpoints


def _stream_schema(endpoint: Endpoint, timeout: float, access: Access = PLAIN) -> pa.Schema:
    """The schema of one stream: open it, read the schema message, hang up."""
    from dissoc.client import open_stream

    uri, data_uri, ticket = endpoint
    options = access.options(timeout=timeout)
    with open_stream(uri, ticket, data_uri=data_uri, options=options) as reader:
        return reader.schema


class DissocPartition(InputPartition):
    """One Spark input partition: one dissoc stream."""

    def __init__(self, index: int, uri: str, data_uri: str, ticket: bytes) -> None:
        super().__init__(index)
        self.uri = uri
        self.data_uri = data_uri
        self.ticket = ticket


class DissocDataSource(DataSource):
    """``spark.read.format("dissoc")`` / ``df.write.format("dissoc")`` (options: see :mod:`dissoc.spark`)."""

    def __init__(self, options: MutableMapping[str, str]) -> None:
        super().__init__(options)
        self._endpoints: list[Endpoint] | None = None
        self._arrow_schema: pa.Schema | None = None

    @classmethod
    def name(cls) -> str:
        """The format name: ``spark.read.format("dissoc")``."""
        return "dissoc"

    # -- options

    def _option(self, key: str) -> str | None:
        value = self.options.get(key)
        return None if value is None else str(value)

    def _seconds(self, key: str, default: float) -> float:
        text = self._option(key)
        try:
            value = default if text is None else float(text)
        except ValueError:
            raise DissocError(f"option {key}: expected seconds, got {text!r}") from None
        if value < 0:
            raise DissocError(f"option {key}: expected seconds >= 0, got {text!r}")
        return value

    @property
    def _timeout(self) -> float:
        return self._seconds("timeout", 30.0)

    def _dataset_name(self) -> str | None:
        return self._option("path") or self._option("name")

    @property
    def _access(self) -> Access:
        """The ``token`` option (a signed ticket, :mod:`dissoc.tokens`, for servers with a secret) and the
        ``tls_ca`` / ``tls_cert`` / ``tls_key`` options (PEM files, for ``tls://`` and ``grpc+tls://``)."""
        return Access(
            token=self._option("token") or None,
            tls_ca=self._option("tls_ca") or None,
            tls_cert=self._option("tls_cert") or None,
            tls_key=self._option("tls_key") or None,
        )

    # -- reading

    def _resolve(self) -> tuple[list[Endpoint], pa.Schema]:
        """The streams to read and their Arrow schema (driver side)."""
        if self._endpoints is not None and self._arrow_schema is not None:
            return self._endpoints, self._arrow_schema
        listed = self._option("endpoints")
        location = self._option("location")
        if listed is not None:
            endpoints = parse_endpoints(listed)
            schema = _stream_schema(endpoints[0], self._timeout, self._access)
        elif location is not None:
            name = self._dataset_name()
            if not name:
                raise DissocError(
                    'reading from a Flight location needs a dataset name: .option("location", ...).load(NAME)'
                )
            endpoints, schema = _resolve_location(location, name, self._timeout, self._access)
        else:
            raise DissocError(
                'the dissoc data source needs .option("location", "grpc://HOST:PORT") with .load(NAME), or '
                '.option("endpoints", json.dumps([[uri, data_uri, ticket], ...]))'
            )
        log.info("dissoc source: %d stream(s), schema %s", len(endpoints), schema)
        self._endpoints, self._arrow_schema = endpoints, schema
        return endpoints, schema

    def schema(self) -> StructType:
        """Spark's schema for the data: resolved on the driver (see :func:`dissoc.spark.spark_schema`)."""
        _, schema = self._resolve()
        return spark_schema(schema)

    def reader(self, schema: StructType) -> DissocReader:
        """A reader with one partition per stream, casting batches to ``schema``'s Arrow form."""
        endpoints, _ = self._resolve()
        return DissocReader(
            endpoints,
            schema,
            timeout=self._timeout,
            validate=_truthy(self._option("validate"), True),
            access=self._access,
        )

    # -- writing

    def writer(self, schema: StructType, overwrite: bool) -> DissocWriter:
        """A writer for a new job (checked first: the server is reachable, ``name`` is free or a manifest)."""
        location = self._option("location")
        if location is None:
            raise DissocError(
                'writing needs .option("location", "grpc://HOST:PORT"): a dissoc server with a Flight '
                "control plane (dissoc serve --flight PORT)"
            )
        name = self._dataset_name() or DEFAULT_WRITE_NAME
        target = arrow_target(schema)
        # fails if `name` is a plain dataset
        found = describe_manifest(location, name, timeout=self._timeout, access=self._access)
        if found is not None and not overwrite:
            old_schema = manifest_data_schema(found)
            if not old_schema.equals(target):
                raise DissocError(
                    f"appending to {name!r} at {location}: its data have schema ({old_schema}), this write's "
                    f"is ({target}); use mode('overwrite') or another name"
                )
        job = uuid.uuid4().hex[:16]
        log.info("dissoc write job %s: %r at %s (overwrite=%s)", job, name, location, overwrite)
        return DissocWriter(
            location,
            name,
            job,
            schema,
            overwrite=overwrite,
            timeout=self._timeout,
            cleanup_grace=self._seconds("cleanupGrace", DEFAULT_CLEANUP_GRACE),
            access=self._access,
        )

    # -- Structured Streaming (dissoc.spark._streaming)

    def _count(self, key: str) -> int | None:
        text = self._option(key)
        if text is None:
            return None
        if not text.strip().isdigit() or int(text) < 1:
            raise DissocError(f"option {key}: expected a whole number >= 1, got {text!r}")
        return int(text)

    def _live_stream(self, what: str) -> tuple[str, str]:
        """(location, name) of the live stream a streaming query reads or appends to."""
        location = self._option("location")
        name = self._dataset_name()
        if location is None or not name:
            raise DissocError(
                f"{what} needs a dissoc server's Flight control plane and a live stream's name: "
                '.option("location", "grpc://HOST:PORT") and .load(NAME) / .start(NAME)'
            )
        return location, name

    def streamReader(self, schema: StructType) -> DissocStreamReader:
        """A reader of a live stream, micro-batch by micro-batch (driver; see :mod:`dissoc.spark`)."""
        location, name = self._live_stream("spark.readStream.format('dissoc')")
        if self._option("endpoints") is not None:
            raise DissocError("a streaming read takes a location and a live stream's name, not endpoints")
        return DissocStreamReader(
            location,
            name,
            schema,
            starting=parse_starting_offsets(self._option("startingOffsets")),
            timeout=self._timeout,
            validate=_truthy(self._option("validate"), True),
            access=self._access,
            max_batches_per_trigger=self._count("maxBatchesPerTrigger"),
            max_partitions=self._count("maxPartitions") or 1,
        )

    def streamWriter(self, schema: StructType, overwrite: bool) -> DissocStreamWriter:
        """A sink appending each micro-batch to a live stream exactly once (checked first: the stream is
        served, live, open, and has the query's columns)."""
        location, name = self._live_stream("df.writeStream.format('dissoc')")
        if overwrite:
            raise DissocError(
                f"live stream {name!r} is append-only: the complete output mode would append the whole "
                "result again every micro-batch; use outputMode('append') or outputMode('update')"
            )
        target = live_target(location, name, schema, self._timeout, self._access)
        return DissocStreamWriter(
            location,
            name,
            target,
            fallback_producer=checkpoint_producer(self._option("checkpointLocation")),
            timeout=self._timeout,
            cleanup_grace=self._seconds("cleanupGrace", DEFAULT_CLEANUP_GRACE),
            access=self._access,
        )


def _resolve_location(
    location: str, name: str, timeout: float, access: Access = PLAIN
) -> tuple[list[Endpoint], pa.Schema]:
    """Endpoints and schema of ``name`` at a Flight control plane; a write's manifest lists its partitions.

    With a token (a control plane with a secret), each listed partition is described too, for the signed
    ticket the control plane makes for it (the manifest holds plain names)."""
    from dissoc import flight

    info = flight.describe(location, name, timeout=timeout, **access.flight())
    if not is_manifest(info.schema):
        if not info.endpoints:
            raise DissocError(f"{name!r} at {location}: the control plane lists no endpoints")
        return list(info.endpoints), info.schema
    from dissoc.client import fetch

    options = access.options(flight_timeout=timeout)
    parts = decode_manifest(fetch(location, name, options=options))
    schema = manifest_data_schema(info.schema)
    if access.token is None:
        return [(p.uri, p.data_uri, p.ticket.encode("utf-8")) for p in parts], schema  # may be none: no rows
    endpoints: list[Endpoint] = []
    for p in parts:
        endpoints.extend(flight.resolve(location, p.ticket, timeout=timeout, **access.flight()))
    return endpoints, schema


class DissocReader(DataSourceReader):
    """Reads one dissoc stream per partition and yields batches cast to Spark's exact Arrow schema."""

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        schema: StructType,
        *,
        timeout: float,
        validate: bool,
        access: Access = PLAIN,
    ) -> None:
        self.endpoints = list(endpoints)
        self.schema = schema
        self.timeout = timeout
        self.validate = validate
        self.access = access

    def partitions(self) -> Sequence[InputPartition]:
        """One partition per stream (none: PySpark then reads one empty partition)."""
        return [DissocPartition(i, *ep) for i, ep in enumerate(self.endpoints)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The stream's batches, each cast to exactly the Arrow schema Spark expects (runs in a task)."""
        from dissoc.client import open_stream

        if not isinstance(partition, DissocPartition):  # PySpark's stand-in when there are no streams
            return
        conform = Conformer(arrow_target(self.schema))
        options = self.access.options(timeout=self.timeout, validate=self.validate)
        with open_stream(
            partition.uri, partition.ticket, data_uri=partition.data_uri, options=options
        ) as stream:
            for batch in stream:
                if batch.num_rows:
                    yield conform(batch)


# ------------------------------------------------------------------------------------------------- writing


class DissocCommitMessage(WriterCommitMessage):
    """What one successful write task reports to the driver: the partition it published."""

    def __init__(self, part: WrittenPart) -> None:
        self.part = part


class DissocWriter(DataSourceArrowWriter):
    """Publishes each partition to a dissoc server through its Flight control plane (:mod:`dissoc.spark`).

    Cleaning up after failed and speculative attempts: the committing driver publishes the manifest (which
    lists this job) *before* it looks for this job's datasets that no commit message names and removes them;
    a task checks the manifest *after* publishing and removes its own dataset when the job is already
    listed. Whichever comes last sees the other's work, so no attempt outlives a commit. An aborting driver
    removes the job's datasets, waits ``cleanup_grace`` seconds (Spark kills the Python workers of the
    job's remaining tasks within ``spark.python.task.killTimeout``, 2 s) and removes any that appeared since.
    """

    def __init__(
        self,
        location: str,
        name: str,
        job: str,
        schema: StructType,
        *,
        overwrite: bool,
        timeout: float,
        cleanup_grace: float = DEFAULT_CLEANUP_GRACE,
        access: Access = PLAIN,
    ) -> None:
        self.location = location
        self.name = name
        self.job = job
        self.schema = schema
        self.overwrite = overwrite
        self.timeout = timeout
        self.cleanup_grace = cleanup_grace
        #: The token (scope write, for NAME or ``*``, for a control plane with a secret) and TLS files.
        self.access = access

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        """Publish this task's partition as ``NAME/JOB/PPPPP.A`` and report it (runs in a task)."""
        from dissoc import flight

        context = TaskContext.get()
        if context is None:
            raise DissocError("DissocWriter.write must run in a Spark task")
        partition, attempt = context.partitionId(), context.attemptNumber()
        ticket = part_ticket(self.name, self.job, partition, attempt)
        target = arrow_target(self.schema)
        conform = Conformer(target)
        # The whole partition is gathered before anything is sent: a task that fails while producing its
        # rows (a failing UDF upstream) has published nothing.
        batches = [conform(b) for b in iterator]
        table = pa.Table.from_batches(batches, schema=target)
        try:
            flight.publish(self.location, ticket, table, timeout=None, **self.access.flight())
            (uri, data_uri, _), *_ = flight.resolve(
                self.location, ticket, timeout=self.timeout, **self.access.flight()
            )
            late = self._job_committed()
        except BaseException:
            # the upload may have landed before the failure
            remove_quietly(self.location, ticket, self.access)
            raise
        if late:
            log.info(
                "write job %s committed without %r (a late or speculative attempt): removing it",
                self.job,
                ticket,
            )
            remove_quietly(self.location, ticket, self.access)
        else:
            log.info(
                "published partition %d (attempt %d) as %r: %d rows", partition, attempt, ticket, len(table)
            )
        part = WrittenPart(self.job, partition, attempt, uri, data_uri, ticket, table.num_rows)
        return DissocCommitMessage(part)

    def _job_committed(self) -> bool:
        """Whether the manifest already lists this job (then this attempt is not part of it)."""
        schema = describe_manifest(self.location, self.name, timeout=self.timeout, access=self.access)
        return schema is not None and self.job in manifest_jobs(schema)

    def _parts(self, messages: Sequence[WriterCommitMessage | None]) -> list[WrittenPart]:
        return [m.part for m in messages if isinstance(m, DissocCommitMessage)]

    def _remove_strays(self, keep: set[str]) -> int:
        """Remove this job's datasets not in ``keep``; how many were removed."""
        prefix = job_prefix(self.name, self.job)
        strays = [t for t in served_with_prefix(self.location, prefix, self.access) if t not in keep]
        for ticket in strays:
            remove_quietly(self.location, ticket, self.access)
        return len(strays)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Publish the manifest listing this job's partitions, then remove every stray attempt (driver)."""
        from dissoc import flight

        parts = sorted(self._parts(messages), key=lambda p: p.partition)
        committed = {p.ticket for p in parts}
        found = read_manifest(self.location, self.name, access=self.access)
        old_parts, old_jobs = ([], []) if found is None else (found[0], found[2])
        kept, jobs = ([], []) if self.overwrite else (old_parts, old_jobs)
        manifest = encode_manifest(kept + parts, arrow_target(self.schema), [*jobs, self.job])
        flight.publish(
            self.location, self.name, manifest, replace=True, timeout=self.timeout, **self.access.flight()
        )
        # After the manifest names this job: failed or speculative attempts still served are removed here,
        # and attempts that publish from now on remove themselves.
        strays = self._remove_strays(committed)
        if self.overwrite:
            for p in old_parts:
                if p.ticket not in committed:
                    remove_quietly(self.location, p.ticket, self.access)
        log.info(
            "dissoc write job %s committed %d partition(s) under %r (%d stray attempt(s) removed)",
            self.job,
            len(parts),
            self.name,
            strays,
        )

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Remove everything this job published, again after ``cleanup_grace`` seconds (driver)."""
        import time

        removed = 0
        for ticket in sorted({p.ticket for p in self._parts(messages)}):
            remove_quietly(self.location, ticket, self.access)
            removed += 1
        try:
            removed += self._remove_strays(set())
            if self.cleanup_grace > 0:
                time.sleep(self.cleanup_grace)  # tasks being killed may still publish meanwhile
                removed += self._remove_strays(set())
        except DissocError as e:
            log.warning("dissoc write job %s: cleaning up after the abort failed: %s", self.job, e)
        log.info("dissoc write job %s aborted; removed %d dataset(s)", self.job, removed)
