"""Soak: many fetches of mixed datasets from one ``dissoc serve`` process by 16 concurrent clients.

Every fetched table must equal its source; once the clients are gone the server's RSS and open fds come
back to what they were after the warm-up (within the margins below), and once it stops no segment of its
shared-memory arena is left in ``/dev/shm``.

TCP: 1,000 fetches in all over four servers (``FETCHES``): packed bodies combined and split, pairs in shared
memory combined and split, each pairs server read by copy-mode and zero-copy clients alike. UCX (where ucxx is
installed): fewer, packed bodies and pairs read with RMA.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from helpers.e2e import within
from helpers.reliability import (
    open_fds,
    rss,
    serve_process,
    shm_segments,
    soak_tables,
    stop_gracefully,
    write_ipc,
)

from dissoc.client import ClientOptions, fetch_async, settle, stream_batches

pytestmark = pytest.mark.slow

CLIENTS = 16
# Fetches per TCP server; the four add up to 1,000 (each pairs server's are shared by copy-mode and
# zero-copy clients, half each).
FETCHES = {"packed-combined": 250, "packed-split": 250, "pairs-combined": 250, "pairs-split": 250}
assert sum(FETCHES.values()) == 1000
UCX_FETCHES = 160  # per UCX server: the UCX connection setup is slower (two workers and a handshake)
WARMUP_ROUNDS = 3  # every client fetches this many tables before the baseline is taken

# Margins against the baseline taken after the warm-up (same server, no client connected):
# - fds: exact. Every fd the server opens for a client is that client's socket; the arena segment, the
#   memory-mapped files and the event loop's own fds exist from the warm-up on. A leaked socket is one more.
# - RSS: 48 MiB. The warm-up has already touched every page of the mapped files and placed every resident
#   batch (shared-memory pages count in VmRSS); what still moves is the Python and glibc heaps (free lists,
#   allocator arenas, send queues sized by the 16 concurrent streams). Measured on the 2-core machine: +6 to
#   +19 MiB after 250 fetches per server and +21 to +32 MiB after 1,000 (growth that flattens: heap
#   fragmentation, not a per-fetch leak). A leaked stream holds at least one batch (up to 2.5 MiB here);
#   leaking one per fetch would add hundreds of MiB, far beyond the margin.
RSS_MARGIN = 48 << 20
FD_MARGIN = 0


@dataclasses.dataclass
class Mode:
    name: str
    options: ClientOptions


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, pa.Table], list[str]]:
    folder = tmp_path_factory.mktemp("soak")
    tables = soak_tables()
    paths = [str(write_ipc(folder / f"{name}.arrow", table)) for name, table in tables.items()]
    return tables, paths


def _modes(body: str) -> list[Mode]:
    base = ClientOptions(timeout=30)
    if body == "packed":
        return [Mode("packed", base)]
    return [Mode("copy", base), Mode("zero-copy", dataclasses.replace(base, zero_copy=True))]


async def _client(
    rng: random.Random,
    count: int,
    lines: dict[str, Any],
    tables: dict[str, pa.Table],
    modes: list[Mode],
    done: dict[str, int],
) -> None:
    names = sorted(tables)
    for i in range(count):
        name = rng.choice(names)
        mode = modes[i % len(modes)]
        line = lines[name]
        table = await fetch_async(line["uri"], name, data_uri=line["data_uri"], options=mode.options)
        assert table.equals(tables[name]), f"{mode.name} fetch of {name!r} differs from its source"
        del table  # a zero-copy table gives its ranges back when released
        done[mode.name] = done.get(mode.name, 0) + 1


async def _round(
    total: int, seed: int, lines: dict[str, Any], tables: dict[str, pa.Table], modes: list[Mode]
) -> dict[str, int]:
    """``total`` fetches shared by CLIENTS concurrent clients; returns the fetches done per mode."""
    done: dict[str, int] = {}
    shares = [total // CLIENTS + (1 if c < total % CLIENTS else 0) for c in range(CLIENTS)]
    clients = [
        _client(random.Random(seed * 1000 + c), n, lines, tables, modes, done) for c, n in enumerate(shares)
    ]
    await within(150, asyncio.gather(*clients), f"{total} fetches by {CLIENTS} clients")
    await within(20, settle(15), "zero-copy sessions sending their last free_data")
    return done


async def _steady_fds(pid: int, seconds: float = 5.0) -> int:
    """The server's fd count once it has stayed the same for half a second (or after ``seconds``)."""
    deadline = time.monotonic() + seconds
    last, since = open_fds(pid), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < 0.5:
        await asyncio.sleep(0.05)
        now = open_fds(pid)
        if now != last:
            last, since = now, time.monotonic()
    return last


