"""POSIX shared-memory arena (server side) and read-only view (client side)."""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import re
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dissoc.errors import ProtocolError, ResourceError
from dissoc.memory import ShmArena, ShmView, cleanup_stale
from dissoc.memory.shm import ALIGNMENT, SHM_DIR
from dissoc.protocol.pairs import decode_pairs, encode_pairs
from dissoc.uri import DissocURI

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs Linux /dev/shm")


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


@pytest.fixture
def arena() -> Iterator[ShmArena]:
    with ShmArena.create(4096) as a:
        yield a
    assert not os.path.exists(_path(a.name))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# -- creation, naming, permissions, lifetime ----------------------------------------------------------------


def test_create_names_mode_and_close_unlinks() -> None:
    a = ShmArena.create(1000)
    try:
        assert re.fullmatch(rf"dissoc-{os.getpid()}-[0-9a-f]{{16}}", a.name)
        assert a.handle == a.name.encode("ascii")
        assert a.capacity == 1024  # rounded up to 64
        st_ = os.stat(_path(a.name))
        assert stat.S_IMODE(st_.st_mode) == 0o400  # made 0600, read-only once mapped
        assert st_.st_blocks * 512 >= 1024  # reserved, not sparse
        assert st_.st_size == 1024
        assert st_.st_uid == os.getuid()
        assert len(a.buffer) == 1024 and not a.buffer.readonly
        assert a.array.shape == (1024,) and a.array.flags.writeable
        assert "used=0" in repr(a)
    finally:
        a.close()
    assert a.closed
    assert not os.path.exists(_path(a.name))
    a.close()  # idempotent
    with pytest.raises(ResourceError, match="closed"):
        a.allocate(64)
    with pytest.raises(ResourceError, match="closed"):
        _ = a.buffer


@pytest.mark.parametrize("umask", [0o000, 0o077, 0o777])
def test_mode_is_0400_whatever_the_umask(umask: int) -> None:
    old = os.umask(umask)
    try:
        a = ShmArena.create(64)
    finally:
        os.umask(old)
    with a:
        assert stat.S_IMODE(os.stat(_path(a.name)).st_mode) == 0o400


def test_explicit_name_and_bad_arguments() -> None:
    name = f"dissoc-{os.getpid()}-explicit-{threading.get_ident()}"
    with ShmArena.create(128, name=name) as a:
        assert a.name == name
        with pytest.raises(FileExistsError):
            ShmArena.create(128, name=name)
    for bad_name in ("../etc/x", "a/b", "", ".", "..", "x" * 300, "sp ace"):
        with pytest.raises(ValueError):
            ShmArena.create(128, name=bad_name)
    for bad_cap in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            ShmArena.create(bad_cap)  # type: ignore[arg-type]


def test_handle_round_trips_through_the_uri(arena: ShmArena) -> None:
    uri = DissocURI.parse("tcp://127.0.0.1:1?want_data=1&free_data=2&memory=shm")
    text = uri.to_string()
    assert "memory=shm" in text
    full = DissocURI("tcp", "127.0.0.1", 1, 1, 2, arena.handle, "shm")
    back = DissocURI.parse(full.to_string())
    assert back.remote_handle == arena.handle
    with ShmView.attach(back.remote_handle or b"") as view:
        assert view.size == arena.capacity
    with ShmView.attach(b"/" + arena.handle) as view:  # leading '/' accepted
        assert view.name == arena.name


def test_finalizer_unlinks_a_forgotten_arena() -> None:
    a = ShmArena.create(64)
    name = a.name
    assert os.path.exists(_path(name))
    del a
    gc.collect()
    assert not os.path.exists(_path(name))


