"""Throughput of the TCP transport over loopback (not collected by pytest).

Measures, with client and server on one event loop (same process) and in two processes:

- large tagged messages (16 and 64 MiB), GB/s: with the default allocator (pooled 64-byte-aligned buffers,
  "default") and with one receive buffer the caller reuses ("reused");
- 100k small untagged messages (1 KiB), messages/s;

next to the anchors of spec/FACTS.md section 6, measured on this machine in the same run: a blocking socket
with ``sendall``/``recv_into`` a preallocated buffer, and a pyarrow IPC stream over a socket. Each figure is
the best of two runs. Prints JSON.
Run: ``python benchmarks/transport_tcp.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import sys
import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa

from dissoc.transport import Connection, connect_tcp, serve_tcp

MiB = 1 << 20
SMALL = 1024
REPEATS = 2  # each figure is the best of this many runs (the machine is shared and noisy)


async def _serve_requests(conn: Connection) -> None:
    """Server side: each request names what to send; an empty request ends the connection."""
    payloads: dict[int, np.ndarray[Any, Any]] = {}
    while True:
        request = json.loads(bytes(await conn.recv()) or b"null")
        if request is None:
            return
        if request["kind"] == "large":
            size = request["size"]
            payload = payloads.setdefault(size, np.ones(size, dtype=np.uint8))
            for i in range(request["count"]):
                await conn.send_tagged(i, payload)
        else:
            message = b"m" * request["size"]
            for _ in range(request["count"]):
                await conn.send(message)


async def _large(conn: Connection, size: int, count: int, reuse: bool) -> float:
    if reuse:
        buffer = np.empty(size, dtype=np.uint8)
        conn.set_allocator(lambda tag, length: buffer)
    else:
        conn.set_allocator(None)
    await conn.send(json.dumps({"kind": "large", "size": size, "count": count}).encode())
    start = time.perf_counter()
    for i in range(count):
        message = await conn.recv_tagged(i)
        assert message.view().nbytes == size
        del message
    return size * count / (time.perf_counter() - start) / 1e9


async def _small(conn: Connection, count: int) -> float:
    await conn.send(json.dumps({"kind": "small", "size": SMALL, "count": count}).encode())
    start = time.perf_counter()
    for _ in range(count):
        await conn.recv()
    return count / (time.perf_counter() - start)


async def _measure(port: int, sizes: list[int], total: int, small_count: int) -> dict[str, float]:
    results: dict[str, float] = {}
    async with await connect_tcp("127.0.0.1", port) as conn:
        await _large(conn, 4 * MiB, 4, False)  # warm up
        for size in sizes:
            count = max(2, total // size)
            for _ in range(REPEATS):
                for reuse in (False, True):
                    label = f"{size // MiB}MiB_{'reused' if reuse else 'default'}_GBps"
                    speed = round(await _large(conn, size, count, reuse), 2)
                    results[label] = max(results.get(label, 0.0), speed)
        for _ in range(REPEATS):
            speed = round(await _small(conn, small_count))
            results["1KiB_msgs_per_s"] = max(results.get("1KiB_msgs_per_s", 0.0), speed)
        await conn.send(b"")
    return results


async def _same_process(sizes: list[int], total: int, small_count: int) -> dict[str, float]:
    async with await serve_tcp("127.0.0.1", 0, _serve_requests) as listener:
        return await _measure(listener.port, sizes, total, small_count)


def _server_process(port_queue: Any) -> None:
    async def main() -> None:
        done = asyncio.Event()

        async def handler(conn: Connection) -> None:
            await _serve_requests(conn)
            done.set()

        async with await serve_tcp("127.0.0.1", 0, handler) as listener:
            port_queue.put(listener.port)
            await done.wait()

    asyncio.run(main())


def _cross_process(sizes: list[int], total: int, small_count: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    child = ctx.Process(target=_server_process, args=(ports,))
    child.start()
    try:
        port = ports.get(timeout=60)
        return asyncio.run(_measure(port, sizes, total, small_count))
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.terminate()


def _blocking_anchor(size: int, count: int) -> float:
    """Blocking socket: the sender thread ``sendall``s, the receiver ``recv_into``s one reused buffer."""
    listener = socket.create_server(("127.0.0.1", 0))
    payload = np.ones(size, dtype=np.uint8)

    def sender() -> None:
        conn, _ = listener.accept()
        with conn:
            for _ in range(count):
                conn.sendall(payload.data)

    thread = threading.Thread(target=sender)
    thread.start()
    sock = socket.create_connection(listener.getsockname())
    buffer = np.empty(size, dtype=np.uint8).data
    start = time.perf_counter()
    for _ in range(count):
        got = 0
        while got < size:
            got += sock.recv_into(buffer[got:], size - got)
    elapsed = time.perf_counter() - start
    sock.close()
    thread.join()
    listener.close()
    return size * count / elapsed / 1e9


def _pyarrow_anchor(size: int, count: int) -> float:
    """pyarrow IPC stream over a socket: one uint8 column of ``size`` bytes per batch."""
    listener = socket.create_server(("127.0.0.1", 0))
    batch = pa.record_batch([pa.array(np.ones(size, dtype=np.uint8))], names=["x"])

    def sender() -> None:
        conn, _ = listener.accept()
        with conn, conn.makefile("wb") as sink, pa.ipc.new_stream(sink, batch.schema) as writer:
            for _ in range(count):
                writer.write_batch(batch)

    thread = threading.Thread(target=sender)
    thread.start()
    sock = socket.create_connection(listener.getsockname())
    start = time.perf_counter()
    with sock, sock.makefile("rb") as source:
        rows = sum(b.num_rows for b in pa.ipc.open_stream(source))
    elapsed = time.perf_counter() - start
    thread.join()
    listener.close()
    assert rows == size * count
    return size * count / elapsed / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer messages")
    args = parser.parse_args()
    sizes = [16 * MiB, 64 * MiB]
    total = (256 if args.quick else 1024) * MiB
    small_count = 20_000 if args.quick else 100_000
    report: dict[str, Any] = {
        "same_process": asyncio.run(_same_process(sizes, total, small_count)),
        "cross_process": _cross_process(sizes, total, small_count),
        "anchors_GBps": {
            f"{name}_{size // MiB}MiB": round(
                max(anchor(size, max(2, total // size)) for _ in range(REPEATS)), 2
            )
            for size in sizes
            for name, anchor in (
                ("blocking_recv_into", _blocking_anchor),
                ("pyarrow_ipc_stream", _pyarrow_anchor),
            )
        },
    }
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
