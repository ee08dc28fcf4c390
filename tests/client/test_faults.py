"""A real Server and client joined by the in-process transport with injected faults (server -> client):
reordering must be absorbed by sequence numbers; duplicates are protocol errors; drops and cuts fail with a
DissocError, quickly, never a hang."""

from __future__ import annotations

import itertools
import time

import pyarrow as pa
import pytest
from helpers.e2e import assert_ids_in_order, eventually, listener_connections, ordered_table, within

from dissoc.client import ClientOptions, fetch_async
from dissoc.errors import DissocError, ProtocolError, TransportError
from dissoc.server import Server
from dissoc.transport.inproc import Faults

pytestmark = pytest.mark.timeout(30)

BATCHES = 20
TABLE = ordered_table(BATCHES, 500, pad=16)
# Messages server -> client in the combined layout: 0 schema, then for batch k (1-based) metadata 2k-1 and
# body 2k, then the end of stream at 2 * BATCHES + 1.
EOS_INDEX = 2 * BATCHES + 1

_names = itertools.count()


def _server(faults: Faults | None = None, to_server: Faults | None = None) -> Server:
    return Server(
        {"t": TABLE},
        transport="inproc",
        host=f"e2e-faults-{next(_names)}",
        to_client=faults,
        to_server=to_server,
    )


async def _fetch(server: Server, timeout: float) -> tuple[pa.Table | BaseException, float]:
    started = time.monotonic()
    try:
        table = await within(
            timeout + 5, fetch_async(server.uri, "t", options=ClientOptions(timeout=timeout))
        )
    except AssertionError:
        raise
    except BaseException as e:
        return e, time.monotonic() - started
    return table, time.monotonic() - started


async def test_no_faults_baseline() -> None:
    async with _server() as server:
        assert server.uri.startswith("inproc://")
        got, _ = await _fetch(server, 5)
    assert isinstance(got, pa.Table)
    assert got.equals(TABLE)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("window", [4, 16])
async def test_reordered_bodies_still_succeed(seed: int, window: int) -> None:
    """Tagged bodies move freely (also relative to the metadata); metadata keeps its order."""
    async with _server(Faults(seed=seed, reorder_window=window, jitter=0.001)) as server:
        got, _ = await _fetch(server, 5)
    assert isinstance(got, pa.Table), f"reordering broke the stream: {got!r}"
    assert got.equals(TABLE)
    assert assert_ids_in_order(got.to_batches()) == TABLE.num_rows


@pytest.mark.parametrize("seed", [1, 2])
async def test_reordered_metadata_still_succeeds(seed: int) -> None:
    """Untagged (metadata-stream) messages reordered too, within a window: the spec has the client order
    everything by sequence number ("to ensure we do not rely on messages having to arrive in order"), and EOS
    means "safe to close if there are no gaps", i.e. it may overtake metadata."""
    async with _server(Faults(seed=seed, reorder_window=6, reorder_untagged=True)) as server:
        got, _ = await _fetch(server, 5)
    assert isinstance(got, pa.Table), f"metadata reordering broke the stream: {type(got).__name__}: {got}"
    assert got.equals(TABLE)


@pytest.mark.parametrize("index", [2, 10], ids=["body-1", "body-5"])
async def test_duplicated_body_is_a_protocol_error(index: int) -> None:
    async with _server(Faults(duplicate={index})) as server:
        got, elapsed = await _fetch(server, 3)
    assert isinstance(got, ProtocolError), f"expected ProtocolError, got {type(got).__name__}: {got}"
    assert elapsed < 1.5, f"took {elapsed:.2f} s: the duplicate was only noticed by the timeout"


@pytest.mark.parametrize("index", [1, 9], ids=["metadata-1", "metadata-5"])
async def test_duplicated_metadata_is_a_protocol_error(index: int) -> None:
    async with _server(Faults(duplicate={index})) as server:
        got, elapsed = await _fetch(server, 3)
    assert isinstance(got, ProtocolError), f"expected ProtocolError, got {type(got).__name__}: {got}"
    assert elapsed < 1.5


@pytest.mark.parametrize(
    ("index", "what"), [(4, "body"), (5, "metadata"), (EOS_INDEX, "end of stream"), (0, "schema")]
)
async def test_dropped_message_fails_cleanly(index: int, what: str) -> None:
    async with _server(Faults(drop={index})) as server:
        got, elapsed = await _fetch(server, 1.0)
    assert isinstance(got, (ProtocolError, TransportError)), (
        f"dropped {what}: got {type(got).__name__}: {got}"
    )
    assert elapsed < 4, f"dropped {what}: took {elapsed:.2f} s with a 1 s timeout"


async def test_dropped_want_data_times_out() -> None:
    async with _server(to_server=Faults(drop={0})) as server:
        got, elapsed = await _fetch(server, 1.0)
    assert isinstance(got, TransportError), f"got {type(got).__name__}: {got}"
    assert elapsed < 4


@pytest.mark.parametrize("after", [0, 1, 7, EOS_INDEX])
async def test_cut_connection_is_a_transport_error(after: int) -> None:
    async with _server(Faults(cut_after_messages=after)) as server:
        got, elapsed = await _fetch(server, 3)
        assert isinstance(got, TransportError), f"got {type(got).__name__}: {got}"
        assert elapsed < 1.5, f"took {elapsed:.2f} s: the cut was only noticed by the timeout"
        assert await eventually(lambda: listener_connections(server) in (0, None), 5), (
            "server handler still runs"
        )


async def test_cut_in_the_middle_of_a_body_is_a_transport_error() -> None:
    async with _server(Faults(cut_after_bytes=TABLE.nbytes // 2)) as server:
        got, elapsed = await _fetch(server, 3)
    assert isinstance(got, TransportError), f"got {type(got).__name__}: {got}"
    assert elapsed < 1.5


@pytest.mark.parametrize("seed", range(6))
async def test_corrupted_message_never_escapes_dissoc_error(seed: int) -> None:
    """One random byte flipped in one message: the client returns a table or raises a DissocError."""
    index = 1 + seed * 5
    async with _server(Faults(seed=seed, corrupt={index})) as server:
        got, _ = await _fetch(server, 2)
    assert isinstance(got, (pa.Table, DissocError)), f"escaped: {type(got).__name__}: {got}"


async def test_repeated_cut_connections_each_fail_cleanly() -> None:
    """Every connection of a faulty listener fails the same clean way and leaves no handler behind."""
    async with _server(Faults(cut_after_messages=3)) as server:
        for _ in range(3):
            got, _ = await _fetch(server, 2)
            assert isinstance(got, TransportError)
        assert await eventually(lambda: listener_connections(server) in (0, None), 5)