def test_no_resource_tracker_warnings_in_a_clean_run() -> None:
    code = (
        "from dissoc.memory import ShmArena, ShmView\n"
        "a = ShmArena.create(4096)\n"
        "pairs = a.place([b'x' * 100])\n"
        "v = ShmView.attach(a.handle)\n"
        "assert v.slice(*pairs[0]).to_pybytes() == b'x' * 100\n"
        "v.close(); a.close()\n"
        "b = ShmArena.create(64)\n"  # never closed: the finalizer unlinks it at exit
        "print(b.name)\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert not os.path.exists(_path(out.stdout.strip()))


# -- allocator ----------------------------------------------------------------------------------------------


def test_allocate_release_accounting(arena: ShmArena) -> None:
    a = arena.allocate(1)
    b = arena.allocate(100)
    c = arena.allocate(64)
    assert (a, b, c) == (0, 64, 192)
    assert arena.used_bytes == 64 + 128 + 64
    assert arena.allocations == 3
    assert arena.allocation_size(b) == 128
    assert arena.release(b) == 128
    assert arena.used_bytes == 128
    assert arena.allocate(128) == 64  # first fit reuses the hole
    arena.release(64)
    arena.release(a)
    arena.release(c)
    assert arena.used_bytes == 0
    assert arena.largest_free_block == arena.capacity  # fully coalesced
    assert arena.allocate(arena.capacity) == 0
    with pytest.raises(ResourceError, match="room"):
        arena.allocate(1)
    assert arena.try_allocate(1) is None
    arena.release(0)


def test_allocate_errors(arena: ShmArena) -> None:
    with pytest.raises(ResourceError, match="capacity"):
        arena.allocate(arena.capacity + 1)
    for bad in (0, -5):
        with pytest.raises(ValueError):
            arena.allocate(bad)
    with pytest.raises(ValueError, match="alignment"):
        arena.allocate(8, alignment=96)
    with pytest.raises(ValueError, match="double release"):
        arena.release(0)
    off = arena.allocate(8)
    with pytest.raises(ValueError):
        arena.release_many([off, off])
    assert arena.used_bytes == 64  # the failed release_many released nothing
    assert arena.release_many([off]) == 64
    assert arena.used_bytes == 0


def test_larger_alignment_keeps_padding_free(arena: ShmArena) -> None:
    first = arena.allocate(64)
    page = arena.allocate(64, alignment=1024)
    assert page == 1024
    assert arena.allocate(64) == 64  # the padding before the aligned block is still free
    arena.release_many([first, page, 64])
    assert arena.largest_free_block == arena.capacity


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 700), st.integers(0, 1000)), max_size=60))
def test_allocator_invariants(ops: list[tuple[bool, int, int]]) -> None:
    with ShmArena.create(4096) as arena:
        live: dict[int, int] = {}
        for is_alloc, nbytes, pick in ops:
            if is_alloc or not live:
                off = arena.try_allocate(nbytes)
                if off is None:
                    # first fit found no block: then no free block is big enough
                    assert arena.largest_free_block < -(-nbytes // 64) * 64
                    continue
                assert off % ALIGNMENT == 0
                assert off >= 0 and off + nbytes <= arena.capacity
                live[off] = -(-nbytes // 64) * 64
            else:
                off = sorted(live)[pick % len(live)]
                assert arena.release(off) == live.pop(off)
            spans = sorted(live.items())
            assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(spans))  # no overlap
            assert arena.used_bytes == sum(live.values())
            assert arena.allocations == len(live)
        for off in list(live):
            arena.release(off)
        assert arena.used_bytes == 0
        assert arena.largest_free_block == arena.capacity


# -- place and zero-copy reading ----------------------------------------------------------------------------


def _sample_batch() -> pa.RecordBatch:
    return pa.record_batch(
        {
            "i": pa.array([1, None, 3, 4, None], type=pa.int64()),
            "s": pa.array(["a", "bb", None, "", "dddd"]),
            "f": pa.array([0.5, 1.5, 2.5, 3.5, 4.5]),
        }
    )


def test_place_then_rebuild_batch_zero_copy(arena: ShmArena) -> None:
    batch = _sample_batch()
    columns = [batch.column(i) for i in range(batch.num_columns)]
    buffers = [b for col in columns for b in col.buffers()]
    raw = [b"" if b is None else b for b in buffers]
    pairs = arena.place(raw)
    assert len(pairs) == len(buffers)
    for (off, n), b in zip(pairs, buffers, strict=True):
        if b is None or b.size == 0:
            assert (off, n) == (0, 0)
        else:
            assert off % 64 == 0 and n == b.size
    # the pair list travels on the wire; the client maps the segment and rebuilds the batch
    wire = decode_pairs(encode_pairs(pairs))
    with ShmView.attach(arena.handle) as view:
        views = view.buffers(wire)
        assert all(not v.is_mutable for v in views)
        arrays = []
        i = 0
        for col in columns:
            k = len(col.buffers())
            bufs = [None if pairs[j] == (0, 0) else views[j] for j in range(i, i + k)]
            arrays.append(pa.Array.from_buffers(col.type, len(col), bufs, null_count=col.null_count))
            i += k
        rebuilt = pa.RecordBatch.from_arrays(arrays, names=batch.schema.names)
        rebuilt.validate(full=True)
        assert rebuilt.equals(batch)
        # zero copy: the data buffer points into the mapping
        base = view.slice(0, 0).address
        data = rebuilt.column(2).buffers()[1]
        assert base <= data.address < base + view.size
        # a write on the server side shows through (same memory)
        arena.array[pairs[-1][0]] ^= 0xFF
        assert not rebuilt.equals(batch)


def test_place_is_all_or_nothing_and_accepts_buffer_kinds(arena: ShmArena) -> None:
    pairs = arena.place(
        [np.arange(4, dtype=np.int32), bytearray(b"xyz"), memoryview(b""), pa.py_buffer(b"q")]
    )
    assert [n for _, n in pairs] == [16, 3, 0, 1]
    assert pairs[2] == (0, 0)
    assert arena.used_bytes == 192
    with pytest.raises(ResourceError, match="room"):
        arena.place([b"a" * 1024, b"b" * 3000])
    assert arena.used_bytes == 192  # the first buffer's allocation was rolled back
    with pytest.raises(ResourceError, match="at most"):
        arena.place([b"a" * 4096, b"b"])
    with pytest.raises(TypeError):
        arena.place([np.arange(10)[::2]])
    assert arena.place([b"", b""]) == [(0, 0), (0, 0)]


def test_view_is_read_only(arena: ShmArena) -> None:
    ((off, n),) = arena.place([b"secret data"])
    with ShmView.attach(arena.handle) as view:
        assert view.readonly
        buf = view.slice(off, n)
        assert buf.to_pybytes() == b"secret data"
        assert not buf.is_mutable
        mv = memoryview(buf)
        assert mv.readonly
        with pytest.raises(TypeError):
            mv[0] = 0
        arr = view.numpy()
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr[0] = 1
        with pytest.raises(ValueError):
            arr.flags.writeable = True
        with pytest.raises(TypeError):
            view._mmap[0] = 1  # type: ignore[index]  # the mapping itself is PROT_READ
        np_slice = np.frombuffer(buf, dtype=np.uint8)
        with pytest.raises(ValueError):
            np_slice[0] = 1
    assert bytes(arena.buffer[off : off + n]) == b"secret data"


def test_writable_attach_when_asked(arena: ShmArena) -> None:
    ((off, _),) = arena.place([b"abc"])
    with ShmView.attach(arena.handle, readonly=False) as view:
        assert not view.readonly
        arr = np.frombuffer(view.slice(off, 3), dtype=np.uint8)
        assert arr.flags.writeable
        arr[0] = ord("X")
    assert bytes(arena.buffer[off : off + 3]) == b"Xbc"


def test_slice_bounds(arena: ShmArena) -> None:
    with ShmView.attach(arena.handle) as view:
        size = view.size
        assert view.slice(size, 0).size == 0
        assert view.slice(size - 8, 8).size == 8
        for off, n in [
            (size, 1),
            (size - 8, 9),
            (-1, 4),
            (0, -1),
            (2**63, 2**63),
            (2**64 - 1, 2),
            (0, 2**64),
        ]:
            with pytest.raises(ProtocolError, match="inside segment"):
                view.slice(off, n)
        with pytest.raises(ProtocolError, match="integer"):
            view.slice(1.0, 2)  # type: ignore[arg-type]
        with pytest.raises(ProtocolError):
            view.buffers(decode_pairs(encode_pairs([(0, 8), (size, 64)])))
        assert [b.size for b in view.buffers(np.array([[0, 0], [64, 8]], dtype=np.uint64))] == [0, 8]
    with pytest.raises(ResourceError, match="closed"):
        view.slice(0, 1)
    assert view.closed
    view.close()  # idempotent


@pytest.mark.parametrize(
    "handle", [b"../../etc/passwd", b"a/b", b"", b"/", b"..", "caf\u00e9".encode(), b"x\x00y", b"x" * 300]
)
def test_attach_rejects_bad_handles(handle: bytes) -> None:
    with pytest.raises(ProtocolError, match="remote_handle"):
        ShmView.attach(handle)


def test_attach_missing_segment() -> None:
    with pytest.raises(ResourceError, match="dissoc-0-does-not-exist"):
        ShmView.attach(b"dissoc-0-does-not-exist")


def test_slices_outlive_close(arena: ShmArena) -> None:
    ((off, n),) = arena.place([b"still here"])
    view = ShmView.attach(arena.handle)
    buf = view.slice(off, n)
    view.close()
    keep = arena.buffer[off : off + n]
    arena.close()
    assert not os.path.exists(_path(arena.name))
    assert buf.to_pybytes() == b"still here"  # the mapping lives as long as the buffers
    assert bytes(keep) == b"still here"


# -- backpressure -------------------------------------------------------------------------------------------


async def test_allocate_wait_proceeds_after_release(arena: ShmArena) -> None:
    big = arena.allocate(arena.capacity - 128)
    small = arena.allocate(128)
    task = asyncio.create_task(arena.allocate_wait(1024))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done()  # full: it waits rather than failing or growing
    arena.release(small)  # 128 free: not enough, still waiting
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done()
    arena.release(big)
    offset = await asyncio.wait_for(task, 5)
    assert offset == 0
    assert arena.used_bytes == 1024


async def test_allocate_wait_immediate_when_room(arena: ShmArena) -> None:
    assert await arena.allocate_wait(10) == 0
    with pytest.raises(ResourceError, match="capacity"):
        await arena.allocate_wait(arena.capacity + 1)


async def test_allocate_wait_timeout_and_close(arena: ShmArena) -> None:
    arena.allocate(arena.capacity)
    with pytest.raises(ResourceError, match=r"within 0\.05 s"):
        await arena.allocate_wait(64, timeout=0.05)
    task = asyncio.create_task(arena.allocate_wait(64))
    await asyncio.sleep(0.01)
    arena.close()
    with pytest.raises(ResourceError, match="closed"):
        await asyncio.wait_for(task, 5)


async def test_allocate_wait_cancel_leaves_no_waiter(arena: ShmArena) -> None:
    full = arena.allocate(arena.capacity)
    task = asyncio.create_task(arena.allocate_wait(64))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert arena._waiters == []
    arena.release(full)
    assert arena.used_bytes == 0  # the cancelled waiter took nothing


async def test_release_from_another_thread_wakes_waiter(arena: ShmArena) -> None:
    full = arena.allocate(arena.capacity)
    task = asyncio.create_task(arena.allocate_wait(256))
    await asyncio.sleep(0.01)
    assert not task.done()
    await asyncio.to_thread(arena.release, full)
    assert await asyncio.wait_for(task, 5) == 0


async def test_place_wait_backpressure_without_deadlock(arena: ShmArena) -> None:
    held = arena.place([b"x" * 3000])
    # two batches that each need more than half the arena: they must run one after the other
    t1 = asyncio.create_task(arena.place_wait([b"a" * 1000, b"b" * 1200]))
    t2 = asyncio.create_task(arena.place_wait([b"c" * 1000, b"d" * 1200]))
    await asyncio.sleep(0.01)
    assert not t1.done() and not t2.done()
    assert arena.used_bytes == 3008  # waiting never holds part of a batch
    arena.release(held[0][0])
    done, pending = await asyncio.wait({t1, t2}, timeout=0.2)
    assert len(done) == 1 and len(pending) == 1
    first = done.pop().result()
    with ShmView.attach(arena.handle) as view:
        assert [view.slice(o, n).to_pybytes()[:1] for o, n in first] in ([b"a", b"b"], [b"c", b"d"])
    arena.release_many(o for o, _ in first)
    second = await asyncio.wait_for(pending.pop(), 5)
    assert len(second) == 2
    with pytest.raises(ResourceError, match="at most"):
        await arena.place_wait([b"z" * 5000])


# -- crash recovery -----------------------------------------------------------------------------------------


def test_cleanup_stale_removes_dead_pid_segments_only() -> None:
    dead = _dead_pid()
    stale = ShmArena.create(64, name=f"dissoc-{dead}-stale")
    alive_parent = ShmArena.create(64, name=f"dissoc-{os.getppid()}-alive-{os.getpid()}")
    mine = ShmArena.create(64)
    try:
        removed = cleanup_stale()
        assert stale.name in removed
        assert not os.path.exists(_path(stale.name))
        assert os.path.exists(_path(alive_parent.name))
        assert os.path.exists(_path(mine.name))
        again = ShmArena.cleanup_stale()  # the staticmethod alias; the stale one is gone already
        assert stale.name not in again and mine.name not in again
        assert cleanup_stale(directory="/nonexistent-dir") == []
    finally:
        for a in (stale, alive_parent, mine):
            a.close()  # unlinking an already removed segment is fine
    assert not os.path.exists(_path(alive_parent.name))


def test_cleanup_after_a_crashed_server() -> None:
    code = (
        "import os\n"
        "from dissoc.memory import ShmArena\n"
        "a = ShmArena.create(4096)\n"
        "a.place([b'x' * 10])\n"
        "print(a.name, flush=True)\n"
        "os._exit(0)\n"  # like a crash: no close, no finalizers
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    name = out.stdout.strip()
    assert os.path.exists(_path(name))
    assert name in cleanup_stale()
    assert not os.path.exists(_path(name))
