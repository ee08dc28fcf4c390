"""GPU to GPU between two processes on one device, against a CuPy device-to-device copy (not run by pytest).

For each batch size S (default 16 and 256 MiB; 2 int64 columns) a server subprocess uploads ``--total-mib``
of batches to the GPU (``DeviceBatch.from_batches``) and serves them as a device dataset; this process
fetches the whole stream with ``ClientOptions(landing="device")``, so every batch ends in device memory as a
``DeviceBatch``. Paths:

- ``cupy-d2d-copy`` (the anchor): ``dst[...] = src`` of S bytes per batch, alternating between two
  destination buffers, then one synchronize; the same bytes as one stream;
- ``ucx-packed``: ``Server(transport="ucx")`` with packed bodies. The server sends each body from device
  memory and the client's allocator gives UCX a device buffer per body (UCX's ``cuda_ipc`` transport between
  the two processes). The client connects by worker address (same host);
- ``cuda-ipc-pairs-zc``: ``Server(transport="tcp", body="pairs", memory="cuda")``: the server's batches are
  placed in its device arena once (resident) and each batch is a list of (offset, length) pairs into it;
  the client maps the arena's CUDA IPC handle once per stream and builds each batch as a view over it
  (``zero_copy=True``): nothing is copied, so its GB/s is the control path's speed, not memory's;
- ``cuda-ipc-pairs-copy``: the same, the client copying each batch device-to-device into its own memory and
  freeing the ranges at once;
- ``partition-2way``: the send side of the Spark exchange's device path, in this process:
  :func:`~dissoc.device.partition_device_batch` hashes column ``a`` of each resident batch and gathers its
  rows into one new device batch per destination (2 tasks), as ``exchange`` does before it serves them.

Each figure is the median GB/s of ``--repeat`` whole-stream fetches after ``--warmup`` (the warm-up also
places the resident batches); the ratio divides by the copy anchor's median for the same size. Every fetch
connects anew (UCX workers on both sides, the arena's IPC handle mapped again), so a stream of few batches is
dominated by that setup; ``--reuse-connections`` keeps packed and copy-mode connections between fetches, as
``throughput.py`` does (zero-copy streams always keep their own), and a larger ``--total-mib`` shows the
rate per batch. Target:
>= 0.70x the copy at 256 MiB. ``--fake`` runs everything on the CPU with the fake device backend (host shared
memory posing as device memory): a smoke test of the script, not a measurement.

Run from the repository root (on a machine with a CUDA device, cupy and ucxx)::

    .venv/bin/python benchmarks/gpu.py                         # 16 and 256 MiB, 1 GiB per stream
    .venv/bin/python benchmarks/gpu.py --sizes 256 --repeat 9 --json
    .venv/bin/python benchmarks/gpu.py --sizes 256 --total-mib 4096 --reuse-connections
    .venv/bin/python benchmarks/gpu.py --fake --total-mib 64   # CPU smoke test

Server entry point (started by this script)::

    python benchmarks/gpu.py serve MODE SIZE_MIB COUNT   # one JSON line {"uri", "ticket"}, then serves
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

MiB = 1 << 20
MODES = {
    "ucx-packed": {"transport": "ucx", "body": "packed"},
    "cuda-ipc-pairs-zc": {"transport": "tcp", "body": "pairs", "memory": "cuda"},
    "cuda-ipc-pairs-copy": {"transport": "tcp", "body": "pairs", "memory": "cuda"},
}
TARGET = 0.70


def _batches(size_mib: int, count: int) -> list[pa.RecordBatch]:
    rows = size_mib * MiB // 16
    a = np.arange(rows, dtype=np.int64)
    batch = pa.record_batch({"a": a, "b": a * 3})
    return [batch] * count


# ----------------------------------------------------------------------------------------------------------
# Server subprocess


async def _serve(mode: str, size_mib: int, count: int) -> None:
    from dissoc.datasets import DeviceDataset
    from dissoc.device import DeviceBatch
    from dissoc.server import Server

    batches = _batches(size_mib, count)
    device = DeviceBatch.from_batches(batches[0].schema, batches)
    dataset = DeviceDataset("bench", device)
    kwargs: dict[str, Any] = dict(MODES[mode])
    if kwargs.get("body") == "pairs":
        kwargs["arena_bytes"] = 2 * size_mib * MiB * count + 64 * MiB
    async with Server({"bench": dataset}, **kwargs) as server:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        sys.stdout.write(json.dumps({"uri": server.uri, "ticket": "bench"}) + "\n")
        sys.stdout.flush()
        await stop.wait()


# ----------------------------------------------------------------------------------------------------------
# Client side


def _backend(fake: bool) -> Any:
    from dissoc.memory.cuda import FakeDeviceBackend, get_backend

    return FakeDeviceBackend() if fake else get_backend()


def _device_name(fake: bool) -> str:
    if fake:
        return "fake device (host shared memory)"
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    return str(name.decode() if isinstance(name, bytes) else name)


def copy_anchor(backend: Any, size_mib: int, count: int) -> Callable[[], int]:
    """One stream's worth of device-to-device copies (two destinations, alternating)."""
    n = size_mib * MiB
    src = backend.empty(n)
    dst = [backend.empty(n), backend.empty(n)]

    def run() -> int:
        for i in range(count):
            backend.copy(dst[i % 2], src)
        backend.synchronize()
        return n * count

    return run


