"""TCP keepalive: how a connection notices a peer gone without a word (set on both ends by default).

The behaviour across a real link -- a partition, a vanished host -- is tested in ``tests/cluster/``; these
check the socket options each end sets, the option's checks, and its spelling on the command line.
"""

from __future__ import annotations

import argparse
import socket
from typing import Any

import pytest
from helpers.transport import tcp_pair

from dissoc.session.connect import pool_key
from dissoc.session.options import ClientOptions
from dissoc.transport import DEFAULT_KEEPALIVE, Keepalive
from dissoc.transport.tcp import format_keepalive, parse_keepalive
from dissoc.uri import DissocURI

pytestmark = pytest.mark.timeout(30)


def _options(conn: Any) -> dict[str, int]:
    sock: socket.socket = conn._sock
    read = {
        "keepalive": (socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        "idle": (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        "interval": (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
        "count": (socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
        "user_timeout_ms": (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
    }
    return {name: sock.getsockopt(level, option) for name, (level, option) in read.items()}


async def test_both_ends_probe_by_default() -> None:
    async with tcp_pair() as (client, server):
        expected = {"keepalive": 1, "idle": 30, "interval": 10, "count": 3, "user_timeout_ms": 60_000}
        assert _options(client) == expected
        assert _options(server) == expected


async def test_each_end_takes_its_own_settings_or_none() -> None:
    short = Keepalive(idle=2, interval=1, count=4, user_timeout=5.5)
    async with tcp_pair({"keepalive": short}, {"keepalive": None}) as (client, server):
        assert _options(client) == {
            "keepalive": 1,
            "idle": 2,
            "interval": 1,
            "count": 4,
            "user_timeout_ms": 5500,
        }
        assert _options(server)["keepalive"] == 0 and _options(server)["user_timeout_ms"] == 0
    no_user = Keepalive(user_timeout=None)
    async with tcp_pair({"keepalive": no_user}) as (client, _):
        assert _options(client)["keepalive"] == 1 and _options(client)["user_timeout_ms"] == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"idle": 0}, "idle: expected 1 to 32767 seconds"),
        ({"interval": 40000}, "interval: expected 1 to 32767"),
        ({"interval": True}, "interval"),
        ({"count": 0}, "count: expected 1 to 127 probes"),
        ({"count": 2.5}, "count"),
        ({"user_timeout": 0}, "user_timeout: expected seconds > 0 or None"),
        ({"user_timeout": "60"}, "user_timeout"),
    ],
)
def test_bad_settings_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Keepalive(**fields)


def test_the_command_line_spelling_round_trips() -> None:
    assert parse_keepalive("30,10,3,60") == DEFAULT_KEEPALIVE
    assert parse_keepalive(format_keepalive(DEFAULT_KEEPALIVE)) == DEFAULT_KEEPALIVE
    assert parse_keepalive("5,2,4") == Keepalive(5, 2, 4, DEFAULT_KEEPALIVE.user_timeout)
    assert parse_keepalive("5,2,4,none") == Keepalive(5, 2, 4, None)
    assert parse_keepalive("off") is None and format_keepalive(None) == "off"
    for bad in ("30,10", "a,b,c", "30,10,3,60,1", "0,1,1"):
        with pytest.raises(ValueError, match="keepalive"):
            parse_keepalive(bad)


def test_the_flags_of_serve_and_get() -> None:
    from dissoc.cli import _keepalive

    assert _keepalive("off") is None
    with pytest.raises(argparse.ArgumentTypeError, match="IDLE,INTERVAL,COUNT"):
        _keepalive("soon")


def test_connections_with_other_keepalive_settings_are_pooled_apart() -> None:
    uri = DissocURI.parse("tcp://127.0.0.1:9?want_data=1")
    default, short = ClientOptions(), ClientOptions(keepalive=Keepalive(idle=2))
    assert default.keepalive == DEFAULT_KEEPALIVE
    assert pool_key(uri, default) != pool_key(uri, short)
    assert pool_key(uri, short) == pool_key(uri, ClientOptions(keepalive=Keepalive(idle=2)))


def test_a_server_hands_its_keepalive_to_tcp_and_tls_listeners_only() -> None:
    from dissoc.server import Server, ServerOptions

    short = Keepalive(idle=3)
    assert Server({}, ServerOptions(keepalive=short))._listening()[1]["keepalive"] == short
    assert Server({}, ServerOptions(keepalive=None))._listening()[1]["keepalive"] is None
    assert "keepalive" not in Server({}, ServerOptions(transport="ucx"))._listening()[1]
