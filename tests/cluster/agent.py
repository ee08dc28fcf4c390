"""A dissoc server or client inside a cluster host, driven by JSON lines on stdin (one answer line each).

    python tests/cluster/agent.py server --transport tcp --host 10.213.0.2 [--port P] [--keepalive SPEC]
        [--idle-timeout S] [--tls-dir DIR] [--batches N] [--rows N] [--slow S]
    python tests/cluster/agent.py client [--keepalive SPEC]

The server serves ``t`` (``--batches`` ordered batches of ``--rows`` rows) and ``slow`` (the same, each batch
after ``--slow`` seconds), prints ``{"uri", "data_uri"}``, then answers ``{"op": "status"}`` with what it
holds (connections, streams under way, arena bytes held) and ends on ``{"op": "stop"}`` or end of input.

The client keeps one process (and so the synchronous API's pooled connections) across commands:
``{"op": "fetch", "uri", "ticket", "timeout"[, "tls_ca"]}`` reads the stream batch by batch, printing
``{"event": "first"}`` after the first batch, then ``{"ok": true, "rows", "ids_ok", "seconds", "path"}`` or
``{"ok": false, "error": class name, "message", "seconds"}``; ``{"op": "status"}`` answers the pool's
idle connections. Both answer ``status`` with their open file descriptors too (``fds``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def batches(count: int, rows: int) -> list[pa.RecordBatch]:
    out = []
    for b in range(count):
        ids = np.arange(b * rows, (b + 1) * rows, dtype=np.int64)
        out.append(pa.record_batch({"id": ids, "x": ids.astype(np.float64) * 0.5}))
    return out


# ---------------------------------------------------------------------------------------------------- server


async def serve(args: argparse.Namespace) -> None:
    from dissoc.server import Server, ServerOptions
    from dissoc.transport.tcp import parse_keepalive

    if args.transport == "ucx":  # a send under way as long as the keepalive's user timeout fails it
        from dissoc.transport.ucx import connection

        connection.SEND_STALL_TIMEOUT = parse_keepalive(args.keepalive).user_timeout  # type: ignore[union-attr]
    data = batches(args.batches, args.rows)
    schema = data[0].schema

    def slow() -> pa.RecordBatchReader:
        def gen() -> Any:
            for b in data:
                time.sleep(args.slow)
                yield b

        return pa.RecordBatchReader.from_batches(schema, gen())

    tls: dict[str, Any] = {}
    if args.tls_dir:
        d = Path(args.tls_dir)
        tls = {"tls_cert": str(d / "server.pem"), "tls_key": str(d / "server.key")}
    options = ServerOptions(
        transport=args.transport,
        host=args.host,
        port=args.port,
        keepalive=parse_keepalive(args.keepalive),
        idle_timeout=args.idle_timeout,
        **tls,
    )
    server = Server({"t": pa.Table.from_batches(data), "slow": slow}, options)
    async with server:
        say({"uri": server.uri, "data_uri": server.data_uri})
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def read_commands() -> None:
            for line in sys.stdin:
                cmd = json.loads(line)
                if cmd.get("op") == "stop":
                    break
                answer = asyncio.run_coroutine_threadsafe(status(server), loop).result(timeout=10)
                say(answer)
            loop.call_soon_threadsafe(stop.set)

        threading.Thread(target=read_commands, daemon=True).start()
        await stop.wait()


async def status(server: Any) -> dict[str, Any]:
    from dissoc.metrics import SERVER

    connections = 0
    for role in getattr(server, "_servers", None) or []:
        listener = getattr(role, "_listener", None)
        if listener is not None:
            conns = getattr(listener, "connections", None) or ()
            tasks = getattr(listener, "_tasks", None) or ()
            connections += max(len(conns), len(tasks))
    started = sum(SERVER.streams_started.samples().values())
    ended = sum(SERVER.streams_finished.samples().values()) + sum(SERVER.streams_failed.samples().values())
    fds = len(os.listdir("/proc/self/fd"))
    return {"connections": connections, "streams": started - ended, "started": started, "fds": fds}


# ---------------------------------------------------------------------------------------------------- client


def client(args: argparse.Namespace) -> None:
    from dissoc.client import ClientOptions, open_stream
    from dissoc.session.pool import pool_of
    from dissoc.session.runners import main_runner
    from dissoc.transport.tcp import parse_keepalive

    keepalive = parse_keepalive(args.keepalive)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "stop":
            break
        if cmd["op"] == "status":
            runner = main_runner()
            loop = getattr(runner, "_loop", None)
            idle = pool_of(loop)._idle if loop is not None else {}
            say({"pooled": sum(len(v) for v in idle.values()), "fds": len(os.listdir("/proc/self/fd"))})
            continue
        options = ClientOptions(
            timeout=cmd.get("timeout", 30.0),
            keepalive=keepalive,
            tls_ca=cmd.get("tls_ca"),
            ucx_path=cmd.get("ucx_path", "auto"),
        )
        start = time.monotonic()
        rows, ids_ok, expect = 0, True, 0
        try:
            with open_stream(cmd["uri"], cmd["ticket"], options=options) as reader:
                stats = reader.stats
                for batch in reader:
                    assert isinstance(batch, pa.RecordBatch)
                    ids = batch.column(0).to_numpy()
                    ids_ok = ids_ok and bool((ids == np.arange(expect, expect + len(ids))).all())
                    expect += len(ids)
                    if rows == 0:
                        say({"event": "first"})
                    rows += batch.num_rows
            say(
                {
                    "ok": True,
                    "rows": rows,
                    "ids_ok": ids_ok,
                    "seconds": time.monotonic() - start,
                    "path": stats.path.as_dict() if stats.path is not None else {},
                }
            )
        except Exception as e:
            seconds = time.monotonic() - start
            say({"ok": False, "error": type(e).__name__, "message": str(e), "seconds": seconds})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["server", "client"])
    p.add_argument("--transport", default="tcp")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--keepalive", default="30,10,3,60")
    p.add_argument("--idle-timeout", type=float, default=300.0)
    p.add_argument("--tls-dir", default=None)
    p.add_argument("--batches", type=int, default=64)
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--slow", type=float, default=0.05)
    args = p.parse_args()
    if args.role == "server":
        asyncio.run(serve(args))
    else:
        client(args)


if __name__ == "__main__":
    main()
