"""Helpers shared by the reliability tests: the datasets they serve, a ``dissoc serve`` subprocess that is
stopped gracefully, and what a process holds (RSS, open fds, shared-memory segments)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from dissoc.memory.shm import NAME_PREFIX, SHM_DIR
from helpers.e2e import cli_server, vm_rss

__all__ = [
    "open_fds",
    "rss",
    "serve_process",
    "shm_segments",
    "soak_tables",
    "stop_gracefully",
    "write_ipc",
]

rss = vm_rss


def open_fds(pid: int) -> int:
    """How many file descriptors process ``pid`` has open (``/proc/PID/fd``; 0 if it is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return 0


def shm_segments(pid: int) -> list[str]:
    """The dissoc shared-memory segments process ``pid`` created that still exist (segments are named
    ``NAME_PREFIX + PID + '-' + random``, so the segments of other processes on a shared machine are not
    counted)."""
    prefix = f"{NAME_PREFIX}{pid}-"
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def write_ipc(path: Path, table: pa.Table) -> Path:
    """Write ``table`` as an Arrow IPC file (one message per batch) at ``path``."""
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches():
            writer.write_batch(batch)
    return path


def soak_tables() -> dict[str, pa.Table]:
    """Datasets of mixed sizes: a few rows, int columns of a few MiB, strings, a dictionary column."""
    tiny = pa.table({"id": pa.array(range(5), pa.int64()), "v": pa.array([1.5, None, 3.0, 4.5, 5.0])})
    rows = 1 << 17  # 131,072 rows x (8 + 4 + 8) bytes = 2.5 MiB per batch
    int_batches = [
        pa.record_batch(
            {
                "id": pa.array(range(b * rows, (b + 1) * rows), pa.int64()),
                "i32": pa.array([(i * 7) % 1000 - 500 for i in range(rows)], pa.int32()),
                "u64": pa.array(range(rows), pa.uint64()),
            }
        )
        for b in range(2)
    ]
    ints = pa.Table.from_batches(int_batches)
    srows = 20_000
    strings = pa.Table.from_batches(
        [
            pa.record_batch(
                {
                    "id": pa.array(range(b * srows, (b + 1) * srows), pa.int64()),
                    "s": pa.array([None if i % 9 == 0 else f"value-{i}-" * (i % 5) for i in range(srows)]),
                    "ls": pa.array([f"large-{b}-{i}" for i in range(srows)], pa.large_string()),
                }
            )
            for b in range(3)
        ]
    )
    dictionary = pa.array(["alpha", "beta", "gamma", "delta", "epsilon"])
    drows = 50_000
    dict_table = pa.Table.from_batches(
        [
            pa.record_batch(
                {
                    "id": pa.array(range(b * drows, (b + 1) * drows), pa.int64()),
                    "d": pa.DictionaryArray.from_arrays(
                        pa.array([None if i % 13 == 0 else (i + b) % 5 for i in range(drows)], pa.int32()),
                        dictionary,
                    ),
                }
            )
            for b in range(4)
        ]
    )
    return {"tiny": tiny, "ints": ints, "strings": strings, "dict": dict_table}


def stop_gracefully(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> int:
    """SIGTERM ``proc`` and wait (bounded) for it to exit; returns its exit status (SIGKILLed and an
    AssertionError raised if it does not stop in time)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise AssertionError(f"the server did not stop within {timeout} s of SIGTERM") from None


@contextlib.contextmanager
def serve_process(
    *args: str, count: int, timeout: float = 30.0
) -> Iterator[tuple[subprocess.Popen[bytes], Any]]:
    """``dissoc serve ARGS`` in a subprocess (via :func:`helpers.e2e.cli_server`): yields the process and its
    ready lines keyed by ticket. Killed on exit if the test did not stop it."""
    started = time.monotonic()
    with cli_server(*args, count=count, timeout=timeout) as (proc, lines):
        print(f"server {' '.join(args[-3:])!s:.60}... ready in {time.monotonic() - started:.1f} s")
        yield proc, {line["ticket"]: line for line in lines}
