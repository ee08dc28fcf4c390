"""What a connection lets a peer make it hold: per-tag limits, the shared receive budget, the buffers of a
departed peer (released at once, without the garbage collector), and the rate-limited log."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import struct
import weakref
from typing import Any

import numpy as np
import pytest
from helpers.transport import make_pair, raw_peer

from dissoc.buffers import aligned_empty
from dissoc.errors import ResourceError, TransportError
from dissoc.logs import RateLimitedLog
from dissoc.transport import TcpConnection
from dissoc.transport.base import ReceiveBudget, ReceiveBudgetError, TagLimitError

_HEADER = struct.Struct("<QQQ")
MiB = 1 << 20


async def test_a_tag_limit_refuses_larger_messages_of_that_tag_only(kind: str) -> None:
    async with make_pair(kind) as (a, b):
        b.limit_tag(7, 16)
        await a.send_tagged(8, b"x" * 100)  # another tag: no limit
        await a.send_tagged(7, b"y" * 16)  # at the limit
        assert bytes((await b.recv_tagged(8)).view()) == b"x" * 100
        assert bytes((await b.recv_tagged(7)).view()) == b"y" * 16
        with pytest.raises(TransportError):  # the peer refuses it (tcp: the send itself goes out)
            await a.send_tagged(7, b"z" * 17)
            await asyncio.wait_for(b.recv_tagged(7), 5)
        with pytest.raises(TagLimitError, match="limit for this tag is 16 bytes"):
            await asyncio.wait_for(b.recv_tagged(7), 5)
        b.limit_tag(9, None)  # removing a limit that was never set is fine


async def test_a_tag_limit_is_checked_from_the_header_before_anything_is_allocated() -> None:
    allocated: list[int] = []

    def allocator(tag: int, length: int) -> Any:
        allocated.append(length)
        return aligned_empty(length)

    async with raw_peer(allocator=allocator) as (conn, raw):
        conn.limit_tag(5, 1024)
        await _send(raw, _HEADER.pack(2, 5, 1 << 30) + b"a" * 4096)
        with pytest.raises(TagLimitError):
            await asyncio.wait_for(conn.recv_tagged(5), 5)
        assert allocated == []
        assert not conn.closed  # refused: nothing more is read, but the owner may still answer
        await conn.send(b"an answer")
        header = raw.recv(24)
        assert _HEADER.unpack(header) == (1, 0, 9)


async def _send(raw: socket.socket, data: bytes) -> None:
    await asyncio.to_thread(raw.sendall, data)


async def test_the_receive_budget_is_shared_and_given_back() -> None:
    budget = ReceiveBudget(10 * MiB)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        conns = []
        raws = []
        for _ in range(2):
            raw = socket.create_connection(("127.0.0.1", port))
            accepted, _ = listener.accept()
            raws.append(raw)
            conns.append(TcpConnection(accepted, receive_budget=budget))
        first, second = conns
        await _send(raws[0], _HEADER.pack(2, 1, 6 * MiB) + b"1" * MiB)  # partly received: 6 MiB reserved
        for _ in range(100):
            if budget.used:
                break
            await asyncio.sleep(0.01)
        assert budget.used == 6 * MiB
        await _send(raws[1], _HEADER.pack(2, 1, 6 * MiB))
        with pytest.raises(ReceiveBudgetError):
            await asyncio.wait_for(second.recv_tagged(1), 5)
        assert isinstance(ReceiveBudgetError("x"), ResourceError)
        await _send(raws[0], b"1" * (5 * MiB))  # the rest: delivered, still counted until claimed
        message = await asyncio.wait_for(first.recv_tagged(1), 5)
        assert message.view().nbytes == 6 * MiB
        assert budget.used == 0
        await _send(raws[0], _HEADER.pack(2, 2, 100) + b"2" * 100)  # held, unclaimed: counted until close
        for _ in range(100):
            if budget.used:
                break
            await asyncio.sleep(0.01)
        assert budget.used == 100
        for conn in conns:
            await conn.close()
        assert budget.used == 0
        for raw in raws:
            raw.close()
    finally:
        listener.close()


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "reset"])
async def test_a_departed_peer_releases_its_partly_received_payload_at_once(reset: bool) -> None:
    refs: list[weakref.ref[np.ndarray[Any, Any]]] = []

    def allocator(tag: int, length: int) -> Any:
        buffer = aligned_empty(length)
        refs.append(weakref.ref(buffer))
        return buffer

    gc.disable()
    try:
        async with raw_peer(allocator=allocator) as (conn, raw):
            held = asyncio.ensure_future(conn.recv_tagged(3))
            await _send(raw, _HEADER.pack(2, 4, 100) + b"h" * 100)  # held unread
            await _send(raw, _HEADER.pack(2, 3, 64 * MiB) + b"p" * (4 * MiB))  # partly received
            for _ in range(200):
                if len(refs) == 2:
                    break
                await asyncio.sleep(0.01)
            assert len(refs) == 2
            if reset:
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            raw.close()
            with pytest.raises(TransportError):
                await asyncio.wait_for(held, 5)
            await conn.close()
            del held
        alive = [ref() is not None for ref in refs]
        assert alive == [False, False], f"buffers outlived their closed connection (held, partial): {alive}"
    finally:
        gc.enable()


def test_rate_limited_log_counts_what_it_left_out(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("dissoc.test.ratelimit")
    limited = RateLimitedLog(logger, interval=0.2)
    with caplog.at_level(logging.WARNING, logger="dissoc.test.ratelimit"):
        logged = [limited.log(logging.WARNING, "kind", "failure %d", i) for i in range(1000)]
        assert logged.count(True) == 1
        assert limited.log(logging.WARNING, "other", "another kind")
        import time

        time.sleep(0.25)
        assert limited.log(logging.WARNING, "kind", "failure %d", 1000)
    lines = [r.getMessage() for r in caplog.records if r.name == "dissoc.test.ratelimit"]
    assert lines[0] == "failure 0" and lines[1] == "another kind"
    assert lines[2].startswith("failure 1000 (999 more like this")
    assert len(lines) == 3


async def test_a_consumer_just_handed_its_message_is_not_blocked() -> None:
    # One read carries a message for the consumer waiting in recv(), more untagged ones past the budget,
    # then the header of a large tagged message. The consumer has its message but has not resumed yet: it is
    # not blocked (it will take what is held), so reading pauses instead of refusing the large message as a
    # deadlock. (Found on Python 3.12, where the TLS flow-control test met this interleaving every time.)
    budget = 4096
    small = [bytes([i]) * 1000 for i in range(8)]
    big = b"z" * (5 * budget)
    async with raw_peer(max_buffered_bytes=budget) as (conn, raw):
        first = asyncio.ensure_future(conn.recv())
        await asyncio.sleep(0.05)  # waiting in recv() now
        chunk = b"".join(_HEADER.pack(1, 0, len(m)) + m for m in small)  # 1: untagged
        raw.sendall(chunk + _HEADER.pack(2, 7, len(big)) + big)  # 2: tagged
        assert bytes(await asyncio.wait_for(first, 5)) == small[0]
        for m in small[1:]:
            assert bytes(await asyncio.wait_for(conn.recv(), 5)) == m
        tagged = await asyncio.wait_for(conn.recv_tagged(7), 5)
        assert bytes(tagged.view()) == big
