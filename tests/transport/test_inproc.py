"""The in-process transport's fault injection, its named listeners, its limits, and its names until 0.2."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from dissoc.errors import ResourceError, TransportError
from dissoc.transport import Connection, TaggedMessage, connect, inproc, serve
from dissoc.transport.inproc import Faults, InprocConnection, connect_inproc, inproc_pair, serve_inproc


def payload_of(message: TaggedMessage) -> bytes:
    return bytes(message.view())


async def arrival_order(faults: Faults, count: int = 40) -> list[int]:
    """Tags of ``count`` tagged messages in the order they arrive through ``faults``."""
    a, b = inproc_pair(faults)
    async with a, b:
        for i in range(count):
            await a.send_tagged(i, bytes([i]))
        order = []
        for _ in range(count):
            message = await asyncio.wait_for(b.recv_tagged(0, mask=0), 5)
            assert payload_of(message) == bytes([message.tag])
            order.append(message.tag)
        return order


async def test_no_faults_keeps_order() -> None:
    assert await arrival_order(Faults()) == list(range(40))


async def test_reorder_shuffles_within_the_window_and_replays_with_a_seed() -> None:
    faults = Faults(seed=3, reorder_window=8)
    order = await arrival_order(faults)
    assert sorted(order) == list(range(40))
    assert order != list(range(40))
    for start in range(0, 40, 8):  # nothing leaves its window
        assert sorted(order[start : start + 8]) == list(range(start, start + 8))
    assert await arrival_order(faults) == order
    assert await arrival_order(Faults(seed=4, reorder_window=8)) != order


async def test_reorder_flushes_a_partial_window() -> None:
    a, b = inproc_pair(reorder_window=100, seed=1, reorder_linger=0.01)
    async with a, b:
        for i in range(3):
            await a.send_tagged(i, b"x")
        tags = sorted([(await asyncio.wait_for(b.recv_tagged(0, 0), 5)).tag for _ in range(3)])
        assert tags == [0, 1, 2]


async def interleaved(faults: Faults) -> tuple[list[int], list[int]]:
    a, b = inproc_pair(faults)
    async with a, b:
        for i in range(30):
            await a.send(bytes([i]))
            await a.send_tagged(i, bytes([i]))
        untagged = [(await asyncio.wait_for(b.recv(), 5))[0] for _ in range(30)]
        tagged = [(await asyncio.wait_for(b.recv_tagged(0, 0), 5)).tag for _ in range(30)]
        return untagged, tagged


async def test_reorder_keeps_untagged_order_unless_asked() -> None:
    untagged, tagged = await interleaved(Faults(seed=5, reorder_window=10))
    assert untagged == list(range(30))
    assert tagged != list(range(30))
    assert sorted(tagged) == list(range(30))
    untagged, _ = await interleaved(Faults(seed=5, reorder_window=10, reorder_untagged=True))
    assert untagged != list(range(30))
    assert sorted(untagged) == list(range(30))


async def test_reorder_moves_tagged_relative_to_untagged(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = inproc_pair(Faults(seed=2, reorder_window=16))
    arrivals: list[tuple[str, int]] = []
    deliver = b._deliver

    def record(tag: int | None, payload: Any, nbytes: int) -> None:
        arrivals.append(("u", payload[0]) if tag is None else ("t", tag))
        deliver(tag, payload, nbytes)

    monkeypatch.setattr(b, "_deliver", record)
    async with a, b:
        sent = []
        for i in range(8):
            await a.send(bytes([i]))
            await a.send_tagged(i, bytes([i]))
            sent += [("u", i), ("t", i)]
        for _ in range(8):
            await asyncio.wait_for(b.recv(), 5)
        assert sorted(arrivals) == sorted(sent)
        assert [n for k, n in arrivals if k == "u"] == list(range(8))  # untagged keep their order
        assert [n for k, n in arrivals if k == "t"] != list(range(8))
        assert [k for k, _ in arrivals] != [k for k, _ in sent]  # kinds moved relative to each other


async def test_delay_and_jitter() -> None:
    a, b = inproc_pair(delay=0.05, jitter=0.02, seed=1)
    async with a, b:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await a.send(b"first")
        await a.send(b"second")
        assert loop.time() - start < 0.04  # sending does not wait for the delay
        assert bytes(await asyncio.wait_for(b.recv(), 5)) == b"first"
        assert loop.time() - start >= 0.05
        assert bytes(await asyncio.wait_for(b.recv(), 5)) == b"second"
        assert loop.time() - start < 1.0


async def test_duplicate_drop_and_corrupt_given_messages() -> None:
    a, b = inproc_pair(duplicate={1}, drop={2}, corrupt={3}, seed=9)
    async with a, b:
        original = [bytes([i]) * 64 for i in range(5)]
        for i, data in enumerate(original):
            await a.send_tagged(i, data)
        assert payload_of(await b.recv_tagged(0)) == original[0]
        assert payload_of(await b.recv_tagged(1)) == original[1]
        assert payload_of(await b.recv_tagged(1)) == original[1]  # twice
        corrupted = payload_of(await b.recv_tagged(3))
        assert len(corrupted) == 64
        assert sum(x != y for x, y in zip(corrupted, original[3], strict=True)) == 1
        assert payload_of(await b.recv_tagged(4)) == original[4]
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(b.recv_tagged(2), 0.05)  # dropped
        stats = a.sent_stats
        assert (stats.messages, stats.dropped, stats.duplicated, stats.corrupted) == (5, 1, 1, 1)
        assert stats.corrupted_indices == [3]
        assert b.received_stats is stats


async def test_fault_rates_are_seeded() -> None:
    async def survivors(seed: int) -> list[int]:
        a, b = inproc_pair(drop_rate=0.3, seed=seed)
        async with a, b:
            for i in range(100):
                await a.send(bytes([i]))
            await a.close()
            got = []
            with pytest.raises(TransportError):
                while True:
                    got.append((await asyncio.wait_for(b.recv(), 5))[0])
            return got

    first = await survivors(11)
    assert 40 < len(first) < 95
    assert first == sorted(first)
    assert await survivors(11) == first
    assert await survivors(12) != first


async def test_cut_after_messages() -> None:
    a, b = inproc_pair(cut_after_messages=3)
    async with a, b:
        for i in range(3):
            await a.send(bytes([i]))
        with pytest.raises(TransportError, match="cut after 3 messages"):
            await a.send(b"one too many")
        assert [bytes(await b.recv()) for _ in range(3)] == [b"\x00", b"\x01", b"\x02"]
        with pytest.raises(TransportError, match="cut"):
            await asyncio.wait_for(b.recv(), 5)
        with pytest.raises(TransportError, match="cut"):
            await asyncio.wait_for(a.recv(), 5)  # the other direction is cut too
        with pytest.raises(TransportError, match="cut"):
            await b.send(b"reply")
        assert a.sent_stats.cut


async def test_cut_after_bytes_in_the_middle_of_a_message_loses_it() -> None:
    a, b = inproc_pair(cut_after_bytes=2500)
    async with a, b:
        waiting = asyncio.create_task(b.recv_tagged(2))
        await a.send_tagged(0, bytes(1000))
        await a.send_tagged(1, bytes(1000))
        with pytest.raises(TransportError, match="middle"):
            await a.send_tagged(2, bytes(1000))
        with pytest.raises(TransportError, match="cut after 2000 bytes"):
            await asyncio.wait_for(waiting, 5)
        assert len(payload_of(await b.recv_tagged(0))) == 1000
        assert len(payload_of(await b.recv_tagged(1))) == 1000


async def test_cut_with_delay_delivers_what_was_in_flight() -> None:
    a, b = inproc_pair(delay=0.02, cut_after_messages=2)
    async with a, b:
        await a.send(b"1")
        await a.send(b"2")
        with pytest.raises(TransportError):
            await a.send(b"3")
        assert bytes(await asyncio.wait_for(b.recv(), 5)) == b"1"
        assert bytes(await asyncio.wait_for(b.recv(), 5)) == b"2"
        with pytest.raises(TransportError, match="cut"):
            await asyncio.wait_for(b.recv(), 5)


async def test_close_with_delay_delivers_in_flight_then_fails() -> None:
    a, b = inproc_pair(delay=0.02)
    async with b:
        await a.send(b"in flight")
        await a.close()
        assert bytes(await asyncio.wait_for(b.recv(), 5)) == b"in flight"
        with pytest.raises(TransportError, match="peer closed"):
            await asyncio.wait_for(b.recv(), 5)


async def test_sender_blocks_when_the_receiver_budget_is_full() -> None:
    a, b = inproc_pair(max_buffered_bytes=10_000)
    async with a, b:
        sent = [0]

        async def sender() -> None:
            for i in range(50):
                await a.send_tagged(i, bytes(1000))
                sent[0] += 1

        task = asyncio.create_task(sender())
        await asyncio.sleep(0.05)
        assert sent[0] == 10
        assert not task.done()
        assert b.buffered_bytes == 10_000
        for i in range(50):
            assert len(payload_of(await asyncio.wait_for(b.recv_tagged(i), 5))) == 1000
        await asyncio.wait_for(task, 5)


async def test_oversized_message_in_memory() -> None:
    a, b = inproc_pair(max_message_bytes=10)
    async with a, b:
        with pytest.raises(TransportError, match="rejected"):
            await a.send(bytes(11))
        with pytest.raises(ResourceError, match="11 bytes"):
            await b.recv()
        with pytest.raises(TransportError, match="peer closed"):
            await asyncio.wait_for(a.recv(), 5)


async def test_named_listener_with_faults_through_the_registry() -> None:
    received: list[bytes] = []

    async def handler(conn: Connection) -> None:
        while True:
            try:
                received.append(bytes(await conn.recv()))
            except TransportError:
                return
            await conn.send_tagged(1, b"reply")

    listener = await serve("inproc", "unit-test", 0, handler, to_client=Faults(duplicate={0}))
    async with listener:
        assert listener.address == "inproc://unit-test:0"
        client = await connect("inproc", "unit-test", 0, timeout=1)
        assert isinstance(client, InprocConnection)
        async with client:
            await client.send(b"hi")
            first = await asyncio.wait_for(client.recv_tagged(1), 5)
            second = await asyncio.wait_for(client.recv_tagged(1), 5)  # duplicated by the listener's faults
            assert payload_of(first) == payload_of(second) == b"reply"
        other = await connect_inproc("unit-test", recv_faults=Faults())
        async with other:
            await other.send(b"again")
            assert payload_of(await asyncio.wait_for(other.recv_tagged(1), 5)) == b"reply"
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(other.recv_tagged(1), 0.05)  # its own faults: no duplicate
        with pytest.raises(TransportError, match="in use"):
            await serve_inproc("unit-test", 0, handler)
    assert received == [b"hi", b"again"]
    with pytest.raises(TransportError, match="no in-process listener"):
        await connect_inproc("unit-test")
    anonymous = await serve_inproc("", 0, handler)
    async with anonymous:
        assert anonymous.host.startswith("inproc-")


async def test_the_names_of_0_2_still_work_for_one_release() -> None:
    """The transport was the memory transport until 0.2: its old names are aliases of the new, and ``mem``
    an alias of the ``inproc`` scheme."""
    assert inproc.MemoryConnection is InprocConnection
    assert inproc.MemoryListener is inproc.InprocListener
    assert inproc.memory_pair is inproc_pair
    assert inproc.serve_memory is serve_inproc
    assert inproc.connect_memory is connect_inproc

    async def echo(conn: Connection) -> None:
        await conn.send(await conn.recv())

    async with (
        await serve("mem", "old-name", 0, echo) as listener,
        await connect("mem", "old-name", 0) as conn,
    ):
        assert isinstance(listener, inproc.InprocListener) and isinstance(conn, InprocConnection)
        await conn.send(b"ping")
        assert bytes(await asyncio.wait_for(conn.recv(), 5)) == b"ping"


async def test_large_payload_through_the_receivers_allocator() -> None:
    a, b = inproc_pair()
    async with a, b:
        placed: list[np.ndarray] = []

        def allocator(tag: int, length: int) -> np.ndarray:
            placed.append(np.empty(length, dtype=np.uint8))
            return placed[-1]

        b.set_allocator(allocator)
        data = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8)
        await a.send_tagged(5, data)
        data[:] = 0  # the sender may reuse its buffer once send returns
        message = await b.recv_tagged(5)
        assert message.payload is placed[0]
        assert np.array_equal(placed[0], np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8))


def test_faults_validate() -> None:
    with pytest.raises(ValueError, match="drop_rate"):
        Faults(drop_rate=1.5)
    with pytest.raises(ValueError, match=">= 0"):
        Faults(delay=-1)
    assert not Faults().pipelined
    assert Faults(reorder_window=2).pipelined
    with pytest.raises(ValueError, match="either"):
        inproc_pair(Faults(), drop={1})
