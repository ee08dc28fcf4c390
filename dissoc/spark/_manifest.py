"""What a Spark write leaves on the server: one dataset per partition, and a manifest listing them.

A write job ``J`` under name ``N`` publishes partition ``P``'s attempt ``A`` as the dataset (ticket)
``N/J/PPPPP.A``. When the job commits, the driver publishes (or replaces) the dataset ``N`` itself with a
small *manifest* table, one row per committed partition of every job written under ``N`` (append mode keeps
earlier jobs' rows, overwrite mode drops them and removes their partitions)::

    job: string, partition: int32, attempt: int32, uri: string, data_uri: string, ticket: string, rows: int64

Its schema metadata marks it (``dissoc.spark.manifest``), carries the data's Arrow schema
(``dissoc.spark.schema``, an IPC-serialized schema, base64), so readers know the schema without opening a
partition, and lists the committed jobs (``dissoc.spark.jobs``, JSON), so that an attempt that finishes
after its job committed can tell, and remove what it published. Any dissoc client can fetch ``N`` and then
each listed ticket; ``spark.read.format("dissoc")`` given ``N`` reads the listed partitions; :func:`written`
and :func:`last_write` return the rows as :class:`WrittenPart` values. This module needs no pyspark.
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from dissoc.errors import DissocError, RemoteError

if TYPE_CHECKING:
    from dissoc.client import ClientOptions

__all__ = [
    "MANIFEST_KEY",
    "MANIFEST_SCHEMA",
    "JOBS_KEY",
    "SCHEMA_KEY",
    "WrittenPart",
    "decode_manifest",
    "encode_manifest",
    "is_manifest",
    "last_write",
    "part_ticket",
    "remove_quietly",
    "served_with_prefix",
    "written",
]

log = logging.getLogger(__name__)

MANIFEST_KEY = b"dissoc.spark.manifest"
SCHEMA_KEY = b"dissoc.spark.schema"
JOBS_KEY = b"dissoc.spark.jobs"
MANIFEST_VERSION = b"1"

MANIFEST_SCHEMA = pa.schema(
    [
        pa.field("job", pa.string(), nullable=False),
        pa.field("partition", pa.int32(), nullable=False),
        pa.field("attempt", pa.int32(), nullable=False),
        pa.field("uri", pa.string(), nullable=False),
        pa.field("data_uri", pa.string(), nullable=False),
        pa.field("ticket", pa.string(), nullable=False),
        pa.field("rows", pa.int64(), nullable=False),
    ]
)


@dataclass(frozen=True, slots=True)
class WrittenPart:
    """One committed partition of a Spark write: fetch it with ``dissoc.fetch(uri, ticket, data_uri=...)``."""

    job: str
    partition: int
    attempt: int
    uri: str
    data_uri: str
    ticket: str
    rows: int


def part_ticket(name: str, job: str, partition: int, attempt: int) -> str:
    """The ticket of one attempt of one partition of job ``job`` written under ``name``."""
    return f"{job_prefix(name, job)}{partition:05d}.{attempt}"


def job_prefix(name: str, job: str) -> str:
    """The prefix of every ticket job ``job`` publishes under ``name``."""
    return f"{name}/{job}/"


def is_manifest(schema: pa.Schema) -> bool:
    """Whether ``schema`` is a manifest's (its metadata carries the marker)."""
    return MANIFEST_KEY in (schema.metadata or {})


def encode_manifest(parts: list[WrittenPart], data_schema: pa.Schema, jobs: list[str]) -> pa.Table:
    """The manifest table listing ``parts``, whose data have schema ``data_schema``, of committed ``jobs``."""
    columns = {
        "job": [p.job for p in parts],
        "partition": [p.partition for p in parts],
        "attempt": [p.attempt for p in parts],
        "uri": [p.uri for p in parts],
        "data_uri": [p.data_uri for p in parts],
        "ticket": [p.ticket for p in parts],
        "rows": [p.rows for p in parts],
    }
    metadata = {
        MANIFEST_KEY: MANIFEST_VERSION,
        SCHEMA_KEY: base64.b64encode(data_schema.serialize().to_pybytes()),
        JOBS_KEY: json.dumps(jobs).encode(),
    }
    return pa.Table.from_pydict(columns, schema=MANIFEST_SCHEMA.with_metadata(metadata))


def manifest_data_schema(schema: pa.Schema) -> pa.Schema:
    """The data's Arrow schema recorded in a manifest's schema metadata."""
    raw = (schema.metadata or {}).get(SCHEMA_KEY)
    if raw is None:
        raise DissocError("the manifest records no data schema (metadata key dissoc.spark.schema)")
    try:
        return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(raw)))
    except (ValueError, pa.ArrowException) as e:
        raise DissocError(f"the manifest's data schema is unreadable: {e}") from None


