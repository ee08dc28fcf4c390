"""TLS over TCP (``tls://``, :mod:`dissoc.transport.tls`) with certificates made for the test: fetches over
TLS (combined and split, packed and pairs), mutual TLS and the client subject the server sees, refusals (no
client certificate, an untrusted CA, the wrong host name, the system's roots), plaintext/TLS mismatches that
fail at once with a clear TransportError, the handshake timeout, flow control inside TLS, and the command
line (``dissoc serve --tls-cert``, ``dissoc get --tls-ca``)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from helpers.e2e import PYTHON, REPO, cli_server, eventually, ordered_table, sample_table, within
from helpers.tls import CLIENT_IDENTITY, Certs, make_certs

import dissoc
from dissoc.client import ClientOptions, fetch_async
from dissoc.errors import DissocError, ProtocolError, TransportError
from dissoc.transport import Connection, connect_tcp, serve_tcp
from dissoc.transport.tls import (
    TlsConnection,
    TlsListener,
    _writes,
    client_context,
    connect_tls,
    format_subject,
    serve_tls,
    server_context,
)
from dissoc.uri import DissocURI

pytestmark = pytest.mark.timeout(60)

#: What "at once" means for a mismatch or a refusal (they take a few milliseconds on loopback).
FAST = 1.0
SERVER_IDENTITY = "CN=localhost,O=dissoc tests"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def _client(certs: Certs, *, cert: bool = True, ca: Path | None = None) -> ClientOptions:
    return ClientOptions(
        timeout=10.0,
        tls_ca=str(ca or certs.ca),
        tls_cert=str(certs.client_cert) if cert else None,
        tls_key=str(certs.client_key) if cert else None,
    )


@pytest.fixture
async def mtls_server(certs: Certs) -> AsyncIterator[dissoc.Server]:
    async with dissoc.Server(
        {"t": sample_table()},
        tls_cert=certs.server_cert,
        tls_key=certs.server_key,
        tls_client_ca=certs.ca,
    ) as server:
        yield server


# ------------------------------------------------------------------------------------------------ fetches


@pytest.mark.parametrize("body", ["packed", "pairs"])
@pytest.mark.parametrize("split", [False, True], ids=["combined", "split"])
async def test_fetch_over_tls(certs: Certs, split: bool, body: str) -> None:
    table = ordered_table(
        6, 5000, pad=100
    )  # ~3 MB: payloads read straight into their buffers, and small ones
    async with dissoc.Server(
        {"t": table}, split=split, body=body, tls_cert=certs.server_cert, tls_key=certs.server_key
    ) as server:
        for uri in (server.uri, server.data_uri):
            assert uri.startswith("tls://127.0.0.1:")
            assert DissocURI.parse(uri).scheme == "tls"
        assert (server.uri != server.data_uri) is split
        got = await within(
            30, fetch_async(server.uri, "t", data_uri=server.data_uri, options=_client(certs, cert=False))
        )
        assert got.equals(table)
        got = await within(30, fetch_async(server.uri, "t", data_uri=server.data_uri, options=_client(certs)))
        assert got.equals(table)  # a client certificate the server did not ask for does no harm


async def test_mutual_tls_fetch(certs: Certs, mtls_server: dissoc.Server) -> None:
    got = await within(30, fetch_async(mtls_server.uri, "t", options=_client(certs)))
    assert got.equals(sample_table())


async def test_server_name_in_certificate_is_checked(certs: Certs) -> None:
    async with dissoc.Server(
        {"t": sample_table()}, tls_cert=certs.server_cert, tls_key=certs.server_key
    ) as s:
        # The certificate names localhost and 127.0.0.1: both work, any other name is refused.
        uri = DissocURI.parse(s.uri)
        localhost = str(DissocURI("tls", "localhost", uri.port, uri.want_data))
        assert (await fetch_async(localhost, "t", options=_client(certs))).num_rows == sample_table().num_rows
        with pytest.raises(TransportError, match=r"certificate was not accepted.*(match|mismatch)"):
            await connect_tls(
                "127.0.0.1", uri.port, tls=client_context(ca=certs.ca), server_hostname="elsewhere.example"
            )


# ------------------------------------------------------------------------------------------ identities


async def _identities(
    certs: Certs, *, client_ca: Path | None, client_cert: bool
) -> tuple[str | None, str | None, str | None]:
    """(what the server's connection says of the client, the client's of the server, the TLS version)."""
    seen: list[str | None] = []

    async def handler(conn: Connection) -> None:
        await conn.recv()
        seen.append(conn.peer_identity)
        await conn.send(b"ok")

    context = server_context(certs.server_cert, certs.server_key, client_ca=client_ca)
    async with await serve_tls("127.0.0.1", 0, handler, tls=context) as listener:
        assert isinstance(listener, TlsListener) and listener.address.startswith("tls://")
        ctx = client_context(
            ca=certs.ca,
            cert=certs.client_cert if client_cert else None,
            key=certs.client_key if client_cert else None,
        )
        async with await connect_tls("127.0.0.1", listener.port, tls=ctx) as conn:
            await conn.send(b"hello")
            assert bytes(await within(5, conn.recv())) == b"ok"
            return seen[0], conn.peer_identity, conn.tls_version


async def test_peer_identity_is_the_client_certificate_subject(certs: Certs) -> None:
    server_sees, client_sees, version = await _identities(certs, client_ca=certs.ca, client_cert=True)
    assert server_sees == CLIENT_IDENTITY
    assert client_sees == SERVER_IDENTITY
    assert version in ("TLSv1.2", "TLSv1.3")


async def test_peer_identity_is_none_without_mutual_tls_or_tls(certs: Certs) -> None:
    server_sees, client_sees, _ = await _identities(certs, client_ca=None, client_cert=True)
    assert server_sees is None  # the server did not ask for (nor verify) a certificate
    assert client_sees == SERVER_IDENTITY

    seen: list[str | None] = []

    async def handler(conn: Connection) -> None:
        seen.append(conn.peer_identity)
        await conn.send(b"x")

    async with await serve_tcp("127.0.0.1", 0, handler) as listener:
        conn = await connect_tcp("127.0.0.1", listener.port)
        async with conn:
            await within(5, conn.recv())
            assert conn.peer_identity is None
    assert seen == [None]


def test_format_subject_is_rfc4514() -> None:
    assert format_subject(((("commonName", "alice"),),)) == "CN=alice"
    subject = ((("countryName", "DE"),), (("organizationName", "A, B"),), (("commonName", "#x+y "),))
    assert format_subject(subject) == r"CN=\#x\+y\ ,O=A\, B,C=DE"
    multi = ((("organizationalUnitName", "ops"), ("userId", "7")), (("emailAddress", "a@b"),))
    assert format_subject(multi) == "emailAddress=a@b,OU=ops+UID=7"


# -------------------------------------------------------------------------------------------- refusals


async def test_mutual_tls_without_client_certificate_is_refused(
    certs: Certs, mtls_server: dissoc.Server
) -> None:
    started = time.perf_counter()
    with pytest.raises(TransportError, match="client certificate") as caught:
        await within(10, fetch_async(mtls_server.uri, "t", options=_client(certs, cert=False)))
    assert time.perf_counter() - started < FAST
    assert not isinstance(caught.value, ProtocolError)
    # The server goes on serving clients that have one.
    assert (await fetch_async(mtls_server.uri, "t", options=_client(certs))).num_rows > 0


async def test_refused_clients_do_not_hold_up_a_good_one(certs: Certs, mtls_server: dissoc.Server) -> None:
    """Clients without a certificate, plaintext clients and silent ones, all at once, while a client with a
    certificate fetches: it gets its data, and every bad one its error."""
    plain = mtls_server.uri.replace("tls://", "tcp://")
    port = DissocURI.parse(mtls_server.uri).port
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]
    try:
        bad = [fetch_async(mtls_server.uri, "t", options=_client(certs, cert=False)) for _ in range(10)]
        bad += [fetch_async(plain, "t", options=ClientOptions(timeout=10.0)) for _ in range(10)]
        bad_tasks = [asyncio.ensure_future(b) for b in bad]
        started = time.perf_counter()
        good = await within(20, fetch_async(mtls_server.uri, "t", options=_client(certs)))
        assert good.equals(sample_table())
        assert time.perf_counter() - started < 5
        results = await within(20, asyncio.gather(*bad_tasks, return_exceptions=True))
        assert all(isinstance(r, TransportError) for r in results), results
    finally:
        for sock in silent:
            sock.close()


async def test_client_certificate_from_another_ca_is_refused(
    certs: Certs, mtls_server: dissoc.Server
) -> None:
    options = ClientOptions(
        timeout=10.0,
        tls_ca=str(certs.ca),
        tls_cert=str(certs.other_server_cert),  # signed by a CA the server does not trust
        tls_key=str(certs.other_server_key),
    )
    started = time.perf_counter()
    with pytest.raises(TransportError, match="refused the TLS"):
        await within(10, fetch_async(mtls_server.uri, "t", options=options))
    assert time.perf_counter() - started < FAST


async def test_server_certificate_from_an_untrusted_ca_is_refused(certs: Certs) -> None:
    async with dissoc.Server(
        {"t": sample_table()}, tls_cert=certs.other_server_cert, tls_key=certs.other_server_key
    ) as server:
        started = time.perf_counter()
        with pytest.raises(TransportError, match="server's certificate was not accepted"):
            await within(10, fetch_async(server.uri, "t", options=_client(certs, cert=False)))
        assert time.perf_counter() - started < FAST
        # No tls_ca: the system's roots, which do not include a test CA either (None is not "no checks").
        with pytest.raises(TransportError, match="server's certificate was not accepted"):
            await within(10, fetch_async(server.uri, "t", options=ClientOptions(timeout=10.0)))
        # The right CA works.
        options = _client(certs, cert=False, ca=certs.other_ca)
        assert (await fetch_async(server.uri, "t", options=options)).num_rows > 0


# ------------------------------------------------------------------------------------------- mismatches


@pytest.mark.parametrize("split", [False, True], ids=["combined", "split"])
async def test_plaintext_client_to_tls_server_fails_fast(certs: Certs, split: bool) -> None:
    async with dissoc.Server(
        {"t": sample_table()}, split=split, tls_cert=certs.server_cert, tls_key=certs.server_key
    ) as server:
        plain = server.uri.replace("tls://", "tcp://")
        plain_data = server.data_uri.replace("tls://", "tcp://")
        started = time.perf_counter()
        with pytest.raises(TransportError, match="TLS server and this connection is plaintext") as caught:
            await within(
                10, fetch_async(plain, "t", data_uri=plain_data, options=ClientOptions(timeout=10.0))
            )
        assert time.perf_counter() - started < FAST
        assert not isinstance(caught.value, ProtocolError)
        assert "tls://" in str(caught.value)
        # and the server is fine
        got = await fetch_async(server.uri, "t", data_uri=server.data_uri, options=_client(certs))
        assert got.equals(sample_table())


@pytest.mark.parametrize("split", [False, True], ids=["combined", "split"])
async def test_tls_client_to_plaintext_server_fails_fast(certs: Certs, split: bool) -> None:
    async with dissoc.Server({"t": sample_table()}, split=split) as server:
        tls = server.uri.replace("tcp://", "tls://")
        tls_data = server.data_uri.replace("tcp://", "tls://")
        started = time.perf_counter()
        with pytest.raises(TransportError, match="not a TLS server") as caught:
            await within(10, fetch_async(tls, "t", data_uri=tls_data, options=_client(certs)))
        assert time.perf_counter() - started < FAST
        assert not isinstance(caught.value, ProtocolError)
        assert (await fetch_async(server.uri, "t", data_uri=server.data_uri)).equals(sample_table())


async def test_plaintext_server_names_a_tls_client(certs: Certs) -> None:
    """The plaintext side's own error says TLS too (not a corrupt frame)."""
    errors: list[BaseException] = []

    async def handler(conn: Connection) -> None:
        try:
            await conn.recv()
        except DissocError as e:
            errors.append(e)

    async with await serve_tcp("127.0.0.1", 0, handler) as listener:
        with pytest.raises(TransportError):
            await connect_tls("127.0.0.1", listener.port, tls=client_context(ca=certs.ca), timeout=5)
        assert await eventually(lambda: bool(errors), 5)
    assert isinstance(errors[0], TransportError) and not isinstance(errors[0], ProtocolError)
    assert "TLS client and this server is plaintext" in str(errors[0])


