"""Across a link: dissoc TCP (both layouts) against Flight ``do_get`` between two hosts (not run by pytest).

The two hosts are network namespaces of this machine joined by a bridge (``tests/cluster/netns.py``): the
server in one, the client in the other, so every byte crosses a real (virtual) link and its TCP stack instead
of loopback. Batches of 16 KiB and of 16 MiB (2 int64 columns), read from an Arrow IPC file by every
server; each path's client consumes every batch. Two conditions: the link as it is, and capped at 1 Gbit/s
each way (``tc tbf``) with 1% of the packets each host sends dropped (``nft``). Each figure is the median
GB/s of ``--repeat`` transfers after one warm-up; ratios are to Flight in the same condition. Targets: at
least 1.5x Flight at both sizes unshaped, at least 1x Flight under the cap.

Needs root, iproute2, util-linux and nftables (``scripts/ensure-net-tools.sh``)::

    .venv/bin/python benchmarks/cluster.py              # both sizes, both conditions, 3 transfers each
    .venv/bin/python benchmarks/cluster.py --quick --json

Client entry point (run by this script inside the client host)::

    python benchmarks/cluster.py client KIND URI TICKET REPEAT [DATA_URI]   # one JSON line: seconds each
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
for where in (REPO_ROOT, REPO_ROOT / "tests"):
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))


from benchmarks._anchors import Workload, write_dataset  # noqa: E402

PATHS = ("dissoc-tcp-combined", "dissoc-tcp-split", "flight-do-get")
TARGET_UNSHAPED = 1.5
TARGET_SHAPED = 1.0


def workloads(quick: bool) -> list[Workload]:
    return [
        Workload("small", 2, 1024, 4_000 if quick else 20_000),  # 16 KiB batches
        Workload("large", 2, 1 << 20, 8 if quick else 32),  # 16 MiB batches
    ]


# ---------------------------------------------------------------------------------------------- the client


def client(kind: str, uri: str, ticket: str, repeat: int, data_uri: str | None = None) -> None:
    """Transfers the stream ``repeat + 1`` times (the first untimed); prints the seconds of each timed one."""
    if kind == "flight":
        from pyarrow import flight

        conn = flight.FlightClient(uri)

        def once() -> tuple[int, int]:
            n = rows = 0
            for chunk in conn.do_get(flight.Ticket(ticket.encode())):
                n += chunk.data.nbytes
                rows += chunk.data.num_rows
            return n, rows

    else:
        from dissoc.client import open_stream

        def once() -> tuple[int, int]:
            n = rows = 0
            with open_stream(uri, ticket, data_uri=data_uri) as reader:
                for batch in reader:
                    n += batch.nbytes
                    rows += batch.num_rows
            return n, rows

    once()
    seconds = []
    nbytes = rows = 0
    for _ in range(repeat):
        start = time.perf_counter()
        nbytes, rows = once()
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"seconds": seconds, "bytes": nbytes, "rows": rows}), flush=True)


# ------------------------------------------------------------------------------------------------ the run


def _servers(
    server_host: Any, files: dict[str, Path], env: dict[str, str]
) -> dict[str, dict[str, list[str]]]:
    """Start the three servers in ``server_host``; each path's URIs per workload (metadata, and data)."""
    python = sys.executable
    uris: dict[str, dict[str, list[str]]] = {p: {} for p in PATHS}
    for path, extra in (("dissoc-tcp-combined", []), ("dissoc-tcp-split", ["--split"])):
        proc = server_host.popen(
            [
                python,
                "-m",
                "dissoc.cli",
                "serve",
                "--host",
                server_host.addr,
                *extra,
                *map(str, files.values()),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert proc.stdout is not None
        for _ in files:
            info = json.loads(proc.stdout.readline())
            uris[path][info["ticket"]] = [info["uri"], info["data_uri"]]
    for name, file in files.items():
        proc = server_host.popen(
            [python, str(REPO_ROOT / "benchmarks" / "_anchors.py"), "serve-flight", str(file)],
            stdout=subprocess.PIPE,
            text=True,
            env={**env, "DISSOC_BENCH_HOST": server_host.addr},
        )
        assert proc.stdout is not None
        uris["flight-do-get"][name] = [json.loads(proc.stdout.readline())["uri"]]
    return uris


def _transfer(
    client_host: Any, path: str, uris: list[str], ticket: str, repeat: int, env: dict[str, str]
) -> Any:
    kind = "flight" if path == "flight-do-get" else "dissoc"
    done = client_host.run(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "client",
            kind,
            uris[0],
            ticket,
            str(repeat),
            *uris[1:],
        ],
        env=env,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        return f"error: {done.stderr.strip().splitlines()[-1:] or done.returncode}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from cluster.netns import Cluster, missing

    why = missing()
    if why is not None:
        raise SystemExit(f"cluster.py: cannot make the hosts here: {why}")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dissoc-cluster-bench-", dir="/tmp") as tmp:
        files = {w.name: write_dataset(Path(tmp), w).path for w in workloads(args.quick)}
        with Cluster(2) as cluster:
            client_host, server_host = cluster.hosts
            uris = _servers(server_host, files, env)
            for condition in ("unshaped", "1gbit-1%loss"):
                cluster.heal()
                if condition != "unshaped":
                    cluster.shape("1gbit", loss_percent=1)
                for w in workloads(args.quick):
                    for path in PATHS:
                        print(f"  {condition} / {w.name} / {path} ...", file=sys.stderr, flush=True)
                        got = _transfer(client_host, path, uris[path][w.name], w.name, args.repeat, env)
                        entry: dict[str, Any] = {"condition": condition, "workload": w.name, "path": path}
                        if isinstance(got, str):
                            entry["error"] = got
                        else:
                            med = statistics.median(got["seconds"])
                            entry.update(
                                gbps=round(got["bytes"] / med / 1e9, 3),
                                batches_per_s=round(w.num_batches / med),
                                seconds=[round(s, 4) for s in got["seconds"]],
                            )
                        results.append(entry)
    for e in results:
        where = (e["condition"], e["workload"])
        anchor = next(
            (a for a in results if a["path"] == "flight-do-get" and (a["condition"], a["workload"]) == where),
            None,
        )
        if anchor and "gbps" in anchor and "gbps" in e:
            e["vs_flight"] = round(e["gbps"] / anchor["gbps"], 2)
    return results


def report(results: list[dict[str, Any]], out: Any) -> None:
    head = f"{'condition':<14} {'batches':<7} {'path':<22} {'GB/s':>7} {'batches/s':>10} {'vs flight':>9}"
    print(head, file=out)
    for e in results:
        if "error" in e:
            print(f"{e['condition']:<14} {e['workload']:<7} {e['path']:<22} {e['error']}", file=out)
            continue
        print(
            f"{e['condition']:<14} {e['workload']:<7} {e['path']:<22} {e['gbps']:>7.3f} "
            f"{e['batches_per_s']:>10,} {e.get('vs_flight', 0):>8.2f}x",
            file=out,
        )
    print(
        f"\ntargets: >= {TARGET_UNSHAPED}x Flight unshaped (both sizes), >= {TARGET_SHAPED}x under the cap",
        file=out,
    )
    for e in results:
        if e["path"] == "flight-do-get" or "vs_flight" not in e:
            continue
        target = TARGET_UNSHAPED if e["condition"] == "unshaped" else TARGET_SHAPED
        verdict = "met" if e["vs_flight"] >= target else "MISSED"
        row = f"  {e['condition']:<14} {e['workload']:<7} {e['path']:<22} {e['vs_flight']:.2f}x ({verdict})"
        print(row, file=out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["client"]:
        kind, uri, ticket, repeat = argv[1:5]
        client(kind, uri, ticket, int(repeat), argv[5] if len(argv) > 5 else None)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="timed transfers per path (default 3)")
    parser.add_argument("--quick", action="store_true", help="4,000 small and 8 large batches per stream")
    parser.add_argument("--json", action="store_true", help="JSON on stdout (the table goes to stderr)")
    args = parser.parse_args(argv)
    results = run(args)
    report(results, sys.stderr if args.json else sys.stdout)
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
    return 1 if any("error" in e for e in results) else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
