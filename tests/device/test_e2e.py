"""Device memory end to end: servers of host tables or device batches, clients landing on the host or the
device, over packed bodies and address/length pairs in shm or "cuda" arenas.

The CPU tests run everywhere on :class:`~dissoc.memory.cuda.FakeDeviceBackend` (host shared memory posing as
device memory, with IPC handles another process can open). They check what needs no GPU: that data round-trips
exactly whatever the path, where every batch lands (device arrays or host memory, views of the server's arena
or private copies, read from ``/proc/self/maps``), what each landing costs (uploads, downloads, device copies,
counted per side), the server's free_data accounting (ledger, resident placements, evictions) and two
processes sharing an arena through the ``dissoc`` command line. The ``gpu`` tests repeat the essentials with
CuPy, UCX's CUDA transports and real CUDA IPC handles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pytest
from helpers.e2e import PYTHON, REPO, Listings, ServerThread, cli_server, eventually, read_lines

from dissoc.client import (
    ClientOptions,
    FetchPath,
    FetchStats,
    fetch,
    fetch_async,
    fetch_device,
    fetch_device_async,
    open_stream,
    stream_batches,
)
from dissoc.codec import MessageEncoder, iter_messages, parse
from dissoc.device import DeviceBatch, DeviceColumn, DeviceDecoder
from dissoc.errors import CodecError, DevicePathError, DissocError, ProtocolError, ResourceError
from dissoc.memory import cuda as device_mod
from dissoc.memory.cuda import (
    ENV_VAR,
    FAKE_HANDLE_MAGIC,
    CupyBackend,
    DeviceArray,
    FakeDeviceArray,
    FakeDeviceBackend,
    use_backend,
)
from dissoc.memory.cuda_arena import DeviceArena
from dissoc.memory.mappings import MAPPINGS
from dissoc.metrics import CLIENT
from dissoc.server import Server
from dissoc.uri import DissocURI

pytestmark = pytest.mark.timeout(120)

TICKET = "x"
BODIES: dict[str, tuple[str, str | None]] = {
    "packed": ("packed", None),
    "shm": ("pairs", "shm"),
    "cuda": ("pairs", "cuda"),
}

# ------------------------------------------------------------------------------------------------ data


def _dict_batches() -> list[pa.RecordBatch]:
    """Four batches whose dictionary grows (a delta), is replaced, then grows again; with strings and nulls,
    string views (variadic buffers), lists of structs, lists with null items and booleans."""
    dictionaries = [["a", "b"], ["a", "b", "c", "dd"], ["x", "y", "z"], ["x", "y", "z", "w"]]
    out = []
    for b, words in enumerate(dictionaries):
        ids = list(range(b * 100, b * 100 + 50 + b))
        out.append(
            pa.record_batch(
                {
                    "id": pa.array(ids, pa.int64()),
                    "d": pa.DictionaryArray.from_arrays(
                        pa.array([None if i % 9 == 0 else i % len(words) for i in ids], pa.int16()),
                        pa.array(words),
                    ),
                    "s": pa.array([None if i % 7 == 0 else f"s{i}" * (i % 3) for i in ids]),
                    "sv": pa.array(
                        [None if i % 6 == 0 else f"view-{i}" * (1 + i % 4) for i in ids], pa.string_view()
                    ),
                    "ls": pa.array(
                        [
                            None
                            if i % 5 == 0
                            else [{"a": j, "b": None if j % 2 else str(j)} for j in range(i % 4)]
                            for i in ids
                        ],
                        pa.list_(pa.struct([("a", pa.int32()), ("b", pa.string())])),
                    ),
                    "lf": pa.array(
                        [[float(i), None] if i % 4 else None for i in ids], pa.list_(pa.float64())
                    ),
                    "flag": pa.array([None if i % 11 == 0 else bool(i % 2) for i in ids]),
                }
            )
        )
    return out


@pytest.fixture(scope="module")
def stream_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An IPC stream with a dictionary delta, a replacement, and another delta (as pyarrow writes them)."""
    path = tmp_path_factory.mktemp("device-e2e") / "dicts.arrows"
    batches = _dict_batches()
    options = pa.ipc.IpcWriteOptions(emit_dictionary_deltas=True)
    with pa.ipc.new_stream(path, batches[0].schema, options=options) as writer:
        for batch in batches:
            writer.write_batch(batch)
    reader = pa.ipc.open_stream(path)
    reader.read_all()
    assert (reader.stats.num_dictionary_deltas, reader.stats.num_replaced_dictionaries) == (2, 1)
    return path


@pytest.fixture(scope="module")
def expected(stream_file: Path) -> pa.Table:
    table = pa.ipc.open_stream(stream_file).read_all()
    assert table.equals(pa.Table.from_batches(_dict_batches()))
    return table


def _device_batches_of_stream(path: Path, backend: Any) -> list[DeviceBatch]:
    """The stream's batches in device memory, landed as they are stored (its deltas stay deltas)."""
    decoder = DeviceDecoder(backend=backend)
    out = []
    for msg, metadata, body in iter_messages(path):
        batch = decoder.decode(metadata, backend.upload(body) if msg.has_body else None)
        if batch is not None:
            out.append(batch)
    assert any(m.is_delta for b in out for m in b.messages)
    return out


def _source(kind: str, path: Path, table: pa.Table, backend: Any) -> Any:
    if kind == "table":  # in memory, re-encoded by the server (dictionary replacements, no deltas)
        return table
    if kind == "stream":  # stored, forwarded as it is (deltas)
        return str(path)
    assert kind == "device"  # in device memory (deltas)
    return _device_batches_of_stream(path, backend)


def _stream_cost(table: pa.Table) -> tuple[int, int]:
    """(messages with a body, non-empty buffers) of the stream a server encodes for ``table``."""
    encoder = MessageEncoder(table.schema)
    bodies = ranges = 0
    for batch in table.to_batches():
        for message in encoder.encode(batch):
            spans = parse(message.metadata).batch
            assert spans is not None
            bodies += 1
            ranges += int((spans.buffers[:, 1] > 0).sum())
    return bodies, ranges


# -------------------------------------------------------------------------------------------- backends


class _Counts:
    """Counts the transfers a device backend makes, per side: calls from the thread of a
    :class:`~helpers.e2e.ServerThread` (named ``e2e-server``) are the server's, all others the client's."""

    COUNTED = ("upload", "download", "copy", "upload_into", "open_ipc", "allocate")

    def _init_counts(self) -> None:
        self._count_lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}

    def _note(self, op: str) -> None:
        side = "server" if threading.current_thread().name == "e2e-server" else "client"
        with self._count_lock:
            self._counts[(side, op)] = self._counts.get((side, op), 0) + 1

    def calls(self, side: str | None = None) -> dict[str, int]:
        """What was counted (of :attr:`COUNTED`) since the last :meth:`reset`, on one side or both."""
        out: dict[str, int] = {}
        with self._count_lock:
            for (s, op), n in self._counts.items():
                if side is None or s == side:
                    out[op] = out.get(op, 0) + n
        return out

    def reset(self) -> None:
        with self._count_lock:
            self._counts.clear()

    def upload(self, data: Any) -> Any:
        self._note("upload")
        return super().upload(data)  # type: ignore[misc]

    def download(self, array: Any, out: Any = None) -> Any:
        self._note("download")
        return super().download(array, out)  # type: ignore[misc]

    def copy(self, dst: Any, src: Any) -> None:
        self._note("copy")
        super().copy(dst, src)  # type: ignore[misc]

    def upload_into(self, dst: Any, data: Any) -> None:
        self._note("upload_into")
        super().upload_into(dst, data)  # type: ignore[misc]

    def open_ipc(self, handle: bytes, nbytes: int) -> Any:
        self._note("open_ipc")
        return super().open_ipc(handle, nbytes)  # type: ignore[misc]

    def allocate(self, nbytes: int) -> Any:
        self._note("allocate")
        return super().allocate(nbytes)  # type: ignore[misc]


