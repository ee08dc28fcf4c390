"""Executor-to-executor exchange inside a Spark barrier stage (see :func:`dissoc.spark.exchange`).

Every task of the stage: splits its rows into one bucket per task as Spark hands them over (on the device
for device batches where it can), starts the servers its peers may choose a path to (:mod:`._paths`:
pairs read in place on one node, UCX or TCP elsewhere; each server on a thread with its own event loop),
swaps what it can do, its servers' URIs and its tickets with the other tasks in one round
(:mod:`._rendezvous`: files in ``/dev/shm`` on one host, ``BarrierTaskContext.allGather`` otherwise),
fetches the buckets meant for it from every peer along the path both choose, tells each peer it is done,
and shuts its servers down once every peer has told it the same. A server therefore lives no longer than the
barrier stage, which also keeps it clear of Python workers dying when idle.

No outside process can read a stage's buckets: each task's servers are started with a random secret of its
own (:class:`dissoc.tokens.Secret`, made for this stage and never written anywhere), and serve only signed
tickets made with it. The task mints two tickets per peer (that peer's bucket, and its done request) and
shares them through the rendezvous (``allGather`` travels over Spark's own channel, protected by
``spark.authenticate`` where it is on; files are readable by the executors' user only); the secret itself
never leaves the task, and dies with the stage's servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from dissoc.datasets.base import Dataset
from dissoc.errors import DissocError
from dissoc.hashing import column_hash, destination_order, destinations, row_hash
from dissoc.spark._paths import (
    BODIES,
    LANDINGS,
    MEMORIES,
    TRANSPORTS,
    Capabilities,
    Path,
    PeerReport,
    check_choice,
    choose,
)
from dissoc.spark._rendezvous import FileRendezvous, rendezvous_kind
from dissoc.tokens import Secret

__all__ = ["ExchangeResult", "Partitioner", "exchange", "hash_partition"]

log = logging.getLogger(__name__)

Partitioner: TypeAlias = Callable[[pa.RecordBatch, int], npt.ArrayLike]
"""``f(batch, n)`` -> one destination task index in ``[0, n)`` per row of ``batch`` (integers, as a numpy
array or anything ``numpy.asarray`` takes)."""

#: What :func:`exchange` takes: this task's rows.
ExchangeData: TypeAlias = "Iterable[Any] | pa.Table | pa.RecordBatch | Any"

#: How long the tickets a task hands its peers stay valid: its server and its secret end with the stage, and
#: a peer may reach allGather long after this task did.
_TICKET_TTL = 24 * 3600

RENDEZVOUS_ENV = "DISSOC_SPARK_RENDEZVOUS"
"""Environment variable with the default ``rendezvous`` (``auto``, ``allgather`` or ``files``): set it alike
on every executor."""

#: Exchanges made so far by the task this worker runs (the file rendezvous names each call).
_calls: dict[int, itertools.count[int]] = {}

HOST_ENV = "DISSOC_SPARK_HOST"
"""Environment variable naming the address exchange servers bind to and advertise (overrides the default)."""


def hash_partition(batch: pa.RecordBatch, key: str | Sequence[str], n: int) -> npt.NDArray[np.int64]:
    """Destination task per row: a hash of the ``key`` column(s) modulo ``n``, the same in every process.

    Rows with equal keys always go to the same task, in every task of the stage.
    """
    if n <= 0:
        raise DissocError(f"hash_partition: the number of tasks must be positive, got {n}")
    keys = [key] if isinstance(key, str) else list(key)
    if not keys:
        raise DissocError("hash_partition: expected at least one key column")
    hashes = []
    for name in keys:
        if name not in batch.schema.names:
            raise DissocError(
                f"hash_partition: no column {name!r} (columns: {', '.join(batch.schema.names)})"
            )
        hashes.append(column_hash(batch.column(name)))
    return np.asarray(destinations(row_hash(hashes, batch.num_rows), n), dtype=np.int64)


def _split(batch: pa.RecordBatch, destinations: npt.ArrayLike, n: int) -> list[pa.RecordBatch]:
    """``batch``'s rows grouped by destination (one take, then zero-copy slices); order kept within each."""
    dest = np.asarray(destinations, dtype=np.int64)
    if dest.shape != (batch.num_rows,):
        raise DissocError(f"the partitioner returned {dest.shape} destinations for {batch.num_rows} rows")
    if batch.num_rows and (dest.min() < 0 or dest.max() >= n):
        raise DissocError(f"the partitioner returned destinations outside [0, {n})")
    counts = np.bincount(dest, minlength=n)
    if n == 1 or np.count_nonzero(counts) <= 1:
        return [batch if count else batch.slice(0, 0) for count in counts.tolist()]
    order = destination_order(dest, n)
    # One take per destination, not one take sliced: each piece owns exactly its rows, so the pieces a
    # task sends can be let go of (and their memory reused, warm) once gathered, apart from those it keeps.
    out, start = [], 0
    for count in counts.tolist():
        piece = pc.take(batch, pa.array(order[start : start + count]), memory_pool=_pool()) if count else None
        out.append(piece if piece is not None else batch.slice(0, 0))
        start += count
    return out


