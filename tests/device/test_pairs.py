"""Pairs with ``memory=cuda``: the device arena, handle encoding, and the client's reader, on the CPU.

Everything here runs with :class:`~dissoc.memory.cuda.FakeDeviceBackend` (host shared memory posing as
device memory, with 64-byte handles another process can open); the ``gpu``-marked tests repeat the essentials
with CuPy and real CUDA IPC handles where a device exists.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import textwrap
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from dissoc.data_server import DataServer
from dissoc.datasets import Catalog
from dissoc.errors import DissocError, ProtocolError, ResourceError
from dissoc.memory import cuda as device_mod
from dissoc.memory.arena import Body
from dissoc.memory.cuda import (
    ENV_VAR,
    FAKE_HANDLE_MAGIC,
    IPC_HANDLE_BYTES,
    CupyBackend,
    FakeDeviceArray,
    FakeDeviceBackend,
    check_ipc_handle,
    use_backend,
)
from dissoc.memory.cuda_arena import DeviceArena
from dissoc.memory.pairs import ServedArena, cuda_region, open_pair_reader
from dissoc.memory.shm import ShmArena
from dissoc.protocol import PairList, decode_pairs, encode_pairs
from dissoc.server.role import ServeOptions
from dissoc.uri import DissocURI

ROOT = Path(__file__).resolve().parents[2]


# -- helpers -------------------------------------------------------------------------------------------------


@pytest.fixture
def fake() -> Iterator[FakeDeviceBackend]:
    with use_backend(FakeDeviceBackend()) as backend:
        assert isinstance(backend, FakeDeviceBackend)
        yield backend


def _segment(handle: bytes) -> Path:
    """Where a fake-device handle's segment lives."""
    assert handle.startswith(FAKE_HANDLE_MAGIC)
    return Path("/dev/shm") / handle[len(FAKE_HANDLE_MAGIC) :].rstrip(b"\0").decode()


def _down(backend: Any, array: Any) -> bytes:
    return bytes(backend.download(array).tobytes())


def _ptr(array: Any) -> int:
    return int(array.data_ptr) if isinstance(array, FakeDeviceArray) else int(array.data.ptr)


def _pairs(rows: list[tuple[int, int]] | list[list[int]]) -> PairList:
    """A pair list as the client gets it: encoded and decoded."""
    return decode_pairs(encode_pairs([(int(a), int(n)) for a, n in rows]))