class CountingFake(_Counts, FakeDeviceBackend):
    def __init__(self) -> None:
        super().__init__()
        self._init_counts()


class CountingCupy(_Counts, CupyBackend):
    def __init__(self) -> None:
        super().__init__()
        self._init_counts()


@pytest.fixture
def fake() -> Iterator[CountingFake]:
    with use_backend(CountingFake()) as backend:
        assert isinstance(backend, CountingFake)
        try:
            yield backend
        finally:
            MAPPINGS.clear()  # (mappings a test's streams left for later ones)


@pytest.fixture
def no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process without a device backend: nothing chosen, no environment variable, and no cupy (even on a
    machine that has it)."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(device_mod, "_override", None)
    monkeypatch.setattr(device_mod, "_default", None)
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError


@pytest.fixture
def no_cupy_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a subprocess that has no device: no DISSOC_DEVICE_BACKEND, and a ``cupy`` package
    first on its path that fails to import (so that this holds on a GPU machine too)."""
    shim = tmp_path / "no-cupy"
    (shim / "cupy").mkdir(parents=True)
    (shim / "cupy" / "__init__.py").write_text(
        'raise ImportError("cupy is hidden from this process by a test")\n'
    )
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    # The shim first; then whatever path this process was given (where packages come by PYTHONPATH).
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(shim), str(REPO), *inherited])
    return env


# ------------------------------------------------------------------------------------ where memory lies


def _shm_mappings(pid: int | str = "self") -> list[tuple[int, int, str]]:
    """(start, end, segment name) of every /dev/shm mapping of a process."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith("/dev/shm/"):
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            name = parts[5].strip().removesuffix(" (deleted)")
            out.append((start, end, os.path.basename(name)))
    return out


def _segment_at(address: int, size: int) -> str | None:
    """The /dev/shm segment whose mapping in this process holds ``[address, address + size)``, else None."""
    for start, end, name in _shm_mappings():
        if start <= address and address + size <= end:
            return name
    return None


def _arena_segment(server: Server) -> str:
    arena = server.arena
    if isinstance(arena, DeviceArena):
        return str(arena.allocation.name)  # type: ignore[attr-defined]
    assert arena is not None
    return arena.name.lstrip("/")


def _host(array: DeviceArray) -> npt.NDArray[Any]:
    """The host memory behind a fake device array (what the server's arena holds, seen from the test)."""
    assert isinstance(array, FakeDeviceArray)
    return array.host


def _mapping_of(array: Any) -> Any:
    """The fake allocation a device array is a view of (through the zero-copy lease that owns it), or None."""
    obj = array.host
    while isinstance(obj, np.ndarray):
        obj = obj.base
    owner = getattr(obj, "owner", None)
    return getattr(owner, "allocation", None)


def _columns(columns: Sequence[DeviceColumn]) -> Iterator[DeviceColumn]:
    for c in columns:
        yield c
        yield from _columns(c.children)
        yield from _columns(c.dictionary_chunks)


def _host_buffers(batch: pa.RecordBatch) -> Iterator[tuple[pa.Buffer, bool]]:
    """Every buffer of the batch (children's included), and whether it belongs to a dictionary."""

    def walk(array: pa.Array, dictionary: bool) -> Iterator[tuple[pa.Buffer, bool]]:
        yield from ((b, dictionary) for b in array.buffers() if b is not None)
        if isinstance(array, pa.DictionaryArray):
            yield from walk(array.dictionary, True)

    for column in batch.columns:
        yield from walk(column, False)


def _ids(batch: pa.RecordBatch) -> list[int]:
    return [int(v) for v in batch.column("id").to_pylist()]


async def _held_until_released(server: Server) -> None:
    placements = server.placements
    assert placements is not None
    gc.collect()
    assert await eventually(lambda: placements.held_bytes == 0, 10), (
        f"{placements.held_bytes} bytes of the arena are still held after the client released everything"
    )
    ledger = server.ledger
    assert ledger is not None
    assert await eventually(lambda: ledger.live_bytes == 0, 10), repr(ledger)


# ------------------------------------------------------------------------------------- (1) landing matrix


def _matrix() -> list[Any]:
    cases = []
    for dataset in ("table", "stream", "device"):
        for body in BODIES:
            for landing in ("host", "device"):
                for zero_copy in (False,) if body == "packed" else (False, True):
                    name = f"{dataset}-{body}-{landing}" + ("-zc" if zero_copy else "")
                    cases.append(pytest.param(dataset, body, landing, zero_copy, id=name))
    return cases


def _check_host_landing(batches: Sequence[Any], segment: str | None) -> None:
    """Host batches in host memory: private copies, or views of the shm segment ``segment`` (zero-copy; but a
    dictionary that a delta extended is a private concatenation)."""
    assert all(type(b) is pa.RecordBatch for b in batches)
    for b in batches:
        for buf, dictionary in _host_buffers(b):
            assert buf.is_cpu
            if buf.size:
                where = _segment_at(buf.address, buf.size)
                assert where == segment or (dictionary and where is None)


def _check_device_landing(
    batches: Sequence[Any], expected: pa.Table, backend: Any, segment: str | None, deltas: bool
) -> None:
    """Device batches of ``backend`` whose bodies are private device memory, or views of this process's
    mapping of the cuda arena ``segment`` (zero-copy); dictionaries as the stream sent them."""
    assert all(isinstance(b, DeviceBatch) for b in batches)
    for b, w in zip(batches, expected.to_batches(), strict=True):
        assert b.backend is backend
        for m in b.messages:
            assert backend.is_device_array(m.body)
            if m.body_length:
                assert _segment_at(m.body.data_ptr, m.body.nbytes) == segment
            assert (_mapping_of(m.body) is not None) == (segment is not None)
        for column in _columns(b.columns):
            assert all(buf is None or backend.is_device_array(buf) for buf in column.buffers)
        # the typed view of the id column, read where it lies (a rewritten metadata must point right)
        assert np.asarray(b.column("id").data.host).tolist() == _ids(w)
    # deltas stay deltas and share their base (one device body); replacements start anew
    kinds = [[m.is_delta for m in b.messages[:-1]] for b in batches]
    if deltas:
        assert kinds == [[False], [False, True], [False], [False, True]]
        assert batches[1].messages[0] is batches[0].messages[0]
        assert batches[3].messages[0] is batches[2].messages[0]
    else:
        assert kinds == [[False], [False], [False], [False]]


