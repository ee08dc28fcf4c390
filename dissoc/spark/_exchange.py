"""Executor-to-executor exchange inside a Spark barrier stage (see :func:`dissoc.spark.exchange`).

Every task of the stage: splits its rows into one bucket per task, serves the buckets from a dissoc
server of its own (on a thread with its own event loop), swaps server URIs with the other tasks through
``BarrierTaskContext.allGather``, fetches the buckets meant for it from every peer, then waits at a barrier
(so no server stops while a peer still reads from it) and shuts its server down. A server therefore lives
exactly as long as the barrier stage, which also keeps it clear of Python workers dying when idle.

No outside process can read a stage's buckets: each task's server is started with a random secret of its own
(:class:`dissoc.tokens.Secret`, made for this stage and never written anywhere), and serves only signed
tickets made with it. The task mints one ticket per peer (for that peer's bucket only) and shares them with
the URIs through ``allGather``, which travels over Spark's own channel (protected by ``spark.authenticate``
where it is on); the secret itself never leaves the task, and dies with the stage's server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from dissoc.errors import DissocError
from dissoc.tokens import Secret

__all__ = ["Partitioner", "exchange", "hash_partition"]

log = logging.getLogger(__name__)

Partitioner: TypeAlias = Callable[[pa.RecordBatch, int], npt.ArrayLike]
"""``f(batch, n)`` -> one destination task index in ``[0, n)`` per row of ``batch`` (integers, as a numpy
array or anything ``numpy.asarray`` takes)."""

#: What :func:`exchange` takes: this task's rows.
ExchangeData: TypeAlias = "Iterable[pa.RecordBatch | pa.Table] | pa.Table | pa.RecordBatch"

#: How long the tickets a task hands its peers stay valid: its server and its secret end with the stage, and
#: a peer may reach allGather long after this task did.
_TICKET_TTL = 24 * 3600

HOST_ENV = "DISSOC_SPARK_HOST"
"""Environment variable naming the address exchange servers bind to and advertise (overrides the default)."""

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_NULL_HASH = np.uint64(0x9E3779B97F4A7C15)


def _mix(h: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser: every input bit affects every output bit."""
    with np.errstate(over="ignore"):
        h = h ^ (h >> np.uint64(30))
        h = h * _M1
        h = h ^ (h >> np.uint64(27))
        h = h * _M2
        return h ^ (h >> np.uint64(31))


def _column_hash(column: pa.Array) -> npt.NDArray[np.uint64]:
    """A 64-bit hash per value, equal in every process (no per-process seed), nulls all alike."""
    t = column.type
    if pa.types.is_dictionary(t):
        column = column.dictionary_decode()
        t = column.type
    values: npt.NDArray[np.uint64]
    if pa.types.is_integer(t) or pa.types.is_temporal(t) or pa.types.is_boolean(t):
        if not pa.types.is_integer(t):
            column = column.cast(pa.int64()) if not pa.types.is_boolean(t) else column.cast(pa.int8())
        filled = column.fill_null(0) if column.null_count else column
        values = _mix(np.asarray(filled.to_numpy(zero_copy_only=False)).astype(np.int64).view(np.uint64))
    elif pa.types.is_floating(t):
        filled = column.cast(pa.float64())
        filled = filled.fill_null(0.0) if filled.null_count else filled
        floats = np.asarray(filled.to_numpy(zero_copy_only=False), dtype=np.float64) + 0.0  # -0.0 == 0.0
        values = _mix(floats.view(np.uint64))
    else:
        # Everything else (strings, binaries, decimals, nested): hash each distinct value's bytes once.
        encoded = pc.dictionary_encode(column) if _encodable(t) else None
        if encoded is not None:
            distinct = encoded.dictionary.to_pylist()
            indices = encoded.indices.fill_null(0).to_numpy(zero_copy_only=False)
        else:
            distinct = column.to_pylist()
            indices = np.arange(len(column))
        table = np.fromiter(
            (zlib.crc32(v if isinstance(v, bytes) else repr(v).encode()) for v in distinct),
            dtype=np.uint64,
            count=len(distinct),
        )
        values = _mix(table[indices] if len(distinct) else np.zeros(len(column), np.uint64))
    if column.null_count:
        values = np.where(np.asarray(column.is_null().to_numpy(zero_copy_only=False)), _NULL_HASH, values)
    return values