def partition_anchor(size_mib: int, count: int) -> Callable[[], int]:
    """Hash-partition ``count`` resident device batches of ``size_mib`` into 2 destinations each."""
    from dissoc.device import DeviceBatch
    from dissoc.device.partition import partition_device_batch

    batches = _batches(size_mib, 1)
    (device,) = DeviceBatch.from_batches(batches[0].schema, batches)

    def run() -> int:
        total = 0
        for _ in range(count):
            parts = partition_device_batch(device, "a", 2)
            total += sum(int(p.nbytes) for p in parts)
            del parts
        return total

    return run


def fetch_path(
    mode: str,
    size_mib: int,
    count: int,
    env: dict[str, str],
    stack: contextlib.ExitStack,
    reuse: bool = False,
) -> Any:
    """Start the mode's server; returns a function fetching the whole stream onto the device once (over a
    new connection each time unless ``reuse``: then the loop's pool keeps it for the next fetch)."""
    from dissoc.client import ClientOptions, close_idle_connections, stream_batches

    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "serve", mode, str(size_mib), str(count)],
        stdout=subprocess.PIPE,
        env=env,
        cwd=REPO_ROOT,
        text=True,
    )

    stack.callback(_stop, proc)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"{mode}: the server exited ({proc.wait()}) before it was ready")
    info = json.loads(line)
    options = ClientOptions(
        landing="device",
        zero_copy=mode.endswith("-zc"),
        ucx_path="address",
        timeout=120,
        reuse_connections=reuse or None,
    )

    async def once() -> int:
        total = 0
        async for batch in stream_batches(info["uri"], info["ticket"], options=options):
            total += int(batch.nbytes)
            del batch
        return total

    loop = asyncio.new_event_loop()

    def close_loop() -> None:
        loop.run_until_complete(close_idle_connections())  # before the server stops (runs first: LIFO)
        gc.collect()  # zero-copy batches still referenced somewhere: their frees run now
        pending = asyncio.all_tasks(loop)
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=5))
        loop.close()

    stack.callback(close_loop)

    def run() -> int:
        return loop.run_until_complete(once())

    return run


def _profiled(run: Callable[[], int], title: str, path: str) -> Callable[[], int]:
    """``run`` under cProfile; every profiled path's functions that took the most time go to ``path`` at
    exit."""
    import cProfile

    profile = cProfile.Profile()
    if not _PROFILES:
        atexit.register(_write_profiles, path)
    _PROFILES.append((title, profile))

    def profiled() -> int:
        profile.enable()
        try:
            return run()
        finally:
            profile.disable()

    return profiled


_PROFILES: list[tuple[str, Any]] = []


def _write_profiles(path: str) -> None:
    import io
    import pstats

    with open(path, "w") as f:
        for title, profile in _PROFILES:
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
            f.write(f"==== {title} (client side, warm-up included)\n{text.getvalue()}\n")


def measure(run: Callable[[], int], repeat: int, warmup: int, sync: Callable[[], None]) -> list[float]:
    for _ in range(warmup):
        run()
    rates: list[float] = []
    for _ in range(repeat):
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            nbytes = run()
            sync()
            seconds = time.perf_counter() - start
        finally:
            gc.enable()
        rates.append(nbytes / seconds / 1e9)
    return rates