async def _round_trip(
    backend: CountingFake,
    path: Path,
    expected: pa.Table,
    transport: str,
    dataset: str,
    body: str,
    landing: str,
    zero_copy: bool,
) -> None:
    kind, memory = BODIES[body]
    source = _source(dataset, path, expected, backend)
    async with Server(
        {TICKET: source}, transport=transport, body=kind, memory=memory, arena_bytes=8 << 20
    ) as srv:
        options = ClientOptions(landing=landing, zero_copy=zero_copy, timeout=20)
        batches = [b async for b in stream_batches(srv.uri, TICKET, data_uri=srv.data_uri, options=options)]
        assert [b.num_rows for b in batches] == [b.num_rows for b in expected.to_batches()]
        segment = _arena_segment(srv) if memory is not None else None
        if landing == "host":
            _check_host_landing(batches, segment if zero_copy and body == "shm" else None)
            got = pa.Table.from_batches(batches)
        else:
            views = zero_copy and body == "cuda"
            _check_device_landing(batches, expected, backend, segment if views else None, dataset != "table")
            got = DeviceBatch.to_table(batches)
        assert got.equals(expected)
        if memory is not None:
            del batches, got
            await _held_until_released(srv)


@pytest.mark.parametrize(("dataset", "body", "landing", "zero_copy"), _matrix())
async def test_landing_matrix_over_tcp(
    fake: CountingFake,
    stream_file: Path,
    expected: pa.Table,
    dataset: str,
    body: str,
    landing: str,
    zero_copy: bool,
) -> None:
    await _round_trip(fake, stream_file, expected, "tcp", dataset, body, landing, zero_copy)


@pytest.mark.ucx
@pytest.mark.parametrize(
    ("dataset", "body", "landing", "zero_copy"),
    [
        pytest.param("device", "packed", "device", False, id="device-packed-device"),
        pytest.param("table", "packed", "device", False, id="table-packed-device"),
        pytest.param("device", "packed", "host", False, id="device-packed-host"),
        pytest.param("device", "cuda", "device", True, id="device-cuda-device-zc"),
        pytest.param("stream", "shm", "device", False, id="stream-shm-device"),
        pytest.param("device", "cuda", "host", False, id="device-cuda-host"),
    ],
)
async def test_landing_matrix_over_ucx(
    fake: CountingFake,
    stream_file: Path,
    expected: pa.Table,
    dataset: str,
    body: str,
    landing: str,
    zero_copy: bool,
) -> None:
    await _round_trip(fake, stream_file, expected, "ucx", dataset, body, landing, zero_copy)


@pytest.mark.ucx
async def test_packed_over_ucx_without_cuda_memory_is_uploaded_once_per_body(
    fake: CountingFake, expected: pa.Table
) -> None:
    # The fake device is no CUDA memory: UCX receives into host memory, and each body is uploaded once.
    bodies, _ = _stream_cost(expected)
    async with Server({TICKET: expected}, transport="ucx") as srv:
        fake.reset()
        got = await fetch_device_async(srv.uri, TICKET, options=ClientOptions(timeout=20))
        assert fake.calls() == {"upload": bodies}
        assert DeviceBatch.to_table(got).equals(expected)
        # a host copy all the same, which the device path refuses, naming why
        required = ClientOptions(timeout=20, require_device_path=True)
        with pytest.raises(
            DevicePathError, match=r"over ucx were received into host memory .*'fake', not CuPy"
        ):
            await fetch_device_async(srv.uri, TICKET, options=required)


# ------------------------------------------------------------------------- (2) zero-copy: views and ledger


def _body_spans(
    batches: Sequence[DeviceBatch], segment: str, arena: DeviceArena
) -> dict[int, tuple[int, int]]:
    """Arena offsets [start, end) of every message body of the batches (by the body's identity), checking that
    each is a view of the client's own mapping of the arena segment (opened from the IPC handle, not the
    server's allocation object) holding what the server placed at that offset."""
    spans: dict[int, tuple[int, int]] = {}
    for b in batches:
        for m in b.messages:
            mapping = _mapping_of(m.body)
            assert mapping is not None and mapping.name == segment
            start = m.body.data_ptr - mapping.ptr
            assert m.body.data_ptr != arena.allocation.ptr + start
            assert np.array_equal(_host(arena.view(start, m.body.nbytes)), m.body.host)
            spans[id(m.body)] = (start, start + m.body.nbytes)
    return spans


def _inside(ranges: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(o, n) for o, n in ranges if any(s <= o and o + n <= e for s, e in spans)]