def _payload(seed: int, n: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _cuda_uri(handle: bytes, length: int, **params: str) -> DissocURI:
    return DissocURI(
        "tcp",
        "127.0.0.1",
        9,
        1,
        2,
        remote_handle=handle,
        memory="cuda",
        params={"cuda_length": str(length), **params},
    )


class _Counting(FakeDeviceBackend):
    """A fake device that counts what touches the memory (to prove that nothing was mapped or copied)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}

    def _count(self, what: str) -> None:
        self.calls[what] = self.calls.get(what, 0) + 1

    def open_ipc(self, handle: bytes, nbytes: int) -> Any:
        self._count("open_ipc")
        return super().open_ipc(handle, nbytes)

    def view(self, allocation: Any, offset: int, length: int, owner: Any = None) -> Any:
        self._count("view")
        return super().view(allocation, offset, length, owner)

    def download(self, array: Any, out: Any = None) -> Any:
        self._count("download")
        return super().download(array, out)

    def copy(self, dst: Any, src: Any) -> None:
        self._count("copy")
        super().copy(dst, src)

    def empty(self, nbytes: int) -> Any:
        self._count("empty")
        return super().empty(nbytes)


# -- DeviceArena: accounting ---------------------------------------------------------------------------------


def test_arena_allocate_release_alignment(fake: FakeDeviceBackend) -> None:
    with DeviceArena.create(1000) as arena:
        assert arena.capacity == 1024 and arena.backend is fake
        assert len(arena.handle) == IPC_HANDLE_BYTES and _segment(arena.handle).exists()
        a = arena.allocate(1)
        b = arena.allocate(65)
        c = arena.allocate(100, alignment=256)
        assert (a, b, c) == (0, 64, 256)
        assert [arena.allocation_size(o) for o in (a, b, c)] == [64, 128, 128]
        assert arena.used_bytes == 320 and arena.allocations == 3
        assert arena.free_bytes == 1024 - 320
        assert arena.try_allocate(1024) is None
        with pytest.raises(ResourceError, match="room"):
            arena.allocate(1024 - 128)
        with pytest.raises(ResourceError, match="capacity"):
            arena.allocate(1025)
        with pytest.raises(ValueError, match="alignment"):
            arena.allocate(64, alignment=96)
        assert arena.release(b) == 128
        with pytest.raises(ValueError, match="double release"):
            arena.release(b)
        with pytest.raises(ValueError, match="distinct"):
            arena.release_many([a, a])
        assert arena.allocations == 2  # a failed release_many releases nothing
        assert arena.release_many([a, c]) == 192
        assert arena.used_bytes == 0 and arena.largest_free_block == 1024  # neighbours coalesced
    assert arena.closed and not _segment(arena.handle).exists()


def test_arena_place_all_or_nothing(fake: FakeDeviceBackend) -> None:
    with DeviceArena.create(1024) as arena:
        held = arena.allocate(512)
        with pytest.raises(ResourceError, match="room for a batch of 640"):
            arena.place([b"a" * 300, b"b" * 300])
        assert arena.used_bytes == 512 and arena.allocations == 1  # nothing of the batch stayed
        with pytest.raises(ResourceError, match="at most"):
            arena.place([b"a" * 600, b"b" * 600])  # could never fit
        arena.release(held)
        pairs = arena.place([b"a" * 300, b"", b"b" * 300])
        assert pairs == [(0, 300), (0, 0), (320, 300)]
        assert arena.used_bytes == 640


def _body(fake: FakeDeviceBackend, n: int, seed: int = 7) -> tuple[Any, bytes]:
    data = _payload(seed, n)
    return fake.upload(data), data


def test_arena_places_a_body_whole_and_frees_it_with_its_last_pair(fake: FakeDeviceBackend) -> None:
    body, data = _body(fake, 200)
    spans = [(0, 100), (0, 0), (104, 50), (160, 40)]
    with DeviceArena.create(4096) as arena:
        held = arena.allocate(64)
        pairs = arena.place(Body(body, spans))
        base = pairs[0][0]
        assert base % 64 == 0 and base != held
        # one allocation, one copy; each buffer where the body has it
        assert pairs == [(base, 100), (0, 0), (base + 104, 50), (base + 160, 40)]
        assert arena.allocations == 2 and arena.used_bytes == 64 + 256
        assert _down(fake, arena.view(base, 200)) == data
        assert arena.placed_bytes([base, base + 104, base + 160]) == 256
        assert arena.placed_bytes([base + 104]) == 256 and arena.placed_bytes([held, base]) == 64 + 256
        # each pair is released on its own; the allocation goes with the last
        assert arena.release(base + 104) == 0 and arena.used_bytes == 64 + 256
        with pytest.raises(ValueError, match="double release"):
            arena.release(base + 104)
        with pytest.raises(ValueError, match="distinct"):
            arena.release_many([base, base])
        assert arena.used_bytes == 64 + 256  # a refused release_many releases nothing
        assert arena.release_many([base, base + 160]) == 256
        assert arena.allocations == 1 and arena.used_bytes == 64
        with pytest.raises(ValueError, match="double release"):
            arena.release(base)
        # the room is reused
        again = arena.place(Body(body, spans))
        assert again[0][0] == base


def test_arena_body_placement_edge_cases(fake: FakeDeviceBackend) -> None:
    body, data = _body(fake, 128)
    with DeviceArena.create(4096) as arena:
        # two buffers at one offset cannot be freed apart: one allocation per buffer instead
        shared = arena.place(Body(body, [(0, 64), (0, 64)]))
        assert shared[0][0] != shared[1][0] and arena.allocations == 2
        assert [_down(fake, arena.view(o, n)) for o, n in shared] == [data[:64], data[:64]]
        arena.release_many([o for o, _ in shared])
        # nothing to hold
        assert arena.place(Body(body, [(0, 0), (64, 0)])) == [(0, 0), (0, 0)]
        assert arena.allocations == 0 and arena.used_bytes == 0
        # a span outside the body
        with pytest.raises(ValueError, match="inside the 128-byte body"):
            arena.place(Body(body, [(0, 64), (100, 29)]))
        assert arena.allocations == 0
        # too large for the arena, at once; not now, all or nothing
        big, _ = _body(fake, 8192)
        with pytest.raises(ResourceError, match="at most"):
            arena.place(Body(big, [(0, 8192)]))
        held = arena.allocate(4096 - 64)
        with pytest.raises(ResourceError, match="room"):
            arena.place(Body(body, [(0, 64), (64, 64)]))
        assert arena.allocations == 1
        arena.release(held)


async def test_arena_body_waits_for_room(fake: FakeDeviceBackend) -> None:
    body, data = _body(fake, 1024)
    with DeviceArena.create(2048) as arena:
        first = await arena.place_wait(Body(body, [(0, 512), (512, 512)]))
        second = await arena.place_wait(Body(body, [(0, 1024)]))
        waiting = asyncio.ensure_future(arena.place_wait(Body(body, [(0, 1000), (1000, 24)]), timeout=5))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        arena.release(first[0][0])
        await asyncio.sleep(0.05)
        assert not waiting.done()  # half of the first body is still held
        arena.release(first[1][0])
        third = await waiting
        assert third[0][0] == first[0][0] and _down(fake, arena.view(third[0][0], 1024)) == data
        arena.release_many([second[0][0], third[0][0], third[1][0]])
        assert arena.used_bytes == 0


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zc"])
def test_cuda_reader_takes_a_body_placed_whole_as_one_range(zero_copy: bool) -> None:
    backend = _Counting()
    released: list[list[int]] = []
    with use_backend(backend), DeviceArena.create(8192) as arena:
        data = _payload(3, 400)
        spans = [(0, 100), (0, 0), (104, 200), (304, 96)]
        at = [o for o, _ in spans]
        placed = arena.place(Body(backend.upload(data), spans))
        apart = arena.place([data[o : o + n] if n else b"" for o, n in spans])  # a buffer per allocation
        reader = open_pair_reader(
            _cuda_uri(arena.handle, 8192), zero_copy=zero_copy, on_release=released.append, timeout=1
        )
        try:
            backend.calls.clear()
            if zero_copy:
                view = reader.device_body(_pairs(placed), at, 400)  # type: ignore[attr-defined]
                assert backend.calls == {"view": 1}  # one view over the mapping, nothing copied
                assert _down(backend, view) == data
                assert reader.device_body(_pairs(apart), at, 400) is None  # type: ignore[attr-defined]
                assert reader.device_body(_pairs([(0, 0)] * 4), at, 400) is None  # type: ignore[attr-defined]
                # near the end of the mapping: the body would not fit in it
                near = _cuda_uri(arena.handle, placed[0][0] + 399)
                short = open_pair_reader(near, zero_copy=True, on_release=released.append, timeout=1)
                with pytest.raises(ProtocolError, match="inside"):
                    short.device_body(_pairs(placed), at, 400)  # type: ignore[attr-defined]
                short.close()
                del view
                gc.collect()
                assert released == [[placed[0][0], placed[2][0], placed[3][0]]]
            else:
                one, many = backend.empty(400), backend.empty(400)
                done = reader.gather_into(_pairs(placed), one, at)  # type: ignore[attr-defined]
                assert backend.calls.get("copy") == 1 and _down(backend, one) == data
                assert done == [placed[0][0], placed[2][0], placed[3][0]]
                backend.calls.clear()
                reader.gather_into(_pairs(apart), many, at)  # type: ignore[attr-defined]
                assert backend.calls.get("copy") == 3
                assert [_down(backend, many)[o : o + n] for o, n in spans] == [
                    data[o : o + n] for o, n in spans
                ]
        finally:
            reader.close()


def test_arena_place_host_and_device_sources(fake: FakeDeviceBackend) -> None:
    ints = np.arange(50, dtype=np.int32)
    host = [
        _payload(1, 100),
        memoryview(_payload(2, 65)),
        ints,
        pa.py_buffer(_payload(3, 7)),
        b"",
        bytearray(_payload(4, 64)),
    ]
    dev_int64 = fake.upload(np.arange(20, dtype=np.int64).tobytes()).view(np.int64)
    dev = [fake.upload(_payload(5, 300)), dev_int64, fake.empty(0), fake.upload(_payload(6, 1))[0:1]]
    with DeviceArena.create(1 << 14) as arena:
        got = arena.place(host + dev)
        expect = [bytes(memoryview(b).cast("B")) for b in host] + [
            _payload(5, 300),
            np.arange(20, dtype=np.int64).tobytes(),
            b"",
            _payload(6, 1),
        ]
        assert [n for _, n in got] == [len(e) for e in expect]
        assert got[4] == (0, 0) and got[8] == (0, 0)
        for (offset, n), e in zip(got, expect, strict=True):
            assert offset % 64 == 0
            if n:
                assert _down(fake, arena.view(offset, n)) == e
        offsets = [o for o, n in got if n]
        assert len(set(offsets)) == len(offsets) == arena.allocations


def test_arena_place_spans_of_a_device_body(fake: FakeDeviceBackend) -> None:
    body = _payload(7, 1000)
    with DeviceArena.create(4096) as arena:
        pairs = arena.place_spans(fake.upload(body), [(0, 10), (10, 0), (64, 936)])
        assert [n for _, n in pairs] == [10, 0, 936] and pairs[1] == (0, 0)
        assert _down(fake, arena.view(*pairs[0])) == body[:10]
        assert _down(fake, arena.view(*pairs[2])) == body[64:]
        with pytest.raises(ValueError, match="inside"):
            arena.place_spans(fake.upload(body), [(990, 20)])
        with pytest.raises(TypeError, match="device array"):
            arena.place_spans(body, [(0, 1)])
        assert arena.allocations == 2


def test_arena_rejects_bad_sources_and_ranges(fake: FakeDeviceBackend) -> None:
    with DeviceArena.create(1024) as arena:
        with pytest.raises(TypeError, match="one-dimensional"):
            arena.place([FakeDeviceArray(np.zeros((2, 4), np.uint8))])
        with pytest.raises(TypeError, match="contiguous"):
            arena.place([np.arange(20, dtype=np.int32)[::2]])
        with pytest.raises(ValueError, match="inside"):
            arena.view(1000, 100)
        assert arena.allocations == 0


def test_arena_failed_copy_releases_the_batch() -> None:
    class Broken(FakeDeviceBackend):
        def upload_into(self, dst: Any, data: Any) -> None:
            raise RuntimeError("copy failed")

    with DeviceArena.create(1024, backend=Broken()) as arena:
        with pytest.raises(RuntimeError, match="copy failed"):
            arena.place([b"x" * 10, b"y" * 10])
        assert arena.used_bytes == 0 and arena.allocations == 0


async def test_arena_place_wait_blocks_until_a_release(fake: FakeDeviceBackend) -> None:
    with DeviceArena.create(1024) as arena:
        held = arena.place([b"h" * 800])
        task = asyncio.create_task(arena.place_wait([fake.upload(b"d" * 200), b"e" * 100]))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not task.done() and arena.used_bytes == 832  # waiting holds no part of the batch
        await asyncio.to_thread(arena.release, held[0][0])  # from another thread, as the client's frees do
        pairs = await asyncio.wait_for(task, 5)
        assert [_down(fake, arena.view(o, n)) for o, n in pairs] == [b"d" * 200, b"e" * 100]
        assert arena.allocations == 2


async def test_arena_place_wait_timeout_capacity_and_close(fake: FakeDeviceBackend) -> None:
    arena = DeviceArena.create(1024)
    try:
        arena.allocate(1024)
        with pytest.raises(ResourceError, match=r"within 0\.05 s"):
            await arena.place_wait([b"x"], timeout=0.05)
        with pytest.raises(ResourceError, match="at most"):
            await arena.place_wait([b"x" * 2000])
        assert arena._waiters == []
        waiting = [
            asyncio.create_task(arena.place_wait([b"x"])),
            asyncio.create_task(arena.allocate_wait(64)),
        ]
        await asyncio.sleep(0.01)
        assert not any(t.done() for t in waiting)
    finally:
        arena.close()
    for t in waiting:
        with pytest.raises(ResourceError, match="closed"):
            await asyncio.wait_for(t, 5)
    with pytest.raises(ResourceError, match="closed"):
        arena.place([b"x"])
    with pytest.raises(ResourceError, match="closed"):
        arena.allocate(64)
    assert not _segment(arena.handle).exists()


def test_arena_is_freed_when_dropped_unclosed(fake: FakeDeviceBackend) -> None:
    arena = DeviceArena.create(256)
    segment = _segment(arena.handle)
    assert segment.exists()
    del arena
    gc.collect()
    assert not segment.exists()


# -- ServedArena and the data URI ----------------------------------------------------------------------------


def test_served_arena_cuda_publishes_handle_and_length(fake: FakeDeviceBackend) -> None:
    served = ServedArena("cuda", 5000)
    try:
        assert isinstance(served.arena, DeviceArena)
        assert served.memory == "cuda"
        assert served.remote_handle == served.arena.handle and len(served.remote_handle) == IPC_HANDLE_BYTES
        assert served.params == {"cuda_length": "5056"}
        # the data URI as the data server builds it
        server = DataServer(Catalog(), ServeOptions(want_data=7, free_data=8, served=served))
        uri = server.uri()
        assert (uri.memory, uri.remote_handle, uri.free_data) == ("cuda", served.remote_handle, 8)
        parsed = DissocURI.parse(str(uri))
        assert parsed == uri
        assert cuda_region(parsed) == (served.remote_handle, 5056)
        segment = _segment(parsed.remote_handle or b"")
        assert segment.exists()
    finally:
        served.close()
    assert not segment.exists()


def test_served_arena_cuda_without_a_device_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("cupy is installed: there may be a device")
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(device_mod, "_default", None)
    monkeypatch.setattr(device_mod, "_override", None)
    with pytest.raises(ResourceError, match=r"memory=cuda.*dissoc\[gpu\]"):
        ServedArena("cuda", 1024)
    with pytest.raises(DissocError, match="shm, ucx, cuda"):
        ServedArena("gpu", 1024)


@pytest.mark.parametrize("size", [0, 1, 63, 65, 128])
def test_wrong_length_handle_is_rejected(fake: FakeDeviceBackend, size: int) -> None:
    uri = DissocURI.parse(str(_cuda_uri(b"\x01" * size, 4096)))  # the URI itself carries any bytes
    assert uri.remote_handle == b"\x01" * size
    with pytest.raises(ProtocolError, match=f"64-byte CUDA IPC handle as remote_handle, got {size} bytes"):
        cuda_region(uri)
    with pytest.raises(ProtocolError, match="64-byte"):
        open_pair_reader(uri, zero_copy=False, on_release=lambda o: None, timeout=1)


@pytest.mark.parametrize("length", [None, "", "0", "-5", "12x", "\uff11\uff12", "1" * 30, str(1 << 63)])
def test_bad_cuda_length_is_rejected(length: str | None) -> None:
    params = {} if length is None else {"cuda_length": length}
    uri = DissocURI("tcp", "h", 1, 1, 2, remote_handle=b"\0" * 64, memory="cuda", params=params)
    with pytest.raises(ProtocolError, match="cuda_length"):
        cuda_region(DissocURI.parse(str(uri)))


def test_cuda_uri_needs_free_data_and_handle(fake: FakeDeviceBackend) -> None:
    no_free = DissocURI("tcp", "h", 1, 1, None, remote_handle=b"\0" * 64, memory="cuda")
    with pytest.raises(ProtocolError, match="free_data"):
        open_pair_reader(no_free, zero_copy=False, on_release=lambda o: None, timeout=1)


def test_bad_handles_refuse_cleanly(fake: FakeDeviceBackend) -> None:
    with pytest.raises(ResourceError, match="64 bytes, got 63"):
        check_ipc_handle(b"x" * 63)
    assert check_ipc_handle(bytearray(64)) == bytes(64)
    with pytest.raises(ResourceError, match="not a fake-device handle"):
        fake.open_ipc(b"\x07" * 64, 64)  # what a real CUDA handle looks like to the fake
    with pytest.raises(ResourceError, match="bad segment name"):
        fake.open_ipc((FAKE_HANDLE_MAGIC + b"../../etc/passwd").ljust(64, b"\0"), 64)
    with pytest.raises(ResourceError, match="cannot open"):
        fake.open_ipc((FAKE_HANDLE_MAGIC + b"dissoc-fakedev-0000").ljust(64, b"\0"), 64)
    # The CuPy path refuses a fake handle before it touches CUDA (so this runs without cupy too).
    cupy_backend = object.__new__(CupyBackend)
    with DeviceArena.create(128) as arena:
        with pytest.raises(ResourceError, match="fake-device segment"):
            cupy_backend.open_ipc(arena.handle, 128)
        with pytest.raises(ResourceError, match="64 bytes"):
            cupy_backend.open_ipc(arena.handle[:32], 128)
        # a client told of more than the allocation holds refuses to map it
        uri = _cuda_uri(arena.handle, 4096)
        with pytest.raises(ResourceError, match="4096 bytes asked"):
            open_pair_reader(uri, zero_copy=True, on_release=lambda o: None, timeout=1)


# -- range checks --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("landing", ["host", "device-copy", "device-zero-copy"])
def test_pairs_outside_cuda_length_are_refused_before_any_copy(landing: str) -> None:
    backend = _Counting()
    released: list[list[int]] = []
    with use_backend(backend), DeviceArena.create(4096) as arena:
        good = arena.place([b"g" * 100])[0]
        backend.calls.clear()
        # the URI bounds reads to 1024 bytes, although the allocation holds 4096
        reader = open_pair_reader(
            _cuda_uri(arena.handle, 1024),
            zero_copy=landing == "device-zero-copy",
            on_release=released.append,
            timeout=1,
        )
        try:
            assert backend.calls == {"open_ipc": 1}
            for bad in ([good, (1000, 25)], [good, (1024, 1)], [(2048, 64)], [good, (1 << 63, 64)]):
                with pytest.raises(ProtocolError, match="inside the 1024-byte device allocation"):
                    if landing == "host":
                        reader.read(_pairs(bad))
                    else:
                        reader.read_device(_pairs(bad))
            assert backend.calls == {"open_ipc": 1}  # nothing viewed, copied or allocated
            assert released == [] and reader.idle.is_set()  # type: ignore[attr-defined]
            # the edge itself is fine
            arena.allocate(1024 - 192)
            edge = arena.place([b"e" * 64])[0]
            assert edge == (960, 64)
            if landing == "host":
                bufs, done = reader.read(_pairs([edge]))
                assert bufs[0] is not None and bufs[0].to_pybytes() == b"e" * 64 and done == [960]
            else:
                arrays, done = reader.read_device(_pairs([edge]))
                assert _down(backend, arrays[0]) == b"e" * 64
        finally:
            reader.close()


# -- other readers' device landing ---------------------------------------------------------------------------


@pytest.mark.parametrize("zero_copy", [False, True])
def test_shm_reader_read_device_uploads(fake: FakeDeviceBackend, zero_copy: bool) -> None:
    released: list[list[int]] = []
    with ShmArena.create(4096) as arena:
        rows = arena.place([b"a" * 100, b"", b"b" * 5])
        uri = DissocURI("tcp", "h", 1, 1, 2, remote_handle=arena.handle, memory="shm")
        reader = open_pair_reader(uri, zero_copy=zero_copy, on_release=released.append, timeout=1)
        try:
            arrays, done = reader.read_device(_pairs(rows))
            assert arrays[1] is None
            assert all(fake.is_device_array(a) for a in (arrays[0], arrays[2]))
            assert [_down(fake, arrays[0]), _down(fake, arrays[2])] == [b"a" * 100, b"b" * 5]
            gc.collect()
            offsets = [rows[0][0], rows[2][0]]
            if zero_copy:  # the host buffers went after the upload: their ranges come back by on_release
                assert done == [] and released == [offsets]
            else:
                assert done == offsets and released == []
        finally:
            reader.close()


# -- two processes -------------------------------------------------------------------------------------------

_SERVER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from dissoc.memory.cuda import get_backend
    from dissoc.memory.pairs import ServedArena
    from dissoc.data_server import DataServer
    from dissoc.server.role import ServeOptions
    from dissoc.datasets import Catalog

    def payload(seed, n):
        return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()

    backend = get_backend()
    served = ServedArena("cuda", 1 << 16)
    arena = served.arena
    uri = DataServer(Catalog(), ServeOptions(want_data=1, free_data=2, served=served)).uri()
    batches = []
    for i, sizes in enumerate(json.loads(sys.argv[1])):
        parts = [payload(100 * i + j, n) for j, n in enumerate(sizes)]
        if i % 2:  # odd batches come from device memory, even ones from host memory
            parts = [backend.upload(p) if p else p for p in parts]
        batches.append(arena.place(parts))
    print(json.dumps({"uri": str(uri), "batches": batches, "backend": backend.name}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if "release" in cmd:
            arena.release_many(cmd["release"])  # raises on an unknown or repeated offset
            print(json.dumps({"used": arena.used_bytes, "allocations": arena.allocations}), flush=True)
        elif "close" in cmd:
            served.close()
            print(json.dumps({"closed": True}), flush=True)
            break
    """
)

