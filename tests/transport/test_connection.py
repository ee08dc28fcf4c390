"""Behaviour every transport shares (run over TCP and in-process): messages, tags, masks, placement."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

import numpy as np
import pytest
from helpers.transport import make_pair

from dissoc.buffers import BufferPool
from dissoc.errors import ResourceError, TransportError
from dissoc.transport import (
    ALIGNMENT,
    DEFAULT_MAX_BUFFERED_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    TAG_MASK_ALL,
    BytesLike,
    Connection,
    TaggedMessage,
    aligned_empty,
    default_allocator,
)

Pair = tuple[Connection, Connection]
BODY = 1 << 56  # body type 1 in the data-stream tag (FACTS section 4)


def as_bytes(payload: Any) -> bytes:
    return bytes(memoryview(payload))


async def test_untagged_round_trip_keeps_order(pair: Pair) -> None:
    a, b = pair
    messages = [b"", b"x", b"hello" * 100, bytes(range(256)) * 300]
    for message in messages:
        await a.send(message)
    received = [bytes(await b.recv()) for _ in messages]
    assert received == messages
    await b.send(b"back")
    assert bytes(await a.recv()) == b"back"


async def test_lanes_are_empty_where_the_transport_has_none_to_tell(pair: Pair) -> None:
    a, b = pair
    assert a.lanes() == () and b.lanes() == ()


async def test_send_accepts_bytes_like_objects(pair: Pair) -> None:
    a, b = pair
    floats = np.arange(10, dtype=np.float64)
    await a.send(bytearray(b"ab"))
    await a.send(memoryview(b"cd"))
    await a.send(floats)
    await a.send(np.arange(6, dtype=np.int32).reshape(2, 3))
    assert bytes(await b.recv()) == b"ab"
    assert bytes(await b.recv()) == b"cd"
    assert bytes(await b.recv()) == floats.tobytes()
    assert bytes(await b.recv()) == np.arange(6, dtype=np.int32).tobytes()


async def test_send_rejects_non_contiguous_and_bad_tags(pair: Pair) -> None:
    a, _ = pair
    with pytest.raises(ValueError, match="contiguous"):
        await a.send(np.arange(10, dtype=np.uint8)[::2])
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        await a.send_tagged(-1, b"x")
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        await a.send_tagged(1 << 64, b"x")
    with pytest.raises(ValueError, match="mask"):
        await a.recv_tagged(1, mask=1 << 64)


async def test_gathered_send_arrives_as_one_message(pair: Pair) -> None:
    a, b = pair
    parts: list[BytesLike] = [b"head", np.arange(1000, dtype=np.int64), memoryview(b""), bytearray(b"tail")]
    await a.send(parts)
    await a.send_tagged(7, tuple(parts))
    expected = b"head" + np.arange(1000, dtype=np.int64).tobytes() + b"tail"
    assert bytes(await b.recv()) == expected
    message = await b.recv_tagged(7)
    assert message.tag == 7
    assert as_bytes(message.payload) == expected


async def test_tagged_round_trip_full_u64_tags(pair: Pair) -> None:
    a, b = pair
    tags = [0, 1, 0xFFFF_FFFF, BODY | 3, TAG_MASK_ALL]
    for tag in tags:
        await a.send_tagged(tag, tag.to_bytes(8, "little"))
    for tag in reversed(tags):
        message = await b.recv_tagged(tag)
        assert isinstance(message, TaggedMessage)
        assert message.tag == tag
        assert as_bytes(message.payload) == tag.to_bytes(8, "little")
    assert b.buffered_bytes == 0


async def test_masked_matching_ignores_high_bits(pair: Pair) -> None:
    a, b = pair
    await a.send_tagged(BODY | 5, b"pairs for 5")
    await a.send_tagged(6, b"packed 6")
    await a.send_tagged(5, b"packed 5")
    low = 0x0000_0000_FFFF_FFFF
    first = await b.recv_tagged(5, low)
    assert (first.tag, as_bytes(first.payload)) == (BODY | 5, b"pairs for 5")
    second = await b.recv_tagged(0xAB00_0000_0000_0005, low)
    assert (second.tag, as_bytes(second.payload)) == (5, b"packed 5")
    # exact matching does not confuse 6 with anything else; mask 0 takes the next arrival of any tag
    await a.send_tagged(BODY | 9, b"nine")
    assert (await b.recv_tagged(6)).tag == 6
    assert (await b.recv_tagged(0, mask=0)).tag == BODY | 9


async def test_masked_and_exact_claims_mix(pair: Pair) -> None:
    a, b = pair
    for seq in range(20):
        await a.send_tagged(seq | (BODY if seq % 2 else 0), bytes([seq]))
    # claim some through an exact index, others through a masked one, then the rest in arrival order
    assert as_bytes((await b.recv_tagged(BODY | 3)).payload) == b"\x03"
    assert as_bytes((await b.recv_tagged(4, 0xFFFF_FFFF)).payload) == b"\x04"
    assert as_bytes((await b.recv_tagged(BODY | 5, TAG_MASK_ALL)).payload) == b"\x05"
    remaining = [as_bytes((await b.recv_tagged(0, 0)).payload)[0] for _ in range(17)]
    assert remaining == [s for s in range(20) if s not in (3, 4, 5)]
    assert b.buffered_bytes == 0


async def test_concurrent_waiters_get_their_own_messages(pair: Pair) -> None:
    a, b = pair
    waiters = {seq: asyncio.create_task(b.recv_tagged(seq, 0xFFFF_FFFF)) for seq in range(1, 6)}
    exact = asyncio.create_task(b.recv_tagged(BODY | 9))
    any_tag = asyncio.create_task(b.recv_tagged(0, mask=0))
    await asyncio.sleep(0.01)
    for seq in (5, 3, 1, 4, 2):
        await a.send_tagged(BODY | seq, f"body {seq}".encode())
    await a.send_tagged(BODY | 9, b"nine")
    await a.send_tagged(77, b"for whoever")
    for seq, task in waiters.items():
        message = await asyncio.wait_for(task, 5)
        assert message.tag == BODY | seq
        assert as_bytes(message.payload) == f"body {seq}".encode()
    assert as_bytes((await asyncio.wait_for(exact, 5)).payload) == b"nine"
    assert (await asyncio.wait_for(any_tag, 5)).tag == 77


async def test_waiters_for_one_tag_are_served_in_order(pair: Pair) -> None:
    a, b = pair
    first = asyncio.create_task(b.recv_tagged(3))
    await asyncio.sleep(0)
    second = asyncio.create_task(b.recv_tagged(3))
    untagged = [asyncio.create_task(b.recv()) for _ in range(3)]
    await asyncio.sleep(0.01)
    await a.send_tagged(3, b"one")
    await a.send_tagged(3, b"two")
    for i in range(3):
        await a.send(bytes([i]))
    assert as_bytes((await asyncio.wait_for(first, 5)).payload) == b"one"
    assert as_bytes((await asyncio.wait_for(second, 5)).payload) == b"two"
    assert [bytes(await asyncio.wait_for(t, 5)) for t in untagged] == [b"\x00", b"\x01", b"\x02"]


async def test_cancelled_waiter_loses_no_message(pair: Pair) -> None:
    a, b = pair
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(b.recv_tagged(1), 0.02)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(b.recv(), 0.02)
    await a.send_tagged(1, b"late")
    await a.send(b"late untagged")
    assert as_bytes((await asyncio.wait_for(b.recv_tagged(1), 5)).payload) == b"late"
    assert bytes(await asyncio.wait_for(b.recv(), 5)) == b"late untagged"


async def test_a_message_given_back_by_a_cancelled_consumer_goes_to_the_next(pair: Pair) -> None:
    _, b = pair
    first = asyncio.create_task(b.recv())
    second = asyncio.create_task(b.recv())
    await asyncio.sleep(0.01)
    b._deliver(None, b"only one", 8)  # as the reader does when a message arrives ...
    first.cancel()  # ... and the first consumer is cancelled before it could run
    assert bytes(await asyncio.wait_for(second, 5)) == b"only one"
    with pytest.raises(asyncio.CancelledError):
        await first

    first_tagged = asyncio.create_task(b.recv_tagged(8))
    second_tagged = asyncio.create_task(b.recv_tagged(8, 0xFF))
    await asyncio.sleep(0.01)
    b._deliver(8, bytearray(b"tagged"), 6)
    first_tagged.cancel()
    assert bytes((await asyncio.wait_for(second_tagged, 5)).view()) == b"tagged"
    with pytest.raises(asyncio.CancelledError):
        await first_tagged

    lone = asyncio.create_task(b.recv_tagged(9))
    await asyncio.sleep(0.01)
    b._deliver(9, bytearray(b"kept"), 4)
    lone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await lone
    assert b.buffered_bytes == 4  # nobody else waited: it is held again
    assert bytes((await b.recv_tagged(9)).view()) == b"kept"


@pytest.mark.parametrize("size", [0, 100, 300_000, 3 << 20])
async def test_allocator_receives_payload_in_place(kind: str, size: int) -> None:
    async with make_pair(kind) as (a, b):
        calls: list[tuple[int, int]] = []
        buffers: list[np.ndarray[Any, Any]] = []

        def allocator(tag: int, length: int) -> np.ndarray[Any, Any]:
            calls.append((tag, length))
            buffers.append(np.zeros(length, dtype=np.uint8))
            return buffers[-1]

        b.set_allocator(allocator)
        data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        await a.send(b"metadata first")
        await a.send_tagged(BODY | 42, data)
        assert bytes(await b.recv()) == b"metadata first"
        message = await b.recv_tagged(42, 0xFFFF_FFFF)
        assert calls == [(BODY | 42, size)]
        assert message.payload is buffers[0]
        assert np.array_equal(buffers[0], data)
        b.set_allocator(None)
        await a.send_tagged(1, data)
        default = (await b.recv_tagged(1)).payload
        assert isinstance(default, np.ndarray)
        assert np.array_equal(default, data)


async def test_default_allocator_is_aligned() -> None:
    for length in (0, 1, 1000, 5 << 20):
        buffer = default_allocator(0, length)
        assert buffer.dtype == np.uint8
        assert buffer.nbytes == length
        assert length == 0 or buffer.ctypes.data % ALIGNMENT == 0  # numpy moves empty slices' pointers
        assert buffer.flags.writeable
    assert aligned_empty(10, 4096).ctypes.data % 4096 == 0


async def test_buffer_pool_reuses_only_unreferenced_buffers() -> None:
    pool = BufferPool(max_bytes=32 << 20, min_bytes=1 << 20)
    first = pool.allocate(3 << 20)
    address = first.ctypes.data
    view = first[100:200]
    del first
    second = pool.allocate(3 << 20)
    assert second.ctypes.data != address  # a view of the first is alive
    as_memoryview = second.data
    second_address = second.ctypes.data
    del view, second
    third = pool.allocate(3 << 20)
    assert third.ctypes.data == address  # the first is free again; the second is held by the memoryview
    assert third.ctypes.data != second_address
    assert as_memoryview.nbytes == 3 << 20
    assert pool.held_bytes <= 32 << 20
    assert pool.allocate(100).nbytes == 100  # small buffers are not pooled
    pool.clear()
    assert pool.held_bytes == 0


def test_buffer_pool_allocate_at_gives_each_array_its_own_address() -> None:
    # UCX receives into the address given with the array: it must be the array's first byte, across slabs,
    # and the carved arrays must not overlap
    pool = BufferPool(max_bytes=32 << 20, slab_max=64 << 10, slab_bytes=256 << 10)
    seen: list[tuple[int, int]] = []
    arrays = []
    for length in [0, 1, 100, 16 << 10, 64 << 10, 200 << 10, 3 << 20] * 6:
        array, address = pool.allocate_at(length)
        assert array.nbytes == length
        if length:  # (an empty array's address is whatever numpy makes it: nothing is written there)
            assert address == array.ctypes.data
            assert address % ALIGNMENT == 0
            seen.append((address, address + length))
        arrays.append(array)
    seen.sort()
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(seen))


def test_buffer_pool_shares_a_size_class_and_never_hands_a_live_array_out() -> None:
    pool = BufferPool(max_bytes=64 << 20)
    first = pool.allocate(800_000)
    address = first.ctypes.data
    del first
    near = pool.allocate(800_001)  # a slightly different size of the same class
    assert near.ctypes.data == address and near.nbytes == 800_001
    live = [pool.allocate(800_000) for _ in range(10)]  # the queue is all in use: fresh arrays
    addresses = {b.ctypes.data for b in [near, *live]}
    assert len(addresses) == 11  # no two live buffers share memory
    for b in live:
        assert b.ctypes.data % ALIGNMENT == 0
    del live
    again = [pool.allocate(800_000) for _ in range(10)]  # idle ones come back, the live one never
    got = {b.ctypes.data for b in again}
    assert address not in got and len(got) == 10
    assert len(got & addresses) >= 5  # (a few in-use arrays are checked per allocation, not all)
    assert pool.held_bytes <= 64 << 20


def test_buffer_pool_forgets_idle_arrays_to_stay_within_its_budget() -> None:
    pool = BufferPool(max_bytes=8 << 20)
    small = [pool.allocate(1 << 20) for _ in range(6)]  # about 6.1 MiB of raw arrays
    held = pool.held_bytes
    assert 6 << 20 < held <= 8 << 20
    big = pool.allocate(3 << 20)  # does not fit while the small ones are in use: allocated, not pooled
    assert pool.held_bytes == held
    del small, big
    big = pool.allocate(3 << 20)  # the idle small ones make room for it
    assert pool.held_bytes <= 8 << 20
    big_address = big.ctypes.data
    del big
    assert pool.allocate(3 << 20).ctypes.data == big_address  # and it is pooled now


@pytest.mark.parametrize("result", ["short", "readonly", "raises", "resource"])
async def test_bad_allocator_fails_the_connection(kind: str, result: str) -> None:
    async with make_pair(kind) as (a, b):

        def allocator(tag: int, length: int) -> Any:
            if result == "short":
                return bytearray(length - 1)
            if result == "readonly":
                return bytes(length)
            if result == "raises":
                raise RuntimeError("no memory today")
            raise ResourceError("arena full")

        b.set_allocator(allocator)
        await a.send_tagged(5, b"payload")
        expected = ResourceError if result == "resource" else TransportError
        with pytest.raises(expected, match=r"arena full|no memory|writable buffer"):
            await asyncio.wait_for(b.recv_tagged(5), 5)
        assert b.closed


async def test_large_payload_integrity(kind: str) -> None:
    size = 64 << 20
    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    async with make_pair(kind) as (a, b):
        sender = asyncio.create_task(a.send_tagged(BODY | 1, [data[:12345], data[12345:]]))
        message = await asyncio.wait_for(b.recv_tagged(1, 0xFFFF_FFFF), 30)
        await sender
        payload = message.payload
        assert isinstance(payload, np.ndarray)
        assert payload.ctypes.data % ALIGNMENT == 0
        assert np.array_equal(payload, data)
        # untagged messages larger than the staging buffer arrive intact too
        await a.send(data[: 5 << 20])
        assert np.array_equal(np.frombuffer(await asyncio.wait_for(b.recv(), 30), np.uint8), data[: 5 << 20])


def _payload(sender: int, index: int) -> bytes:
    size = [0, 10, 5000, 200_000, 1_500_000][(sender + index) % 5]
    return bytes([sender * 16 + index % 16]) * size


async def test_concurrent_senders_do_not_interleave(kind: str) -> None:
    senders, count = 4, 12
    async with make_pair(kind) as (a, b):

        async def send_all(sender: int) -> None:
            for index in range(count):
                await a.send_tagged((sender << 32) | index, _payload(sender, index))
                await a.send(f"{sender}:{index};".encode() * (index + 1))

        tasks = [asyncio.create_task(send_all(s)) for s in range(senders)]
        untagged: dict[int, list[int]] = {s: [] for s in range(senders)}
        for _ in range(senders * count):
            text = bytes(await asyncio.wait_for(b.recv(), 30)).decode()
            sender, index = map(int, text.split(";")[0].split(":"))
            assert text == f"{sender}:{index};" * (index + 1)
            untagged[sender].append(index)
        for sender in range(senders):
            assert untagged[sender] == list(range(count))  # each sender's messages stay in its order
            for index in range(count):
                message = await asyncio.wait_for(b.recv_tagged((sender << 32) | index), 30)
                assert as_bytes(message.payload) == _payload(sender, index)
        await asyncio.gather(*tasks)


async def test_local_close(pair: Pair) -> None:
    a, _ = pair
    waiting = asyncio.create_task(a.recv())
    tagged_waiting = asyncio.create_task(a.recv_tagged(1))
    await asyncio.sleep(0.01)
    await a.close()
    assert a.closed
    for task in (waiting, tagged_waiting):
        with pytest.raises(TransportError, match="closed"):
            await asyncio.wait_for(task, 5)
    with pytest.raises(TransportError):
        await a.send(b"x")
    with pytest.raises(TransportError):
        await a.send_tagged(1, b"x")
    with pytest.raises(TransportError):
        await a.recv()
    await a.close()  # idempotent
    assert "closed" in repr(a)


async def test_peer_close_wakes_waiters_after_delivering_what_arrived(pair: Pair) -> None:
    a, b = pair
    pending_tagged = asyncio.create_task(b.recv_tagged(99))
    await asyncio.sleep(0.01)
    await a.send(b"last words")
    await a.send_tagged(1, b"last body")
    await a.close()
    with pytest.raises(TransportError, match="peer closed"):
        await asyncio.wait_for(pending_tagged, 5)
    assert bytes(await asyncio.wait_for(b.recv(), 5)) == b"last words"
    assert as_bytes((await b.recv_tagged(1)).payload) == b"last body"
    with pytest.raises(TransportError, match="peer closed"):
        await asyncio.wait_for(b.recv(), 5)
    with pytest.raises(TransportError, match="peer closed"):
        await asyncio.wait_for(b.recv_tagged(1), 5)
    assert b.closed
    with pytest.raises(TransportError):
        await b.send(b"anyone there?")


async def test_context_manager_closes(kind: str) -> None:
    async with make_pair(kind) as (a, b):
        async with a as entered:
            assert entered is a
            await a.send(b"x")
        assert a.closed
        assert bytes(await b.recv()) == b"x"


async def test_buffered_bytes_and_limits(kind: str) -> None:
    async with make_pair(kind, max_message_bytes=1000, max_buffered_bytes=10_000) as (a, b):
        assert (b.max_message_bytes, b.max_buffered_bytes) == (1000, 10_000)
        await a.send(b"x" * 100)
        await a.send_tagged(1, b"y" * 200)
        for _ in range(100):
            if b.buffered_bytes == 300:
                break
            await asyncio.sleep(0.01)
        assert b.buffered_bytes == 300
        await b.recv()
        assert b.buffered_bytes == 200
        await b.recv_tagged(1)
        assert b.buffered_bytes == 0


async def test_message_over_the_limit_fails_the_receiver(kind: str) -> None:
    async with make_pair(kind, max_message_bytes=1000) as (a, b):
        calls: list[int] = []

        def allocator(tag: int, length: int) -> bytearray:
            calls.append(length)
            return bytearray(length)

        b.set_allocator(allocator)
        await a.send_tagged(3, b"x" * 1000)  # exactly at the limit: fine
        assert len(as_bytes((await asyncio.wait_for(b.recv_tagged(3), 5)).payload)) == 1000
        with contextlib.suppress(TransportError):  # in-process the sender learns at once; over TCP, later
            await a.send_tagged(4, b"x" * 1001)
        with pytest.raises(ResourceError, match="1001 bytes"):
            await asyncio.wait_for(b.recv_tagged(4), 5)
        assert calls == [1000]
        assert b.closed


def test_defaults() -> None:
    assert DEFAULT_MAX_MESSAGE_BYTES == 4 << 30
    assert DEFAULT_MAX_BUFFERED_BYTES == 256 << 20
    with pytest.raises(ValueError, match="max_buffered_bytes"):
        from dissoc.transport.inproc import InprocConnection

        InprocConnection(max_buffered_bytes=0)


def test_buffer_pool_carves_small_buffers_from_slabs() -> None:
    pool = BufferPool(slab_max=4096, slab_bytes=16384)
    first, second = pool.allocate(100), pool.allocate(4096)
    for buffer in (first, second):
        assert buffer.ctypes.data % ALIGNMENT == 0 and buffer.flags.writeable
    assert first.base is second.base  # one slab
    assert second.ctypes.data >= first.ctypes.data + 100  # no overlap
    first[:] = 1
    second[:] = 2
    assert int(first.sum()) == 100  # writing one never touches the other
    rest = [pool.allocate(4096) for _ in range(3)]  # the slab is used up on the third
    assert rest[-1].base is not first.base
    assert pool.allocate(4097).base is not rest[-1].base  # over slab_max: allocated on its own
    assert pool.allocate(0).nbytes == 0
    with pytest.raises(ValueError, match="slab_max"):
        BufferPool(slab_max=2, slab_bytes=1)


def test_buffer_pool_reuses_slabs_nothing_uses() -> None:
    pool = BufferPool(slab_max=4096, slab_bytes=8192)
    held = pool.allocate(4096)
    held_at = held.ctypes.data
    dropped = [pool.allocate(4096) for _ in range(3)]  # fills the first slab, starts a second
    second_at = dropped[1].ctypes.data  # the start of the second slab
    assert abs(second_at - held_at) >= 8192
    del dropped
    more = [pool.allocate(4096) for _ in range(4)]  # the second slab is used up again: another is needed
    addresses = [b.ctypes.data for b in more]
    assert second_at in addresses  # the second slab was idle and is carved again
    assert held_at not in addresses  # the first is still in use (``held``): never handed out twice
    assert held.ctypes.data == held_at


def test_as_views_gives_flat_byte_views_whatever_it_is_given() -> None:
    """Partial sends slice these views by bytes: every view must be one-dimensional, one byte per item."""
    import pyarrow as pa

    from dissoc.transport.base import as_views

    given = [
        b"abc",
        pa.py_buffer(b"defg"),
        memoryview(b"hi"),
        np.arange(6, dtype=np.uint8).reshape(2, 3).data,  # 2-D bytes
        np.arange(2, dtype=np.int64).data,  # 8 bytes an item
    ]
    views, total = as_views(given)
    assert total == 3 + 4 + 2 + 6 + 16
    assert all(v.ndim == 1 and v.itemsize == 1 for v in views)
    assert [v.nbytes for v in views] == [3, 4, 2, 6, 16]
    assert bytes(views[3][4:]) == bytes([4, 5])  # sliced by bytes, as a partial send does