async def _settled(pid: int, baseline_fds: int, seconds: float) -> int:
    """The server's fd count once it is back at ``baseline_fds`` or ``seconds`` have passed (sockets of
    clients that just left close a moment later on the server's side)."""
    deadline = time.monotonic() + seconds
    while open_fds(pid) > baseline_fds + FD_MARGIN and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return open_fds(pid)


async def _soak(args: list[str], fetches: int, sources: Any, modes: list[Mode], seed: int) -> None:
    tables, paths = sources
    with serve_process(*args, *paths, count=len(paths)) as (proc, lines):
        pid = proc.pid
        started = time.monotonic()
        warmup = await _round(CLIENTS * WARMUP_ROUNDS, seed, lines, tables, modes)
        base_fds = await _steady_fds(pid)  # the last clients' sockets close on the server's side
        base_rss = rss(pid)
        rest = await _round(fetches - CLIENTS * WARMUP_ROUNDS, seed + 1, lines, tables, modes)
        elapsed = time.monotonic() - started
        fds = await _settled(pid, base_fds, 10)
        end_rss = rss(pid)
        assert proc.poll() is None, "the server died during the soak"
        per_mode = {m: warmup.get(m, 0) + rest.get(m, 0) for m in {*warmup, *rest}}
        print(
            f"\n{' '.join(args)}: {sum(per_mode.values())} fetches {per_mode} in {elapsed:.1f} s; "
            f"server RSS after warm-up {base_rss / 2**20:.1f} MiB, after the soak {end_rss / 2**20:.1f} MiB "
            f"({(end_rss - base_rss) / 2**20:+.1f} MiB, margin {RSS_MARGIN >> 20} MiB); "
            f"fds {base_fds} -> {fds} (margin {FD_MARGIN})"
        )
        assert sum(per_mode.values()) == fetches
        assert fds <= base_fds + FD_MARGIN, f"the server holds {fds - base_fds} more fds than after warm-up"
        assert end_rss <= base_rss + RSS_MARGIN, (
            f"server RSS grew by {(end_rss - base_rss) / 2**20:.1f} MiB over the soak "
            f"(margin {RSS_MARGIN >> 20} MiB)"
        )
        segments_before = shm_segments(pid)
        rc = stop_gracefully(proc)
    assert rc == 0, f"the server exited with status {rc} after SIGTERM"
    if "shm" in args:
        assert segments_before, "a pairs server should have had a shared-memory segment while running"
    assert shm_segments(pid) == [], f"segments left in /dev/shm after the server stopped: {shm_segments(pid)}"


def _tcp_cases() -> Iterator[Any]:
    for name, fetches in FETCHES.items():
        body, layout = name.split("-")
        args = ["--body", body] + (["--memory", "shm", "--arena-mib", "256"] if body == "pairs" else [])
        args += ["--split"] if layout == "split" else []
        yield pytest.param(args, fetches, _modes(body), id=name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("args", "fetches", "modes"), list(_tcp_cases()))
async def test_soak_tcp(args: list[str], fetches: int, modes: list[Mode], sources: Any) -> None:
    await _soak(args, fetches, sources, modes, seed=len(args) * 7 + fetches)


