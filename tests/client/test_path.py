"""The path a fetch's bytes took, as ``FetchStats`` reports it (``path``, ``paths``): the metadata and data
transports, the body kind and the memory pairs point into, against real servers over TCP. The UCX lanes are
in ``client/test_ucx.py``, device landing in ``device/test_e2e.py``, ``dissoc get``'s JSON in ``cli/``."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pytest
from helpers.e2e import ServerThread, sample_table

import dissoc.client
from dissoc.client import ClientOptions, FetchPath, FetchStats, open_stream, stream_batches
from dissoc.server import Server

pytestmark = pytest.mark.timeout(60)

TABLE = sample_table()


@pytest.mark.parametrize(
    ("server", "path"),
    [
        pytest.param({}, FetchPath("tcp", "tcp", (), "packed"), id="packed"),
        pytest.param({"split": True}, FetchPath("tcp", "tcp", (), "packed"), id="packed-split"),
        pytest.param(
            {"body": "pairs", "memory": "shm"},
            FetchPath("tcp", "tcp", (), "pairs", "shm", "shared"),
            id="shm-pairs",
        ),
        pytest.param(
            {"body": "pairs", "memory": "shm", "private_memory": True},
            FetchPath("tcp", "tcp", (), "pairs", "shm", "private"),
            id="shm-pairs-private",
        ),
    ],
)
async def test_a_host_fetch_reports_its_path(server: dict[str, Any], path: FetchPath) -> None:
    async with Server({"t": TABLE}, arena_bytes=8 << 20, **server) as srv:
        stats = FetchStats()
        options = ClientOptions(timeout=20)
        got = [
            b async for b in stream_batches(srv.uri, "t", data_uri=srv.data_uri, options=options, stats=stats)
        ]
    assert pa.Table.from_batches(got).equals(TABLE)
    assert stats.paths == [path]
    assert stats.path is stats.paths[0]
    assert not path.host_copy
    # what dissoc get prints: plain JSON values, tuples as lists
    shown = json.loads(json.dumps(path.as_dict()))
    assert shown == {
        "transport": "tcp",
        "data_transport": "tcp",
        "ucx_transports": [],
        "bodies": path.bodies,
        "memory": path.memory,
        "arena": path.arena,
        "device_landing": [],
    }


def test_the_synchronous_reader_reports_the_path_when_the_stream_ends() -> None:
    with (
        ServerThread({"t": TABLE}, body="pairs", memory="shm", arena_bytes=8 << 20) as srv,
        open_stream(srv.uri, "t", data_uri=srv.data_uri, options=ClientOptions(timeout=10)) as reader,
    ):
        assert reader.stats.path is None  # filled in when the stream ends, as the counts are
        got = reader.read_all()
    assert got.equals(TABLE)
    assert reader.stats.paths == [FetchPath("tcp", "tcp", (), "pairs", "shm", "shared")]
    assert reader.stats.rows == TABLE.num_rows


async def test_every_stream_of_a_fetch_reports_its_own_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # A Flight location lists several endpoints, read one after the other: each one's path, in order.
    async with (
        Server({"t": TABLE}) as packed,
        Server({"t": TABLE}, body="pairs", memory="shm", arena_bytes=8 << 20) as pairs,
    ):
        endpoints = [(packed.uri, None, "t"), (pairs.uri, pairs.data_uri, "t")]

        async def resolve(*args: Any, **kwargs: Any) -> tuple[list[Any], pa.Schema]:
            return endpoints, TABLE.schema

        monkeypatch.setattr(dissoc.client, "resolve_endpoints", resolve)
        stats = FetchStats()
        got = [b async for b in stream_batches("grpc://flight", "t", stats=stats)]
    assert len(got) == 2 * len(TABLE.to_batches())
    assert stats.paths == [
        FetchPath("tcp", "tcp", (), "packed"),
        FetchPath("tcp", "tcp", (), "pairs", "shm", "shared"),
    ]
    assert stats.path == stats.paths[0]
    assert stats.rows == 2 * TABLE.num_rows