# ----------------------------------------------------------------------------------- handshake timeout


async def _dropped_within(port: int, first_bytes: bytes, seconds: float) -> float:
    """Connect with a raw socket, send ``first_bytes``, and time until the server closes the connection."""
    loop = asyncio.get_running_loop()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setblocking(False)
    started = time.perf_counter()
    try:
        if first_bytes:
            await loop.sock_sendall(sock, first_bytes)
        while True:
            chunk = await within(
                seconds, loop.sock_recv(sock, 4096), "the server dropping a stalled handshake"
            )
            if not chunk:
                return time.perf_counter() - started
    except ConnectionResetError:
        return time.perf_counter() - started
    finally:
        sock.close()


@pytest.mark.parametrize("first_bytes", [b"", b"\x16\x03\x01"], ids=["silent", "partial-hello"])
async def test_stalled_handshake_is_dropped(certs: Certs, first_bytes: bytes) -> None:
    async with dissoc.Server(
        {"t": sample_table()},
        tls_cert=certs.server_cert,
        tls_key=certs.server_key,
        tls_handshake_timeout=0.3,
        want_data_timeout=None,  # only the handshake timeout can drop it
        idle_timeout=None,
    ) as server:
        port = DissocURI.parse(server.uri).port
        took = await _dropped_within(port, first_bytes, 5)
        assert 0.25 <= took < 3
        # a proper client is still served
        assert (await fetch_async(server.uri, "t", options=_client(certs))).num_rows > 0


