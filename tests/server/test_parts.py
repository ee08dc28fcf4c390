"""A directory served per file (``FileSystemDataset(per_file=True)``): the server serves each file under
``NAME/PATH`` too, and removes or replaces the parts with the directory; a Flight control plane lists the
parts as the directory's endpoints, in order, and the client reads them back as the whole directory."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pyarrow as pa
import pytest

from dissoc.client import ClientOptions, fetch_async
from dissoc.datasets import Dataset, DatasetError, FileSystemDataset
from dissoc.server import Server
from dissoc.tokens import Secret, peek

pytestmark = pytest.mark.timeout(60)

PARTS = ["logs/day=1/a.jsonl", "logs/day=1/b.jsonl", "logs/day=2/a.jsonl"]


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    root = tmp_path / "logs"
    for i, part in enumerate(PARTS):
        path = tmp_path / part
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f'{{"n": {i * 10 + j}, "msg": "m{j}"}}\n' for j in range(i + 1)))
    return root


def whole(ds: Dataset) -> pa.Table:
    return pa.Table.from_batches(list(ds.open()), schema=ds.schema)


def test_the_server_serves_the_parts_and_removes_them_with_the_directory(logs: Path) -> None:
    server = Server({"logs": FileSystemDataset(logs, per_file=True), "other": pa.table({"x": [1]})})
    assert server.catalog.names() == ["logs", *PARTS, "other"]
    assert whole(server.catalog.get(PARTS[2])).column("day").to_pylist() == [2, 2, 2]
    server.add("logs", FileSystemDataset(logs, per_file=False), replace=True)
    assert server.catalog.names() == ["logs", "other"]
    server.add("logs", FileSystemDataset(logs, per_file=True), replace=True)
    assert server.remove("logs").name == "logs"
    assert server.catalog.names() == ["other"]
    server.add("alias", FileSystemDataset(logs, per_file=True))  # its parts' names would not lie under it
    assert server.catalog.names() == ["other", "alias"]


def test_a_taken_part_name_adds_nothing(logs: Path) -> None:
    server = Server({PARTS[1]: pa.table({"x": [1]})})
    with pytest.raises(DatasetError, match="already served"):
        server.add("logs", FileSystemDataset(logs, per_file=True))
    assert server.catalog.names() == [PARTS[1]]


async def test_flight_lists_one_endpoint_per_file_and_the_client_reads_them_in_order(logs: Path) -> None:
    pytest.importorskip("pyarrow.flight")
    from dissoc.flight import describe, serve_with_flight

    ds = FileSystemDataset(logs, per_file=True)
    async with serve_with_flight({"logs": ds}) as plane:
        info = await asyncio.to_thread(describe, plane.location, "logs")
        assert [ticket for _, _, ticket in info.endpoints] == [p.encode() for p in PARTS]
        assert info.schema.equals(ds.schema)
        single = await asyncio.to_thread(describe, plane.location, PARTS[0])
        assert len(single.endpoints) == 1
        got = await fetch_async(plane.location, "logs")
        assert got.equals(whole(ds))
        assert got.column("n").to_pylist() == [0, 10, 11, 20, 21, 22]


async def test_with_a_secret_the_parts_tickets_are_signed_for_the_parts(logs: Path) -> None:
    pytest.importorskip("pyarrow.flight")
    from dissoc.flight import describe, serve_with_flight

    secret = Secret(b"k" * 32)
    ds = FileSystemDataset(logs, per_file=True)
    async with serve_with_flight({"logs": ds}, secret=secret) as plane:
        token = secret.mint("logs")
        info = await asyncio.to_thread(describe, plane.location, "logs", token=token)
        names = []
        for _, _, ticket in info.endpoints:
            claims = peek(ticket)
            assert claims is not None and claims.scope == "read"
            names.append(claims.name)
        assert names == PARTS
        got = await fetch_async(plane.location, "logs", options=ClientOptions(token=token))
        assert got.equals(whole(ds))
