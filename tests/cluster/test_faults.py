"""Streams between hosts of a cluster of network namespaces, through real faults on the link between them.

Each test runs a server agent in one host and a client agent in another (:mod:`cluster.agent`), and states
what a user gets: the stream completes identical, or fails with ``TransportError`` within a stated deadline
-- never a hang -- and the server lets go of the client's connection and stream within its keepalive bounds.
Short keepalive and client time-outs keep the tests quick; the defaults, sized for a real network, are in
the limits table (docs/reference/limits.md).
"""

from __future__ import annotations

import importlib.util
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from cluster.conftest import Agent
from cluster.netns import Cluster

pytestmark = pytest.mark.netns

#: Keepalive of both sides in these tests: probes after 1 s idle, every 1 s, 2 unanswered end the connection;
#: data unacknowledged for 3 s ends it too.
KEEPALIVE = "1,1,2,3"
#: The client's time-out: its longest wait for data while a stream is incomplete.
CLIENT_TIMEOUT = 3.0
#: How long a stream may take to fail once the link broke: the client's time-out (or the keepalive's user
#: time-out), plus slack for a loaded machine.
FAIL_WITHIN = CLIENT_TIMEOUT + 4.0
#: How long the server may hold a broken connection: the keepalive's bounds (3 s unacknowledged, or 1 + 2 x 1
#: s of probes), plus slack.
RECLAIM_WITHIN = 10.0

UCX = pytest.param(
    "ucx",
    marks=pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed"),
)


def _server(host: Any, transport: str = "tcp", *args: str, tls_dir: Path | None = None) -> Agent:
    extra = ["--tls-dir", str(tls_dir)] if tls_dir is not None else []
    return Agent(
        host,
        "server",
        "--transport",
        transport,
        "--host",
        host.addr,
        "--keepalive",
        KEEPALIVE,
        *extra,
        *args,
    )


def _fetch(client: Agent, server: Agent, ticket: str = "t", **more: Any) -> dict[str, Any]:
    return client.ask({"op": "fetch", "uri": server.info["uri"], "ticket": ticket, **more})


def _tls(tmp_path: Path, server_addr: str) -> Path:
    from helpers.tls import make_certs

    make_certs(tmp_path, ips=(server_addr,))
    return tmp_path


# ------------------------------------------------------------------------------------- across the link


@pytest.mark.parametrize("transport", ["tcp", "tls", UCX])
def test_streams_cross_hosts_and_reuse_their_connection(
    cluster: Cluster, tmp_path: Path, transport: str
) -> None:
    a, b, _ = cluster.hosts
    tls_dir = _tls(tmp_path, b.addr) if transport == "tls" else None
    server = _server(b, "tcp" if transport == "tls" else transport, tls_dir=tls_dir)
    client = Agent(a, "client", "--keepalive", KEEPALIVE)
    more = {"tls_ca": str(tmp_path / "ca.pem")} if tls_dir else {}
    first = _fetch(client, server, timeout=20, **more)
    assert first["ok"], first
    assert first["rows"] == 64 * 65536 and first["ids_ok"]
    assert first["path"]["transport"] == transport
    if transport == "ucx":  # across hosts: the listener path, over UCX's TCP transport here
        assert any(lane.startswith("tcp") for lane in first["path"]["ucx_transports"]), first["path"]
    second = _fetch(client, server, timeout=20, **more)
    assert second["ok"] and second["ids_ok"], second
    status = server.ask({"op": "status"})
    assert status["started"] == 2 and status["connections"] == 1, "the second stream connected anew"
    server.stop()
    client.stop()