def manifest_jobs(schema: pa.Schema) -> list[str]:
    """The committed jobs a manifest's schema metadata lists (oldest first)."""
    raw = (schema.metadata or {}).get(JOBS_KEY)
    try:
        jobs = json.loads(raw) if raw is not None else []
    except ValueError:
        raise DissocError("the manifest's job list (metadata key dissoc.spark.jobs) is not JSON") from None
    if not isinstance(jobs, list) or not all(isinstance(j, str) for j in jobs):
        raise DissocError(f"the manifest's job list should be a JSON list of strings, got {raw!r}")
    return jobs


def decode_manifest(table: pa.Table) -> list[WrittenPart]:
    """The parts a manifest table lists, in its order."""
    missing = [n for n in MANIFEST_SCHEMA.names if n not in table.column_names]
    if missing:
        raise DissocError(f"not a dissoc Spark manifest: columns {missing} are missing")
    rows = table.select(MANIFEST_SCHEMA.names).to_pylist()
    return [WrittenPart(**row) for row in rows]


@dataclass(frozen=True)
class Access:
    """How the data source reaches servers that guard themselves: the bearer token (a signed ticket,
    :mod:`dissoc.tokens`) and the TLS files (PEM paths on every executor: the CA bundle, and this client's
    certificate and key for servers that require one). Sent to the executors with the reader and writer."""

    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def flight(self) -> dict[str, Any]:
        """Keyword arguments for the :mod:`dissoc.flight` calls."""
        return {
            "token": self.token,
            "tls_ca": self.tls_ca,
            "tls_cert": self.tls_cert,
            "tls_key": self.tls_key,
        }

    def options(self, **limits: Any) -> ClientOptions:
        """:class:`dissoc.client.ClientOptions` with these credentials and ``limits``."""
        from dissoc.client import ClientOptions

        return ClientOptions(
            token=self.token, tls_ca=self.tls_ca, tls_cert=self.tls_cert, tls_key=self.tls_key, **limits
        )


#: No token, no TLS files (plain servers, or TLS with the system's roots).
PLAIN = Access()


def describe_manifest(
    location: str, name: str, *, timeout: float | None = None, access: Access = PLAIN
) -> pa.Schema | None:
    """The schema of the manifest served as ``name`` (its metadata says the rest); None when nothing is.

    Raises DissocError when ``name`` is served but is not a manifest.
    """
    from dissoc import flight

    try:
        wait = flight.DEFAULT_TIMEOUT if timeout is None else timeout
        info = flight.describe(location, name, timeout=wait, **access.flight())
    except RemoteError as e:
        if e.code == "unknown_ticket":
            return None
        raise
    if not is_manifest(info.schema):
        raise DissocError(
            f"{name!r} at {location} is a plain dataset, not the manifest of a Spark write; "
            "choose another name to write under"
        )
    return info.schema


def read_manifest(
    location: str, name: str, *, access: Access = PLAIN
) -> tuple[list[WrittenPart], pa.Schema, list[str]] | None:
    """``(parts, data schema, jobs)`` of the manifest served as ``name``; None when nothing is served.

    Raises DissocError when ``name`` is served but is not a manifest.
    """
    from dissoc.client import fetch

    schema = describe_manifest(location, name, access=access)
    if schema is None:
        return None
    table = fetch(location, name, options=access.options())
    return decode_manifest(table), manifest_data_schema(schema), manifest_jobs(schema)


def written(location: str, name: str, *, access: Access = PLAIN) -> list[WrittenPart]:
    """Every committed partition written under ``name`` at the Flight control plane ``location``.

    In commit order (jobs in the order they committed, partitions in partition order); empty when nothing
    was written under ``name``. ``access``: the token and TLS files for a guarded control plane.
    """
    found = read_manifest(location, name, access=access)
    return [] if found is None else found[0]


def last_write(location: str, name: str, *, access: Access = PLAIN) -> list[WrittenPart]:
    """The committed partitions of the most recent job written under ``name`` (empty if none). ``access``:
    the token and TLS files for a guarded control plane."""
    parts = written(location, name, access=access)
    if not parts:
        return []
    job = parts[-1].job
    return [p for p in parts if p.job == job]


def remove_quietly(location: str, ticket: str, access: Access = PLAIN) -> None:
    """Remove ``ticket`` from the server; an unknown ticket (or an unreachable server) is only logged."""
    from dissoc import flight

    try:
        flight.remove(location, ticket, **access.flight())
        log.info("removed %r at %s", ticket, location)
    except RemoteError as e:
        if e.code != "unknown_ticket":
            log.warning("could not remove %r at %s: %s", ticket, location, e)
    except DissocError as e:
        log.warning("could not remove %r at %s: %s", ticket, location, e)


def served_with_prefix(location: str, prefix: str, access: Access = PLAIN) -> list[str]:
    """The names served at ``location`` that start with ``prefix``."""
    from dissoc import flight

    listed = flight.list_datasets(location, **access.flight())
    return [info.name for info in listed if info.name.startswith(prefix)]
