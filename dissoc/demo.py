"""The main job: serve a generated dataset and fetch it back over Dissociated IPC on TCP.

Runs ``dissoc serve`` as a separate process (both layouts: combined and split), fetches each stream with
:func:`dissoc.fetch`, checks every row against the source, and prints what it did: rows, bytes and GB/s.
``python -m dissoc.demo [--rows N] [--batch-rows N]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from dissoc import codec
from dissoc.client import ClientOptions, FetchStats, stream_batches


def make_table(rows: int, seed: int = 7) -> pa.Table:
    """A synthetic trips table: ints, floats, timestamps, dictionary-encoded and plain strings, nulls."""
    rng = np.random.default_rng(seed)
    zones = pa.array([f"zone-{i:03d}" for i in range(265)])
    return pa.table(
        {
            "trip_id": pa.array(np.arange(rows, dtype=np.int64)),
            "pickup": pa.array(
                np.datetime64("2026-01-01") + rng.integers(0, 86_400_000_000, rows).astype("timedelta64[us]")
            ),
            "distance_km": pa.array(rng.gamma(2.0, 2.5, rows)),
            "fare": pa.array(np.round(rng.gamma(3.0, 6.0, rows), 2), mask=rng.random(rows) < 0.01),
            "zone": pa.DictionaryArray.from_arrays(
                pa.array(rng.integers(0, 265, rows).astype(np.int16)), zones
            ),
            "note": pa.array([None if i % 7 else f"trip {i}" for i in range(rows)], pa.string()),
        }
    )


def _start_server(path: Path, split: bool) -> tuple[subprocess.Popen[str], dict[str, str]]:
    cmd = [sys.executable, "-m", "dissoc.cli", "serve", "--host", "127.0.0.1", "--port", "0", str(path)]
    if split:
        cmd.insert(4, "--split")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        raise SystemExit(f"dissoc serve exited with status {proc.returncode} before it was ready")
    return proc, json.loads(line)


def _fetch(info: dict[str, str]) -> tuple[pa.Table, FetchStats, float]:
    import asyncio

    stats = FetchStats()

    async def run() -> pa.Table:
        batches = [
            b
            async for b in stream_batches(
                info["uri"], info["ticket"], data_uri=info["data_uri"], options=ClientOptions(), stats=stats
            )
        ]
        return pa.Table.from_batches(batches)

    t0 = time.perf_counter()
    table = asyncio.run(run())
    return table, stats, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4_000_000)
    p.add_argument("--batch-rows", type=int, default=250_000)
    p.add_argument("--repeat", type=int, default=4, help="fetches per layout (the first is cold)")
    args = p.parse_args(argv)

    table = make_table(args.rows)
    with tempfile.TemporaryDirectory(prefix="dissoc-demo-") as tmp:
        path = Path(tmp) / "trips.arrow"
        with codec.new_file(path, table.schema) as writer:
            writer.write_table(table, max_chunksize=args.batch_rows)
        print(
            f"dataset: {table.num_rows:,} rows, {table.nbytes / 1e6:,.1f} MB in memory, "
            f"written with dissoc's codec to {path.name} ({path.stat().st_size / 1e6:,.1f} MB)"
        )
        ok = True
        for split in (False, True):
            proc, info = _start_server(path, split)
            try:
                layout = "split (metadata and data servers)" if split else "combined (one server)"
                print(f"\n{layout}\n  metadata {info['uri']}\n  data     {info['data_uri']}")
                rates = []
                for attempt in range(args.repeat):
                    got, stats, seconds = _fetch(info)
                    same = got.equals(table)
                    ok &= same
                    rates.append(stats.bytes / seconds / 1e9)
                    if attempt == 0:
                        print(
                            f"  fetched {stats.rows:,} rows in {stats.batches} batches, "
                            f"{stats.bytes / 1e6:,.1f} MB of bodies; identical to the source: {same}"
                        )
                warm = sorted(rates[1:])[len(rates[1:]) // 2] if len(rates) > 1 else rates[0]
                print(
                    f"  first fetch {rates[0]:.2f} GB/s (cold: fresh buffers, first touch of the pages); "
                    f"then median {warm:.2f} GB/s over {len(rates) - 1} more"
                )
            finally:
                proc.terminate()
                proc.wait(10)
        print("\nall streams identical to the source" if ok else "\nMISMATCH")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
