"""Flow control end to end: a slow consumer slows the server down (bounded read-ahead), and a 10 GiB stream
passes between two processes with bounded memory on both sides."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from helpers.e2e import PYTHON, REPO, read_lines, vm_rss, within

from dissoc.client import ClientOptions, stream_batches
from dissoc.datasets import ReaderFactoryDataset
from dissoc.server import Server

LAYOUTS = [pytest.param(False, id="combined"), pytest.param(True, id="split")]

MiB = 1 << 20


def _sysctl_max(name: str) -> int:
    try:
        return int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[2])
    except (OSError, ValueError, IndexError):
        return 32 * MiB


class CountingSource:
    """A reader factory of ``batches`` batches of ``batch_bytes`` bytes (an ``id`` column); counts per
    opened iterator how many batches it produced."""

    def __init__(self, batches: int, batch_bytes: int) -> None:
        rows = batch_bytes // 8
        self.rows = rows
        self.batches = batches
        self.lock = threading.Lock()
        self.produced: list[int] = []
        self.schema = pa.schema([("id", pa.int64())])

    def __call__(self) -> Iterator[pa.RecordBatch]:
        with self.lock:
            slot = len(self.produced)
            self.produced.append(0)
        base = np.arange(self.rows, dtype=np.int64)
        for i in range(self.batches):
            with self.lock:
                self.produced[slot] += 1
            yield pa.record_batch([pa.array(base + i * self.rows)], schema=self.schema)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("split", LAYOUTS)
async def test_slow_consumer_throttles_the_server(split: bool) -> None:
    batch_bytes = 1 * MiB
    source = CountingSource(batches=400, batch_bytes=batch_bytes)
    opts = ClientOptions(timeout=10, max_in_flight_bytes=4 * MiB, max_buffered_bytes=4 * MiB)
    # What may legitimately sit between producer and consumer: the client's in-flight and transport budgets,
    # both kernel socket buffers (autotuned up to the sysctl maxima), and a few batches in the pipeline
    # (the one being produced, encoded, sent, decoded).
    allowed = (
        opts.max_in_flight_bytes + opts.max_buffered_bytes + _sysctl_max("tcp_rmem") + _sysctl_max("tcp_wmem")
    )
    allowed_batches = allowed // batch_bytes + 4
    consumed = 0
    max_lead = 0

    def data_produced() -> int:
        with source.lock:
            counts = list(source.produced)
        # split: the metadata server reads its own iterator (only metadata leaves it); the bodies come from
        # the data server's, which is the slower of the two.
        return min(counts) if counts else 0

    async with Server(
        {"slow": ReaderFactoryDataset("slow", source, schema=source.schema)}, split=split
    ) as server:
        agen = stream_batches(server.uri, "slow", data_uri=server.data_uri, options=opts)
        async with contextlib.aclosing(agen):

            async def consume() -> None:
                nonlocal consumed, max_lead
                batch: pa.RecordBatch
                async for batch in agen:
                    assert batch.column("id")[0].as_py() == consumed * source.rows
                    consumed += 1
                    await asyncio.sleep(0.01)
                    max_lead = max(max_lead, data_produced() - consumed)
                    if consumed == 80:
                        return

            await within(40, consume(), "the slow consumer")
        final = data_produced()
    assert consumed == 80
    assert final < source.batches, f"the server produced all {final} batches for a consumer that took 80"
    assert max_lead <= allowed_batches, (
        f"the server ran {max_lead} batches ({max_lead * batch_bytes >> 20} MiB) ahead of the consumer; "
        f"allowed {allowed_batches}"
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("split", LAYOUTS)
async def test_slow_consumer_with_default_options_completes(split: bool) -> None:
    """The defaults (256 MiB in flight, 64 MiB transport budget) with a consumer that stalls for a while after
    the first batch: the stream must just pause, not fail, however far the server could run ahead (600 MiB
    here)."""
    source = CountingSource(batches=300, batch_bytes=2 * MiB)
    consumed = 0
    async with Server({"s": ReaderFactoryDataset("s", source, schema=source.schema)}, split=split) as server:

        async def consume() -> None:
            nonlocal consumed
            batch: pa.RecordBatch
            async for batch in stream_batches(server.uri, "s", data_uri=server.data_uri):
                assert batch.column("id")[0].as_py() == consumed * source.rows
                consumed += 1
                await asyncio.sleep(1.5 if consumed == 1 else 0.001)

        await within(45, consume(), "the slow consumer")
    assert consumed == 300


@pytest.mark.parametrize("window", [1, 2, 8, 64])
async def test_metadata_running_ahead_of_a_small_window_waits_and_completes(window: int) -> None:
    """A split server's metadata runs far ahead of its bodies: whatever the client's window, the metadata
    that waits for it is let through as the window opens (in runs, not one at a time) and every batch comes,
    in order, without the stream stalling."""
    whole = pa.table({"id": np.arange(600 * 128, dtype=np.int64)})
    table = pa.Table.from_batches(whole.to_batches(max_chunksize=128))
    async with Server({"t": table}, split=True) as server:
        options = ClientOptions(window=window, timeout=10)
        ids: list[int] = []

        async def consume() -> None:
            batch: pa.RecordBatch
            async for batch in stream_batches(server.uri, "t", data_uri=server.data_uri, options=options):
                ids.append(batch.column("id")[0].as_py())

        await within(30, consume(), f"the stream with window {window}")
    assert ids == list(range(0, 600 * 128, 128))


# ------------------------------------------------------------------------------------------ 10 GiB stream

SERVER_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, signal, sys
    import numpy as np, pyarrow as pa
    from dissoc.datasets import ReaderFactoryDataset
    from dissoc.server import Server

    count, size, split = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "split"
    batch = pa.record_batch([pa.array(np.arange(size // 8, dtype=np.int64))], names=["v"])

    def factory():
        for _ in range(count):
            yield batch

    async def main():
        ds = ReaderFactoryDataset("big", factory, schema=batch.schema)
        async with Server({"big": ds}, split=split) as server:
            print(json.dumps({"uri": server.uri, "data_uri": server.data_uri}), flush=True)
            stop = asyncio.Event()
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
            await stop.wait()

    asyncio.run(main())
    """
)