async def test_handshaking_connection_counts_against_max_connections(certs: Certs) -> None:
    started = asyncio.Event()

    async def handler(conn: Connection) -> None:
        started.set()
        await conn.recv()

    context = server_context(certs.server_cert, certs.server_key)
    async with await serve_tls("127.0.0.1", 0, handler, tls=context, handshake_timeout=None) as listener:
        sock = socket.create_connection(("127.0.0.1", listener.port))
        try:
            await within(5, started.wait())
            assert listener.open_connections == 1
            (conn,) = listener.connections
            assert isinstance(conn, TlsConnection) and conn.peer_identity is None
        finally:
            sock.close()
        assert await eventually(lambda: listener.open_connections == 0, 5)


# ------------------------------------------------------------------------------------- flow inside TLS


async def test_flow_control_and_large_payloads_inside_tls(certs: Certs) -> None:
    """Many small frames to a reader with a tiny buffer budget (reading pauses and resumes while records wait
    inside the TLS layer), then large tagged payloads both ways; everything arrives intact and in order."""
    big = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MiB, not a multiple of a TLS record
    count = 300

    async def handler(conn: Connection) -> None:
        await conn.send_many([(None, f"m{i:05d}".encode() * 200) for i in range(count)])
        await conn.send_tagged(7, [b"head", big, b"tail"])
        got = await conn.recv_tagged(9)
        await conn.send(bytes(got.view())[-16:] + len(got.view()).to_bytes(8, "little"))

    context = server_context(certs.server_cert, certs.server_key)
    async with await serve_tls("127.0.0.1", 0, handler, tls=context) as listener:
        conn = await connect_tls(
            "127.0.0.1", listener.port, tls=client_context(ca=certs.ca), max_buffered_bytes=16 * 1024
        )
        async with conn:
            await asyncio.sleep(0.2)  # let the server run into the budget
            for i in range(count):
                message = bytes(await within(5, conn.recv(), f"message {i}"))
                assert message == f"m{i:05d}".encode() * 200
            tagged = await within(10, conn.recv_tagged(7))
            assert bytes(tagged.view()) == b"head" + big + b"tail"
            await conn.send_tagged(9, big)
            answer = bytes(await within(10, conn.recv()))
            assert answer == big[-16:] + len(big).to_bytes(8, "little")


