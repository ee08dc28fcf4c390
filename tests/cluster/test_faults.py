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


class Pair:
    """A server agent on host b and a client agent on host a, over ``transport`` (``tls``: the tcp server
    with certificates for b's address)."""

    def __init__(self, cluster: Cluster, tmp_path: Path, transport: str = "tcp") -> None:
        self.a, self.b, _ = cluster.hosts
        tls_dir = _tls(tmp_path, self.b.addr) if transport == "tls" else None
        self.server = _server(self.b, "tcp" if transport == "tls" else transport, tls_dir=tls_dir)
        self.client = Agent(self.a, "client", "--keepalive", KEEPALIVE)
        #: what a fetch needs besides the URI (the CA, over TLS)
        self.more: dict[str, Any] = {"tls_ca": str(tmp_path / "ca.pem")} if tls_dir else {}

    def fetch(self, ticket: str = "t", timeout: float = 20) -> dict[str, Any]:
        return _fetch(self.client, self.server, ticket, timeout=timeout, **self.more)

    def begin_slow_stream(self) -> None:
        """Start fetching ``slow`` (about 3 s of batches) with the short client time-out; returns once the
        first batch is in."""
        uri = self.server.info["uri"]
        self.client.send(
            {"op": "fetch", "uri": uri, "ticket": "slow", "timeout": CLIENT_TIMEOUT, **self.more}
        )
        assert self.client.read(20) == {"event": "first"}

    def failed_in_time(self) -> dict[str, Any]:
        """The stream's end: a ``TransportError`` within the deadline (a test failure otherwise)."""
        got = self.client.read(FAIL_WITHIN + 5)
        assert not got["ok"] and got["error"] == "TransportError", got
        return got

    def server_reclaimed(self) -> dict[str, Any]:
        """The server's status once it let go of the client's connection and stream (asserted)."""
        status = self.server.status_until(
            lambda s: s["connections"] == 0 and s["streams"] == 0, RECLAIM_WITHIN
        )
        assert status["connections"] == 0 and status["streams"] == 0, status
        return status

    def heal_and_fetch(self, cluster: Cluster) -> None:
        """Take the faults out; the same client fetches whole again from the same server, then both stop."""
        cluster.heal()
        again = self.fetch()
        assert again["ok"] and again["ids_ok"], again
        self.stop()

    def stop(self) -> None:
        self.client.stop()
        self.server.stop()


# ------------------------------------------------------------------------------------- across the link


@pytest.mark.parametrize("transport", ["tcp", "tls", UCX])
def test_streams_cross_hosts_and_reuse_their_connection(
    cluster: Cluster, tmp_path: Path, transport: str
) -> None:
    p = Pair(cluster, tmp_path, transport)
    first = p.fetch()
    assert first["ok"], first
    assert first["rows"] == 64 * 65536 and first["ids_ok"]
    assert first["path"]["transport"] == transport
    if transport == "ucx":  # across hosts: the listener path, over UCX's TCP transport here
        assert any(lane.startswith("tcp") for lane in first["path"]["ucx_transports"]), first["path"]
    second = p.fetch()
    assert second["ok"] and second["ids_ok"], second
    status = p.server.ask({"op": "status"})
    assert status["started"] == 2 and status["connections"] == 1, "the second stream connected anew"
    p.stop()


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
    p = Pair(cluster, tmp_path, transport)
    fds = p.server.ask({"op": "status"})["fds"], p.client.ask({"op": "status"})["fds"]
    p.begin_slow_stream()
    assert p.server.ask({"op": "status"})["streams"] == 1
    cluster.partition(p.a, p.b, one_way=way != "both")
    got = p.failed_in_time()
    assert got["seconds"] < 64 * 0.05 + FAIL_WITHIN  # well before the stream would have ended
    status = p.server_reclaimed()
    # nothing held for the other side on either: no descriptor, no pooled connection
    assert status["fds"] <= fds[0]
    after = p.client.ask({"op": "status"})
    assert after["pooled"] == 0 and after["fds"] <= fds[1], after
    p.heal_and_fetch(cluster)


def test_partition_over_ucx_fails_in_time_and_the_server_reclaims(cluster: Cluster, tmp_path: Path) -> None:
    pytest.importorskip("ucxx", reason="ucxx is not installed (pip install 'dissoc[ucx]')")
    p = Pair(cluster, tmp_path, "ucx")  # (the server's SEND_STALL_TIMEOUT: the keepalive's 3 s)
    p.begin_slow_stream()
    cluster.partition(p.a, p.b)
    p.failed_in_time()
    p.server_reclaimed()  # its sends to the client stalled: the connection failed, the stream with it
    p.heal_and_fetch(cluster)


# ------------------------------------------------------------------------ resets, vanished peers, restarts


@pytest.mark.parametrize("transport", ["tcp", "tls", UCX])
def test_reset_mid_stream(cluster: Cluster, tmp_path: Path, transport: str) -> None:
    p = Pair(cluster, tmp_path, transport)
    port = int(p.server.info["uri"].split(":")[2].split("?")[0])
    p.begin_slow_stream()
    # (UCX's data moves on connections of its own, not the listener's port: every port is reset)
    cluster.reset(p.b, None if transport == "ucx" else port)
    p.failed_in_time()
    if transport != "ucx":
        p.server_reclaimed()
    p.heal_and_fetch(cluster)


@pytest.mark.parametrize("transport", ["tcp", "tls", UCX])
def test_a_server_that_vanishes_mid_stream(cluster: Cluster, tmp_path: Path, transport: str) -> None:
    p = Pair(cluster, tmp_path, transport)
    p.begin_slow_stream()
    cluster.vanish(p.b)  # no FIN, no reset: the host is gone
    p.failed_in_time()
    assert p.client.ask({"op": "status"})["pooled"] == 0  # nothing kept for a peer that left
    p.client.stop()


def test_a_client_that_vanishes_mid_stream_is_let_go(cluster: Cluster, tmp_path: Path) -> None:
    p = Pair(cluster, tmp_path)
    p.client.send({"op": "fetch", "uri": p.server.info["uri"], "ticket": "slow", "timeout": 30})
    assert p.client.read(20) == {"event": "first"}
    cluster.vanish(p.a)
    p.server_reclaimed()
    p.server.stop()


@pytest.mark.parametrize("transport", ["tcp", "tls", UCX])
def test_a_restarted_server_serves_clients_holding_pooled_connections(
    cluster: Cluster, tmp_path: Path, transport: str
) -> None:
    p = Pair(cluster, tmp_path, transport)
    assert p.fetch()["ok"]
    assert p.client.ask({"op": "status"})["pooled"] == 1
    port = p.server.info["uri"].split(":")[2].split("?")[0]
    p.server.proc.send_signal(signal.SIGKILL)  # no goodbye: the pooled connection is dead
    p.server.proc.wait(timeout=10)
    tls_dir = tmp_path if transport == "tls" else None
    p.server = _server(p.b, "tcp" if transport == "tls" else transport, "--port", port, tls_dir=tls_dir)
    assert p.server.info["uri"].split(":")[2].split("?")[0] == port
    got = p.fetch()
    assert got["ok"] and got["ids_ok"], got
    status = p.server.ask({"op": "status"})
    assert status["started"] == 1 and status["connections"] == 1
    p.stop()