CLIENT_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys, time
    from dissoc.client import ClientOptions, stream_batches

    async def main():
        batches = rows = nbytes = 0
        first = None
        started = time.perf_counter()
        opts = ClientOptions(timeout=30)
        async for b in stream_batches(sys.argv[1], "big", data_uri=sys.argv[2], options=opts):
            if first is None:
                first = b.column(0)[5].as_py()
            batches += 1
            rows += b.num_rows
            nbytes += b.nbytes
        seconds = time.perf_counter() - started
        out = {"batches": batches, "rows": rows, "bytes": nbytes, "seconds": seconds, "v5": first}
        print(json.dumps(out))

    asyncio.run(main())
    """
)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", ["combined", "split"])
async def test_10_gib_stream_bounded_memory_between_processes(tmp_path: Path, layout: str) -> None:
    count, size = 160, 64 * MiB  # 10 GiB
    limit = 1536 * MiB
    (tmp_path / "srv.py").write_text(SERVER_SCRIPT)
    (tmp_path / "cli.py").write_text(CLIENT_SCRIPT)
    server = subprocess.Popen(
        [PYTHON, str(tmp_path / "srv.py"), str(count), str(size), layout],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    client: subprocess.Popen[bytes] | None = None
    peaks = {"server": 0, "client": 0}
    try:
        info = json.loads(read_lines(server, 1, 30)[0])
        client = subprocess.Popen(
            [PYTHON, str(tmp_path / "cli.py"), info["uri"], info["data_uri"]],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 150
        while client.poll() is None:
            peaks["server"] = max(peaks["server"], vm_rss(server.pid))
            peaks["client"] = max(peaks["client"], vm_rss(client.pid))
            assert peaks["server"] < limit and peaks["client"] < limit, f"RSS over {limit >> 20} MiB: {peaks}"
            assert server.poll() is None, "the server died"
            assert time.monotonic() < deadline, "the 10 GiB stream did not finish in 150 s"
            await asyncio.sleep(0.05)
        out, err = client.communicate(timeout=10)
        assert client.returncode == 0, f"client failed: {err.decode()[-2000:]}"
        summary = json.loads(out.decode().strip().splitlines()[-1])
    finally:
        for proc in (client, server):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        for proc in (client, server):
            if proc is not None:
                for pipe in (proc.stdout, proc.stderr):
                    if pipe is not None:
                        pipe.close()
    assert summary["batches"] == count
    assert summary["rows"] == count * (size // 8)
    assert summary["bytes"] == count * size
    assert summary["v5"] == 5
    assert max(peaks.values()) < limit, peaks
    print(f"10 GiB in {summary['seconds']:.1f} s; peak RSS MiB: { {k: v >> 20 for k, v in peaks.items()} }")
