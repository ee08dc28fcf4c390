"""The Flight control plane over ``grpc+tls://``: the dissoc client resolves and fetches through it (the
endpoints it hands out are ``tls://`` too), mutual TLS refuses a client without a certificate, an untrusted CA
is refused, and ``dissoc serve --flight`` with the TLS flags prints a ``grpc+tls://`` location that
``dissoc get`` reads with ``--tls-ca``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pytest
from helpers.e2e import PYTHON, REPO, cli_server, sample_table, within
from helpers.tls import Certs, make_certs

from dissoc.client import ClientOptions, fetch_async
from dissoc.errors import DissocError, TransportError
from dissoc.flight import FlightControlPlane, list_datasets, publish, resolve, serve_with_flight

pytest.importorskip("pyarrow.flight")

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def _options(certs: Certs, *, cert: bool = True, ca: Path | None = None) -> ClientOptions:
    return ClientOptions(
        timeout=10.0,
        flight_timeout=10.0,
        tls_ca=str(ca or certs.ca),
        tls_cert=str(certs.client_cert) if cert else None,
        tls_key=str(certs.client_key) if cert else None,
    )


async def test_fetch_through_a_grpc_tls_control_plane(certs: Certs) -> None:
    table = sample_table()
    async with serve_with_flight({"t": table}, tls_cert=certs.server_cert, tls_key=certs.server_key) as plane:
        assert plane.location.startswith("grpc+tls://127.0.0.1:")
        options = _options(certs, cert=False)
        got = await within(30, fetch_async(plane.location, "t", options=options))
        assert got.equals(table)
        ((uri, data_uri, ticket),) = await asyncio.to_thread(resolve, plane.location, "t", tls_ca=certs.ca)
        assert uri.startswith("tls://") and data_uri.startswith("tls://") and ticket == b"t"
        # without the CA, the system's roots: the test CA is not among them
        started = time.perf_counter()
        with pytest.raises(TransportError, match="grpc\\+tls://"):
            await asyncio.to_thread(list_datasets, plane.location, timeout=10)
        assert time.perf_counter() - started < 5


async def test_mutual_tls_control_plane(certs: Certs) -> None:
    async with serve_with_flight(
        {"t": sample_table()},
        tls_cert=certs.server_cert,
        tls_key=certs.server_key,
        tls_client_ca=certs.ca,
    ) as plane:
        got = await within(30, fetch_async(plane.location, "t", options=_options(certs)))
        assert got.num_rows == sample_table().num_rows
        rows = await asyncio.to_thread(
            publish,
            plane.location,
            "more",
            pa.table({"x": [1, 2, 3]}),
            tls_ca=certs.ca,
            tls_cert=certs.client_cert,
            tls_key=certs.client_key,
        )
        assert rows == 3
        for options in (_options(certs, cert=False), _options(certs, ca=certs.other_ca)):
            started = time.perf_counter()
            with pytest.raises(TransportError):
                await within(20, fetch_async(plane.location, "t", options=options))
            assert time.perf_counter() - started < 5


async def test_control_plane_tls_arguments_are_checked(certs: Certs) -> None:
    async with serve_with_flight({"t": sample_table()}) as plane:
        assert plane.location.startswith("grpc://")
        with pytest.raises(DissocError, match="need tls_cert"):
            FlightControlPlane(plane.server, tls_client_ca=certs.ca)
        with pytest.raises(DissocError, match="needs tls_key"):
            FlightControlPlane(plane.server, tls_cert=certs.server_cert)
        with pytest.raises(DissocError, match="tls_cert and tls_key together"):
            await asyncio.to_thread(list_datasets, plane.location, tls_cert=certs.client_cert)


def test_cli_serve_flight_with_tls_and_get_through_it(certs: Certs, tmp_path: Path) -> None:
    table = sample_table(batches=2)
    path = tmp_path / "trips.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    flags = ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)]
    flags += ["--tls-client-ca", str(certs.ca), "--flight", "0"]
    with cli_server(str(path), *flags, count=1) as (proc, lines):
        (line,) = lines
        assert line["flight"].startswith("grpc+tls://") and line["uri"].startswith("tls://")
        get = [PYTHON, "-m", "dissoc.cli", "get", line["flight"], "trips", "--no-progress", "--timeout", "10"]
        tls = [
            "--tls-ca",
            str(certs.ca),
            "--tls-cert",
            str(certs.client_cert),
            "--tls-key",
            str(certs.client_key),
        ]
        done = subprocess.run([*get, *tls], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["rows"] == table.num_rows
        refused = subprocess.run(
            [*get, "--tls-ca", str(certs.ca)], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert refused.returncode == 1 and "Traceback" not in refused.stderr
        assert proc.poll() is None