def _encodable(t: pa.DataType) -> bool:
    return bool(
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or pa.types.is_decimal(t)
    )


def hash_partition(batch: pa.RecordBatch, key: str | Sequence[str], n: int) -> npt.NDArray[np.int64]:
    """Destination task per row: a hash of the ``key`` column(s) modulo ``n``, the same in every process.

    Rows with equal keys always go to the same task, in every task of the stage.
    """
    if n <= 0:
        raise DissocError(f"hash_partition: the number of tasks must be positive, got {n}")
    keys = [key] if isinstance(key, str) else list(key)
    if not keys:
        raise DissocError("hash_partition: expected at least one key column")
    h = np.zeros(batch.num_rows, dtype=np.uint64)
    for name in keys:
        if name not in batch.schema.names:
            raise DissocError(
                f"hash_partition: no column {name!r} (columns: {', '.join(batch.schema.names)})"
            )
        with np.errstate(over="ignore"):
            h = _mix(h * np.uint64(31) + _column_hash(batch.column(name)))
    return (h % np.uint64(n)).astype(np.int64)


def _split(batch: pa.RecordBatch, destinations: npt.ArrayLike, n: int) -> list[pa.RecordBatch]:
    """``batch``'s rows grouped by destination (one take, then zero-copy slices); order kept within each."""
    dest = np.asarray(destinations, dtype=np.int64)
    if dest.shape != (batch.num_rows,):
        raise DissocError(f"the partitioner returned {dest.shape} destinations for {batch.num_rows} rows")
    if batch.num_rows and (dest.min() < 0 or dest.max() >= n):
        raise DissocError(f"the partitioner returned destinations outside [0, {n})")
    order = np.argsort(dest, kind="stable")
    counts = np.bincount(dest, minlength=n)
    ordered = batch.take(pa.array(order))
    out, start = [], 0
    for count in counts.tolist():
        out.append(ordered.slice(start, count))
        start += count
    return out