async def test_zero_copy_device_batches_are_the_servers_arena_until_released(
    fake: CountingFake, stream_file: Path, expected: pa.Table, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _device_batches_of_stream(stream_file, fake)
    listings = Listings(monkeypatch)
    async with Server({TICKET: source}, body="pairs", memory="cuda", arena_bytes=8 << 20) as srv:
        arena, ledger, placements = srv.arena, srv.ledger, srv.placements
        assert isinstance(arena, DeviceArena) and ledger is not None and placements is not None
        segment = _arena_segment(srv)
        got = await fetch_device_async(srv.uri, TICKET, options=ClientOptions(zero_copy=True, timeout=20))
        assert DeviceBatch.to_table(got).equals(expected)

        # Every body is a view of this process's own mapping of the arena, at the offset the server placed it.
        spans = _body_spans(got, segment, arena)
        assert _segment_count(segment) == 2  # the server's mapping and this client's
        # Shared memory: what the server writes there, the client's batch reads.
        ids = got[-1].column("id").data
        mapping = _mapping_of(ids)
        at = ids.data_ptr - mapping.ptr
        before = int(ids.host[0])
        _host(arena.view(at, 8))[:] = np.array([-7], np.int64).view(np.uint8)
        assert int(ids.host[0]) == -7
        _host(arena.view(at, 8))[:] = np.array([before], np.int64).view(np.uint8)
        del ids, mapping

        # The ledger holds exactly the ranges behind the batches' bodies, listed to this one client.
        (client,) = listings.clients()
        ranges = listings.held(client)
        all_spans = list(spans.values())
        assert _inside(ranges, all_spans) == ranges
        assert all(_inside(ranges, [span]) for span in all_spans)
        held = ledger.live_bytes
        assert held == ledger.live_bytes_of(client) == sum(n for _, n in ranges) > 0
        assert placements.held_bytes > 0
        assert not await eventually(lambda: ledger.live_bytes < held, 0.3), "freed while the batches live"

        # Releasing the first batch frees its own record batch only: its dictionary is the base the second
        # batch's delta extends, still in use.
        first = got.pop(0)
        shared = {id(m.body) for b in got for m in b.messages}
        own = [id(m.body) for m in first.messages if id(m.body) not in shared]
        assert len(own) == 1 and len(first.messages) == 2
        del first
        kept = [span for key, span in spans.items() if key in shared]
        left = _inside(ranges, kept)
        assert 0 < len(left) < len(ranges)
        gc.collect()
        assert await eventually(lambda: listings.held(client) == left, 10), (listings.held(client), left)
        assert ledger.live_bytes_of(client) == sum(n for _, n in left)
        assert DeviceBatch.to_table(got).equals(pa.Table.from_batches(expected.to_batches()[1:]))

        # Releasing the rest frees everything; this process keeps the arena mapped for its next stream (no
        # second open), until the mapping has been idle for long enough.
        del got
        await _held_until_released(srv)
        again = await fetch_device_async(srv.uri, TICKET, options=ClientOptions(zero_copy=True, timeout=20))
        assert DeviceBatch.to_table(again).equals(expected)
        del again
        await _held_until_released(srv)
        assert fake.calls("client").get("open_ipc") == 1
        assert _segment_count(segment) == 2
        assert await eventually(lambda: _unmapped(segment, 1), 10), "the client kept its mapping"


async def test_copied_device_batches_free_at_once_and_are_private(
    fake: CountingFake, stream_file: Path, expected: pa.Table
) -> None:
    source = _device_batches_of_stream(stream_file, fake)
    async with Server({TICKET: source}, body="pairs", memory="cuda", arena_bytes=8 << 20) as srv:
        arena, ledger = srv.arena, srv.ledger
        assert isinstance(arena, DeviceArena) and ledger is not None
        got = await fetch_device_async(srv.uri, TICKET, options=ClientOptions(timeout=20))
        # freed while the batches are still alive: they are copies
        assert await eventually(lambda: ledger.live_bytes == 0, 10), repr(ledger)
        assert all(_mapping_of(m.body) is None for b in got for m in b.messages)
        # the server scribbles over its whole arena: the client's batches do not change
        _host(arena.allocation.array)[:] = 0xAB
        assert DeviceBatch.to_table(got).equals(expected)
        # the arena stays mapped here for the next stream, and is unmapped once idle long enough
        segment = _arena_segment(srv)
        assert _segment_count(segment) == 2
        assert await eventually(lambda: _unmapped(segment, 1), 10), "the client kept its mapping"


class _StubRuntime:
    """What the CUDA runtime does with IPC handles, enough to check the CuPy backend's bookkeeping without a
    device: a handle is mapped at most once per process (``cudaErrorAlreadyMapped`` otherwise)."""

    def __init__(self) -> None:
        self.mapped: dict[bytes, int] = {}
        self.opened: list[bytes] = []
        self.closed: list[int] = []

    def getDeviceCount(self) -> int:
        return 1

    def ipcOpenMemHandle(self, handle: bytes) -> int:
        if handle in self.mapped:
            raise RuntimeError("cudaErrorAlreadyMapped: the handle is already open in this process")
        if handle.startswith(b"\xff"):
            raise RuntimeError("cudaErrorInvalidValue")
        self.mapped[handle] = ptr = 0x7F0000000000 + 0x10000000 * len(self.opened)
        self.opened.append(handle)
        return ptr

    def ipcCloseMemHandle(self, ptr: int) -> None:
        handle = next(h for h, p in self.mapped.items() if p == ptr)  # StopIteration: not open
        del self.mapped[handle]
        self.closed.append(ptr)


def test_cupy_shares_one_mapping_of_a_handle_between_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    # A client may read two streams of one server at once (or hold zero-copy batches of one while it reads the
    # next): both open the server's handle, which CUDA maps once per process.
    runtime = _StubRuntime()
    cuda = types.SimpleNamespace(
        runtime=runtime,
        UnownedMemory=lambda ptr, size, owner: (ptr, size, owner),
        MemoryPointer=lambda memory, offset: (memory, offset),
    )
    stub = types.SimpleNamespace(
        cuda=cuda,
        uint8=np.uint8,
        empty=lambda n, dtype=None: None,
        ndarray=lambda shape, dtype=None, memptr=None: ("ndarray", shape, memptr),
    )
    monkeypatch.setitem(sys.modules, "cupy", stub)
    backend = CupyBackend()
    first, second = b"\x01" * 64, b"\x02" * 64
    a = backend.open_ipc(first, 4096)
    b = backend.open_ipc(first, 1024)  # the same handle again, the first still open
    c = backend.open_ipc(second, 64)
    assert a.ptr == b.ptr != c.ptr and (a.nbytes, b.nbytes) == (4096, 1024)
    assert runtime.opened == [first, second]
    a.close()
    a.close()  # closing twice lets go once
    assert runtime.closed == []
    b.close()
    assert runtime.closed == [a.ptr]
    again = backend.open_ipc(first, 4096)  # mapped anew once nobody uses it
    assert runtime.opened == [first, second, first]
    with pytest.raises(ResourceError, match="cannot open the CUDA IPC handle"):
        backend.open_ipc(b"\xff" * 64, 64)
    with pytest.raises(ResourceError, match="cannot open the CUDA IPC handle"):
        backend.open_ipc(b"\xff" * 64, 64)  # a failed open leaves nothing behind
    again.close()
    c.close()
    assert runtime.mapped == {}


# ---------------------------------------------------------------------------- (3) the choice of landing


COSTS = [
    # dataset, body, landing, zero copy: what the client does to land the stream
    pytest.param("table", "packed", "device", False, {"upload": "bodies"}, id="packed-device"),
    pytest.param("table", "cuda", "device", True, {"open_ipc": 1}, id="cuda-device-zc"),
    pytest.param("table", "cuda", "device", False, {"open_ipc": 1, "copy": "ranges"}, id="cuda-device-copy"),
    pytest.param("table", "cuda", "host", False, {"open_ipc": 1, "download": "ranges"}, id="cuda-host"),
    pytest.param("table", "cuda", "host", True, {"open_ipc": 1, "download": "ranges"}, id="cuda-host-zc"),
    pytest.param("table", "shm", "device", False, {"upload": "bodies"}, id="shm-device-copy"),
    pytest.param("table", "shm", "device", True, {"upload": "bodies"}, id="shm-device-zc"),
    pytest.param("table", "shm", "host", True, {}, id="shm-host-zc"),
    pytest.param("device", "packed", "device", False, {"upload": "bodies"}, id="device-packed-device"),
    pytest.param("device", "packed", "host", False, {}, id="device-packed-host"),
]


def test_the_counting_backend_tells_the_sides_apart() -> None:
    backend = CountingFake()
    with use_backend(backend):
        backend.upload(b"abc")

        def in_server_thread() -> None:
            backend.download(backend.upload(b"xyz"))

        t = threading.Thread(target=in_server_thread, name="e2e-server")
        t.start()
        t.join()
    assert backend.calls("client") == {"upload": 1}
    assert backend.calls("server") == {"upload": 1, "download": 1}


@pytest.mark.parametrize(("dataset", "body", "landing", "zero_copy", "cost"), COSTS)
async def test_the_choice_of_landing(
    fake: CountingFake,
    expected: pa.Table,
    dataset: str,
    body: str,
    landing: str,
    zero_copy: bool,
    cost: dict[str, Any],
) -> None:
    bodies, ranges = _stream_cost(expected)
    per = {"bodies": bodies, "ranges": ranges}
    want = {op: per.get(n, n) for op, n in cost.items()}
    source = DeviceBatch.from_table(expected) if dataset == "device" else expected
    kind, memory = BODIES[body]
    with ServerThread({TICKET: source}, body=kind, memory=memory, arena_bytes=8 << 20) as st:
        fake.reset()
        # the landing's own cost: content validation (a host copy of each body, tested below) is off
        options = ClientOptions(landing=landing, zero_copy=zero_copy, timeout=20, validate=False)
        batches = [b async for b in stream_batches(st.uri, TICKET, data_uri=st.data_uri, options=options)]
        client, server = fake.calls("client"), fake.calls("server")
        assert client == want
        # the server's side: a device dataset goes through the host on TCP; a host table into a cuda arena
        # is uploaded there, buffer by buffer
        if dataset == "device" and body == "packed":
            assert server == {"download": bodies}
        elif body == "cuda":
            assert server == {"upload_into": ranges}
        else:
            assert server == {}
        if landing == "device":
            assert all(isinstance(b, DeviceBatch) for b in batches)
            got = DeviceBatch.to_table(batches)
        else:
            assert all(type(b) is pa.RecordBatch for b in batches)
            got = pa.Table.from_batches(batches)
        assert got.equals(expected)
        if memory is not None:
            placements = st.server.placements
            del batches, got
            gc.collect()
            assert await eventually(lambda: placements.held_bytes == 0, 10)


# --------------------------------------------------------------------------------- (4) arena accounting


@pytest.mark.parametrize("memory", ["cuda", "shm"])
async def test_a_device_dataset_is_placed_once_for_every_client(
    fake: CountingFake, expected: pa.Table, memory: str
) -> None:
    bodies, ranges = _stream_cost(expected)
    source = DeviceBatch.from_table(expected)
    with ServerThread({TICKET: source}, body="pairs", memory=memory, arena_bytes=8 << 20) as st:
        srv = st.server
        fake.reset()
        first = await fetch_device_async(st.uri, TICKET, options=ClientOptions(timeout=20))
        assert DeviceBatch.to_table(first).equals(expected)
        # placed once: each body whole (one copy and one allocation) device-to-device into a cuda arena,
        # through the host into a shm one (an allocation per buffer)
        assert fake.calls("server") == ({"copy": bodies} if memory == "cuda" else {"download": bodies})
        placed, allocations = srv.placements.placed, srv.arena.allocations
        assert placed == bodies and srv.placements.hits == 0
        assert allocations == (bodies if memory == "cuda" else ranges)
        fake.reset()
        # two more clients, landing elsewhere: listed from the resident placements, nothing copied again
        second = await fetch_async(st.uri, TICKET, options=ClientOptions(timeout=20))
        third = await fetch_device_async(st.uri, TICKET, options=ClientOptions(zero_copy=True, timeout=20))
        assert second.equals(expected) and DeviceBatch.to_table(third).equals(expected)
        assert fake.calls("server") == {}
        assert srv.placements.placed == placed and srv.arena.allocations == allocations
        assert srv.placements.hits == 2 * bodies
        placements = srv.placements
        del first, second, third
        gc.collect()
        assert await eventually(lambda: placements.held_bytes == 0, 10)


async def test_a_small_cuda_arena_serves_a_larger_device_dataset(fake: CountingFake) -> None:
    rows, count, window = 100_000, 24, 3  # 24 batches of 800 KB through a 4 MiB arena
    table = pa.Table.from_batches(
        [pa.record_batch({"id": np.arange(b * rows, (b + 1) * rows)}) for b in range(count)]
    )
    source = DeviceBatch.from_table(table)
    assert sum(b.nbytes for b in source) > 4 * (4 << 20)
    async with Server({TICKET: source}, body="pairs", memory="cuda", arena_bytes=4 << 20) as srv:
        arena, placements = srv.arena, srv.placements
        assert arena is not None and placements is not None
        copied = await fetch_device_async(srv.uri, TICKET, options=ClientOptions(timeout=20))
        assert DeviceBatch.to_table(copied).equals(table)
        del copied
        # the last batches stay resident, nobody holding them: the next stream must evict them to get through
        await _held_until_released(srv)
        assert placements.idle_bytes > 0
        evicted = placements.evicted

        # Zero-copy, holding the last few batches: evictions go on, and never touch a batch still held.
        held: list[tuple[int, DeviceBatch]] = []
        n = 0
        options = ClientOptions(landing="device", zero_copy=True, timeout=20)
        async for batch in stream_batches(srv.uri, TICKET, options=options):
            assert isinstance(batch, DeviceBatch)
            held.append((n, batch))
            n += 1
            del batch
            assert arena.used_bytes <= arena.capacity
            if len(held) > window:
                k, old = held.pop(0)
                # placed after it: `window` batches, in the same small arena
                assert np.array_equal(
                    np.asarray(old.column("id").data.host), np.arange(k * rows, (k + 1) * rows)
                )
                del old
        assert n == count
        for k, old in held:
            assert np.array_equal(np.asarray(old.column("id").data.host), np.arange(k * rows, (k + 1) * rows))
        assert placements.evicted > evicted, "resident placements must make room for later batches"
        del held, old
        await _held_until_released(srv)


# ------------------------------------------------------------------------------------ (5) two processes


def _fake_segments() -> set[str]:
    """The fake device segments in /dev/shm now (other processes may have some: compare names)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("dissoc-fakedev-")}


def _segments_of(pid: int) -> set[str]:
    return {name for *_, name in _shm_mappings(pid) if name.startswith("dissoc-fakedev-")}


def _poll(predicate: Any, seconds: float) -> bool:
    """Poll ``predicate`` until it is true or ``seconds`` pass (for synchronous tests)."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() >= deadline:
            return bool(predicate())
        time.sleep(0.02)
    return True


def test_a_device_server_in_another_process(
    fake: CountingFake,
    stream_file: Path,
    expected: pa.Table,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bodies, ranges = _stream_cost(expected)
    monkeypatch.setenv(ENV_VAR, "fake")  # for the subprocesses; this one uses `fake`
    args = ["--device", "--body", "pairs", "--memory", "cuda", str(stream_file)]
    before = _fake_segments()
    owned: set[str] = set()
    try:
        with cli_server(*args, count=1) as (proc, lines):
            line = lines[0]
            assert line["ticket"] == "dicts"
            uri, data_uri = line["uri"], line["data_uri"]
            data = DissocURI.parse(data_uri)
            assert data.memory == "cuda" and data.remote_handle is not None and "cuda_length" in data.params
            owned = _segments_of(proc.pid)  # the server's fake device memory: its arena
            segment = data.remote_handle[len(FAKE_HANDLE_MAGIC) :].rstrip(b"\0").decode()
            assert owned == {segment} and not owned & before and owned <= _fake_segments()

            # zero-copy device landing: views of this process's mapping of the server's arena, nothing copied
            fake.reset()
            trusting = ClientOptions(zero_copy=True, timeout=20, validate=False)  # no host check copies
            zc = fetch_device(uri, "dicts", data_uri=data_uri, options=trusting)
            assert fake.calls() == {"open_ipc": 1}
            assert all(_mapping_of(m.body).name == segment for b in zc for m in b.messages)
            assert all(_segment_at(m.body.data_ptr, m.body.nbytes) == segment for b in zc for m in b.messages)
            assert DeviceBatch.to_table(zc).equals(expected)
            # device landing by copy (device-to-device: the server placed each body whole, so one copy per
            # body), and host landing
            fake.reset()
            copied = fetch_device(
                uri, "dicts", data_uri=data_uri, options=ClientOptions(timeout=20, validate=False)
            )
            assert fake.calls() == {"copy": bodies}  # the mapping the first stream made is kept
            assert all(_mapping_of(m.body) is None for b in copied for m in b.messages)
            assert DeviceBatch.to_table(copied).equals(expected)
            fake.reset()
            assert fetch(uri, "dicts", data_uri=data_uri).equals(expected)
            assert fake.calls() == {"download": ranges}
            with open_stream(
                uri, "dicts", data_uri=data_uri, options=ClientOptions(landing="device")
            ) as reader:
                assert reader.read_all().equals(expected)
            # the server's arena stays mapped here while zero-copy batches use it, and for the next stream
            # after; unmapped once idle long enough (MAPPINGS.clear: what the idle time-out does)
            assert _segment_count(segment) == 1
            del zc, copied
            gc.collect()
            assert _poll(lambda: _unmapped(segment, 0), 10), "the client kept its mapping"

            # `dissoc get` landing on the device, zero-copy, written to a file
            out = tmp_path / "out.arrows"  # a stream: the IPC file format cannot replace a dictionary
            got = subprocess.run(
                [
                    *(PYTHON, "-m", "dissoc.cli", "get", uri, "dicts", "--data-uri", data_uri),
                    *("--landing", "device", "--zero-copy", "-o", str(out), "--no-progress"),
                ],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert got.returncode == 0, got.stderr
            assert "Traceback" not in got.stderr
            summary = json.loads(got.stdout)
            assert summary["rows"] == expected.num_rows and summary["batches"] == len(expected.to_batches())
            assert summary["output"] == str(out)
            assert pa.ipc.open_stream(out).read_all().equals(expected)

            # the server still serves, then stops cleanly on SIGTERM and leaves no fake device memory behind
            assert fetch(uri, "dicts", data_uri=data_uri).equals(expected)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=20)
            assert proc.returncode == 0, err.decode()[-2000:]
            assert b"Traceback" not in err
        left = owned & _fake_segments()
        assert not left, f"the server left its fake device memory behind: {left}"
    finally:
        for name in owned & _fake_segments():  # a server killed by a failing test cannot unlink them
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", name))


def _unmapped(segment: str, count: int) -> bool:
    """Unmap what nobody uses (what the idle time-out of dissoc.memory.mappings does), then whether
    ``segment`` is mapped ``count`` times here."""
    MAPPINGS.clear()
    return _segment_count(segment) == count


def _segment_count(segment: str) -> int:
    return sum(1 for *_, name in _shm_mappings() if name == segment)


# ------------------------------------------------------------------------------------------- (6) errors


async def test_device_landing_without_a_device_names_the_gpu_extra(
    no_device: None, expected: pa.Table
) -> None:
    async with Server({TICKET: expected}) as srv:
        options = ClientOptions(landing="device", timeout=10)
        with pytest.raises(ResourceError, match=r"dissoc\[gpu\]"):
            async for _ in stream_batches(srv.uri, TICKET, options=options):
                pass
        with pytest.raises(ResourceError, match=r"dissoc\[gpu\]"):
            await fetch_device_async(srv.uri, TICKET)
        with pytest.raises(ResourceError, match=r"dissoc\[gpu\]"):
            DeviceBatch.from_table(expected)
        # the server is unharmed; host landing works
        assert (await fetch_async(srv.uri, TICKET)).equals(expected)


def test_synchronous_device_landing_without_a_device(no_device: None, expected: pa.Table) -> None:
    with ServerThread({TICKET: expected}) as st:
        with pytest.raises(ResourceError, match=r"dissoc\[gpu\]"):
            fetch_device(st.uri, TICKET)
        with (
            pytest.raises(ResourceError, match=r"dissoc\[gpu\]"),
            open_stream(st.uri, TICKET, options=ClientOptions(landing="device")) as reader,
        ):
            reader.read_all()
        assert fetch(st.uri, TICKET).equals(expected)


def test_a_cuda_arena_without_a_device_names_the_gpu_extra(no_device: None) -> None:
    with pytest.raises(ResourceError, match=r"memory=cuda.*dissoc\[gpu\]"):
        Server({}, body="pairs", memory="cuda")


@pytest.mark.parametrize(
    "args",
    [
        ["--body", "pairs", "--memory", "cuda"],
        ["--device"],
        ["--device", "--body", "pairs", "--memory", "shm"],
    ],
    ids=["memory-cuda", "device", "device-shm"],
)
def test_cli_serve_without_a_device_exits_1(
    no_cupy_env: dict[str, str], tmp_path: Path, args: list[str]
) -> None:
    path = tmp_path / "x.arrow"
    with pa.ipc.new_file(path, pa.schema([("a", pa.int64())])) as w:
        w.write_table(pa.table({"a": [1, 2]}))
    r = subprocess.run(
        [PYTHON, "-m", "dissoc.cli", "serve", *args, str(path)],
        cwd=REPO,
        env=no_cupy_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "dissoc[gpu]" in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""


def test_cli_get_landing_on_a_device_without_one_exits_1(
    no_cupy_env: dict[str, str], expected: pa.Table
) -> None:
    with ServerThread({TICKET: expected}) as st:
        r = subprocess.run(
            [PYTHON, "-m", "dissoc.cli", "get", st.uri, TICKET, "--landing", "device", "--no-progress"],
            cwd=REPO,
            env=no_cupy_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "dissoc[gpu]" in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""


async def test_landing_must_be_host_or_device(fake: CountingFake, expected: pa.Table) -> None:
    async with Server({TICKET: expected}) as srv:
        with pytest.raises(DissocError, match=r"'host' or 'device'.*'elsewhere'"):
            async for _ in stream_batches(srv.uri, TICKET, options=ClientOptions(landing="elsewhere")):
                pass
        with pytest.raises(DissocError, match="fetch_device"):
            await fetch_async(srv.uri, TICKET, options=ClientOptions(landing="device"))
    with ServerThread({TICKET: expected}) as st, pytest.raises(DissocError, match="fetch_device"):
        fetch(st.uri, TICKET, options=ClientOptions(landing="device"))


@pytest.mark.parametrize("dataset", ["table", "device"])
async def test_compressed_bodies_cannot_land_on_the_device(
    fake: CountingFake, stream_file: Path, expected: pa.Table, dataset: str
) -> None:
    source = _source(dataset, stream_file, expected, fake)
    async with Server({TICKET: source}, compression="lz4") as srv:
        with pytest.raises(CodecError, match="compressed"):
            await fetch_device_async(srv.uri, TICKET, options=ClientOptions(timeout=10))
        # host landing decompresses, and the server is unharmed
        assert (await fetch_async(srv.uri, TICKET)).equals(expected)
        with pytest.raises(CodecError, match="compressed"):
            async for _ in stream_batches(srv.uri, TICKET, options=ClientOptions(landing="device")):
                pass


def _stream_with_bad_offsets(path: Path) -> None:
    """An IPC stream whose string column's last offset points past its data (written, then damaged)."""
    strings = ["x" * i for i in range(1, 101)]
    table = pa.table({"id": pa.array(range(100), pa.int64()), "s": pa.array(strings)})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    raw = bytearray(sink.getvalue().to_pybytes())
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in strings])]).astype("<i4").tobytes()
    at = raw.find(offsets)
    assert at >= 0 and raw.find(offsets, at + 1) < 0
    raw[at + len(offsets) - 4 : at + len(offsets)] = (1 << 20).to_bytes(4, "little")
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("body", ["packed", "cuda", "shm"])
@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zc"])
async def test_device_landing_checks_contents_as_host_landing_does(
    fake: CountingFake, tmp_path: Path, body: str, zero_copy: bool
) -> None:
    # the server forwards a stored stream as it is, so a damaged one reaches the client
    path = tmp_path / "bad.arrows"
    _stream_with_bad_offsets(path)
    kind, memory = BODIES[body]
    with ServerThread({TICKET: path}, body=kind, memory=memory, arena_bytes=8 << 20) as st:
        for landing in ("host", "device"):
            options = ClientOptions(landing=landing, zero_copy=zero_copy, timeout=20)
            with pytest.raises(CodecError, match="offsets"):
                async for _ in stream_batches(st.uri, TICKET, data_uri=st.data_uri, options=options):
                    pass
        # validation off (trusted servers): the device batch is handed out, its metadata still checked
        trusting = ClientOptions(landing="device", zero_copy=zero_copy, timeout=20, validate=False)
        got = [b async for b in stream_batches(st.uri, TICKET, data_uri=st.data_uri, options=trusting)]
        assert [b.num_rows for b in got] == [100]


