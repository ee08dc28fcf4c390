"""What private arenas cost: one arena per data connection against the shared arena (not run by pytest).

Two Arrow IPC files, 2 int64 columns: **small** (one batch of 1024 rows, 16 KiB) and **large** (16 batches of
1 Mi rows, 16 MiB each, 256 MiB). Each row serves both from a ``python -m dissoc.cli serve --body pairs``
subprocess (``--arena-mib 1024``):

- ``shared``: the shared arena, batches resident (placed once, listed to every client; the default);
- ``shared, per request``: the shared arena with ``--no-resident`` (every request copies its batches in);
- ``private``: ``--private-memory``: an arena per data connection of the default quota (a quarter of the
  arena: 256 MiB), made when the connection's first pair list is due, destroyed when it closes; every
  request copies its batches in (nothing is resident in a private arena);
- ``private, 32 MiB``: the same with ``--max-unfreed-mib 32`` (a smaller arena to reserve per connection).

The client (this process) fetches each file with ``dissoc.client.open_stream`` in copy mode, a new
connection per fetch (as every ``dissoc.fetch`` does), counting batches and keeping none. Each figure is the
median of ``--repeat`` fetches after one warm-up; ratios divide a row's median by the ``shared`` row's of
the same memory kind (above 1: slower). ``memory=shm`` over TCP always; ``memory=ucx`` over UCX where ucxx is
installed.

Below the table, the per-connection set-up itself, in this process: making and destroying one private arena
(``PrivateArenas.open`` + ``release``: create the segment, reserve its memory, map it, and for ucx register
it with UCX; then deregister, unlink and unmap), median of ``--repeat``.

Run from the repository root::

    .venv/bin/python benchmarks/private_memory.py               # ~1-2 min
    .venv/bin/python benchmarks/private_memory.py --repeat 3 --memory shm --json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

try:
    from benchmarks import _anchors as anchors
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    import _anchors as anchors  # type: ignore[no-redef, import-not-found]

if str(anchors.REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(anchors.REPO_ROOT))

#: (name, batches, rows per batch)
DATASETS = (("small", 1, 1024), ("large", 16, 1 << 20))
#: (label, extra `dissoc serve` flags)
MODES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("shared", ()),
    ("shared, per request", ("--no-resident",)),
    ("private", ("--private-memory",)),
    ("private, 32 MiB", ("--private-memory", "--max-unfreed-mib", "32")),
)
ARENA_MIB = 1024


def _write(directory: Path, name: str, batches: int, rows: int) -> Path:
    path = directory / f"{name}.arrow"
    values = np.arange(rows, dtype=np.int64)
    batch = pa.record_batch([pa.array(values), pa.array(values + 1)], names=["a", "b"])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
        for _ in range(batches):
            writer.write_batch(batch)
    return path


def _fetch(info: dict[str, Any]) -> int:
    from dissoc.client import open_stream

    count = 0
    with open_stream(info["uri"], info["ticket"], data_uri=info["data_uri"]) as reader:
        for _ in reader:
            count += 1
    return count


def _timed(run: Callable[[], object], repeat: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _row(memory: str, flags: tuple[str, ...], files: list[Path], repeat: int) -> dict[str, float]:
    transport = "ucx" if memory == "ucx" else "tcp"
    argv = [sys.executable, "-m", "dissoc.cli", "serve", *map(str, files), "--transport", transport]
    argv += ["--body", "pairs", "--memory", memory, "--arena-mib", str(ARENA_MIB), *flags]
    with contextlib.ExitStack() as stack:
        lines = anchors.start_server(stack, argv, lines=len(files))
        return {info["ticket"]: _timed(functools.partial(_fetch, info), repeat) for info in lines}


def _setup_cost(memory: str, capacity_mib: int, repeat: int) -> float:
    from dissoc.memory.private import PrivateArenas

    arenas = PrivateArenas(memory, capacity=capacity_mib << 20, budget=ARENA_MIB << 20)
    try:

        def once() -> None:
            arenas.release(arenas.open())

        return _timed(once, repeat)
    finally:
        arenas.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed fetches per row and dataset (5)")
    parser.add_argument("--memory", default="shm,ucx", help="memory kinds: shm, ucx or both (default)")
    parser.add_argument("--json", action="store_true", help="JSON on stdout, the table on stderr")
    args = parser.parse_args(argv)
    kinds = [k for k in args.memory.split(",") if k]
    if "ucx" in kinds and importlib.util.find_spec("ucxx") is None:
        print("memory=ucx: not available (ucxx is not installed)", file=sys.stderr)
        kinds.remove("ucx")
    results: dict[str, Any] = {"rows": [], "setup": []}
    out = sys.stderr if args.json else sys.stdout
    with tempfile.TemporaryDirectory(prefix="dissoc-bench-") as tmp:
        files = [_write(Path(tmp), name, batches, rows) for name, batches, rows in DATASETS]
        for memory in kinds:
            base: dict[str, float] | None = None
            print(f"\nmemory={memory} (median of {args.repeat} fetches, ms; ratio to 'shared')", file=out)
            print(f"| arena | {' | '.join(f'{n} | vs shared' for n, _, _ in DATASETS)} |", file=out)
            print(f"| --- |{' --- | --- |' * len(DATASETS)}", file=out)
            for label, flags in MODES:
                got = _row(memory, flags, files, args.repeat)
                base = base or got
                cells = " | ".join(f"{got[n] * 1e3:.2f} | {got[n] / base[n]:.2f}x" for n, _, _ in DATASETS)
                print(f"| {label} | {cells} |", file=out, flush=True)
                results["rows"].append({"memory": memory, "arena": label, "seconds": got})
            for mib in (ARENA_MIB // 4, 32):
                cost = _setup_cost(memory, mib, args.repeat)
                print(f"making and destroying one {mib} MiB private arena: {cost * 1e3:.2f} ms", file=out)
                results["setup"].append({"memory": memory, "mib": mib, "seconds": cost})
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
