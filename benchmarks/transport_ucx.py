"""Throughput of the UCX transport between two processes, through the listener path (not collected by pytest).

A server process listens with ``serve_ucx``; this process connects with ``connect_ucx`` (bootstrap over TCP,
then per-connection workers joined by worker address: shared memory on one host). Measures:

- large tagged messages (16 and 64 MiB), GB/s, with the default allocator (pooled aligned buffers, "default")
  and with one receive buffer the caller reuses ("reused"); the server awaits each send before the next
  ("serial", as the protocol server does) or keeps up to 4 in flight ("window4");
- 20k small untagged messages (1 KiB, active messages), messages/s;
- 20k small tagged messages (16 KiB, a small batch's body), messages/s, taken the way the client's stream
  session takes them: by a receiver (``Connection.set_receiver``), the server posting 64 at a time
  (``send_many``);
- the anchors: the same transfers with ucxx's raw API in a polling loop (no asyncio, no dissoc), serial.

Each figure is the best of two runs. Prints JSON. Run: ``python benchmarks/transport_ucx.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Any

import numpy as np

MiB = 1 << 20
SMALL = 1024
SMALL_TAGGED = 16 << 10
REPEATS = 2


async def _serve_requests(conn: Any) -> None:
    payloads: dict[int, np.ndarray[Any, Any]] = {}
    while True:
        request = json.loads(bytes(await conn.recv()) or b"null")
        if request is None:
            return
        if request["kind"] == "large":
            size = request["size"]
            payload = payloads.setdefault(size, np.ones(size, dtype=np.uint8))
            window = request["window"]
            pending: set[asyncio.Task[None]] = set()
            for i in range(request["count"]):
                if window <= 1:
                    await conn.send_tagged(i, payload)
                    continue
                pending.add(asyncio.create_task(conn.send_tagged(i, payload)))
                if len(pending) >= window:
                    _done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.gather(*pending)
        elif request["kind"] == "tagged":
            payload = payloads.setdefault(request["size"], np.ones(request["size"], dtype=np.uint8))
            count = request["count"]
            for first in range(0, count, 64):
                await conn.send_many([(i, payload) for i in range(first, min(count, first + 64))])
        else:
            message = b"m" * request["size"]
            for _ in range(request["count"]):
                await conn.send(message)


def _server_process(port_queue: Any) -> None:
    from dissoc.transport.ucx import serve_ucx

    async def main() -> None:
        done = asyncio.Event()

        async def handler(conn: Any) -> None:
            await _serve_requests(conn)
            done.set()

        async with await serve_ucx("127.0.0.1", 0, handler) as listener:
            port_queue.put(listener.port)
            await done.wait()

    asyncio.run(main())


async def _large(conn: Any, size: int, count: int, reuse: bool, window: int) -> float:
    if reuse:
        buffer = np.empty(size, dtype=np.uint8)
        conn.set_allocator(lambda tag, length: buffer)
    else:
        conn.set_allocator(None)
    await conn.send(json.dumps({"kind": "large", "size": size, "count": count, "window": window}).encode())
    start = time.perf_counter()
    for i in range(count):
        message = await conn.recv_tagged(i)
        assert message.view().nbytes == size
        del message
    return size * count / (time.perf_counter() - start) / 1e9


async def _small(conn: Any, count: int) -> float:
    await conn.send(json.dumps({"kind": "small", "size": SMALL, "count": count}).encode())
    start = time.perf_counter()
    for _ in range(count):
        await conn.recv()
    return count / (time.perf_counter() - start)


class _Counter:
    """A receiver that takes every message (as the client's session does) and counts the tagged ones."""

    def __init__(self, count: int) -> None:
        self.left = count
        self.done = asyncio.get_running_loop().create_future()

    def on_messages(self, messages: list[Any], lent: bool) -> int:
        self.left -= len(messages)
        if self.left <= 0 and not self.done.done():
            self.done.set_result(None)
        return len(messages)

    def on_failure(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)


async def _small_tagged(conn: Any, count: int) -> float:
    conn.set_allocator(None)
    counter = _Counter(count)
    conn.set_receiver(counter)
    try:
        await conn.send(json.dumps({"kind": "tagged", "size": SMALL_TAGGED, "count": count}).encode())
        start = time.perf_counter()
        await counter.done
        return count / (time.perf_counter() - start)
    finally:
        conn.set_receiver(None)


async def _measure(port: int, sizes: list[int], total: int, small_count: int) -> dict[str, float]:
    from dissoc.transport.ucx import connect_ucx

    results: dict[str, float] = {}
    async with await connect_ucx("127.0.0.1", port) as conn:
        await _large(conn, 4 * MiB, 4, False, 1)  # warm up
        for size in sizes:
            count = max(2, total // size)
            for _ in range(REPEATS):
                for window in (1, 4):
                    for reuse in (False, True):
                        mode = "serial" if window == 1 else f"window{window}"
                        label = f"{size // MiB}MiB_{mode}_{'reused' if reuse else 'default'}_GBps"
                        speed = round(await _large(conn, size, count, reuse, window), 2)
                        results[label] = max(results.get(label, 0.0), speed)
        for _ in range(REPEATS):
            speed = round(await _small(conn, small_count))
            results["1KiB_msgs_per_s"] = max(results.get("1KiB_msgs_per_s", 0.0), speed)
        for _ in range(REPEATS):
            speed = round(await _small_tagged(conn, small_count))
            results["16KiB_tagged_msgs_per_s"] = max(results.get("16KiB_tagged_msgs_per_s", 0.0), speed)
        await conn.send(b"")
    return results


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


def _raw_sender(addresses: Any, replies: Any, size: int, count: int) -> None:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx._lib.libucxx as lib
    from ucxx._lib.arr import Array

    context = lib.UCXContext({}, (lib.Feature.TAG, lib.Feature.AM, lib.Feature.WAKEUP))
    worker = lib.UCXWorker(context)
    addresses.put(worker.address.tobytes())
    peer = replies.get()
    endpoint = worker.create_endpoint_from_worker_address(lib.UCXAddress.create_from_buffer(peer), False)
    payload = np.ones(size, dtype=np.uint8)
    for i in range(count + 1):
        request = endpoint.tag_send(Array(payload), lib.UCXXTag(i))
        while not request.completed:
            worker.progress()
    done = replies.get()
    del done


def _raw_anchor(size: int, count: int) -> float:
    """ucxx's raw API, worker-address endpoints, polling progress, one reused receive buffer."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx._lib.libucxx as lib
    from ucxx._lib.arr import Array

    ctx = mp.get_context("spawn")
    addresses, replies = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_raw_sender, args=(addresses, replies, size, count))
    child.start()
    try:
        context = lib.UCXContext({}, (lib.Feature.TAG, lib.Feature.AM, lib.Feature.WAKEUP))
        worker = lib.UCXWorker(context)
        peer = addresses.get(timeout=60)
        replies.put(worker.address.tobytes())
        endpoint = worker.create_endpoint_from_worker_address(lib.UCXAddress.create_from_buffer(peer), False)
        buffer = np.empty(size, dtype=np.uint8)
        start = 0.0
        for i in range(count + 1):
            if i == 1:
                start = time.perf_counter()
            request = worker.tag_recv(Array(buffer), lib.UCXXTag(i))
            while not request.completed:
                worker.progress()
        elapsed = time.perf_counter() - start
        replies.put(b"done")
        del endpoint
        return size * count / elapsed / 1e9
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.terminate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer messages")
    args = parser.parse_args()
    sizes = [16 * MiB, 64 * MiB]
    total = (256 if args.quick else 1024) * MiB
    small_count = 5_000 if args.quick else 20_000
    report: dict[str, Any] = {
        "cross_process": _cross_process(sizes, total, small_count),
        "anchors_GBps": {
            f"ucxx_raw_polling_{size // MiB}MiB": round(
                max(_raw_anchor(size, max(2, total // size)) for _ in range(REPEATS)), 2
            )
            for size in sizes
        },
        "anchors_msgs_per_s": {
            "ucxx_raw_polling_16KiB_tagged": round(
                max(_raw_anchor(SMALL_TAGGED, small_count) for _ in range(REPEATS)) * 1e9 / SMALL_TAGGED
            )
        },
    }
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