@pytest.mark.parametrize("columns", ["fixed-width", "strings-and-dictionaries"])
async def test_device_validation_copies_only_what_has_contents_to_check(
    fake: CountingFake, expected: pa.Table, columns: str
) -> None:
    table = pa.table({"a": pa.array(range(4096), pa.int64()), "b": pa.array(range(4096), pa.float64())})
    table = table if columns == "fixed-width" else expected
    bodies, _ = _stream_cost(table)
    with ServerThread({TICKET: table}, body="pairs", memory="cuda", arena_bytes=8 << 20) as st:
        fake.reset()
        options = ClientOptions(landing="device", zero_copy=True, timeout=20)
        got = [b async for b in stream_batches(st.uri, TICKET, data_uri=st.data_uri, options=options)]
        # fixed-width columns: nothing to check beyond the metadata's sizes, so nothing leaves the device;
        # otherwise each body is copied to the host once and checked there
        want = {"open_ipc": 1} if columns == "fixed-width" else {"open_ipc": 1, "download": bodies}
        assert fake.calls("client") == want
        assert DeviceBatch.to_table(got).equals(table)


@pytest.mark.parametrize("damage", ["handle-63-bytes", "no-cuda-length"])
@pytest.mark.parametrize("landing", ["host", "device"])
async def test_a_damaged_cuda_data_uri_is_refused_before_anything_is_mapped(
    fake: CountingFake, expected: pa.Table, damage: str, landing: str
) -> None:
    async with Server({TICKET: expected}, body="pairs", memory="cuda", arena_bytes=1 << 20) as srv:
        data = DissocURI.parse(srv.data_uri)
        assert data.remote_handle is not None
        if damage == "handle-63-bytes":
            bad = dataclasses.replace(data, remote_handle=data.remote_handle[:63])
            match = "64-byte CUDA IPC handle as remote_handle, got 63 bytes"
        else:
            params = {k: v for k, v in data.params.items() if k != "cuda_length"}
            bad = dataclasses.replace(data, params=params)
            match = "cuda_length"
        bad = DissocURI.parse(str(bad))  # as a client would get it
        fake.reset()
        with pytest.raises(ProtocolError, match=match):
            async for _ in stream_batches(
                srv.uri, TICKET, data_uri=bad, options=ClientOptions(landing=landing, timeout=10)
            ):
                pass
        assert fake.calls() == {}  # nothing opened, mapped or copied
        assert srv.placements is not None and srv.placements.placed == 0  # nothing was even asked for
        good = await fetch_async(srv.uri, TICKET, data_uri=srv.data_uri)
        assert good.equals(expected)