@pytest.mark.ucx
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("args", "modes"),
    [
        pytest.param(["--transport", "ucx"], _modes("packed"), id="ucx-packed"),
        pytest.param(
            ["--transport", "ucx", "--body", "pairs", "--memory", "ucx", "--arena-mib", "256"],
            [Mode("rma", ClientOptions(timeout=30))],
            id="ucx-pairs-rma",
        ),
    ],
)
async def test_soak_ucx(args: list[str], modes: list[Mode], sources: Any) -> None:
    await _soak(args, UCX_FETCHES, sources, modes, seed=3)


async def _abandon(uri: str, ticket: str, after: int) -> None:
    """Read ``after`` batches of the stream, then close it (the consumer stops mid-stream)."""
    batches = stream_batches(uri, ticket, options=ClientOptions(timeout=30))
    async with contextlib.aclosing(batches):
        seen = 0
        async for _ in batches:
            seen += 1
            if seen == after:
                return
    raise AssertionError(f"the stream of {ticket!r} ended after {seen} batches, before the client stopped")


@pytest.mark.ucx
@pytest.mark.timeout(120)
async def test_ucx_streams_closed_mid_way_release_the_server(sources: Any) -> None:
    """Consumers that stop reading after two batches and close, four at a time, while the server still has
    rendezvous sends under way to them: every per-connection worker goes (the closing exchange lets those
    sends complete), so the server's fds come back exactly and its RSS within the margin."""
    tables, paths = sources
    name = next(n for n, t in tables.items() if len(t.to_batches()) >= 4)
    with serve_process("--transport", "ucx", *paths, count=len(paths)) as (proc, lines):
        uri = lines[name]["uri"]
        await within(60, asyncio.gather(*(_abandon(uri, name, 2) for _ in range(4))), "warm-up")
        base_fds = await _steady_fds(proc.pid)
        base_rss = rss(proc.pid)
        for _ in range(6):
            await within(60, asyncio.gather(*(_abandon(uri, name, 2) for _ in range(4))), "abandoned streams")
        fds = await _settled(proc.pid, base_fds, 10)
        end_rss = rss(proc.pid)
        print(
            f"\n24 abandoned UCX streams: server fds {base_fds} -> {fds}, "
            f"RSS {(end_rss - base_rss) / 2**20:+.1f} MiB"
        )
        assert fds <= base_fds, f"the server holds {fds - base_fds} more fds after 24 abandoned streams"
        assert end_rss <= base_rss + RSS_MARGIN


_KILLED_CHILD = """
import asyncio, sys
from dissoc.client import ClientOptions, stream_batches

async def main(uri, ticket, path):
    seen = 0
    async for _ in stream_batches(uri, ticket, options=ClientOptions(timeout=30, ucx_path=path)):
        seen += 1
        if seen == 2:
            print("reading", flush=True)
            await asyncio.sleep(60)  # killed here, with the server's next sends under way

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.mark.ucx
@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["address", "listener"])
async def test_ucx_clients_killed_mid_stream_release_the_server(sources: Any, path: str) -> None:
    """Clients SIGKILLed mid-stream, while the server has sends under way to them, on both connection paths:
    the server's per-connection workers all go (same-host endpoints are closed forcefully once the peer is
    known dead, and what UCX never completes is given up with the worker), so its fds come back exactly."""
    import subprocess
    import sys

    tables, paths = sources
    name = next(n for n, t in tables.items() if len(t.to_batches()) >= 4)
    with serve_process("--transport", "ucx", *paths, count=len(paths)) as (proc, lines):
        uri = lines[name]["uri"]
        await within(60, _abandon(uri, name, 2), "warm-up")
        base_fds = await _steady_fds(proc.pid)
        for _ in range(3):
            child = subprocess.Popen(
                [sys.executable, "-c", _KILLED_CHILD, uri, name, path],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            try:
                assert child.stdout is not None
                line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 30)
                assert line.strip() == b"reading", line
            finally:
                child.kill()
                child.wait(10)
                if child.stdout is not None:
                    child.stdout.close()
        fds = await _settled(proc.pid, base_fds, 10)
        print(f"\n3 UCX clients killed mid-stream ({path} path): server fds {base_fds} -> {fds}")
        assert fds <= base_fds, f"the server holds {fds - base_fds} more fds after 3 killed clients"
        assert proc.poll() is None