class _ServerThread:
    """A dissoc Server on its own loop in a daemon thread (the task's main thread blocks in barriers)."""

    def __init__(self, datasets: dict[str, pa.Table], host: str, port: int, secret: Secret) -> None:
        self._datasets = datasets
        self._secret = secret
        self._host = host
        self._port = port
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.uri = ""
        self.data_uri = ""
        self._thread = threading.Thread(target=self._run, name="dissoc-exchange-server", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            from dissoc.server import Server

            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            server = Server(self._datasets, host=self._host, port=self._port, secret=self._secret)
            async with server:
                self.uri, self.data_uri = server.uri, server.data_uri
                self._ready.set()
                await self._stop.wait()

        try:
            asyncio.run(main())
        except BaseException as e:
            self._error = e
        finally:
            self._ready.set()

    def start(self, timeout: float) -> None:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise DissocError(f"the exchange server did not start within {timeout} s")
        if self._error is not None:
            raise DissocError(
                f"the exchange server could not start on {self._host}:{self._port}: {self._error}"
            )

    def stop(self, timeout: float) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(stop.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the exchange server did not stop within %s s", timeout)


def _task_host(address: str) -> str:
    """The host part of a BarrierTaskInfo address (``host:port``, IPv6 possibly in brackets)."""
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 or address.startswith("[") else address
    return host.strip("[]")


def _bind_host(host: str | None, addresses: list[str], me: int) -> str:
    """Where this task's server listens (and what peers connect to).

    ``host`` if given, else ``$DISSOC_SPARK_HOST``, else 127.0.0.1 when every task of the stage runs on one
    host (local mode, one executor), else this task's executor host as Spark knows it.
    """
    if host:
        return host
    env = os.environ.get(HOST_ENV)
    if env:
        return env
    hosts = {_task_host(a) for a in addresses}
    if len(hosts) <= 1:
        return "127.0.0.1"
    return _task_host(addresses[me]) or "127.0.0.1"


def _as_batches(data: ExchangeData) -> Iterator[pa.RecordBatch]:
    if isinstance(data, pa.Table):
        yield from data.to_batches()
        return
    if isinstance(data, pa.RecordBatch):
        yield data
        return
    for item in data:
        if isinstance(item, pa.RecordBatch):
            yield item
        elif isinstance(item, pa.Table):
            yield from item.to_batches()
        else:
            raise DissocError(
                f"exchange: expected pyarrow RecordBatches or Tables, got a {type(item).__name__} (use "
                "df.mapInArrow(..., barrier=True), or yield batches from an RDD)"
            )


def exchange(
    data: ExchangeData,
    *,
    key: str | Sequence[str] | None = None,
    partitioner: Partitioner | None = None,
    schema: pa.Schema | None = None,
    host: str | None = None,
    port: int = 0,
    timeout: float = 60.0,
) -> Iterator[pa.RecordBatch]:
    """Swap rows between the tasks of a Spark barrier stage over dissoc (see :mod:`dissoc.spark`)."""
    from pyspark import BarrierTaskContext

    from dissoc.client import ClientOptions, fetch_async

    try:
        context = BarrierTaskContext.get()
    except Exception as e:  # PySpark raises its own errors outside a barrier stage
        raise DissocError(
            "dissoc.spark.exchange must run in a barrier stage: rdd.barrier().mapPartitions(...) or "
            f"df.mapInArrow(..., barrier=True) ({e})"
        ) from None
    if key is not None and partitioner is not None:
        raise DissocError("exchange: give key or partitioner, not both")
    addresses = [info.address for info in context.getTaskInfos()]
    n, me = len(addresses), context.partitionId()

    batches = list(_as_batches(data))
    if schema is None and batches:
        schema = batches[0].schema
    buckets: list[list[pa.RecordBatch]] = [[] for _ in range(n)]
    for batch in batches:
        if schema is not None and not batch.schema.equals(schema):
            batch = pa.RecordBatch.from_arrays(batch.columns, schema=schema)
        if key is None and partitioner is None:
            for j in range(n):  # no key: every task gets every row
                buckets[j].append(batch)
            continue
        dest: npt.ArrayLike
        if key is not None:
            dest = hash_partition(batch, key, n)
        else:
            assert partitioner is not None
            dest = partitioner(batch, n)
        for j, part in enumerate(_split(batch, dest, n)):
            if part.num_rows:
                buckets[j].append(part)

    datasets: dict[str, pa.Table] = {}
    if schema is not None:
        datasets = {f"to-{j}": pa.Table.from_batches(buckets[j], schema=schema) for j in range(n) if j != me}
    bind = _bind_host(host, addresses, me)
    secret = Secret.generate()  # this task's, for this stage only
    server = _ServerThread(datasets, bind, port, secret)
    server.start(timeout)
    try:
        # Peer j gets a ticket for its own bucket only.
        tickets = {str(j): secret.mint(f"to-{j}", ttl=_TICKET_TTL) for j in range(n) if j != me}
        mine = json.dumps(
            {"uri": server.uri, "data_uri": server.data_uri, "serves": schema is not None, "tickets": tickets}
        )
        log.info("exchange task %d/%d serving at %s", me, n, server.uri)
        peers = [json.loads(m) for m in context.allGather(mine)]
        options = ClientOptions(timeout=timeout)

        async def fetch_all() -> list[pa.Table]:
            coros = [
                fetch_async(p["uri"], p["tickets"][str(me)], data_uri=p["data_uri"], options=options)
                for j, p in enumerate(peers)
                if j != me and p["serves"]
            ]
            return list(await asyncio.gather(*coros))

        received = iter(asyncio.run(fetch_all()))
        out: list[pa.RecordBatch] = []
        for j, p in enumerate(peers):
            if j == me:
                out.extend(buckets[me])
            elif p["serves"]:
                out.extend(b for b in next(received).to_batches() if b.num_rows)
        # Nobody shuts down while a peer may still be reading from it.
        context.barrier()
    finally:
        server.stop(timeout)
    log.info("exchange task %d/%d received %d rows", me, n, sum(b.num_rows for b in out))
    return iter(out)
