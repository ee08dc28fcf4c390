"""UCX transport: round trips, masked probes, placement, large payloads, concurrency, peers going away."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import numpy as np
import pytest
from helpers.transport import connected_pair

from dissoc.errors import TransportError
from dissoc.transport import (
    Connection,
    MessageTooLargeError,
    aligned_empty,
    connect,
    registered_schemes,
    serve,
)

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(60)]

MiB = 1 << 20
BODY = 1 << 56  # body type 1 in the high byte


def ucx_pair(
    client_options: dict[str, Any] | None = None, server_options: dict[str, Any] | None = None
) -> contextlib.AbstractAsyncContextManager[tuple[Connection, Connection]]:
    """A client connection and the server side of it, through a UCX listener."""
    import dissoc.transport.ucx  # noqa: F401 - registers the "ucx" scheme

    return connected_pair("ucx", client_options, server_options, timeout=10)


def test_import_is_lazy_and_leaves_the_environment() -> None:
    code = textwrap.dedent(
        """
        import os, sys
        before = dict(os.environ)
        import dissoc.transport.ucx as ucx
        assert "ucxx" not in sys.modules, "importing the module imported ucxx"
        assert dict(os.environ) == before, "importing the module changed os.environ"
        from dissoc.transport import registered_schemes
        assert "ucx" in registered_schemes()
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


async def test_untagged_round_trip_both_ways() -> None:
    async with ucx_pair() as (client, server):
        messages = [b"", b"x", b"hello" * 100, bytes(range(256)) * 4096]  # 0 B .. 1 MiB
        for message in messages:
            await client.send(message)
        for message in messages:
            assert bytes(await server.recv()) == message
        await server.send([b"gath", memoryview(b"ered"), np.frombuffer(b"!", dtype=np.uint8)])
        assert bytes(await client.recv()) == b"gathered!"
        assert "ucx" in registered_schemes()


async def test_tagged_round_trip_and_order() -> None:
    async with ucx_pair() as (client, server):
        for i in range(20):
            await client.send_tagged(7, i.to_bytes(4, "little"))
        for i in range(20):
            message = await server.recv_tagged(7)
            assert message.tag == 7
            assert int.from_bytes(message.view(), "little") == i
        await server.send_tagged(2**64 - 1, b"max tag")
        message = await client.recv_tagged(2**64 - 1)
        assert bytes(message.view()) == b"max tag"
        await server.send_tagged(3, b"")
        assert (await client.recv_tagged(3)).view().nbytes == 0


async def test_send_many_keeps_order() -> None:
    async with ucx_pair() as (client, server):
        body = np.arange(3 * MiB, dtype=np.uint8)
        await server.send_many([(None, b"metadata 1"), (BODY | 1, [body[:100], body[100:]]), (None, b"eos")])
        assert bytes(await client.recv()) == b"metadata 1"
        assert np.array_equal(np.frombuffer((await client.recv_tagged(1, 0xFFFFFFFF)).view(), np.uint8), body)
        assert bytes(await client.recv()) == b"eos"


async def test_masked_tag_matching_ignores_the_high_byte() -> None:
    async with ucx_pair() as (client, server):
        await server.send_tagged(BODY | 5, b"body of 5")
        await server.send_tagged(BODY | 4, b"body of 4")
        await server.send_tagged(0x7F << 56 | 4, b"other type, seq 4")
        low = 0x00000000FFFFFFFF
        # Exact tags do not match a different high byte...
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(client.recv_tagged(4), 0.3)
        # ...the low-32-bit mask does, in arrival order, whatever the body type.
        first = await client.recv_tagged(4, low)
        second = await client.recv_tagged(4, low)
        assert (first.tag, bytes(first.view())) == (BODY | 4, b"body of 4")
        assert (second.tag, bytes(second.view())) == (0x7F << 56 | 4, b"other type, seq 4")
        five = await client.recv_tagged(5, low)
        assert five.tag == BODY | 5

        # A waiter registered before the message arrives gets it too.
        waiting = asyncio.create_task(client.recv_tagged(9, low))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await server.send_tagged(BODY | 9, b"late")
        message = await asyncio.wait_for(waiting, 5)
        assert message.tag == BODY | 9 and bytes(message.view()) == b"late"