# ----------------------------------------------------------------------------------------------------------
# Setup per stream and control per batch (--streams)

#: ``--streams``: the servers (``dissoc serve --device`` flags), and each row's server and client options.
STREAM_SERVERS = {
    "ucx": ["--transport", "ucx"],
    "pairs": ["--transport", "tcp", "--body", "pairs", "--memory", "cuda"],
}
STREAM_PATHS: dict[str, tuple[str, dict[str, Any]]] = {
    "ucx-packed": ("ucx", {}),
    "cuda-ipc-pairs-copy": ("pairs", {}),
    "cuda-ipc-pairs-zc": ("pairs", {"zero_copy": True}),
}
#: ``--streams`` targets: a warm client's later device streams, and the control per batch of CUDA IPC pairs.
STREAM_TARGET_MS = 2.0
BATCH_TARGET_US = 50.0


def _ipc_file(path: Path, batches: int, rows: int) -> Path:
    a = np.arange(rows, dtype=np.int64)
    batch = pa.record_batch({"a": a, "b": a * 3})
    with pa.ipc.new_file(path, batch.schema) as writer:
        for _ in range(batches):
            writer.write_batch(batch)
    return path


def _cli_servers(
    servers: dict[str, list[str]], env: dict[str, str], stack: contextlib.ExitStack
) -> dict[str, dict[str, dict[str, Any]]]:
    """``dissoc serve --device ARGS`` per entry, in subprocesses started together (as a user starts one);
    each one's ready lines by ticket."""
    procs: dict[str, subprocess.Popen[str]] = {}
    for name, args in servers.items():
        proc = procs[name] = subprocess.Popen(
            [sys.executable, "-m", "dissoc.cli", "serve", "--device", "--port", "0", *args],
            stdout=subprocess.PIPE,
            env=env,
            cwd=REPO_ROOT,
            text=True,
        )
        stack.callback(_stop, proc)
    ready: dict[str, dict[str, dict[str, Any]]] = {}
    for name, proc in procs.items():
        assert proc.stdout is not None
        lines = {}
        for _ in range(sum(1 for a in servers[name] if a.endswith(".arrow"))):
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"dissoc serve {' '.join(servers[name])}: exited ({proc.wait()}) early")
            info = json.loads(line)
            lines[info["ticket"]] = info
        ready[name] = lines
    return ready


def _stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM a server subprocess, and kill it if it has not gone within 20 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _timed_ms(call: Callable[[], object], repeat: int) -> tuple[float, float]:
    """The first call's milliseconds, and the median of ``repeat`` more."""
    times = []
    for _ in range(repeat + 1):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return round(times[0], 2), round(statistics.median(times[1:]), 3)


def streams(env: dict[str, str], repeat: int, count: int) -> list[dict[str, Any]]:
    """Per stream: a warm client's ``fetch_device`` of a one-batch dataset, default options (the first
    stream, then the median of ``repeat`` more). Per batch: a stream of ``count`` 2 KiB batches over CUDA IPC
    pairs, wall time per batch (median of ``repeat`` streams after one untimed)."""
    import logging
    import tempfile

    from dissoc.client import ClientOptions, fetch, fetch_device

    # (the fake device's packed bodies go through host memory: one warning per stream, not measured here)
    logging.getLogger("dissoc.client").setLevel(logging.ERROR)
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        one = str(_ipc_file(tmp / "one.arrow", 1, 8192))
        many = str(_ipc_file(tmp / "many.arrow", count, 128))
        try:
            servers = _cli_servers({k: [*v, one, many] for k, v in STREAM_SERVERS.items()}, env, stack)
        except Exception as exc:
            return [{"what": "stream", "path": "servers", "error": f"{type(exc).__name__}: {exc}"}]
        for name, (server, fields) in STREAM_PATHS.items():
            info = servers[server]["one"]
            options = ClientOptions(**fields) if fields else None
            try:
                first, later = _timed_ms(
                    lambda: fetch_device(info["uri"], "one", options=options),  # noqa: B023 (called at once)
                    repeat,
                )
                results.append({"what": "stream", "path": name, "first_ms": first, "ms": later})
            except Exception as exc:
                results.append({"what": "stream", "path": name, "error": f"{type(exc).__name__}: {exc}"})
        try:  # the same server's host streams, for comparison
            info = servers["ucx"]["one"]
            first, later = _timed_ms(lambda: fetch(info["uri"], "one"), repeat)
            results.append({"what": "stream", "path": "ucx-packed-host", "first_ms": first, "ms": later})
        except Exception as exc:
            results.append(
                {"what": "stream", "path": "ucx-packed-host", "error": f"{type(exc).__name__}: {exc}"}
            )
        for name in ("cuda-ipc-pairs-copy", "cuda-ipc-pairs-zc"):
            server, fields = STREAM_PATHS[name]
            info = servers[server]["many"]
            options = ClientOptions(**fields) if fields else None
            try:
                per_batch = []
                for k in range(repeat + 1):
                    start = time.perf_counter()
                    got = fetch_device(info["uri"], "many", options=options)
                    seconds = time.perf_counter() - start
                    assert len(got) == count, (len(got), count)
                    del got
                    if k:
                        per_batch.append(seconds / count * 1e6)
                us = round(statistics.median(per_batch), 2)
                results.append({"what": "batch", "path": name, "batches": count, "us": us})
            except Exception as exc:
                results.append({"what": "batch", "path": name, "error": f"{type(exc).__name__}: {exc}"})
    return results


