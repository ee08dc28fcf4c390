"""The Flight control plane with a secret, against pyarrow's own FlightClient and dissoc's calls.

Every call without a valid bearer token (none, forged, expired, another secret's, bound to a client) is
refused with FlightUnauthenticatedError; a token grants its name and what lies under it (``*`` everything), so
ListFlights and ``list-tickets`` show only that and GetFlightInfo/GetSchema/DoGet of anything else are
refused with FlightUnauthorizedError; the endpoints carry signed tickets that fetch over dissoc (combined and
split) and nothing else; DoPut and ``remove`` need scope write; a read-only plane refuses them whatever the
token; uploads over the limit are refused; ``dissoc serve --secret-file --flight`` and ``dissoc get --token``
round-trip from the command line.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from helpers.e2e import PYTHON, REPO, cli_server, ordered_table, sample_table

import dissoc
from dissoc.client import ClientOptions, fetch_async
from dissoc.errors import RemoteError
from dissoc.flight import (
    ACTION_LIST_TICKETS,
    ACTION_REMOVE,
    FlightControlPlane,
    describe,
    list_datasets,
    publish,
    remove,
    resolve,
    serve_with_flight,
)
from dissoc.flight.server import DEFAULT_MAX_PUT_BYTES
from dissoc.server import Server
from dissoc.tokens import Secret, peek

flight = pytest.importorskip("pyarrow.flight")

pytestmark = pytest.mark.timeout(60)

KEY = b"flight-plane-secret-0123456789ab"
SECRET = Secret(KEY)
LAYOUTS = [pytest.param(False, id="combined"), pytest.param(True, id="split")]


def _bearer(token: str) -> Any:
    return flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {token}".encode())])


def _extra_code(error: Exception) -> str:
    info = json.loads(bytes(getattr(error, "extra_info", b"") or b"{}"))
    code: str = info.get("code", "")
    return code


@pytest.fixture(params=LAYOUTS)
async def plane(request: pytest.FixtureRequest) -> AsyncIterator[FlightControlPlane]:
    datasets = {
        "trips": sample_table(batches=2),
        "hidden": ordered_table(1, 10),
        "trips/part-1": ordered_table(1, 3),
    }
    async with serve_with_flight(datasets, split=request.param, secret=SECRET) as p:
        yield p


def _calls(client: Any, options: Any) -> dict[str, Any]:
    """Every kind of call the plane answers, as thunks."""

    def put() -> None:
        table = ordered_table(1, 3)
        writer, _ = client.do_put(flight.FlightDescriptor.for_path("trips"), table.schema, options)
        with writer:
            writer.write_table(table)

    return {
        "ListFlights": lambda: list(client.list_flights(b"", options)),
        "GetFlightInfo": lambda: client.get_flight_info(flight.FlightDescriptor.for_path("trips"), options),
        "GetSchema": lambda: client.get_schema(flight.FlightDescriptor.for_path("trips"), options),
        "DoGet": lambda: client.do_get(flight.Ticket(b"trips"), options).read_all(),
        "DoPut": put,
        "DoAction": lambda: list(client.do_action(flight.Action(ACTION_REMOVE, b"trips"), options)),
        "ListActions": lambda: client.list_actions(options),
    }


async def test_every_call_without_a_valid_token_is_unauthenticated(plane: FlightControlPlane) -> None:
    client = flight.FlightClient(plane.location)
    bad_tokens = {
        "none": None,
        "not-a-token": "trips",
        "forged": SECRET.mint("*", scope="write")[:-3] + "AAA",
        "expired": SECRET.mint("*", scope="write", expires=int(time.time()) - 1),
        "other-secret": Secret(b"some other plane's secret 012345").mint("*", scope="write"),
        "bound": SECRET.mint("*", scope="write", bind="CN=alice"),
    }
    try:
        for what, token in bad_tokens.items():
            options = flight.FlightCallOptions() if token is None else _bearer(token)
            for call, thunk in _calls(client, options).items():
                # (pyarrow raises a plain OSError for a refused GetSchema, its status code in the text)
                expected = OSError if call == "GetSchema" else flight.FlightUnauthenticatedError
                with pytest.raises(expected, match="authentication required") as info:
                    thunk()
                assert "Unauthenticated" in str(info.value), (what, call)
                if call not in ("GetSchema", "DoPut"):  # (pyarrow keeps no extra_info on those)
                    assert _extra_code(info.value) == "unauthenticated", (what, call)
                assert "hidden" not in str(info.value) and KEY.decode() not in str(info.value)
        # a malformed header is refused too
        raw = flight.FlightCallOptions(headers=[(b"authorization", b"Basic dXNlcjpwYXNz")])
        with pytest.raises(flight.FlightUnauthenticatedError):
            list(client.list_flights(b"", raw))
    finally:
        client.close()
    assert plane.unauthenticated >= len(bad_tokens) * 7
    # nothing was changed or removed by any of it
    assert sorted(plane.server.catalog.names()) == ["hidden", "trips", "trips/part-1"]


async def test_a_token_grants_its_name_what_lies_under_it_and_nothing_else(plane: FlightControlPlane) -> None:
    location = plane.location
    token = SECRET.mint("trips", ttl=600)

    def calls() -> None:
        client = flight.FlightClient(location)
        try:
            options = _bearer(token)
            listed = sorted(bytes(i.descriptor.path[0]).decode() for i in client.list_flights(b"", options))
            assert listed == ["trips", "trips/part-1"]
            (result,) = client.do_action(flight.Action(ACTION_LIST_TICKETS, b""), options)
            assert json.loads(result.body.to_pybytes()) == ["trips", "trips/part-1"]
            info = client.get_flight_info(flight.FlightDescriptor.for_path("trips"), options)
            (endpoint,) = info.endpoints
            ticket = endpoint.ticket.ticket
            # the endpoint's ticket: signed by the plane, scope read, for this dataset, expires with the token
            claims = SECRET.verify(ticket, scope="read", name="trips")
            assert claims.name == "trips" and claims.expires == peek(token).expires  # type: ignore[union-attr]
            assert client.do_get(endpoint.ticket, options).read_all().equals(sample_table(batches=2))
            assert client.get_schema(flight.FlightDescriptor.for_path("trips"), options).schema.equals(
                info.schema
            )
            # the endpoint ticket without a bearer token: refused (every call needs one)
            with pytest.raises(flight.FlightUnauthenticatedError):
                client.do_get(endpoint.ticket).read_all()
            # anything else: refused, whether it exists or not (no existence is revealed)
            for name in ("hidden", "no-such", "tripsX"):
                path = flight.FlightDescriptor.for_path(name)
                with pytest.raises(flight.FlightUnauthorizedError) as refused:
                    client.get_flight_info(path, options)
                assert _extra_code(refused.value) == "unauthorized"
                assert name not in str(refused.value)
                with pytest.raises(flight.FlightUnauthorizedError) as refused:
                    client.do_get(flight.Ticket(name.encode()), options).read_all()
                assert _extra_code(refused.value) == "unauthorized"
                # (pyarrow's GetSchema loses the Flight error's kind: an ArrowException with its text)
                with pytest.raises(pa.ArrowException, match="not allowed: the token does not grant"):
                    client.get_schema(path, options)
            # a ticket the plane signed for "trips", edited to name "hidden": forged
            forged = ticket.replace(ticket.split(b".")[1], b"aGlkZGVu")
            with pytest.raises(flight.FlightUnauthorizedError):
                client.do_get(flight.Ticket(forged), _bearer(SECRET.mint("*"))).read_all()
            # the star token lists everything
            everything = sorted(
                bytes(i.descriptor.path[0]).decode()
                for i in client.list_flights(b"", _bearer(SECRET.mint("*")))
            )
            assert everything == ["hidden", "trips", "trips/part-1"]
        finally:
            client.close()

    await asyncio.to_thread(calls)
    assert plane.unauthorized >= 9


@pytest.mark.parametrize("split", LAYOUTS)
async def test_the_endpoints_tickets_fetch_over_dissoc_and_nothing_else(split: bool) -> None:
    table, hidden = sample_table(batches=3), ordered_table(1, 5)
    async with serve_with_flight({"trips": table, "hidden": hidden}, split=split, secret=SECRET) as plane:
        location = plane.location
        token = SECRET.mint("trips")
        (uri, data_uri, ticket), *rest = await _thread(resolve, location, "trips", token=token)
        assert rest == [] and peek(ticket) is not None
        # the endpoint's ticket is what the dissoc servers want
        assert (await fetch_async(uri, ticket, data_uri=data_uri)).equals(table)
        # the name alone is not, and the ticket serves its dataset only
        with pytest.raises(RemoteError) as refused:
            await fetch_async(uri, "trips", data_uri=data_uri)
        assert refused.value.code == "unauthorized"
        # dissoc's own entry points: ClientOptions.token, or the signed ticket in place of the name
        options = ClientOptions(token=token)
        assert (await fetch_async(location, "trips", options=options)).equals(table)
        assert (await fetch_async(location, token)).equals(table)
        rows = 0
        async for batch in dissoc.stream_batches(location, "trips", options=options):
            rows += batch.num_rows
        assert rows == table.num_rows
        with pytest.raises(RemoteError) as no_token:
            await fetch_async(location, "trips")
        assert no_token.value.code == "unauthenticated"
        with pytest.raises(RemoteError) as not_granted:
            await fetch_async(location, "hidden", options=options)
        assert not_granted.value.code == "unauthorized"
        infos = await _thread(list_datasets, location, token=token)
        assert [i.name for i in infos] == ["trips"]
        assert all(peek(t) is not None for i in infos for _, _, t in i.endpoints)
        described = await _thread(describe, location, "trips", token=token)
        assert described.num_rows == table.num_rows


async def _thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return await asyncio.to_thread(fn, *args, **kwargs)


async def test_writes_need_a_write_token_for_the_name() -> None:
    table = ordered_table(1, 7)
    async with serve_with_flight({"trips": sample_table(batches=1)}, secret=SECRET) as plane:
        location = plane.location
        read = SECRET.mint("*")
        write_new = SECRET.mint("new", scope="write")
        for token in (None, read, SECRET.mint("new")):
            with pytest.raises(RemoteError) as refused:
                await _thread(publish, location, "new", table, token=token)
            assert refused.value.code == ("unauthenticated" if token is None else "unauthorized")
        assert "new" not in plane.server.catalog
        assert await _thread(publish, location, "new", table, token=write_new) == 7
        assert await _thread(publish, location, "new/part", table, token=write_new) == 7  # under its name
        # a write token for "new" neither replaces nor removes "trips"
        with pytest.raises(RemoteError) as other:
            await _thread(publish, location, "trips", table, replace=True, token=write_new)
        assert other.value.code == "unauthorized"
        for token in (None, read, write_new):
            with pytest.raises(RemoteError) as refused:
                await _thread(remove, location, "trips", token=token)
            assert refused.value.code in ("unauthenticated", "unauthorized")
        assert "trips" in plane.server.catalog
        await _thread(remove, location, "new", token=write_new)
        await _thread(remove, location, "trips", token=SECRET.mint("*", scope="write"))
        assert plane.server.catalog.names() == ["new/part"]
        # what was published is served to signed tickets like the rest
        got = await fetch_async(location, "new/part", options=ClientOptions(token=SECRET.mint("new")))
        assert got.equals(table)


async def test_a_read_only_plane_refuses_writes_whatever_the_token() -> None:
    async with (
        Server({"trips": sample_table(batches=1)}, secret=SECRET) as server,
        FlightControlPlane(server, read_only=True) as plane,
    ):
        admin = SECRET.mint("*", scope="write")
        with pytest.raises(RemoteError) as put:
            await _thread(publish, plane.location, "new", ordered_table(1, 3), token=admin)
        with pytest.raises(RemoteError) as rm:
            await _thread(remove, plane.location, "trips", token=admin)
        assert put.value.code == rm.value.code == "read_only"
        assert server.catalog.names() == ["trips"]
        # reading still works
        assert (await fetch_async(plane.location, "trips", options=ClientOptions(token=admin))).num_rows > 0


async def test_uploads_over_the_limit_are_refused() -> None:
    async with Server(secret=SECRET) as server:
        async with FlightControlPlane(server) as default_plane:
            assert default_plane.handlers.max_put_bytes == DEFAULT_MAX_PUT_BYTES == 1 << 30
        async with FlightControlPlane(server, max_put_bytes=1 << 20) as plane:
            admin = SECRET.mint("*", scope="write")
            big = ordered_table(4, 1 << 16)  # 2 MiB of int64
            with pytest.raises(RemoteError) as refused:
                await _thread(publish, plane.location, "big", big, token=admin)
            assert refused.value.code == "too_large"
            assert "1048576 bytes" in refused.value.message
            assert "big" not in server.catalog
            assert (
                await _thread(publish, plane.location, "small", ordered_table(1, 1000), token=admin) == 1000
            )


# ------------------------------------------------------------------------------------------ the command line


def _dissoc(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DISSOC_")}
    full_env.update(env or {})
    return subprocess.run(
        [PYTHON, "-m", "dissoc.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=full_env,
    )


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    path.write_bytes(KEY)
    path.chmod(0o600)
    return path


def _arrow_file(path: Path, table: pa.Table) -> Path:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return path


@pytest.mark.parametrize("split", LAYOUTS)
def test_cli_serve_with_a_secret_and_flight_then_get_with_a_token(
    secret_file: Path, tmp_path: Path, split: bool
) -> None:
    table = ordered_table(3, 50)
    path = _arrow_file(tmp_path / "trips.arrow", table)
    args = [str(path), "--flight", "0", "--secret-file", str(secret_file), *(["--split"] if split else [])]
    with cli_server(*args, count=1) as (_proc, lines):
        location = lines[0]["flight"]
        token = _dissoc("token", "--secret-file", str(secret_file), "trips").stdout.strip()
        for env, extra in (({}, ["--token", token]), ({"DISSOC_TOKEN": token}, []), ({}, [])):
            got = _dissoc("get", location, "trips", *extra, env=env)
            if env or extra:
                assert got.returncode == 0, got.stderr
                assert json.loads(got.stdout)["rows"] == table.num_rows
            else:
                assert got.returncode == 1 and "unauthenticated" in got.stderr, got.stderr
                assert "Traceback" not in got.stderr
        # the signed ticket itself, given as the ticket
        got = _dissoc("get", location, token)
        assert got.returncode == 0 and json.loads(got.stdout)["rows"] == table.num_rows, got.stderr


def test_cli_flight_read_only_and_upload_limit(secret_file: Path, tmp_path: Path) -> None:
    path = _arrow_file(tmp_path / "trips.arrow", ordered_table(1, 10))
    admin = SECRET.mint("*", scope="write")
    common = [str(path), "--flight", "0", "--secret-file", str(secret_file)]
    with cli_server(*common, "--flight-read-only", count=1) as (_proc, lines):
        with pytest.raises(RemoteError) as refused:
            publish(lines[0]["flight"], "new", ordered_table(1, 3), token=admin)
        assert refused.value.code == "read_only"
        with pytest.raises(RemoteError) as refused:
            remove(lines[0]["flight"], "trips", token=admin)
        assert refused.value.code == "read_only"
    with cli_server(*common, "--flight-max-put-mib", "1", count=1) as (_proc, lines):
        with pytest.raises(RemoteError) as too_big:
            publish(lines[0]["flight"], "big", ordered_table(4, 1 << 16), token=admin)
        assert too_big.value.code == "too_large"
        assert publish(lines[0]["flight"], "small", ordered_table(1, 100), token=admin) == 100