SIZES = [[100, 0, 4097, 1], [64, 3000], [0, 0], [513, 7, 0, 64]]


class _ServerProcess:
    def __init__(self, backend: str) -> None:
        path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        env = {**os.environ, ENV_VAR: backend, "PYTHONPATH": path}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, json.dumps(SIZES)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        hello = self._reply()
        self.uri = DissocURI.parse(hello["uri"])
        self.batches: list[list[tuple[int, int]]] = [[(o, n) for o, n in b] for b in hello["batches"]]
        assert hello["backend"] == backend

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"server process ended early (rc={self.proc.poll()})"
        reply: dict[str, Any] = json.loads(line)
        return reply

    def command(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.command(close=True) == {"closed": True}
                assert self.proc.wait(10) == 0
            finally:
                if self.proc.poll() is None:
                    self.proc.kill()
                    self.proc.wait(10)


def _expected(batch: int) -> list[bytes]:
    return [_payload(100 * batch + j, n) for j, n in enumerate(SIZES[batch])]


def _parent_backend(name: str) -> Any:
    return FakeDeviceBackend() if name == "fake" else CupyBackend()


BACKENDS = ["fake", pytest.param("cupy", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_two_processes_copy_landings(backend_name: str) -> None:
    server = _ServerProcess(backend_name)
    try:
        segment = _segment(server.uri.remote_handle or b"") if backend_name == "fake" else None
        released: list[list[int]] = []
        with use_backend(_parent_backend(backend_name)) as backend:
            reader = open_pair_reader(server.uri, zero_copy=False, on_release=released.append, timeout=5)
            base = reader._allocation.ptr  # type: ignore[attr-defined]
            freed: list[int] = []
            try:
                # host landing: private host memory, every range freed at once
                for i in (0, 1):
                    bufs, done = reader.read(_pairs(server.batches[i]))
                    assert [b"" if b is None else b.to_pybytes() for b in bufs] == _expected(i)
                    assert all(b is None or b.address % 64 == 0 for b in bufs)
                    assert done == [o for o, n in server.batches[i] if n]
                    freed += done
                # device landing, copied: fresh device arrays, freed at once
                for i in (2, 3):
                    arrays, done = reader.read_device(_pairs(server.batches[i]))
                    assert [b"" if a is None else _down(backend, a) for a in arrays] == _expected(i)
                    assert all(a is None or backend.is_device_array(a) for a in arrays)
                    assert done == [o for o, n in server.batches[i] if n]
                    freed += done
                    if arrays[0] is not None:  # a copy, not a view of the server's memory
                        assert not base <= _ptr(arrays[0]) < base + (1 << 16)
            finally:
                reader.close()
            assert released == []
            assert reader.idle.is_set()  # type: ignore[attr-defined]
            with pytest.raises(ResourceError, match="closed"):
                reader.read(_pairs(server.batches[0]))
        # every listed range was reported exactly once: the server takes them all back, and nothing stays
        assert server.command(release=freed) == {"used": 0, "allocations": 0}
    finally:
        server.close()
    if segment is not None:
        assert not segment.exists()


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_two_processes_zero_copy_device_landing(backend_name: str) -> None:
    server = _ServerProcess(backend_name)
    try:
        segment = _segment(server.uri.remote_handle or b"") if backend_name == "fake" else None
        released: list[list[int]] = []
        with use_backend(_parent_backend(backend_name)) as backend:
            reader = open_pair_reader(server.uri, zero_copy=True, on_release=released.append, timeout=5)
            base = reader._allocation.ptr  # type: ignore[attr-defined]
            freed: list[int] = []
            idle: Any = reader.idle  # type: ignore[attr-defined]
            try:
                # views over the mapped allocation itself, freed when the batch's last view goes
                arrays, done = reader.read_device(_pairs(server.batches[0]))
                assert done == [] and not idle.is_set()
                assert [b"" if a is None else _down(backend, a) for a in arrays] == _expected(0)
                assert [_ptr(a) - base for a in arrays if a is not None] == [
                    o for o, n in server.batches[0] if n
                ]
                assert arrays[2] is not None
                keep = arrays[2][10:20]  # a slice outlives the batch's own arrays
                del arrays
                gc.collect()
                assert released == []
                assert _down(backend, keep) == _expected(0)[2][10:20]
                del keep
                gc.collect()
                assert released == [[o for o, n in server.batches[0] if n]]
                assert idle.is_set()
                # an all-empty batch holds nothing
                assert reader.read_device(_pairs(server.batches[2])) == ([None, None], [])
                # host landing on a zero-copy reader still copies and frees at once
                bufs, done = reader.read(_pairs(server.batches[1]))
                assert [b.to_pybytes() for b in bufs if b is not None] == _expected(1)
                assert done == [o for o, n in server.batches[1] if n]
                freed += done
                # closing while views are alive keeps the mapping until the last of them goes
                arrays, done = reader.read_device(_pairs(server.batches[3]))
                watch = weakref.ref(reader)
                reader.close()
                assert reader._allocation is not None and not idle.is_set()  # type: ignore[attr-defined]
                with pytest.raises(ResourceError, match="closed"):
                    reader.read_device(_pairs(server.batches[3]))
                assert [b"" if a is None else _down(backend, a) for a in arrays] == _expected(3)
                assert len(released) == 1
                del arrays
                gc.collect()
                assert released[1] == [o for o, n in server.batches[3] if n]
                assert idle.is_set() and reader._allocation is None  # type: ignore[attr-defined]
                assert watch() is reader
            finally:
                reader.close()
        freed += [o for batch in released for o in batch]
        assert server.command(release=freed) == {"used": 0, "allocations": 0}
    finally:
        server.close()
    if segment is not None:
        assert not segment.exists()


# -- CuPy ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cupy_arena_places_host_and_device_buffers() -> None:
    import cupy

    backend = CupyBackend()
    with DeviceArena.create(1 << 16, backend=backend) as arena:
        assert len(arena.handle) == IPC_HANDLE_BYTES and not arena.handle.startswith(FAKE_HANDLE_MAGIC)
        dev = cupy.arange(100, dtype=cupy.int64)
        pairs = arena.place([_payload(1, 1000), b"", dev, pa.py_buffer(b"xyz")])
        assert pairs[1] == (0, 0)
        assert _down(backend, arena.view(*pairs[0])) == _payload(1, 1000)
        assert _down(backend, arena.view(*pairs[2])) == np.arange(100, dtype=np.int64).tobytes()
        assert _down(backend, arena.view(*pairs[3])) == b"xyz"
        assert _ptr(arena.view(*pairs[0])) == arena.allocation.ptr + pairs[0][0]
        with pytest.raises(ResourceError, match="fake-device segment"):
            backend.open_ipc((FAKE_HANDLE_MAGIC + b"dissoc-fakedev-00").ljust(64, b"\0"), 64)