# -------------------------------------------------------------------------- (9) the path bodies took


def _host_copy_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "dissoc.client"
        and r.levelno == logging.WARNING
        and "uploaded to the device" in r.getMessage()
    ]


@pytest.mark.parametrize("body", ["packed", "shm"])
async def test_device_landing_through_host_memory_is_warned_once_counted_or_refused(
    fake: CountingFake, expected: pa.Table, caplog: pytest.LogCaptureFixture, body: str
) -> None:
    kind, memory = BODIES[body]
    async with Server({TICKET: expected}, body=kind, memory=memory, arena_bytes=8 << 20) as srv:
        copies = CLIENT.device_host_copies.value("tcp", kind)
        stats = FetchStats()
        options = ClientOptions(landing="device", timeout=20)
        with caplog.at_level(logging.WARNING, logger="dissoc.client"):
            got = [
                b
                async for b in stream_batches(
                    srv.uri, TICKET, data_uri=srv.data_uri, options=options, stats=stats
                )
            ]
        assert DeviceBatch.to_table(got).equals(expected)
        assert len(got) == 4
        shared = None if memory is None else "shared"
        assert stats.paths == [FetchPath("tcp", "tcp", (), kind, memory, shared, ("host-copy",))]
        assert stats.path is not None and stats.path.host_copy
        # once for the stream, not once per batch; it says what to do instead
        (warning,) = _host_copy_warnings(caplog)
        assert "host memory" in warning and "ucx://" in warning and "--memory cuda" in warning
        assert CLIENT.device_host_copies.value("tcp", kind) == copies + 1
        del got

        # required: the stream fails before its first batch is handed out, and is counted as such
        failed = CLIENT.streams_failed.value("tcp", "device_path")
        caplog.clear()
        handed: list[Any] = []
        required = dataclasses.replace(options, require_device_path=True)
        with (
            caplog.at_level(logging.WARNING, logger="dissoc.client"),
            pytest.raises(DevicePathError, match=r"require_device_path: .*host memory.*--memory cuda"),
        ):
            async for batch in stream_batches(srv.uri, TICKET, data_uri=srv.data_uri, options=required):
                handed.append(batch)
        assert handed == []
        assert CLIENT.streams_failed.value("tcp", "device_path") == failed + 1
        assert CLIENT.device_host_copies.value("tcp", kind) == copies + 2
        assert _host_copy_warnings(caplog) == []  # the error says it all
        if memory is not None:
            await _held_until_released(srv)  # the refused stream's ranges went back


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zc"])
async def test_device_landing_from_cuda_pairs_takes_no_host_path(
    fake: CountingFake, expected: pa.Table, caplog: pytest.LogCaptureFixture, zero_copy: bool
) -> None:
    async with Server({TICKET: expected}, body="pairs", memory="cuda", arena_bytes=8 << 20) as srv:
        copies = CLIENT.device_host_copies.total()
        stats = FetchStats()
        options = ClientOptions(landing="device", zero_copy=zero_copy, require_device_path=True, timeout=20)
        with caplog.at_level(logging.WARNING, logger="dissoc.client"):
            got = [
                b
                async for b in stream_batches(
                    srv.uri, TICKET, data_uri=srv.data_uri, options=options, stats=stats
                )
            ]
        assert DeviceBatch.to_table(got).equals(expected)
        way = "cuda-ipc-view" if zero_copy else "cuda-ipc-copy"
        assert stats.paths == [FetchPath("tcp", "tcp", (), "pairs", "cuda", "shared", (way,))]
        assert stats.path is not None and not stats.path.host_copy
        assert _host_copy_warnings(caplog) == []
        assert CLIENT.device_host_copies.total() == copies
        del got
        await _held_until_released(srv)