class _ServerThread:
    """A dissoc Server on its own loop in a daemon thread (the task's main thread blocks in barriers)."""

    def __init__(
        self, datasets: dict[str, Any], host: str, port: int, secret: Secret, **server_options: Any
    ) -> None:
        self._datasets = datasets
        self._secret = secret
        self._host = host
        self._port = port
        self._options = server_options
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
            server = Server(
                self._datasets, host=self._host, port=self._port, secret=self._secret, **self._options
            )
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


def _items(data: ExchangeData) -> Iterator[Any]:
    """The rows as a stream of ``pa.RecordBatch`` or :class:`~dissoc.device.DeviceBatch` objects."""
    from dissoc.device import DeviceBatch

    if isinstance(data, pa.Table):
        yield from data.to_batches()
        return
    if isinstance(data, (pa.RecordBatch, DeviceBatch)):
        yield data
        return
    for item in data:
        if isinstance(item, (pa.RecordBatch, DeviceBatch)):
            yield item
        elif isinstance(item, pa.Table):
            yield from item.to_batches()
        else:
            raise DissocError(
                f"exchange: expected pyarrow RecordBatches or Tables, or DeviceBatches, got a "
                f"{type(item).__name__} (use df.mapInArrow(..., barrier=True), or yield batches from an RDD)"
            )


def _destinations(batch: pa.RecordBatch, n: int, key: Any, partitioner: Partitioner | None) -> Any:
    if key is not None:
        return hash_partition(batch, key, n)
    assert partitioner is not None
    return partitioner(batch, n)


def _partition_host(
    batches: Iterable[pa.RecordBatch],
    n: int,
    key: Any,
    partitioner: Partitioner | None,
    schema: pa.Schema | None,
    me: int,
) -> list[list[pa.RecordBatch]]:
    """This task's rows, bucket by destination task. The pieces bound for peers are gathered into batches
    of about :data:`_COALESCE_BYTES` as they come (splitting batch by batch is what keeps the copy in
    cache; sending thousands of small pieces is what costs: every batch is a message, a placement, a pair
    list)."""
    buckets: list[list[pa.RecordBatch]] = [[] for _ in range(n)]
    pending: list[list[pa.RecordBatch]] = [[] for _ in range(n)]
    held = [0] * n

    def flush(j: int) -> None:
        if pending[j]:
            parts, pending[j], held[j] = pending[j], [], 0
            buckets[j].append(parts[0] if len(parts) == 1 else pa.concat_batches(parts, memory_pool=_pool()))

    for batch in batches:
        if schema is not None and not batch.schema.equals(schema):
            batch = pa.RecordBatch.from_arrays(batch.columns, schema=schema)
        if key is None and partitioner is None:
            for j in range(n):  # no key: every task gets every row
                buckets[j].append(batch)
            continue
        for j, part in enumerate(_split(batch, _destinations(batch, n, key, partitioner), n)):
            if not part.num_rows:
                continue
            if j == me:
                buckets[j].append(part)
                continue
            pending[j].append(part)
            held[j] += part.nbytes
            if held[j] >= _COALESCE_BYTES:
                flush(j)
    for j in range(n):
        flush(j)
    return buckets


