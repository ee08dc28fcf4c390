"""Shared helpers for the end-to-end tests (tests/client/, and every test that runs real servers).

- sample data: a table with dictionaries, strings, nulls and nested types; an ordered table with an ``id``;
- :func:`within`: await with a deadline, turning a hang into a test failure that says so;
- :class:`Listings`: which ranges a server's free_data ledger was told each client was listed and let go;
- :class:`ServerThread`: a :class:`dissoc.Server` on its own event loop in a thread, for the synchronous API;
- :class:`RawServer`: a scripted raw TCP peer that answers a want_data request with whatever bytes a test
  wants (valid frames built with :func:`untagged` / :func:`tagged`, or garbage);
- process helpers: start ``python -m dissoc.cli serve`` and read its JSON lines, read ``VmRSS``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import selectors
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pytest

from dissoc.protocol.ledger import Ledger

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable

T = TypeVar("T")

# ------------------------------------------------------------------------------------------------------ data


def sample_table(batches: int = 4, rows: int = 257) -> pa.Table:
    """Several batches of: int ids, strings with nulls, a dictionary column (same dictionary in every batch),
    lists with nulls, a struct, a large string, booleans, timestamps and fixed-size lists."""
    dictionary = pa.array(["red", "green", "blue", "violet"])
    out = []
    for b in range(batches):
        base = b * rows
        ids = list(range(base, base + rows))
        out.append(
            pa.record_batch(
                {
                    "id": pa.array(ids, pa.int64()),
                    "s": pa.array([None if i % 7 == 0 else f"row-{i}" * (i % 4) for i in ids]),
                    "d": pa.DictionaryArray.from_arrays(
                        pa.array([None if i % 11 == 0 else i % 4 for i in ids], pa.int32()), dictionary
                    ),
                    "l": pa.array(
                        [None if i % 5 == 0 else [j if j % 3 else None for j in range(i % 6)] for i in ids],
                        pa.list_(pa.int32()),
                    ),
                    "st": pa.array(
                        [None if i % 13 == 0 else {"a": i, "b": None if i % 2 else str(i)} for i in ids],
                        pa.struct([("a", pa.int32()), ("b", pa.string())]),
                    ),
                    "ls": pa.array([f"large-{i}" if i % 3 else None for i in ids], pa.large_string()),
                    "flag": pa.array([None if i % 17 == 0 else bool(i % 2) for i in ids]),
                    "ts": pa.array([i * 1_000_000 for i in ids], pa.timestamp("us", tz="UTC")),
                    "fsl": pa.array([[i, -i] for i in ids], pa.list_(pa.int16(), 2)),
                }
            )
        )
    return pa.Table.from_batches(out)


def ordered_table(batches: int, rows: int, pad: int = 0) -> pa.Table:
    """``batches`` batches of ``rows`` rows: ``id`` (global row number) and, if ``pad``, a binary column of
    ``pad`` bytes per row."""
    out = []
    for b in range(batches):
        cols: dict[str, pa.Array] = {"id": pa.array(range(b * rows, (b + 1) * rows), pa.int64())}
        if pad:
            cols["pad"] = pa.array([bytes([b % 256]) * pad] * rows, pa.binary())
        out.append(pa.record_batch(cols))
    return pa.Table.from_batches(out)


def assert_ids_in_order(batches: Iterable[pa.RecordBatch]) -> int:
    """Every batch's ``id`` column continues the previous one without gaps; returns the row count."""
    expected = 0
    for batch in batches:
        ids = batch.column("id").to_pylist()
        assert ids == list(range(expected, expected + len(ids))), (
            f"batch out of order: expected ids from {expected}, got {ids[:3]}...{ids[-3:]}"
        )
        expected += len(ids)
    return expected


# --------------------------------------------------------------------------------------------------- timing


async def within(seconds: float, awaitable: Awaitable[T], what: str = "the operation") -> T:
    """``await awaitable`` but fail the test (instead of hanging) if it takes more than ``seconds``."""
    try:
        return await asyncio.wait_for(awaitable, seconds)
    except TimeoutError:
        raise AssertionError(f"{what} hung: no result within {seconds} s") from None