def _print_streams(results: list[dict[str, Any]], out: Any) -> None:
    print(f"{'per stream (warm client)':<28} {'first ms':>9} {'later ms':>9}  target", file=out)
    for e in results:
        if e["what"] != "stream":
            continue
        if "error" in e:
            print(f"{e['path']:<28} {e['error']}", file=out)
            continue
        target = (
            ""
            if e["path"].endswith("-host")
            else ("met" if e["ms"] <= STREAM_TARGET_MS else "MISSED") + f" (<= {STREAM_TARGET_MS:g} ms)"
        )
        print(f"{e['path']:<28} {e['first_ms']:>9.2f} {e['ms']:>9.3f}  {target}", file=out)
    print(f"{'control per batch':<28} {'batches':>9} {'us':>9}  target", file=out)
    for e in results:
        if e["what"] != "batch":
            continue
        if "error" in e:
            print(f"{e['path']:<28} {e['error']}", file=out)
            continue
        verdict = "met" if e["us"] <= BATCH_TARGET_US else "MISSED"
        print(
            f"{e['path']:<28} {e['batches']:>9} {e['us']:>9.2f}  {verdict} (<= {BATCH_TARGET_US:g} us)",
            file=out,
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="16,256", help="batch sizes in MiB (default 16,256)")
    parser.add_argument("--total-mib", type=int, default=1024, help="bytes per stream (default 1024 MiB)")
    parser.add_argument("--repeat", type=int, default=5, help="timed fetches per path (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed fetches first (default 1)")
    parser.add_argument("--only", default=None, help="modes to run, comma-separated")
    parser.add_argument("--fake", action="store_true", help="CPU smoke test with the fake device backend")
    parser.add_argument("--json", action="store_true", help="JSON on stdout (the table goes to stderr)")
    parser.add_argument(
        "--reuse-connections",
        action="store_true",
        help="keep each path's connections between fetches (as throughput.py does); by default every fetch "
        "connects anew, so a stream pays its setup (UCX workers, mapping the arena's IPC handle)",
    )
    parser.add_argument(
        "--streams",
        action="store_true",
        help="measure setup per stream (a warm client's device streams) and control per batch (CUDA IPC "
        "pairs) instead of throughput",
    )
    parser.add_argument(
        "--batches", type=int, default=4000, help="batches per stream of --streams' per-batch rows"
    )
    parser.add_argument(
        "--profile",
        metavar="FILE",
        default=None,
        help="profile the client side of each path's timed fetches (cProfile: slower, so not a measurement) "
        "and write the functions that took the most time to FILE",
    )
    args = parser.parse_args(argv)
    if args.command:
        if args.command[0] != "serve" or len(args.command) != 4:
            parser.error("usage: gpu.py serve MODE SIZE_MIB COUNT")
        asyncio.run(_serve(args.command[1], int(args.command[2]), int(args.command[3])))
        return 0

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if args.fake:
        env["DISSOC_DEVICE_BACKEND"] = "fake"
        os.environ["DISSOC_DEVICE_BACKEND"] = "fake"  # this process too (read by get_backend)
    try:
        backend = _backend(args.fake)
        device = _device_name(args.fake)
    except Exception as exc:
        print(f"gpu.py: no device to measure on: {exc}", file=sys.stderr)
        return 2
    out = sys.stderr if args.json else sys.stdout
    if args.streams:
        print(
            f"# device: {device}; setup per stream and control per batch, median of {args.repeat}", file=out
        )
        rows = streams(env, max(3, args.repeat), args.batches)
        _print_streams(rows, out)
        if args.json:
            json.dump({"device": device, "fake": args.fake, "streams": rows}, sys.stdout, indent=2)
            print()
        return 1 if any("error" in e for e in rows) else 0
    modes = [m for m in MODES if args.only is None or m in args.only.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    out = sys.stderr if args.json else sys.stdout
    print(f"# device: {device}; {args.total_mib} MiB per stream; median of {args.repeat}", file=out)
    results: list[dict[str, Any]] = []
    for size in sizes:
        count = max(2, args.total_mib // size)
        rows: list[tuple[str, list[float] | str]] = []
        try:
            rows.append(
                (
                    "cupy-d2d-copy",
                    measure(copy_anchor(backend, size, count), args.repeat, 1, backend.synchronize),
                )
            )
        except Exception as exc:
            rows.append(("cupy-d2d-copy", f"error: {type(exc).__name__}: {exc}"))
        for mode in modes:
            print(f"  {mode} / {size} MiB ...", file=sys.stderr)
            try:
                with contextlib.ExitStack() as stack:
                    run = fetch_path(mode, size, count, env, stack, reuse=args.reuse_connections)
                    if args.profile:
                        run = _profiled(run, f"{mode} / {size} MiB", args.profile)
                    rows.append((mode, measure(run, args.repeat, args.warmup, backend.synchronize)))
            except Exception as exc:
                rows.append((mode, f"error: {type(exc).__name__}: {exc}"))
        if args.only is None or "partition-2way" in args.only.split(","):
            try:
                rows.append(
                    (
                        "partition-2way",
                        measure(partition_anchor(size, count), args.repeat, 1, backend.synchronize),
                    )
                )
            except Exception as exc:
                rows.append(("partition-2way", f"error: {type(exc).__name__}: {exc}"))
        anchor = rows[0][1]
        anchor_med = statistics.median(anchor) if isinstance(anchor, list) else None
        for name, rates in rows:
            entry: dict[str, Any] = {"path": name, "size_mib": size, "batches": count}
            if isinstance(rates, str):
                entry["error"] = rates
            else:
                med = statistics.median(rates)
                entry.update(gbps=[round(r, 3) for r in rates], median_gbps=round(med, 3))
                if anchor_med:
                    entry["vs_copy"] = round(med / anchor_med, 3)
            results.append(entry)
    print(f"{'path':<22} {'MiB':>4} {'GB/s med':>9} {'min':>8} {'max':>8} {'vs copy':>8}", file=out)
    for e in results:
        if "error" in e:
            print(f"{e['path']:<22} {e['size_mib']:>4}  {e['error']}", file=out)
            continue
        vs = f"{e['vs_copy']:.2f}x" if "vs_copy" in e else "-"
        print(
            f"{e['path']:<22} {e['size_mib']:>4} {e['median_gbps']:>9.2f} {min(e['gbps']):>8.2f} "
            f"{max(e['gbps']):>8.2f} {vs:>8}",
            file=out,
        )
    checks = [e for e in results if e["size_mib"] == 256 and e["path"] != "cupy-d2d-copy" and "vs_copy" in e]
    if checks:
        print(f"\ntarget at 256 MiB: >= {TARGET:.2f}x the device-to-device copy", file=out)
        for e in checks:
            verdict = "met" if e["vs_copy"] >= TARGET else "MISSED"
            print(f"  {e['path']:<22} {e['vs_copy']:.2f}x ({verdict})", file=out)
    if args.json:
        json.dump({"device": device, "fake": args.fake, "results": results}, sys.stdout, indent=2)
        print()
    return 1 if any("error" in e for e in results) else 0


if __name__ == "__main__":
    sys.exit(main())
