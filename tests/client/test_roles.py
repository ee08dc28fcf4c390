"""One split server out of several processes, as a compose file runs it: ``--role metadata`` and
``--role data`` serve the two halves (the metadata half hands out the data server's URI), and
``--role none --flight`` is a control plane in front of them; clients fetch through any of them."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from helpers.e2e import cli_server, ordered_table

import dissoc
from dissoc.errors import DissocError, RemoteError
from dissoc.server import Server
from dissoc.server.options import DEFAULT_WANT_DATA

pytestmark = pytest.mark.timeout(90)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, pa.Table]:
    table = ordered_table(6, 5000, pad=3)
    path = tmp_path_factory.mktemp("roles") / "trips.arrows"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return path, table


@contextlib.contextmanager
def three_services(path: Path, *extra: str) -> Iterator[tuple[str, str, str]]:
    """The data half first: its URI (which, with pairs, names its arena) is what the others hand out."""
    meta_port = free_port()
    meta_uri = f"tcp://127.0.0.1:{meta_port}?want_data={DEFAULT_WANT_DATA}"
    with contextlib.ExitStack() as running:
        data, data_lines = running.enter_context(
            cli_server(str(path), "--split", "--role", "data", *extra, count=1)
        )
        data_uri = data_lines[0]["data_uri"]
        assert data_lines[0]["uri"] == data_uri  # a data half alone knows no metadata URI
        meta, meta_lines = running.enter_context(
            cli_server(
                str(path), "--split", "--role", "metadata", "--port", str(meta_port),
                "--advertise-data-uri", data_uri, *extra, count=1,
            )
        )  # fmt: skip
        plane, plane_lines = running.enter_context(
            cli_server(
                str(path), "--role", "none", "--flight", "0", "--flight-read-only",
                "--advertise-uri", meta_uri, "--advertise-data-uri", data_uri, *extra, count=1,
            )
        )  # fmt: skip
        assert (meta_lines[0]["uri"], meta_lines[0]["data_uri"]) == (meta_uri, data_uri)
        assert (plane_lines[0]["uri"], plane_lines[0]["data_uri"]) == (meta_uri, data_uri)
        yield meta_uri, data_uri, plane_lines[0]["flight"]
        for proc in (plane, meta, data):  # stopped, not killed: the data half unlinks its arena
            proc.terminate()
            assert proc.wait(15) == 0


def test_halves_in_separate_processes_make_one_split_server(stored: tuple[Path, pa.Table]) -> None:
    path, table = stored
    with three_services(path) as (meta_uri, data_uri, flight):
        assert dissoc.fetch(meta_uri, "trips", data_uri=data_uri).equals(table)
        assert dissoc.fetch(flight, "trips").equals(table)
        with pytest.raises(RemoteError, match="unknown_ticket"):
            dissoc.fetch(flight, "nope")


@pytest.mark.parametrize(
    "extra", [["--compression", "zstd"], ["--body", "pairs", "--arena-mib", "16"]], ids=["zstd", "pairs"]
)
def test_halves_agree_compressed_and_with_pairs(stored: tuple[Path, pa.Table], extra: list[str]) -> None:
    path, table = stored
    with three_services(path, *extra) as (meta_uri, data_uri, flight):
        assert dissoc.fetch(meta_uri, "trips", data_uri=data_uri).equals(table)
        assert dissoc.fetch(flight, "trips").equals(table)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"role": "metadata"}, "needs split=True"),
        ({"role": "data"}, "needs split=True"),
        ({"role": "metadata", "split": True}, "needs advertise_data_uri"),
        ({"role": "none"}, "needs advertise_uri and advertise_data_uri"),
        ({"role": "both"}, "role must be one of"),
        ({"advertise_uri": "tcp://h:1"}, "advertise_uri: .*want_data"),
    ],
)
def test_role_arguments_are_checked(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(DissocError, match=match):
        Server({}, **kwargs)  # type: ignore[arg-type]