#: What the pieces of a bucket bound for a peer are gathered into (bytes a batch).
_COALESCE_BYTES = 8 << 20


@functools.cache
def _pool() -> pa.MemoryPool:
    """Where splitting allocates: jemalloc (else the system's), not pyarrow's default mimalloc, which gave
    the pages of every 8 MiB batch back and faulted them in anew (splitting 22M rows here: 1.73 s with
    mimalloc, 0.83 s with jemalloc, 0.82 s with the system allocator)."""
    try:
        return pa.jemalloc_memory_pool()
    except NotImplementedError:  # a pyarrow built without it
        return pa.system_memory_pool()


def _partition_device(
    batches: Iterable[Any], n: int, key: Any, partitioner: Partitioner | None, schema: pa.Schema | None
) -> tuple[list[list[Any]], str]:
    """Device batches into buckets: on the device where :mod:`dissoc.device.partition` can (fixed-width
    columns, a key), else through the host (download, split, upload). Returns the buckets and where."""
    from dissoc.device import DeviceBatch

    buckets: list[list[Any]] = [[] for _ in range(n)]
    if key is None and partitioner is None:
        for batch in batches:
            for j in range(n):
                buckets[j].append(batch)
        return buckets, "device"
    on_device = partitioner is None and _device_partitioning(schema, key)
    if on_device:
        batches = _gathered(batches)
    for batch in batches:
        if on_device:
            from dissoc.device.partition import partition_device_batch

            parts: list[Any] = partition_device_batch(batch, key, n)
        else:
            host = batch.to_arrow()
            dest = _destinations(host, n, key, partitioner)
            parts = [DeviceBatch.from_arrow(p) if p.num_rows else None for p in _split(host, dest, n)]
        for j, part in enumerate(parts):
            if part is not None and part.num_rows:
                buckets[j].append(part)
    return buckets, "device" if on_device else "host"


def _gathered(batches: Iterable[Any]) -> Iterator[Any]:
    """Device batches smaller than :data:`_COALESCE_BYTES` gathered (on the device) into batches of about
    that size before they are split: every piece of a split is a batch sent on its own."""
    from dissoc.device.partition import concat_device_batches

    pending: list[Any] = []
    held = 0
    for batch in batches:
        if not pending and batch.nbytes >= _COALESCE_BYTES:
            yield batch
            continue
        pending.append(batch)
        held += int(batch.nbytes)
        if held >= _COALESCE_BYTES:
            yield concat_device_batches(pending)
            pending, held = [], 0
    if pending:
        yield concat_device_batches(pending)


def _device_partitioning(schema: pa.Schema | None, key: Any) -> bool:
    from dissoc.device.partition import can_partition_on_device

    return schema is None or bool(can_partition_on_device(schema, key))


def _body_bytes(batches: list[Any], schema: pa.Schema | None) -> int:
    """Room a pairs arena needs to hold ``batches`` at once (each buffer rounded to the arena's alignment)."""
    from dissoc.buffers import ALIGNMENT, align_up
    from dissoc.codec import MessageEncoder

    total = 0
    encoder: MessageEncoder | None = None
    for b in batches:
        if isinstance(b, pa.RecordBatch):
            if encoder is None:
                encoder = MessageEncoder(schema or b.schema)
            for m in encoder.encode(b):
                total += sum(align_up(len(memoryview(buf).cast("B")), ALIGNMENT) for buf in m.body_buffers)
        else:  # a DeviceBatch: its messages' bodies, one range each
            total += align_up(int(b.nbytes), ALIGNMENT) + ALIGNMENT * 4 * (1 + b.num_columns)
    return total


class _Clock:
    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._last
        self._last = now


