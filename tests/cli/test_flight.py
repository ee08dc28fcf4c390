"""``dissoc serve --flight PORT``: the JSON ready lines carry ``"flight": "grpc://H:P"``, a pyarrow
FlightClient lists and reads the served files there, dissoc resolves and fetches through it, and SIGTERM still
gives exit 0 with nothing else on stdout."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
from pathlib import Path

import pyarrow as pa
import pytest
from helpers.e2e import PYTHON, REPO, cli_server, ordered_table, sample_table

from dissoc.client import fetch as fetch_via_flight
from dissoc.flight import publish, resolve

flight = pytest.importorskip("pyarrow.flight")

pytestmark = pytest.mark.timeout(60)


#: The served files by ticket: (path, the table it holds).
Files = dict[str, tuple[Path, pa.Table]]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    root = tmp_path_factory.mktemp("cli-flight")
    out = {}
    for name, table in (("trips", sample_table(batches=3)), ("ordered", ordered_table(4, 100))):
        path = root / f"{name}.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table)
        out[name] = (path, table)
    return out


def _stop(proc: subprocess.Popen[bytes]) -> tuple[int, bytes, bytes]:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=15)
    return proc.returncode, out, err


@pytest.mark.parametrize("split", [False, True], ids=["combined", "split"])
def test_serve_with_flight_prints_the_location_and_serves_through_it(files: Files, split: bool) -> None:
    paths = [str(files["trips"][0]), str(files["ordered"][0])]
    with cli_server(*paths, "--flight", "0", *(["--split"] if split else []), count=2) as (proc, lines):
        assert [line["ticket"] for line in lines] == ["trips", "ordered"]
        location = lines[0]["flight"]
        assert location.startswith("grpc://127.0.0.1:") and int(location.rsplit(":", 1)[1]) > 0
        assert all(line["flight"] == location for line in lines)
        assert all(set(line) == {"ticket", "uri", "data_uri", "flight"} for line in lines)

        client = flight.FlightClient(location)
        infos = {bytes(i.descriptor.path[0]).decode(): i for i in client.list_flights()}
        assert sorted(infos) == ["ordered", "trips"]
        for line in lines:
            (endpoint,) = infos[line["ticket"]].endpoints
            assert [loc.uri.decode() for loc in endpoint.locations] == [line["uri"], line["data_uri"]]
            assert resolve(location, line["ticket"]) == [
                (line["uri"], line["data_uri"], line["ticket"].encode())
            ]
            expected = files[line["ticket"]][1]
            assert client.do_get(flight.Ticket(line["ticket"].encode())).read_all().equals(expected)
            assert fetch_via_flight(location, line["ticket"]).equals(expected)
        # published into the running process, then served over dissoc like the files
        assert publish(location, "extra", ordered_table(1, 7)) == 7
        assert fetch_via_flight(location, "extra").num_rows == 7
        client.close()
        status, out, err = _stop(proc)
    assert status == 0, f"exit status {status} on SIGTERM; stderr: {err.decode()[-2000:]}"
    assert out == b"", f"stdout carried more than the JSON lines: {out!r}"
    assert b"Traceback" not in err


def test_serve_without_flight_prints_no_flight_key(files: Files) -> None:
    with cli_server(str(files["ordered"][0]), count=1) as (proc, lines):
        assert "flight" not in lines[0]
        status, _out, _err = _stop(proc)
    assert status == 0


def test_flight_port_in_use_is_exit_1_with_a_message(files: Files) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = subprocess.run(
            [PYTHON, "-m", "dissoc.cli", "serve", "--flight", str(port), str(files["ordered"][0])],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert result.stdout == ""
    assert "Flight" in result.stderr and str(port) in result.stderr
    assert "Traceback" not in result.stderr


def test_flight_port_must_be_an_integer(files: Files) -> None:
    result = subprocess.run(
        [PYTHON, "-m", "dissoc.cli", "serve", "--flight", "x", str(files["ordered"][0])],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "--flight" in result.stderr
    assert result.stdout == ""


def test_get_through_a_flight_location(files: Files, tmp_path: Path) -> None:
    path, table = files["trips"]
    with cli_server(str(path), "--flight", "0", "--split", count=1) as (_proc, lines):
        out = tmp_path / "via-flight.arrow"
        got = subprocess.run(
            [PYTHON, "-m", "dissoc.cli", "get", lines[0]["flight"], "trips", "-o", str(out), "--no-progress"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
        assert got.returncode == 0, got.stderr
        summary = json.loads(got.stdout)
        assert (summary["rows"], summary["batches"]) == (table.num_rows, 3)
        assert pa.ipc.open_file(out).read_all().equals(table)
        refused = subprocess.run(
            [PYTHON, "-m", "dissoc.cli", "get", lines[0]["flight"], "trips", "--data-uri", lines[0]["uri"]],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
        assert refused.returncode == 1 and "data-uri" in refused.stderr and "Traceback" not in refused.stderr