async def eventually(predicate: Callable[[], bool], seconds: float, step: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true or ``seconds`` pass; returns its last value."""
    deadline = time.monotonic() + seconds
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return predicate()
        await asyncio.sleep(step)


def listener_connections(server: Any) -> int | None:
    """How many connections the server's listeners still run handlers for (None if the internals moved)."""
    total = 0
    for role in getattr(server, "_servers", None) or []:
        listener = getattr(role, "_listener", None)
        if listener is None:
            continue
        conns = getattr(listener, "connections", None)
        tasks = getattr(listener, "_tasks", None)
        if conns is None:
            return None
        total += max(len(conns), len(tasks) if tasks is not None else 0)
    return total


class Listings:
    """What the free_data ledgers (:class:`~dissoc.protocol.ledger.Ledger`) of this test's servers are told,
    by client: the ranges listed to it (``record``) and the ranges it let go (what ``free_ranges`` and
    ``drop`` return), spied on the class with ``monkeypatch``. A ledger answers how many bytes a client holds
    (``live_bytes_of``, what the servers ask it); the clients, and which ranges each holds, are named here."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._listed: dict[Hashable, Counter[tuple[int, int]]] = {}
        record, free_ranges, drop = Ledger.record, Ledger.free_ranges, Ledger.drop

        def listing(client: Hashable) -> Counter[tuple[int, int]]:
            return self._listed.setdefault(client, Counter())

        def spied_record(ledger: Ledger, client: Hashable, pairs: Any) -> int:
            rows = pairs.tolist() if isinstance(pairs, np.ndarray) else list(pairs)
            added = record(ledger, client, pairs if isinstance(pairs, np.ndarray) else rows)
            listing(client).update((int(o), int(n)) for o, n in rows if n)
            return added

        def spied_free_ranges(ledger: Ledger, client: Hashable, addresses: Any) -> list[tuple[int, int]]:
            freed = free_ranges(ledger, client, addresses)
            listing(client).subtract(freed)
            return freed

        def spied_drop(ledger: Ledger, client: Hashable) -> list[tuple[int, int]]:
            dropped = drop(ledger, client)
            listing(client).subtract(dropped)
            return dropped

        monkeypatch.setattr(Ledger, "record", spied_record)
        monkeypatch.setattr(Ledger, "free_ranges", spied_free_ranges)
        monkeypatch.setattr(Ledger, "drop", spied_drop)

    def clients(self) -> list[Hashable]:
        """Every client listed a range so far, in the order of their first listing."""
        return list(self._listed)

    def held(self, client: Hashable) -> list[tuple[int, int]]:
        """The (offset, length) ranges listed to ``client`` and not let go, sorted."""
        return sorted(+self._listed.get(client, Counter()))

    def held_bytes(self, client: Hashable) -> int:
        return sum(n for _, n in self.held(client))


# ------------------------------------------------------------------------------------------- server thread


class ServerThread:
    """A ``dissoc.Server`` running on its own event loop in a daemon thread (for the synchronous client API,
    which must not share the test's loop). Use as a context manager; ``.uri`` and ``.data_uri`` once entered;
    with ``flight=True`` a Flight control plane in front of it too (``.location``).
    """

    def __init__(self, datasets: dict[str, Any], *, flight: bool = False, **server_options: Any) -> None:
        self._datasets = datasets
        self._options = server_options
        self._flight = flight
        #: With ``flight=True``: the Flight control plane in front of the server (``grpc://...``).
        self.location = ""
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.uri = ""
        self.data_uri = ""
        self.server: Any = None
        self._thread = threading.Thread(target=self._run, name="e2e-server", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            from dissoc.server import Server

            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            if self._flight:
                from dissoc.flight import serve_with_flight

                async with serve_with_flight(self._datasets, **self._options) as plane:
                    self.location, self.server = plane.location, plane.server
                    self.uri, self.data_uri = plane.server.uri, plane.server.data_uri
                    self._ready.set()
                    await self._stop.wait()
                return
            async with Server(self._datasets, **self._options) as server:
                self.uri, self.data_uri = server.uri, server.data_uri
                self.server = server
                self._ready.set()
                await self._stop.wait()

        try:
            asyncio.run(main())
        except BaseException as e:
            self._error = e
        finally:
            self._ready.set()

    def __enter__(self) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(10) or self._error is not None:
            raise RuntimeError(f"the server thread did not start: {self._error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        assert not self._thread.is_alive(), "the server thread did not stop within 10 s"


# ----------------------------------------------------------------------------------------- raw wire peer

_HEADER = struct.Struct("<QQQ")


def frame(kind: int, tag: int, payload: bytes) -> bytes:
    """A TCP-transport frame (DESIGN.md section 3): u8 kind, 7 zero bytes, u64 LE tag, u64 LE length."""
    return _HEADER.pack(kind, tag, len(payload)) + payload


def untagged(payload: bytes) -> bytes:
    return frame(1, 0, payload)


def tagged(tag: int, payload: bytes) -> bytes:
    return frame(2, tag, payload)


CLOSE = object()
"""In a :class:`RawServer` script: close the connection here."""


class RawServer:
    """A raw TCP peer for wire tests. Each connection: read one frame (the client's want_data), then write
    the items of ``script()`` (bytes, or :data:`CLOSE` to hang up; a float sleeps that long), then stay silent
    until the server is closed. With ``answer=False`` it reads nothing and never answers.

    ``requests`` lists ``(tag, ticket)`` of the want_data frames received.
    """

    def __init__(self, script: Callable[[], Iterable[Any]] = lambda: (), *, answer: bool = True) -> None:
        self._script = script
        self._answer = answer
        self._server: asyncio.Server | None = None
        self._done = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.requests: list[tuple[int, bytes]] = []
        self.port = 0

    def uri(self, want_data: int = 7) -> str:
        return f"tcp://127.0.0.1:{self.port}?want_data={want_data}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            if self._answer:
                _kind, tag, length = _HEADER.unpack(await reader.readexactly(24))
                self.requests.append((tag, await reader.readexactly(length)))
                for item in self._script():
                    if item is CLOSE:
                        return
                    if isinstance(item, float):
                        await asyncio.sleep(item)
                        continue
                    writer.write(item)
                    await writer.drain()
            await self._done.wait()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()
            self._tasks.discard(task)

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._done.set()
        assert self._server is not None
        self._server.close()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        for task in list(self._tasks):
            task.cancel()
        await self._server.wait_closed()


# ------------------------------------------------------------------------------------------------ processes


def vm_rss(pid: int) -> int:
    """Resident set size of process ``pid`` in bytes (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return 0


def read_lines(proc: subprocess.Popen[bytes], count: int, timeout: float) -> list[str]:
    """Read ``count`` lines from ``proc.stdout`` within ``timeout`` seconds (fails instead of blocking)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    buf = b""
    deadline = time.monotonic() + timeout
    try:
        while buf.count(b"\n") < count:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise AssertionError(f"expected {count} line(s) on stdout within {timeout} s, got {buf!r}")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(f"stdout closed after {buf!r} (exit status {proc.poll()})")
            buf += chunk
    finally:
        sel.close()
    return buf.decode().splitlines()


@contextlib.contextmanager
def cli_server(
    *args: str, count: int, timeout: float = 20.0
) -> Iterator[tuple[subprocess.Popen[bytes], list[dict[str, Any]]]]:
    """Run ``python -m dissoc.cli serve ARGS``; yield the process and its ``count`` JSON lines. Killed on exit
    if still running."""
    proc = subprocess.Popen(
        [PYTHON, "-m", "dissoc.cli", "serve", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        lines = read_lines(proc, count, timeout)
        yield proc, [json.loads(line) for line in lines]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


async def collect(agen: AsyncIterator[pa.RecordBatch]) -> list[pa.RecordBatch]:
    return [b async for b in agen]


async def ask_raw(conn: Any, want_data: int, ticket: bytes, *, send: bool = True) -> tuple[str, Any]:
    """One request on a raw combined connection (``send=False``: the answer to one sent before): ("eos",
    EndOfStream) or ("error", ErrorMessage); reads the metadata stream only, so pair lists pile up unread
    and are never freed (a client that holds what it was listed)."""
    from dissoc.protocol import MessageType, decode_stream_message

    if send:
        await conn.send_tagged(want_data, ticket)
    while True:
        buf = await conn.recv()
        kind = bytes(buf[:1])[0]
        if kind == MessageType.END_OF_STREAM:
            return "eos", decode_stream_message(buf)
        if kind == MessageType.ERROR:
            return "error", decode_stream_message(buf)