class ExchangeResult(Iterator[Any]):
    """The rows this task received (an iterator of ``pa.RecordBatch``, or of
    :class:`~dissoc.device.DeviceBatch` when they landed on the device), and :attr:`report`: one
    :class:`PeerReport` per peer that sent rows, saying which path they took."""

    def __init__(
        self,
        batches: list[Any],
        report: list[PeerReport],
        partitioned_on: str,
        seconds: dict[str, float],
        rendezvous: str,
    ) -> None:
        self._batches = iter(batches)
        #: How each peer's rows came (peer, path, transport, body, memory, landing, zero_copy, rows, bytes,
        #: seconds), in peer order.
        self.report = report
        #: Where this task split its rows: ``"host"`` or ``"device"``.
        self.partitioned_on = partitioned_on
        #: Seconds spent in each phase, in order: ``partition`` (reading the rows and splitting them as they
        #: come), ``serve``
        #: (starting servers), ``swap`` (the rendezvous: capabilities, URIs and tickets), ``fetch``,
        #: ``wait`` (until every peer is done reading from this task), ``stop``.
        self.seconds = seconds
        #: How the tasks found each other's servers: ``"files"`` (one host) or ``"allgather"``.
        self.rendezvous = rendezvous

    def __iter__(self) -> ExchangeResult:
        return self

    def __next__(self) -> Any:
        return next(self._batches)

    def __repr__(self) -> str:
        paths = ", ".join(f"{r.peer}:{r.path}" for r in self.report)
        return f"ExchangeResult(partitioned_on={self.partitioned_on}, from=[{paths}])"


def _fetch(
    peer: int, path: Path, server: dict[str, str], tickets: list[str], timeout: float
) -> tuple[list[Any], PeerReport]:
    """Fetch one peer's bucket for this task along ``path``, then tell the peer it is done with its
    servers (runs in a worker thread)."""
    batches, seconds = asyncio.run(_fetch_and_say_done(peer, path, server, tickets, timeout))
    report = PeerReport(
        peer=peer,
        path=path.name,
        transport=path.transport,
        body=path.body,
        memory=path.memory,
        landing=path.landing,
        zero_copy=path.zero_copy,
        rows=sum(int(b.num_rows) for b in batches),
        bytes=sum(int(b.nbytes) for b in batches),
        seconds=seconds,
    )
    return batches, report


async def _fetch_and_say_done(
    peer: int, path: Path, server: dict[str, str], tickets: list[str], timeout: float
) -> tuple[list[Any], float]:
    """The bucket and the seconds it took; then the done request, over the same connection where the stream
    left it reusable (a UCX connection is a worker at each end: tens of ms to make and to close). The
    connections are closed before this returns: the peer stops serving once it has heard from everyone."""
    from dissoc.client import ClientOptions, close_idle_connections, fetch_async, fetch_device_async

    ticket, done = tickets
    options = ClientOptions(
        timeout=timeout, zero_copy=path.zero_copy, landing=path.landing, reuse_connections=True
    )
    try:
        started = time.perf_counter()
        batches: list[Any]
        if path.landing == "device":
            batches = await fetch_device_async(
                server["uri"], ticket, data_uri=server["data_uri"], options=options
            )
        else:
            table = await fetch_async(server["uri"], ticket, data_uri=server["data_uri"], options=options)
            batches = [b for b in table.to_batches() if b.num_rows]
        seconds = time.perf_counter() - started
        await _say_done(peer, server, done, timeout)
        return batches, seconds
    finally:
        await close_idle_connections()


async def _say_done(peer: int, server: dict[str, str], ticket: str, timeout: float) -> None:
    """Tell ``peer`` this task is done with it (its rows and its rendezvous file): it may stop serving. An
    error costs nothing here (everything has arrived), so it is only logged."""
    from dissoc.client import ClientOptions, fetch_async

    options = ClientOptions(timeout=timeout, reuse_connections=True)
    try:
        await fetch_async(server["uri"], ticket, data_uri=server["data_uri"], options=options)
    except DissocError as e:
        log.debug("exchange: saying done to peer %d failed: %s", peer, e)