# ------------------------------------------------------------------------------------------------- GPU


@pytest.fixture
def cupy_counting() -> Iterator[CountingCupy]:
    with use_backend(CountingCupy()) as backend:
        assert isinstance(backend, CountingCupy)
        yield backend


def _gpu_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}  # CuPy, the default
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _assert_cupy_batches(batches: Sequence[Any], expected: pa.Table) -> None:
    import cupy

    assert all(isinstance(b, DeviceBatch) for b in batches)
    assert all(isinstance(m.body, cupy.ndarray) for b in batches for m in b.messages)
    for b, w in zip(batches, expected.to_batches(), strict=True):
        ids = b.column("id").data
        assert isinstance(ids, cupy.ndarray)
        assert cupy.asnumpy(ids).tolist() == _ids(w)


@pytest.mark.gpu
@pytest.mark.ucx
async def test_gpu_packed_over_ucx_device_to_device(cupy_counting: CountingCupy, expected: pa.Table) -> None:
    source = DeviceBatch.from_table(expected)
    async with Server({TICKET: source}, transport="ucx") as srv:
        cupy_counting.reset()
        got = await fetch_device_async(srv.uri, TICKET, options=ClientOptions(timeout=30, validate=False))
        # sent from device memory, received into device memory: no copy through the host on either side
        assert cupy_counting.calls() == {}
        _assert_cupy_batches(got, expected)
        assert DeviceBatch.to_table(got).equals(expected)