async def test_bytes_left_inside_the_tls_layer_are_read(certs: Certs) -> None:
    """Records decrypted into the TLS layer but not yet taken wake no reader callback (the kernel has nothing
    more): a tiny staging buffer and read budget leave most of one record there, and it must still arrive."""
    here, there = socket.socketpair()
    server = TlsConnection(here, server_context(certs.server_cert, certs.server_key), server_side=True)
    client = TlsConnection(
        there,
        client_context(ca=certs.ca),
        server_side=False,
        server_hostname="localhost",
        staging_bytes=64,
        max_buffered_bytes=1024,
    )
    async with server, client:
        await within(5, client.handshake())
        messages = [f"{i:03d}".encode() * 25 for i in range(100)]  # ~10 KB: one TLS record
        await server.send_many([(None, m) for m in messages])
        for i, expected in enumerate(messages):
            assert bytes(await within(5, client.recv(), f"message {i}")) == expected


def test_writes_gather_small_pieces_and_slice_large_ones() -> None:
    header, small, large = b"H" * 24, b"s" * 100, bytes(range(256)) * 20000  # 5 MB
    pieces = [memoryview(p) for p in (header, small, header, large, header, small)]
    writes = list(_writes(pieces))
    assert b"".join(bytes(w) for w in writes) == header + small + header + large + header + small
    assert len(writes[0]) == 16 * 1024  # the small ones topped up with the start of the large one
    assert all(len(w) <= 1024 * 1024 for w in writes)
    assert all(isinstance(w, memoryview) for w in writes[1:-1])  # large slices are not copied


