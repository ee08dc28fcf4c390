"""The command line end to end: ``dissoc serve`` in a subprocess (JSON lines only on stdout, exit 0 on
SIGTERM/SIGINT) and ``dissoc get`` fetching from it into Arrow IPC files and streams; exit statuses 1 (a
DissocError: message, no traceback) and 2 (usage)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.e2e import PYTHON, REPO, ServerThread, cli_server, ordered_table, sample_table

from dissoc import cli
from dissoc.errors import DissocError
from dissoc.memory.cuda import ENV_VAR
from dissoc.uri import DissocURI

pytestmark = pytest.mark.timeout(60)


def dissoc_cmd(
    *args: str, timeout: float = 30, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "dissoc.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


#: The served files by ticket: (path, the table it holds).
Files = dict[str, tuple[Path, pa.Table]]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    root = tmp_path_factory.mktemp("cli")
    table = sample_table(batches=3)
    arrow = root / "trips.arrow"
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    ordered = ordered_table(5, 100)
    parquet = root / "ordered.parquet"
    pq.write_table(ordered, parquet, row_group_size=100)
    return {"trips": (arrow, table), "ordered": (parquet, pq.read_table(parquet))}


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> tuple[int, bytes, bytes]:
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=15)
    return proc.returncode, out, err


@pytest.mark.parametrize("split", [False, True], ids=["combined", "split"])
def test_serve_prints_one_json_line_per_dataset_and_exits_0_on_sigterm(files: Files, split: bool) -> None:
    paths = [str(files["trips"][0]), str(files["ordered"][0])]
    args = [*paths, "--port", "0"] + (["--split"] if split else [])
    with cli_server(*args, count=2) as (proc, lines):
        assert [line["ticket"] for line in lines] == ["trips", "ordered"]
        for line in lines:
            assert set(line) >= {"ticket", "uri", "data_uri"}
            assert line["uri"].startswith("tcp://127.0.0.1:") and "want_data=" in line["uri"]
            assert (line["data_uri"] != line["uri"]) if split else (line["data_uri"] == line["uri"])
        status, out, err = _stop(proc)
    assert status == 0, f"exit status {status} on SIGTERM; stderr: {err.decode()[-2000:]}"
    assert out == b"", f"stdout carried more than the JSON lines: {out!r}"
    assert b"Traceback" not in err


def test_serve_handles_signals_as_soon_as_it_printed_ready(files: Files) -> None:
    """The JSON lines say "ready": a SIGTERM/SIGINT sent the instant they appear must still give exit 0
    (repeated, since it is a race between printing and installing the signal handlers)."""
    import os

    statuses = []
    for attempt in range(6):
        sig = signal.SIGTERM if attempt % 2 == 0 else signal.SIGINT
        proc = subprocess.Popen(
            [PYTHON, "-m", "dissoc.cli", "serve", str(files["ordered"][0])],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None
            first = os.read(proc.stdout.fileno(), 1)  # blocks until the ready line starts
            assert first == b"{"
            proc.send_signal(sig)
            proc.communicate(timeout=15)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
        statuses.append((signal.Signals(sig).name, proc.returncode))
    assert all(status == 0 for _, status in statuses), f"exit statuses: {statuses}"


def test_serve_exits_0_on_sigint(files: Files) -> None:
    with cli_server(str(files["ordered"][0]), count=1) as (proc, _lines):
        status, out, err = _stop(proc, signal.SIGINT)
    assert status == 0, f"exit status {status} on SIGINT; stderr: {err.decode()[-2000:]}"
    assert out == b""
    assert b"Traceback" not in err


@pytest.mark.parametrize("split", [False, True], ids=["combined", "split"])
@pytest.mark.parametrize("suffix", [".arrow", ".arrows"])
def test_get_writes_files_pyarrow_reads_back_equal(
    files: Files, split: bool, suffix: str, tmp_path: Path
) -> None:
    paths = [str(files["trips"][0]), str(files["ordered"][0])]
    with cli_server(*paths, *(["--split"] if split else []), count=2) as (proc, lines):
        for line in lines:
            ticket = line["ticket"]
            out = tmp_path / f"{ticket}{suffix}"
            args = [line["uri"], ticket, "-o", str(out), "--no-progress"]
            if split:
                args += ["--data-uri", line["data_uri"]]
            result = dissoc_cmd("get", *args)
            assert result.returncode == 0, result.stderr
            assert "Traceback" not in result.stderr
            summary_lines = result.stdout.strip().splitlines()
            assert len(summary_lines) == 1, f"expected one JSON line on stdout, got {result.stdout!r}"
            summary = json.loads(summary_lines[0])
            expected = files[ticket][1]
            assert summary["rows"] == expected.num_rows
            assert summary["batches"] >= 1
            assert summary["bytes"] > 0
            assert {"seconds", "bytes", "rows", "batches"} <= set(summary)
            assert summary["path"] == {
                "transport": "tcp",
                "data_transport": "tcp",
                "ucx_transports": [],
                "bodies": "packed",
                "memory": None,
                "arena": None,
                "device_landing": [],
            }
            assert "paths" not in summary  # (one stream)
            if suffix == ".arrow":
                got = pa.ipc.open_file(str(out)).read_all()
            else:
                got = pa.ipc.open_stream(str(out)).read_all()
            assert got.equals(expected), f"{ticket}{suffix} differs from the served data"
        assert proc.poll() is None, "the server exited while serving"


def test_get_landing_on_the_device_over_tcp_says_it_went_through_the_host(files: Files) -> None:
    # The fake device (host memory posing as device memory) in the client; TCP has no way into the device.
    env = {**os.environ, ENV_VAR: "fake"}
    table = files["trips"][1]
    with ServerThread({"trips": table}) as srv:
        got = dissoc_cmd("get", srv.uri, "trips", "--landing", "device", "--no-progress", env=env)
        required = dissoc_cmd(
            "get", srv.uri, "trips", "--landing", "device", "--require-device-path", "--no-progress", env=env
        )
    assert got.returncode == 0, got.stderr
    summary = json.loads(got.stdout)
    assert summary["rows"] == table.num_rows and summary["batches"] == 3
    assert summary["path"]["device_landing"] == ["host-copy"]
    assert summary["path"]["transport"] == "tcp" and summary["path"]["bodies"] == "packed"
    # one warning for the stream (of three batches), naming the flag that makes it an error
    warnings = [line for line in got.stderr.splitlines() if "uploaded to the device" in line]
    assert len(warnings) == 1, got.stderr
    assert "dissoc.client: [stream " in warnings[0] and "require_device_path" in warnings[0]
    # required: exit 1 before a batch is written, the path taken and the way to the device path named
    assert required.returncode == 1, (required.returncode, required.stderr)
    assert required.stdout == "" and "Traceback" not in required.stderr
    assert "dissoc: error: landing='device' with require_device_path" in required.stderr
    assert "packed bodies over tcp were received into host memory" in required.stderr
    assert "ucx://" in required.stderr and "--memory cuda" in required.stderr


def test_get_require_device_path_needs_landing_on_the_device() -> None:
    args, _ = cli.parse_args(["get", "tcp://127.0.0.1:1?want_data=1", "t", "--require-device-path"])
    with pytest.raises(DissocError, match="--require-device-path applies to --landing device"):
        asyncio.run(cli._get(args))  # before anything is connected to


def test_get_unknown_ticket_exits_1_with_message_no_traceback(files: Files) -> None:
    with cli_server(str(files["ordered"][0]), count=1) as (_proc, lines):
        result = dissoc_cmd("get", lines[0]["uri"], "does-not-exist", "--no-progress", "--timeout", "10")
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert "does-not-exist" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_get_nothing_listening_exits_1(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        result = dissoc_cmd(
            "get", f"tcp://127.0.0.1:{port}?want_data=1", "x", "--timeout", "3", "--no-progress"
        )
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert result.stderr.strip(), "no message on stderr"
    assert "Traceback" not in result.stderr


def test_get_malformed_uri_exits_1_or_2_without_traceback() -> None:
    result = dissoc_cmd("get", "tcp://127.0.0.1:1?want_data=notanumber", "x", "--no-progress")
    assert result.returncode in (1, 2), (result.returncode, result.stderr)
    assert "want_data" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_missing_file_exits_1_without_traceback(tmp_path: Path) -> None:
    result = dissoc_cmd("serve", str(tmp_path / "nope.arrow"))
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert "nope.arrow" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["get"],
        ["get", "tcp://127.0.0.1:1?want_data=1"],
        ["serve"],
        ["serve", "--transport", "carrier-pigeon", "x.arrow"],
        ["serve", "--port", "not-a-port", "x.arrow"],
        # out of range: a port that the OS would wrap (70000 -> 4464) or take as "any" (65536) is refused
        ["serve", "--port", "70000", "x.arrow"],
        ["serve", "--port", "65536", "x.arrow"],
        ["serve", "--port", "-1", "x.arrow"],
        ["serve", "--split", "--data-port", "65536", "x.arrow"],
        ["serve", "--flight", "70000", "x.arrow"],
        ["serve", "--body", "pairs", "--arena-mib", "0", "x.arrow"],
        ["frobnicate"],
        ["get", "tcp://127.0.0.1:1?want_data=1", "t", "--no-such-flag"],
    ],
    ids=lambda a: " ".join(a) or "<none>",
)
def test_usage_errors_exit_2(args: list[str]) -> None:
    result = dissoc_cmd(*args)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "usage" in result.stderr.lower()
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_serve_arena_mib_bounds_the_pairs_arena(tmp_path: Path) -> None:
    # 12 batches of ~1 MiB through a 4 MiB arena: served whole twice (resident batches are evicted to make
    # room), which a larger default arena would hide; the URI names the segment, whose size is the option's.
    table = pa.table({"a": pa.array(range(12 * 131072), pa.int64())})
    path = tmp_path / "big.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=131072)
    with cli_server(str(path), "--body", "pairs", "--arena-mib", "4", count=1) as (proc, lines):
        from dissoc.uri import DissocURI

        handle = DissocURI.parse(lines[0]["data_uri"]).remote_handle
        assert handle is not None
        assert Path("/dev/shm", handle.decode()).stat().st_size == 4 << 20
        for _ in range(2):
            out = tmp_path / "out.arrow"
            r = dissoc_cmd("get", lines[0]["uri"], "big", "-o", str(out))
            assert r.returncode == 0, r.stderr
            assert pa.ipc.open_file(str(out)).read_all().equals(table)
        status, _, err = _stop(proc)
    assert status == 0, err.decode()[-2000:]


def test_serve_arena_mib_must_be_positive(tmp_path: Path) -> None:
    # a usage error now (exit 2, like every invalid flag value), no longer a DissocError (exit 1)
    r = dissoc_cmd("serve", "--body", "pairs", "--arena-mib", "0", str(tmp_path / "x.arrow"))
    assert r.returncode == 2 and "--arena-mib" in r.stderr and "Traceback" not in r.stderr


def test_serve_limits_from_the_command_line(files: Files) -> None:
    """The connection limits are flags: a silent connection is dropped after --want-data-timeout, a client
    address over --max-connections-per-peer is closed at once, and a well-behaved client is served."""
    path, table = files["ordered"]
    args = ("--want-data-timeout", "1", "--max-connections-per-peer", "2")
    with cli_server(str(path), *args, count=1) as (proc, lines):
        host_port = lines[0]["uri"].split("://", 1)[1].split("?", 1)[0]
        host, port = host_port.rsplit(":", 1)
        silent = [socket.create_connection((host, int(port)), timeout=10) for _ in range(2)]
        extra = socket.create_connection((host, int(port)), timeout=10)
        try:
            assert extra.recv(1) == b""  # over the per-peer limit: closed at once
            started = time.monotonic()
            for s in silent:
                assert s.recv(1) == b""  # never sent want_data: dropped by the deadline
            assert time.monotonic() - started < 8
        finally:
            for s in (*silent, extra):
                s.close()
        got = dissoc_cmd("get", lines[0]["uri"], lines[0]["ticket"], "--no-progress")
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["rows"] == table.num_rows
        assert proc.poll() is None


@pytest.mark.parametrize(
    "args",
    [
        ["--want-data-timeout", "-1"],
        ["--idle-timeout", "soon"],
        ["--max-connections", "-3"],
        ["--max-ticket-bytes", "0"],
    ],
    ids=lambda a: " ".join(a),
)
def test_bad_limits_are_usage_errors(args: list[str]) -> None:
    result = dissoc_cmd("serve", *args, "x.arrow")
    assert result.returncode == 2 and "usage" in result.stderr.lower(), result.stderr


def test_cleanup_removes_what_a_killed_server_left(files: Files) -> None:
    """A SIGKILLed pairs server leaves its arena in /dev/shm; ``dissoc cleanup`` removes it and says so."""
    path, _table = files["trips"]
    with cli_server(str(path), "--body", "pairs", "--arena-mib", "8", count=1) as (proc, lines):
        segment = DissocURI.parse(lines[0]["uri"]).remote_handle
        assert segment is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    left = Path("/dev/shm") / segment.decode().lstrip("/")
    assert left.exists()
    got = dissoc_cmd("cleanup")
    assert got.returncode == 0, got.stderr
    summary = json.loads(got.stdout)
    removed = {r["name"]: r for r in summary["removed"]}
    assert left.name in removed and removed[left.name]["size"] == 8 << 20
    assert summary["bytes"] >= 8 << 20 and not left.exists()
    again = json.loads(dissoc_cmd("cleanup").stdout)
    assert left.name not in {r["name"] for r in again["removed"]}
