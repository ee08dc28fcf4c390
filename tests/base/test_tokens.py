"""Signed tickets (dissoc.tokens) and the servers that check them, with real servers over TCP.

The format round-trips and every field is covered by the MAC; forged, expired, wrong-name, wrong-scope,
wrong-client and other-secret tickets are refused by combined and split servers with the distinct code
``unauthorized`` (no dataset name, no secret in the reply), counted and logged at a bounded rate, while the
same server keeps serving well-behaved clients at full speed; without a secret nothing changes; the unknown-
ticket error names no served dataset; ``dissoc token`` and ``dissoc serve --secret-file`` round-trip.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import re
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.e2e import PYTHON, REPO, cli_server, ordered_table, sample_table, within

from dissoc.client import ClientOptions, fetch_async
from dissoc.errors import DissocError, RemoteError
from dissoc.protocol import ErrorMessage, decode_stream_message
from dissoc.server import Server
from dissoc.tokens import (
    MIN_SECRET_BYTES,
    Claims,
    Secret,
    TokenError,
    grants,
    is_signed,
    load_secret,
    mint,
    parse_ttl,
    peek,
    verify,
)
from dissoc.transport import connect
from dissoc.transport.tcp import TcpConnection
from dissoc.uri import DissocURI

pytestmark = pytest.mark.timeout(60)

LAYOUTS = [pytest.param(False, id="combined"), pytest.param(True, id="split")]
KEY = b"0123456789abcdef0123456789abcdef"
SECRET = Secret(KEY)
URL_SAFE = re.compile(r"[A-Za-z0-9._-]+")


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).rstrip(b"=").decode()


# ------------------------------------------------------------------------------------------------- the format


def test_a_minted_ticket_is_one_url_safe_string_with_the_documented_fields() -> None:
    ticket = mint(SECRET, "trips/2024 ü", expires=1_900_000_000, scope="write", bind="CN=alice,O=x")
    assert URL_SAFE.fullmatch(ticket), ticket
    prefix, name, expiry, scope, bind, mac = ticket.split(".")
    assert prefix == "dt1"
    assert name == _b64("trips/2024 ü") and expiry == "1900000000" and scope == "write"
    assert bind == _b64("CN=alice,O=x") and len(mac) == 43
    assert is_signed(ticket) and is_signed(ticket.encode())
    assert peek(ticket) == Claims("trips/2024 ü", 1_900_000_000, "write", "CN=alice,O=x")
    claims = verify(SECRET, ticket, scope="write", peer="CN=alice,O=x", now=1_800_000_000)
    assert claims == peek(ticket)
    # the MAC is HMAC-SHA256 over everything before the last dot, base64url without padding
    import hashlib
    import hmac

    body = ticket.rpartition(".")[0].encode()
    assert mac == base64.urlsafe_b64encode(hmac.new(KEY, body, hashlib.sha256).digest()).rstrip(b"=").decode()
    unbound = SECRET.mint("trips", ttl=600)
    assert unbound.split(".")[4] == "" and peek(unbound) is not None
    assert abs(SECRET.verify(unbound).expires - (time.time() + 600)) < 5


def _tamper(ticket: str, index: int, value: str) -> str:
    fields = ticket.split(".")
    fields[index] = value
    return ".".join(fields)


def test_every_field_is_covered_by_the_signature() -> None:
    good = SECRET.mint("public", ttl=600)
    expires = int(good.split(".")[2])
    forged = [
        _tamper(good, 1, _b64("secret")),  # another name with the same MAC
        _tamper(good, 2, str(expires + 10_000)),  # a later expiry
        _tamper(good, 3, "write"),  # a wider scope
        _tamper(good, 4, _b64("CN=me")),  # a binding added
        _tamper(good, 5, good.split(".")[5][:-1] + ("A" if good[-1] != "A" else "B")),  # one MAC character
        _tamper(good, 5, good.split(".")[5][:-2]),  # a shorter MAC
        _tamper(good, 5, ""),
        Secret(b"another secret, same length!!!!!").mint("public", ttl=600),
    ]
    for ticket in forged:
        with pytest.raises(TokenError, match="signature"):
            verify(SECRET, ticket)
    assert verify(SECRET, good).name == "public"


@pytest.mark.parametrize(
    "ticket",
    [
        "",
        "public",
        "dt1.",
        "dt1.a.b.c.d",
        "dt2.cHVibGlj.1.read..x",
        "dt1.a.b.c.d.e.f",
        "dt1.cHVibGlj.1.read..é",
    ],
)
def test_what_is_not_a_signed_ticket_is_refused_without_echoing_it(ticket: str) -> None:
    assert not is_signed(ticket) or ticket.count(".") == 5
    with pytest.raises(TokenError) as info:
        verify(SECRET, ticket)
    assert "public" not in str(info.value) and "cHVibGlj" not in str(info.value)


def test_expired_wrong_scope_wrong_name_and_wrong_client_are_refused() -> None:
    now = 1_800_000_000
    ticket = SECRET.mint("trips", expires=now, scope="read", bind="CN=alice")
    assert SECRET.verify(ticket, peer="CN=alice", now=now).name == "trips"  # valid through its last second
    with pytest.raises(TokenError, match="expired"):
        SECRET.verify(ticket, peer="CN=alice", now=now + 1)
    with pytest.raises(TokenError, match="scope"):
        SECRET.verify(ticket, scope="write", peer="CN=alice", now=now)
    with pytest.raises(TokenError, match="another dataset"):
        SECRET.verify(ticket, name="trips-2", peer="CN=alice", now=now)
    for peer in (None, "CN=bob", "CN=alice "):
        with pytest.raises(TokenError, match="another client"):
            SECRET.verify(ticket, peer=peer, now=now)
    for message in (str(e) for e in _errors(ticket, now)):
        assert "trips" not in message and KEY.decode() not in message


def _errors(ticket: str, now: int) -> list[TokenError]:
    found = []
    for kwargs in ({"now": now + 1}, {"scope": "write"}, {"name": "x"}, {"peer": "CN=bob"}):
        try:
            SECRET.verify(ticket, **kwargs)
        except TokenError as e:
            found.append(e)
    assert len(found) == 4
    return found


def test_grants_a_name_and_what_lies_under_it_and_star_grants_all() -> None:
    assert grants("trips", "trips") and grants("trips", "trips/job/00001.0") and grants("*", "anything")
    assert not grants("trips", "trips2") and not grants("trips", "trip") and not grants("trips/a", "trips")


def test_minting_checks_its_arguments() -> None:
    with pytest.raises(TokenError, match="name"):
        SECRET.mint("")
    with pytest.raises(TokenError, match="scope"):
        SECRET.mint("x", scope="admin")  # type: ignore[arg-type]
    with pytest.raises(TokenError, match="ttl"):
        SECRET.mint("x", ttl=0)
    with pytest.raises(TokenError, match="bind"):
        SECRET.mint("x", bind="")


def test_a_secret_never_shows_its_key_and_must_be_long_enough(tmp_path: Path) -> None:
    assert KEY.decode() not in repr(SECRET) and KEY.decode() not in str(SECRET)
    assert repr(SECRET) == "Secret(<32 bytes>)"
    assert Secret(KEY) == SECRET and Secret(KEY[::-1]) != SECRET
    with pytest.raises(TokenError, match=f"at least {MIN_SECRET_BYTES} bytes"):
        Secret(b"short")
    assert Secret.generate() != Secret.generate()

    path = tmp_path / "secret"
    path.write_bytes(KEY + b"\n")
    path.chmod(0o600)
    assert load_secret(path) == SECRET  # the trailing newline is not part of it
    for content, match in ((b"", "empty"), (b"\n\n", "empty"), (b"hunter2hunter2", "at least 16")):
        path.write_bytes(content)
        with pytest.raises(TokenError, match=match) as info:
            load_secret(path)
        assert "hunter2" not in str(info.value)
    with pytest.raises(TokenError, match="cannot read"):
        load_secret(tmp_path / "missing")


def test_a_secret_file_others_can_read_is_used_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "secret"
    path.write_bytes(KEY)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="dissoc.tokens"):
        assert load_secret(path) == SECRET
    assert "chmod 600" in caplog.text and KEY.decode() not in caplog.text


def test_parse_ttl() -> None:
    assert [parse_ttl(t) for t in ("90", "90s", "10m", "2h", "1d", "1.5m")] == [90, 90, 600, 7200, 86400, 90]
    for bad in ("", "10x", "-5", "0", "m"):
        with pytest.raises(TokenError):
            parse_ttl(bad)


# ------------------------------------------------------------------------------------------ servers over TCP


async def _refusal(server: Server, ticket: str | bytes) -> RemoteError:
    with pytest.raises(RemoteError) as info:
        await within(
            10,
            fetch_async(server.uri, ticket, data_uri=server.data_uri, options=ClientOptions(timeout=5)),
        )
    return info.value


@pytest.mark.parametrize("split", LAYOUTS)
async def test_a_valid_ticket_is_served_and_bad_ones_are_refused_with_unauthorized(split: bool) -> None:
    table, other = sample_table(batches=3), ordered_table(2, 50)
    async with Server({"trips": table, "hidden_other": other}, split=split, secret=SECRET) as server:
        got = await within(20, fetch_async(server.uri, SECRET.mint("trips"), data_uri=server.data_uri))
        assert got.equals(table)
        good = SECRET.mint("trips", ttl=600)
        bad: dict[str, str | bytes] = {
            "missing": "trips",
            "forged": _tamper(good, 5, "A" * 43),
            "expired": SECRET.mint("trips", expires=int(time.time()) - 1),
            "wrong-name": _tamper(good, 1, _b64("hidden_other")),
            "wrong-scope": SECRET.mint("trips", scope="write"),
            "other-secret": Secret(b"a server with another secret....").mint("trips"),
            "bound-elsewhere": SECRET.mint("trips", bind="CN=alice"),
            "not-ascii": "dt1.ü.1.read..x".encode(),
        }
        for what, ticket in bad.items():
            error = await _refusal(server, ticket)
            assert error.code == "unauthorized", (what, error)
            for leak in ("trips", "hidden_other", KEY.decode()):
                assert leak not in error.message, (what, error.message)
        # counted: once per refused request on each server that refused it
        assert server.unauthorized >= len(bad)
        # and the server goes on serving, the same ticket again included
        again = await within(20, fetch_async(server.uri, good, data_uri=server.data_uri))
        assert again.equals(table)
        assert (await fetch_async(server.uri, SECRET.mint("hidden_other"), data_uri=server.data_uri)).equals(
            other
        )


@pytest.mark.parametrize("split", LAYOUTS)
async def test_a_bound_ticket_is_served_only_to_the_client_it_names(
    split: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check reads ``Connection.peer_identity`` (the mutual-TLS certificate subject, None without TLS):
    set here on every TCP connection, as a TLS transport would."""
    table = ordered_table(1, 10)
    async with Server({"trips": table}, split=split, secret=SECRET) as server:
        bound = SECRET.mint("trips", bind="CN=alice")
        assert (await _refusal(server, bound)).code == "unauthorized"  # no TLS: no identity
        monkeypatch.setattr(TcpConnection, "peer_identity", "CN=alice", raising=False)
        assert (await fetch_async(server.uri, bound, data_uri=server.data_uri)).equals(table)
        monkeypatch.setattr(TcpConnection, "peer_identity", "CN=mallory", raising=False)
        assert (await _refusal(server, bound)).code == "unauthorized"