def test_capped_and_lossy_link_completes_identical(cluster: Cluster) -> None:
    a, b, _ = cluster.hosts
    cluster.shape("200mbit", loss_percent=3, hosts=[a, b])
    server = _server(b)
    client = Agent(a, "client", "--keepalive", "5,2,5,30")
    started = time.monotonic()
    got = _fetch(client, server, timeout=30)
    assert got["ok"], got
    assert got["rows"] == 64 * 65536 and got["ids_ok"]
    # 32 MiB through a 200 Mbit/s link losing 3% of its packets: slower than the cap alone, but it goes on
    assert time.monotonic() - started < 60
    cluster.heal()
    server.stop()
    client.stop()


# ------------------------------------------------------------------------------------------- partitions


@pytest.mark.parametrize("way", ["both", "client-to-server"])
@pytest.mark.parametrize("transport", ["tcp", "tls"])
def test_partition_mid_stream_fails_in_time_and_the_server_reclaims(
    cluster: Cluster, tmp_path: Path, transport: str, way: str
) -> None:
    a, b, _ = cluster.hosts
    tls_dir = _tls(tmp_path, b.addr) if transport == "tls" else None
    server = _server(b, tls_dir=tls_dir)
    client = Agent(a, "client", "--keepalive", KEEPALIVE)
    more = {"tls_ca": str(tmp_path / "ca.pem")} if tls_dir else {}
    uri = server.info["uri"]
    fds = server.ask({"op": "status"})["fds"], client.ask({"op": "status"})["fds"]
    client.send({"op": "fetch", "uri": uri, "ticket": "slow", "timeout": CLIENT_TIMEOUT, **more})
    assert client.read(20) == {"event": "first"}
    assert server.ask({"op": "status"})["streams"] == 1
    cluster.partition(a, b, one_way=way != "both")
    got = client.read(FAIL_WITHIN + 5)
    assert not got["ok"] and got["error"] == "TransportError", got
    assert got["seconds"] < 64 * 0.05 + FAIL_WITHIN  # well before the stream would have ended
    status = server.status_until(lambda s: s["connections"] == 0 and s["streams"] == 0, RECLAIM_WITHIN)
    assert status["connections"] == 0 and status["streams"] == 0, status
    # nothing held for the other side on either: no descriptor, no pooled connection
    assert status["fds"] <= fds[0]
    after = client.ask({"op": "status"})
    assert after["pooled"] == 0 and after["fds"] <= fds[1], after
    cluster.heal()
    again = _fetch(client, server, timeout=20, **more)
    assert again["ok"] and again["ids_ok"], again
    server.stop()
    client.stop()


def test_partition_over_ucx_fails_in_time(cluster: Cluster) -> None:
    pytest.importorskip("ucxx", reason="ucxx is not installed (pip install 'dissoc[ucx]')")
    a, b, _ = cluster.hosts
    server = _server(b, "ucx")
    client = Agent(a, "client", "--keepalive", KEEPALIVE)
    client.send({"op": "fetch", "uri": server.info["uri"], "ticket": "slow", "timeout": CLIENT_TIMEOUT})
    assert client.read(20) == {"event": "first"}
    cluster.partition(a, b)
    got = client.read(FAIL_WITHIN + 5)
    assert not got["ok"] and got["error"] == "TransportError", got
    cluster.heal()
    again = _fetch(client, server, timeout=20)
    assert again["ok"] and again["ids_ok"], again
    client.stop()
    server.stop()


# ------------------------------------------------------------------------ resets, vanished peers, restarts