def _say_done_now(peer: int, server: dict[str, str], ticket: str, timeout: float) -> None:
    """:func:`_say_done` from synchronous code, on a connection of its own (a peer this task fetches nothing
    from)."""
    from dissoc.client import ClientOptions, fetch

    try:
        fetch(server["uri"], ticket, data_uri=server["data_uri"], options=ClientOptions(timeout=timeout))
    except DissocError as e:
        log.debug("exchange: saying done to peer %d failed: %s", peer, e)


def _land_own(bucket: list[Any], device_in: bool, landing: str) -> list[Any]:
    """This task's own bucket, where its peers' rows land."""
    from dissoc.device import DeviceBatch

    if device_in and landing == "host":
        return [b.to_arrow() for b in bucket]
    if not device_in and landing == "device":
        return [DeviceBatch.from_arrow(b) for b in bucket]
    return bucket


class _Done(Dataset):
    """``done-J``: peer J asks for it once it has every row this task sent it, so that this task's servers
    stop as soon as every peer is through with them (no barrier round: Spark's barrier calls poll once a
    second). Serves no rows."""

    def __init__(self, name: str, arrived: Callable[[], None]) -> None:
        super().__init__(name)
        self._arrived = arrived

    @property
    def schema(self) -> pa.Schema:
        return _DONE_SCHEMA

    def open(self) -> Iterator[pa.RecordBatch]:
        self._arrived()
        return iter(())


_DONE_SCHEMA = pa.schema([("done", pa.int8())])


class _Waiter:
    """Counts the peers that said they are done; :meth:`wait` returns when all have (or on timeout)."""

    def __init__(self, peers: set[int]) -> None:
        self._left = set(peers)
        self._lock = threading.Lock()
        self._all = threading.Event()
        if not self._left:
            self._all.set()

    def arrived(self, peer: int) -> Callable[[], None]:
        def mark() -> None:
            with self._lock:
                self._left.discard(peer)
                if not self._left:
                    self._all.set()

        return mark

    def wait(self, timeout: float) -> set[int]:
        """The peers still not done after ``timeout`` seconds (empty when all were)."""
        self._all.wait(timeout)
        with self._lock:
            return set(self._left)


def _server_paths(
    me: Capabilities, addresses: list[str], index: int, choice: dict[str, str]
) -> dict[str, Path]:
    """The servers this task starts before it knows its peers: one per path any of them may choose.

    A peer whose Spark address names this task's host may share its node (pairs in place); one elsewhere
    gets packed bodies, over UCX if it loads ucxx. TCP with packed bodies always runs too (unless the
    choice rules it out): it is what a receiver falls back to when it expected a path this task did not
    start (say, two containers on one host with separate ``/dev/shm``).
    """
    mine = _task_host(addresses[index])
    places = {_task_host(a) == mine for i, a in enumerate(addresses) if i != index}
    out: dict[str, Path] = {}
    for same in places:
        for ucx in (True, False):
            receiver = Capabilities(node=me.node if same else f"not {me.node}", ucx=ucx, device=me.device)
            try:
                path = choose(me, receiver, **choice)
            except DissocError:
                continue
            out.setdefault(path.server_key, path)
    fallback = _fallback(me, choice)
    if fallback is not None:
        out.setdefault(fallback.server_key, fallback)
    return out


def _fallback(sender: Capabilities, choice: dict[str, str]) -> Path | None:
    """TCP with packed bodies, where the choice allows it."""
    if choice["transport"] not in ("auto", "tcp") or choice["body"] not in ("auto", "packed"):
        return None
    if choice["memory"] != "auto":
        return None
    landing = choice["landing"] if choice["landing"] != "auto" else ("device" if sender.device else "host")
    return Path(transport="tcp", body="packed", memory=None, landing=landing)