@pytest.mark.gpu
@pytest.mark.parametrize("transport", [pytest.param("ucx", marks=pytest.mark.ucx), "tcp"])
async def test_gpu_host_server_to_device_client(
    cupy_counting: CountingCupy, expected: pa.Table, transport: str
) -> None:
    bodies, _ = _stream_cost(expected)
    async with Server({TICKET: expected}, transport=transport) as srv:
        cupy_counting.reset()
        got = await fetch_device_async(srv.uri, TICKET, options=ClientOptions(timeout=30, validate=False))
        # UCX receives straight into device memory; TCP receives on the host, then one upload per body
        assert cupy_counting.calls() == ({} if transport == "ucx" else {"upload": bodies})
        _assert_cupy_batches(got, expected)
        assert DeviceBatch.to_table(got).equals(expected)


@pytest.mark.gpu
@pytest.mark.parametrize("transport", [pytest.param("ucx", marks=pytest.mark.ucx), "tcp"])
async def test_gpu_device_server_to_host_client(
    cupy_counting: CountingCupy, expected: pa.Table, transport: str
) -> None:
    bodies, _ = _stream_cost(expected)
    source = DeviceBatch.from_table(expected)
    async with Server({TICKET: source}, transport=transport) as srv:
        cupy_counting.reset()
        got = await fetch_async(srv.uri, TICKET, options=ClientOptions(timeout=30))
        # UCX sends from device memory to the client's host memory; on TCP the server downloads each body
        assert cupy_counting.calls() == ({} if transport == "ucx" else {"download": bodies})
        assert got.equals(expected)


@contextlib.contextmanager
def _gpu_cli_server(*args: str) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, Any]]]:
    proc = subprocess.Popen(
        [PYTHON, "-m", "dissoc.cli", "serve", *args],
        cwd=REPO,
        env=_gpu_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        yield proc, json.loads(read_lines(proc, 1, 120)[0])
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert b"Traceback" not in err


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_gpu_cuda_ipc_pairs_from_a_cli_server(
    cupy_counting: CountingCupy, stream_file: Path, expected: pa.Table
) -> None:
    bodies, ranges = _stream_cost(expected)
    args = ["--device", "--body", "pairs", "--memory", "cuda", str(stream_file)]
    with _gpu_cli_server(*args) as (proc, line):
        uri, data_uri, ticket = line["uri"], line["data_uri"], line["ticket"]
        data = DissocURI.parse(data_uri)
        assert data.memory == "cuda" and data.remote_handle is not None and len(data.remote_handle) == 64
        # The client process maps the server's handle once, on its first stream, and keeps the mapping for the
        # streams after it (dissoc.memory.mappings), zero-copy, copying and host landings alike.
        opened = MAPPINGS.opened
        for i in range(3):
            mapped = {"open_ipc": 1} if i == 0 else {}
            cupy_counting.reset()
            # (content validation, a host copy per body, is off: these count the landing's own transfers)
            trusting = ClientOptions(zero_copy=True, timeout=30, validate=False)
            zc = fetch_device(uri, ticket, data_uri=data_uri, options=trusting)
            assert cupy_counting.calls() == mapped  # views of the server's allocation: no copy
            _assert_cupy_batches(zc, expected)
            assert DeviceBatch.to_table(zc).equals(expected)
            cupy_counting.reset()
            copied = fetch_device(
                uri, ticket, data_uri=data_uri, options=ClientOptions(timeout=30, validate=False)
            )
            assert cupy_counting.calls() == {"copy": bodies}  # device-to-device, each body whole
            _assert_cupy_batches(copied, expected)
            assert DeviceBatch.to_table(copied).equals(expected)
            cupy_counting.reset()
            host = fetch(uri, ticket, data_uri=data_uri, options=ClientOptions(timeout=30))
            assert cupy_counting.calls() == {"download": ranges}
            assert host.equals(expected)
            del zc, copied, host
            gc.collect()
        assert MAPPINGS.opened == opened + 1
        _stop(proc)
    # the handles were let go of: a new server on the same data starts, serves, and stops cleanly
    with _gpu_cli_server(*args) as (proc, line):
        again = fetch_device(
            line["uri"], line["ticket"], data_uri=line["data_uri"], options=ClientOptions(zero_copy=True)
        )
        assert DeviceBatch.to_table(again).equals(expected)
        del again
        gc.collect()
        _stop(proc)


_SMALL_ARENA_SERVER = """
import asyncio, json, signal, sys
import numpy as np
import pyarrow as pa
from dissoc.device import DeviceBatch
from dissoc.server import Server

async def main():
    rows, count = int(sys.argv[1]), int(sys.argv[2])
    batches = [pa.record_batch({"id": np.arange(b * rows, (b + 1) * rows)}) for b in range(count)]
    source = DeviceBatch.from_batches(batches[0].schema, batches)
    async with Server({"t": source}, body="pairs", memory="cuda", arena_bytes=int(sys.argv[3])) as srv:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        print(json.dumps({"uri": srv.uri, "data_uri": srv.data_uri}), flush=True)
        await stop.wait()

asyncio.run(main())
"""


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_gpu_free_data_lets_a_stream_larger_than_the_arena_through(cupy_counting: CountingCupy) -> None:
    import cupy

    # 48 batches of 1 MiB through a 16 MiB device arena, in one stream: only free_data makes room
    rows, count, arena = 1 << 17, 48, 16 << 20
    proc = subprocess.Popen(
        [PYTHON, "-c", _SMALL_ARENA_SERVER, str(rows), str(count), str(arena)],
        cwd=REPO,
        env=_gpu_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        line = json.loads(read_lines(proc, 1, 120)[0])
        for zero_copy, landing in ((True, "device"), (False, "device"), (False, "host"), (True, "device")):
            options = ClientOptions(zero_copy=zero_copy, landing=landing, timeout=30)
            n = 0
            with open_stream(line["uri"], "t", data_uri=line["data_uri"], options=options) as reader:
                for batch in reader:
                    if isinstance(batch, DeviceBatch):
                        values = cupy.asnumpy(batch.column("id").data)
                    else:
                        values = batch.column("id").to_numpy()
                    assert np.array_equal(values, np.arange(n * rows, (n + 1) * rows))
                    n += 1
                    del batch
            assert n == count
            gc.collect()
        _stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