# -------------------------------------------------------------------------------------- configuration


def test_server_tls_arguments_are_checked(certs: Certs, tmp_path: Path) -> None:
    with pytest.raises(DissocError, match="need tls_cert"):
        dissoc.Server({}, tls_key=certs.server_key)
    with pytest.raises(DissocError, match="tcp transport"):
        dissoc.Server({}, transport="ucx", tls_cert=certs.server_cert, tls_key=certs.server_key)
    with pytest.raises(DissocError, match="needs tls_cert"):
        dissoc.Server({}, transport="tls")
    with pytest.raises(TransportError, match="no such file"):
        dissoc.Server({}, tls_cert=tmp_path / "missing.pem", tls_key=certs.server_key)
    with pytest.raises(TransportError, match="cannot load the server certificate"):
        dissoc.Server({}, tls_cert=certs.server_cert, tls_key=certs.client_key)  # the wrong key
    with pytest.raises(TransportError, match="needs its certificate"):
        client_context(key=certs.client_key)


async def test_server_takes_a_ready_context_for_the_tls_transport(certs: Certs) -> None:
    """``transport="tls"`` with the transport's own ``tls=`` context (for settings the PEM arguments lack)."""
    context = server_context(certs.server_cert, certs.server_key)
    async with dissoc.Server({"t": sample_table()}, transport="tls", tls=context) as server:
        assert server.uri.startswith("tls://")
        got = await fetch_async(server.uri, "t", options=_client(certs, cert=False))
        assert got.equals(sample_table())


def test_tls_uris_parse_and_print() -> None:
    uri = DissocURI.parse("tls://[::1]:9000?want_data=7&free_data=8")
    assert (uri.scheme, uri.host, uri.port) == ("tls", "::1", 9000)
    assert str(uri) == "tls://[::1]:9000?want_data=7&free_data=8"


# ----------------------------------------------------------------------------------------- command line


def _get(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "dissoc.cli", "get", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )


@pytest.fixture(scope="module")
def arrow_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, pa.Table]:
    table = sample_table(batches=3)
    path = tmp_path_factory.mktemp("tls-cli") / "trips.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return path, table


@pytest.mark.parametrize("split", [False, True], ids=["combined", "split"])
def test_cli_serve_and_get_with_mutual_tls(
    certs: Certs, arrow_file: tuple[Path, pa.Table], split: bool
) -> None:
    path, table = arrow_file
    tls_serve = ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)]
    tls_serve += ["--tls-client-ca", str(certs.ca), *(["--split"] if split else [])]
    with cli_server(str(path), *tls_serve, count=1) as (proc, lines):
        (line,) = lines
        assert line["uri"].startswith("tls://") and line["data_uri"].startswith("tls://")
        uri_args = [line["uri"], "trips", "--data-uri", line["data_uri"], "--no-progress"]
        out = tmp = path.with_name(f"got-{split}.arrow")
        done = _get(
            *uri_args,
            "--tls-ca",
            str(certs.ca),
            "--tls-cert",
            str(certs.client_cert),
            "--tls-key",
            str(certs.client_key),
            "-o",
            str(out),
        )
        assert done.returncode == 0, done.stderr
        summary: dict[str, Any] = json.loads(done.stdout)
        assert summary["rows"] == table.num_rows
        assert pa.ipc.open_file(str(tmp)).read_all().equals(table)

        refused = _get(*uri_args, "--tls-ca", str(certs.ca), "--timeout", "10")
        assert refused.returncode == 1
        assert "client certificate" in refused.stderr and "Traceback" not in refused.stderr

        plain = _get(line["uri"].replace("tls://", "tcp://"), "trips", "--timeout", "10", "--no-progress")
        assert plain.returncode == 1
        assert "TLS server" in plain.stderr and "Traceback" not in plain.stderr
        assert proc.poll() is None  # the server still runs


def test_cli_tls_flag_errors(certs: Certs, arrow_file: tuple[Path, pa.Table]) -> None:
    path, _ = arrow_file
    for flags, message in (
        (["--tls-cert", str(certs.server_cert)], "--tls-cert needs --tls-key"),
        (["--tls-key", str(certs.server_key)], "need --tls-cert"),
    ):
        done = subprocess.run(
            [PYTHON, "-m", "dissoc.cli", "serve", str(path), *flags],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 1 and message in done.stderr, done.stderr
    done = subprocess.run(
        [PYTHON, "-m", "dissoc.cli", "serve", str(path), "--tls-handshake-timeout", "soon"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