def exchange(
    data: ExchangeData,
    *,
    key: str | Sequence[str] | None = None,
    partitioner: Partitioner | None = None,
    schema: pa.Schema | None = None,
    host: str | None = None,
    port: int = 0,
    timeout: float = 60.0,
    transport: str = "auto",
    body: str = "auto",
    memory: str = "auto",
    landing: str = "auto",
    rendezvous: str | None = None,
) -> ExchangeResult:
    """Swap rows between the tasks of a Spark barrier stage over dissoc (see :mod:`dissoc.spark`)."""
    from pyspark import BarrierTaskContext

    from dissoc.device import DeviceBatch

    choice = {"transport": transport, "body": body, "memory": memory, "landing": landing}
    for what, allowed in (
        ("transport", TRANSPORTS),
        ("body", BODIES),
        ("memory", MEMORIES),
        ("landing", LANDINGS),
    ):
        check_choice(what, choice[what], allowed)
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
    meeting = rendezvous_kind(
        rendezvous or os.environ.get(RENDEZVOUS_ENV) or "auto", [_task_host(a) for a in addresses]
    )
    files = None
    if meeting == "files":
        # No stage attempt number reaches Python: a retried attempt meets under the same name, and files
        # its killed predecessors left are told apart by their writers (see FileRendezvous).
        # A task may exchange more than once in a stage: every task makes its calls in the same order.
        task = context.taskAttemptId()
        if task not in _calls:
            _calls.clear()  # a Python worker runs one task at a time: earlier tasks' counts are done with
            _calls[task] = itertools.count()
        stage = json.dumps([context.stageId(), addresses, next(_calls[task])])
        files = FileRendezvous(stage, n, me)

    clock = _Clock()
    # Rows are split as they arrive: hashing overlaps Spark's handing over of the next batches.
    stream = _items(data)
    first = next(stream, None)
    device_in = isinstance(first, DeviceBatch)
    if schema is None and first is not None:
        schema = first.schema

    def rows() -> Iterator[Any]:
        if first is None:
            return
        yield first
        for item in stream:
            if isinstance(item, DeviceBatch) != device_in:
                raise DissocError(
                    "exchange: a task's rows are either all pyarrow batches or all DeviceBatches"
                )
            yield item

    buckets: list[list[Any]]
    if device_in:
        buckets, partitioned_on = _partition_device(rows(), n, key, partitioner, schema)
    else:
        buckets, partitioned_on = _partition_host(rows(), n, key, partitioner, schema, me), "host"
    clock.lap("partition")

    # UCX is a path only to a peer on another host, or when asked for: every task decides alike from the
    # task addresses, so a stage on one host never loads ucxx.
    elsewhere = len({_task_host(a) for a in addresses}) > 1
    caps = Capabilities.here(device=device_in, probe_ucx=elsewhere or transport == "ucx" or memory == "ucx")
    bind = _bind_host(host, addresses, me)
    secret = Secret.generate()  # this task's, for this stage only
    servers: dict[str, _ServerThread] = {}
    # Every peer says when it is done with this task (its rows, and its rendezvous file), even when this
    # task has nothing to send (no rows, no schema): then it serves only that.
    waiter = _Waiter({j for j in range(n) if j != me})
    wanted = _server_paths(caps, addresses, me, choice)
    if schema is None:
        wanted = dict(list(wanted.items())[-1:])  # the fallback where there is one: nothing to send fast
    # Room for every peer to hold all of its bucket at once (zero-copy batches until released), in any
    # pairs arena: worked out once, not per server.
    room = 0
    if any(path.body == "pairs" for path in wanted.values()):
        room = sum(_body_bytes(buckets[j], schema) for j in range(n) if j != me) + (1 << 20)
    try:
        for name, path in wanted.items():
            datasets: dict[str, Any] = {}
            for j in range(n):
                if j == me:
                    continue
                if device_in:
                    from dissoc.datasets.in_memory import DeviceDataset

                    datasets[f"to-{j}"] = DeviceDataset(f"to-{j}", buckets[j], schema)
                elif schema is not None:
                    datasets[f"to-{j}"] = pa.Table.from_batches(buckets[j], schema=schema)
                datasets[f"done-{j}"] = _Done(f"done-{j}", waiter.arrived(j))
            options: dict[str, Any] = {"transport": path.transport, "body": path.body}
            if path.body == "pairs":
                options.update(memory=path.memory, arena_bytes=room, max_unfreed_bytes=room)
            server = _ServerThread(datasets, bind, port if not servers else 0, secret, **options)
            server.start(timeout)
            servers[name] = server
        clock.lap("serve")
        # Peer j gets tickets for its own bucket (and for saying it is done) only.
        tickets = {
            str(j): [secret.mint(f"to-{j}", ttl=_TICKET_TTL), secret.mint(f"done-{j}", ttl=_TICKET_TTL)]
            for j in range(n)
            if j != me
        }
        mine = {
            "caps": caps.to_json(),
            "servers": {k: {"uri": s.uri, "data_uri": s.data_uri} for k, s in servers.items()},
            "serves": schema is not None,
            "tickets": tickets,
        }
        # The one round: what every task can do, its servers' URIs and its tickets.
        message = json.dumps(mine)
        gathered = files.gather(message, timeout) if files is not None else context.allGather(message)
        peers = [json.loads(m) for m in gathered]
        clock.lap("swap")
        infos = [Capabilities.from_json(p["caps"]) for p in peers]
        sources = [i for i in range(n) if i != me and peers[i]["serves"]]
        plan = {i: _source_path(i, infos[i], caps, peers[i]["servers"], choice) for i in sources}
        for i in range(n):
            if i != me and not peers[i]["serves"]:
                for server_of in list(peers[i]["servers"].values())[:1]:
                    _say_done_now(i, server_of, peers[i]["tickets"][str(me)][1], timeout)
        received: dict[int, list[Any]] = {}
        report: list[PeerReport] = []
        if sources:
            with ThreadPoolExecutor(max_workers=min(len(sources), 16)) as pool:
                futures = {
                    i: pool.submit(_fetch, i, plan[i][0], plan[i][1], peers[i]["tickets"][str(me)], timeout)
                    for i in sources
                }
                for i in sources:
                    received[i], entry = futures[i].result()
                    report.append(entry)
                    log.info(
                        "exchange task %d/%d got %d rows from %d by %s in %.3f s",
                        me, n, entry.rows, i, entry.path, entry.seconds,
                    )  # fmt: skip
        out_landing = landing if landing != "auto" else ("device" if device_in else "host")
        out: list[Any] = []
        for i in range(n):
            if i == me:
                out.extend(_land_own(buckets[me], device_in, out_landing))
            else:
                out.extend(received.get(i, []))
        clock.lap("fetch")
        # Nobody's servers stop while a peer may still read from them: each waits for its peers' done-J.
        late = waiter.wait(timeout)
        if late:
            log.warning(
                "exchange task %d/%d: peers %s did not say they were done within %s s; stopping anyway",
                me, n, sorted(late), timeout,
            )  # fmt: skip
        clock.lap("wait")
    finally:
        for server in servers.values():
            server.stop(timeout)
        if files is not None:
            files.finish()
    clock.lap("stop")
    log.info(
        "exchange task %d/%d received %d rows (%s)",
        me, n, sum(int(b.num_rows) for b in out), ", ".join(f"{k} {v:.3f} s" for k, v in clock.laps.items()),
    )  # fmt: skip
    return ExchangeResult(out, report, partitioned_on, clock.laps, meeting)


def _source_path(
    peer: int,
    sender: Capabilities,
    me: Capabilities,
    servers: dict[str, dict[str, str]],
    choice: dict[str, str],
) -> tuple[Path, dict[str, str]]:
    """The path from ``peer`` and the server of it to fetch from (TCP packed if ``peer`` did not start the
    one this task would choose)."""
    path = choose(sender, me, **choice)
    server = servers.get(path.server_key)
    if server is None:
        fallback = _fallback(sender, choice)
        server = servers.get(fallback.server_key) if fallback is not None else None
        if fallback is None or server is None:
            raise DissocError(
                f"exchange: peer {peer} serves {sorted(servers)}, not {path.name} (which "
                f"transport={choice['transport']!r}, body={choice['body']!r}, memory={choice['memory']!r} "
                "leave as the only path between them)"
            )
        log.info("exchange: peer %d did not start %s; falling back to %s", peer, path.name, fallback.name)
        path = fallback
    return path, server