@pytest.mark.parametrize("split", LAYOUTS)
async def test_without_a_secret_nothing_changes(split: bool) -> None:
    table = ordered_table(1, 10)
    async with Server({"trips": table}, split=split) as server:
        assert server.secret is None
        assert (await fetch_async(server.uri, "trips", data_uri=server.data_uri)).equals(table)
        # a signed ticket is just an unknown name to a server without a secret
        assert (await _refusal(server, SECRET.mint("trips"))).code == "unknown_ticket"
        assert server.unauthorized == 0


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "signed"])
async def test_the_unknown_ticket_error_names_no_served_dataset(secret: Secret | None) -> None:
    served = {f"private_{i}": ordered_table(1, 4) for i in range(3)}
    async with Server(served, secret=secret) as server:
        ticket = "private" if secret is None else SECRET.mint("private")
        error = await _refusal(server, ticket)
    assert error.code == "unknown_ticket"
    assert all(name not in error.message for name in served), error.message


async def test_client_options_token_stands_in_for_the_name_it_is_for() -> None:
    table = ordered_table(1, 10)
    async with Server({"trips": table}, secret=SECRET) as server:
        options = ClientOptions(token=SECRET.mint("trips"))
        assert (await fetch_async(server.uri, "trips", options=options)).equals(table)
        assert (await fetch_async(server.uri, options.token or "", options=options)).equals(table)
        with pytest.raises(DissocError, match="another dataset"):
            await fetch_async(server.uri, "other", options=options)
        with pytest.raises(DissocError, match="not a signed ticket"):
            await fetch_async(server.uri, "trips", options=ClientOptions(token="plain"))