@pytest.mark.parametrize("transport", ["tcp", "tls", UCX])
def test_reset_mid_stream(cluster: Cluster, tmp_path: Path, transport: str) -> None:
    a, b, _ = cluster.hosts
    tls_dir = _tls(tmp_path, b.addr) if transport == "tls" else None
    server = _server(b, "tcp" if transport == "tls" else transport, tls_dir=tls_dir)
    client = Agent(a, "client", "--keepalive", KEEPALIVE)
    more = {"tls_ca": str(tmp_path / "ca.pem")} if tls_dir else {}
    port = int(server.info["uri"].split(":")[2].split("?")[0])
    uri = server.info["uri"]
    client.send({"op": "fetch", "uri": uri, "ticket": "slow", "timeout": CLIENT_TIMEOUT, **more})
    assert client.read(20) == {"event": "first"}
    # (UCX's data moves on connections of its own, not the listener's port: every port is reset)
    cluster.reset(b, None if transport == "ucx" else port)
    got = client.read(FAIL_WITHIN + 5)
    assert not got["ok"] and got["error"] == "TransportError", got
    if transport != "ucx":
        status = server.status_until(lambda s: s["connections"] == 0 and s["streams"] == 0, RECLAIM_WITHIN)
        assert status["connections"] == 0 and status["streams"] == 0, status
    cluster.heal()
    again = _fetch(client, server, timeout=20, **more)
    assert again["ok"] and again["ids_ok"], again
    server.stop()
    client.stop()


@pytest.mark.parametrize("transport", ["tcp", "tls", UCX])
def test_a_server_that_vanishes_mid_stream(cluster: Cluster, tmp_path: Path, transport: str) -> None:
    a, b, _ = cluster.hosts
    tls_dir = _tls(tmp_path, b.addr) if transport == "tls" else None
    server = _server(b, "tcp" if transport == "tls" else transport, tls_dir=tls_dir)
    client = Agent(a, "client", "--keepalive", KEEPALIVE)
    more = {"tls_ca": str(tmp_path / "ca.pem")} if tls_dir else {}
    uri = server.info["uri"]
    client.send({"op": "fetch", "uri": uri, "ticket": "slow", "timeout": CLIENT_TIMEOUT, **more})
    assert client.read(20) == {"event": "first"}
    cluster.vanish(b)  # no FIN, no reset: the host is gone
    got = client.read(FAIL_WITHIN + 5)
    assert not got["ok"] and got["error"] == "TransportError", got
    assert client.ask({"op": "status"})["pooled"] == 0  # nothing kept for a peer that left
    client.stop()


def test_a_client_that_vanishes_mid_stream_is_let_go(cluster: Cluster) -> None:
    a, b, _ = cluster.hosts
    server = _server(b)
    client = Agent(a, "client", "--keepalive", KEEPALIVE)
    client.send({"op": "fetch", "uri": server.info["uri"], "ticket": "slow", "timeout": 30})
    assert client.read(20) == {"event": "first"}
    cluster.vanish(a)
    status = server.status_until(lambda s: s["connections"] == 0 and s["streams"] == 0, RECLAIM_WITHIN)
    assert status["connections"] == 0 and status["streams"] == 0, status
    server.stop()


@pytest.mark.parametrize("transport", ["tcp", "tls", UCX])
def test_a_restarted_server_serves_clients_holding_pooled_connections(
    cluster: Cluster, tmp_path: Path, transport: str
) -> None:
    a, b, _ = cluster.hosts
    tls_dir = _tls(tmp_path, b.addr) if transport == "tls" else None
    scheme = "tcp" if transport == "tls" else transport
    server = _server(b, scheme, tls_dir=tls_dir)
    client = Agent(a, "client", "--keepalive", KEEPALIVE)
    more = {"tls_ca": str(tmp_path / "ca.pem")} if tls_dir else {}
    assert _fetch(client, server, timeout=20, **more)["ok"]
    assert client.ask({"op": "status"})["pooled"] == 1
    port = server.info["uri"].split(":")[2].split("?")[0]
    server.proc.send_signal(signal.SIGKILL)  # no goodbye: the pooled connection is dead
    server.proc.wait(timeout=10)
    restarted = _server(b, scheme, "--port", port, tls_dir=tls_dir)
    assert restarted.info["uri"].split(":")[2].split("?")[0] == port
    got = _fetch(client, restarted, timeout=20, **more)
    assert got["ok"] and got["ids_ok"], got
    status = restarted.ask({"op": "status"})
    assert status["started"] == 1 and status["connections"] == 1
    restarted.stop()
    client.stop()