async def test_allocator_places_payloads() -> None:
    arena = aligned_empty(8 * MiB)
    calls: list[tuple[int, int]] = []
    offset = 0

    def allocator(tag: int, length: int) -> np.ndarray[Any, Any]:
        nonlocal offset
        calls.append((tag, length))
        start = -(-offset // 64) * 64
        offset = start + length
        return arena[start : start + length]

    async with ucx_pair() as (client, server):
        client.set_allocator(allocator)
        first = np.arange(1000, dtype=np.uint8)
        second = np.full(3 * MiB, 0xAB, dtype=np.uint8)
        await server.send_tagged(BODY | 1, first)
        await server.send_tagged(BODY | 2, second)
        one = await client.recv_tagged(1, 0xFFFFFFFF)
        two = await client.recv_tagged(2, 0xFFFFFFFF)
        assert calls == [(BODY | 1, 1000), (BODY | 2, 3 * MiB)]
        for message, expected in ((one, first), (two, second)):
            payload = message.payload
            assert isinstance(payload, np.ndarray)
            assert np.shares_memory(payload, arena)
            assert payload.ctypes.data % 64 == 0
            assert np.array_equal(payload, expected)
        client.set_allocator(None)
        await server.send_tagged(3, b"abc")
        assert not np.shares_memory(np.asarray((await client.recv_tagged(3)).payload), arena)


async def test_64_mib_payload() -> None:
    size = 64 * MiB
    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    async with ucx_pair() as (client, server):
        await client.send_tagged(BODY | 1, data)
        message = await server.recv_tagged(1, 0xFFFFFFFF)
        assert message.view().nbytes == size
        assert np.array_equal(np.frombuffer(message.view(), dtype=np.uint8), data)
        # Gathered from several buffers, and untagged (an active message).
        await server.send_tagged(2, [data[: size // 3], data[size // 3 :]])
        back = await client.recv_tagged(2)
        assert np.array_equal(np.frombuffer(back.view(), dtype=np.uint8), data)
        await server.send(data[: 8 * MiB])
        assert np.array_equal(np.frombuffer(await client.recv(), dtype=np.uint8), data[: 8 * MiB])


async def test_concurrent_senders() -> None:
    async with ucx_pair() as (client, server):

        async def sender(task: int) -> None:
            for i in range(25):
                payload = np.full(1000 * (i + 1), task, dtype=np.uint8)
                await client.send_tagged(task << 32 | i, payload)
                await client.send(bytes([task, i]))

        await asyncio.gather(*(sender(task) for task in range(6)))
        seen: dict[int, list[int]] = {}
        for _ in range(6 * 25):
            message = bytes(await server.recv())
            seen.setdefault(message[0], []).append(message[1])
        assert all(order == list(range(25)) for order in seen.values()) and len(seen) == 6

        async def receiver(task: int) -> None:
            for i in range(25):
                message = await server.recv_tagged(task << 32 | i)
                view = np.frombuffer(message.view(), dtype=np.uint8)
                assert view.size == 1000 * (i + 1) and (view == task).all()

        await asyncio.gather(*(receiver(task) for task in reversed(range(6))))


async def test_peer_close_is_a_transport_error_not_a_hang() -> None:
    async with ucx_pair() as (client, server):
        await client.send(b"before close")
        await client.send_tagged(1, b"tagged before close")
        waiting = asyncio.create_task(server.recv_tagged(99))
        await client.close()
        with pytest.raises(TransportError):
            await asyncio.wait_for(waiting, 10)
        # Messages the peer sent before it closed are still handed out, then TransportError.
        assert bytes(await server.recv()) == b"before close"
        assert bytes((await server.recv_tagged(1)).view()) == b"tagged before close"
        with pytest.raises(TransportError):
            await asyncio.wait_for(server.recv(), 10)
        with pytest.raises(TransportError):
            await client.send(b"after close")
        with pytest.raises(TransportError):
            await client.recv()


async def test_server_close_fails_the_client() -> None:
    async with ucx_pair() as (client, server):
        waiting = asyncio.create_task(client.recv())
        await asyncio.sleep(0.05)
        await server.close()
        with pytest.raises(TransportError):
            await asyncio.wait_for(waiting, 10)


async def test_killed_peer_process_is_detected() -> None:
    from dissoc.transport.ucx import serve_ucx

    accepted: asyncio.Queue[Connection] = asyncio.Queue()
    done = asyncio.Event()

    async def handler(conn: Connection) -> None:
        await accepted.put(conn)
        await done.wait()

    listener = await serve_ucx("127.0.0.1", 0, handler)
    code = textwrap.dedent(
        f"""
        import asyncio, time
        from dissoc.transport.ucx import connect_ucx
        async def main():
            conn = await connect_ucx("127.0.0.1", {listener.port})
            await conn.send(b"hello from the child")
            print("sent", flush=True)
            await asyncio.sleep(60)
        asyncio.run(main())
        """
    )
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE)
    try:
        server = await asyncio.wait_for(accepted.get(), 20)
        assert child.stdout is not None
        assert (await asyncio.wait_for(child.stdout.readline(), 20)).strip() == b"sent"
        assert bytes(await asyncio.wait_for(server.recv(), 10)) == b"hello from the child"
        waiting = asyncio.create_task(server.recv_tagged(1))
        child.kill()
        await child.wait()
        started = time.monotonic()
        with pytest.raises(TransportError):
            await asyncio.wait_for(waiting, 20)
        assert time.monotonic() - started < 20
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
        done.set()
        listener.close()
        await asyncio.wait_for(listener.wait_closed(), 10)


async def test_several_clients_are_isolated() -> None:
    async def echo(conn: Connection) -> None:
        # Tagged want_data-like requests come back to the connection that sent them, on the untagged stream.
        while True:
            try:
                message = await conn.recv_tagged(1)
            except TransportError:
                return
            await conn.send(message.view())
            await conn.send_tagged(BODY | 1, message.view())

    async with await serve("ucx", "127.0.0.1", 0, echo) as listener:
        clients = [await connect("ucx", "127.0.0.1", listener.port) for _ in range(4)]
        try:

            async def talk(index: int, conn: Connection) -> None:
                for round_ in range(10):
                    payload = f"client {index} round {round_}".encode() * (index + 1)
                    await conn.send_tagged(1, payload)  # every client uses the same tag
                    assert bytes(await conn.recv()) == payload
                    assert bytes((await conn.recv_tagged(1, 0xFFFFFFFF)).view()) == payload

            await asyncio.wait_for(asyncio.gather(*(talk(i, c) for i, c in enumerate(clients))), 30)
            assert len(listener.connections) == 4
        finally:
            for conn in clients:
                await conn.close()


async def test_message_limits() -> None:
    async with ucx_pair(client_options={"max_message_bytes": 1000}) as (client, server):
        await server.send_tagged(1, bytes(1000))
        assert (await client.recv_tagged(1)).view().nbytes == 1000
        await server.send_tagged(2, bytes(1001))
        with pytest.raises(MessageTooLargeError):
            await asyncio.wait_for(client.recv_tagged(2), 10)


async def test_buffering_budget_leaves_messages_in_ucx(monkeypatch: pytest.MonkeyPatch) -> None:
    from dissoc.transport.ucx import connection as ucx_connection

    # A sender goes on while its sends are under way, up to its send window (1 MiB here).
    monkeypatch.setattr(ucx_connection, "SEND_WINDOW_BYTES", MiB)
    async with ucx_pair(client_options={"max_buffered_bytes": 1 * MiB}) as (client, server):
        # Large sends complete only once the receiver took them (rendezvous): what exceeds the budget waits
        # in UCX, and so do its senders, once their sends under way fill the window.
        sends = [asyncio.create_task(server.send_tagged(i, bytes(MiB))) for i in range(8)]
        await asyncio.sleep(0.3)
        assert client.buffered_bytes <= 2 * MiB
        assert not all(send.done() for send in sends)
        for i in reversed(range(8)):
            assert (await asyncio.wait_for(client.recv_tagged(i), 10)).view().nbytes == MiB
        await asyncio.wait_for(asyncio.gather(*sends), 10)


async def test_pause_reading_holds_back_even_waiters() -> None:
    async with ucx_pair() as (client, server):
        client.pause_reading()
        await server.send_tagged(1, b"held in UCX")
        waiting = asyncio.create_task(client.recv_tagged(1))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        client.resume_reading()
        assert bytes((await asyncio.wait_for(waiting, 5)).view()) == b"held in UCX"


async def test_idle_connection_does_not_spin() -> None:
    async with ucx_pair() as (client, server):
        waiting = asyncio.create_task(client.recv_tagged(1))
        await asyncio.sleep(0.1)
        before = time.process_time()
        await asyncio.sleep(1.0)
        used = time.process_time() - before
        waiting.cancel()
        assert used < 0.2, f"an idle connection used {used:.2f} s of CPU in 1 s"
        del server


async def test_connect_to_nothing_fails_cleanly() -> None:
    from dissoc.transport.ucx import connect_ucx

    with pytest.raises(TransportError):
        await connect_ucx("127.0.0.1", 1, timeout=5)


async def test_lanes_name_the_ucx_transports_of_both_ends() -> None:
    async with ucx_pair() as (client, server):
        await client.send_tagged(1, b"up")
        await server.recv_tagged(1)
        # ucxx's endpoint on the client, dissoc's own (an accepted connection request) on the server; both
        # went through the listener's socket address: TCP's connection manager has a lane
        for conn in (client, server):
            lanes = conn.lanes()
            assert lanes and all(isinstance(lane, str) and lane for lane in lanes), lanes
            assert "tcp" in {lane.split("/", 1)[0] for lane in lanes}, lanes
        await client.close()
        assert client.lanes() == ()  # a closed endpoint is not asked


async def test_the_listener_accepts_on_a_worker_it_made_ahead() -> None:
    """Making a UCX worker takes about 10 ms: a listener keeps one made for its next connection of each
    kind, takes it when a connection comes, and makes the next one soon after."""
    from dissoc.transport.ucx import UcxListener
    from dissoc.transport.ucx.listener import SPARE_WORKERS

    accepted: asyncio.Queue[Connection] = asyncio.Queue()
    done = asyncio.Event()

    async def handler(conn: Connection) -> None:
        await accepted.put(conn)
        await done.wait()

    listener = await serve("ucx", "127.0.0.1", 0, handler)
    assert isinstance(listener, UcxListener)
    spares = listener._spares  # (the listener's own bookkeeping, looked at from here)

    async def filled() -> None:
        while any(len(s) < SPARE_WORKERS for s in spares.values()):
            await asyncio.sleep(0.01)

    clients: list[Connection] = []
    try:
        await asyncio.wait_for(filled(), 10)
        for _ in range(2):
            ready = spares["listener"][-1]
            clients.append(await connect("ucx", "127.0.0.1", listener.port, timeout=10))
            server = await asyncio.wait_for(accepted.get(), 10)
            assert server._worker is ready  # type: ignore[attr-defined]
            await asyncio.wait_for(filled(), 10)
            assert spares["listener"][-1] is not ready
            await clients[-1].send_tagged(5, b"ping")
            assert bytes((await asyncio.wait_for(server.recv_tagged(5), 10)).view()) == b"ping"
    finally:
        for client in clients:
            await client.close()
        done.set()
        listener.close()
        await asyncio.wait_for(listener.wait_closed(), 10)
    assert all(not s for s in spares.values()), "a closed listener kept its spare workers"
