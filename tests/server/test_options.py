"""``ServerOptions``: the options a ``Server`` is built from. Its defaults are the ones ``Server`` always had,
each check refuses a bad value before anything is built (naming the option), ``Server(d, options)`` and
``Server(d, **fields)`` build the same server, an unknown keyword is refused by name, and ``dissoc serve``
fills it from its flags, the environment and its configuration file in that order."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from helpers.e2e import sample_table, within

import dissoc
from dissoc.cli import _parser, _subparser, parse_args
from dissoc.client import fetch_async
from dissoc.config import OPTION_KEY
from dissoc.errors import DissocError
from dissoc.server import Server, ServerOptions
from dissoc.server.combined import CombinedServer
from dissoc.server.data import DataServer
from dissoc.server.metadata import MetadataServer
from dissoc.tokens import Secret, TokenError
from dissoc.transport import Keepalive

pytestmark = pytest.mark.timeout(60)

#: ``Server.__init__``'s keyword defaults before it took a ServerOptions (the public API it keeps).
OLD_DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 0,
    "transport": "tcp",
    "split": False,
    "data_port": 0,
    "want_data": 0x57414E54,
    "free_data": None,
    "compression": None,
    "body": "packed",
    "memory": None,
    "arena_bytes": 1 << 30,
    "resident": True,
    "max_connections": "auto",
    "max_connections_per_peer": 64,
    "want_data_timeout": 10.0,
    "idle_timeout": 300.0,
    "keepalive": Keepalive(idle=30.0, interval=10.0, count=3, user_timeout=60.0),
    "max_ticket_bytes": 64 << 10,
    "max_free_data_bytes": 8 << 20,
    "max_receiving_bytes": 1 << 30,
    "max_unfreed_bytes": None,
    "tls_cert": None,
    "tls_key": None,
    "tls_client_ca": None,
    "tls_handshake_timeout": 10.0,
    "secret": None,
    "private_memory": False,
    "role": "all",
    "advertise_uri": None,
    "advertise_data_uri": None,
}

#: ``dissoc serve``'s options that are the command line's own, not the server's.
CLI_ONLY = {
    "paths",
    "per_file",
    "live",
    "live_max_batches",
    "live_max_mib",
    "live_on_full",
    "config",
    "log_format",
    "log_level",
    "device",
    "flight",
    "flight_read_only",
    "flight_max_put_mib",
    "metrics",
    "metrics_host",
    "secret_file",
}

URI = "tcp://10.0.0.1:9000?want_data=1"


def test_defaults_are_the_old_keyword_defaults() -> None:
    options = ServerOptions()
    got = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    assert got.pop("transport_options") == {}
    assert got == OLD_DEFAULTS


def test_it_is_frozen_and_exported() -> None:
    assert dissoc.ServerOptions is ServerOptions
    with pytest.raises(dataclasses.FrozenInstanceError):
        ServerOptions().port = 1  # type: ignore[misc]
    assert list(inspect.signature(Server).parameters) == ["datasets", "options", "overrides"]


CHECKS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"role": "both"}, DissocError, "role must be one of all, metadata, data, none"),
    ({"role": "data"}, DissocError, "needs split=True"),
    ({"advertise_uri": "nonsense"}, DissocError, "advertise_uri: "),
    ({"split": True, "role": "metadata"}, DissocError, "role='metadata' needs advertise_data_uri"),
    ({"role": "none", "advertise_uri": URI}, DissocError, "role='none'.*needs advertise_uri and"),
    ({"port": 70000}, DissocError, "port must be 0 .any free port. to 65535, got 70000"),
    ({"split": True, "data_port": -1}, DissocError, "data_port must be 0"),
    ({"port": True}, DissocError, "port must be 0"),
    ({"secret": b"short"}, TokenError, "a secret needs at least 16 bytes"),
    ({"body": "bytes"}, DissocError, "body must be 'packed' or 'pairs', got 'bytes'"),
    ({"body": "pairs", "memory": "ucx"}, DissocError, "memory='ucx' .* needs transport='ucx'"),
    ({"body": "pairs", "compression": "lz4"}, DissocError, "compression applies to packed bodies"),
    ({"memory": "shm"}, DissocError, "memory='shm' needs body='pairs'"),
    ({"private_memory": True}, DissocError, "private_memory .* needs body='pairs'"),
    ({"want_data_timeout": 0}, DissocError, "want_data_timeout must be > 0 .or None., got 0"),
    ({"idle_timeout": -1.0}, DissocError, "idle_timeout must be > 0"),
    ({"max_ticket_bytes": -1}, DissocError, "max_ticket_bytes and max_free_data_bytes must be >= 0"),
    ({"tls_key": "key.pem"}, DissocError, "tls_key and tls_client_ca .* need tls_cert"),
    ({"transport": "tls"}, DissocError, "transport='tls' needs tls_cert and tls_key"),
    (
        {"tls_cert": "c.pem", "transport": "inproc"},
        DissocError,
        "TLS .* is for the tcp transport, not 'inproc'",
    ),
    ({"tls_cert": "c.pem", "tls_handshake_timeout": 0}, DissocError, "tls_handshake_timeout must be > 0"),
    ({"transport_options": {"bogus": 1}}, TypeError, "unknown server option 'bogus'"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), CHECKS, ids=[str(c[0]) for c in CHECKS])
def test_each_check_refuses_with_a_clear_error(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ServerOptions(**kwargs)
    with pytest.raises(error, match=match):
        Server({}, **kwargs)  # the same check, before anything is built
    with pytest.raises(error, match=match):
        Server({}, ServerOptions(), **kwargs)


def test_the_checks_let_good_values_through() -> None:
    ServerOptions(split=True, role="metadata", advertise_data_uri=URI)
    ServerOptions(role="none", advertise_uri=URI, advertise_data_uri=URI)
    ServerOptions(body="pairs", memory="ucx", transport="ucx", private_memory=True)
    ServerOptions(want_data_timeout=None, idle_timeout=None, tls_handshake_timeout=None, max_connections=None)
    assert isinstance(ServerOptions(secret=b"s" * 16).secret, Secret)  # held as a Secret: no key in its repr


async def test_options_and_keywords_build_the_same_server() -> None:
    fields: dict[str, Any] = {
        "split": True,
        "body": "pairs",
        "arena_bytes": 1 << 20,
        "want_data_timeout": 5.0,
    }
    by_options = Server({"t": sample_table(batches=2)}, ServerOptions(**fields))
    by_keywords = Server({"t": sample_table(batches=2)}, **fields)
    mixed = Server(
        {"t": sample_table(batches=2)}, ServerOptions(split=True, body="pairs"), arena_bytes=1 << 20
    )
    try:
        assert (
            by_options.options
            == by_keywords.options
            == dataclasses.replace(mixed.options, want_data_timeout=5.0)
        )
        for server in (by_options, by_keywords):
            assert [type(s) for s in server._servers] == [MetadataServer, DataServer]
            assert server.arena is not None and server.arena.capacity == 1 << 20
            assert server._servers[0].options.want_data_timeout == 5.0
    finally:
        for server in (by_options, by_keywords, mixed):
            await server.close()


async def test_a_server_built_from_options_serves() -> None:
    table = sample_table(batches=2)
    async with Server({"t": table}, ServerOptions(body="pairs", arena_bytes=4 << 20)) as server:
        assert [type(s) for s in server._servers] == [CombinedServer]
        got = await within(30, fetch_async(server.uri, "t"), "the fetch")
    assert got.equals(table)


def test_overrides_apply_over_the_options_and_leave_them_unchanged() -> None:
    base = ServerOptions(split=True, body="pairs", arena_bytes=1 << 20)
    assert ServerOptions.resolve(base, {"body": "packed"}) == dataclasses.replace(base, body="packed")
    assert base.body == "pairs"
    assert ServerOptions.resolve(None, {}) == ServerOptions()
    assert ServerOptions.resolve(base, {}) is base


def test_an_unknown_keyword_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"unknown server option 'splt' \(did you mean 'split'\?\)"):
        Server({}, splt=True)
    with pytest.raises(TypeError, match=r"unknown server option 'bogus'.*the 'tcp' transport's serve"):
        Server({}, bogus=1)
    with pytest.raises(TypeError, match="options must be a ServerOptions, got dict"):
        Server({}, {"split": True})  # type: ignore[arg-type]


def test_a_keyword_the_transport_takes_is_a_transport_option() -> None:
    options = ServerOptions.resolve(None, {"sndbuf": 1 << 20, "transport_options": {"backlog": 8}})
    assert options.transport_options == {"backlog": 8, "sndbuf": 1 << 20}
    assert ServerOptions.resolve(None, {"transport": "inproc", "to_client": None}).transport_options == {
        "to_client": None
    }
    with pytest.raises(TypeError, match=r"'to_client'.*the 'tcp' transport's serve"):
        ServerOptions.resolve(None, {"to_client": None})  # mem's fault injection, not tcp's
    with pytest.raises(TypeError):
        ServerOptions().transport_options["sndbuf"] = 1  # type: ignore[index]


# ------------------------------------------------------------------------------------ from dissoc serve


def serve_options(
    tmp_path: Path, *argv: str, env: dict[str, str] | None = None, file: str | None = None
) -> ServerOptions:
    args = ["serve", "x.arrow", *argv]
    if file is not None:
        (tmp_path / "dissoc.toml").write_text(file)
        args += ["--config", str(tmp_path / "dissoc.toml")]
    namespace, _ = parse_args(args, environ=env or {})
    return ServerOptions.from_args(namespace)


def test_the_command_lines_defaults_are_the_servers(tmp_path: Path) -> None:
    assert serve_options(tmp_path) == ServerOptions()


def test_flags_environment_and_file_fill_the_options_in_that_order(tmp_path: Path) -> None:
    file = (
        'port = 7001\nhost = "0.0.0.0"\narena-mib = 8\nbody = "pairs"\nmax_receiving_mib = 0\nsplit = true\n'
    )
    env = {"DISSOC_PORT": "7002", "DISSOC_HOST": "10.0.0.2", "DISSOC_MAX_UNFREED_MIB": "2"}
    options = serve_options(tmp_path, "--port", "7003", "--no-resident", env=env, file=file)
    assert options.port == 7003  # the flag over the environment over the file
    assert options.host == "10.0.0.2"  # the environment over the file
    assert (options.body, options.split) == ("pairs", True)  # the file
    assert options.arena_bytes == 8 << 20  # MiB on the command line, bytes in the options
    assert options.max_receiving_bytes is None  # 0: no limit
    assert options.max_unfreed_bytes == 2 << 20
    assert options.resident is False
    assert options == dataclasses.replace(
        ServerOptions(),
        port=7003,
        host="10.0.0.2",
        body="pairs",
        split=True,
        arena_bytes=8 << 20,
        max_receiving_bytes=None,
        max_unfreed_bytes=2 << 20,
        resident=False,
    )


def test_the_command_line_values_are_checked_as_the_servers(tmp_path: Path) -> None:
    with pytest.raises(DissocError, match="role='data' runs one half of a split server"):
        serve_options(tmp_path, env={"DISSOC_ROLE": "data"})
    secret = Secret(b"k" * 32)
    assert ServerOptions.from_args(parse_args(["serve", "x"], environ={})[0], secret=secret).secret is secret


def test_every_serve_flag_fills_a_field_or_is_the_command_lines_own() -> None:
    """The way from a flag to the server is the field it fills: a new server flag named like no field (nor
    pointed at by one's metadata) would be dropped on the way."""
    dests = {a.dest for a in _subparser(_parser(), "serve")._actions if a.dest != "help"}
    filled = {f.metadata.get(OPTION_KEY, (f.name,))[0] for f in dataclasses.fields(ServerOptions)}
    assert dests - filled == CLI_ONLY
    assert filled - dests == {"want_data", "free_data", "secret", "transport_options"}  # not flags


async def test_serve_with_flight_takes_server_options() -> None:
    pytest.importorskip("pyarrow.flight")
    from dissoc.flight import serve_with_flight

    table = pa.table({"x": [1, 2, 3]})
    async with serve_with_flight({"t": table}, ServerOptions(split=True), read_only=True) as plane:
        assert plane.server.options.split and plane.server.uri != plane.server.data_uri
