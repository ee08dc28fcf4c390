"""``dissoc health`` and :mod:`dissoc.health`: a server that serves answers the empty want_data at once
(every role, with and without a secret, TLS, UCX, a Flight plane); a server that is down, silent or speaks
something else is unhealthy within the timeout; the probe costs the server nothing it counts or keeps."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from helpers.e2e import PYTHON, REPO, RawServer, cli_server, sample_table, untagged
from helpers.tls import make_certs

from dissoc.client import ClientOptions, fetch_async
from dissoc.flight import serve_with_flight
from dissoc.health import check
from dissoc.protocol import EMPTY_TICKET
from dissoc.server import Server

pytestmark = pytest.mark.timeout(60)

SECRET = b"health-secret-0123456789abcdef!!"


@pytest.mark.parametrize("split", [False, True], ids=["combined", "split"])
async def test_every_server_answers_the_probe_and_still_serves(split: bool) -> None:
    table = sample_table(batches=2)
    async with Server({"t": table}, split=split, secret=SECRET) as server:
        for uri in {server.uri, server.data_uri}:
            result = await check(uri, timeout=5)
            assert result.healthy, result
            assert result.answer == EMPTY_TICKET and result.error is None
            assert 0 < result.seconds < 5
        # not a refused ticket, and the server still serves
        assert server.unauthorized == 0
        from dissoc.tokens import Secret

        got = await fetch_async(server.uri, Secret(SECRET).mint("t"), data_uri=server.data_uri)
        assert got.equals(table)


async def test_a_uri_without_want_data_means_the_default_tag() -> None:
    async with Server({"t": sample_table(batches=1)}) as server:
        bare = server.uri.split("?")[0]
        result = await check(bare, timeout=5)
        assert result.healthy and result.answer == EMPTY_TICKET, result
    async with Server({"t": sample_table(batches=1)}, want_data=12345) as server:
        result = await check(server.uri.split("?")[0], timeout=1)
        assert not result.healthy  # another tag: the server waits for its own, the probe times out


async def test_nothing_listening_is_unhealthy() -> None:
    async with RawServer() as raw:
        uri = raw.uri()
    result = await check(uri, timeout=2)
    assert not result.healthy and result.answer is None
    assert result.error is not None and "connect" in result.error


async def test_a_silent_server_is_unhealthy_within_the_timeout() -> None:
    async with RawServer(answer=False) as raw:
        started = time.perf_counter()
        result = await check(raw.uri(), timeout=0.5)
        took = time.perf_counter() - started
    assert not result.healthy
    assert result.error == "no answer within 0.5 s"
    assert took < 3


async def test_an_answer_that_is_not_dissociated_ipc_is_unhealthy() -> None:
    async with RawServer(lambda: [untagged(b"\x07garbage")]) as raw:
        result = await check(raw.uri(), timeout=5)
        assert raw.requests and raw.requests[0][1] == b""  # the probe is the empty want_data
    assert not result.healthy
    assert result.error is not None


async def test_tls_server_answers_a_probe_that_trusts_its_ca(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    async with Server(
        {"t": sample_table(batches=1)}, tls_cert=certs.server_cert, tls_key=certs.server_key
    ) as server:
        good = await check(server.uri, timeout=5, options=ClientOptions(tls_ca=str(certs.ca)))
        assert good.healthy and good.answer == EMPTY_TICKET
        bad = await check(server.uri, timeout=5, options=ClientOptions(tls_ca=str(certs.other_ca)))
        assert not bad.healthy


async def test_flight_plane_answers_with_and_without_a_token() -> None:
    from dissoc.tokens import Secret

    async with serve_with_flight({"t": sample_table(batches=1)}, secret=SECRET) as plane:
        location = plane.location
        result = await check(location, timeout=10)
        # refusing an unauthenticated call is an answer: the plane serves
        assert result.healthy, result
        assert result.answer == "unauthenticated"
        token = Secret(SECRET).mint("*")
        result = await check(location, timeout=10, options=ClientOptions(token=token))
        assert result.healthy and result.answer == "ListActions"
    result = await check(location, timeout=2)
    assert not result.healthy


@pytest.mark.ucx
async def test_ucx_server_answers_the_probe() -> None:
    async with Server({"t": sample_table(batches=1)}, transport="ucx", split=True) as server:
        for uri in (server.uri, server.data_uri):
            result = await check(uri, timeout=10)
            assert result.healthy and result.answer == EMPTY_TICKET, result


def test_the_command_exits_0_for_a_serving_server_and_1_for_a_stopped_one(tmp_path: Path) -> None:
    import pyarrow as pa

    path = tmp_path / "t.arrow"
    table = sample_table(batches=1)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)

    def health(uri: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [PYTHON, "-m", "dissoc.cli", "health", uri, "--timeout", "5"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )

    with cli_server(str(path), "--split", "--flight", "0", count=1) as (proc, lines):
        line = lines[0]
        for uri in (line["uri"], line["data_uri"], line["flight"]):
            result = health(uri)
            assert result.returncode == 0, result.stderr
            report = json.loads(result.stdout)
            assert report["healthy"] is True and report["uri"] == uri
        proc.terminate()
        proc.wait(15)
    result = health(line["uri"])
    assert result.returncode == 1
    assert json.loads(result.stdout)["healthy"] is False
    assert "Traceback" not in result.stderr