async def test_refused_clients_never_slow_a_well_behaved_one(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hostile clients hammer the server with forged tickets on open connections while a good client fetches
    a 128 MiB dataset: its time stays within a small factor of the time alone, every refusal is counted, and
    the log holds a handful of lines, not one per refusal."""
    import dissoc.server.role
    from dissoc.logs import RateLimitedLog

    # a log of its own: earlier tests' refusals must not have used up this kind's line
    monkeypatch.setattr(dissoc.server.role, "peer_log", RateLimitedLog(logging.getLogger("dissoc.peers")))
    table = ordered_table(32, 1 << 19)  # 32 batches of 512 Ki rows
    good = SECRET.mint("big")
    forged = _tamper(good, 5, "B" * 43).encode()

    async with Server({"big": table}, secret=SECRET) as server:
        uri = DissocURI.parse(server.uri)

        async def timed() -> float:
            started = time.perf_counter()
            got = await within(60, fetch_async(server.uri, good))
            assert got.num_rows == table.num_rows
            return time.perf_counter() - started

        await timed()  # warm-up
        alone = min([await timed() for _ in range(3)])
        stop = asyncio.Event()
        sent = 0

        async def hostile() -> None:
            nonlocal sent
            conn = await connect("tcp", uri.host, uri.port)
            try:
                while not stop.is_set():
                    await conn.send_tagged(uri.want_data, forged)
                    reply = decode_stream_message(bytes(await conn.recv()))
                    assert isinstance(reply, ErrorMessage) and reply.code == "unauthorized"
                    sent += 1
            finally:
                await conn.close()

        with caplog.at_level(logging.WARNING, logger="dissoc.peers"):
            attackers = [asyncio.create_task(hostile()) for _ in range(4)]
            await asyncio.sleep(0.2)
            besieged = min([await timed() for _ in range(3)])
            stop.set()
            await asyncio.gather(*attackers)
        print(f"\nalone {alone:.3f} s, with {sent} refusals meanwhile {besieged:.3f} s")
        assert sent > 100, "the hostile clients were not answered"
        assert server.unauthorized >= sent
        # Everything runs on one loop here (and on 2 shared cores): the attackers take some of the CPU the
        # refusals cost, but a refusal is cheap, so the good client is never held up for long.
        assert besieged < 4 * alone + 0.5, (alone, besieged)
        refusals_logged = [r for r in caplog.records if "refused want_data" in r.getMessage()]
        assert 1 <= len(refusals_logged) <= 5, len(refusals_logged)
        assert all(KEY.decode() not in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------------------ the command line


def dissoc_cmd(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """``dissoc ARGS`` with the environment's DISSOC_ variables replaced by ``env``'s."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DISSOC_")}
    full_env.update(env or {})
    return subprocess.run(
        [PYTHON, "-m", "dissoc.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "dissoc.secret"
    path.write_bytes(KEY + b"\n")
    path.chmod(0o600)
    return path


def test_token_command_prints_a_ticket_that_verifies(secret_file: Path) -> None:
    done = dissoc_cmd("token", "--secret-file", str(secret_file), "trips", "--ttl", "10m")
    assert done.returncode == 0, done.stderr
    ticket = done.stdout.strip()
    assert done.stdout == ticket + "\n" and URL_SAFE.fullmatch(ticket)
    claims = load_secret(secret_file).verify(ticket, scope="read")
    assert claims.name == "trips" and claims.bind is None
    assert abs(claims.expires - (time.time() + 600)) < 30

    done = dissoc_cmd(
        "token", "trips", "--scope", "write", "--bind", "CN=alice", "--json", "--ttl", "2h",
        env={"DISSOC_SECRET_FILE": str(secret_file)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout)
    assert set(line) == {"ticket", "name", "scope", "expires", "bind"}
    assert (line["name"], line["scope"], line["bind"]) == ("trips", "write", "CN=alice")
    assert SECRET.verify(line["ticket"], scope="write", peer="CN=alice").expires == line["expires"]
    assert KEY.decode() not in done.stdout + done.stderr


def test_token_command_errors(secret_file: Path, tmp_path: Path) -> None:
    done = dissoc_cmd("token", "trips")
    assert done.returncode == 1 and "--secret-file" in done.stderr
    short = tmp_path / "short"
    short.write_text("hunter2\n")
    done = dissoc_cmd("token", "--secret-file", str(short), "trips")
    assert done.returncode == 1 and "at least 16" in done.stderr and "hunter2" not in done.stderr
    done = dissoc_cmd("token", "--secret-file", str(secret_file), "trips", "--ttl", "soon")
    assert done.returncode == 2 and "duration" in done.stderr
    done = dissoc_cmd("token", "--secret-file", str(secret_file), "trips", "--scope", "admin")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("split", LAYOUTS)
def test_serve_with_a_secret_file_and_get_with_a_minted_ticket(
    secret_file: Path, tmp_path: Path, split: bool
) -> None:
    table = ordered_table(3, 100)
    path = tmp_path / "trips.parquet"
    pq.write_table(table, path)
    layout = ["--split"] if split else []
    with cli_server(str(path), "--secret-file", str(secret_file), *layout, count=1) as (proc, lines):
        line = lines[0]
        ticket = dissoc_cmd("token", "--secret-file", str(secret_file), "trips").stdout.strip()
        out = tmp_path / "out.arrow"
        got = dissoc_cmd("get", line["uri"], ticket, "--data-uri", line["data_uri"], "-o", str(out))
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["rows"] == table.num_rows
        assert pa.ipc.open_file(str(out)).read_all().equals(pq.read_table(path))
        # the name alone is refused, with the code and without a traceback
        refused = dissoc_cmd("get", line["uri"], "trips", "--data-uri", line["data_uri"])
        assert refused.returncode == 1 and "unauthorized" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
        # --token, and DISSOC_TOKEN, stand in for the name they are for
        by_flag = dissoc_cmd("get", line["uri"], "trips", "--data-uri", line["data_uri"], "--token", ticket)
        by_env = dissoc_cmd(
            "get", line["uri"], "trips", "--data-uri", line["data_uri"], env={"DISSOC_TOKEN": ticket}
        )
        for done in (by_flag, by_env):
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout)["rows"] == table.num_rows
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0
    assert b"warning" not in err and KEY not in err, err  # loopback: no warning; the secret never shown


def _stderr_after_start(*args: str) -> str:
    with cli_server(*args, count=1) as (proc, _lines):
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    return err.decode()


def test_serve_on_a_non_loopback_address_without_a_secret_warns_once(
    secret_file: Path, tmp_path: Path
) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(ordered_table(1, 4), path)
    err = _stderr_after_start(str(path), "--host", "0.0.0.0")
    warnings = [line for line in err.splitlines() if "without --secret-file" in line]
    assert len(warnings) == 1 and warnings[0].startswith("dissoc: warning:"), err
    for quiet in (["--host", "0.0.0.0", "--secret-file", str(secret_file)], ["--host", "127.0.0.1"]):
        err = _stderr_after_start(str(path), *quiet)
        assert "without --secret-file" not in err, (quiet, err)


def test_serve_takes_the_secret_file_from_the_environment(secret_file: Path, tmp_path: Path) -> None:
    path = tmp_path / "trips.parquet"
    pq.write_table(ordered_table(1, 4), path)
    env_before = os.environ.get("DISSOC_SECRET_FILE")
    os.environ["DISSOC_SECRET_FILE"] = str(secret_file)
    try:
        with cli_server(str(path), count=1) as (_proc, lines):
            refused = dissoc_cmd("get", lines[0]["uri"], "trips")
            ok = dissoc_cmd("get", lines[0]["uri"], SECRET.mint("trips"))
    finally:
        if env_before is None:
            del os.environ["DISSOC_SECRET_FILE"]
        else:
            os.environ["DISSOC_SECRET_FILE"] = env_before
    assert refused.returncode == 1 and "unauthorized" in refused.stderr
    assert ok.returncode == 0 and json.loads(ok.stdout)["rows"] == 4, ok.stderr


def test_server_takes_a_secret_or_its_bytes_and_refuses_a_short_one() -> None:
    assert Server(secret=KEY).secret == SECRET
    assert Server(secret=KEY.decode()).secret == SECRET
    assert Server(secret=SECRET).secret is SECRET
    assert Server().secret is None
    with pytest.raises(TokenError, match="at least 16 bytes"):
        Server(secret=b"short")


async def test_no_part_of_a_signed_ticket_reaches_the_log(caplog: pytest.LogCaptureFixture) -> None:
    table = ordered_table(1, 4)
    ticket = SECRET.mint("t")
    with caplog.at_level(logging.DEBUG, logger="dissoc"):
        async with Server({"t": table}, secret=SECRET) as server:
            assert (await fetch_async(server.uri, ticket)).equals(table)
            await _refusal(server, ticket[:-4] + "AAAA")
    assert "want_data" in caplog.text  # the debug line is there, without the ticket
    mac = ticket.rpartition(".")[2]
    assert mac[:8] not in caplog.text and ticket[:20] not in caplog.text
