"""libucp's per-message calls (:mod:`dissoc.transport.ucx.calls`): the C module and the ctypes fallback
make the same calls with the same results, each on its own and under the UCX transport and the client.

``kind`` runs a test with the C module's calls (``native``; skipped where it is not built) and with ctypes'
(``ctypes``): the process's calls are swapped for the test, so connections made in it use those.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from helpers.e2e import within
from helpers.transport import connected_pair

from dissoc.client import ClientOptions, fetch_async
from dissoc.errors import TransportError
from dissoc.server import Server
from dissoc.session.landing import Slabs
from dissoc.transport.ucx import calls as calls_module
from dissoc.transport.ucx.calls import Calls, native_module
from dissoc.transport.ucx.library import ucx_context, ucxx_lib
from dissoc.transport.ucx.libucp import UCS_INPROGRESS, UCS_OK, UcpRequestParam, ptr_is_err

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(60)]


MiB = 1 << 20
SOURCE = Path(calls_module.__file__).with_name("_fast.c")


@pytest.fixture(params=["native", "ctypes"])
def kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Calls]:
    """The process's per-message calls for this test: the C module's or ctypes'."""
    native = native_module() if request.param == "native" else None
    if request.param == "native" and native is None:
        pytest.skip("the C module dissoc.transport.ucx._fast is not built (no C compiler at install)")
    made = Calls(native)
    monkeypatch.setattr(calls_module, "_calls", made)
    yield made


def test_the_c_module_is_built_where_a_compiler_is() -> None:
    compiler = shutil.which(str(sysconfig.get_config_var("CC") or "cc").split()[0]) or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler: the install could not build dissoc.transport.ucx._fast")
    module = native_module()
    assert module is not None, "dissoc.transport.ucx._fast is missing: reinstall dissoc (pip install -e .)"
    built = Path(module.__file__)
    assert built.stat().st_mtime >= SOURCE.stat().st_mtime, (
        f"{built.name} is older than {SOURCE.name}: reinstall"
    )
    assert calls_module.calls().native


def test_native_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISSOC_UCX_NATIVE", "0")
    assert native_module() is None
    assert not Calls(None).native


class _Pair:
    """Two workers of this process joined by address, each progressed by :meth:`progress`."""

    def __init__(self) -> None:
        lib = ucxx_lib()
        self.a = lib.UCXWorker(ucx_context("default"))
        self.b = lib.UCXWorker(ucx_context("default"))
        address = lib.UCXAddress.create_from_buffer(bytes(self.b.address.tobytes()))
        self.ep = self.a.create_endpoint_from_worker_address(address, False)
        self.ep_handle = int(self.ep.handle)
        self.b_handle = int(self.b.handle)

    def progress(self) -> None:
        self.a.progress()
        self.b.progress()

    def until(self, done: Callable[[], Any], what: str) -> Any:
        deadline = time.monotonic() + 10
        while True:
            self.progress()
            got = done()
            if got:
                return got
            assert time.monotonic() < deadline, f"{what}: not within 10 s"


@pytest.fixture
def pair() -> Iterator[_Pair]:
    made = _Pair()
    yield made
    made.ep.close()
    for _ in range(100):
        made.progress()


def _param() -> tuple[UcpRequestParam, int]:
    param = UcpRequestParam()
    return param, ctypes.addressof(param)


def test_tagged_message_probed_and_received(kind: Calls, pair: _Pair) -> None:
    _, param = _param()
    payload = bytes(range(256)) * 64  # 16 KiB
    sent = kind.tag_send(pair.ep_handle, payload, len(payload), 0x0100_0000_0000_002A, param)
    assert not ptr_is_err(sent)
    assert kind.tag_probe(pair.b_handle, 7, 0xFFFF_FFFF_FFFF_FFFF, False) is None  # no such tag
    probed = pair.until(lambda: kind.tag_probe(pair.b_handle, 0x2A, 0xFFFF_FFFF, False), "the probe")
    _message, tag, length = probed
    assert (tag, length) == (0x0100_0000_0000_002A, len(payload))
    # looked at, not taken: a second probe finds it again, then takes it
    taken = kind.tag_probe(pair.b_handle, 0x2A, 0xFFFF_FFFF, True)
    assert taken is not None and taken[1:] == (tag, length)
    into = np.zeros(length, dtype=np.uint8)
    request = kind.tag_msg_recv(pair.b_handle, int(into.ctypes.data), length, taken[0], param)
    assert not ptr_is_err(request)
    if request:
        assert pair.until(lambda: kind.request_test(request) != UCS_INPROGRESS, "the receive")
    if sent:
        pair.until(lambda: kind.request_test(sent) == UCS_OK, "the send")
    assert into.tobytes() == payload
    assert kind.tag_probe(pair.b_handle, 0, 0, True) is None


def test_a_probe_takes_a_message_only_within_the_room_given(kind: Calls, pair: _Pair) -> None:
    _, param = _param()
    for tag, size in ((1, 100), (2, 5000)):
        sent = kind.tag_send(pair.ep_handle, bytes(size), size, tag, param)
        if sent:
            while (status := kind.request_test(sent)) == UCS_INPROGRESS:
                pair.progress()
            assert status == UCS_OK
    first = pair.until(lambda: kind.tag_probe_take(pair.b_handle, 0, 0, 1000), "the probe")
    assert first[0] and first[1:] == (1, 100)  # taken: within the room
    into = np.empty(5000, dtype=np.uint8)
    assert kind.tag_msg_recv(pair.b_handle, int(into.ctypes.data), 100, first[0], param) == 0
    assert kind.tag_probe_take(pair.b_handle, 0, 0, 1000) == (0, 2, 5000)  # looked at only
    assert kind.tag_probe_take(pair.b_handle, 0, 0, 4999) == (0, 2, 5000)
    second = kind.tag_probe_take(pair.b_handle, 2, 0xFFFF_FFFF_FFFF_FFFF, -1)  # no limit
    assert second is not None and second[0] and second[1:] == (2, 5000)
    assert kind.tag_msg_recv(pair.b_handle, int(into.ctypes.data), 5000, second[0], param) == 0
    assert kind.tag_probe_take(pair.b_handle, 0, 0, -1) is None


def test_send_from_an_address_and_a_pending_request(kind: Calls, pair: _Pair) -> None:
    _, param = _param()
    source = np.arange(4 * MiB, dtype=np.uint8)  # large enough for rendezvous: the send stays under way
    sent = kind.tag_send(pair.ep_handle, int(source.ctypes.data), source.nbytes, 5, param)
    assert not ptr_is_err(sent)
    probed = pair.until(lambda: kind.tag_probe(pair.b_handle, 5, 0xFFFF_FFFF_FFFF_FFFF, True), "the probe")
    into = np.empty(source.nbytes, dtype=np.uint8)
    request = kind.tag_msg_recv(pair.b_handle, int(into.ctypes.data), into.nbytes, probed[0], param)
    assert request and not ptr_is_err(request), "a rendezvous receive completes later"
    assert kind.request_test(request) == UCS_INPROGRESS
    pair.until(lambda: kind.request_test(request) == UCS_OK, "the receive")
    if sent:
        pair.until(lambda: kind.request_test(sent) == UCS_OK, "the send")
    assert np.array_equal(into, source)


def test_errors_are_pointers_not_crashes(kind: Calls) -> None:
    with pytest.raises(ValueError, match="NULL"):
        kind.tag_send(0, b"x", 1, 1, 0)
    with pytest.raises(ValueError, match="NULL"):
        kind.am_send(0, 0, b"", 0, b"x", 1, 0)
    with pytest.raises(ValueError, match="NULL"):
        kind.request_test(0)


async def test_transport_round_trips(kind: Calls) -> None:
    """Small and rendezvous-sized messages both ways (active messages and tagged ones, eager and not)."""
    import dissoc.transport.ucx  # noqa: F401 - registers the "ucx" scheme

    async with connected_pair("ucx", timeout=10) as (client, server):
        untagged = [b"", b"m" * 100, bytes(range(256)) * 4096]  # up to 1 MiB: a rendezvous active message
        for message in untagged:
            await client.send(message)
            await server.send(message)
        for message in untagged:
            assert bytes(await server.recv()) == message
            assert bytes(await client.recv()) == message
        bodies = [np.full(n, i, dtype=np.uint8).tobytes() for i, n in enumerate([16, 16 << 10, 4 * MiB])]
        for i, body in enumerate(bodies):
            await server.send_tagged(i, body)
        for i, body in enumerate(bodies):
            got = await client.recv_tagged(i)
            assert bytes(got.payload) == body


@pytest.mark.parametrize("path", ["address", "listener"])
async def test_client_streams_land_their_bodies(
    kind: Calls, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream of small batches over UCX: every body is received straight into a slab after room for its
    framing (the session's lander), and the table comes back whole."""
    landed: list[int] = []
    reserve = Slabs.reserve

    def counted(self: Slabs, metadata: bytes, nbytes: int) -> Any:
        got = reserve(self, metadata, nbytes)
        if got is not None:
            landed.append(nbytes)
        return got

    monkeypatch.setattr(Slabs, "reserve", counted)
    batches = [
        pa.record_batch({"a": np.arange(i, i + 1000, dtype=np.int64), "b": np.full(1000, i / 7)})
        for i in range(0, 20_000, 1000)
    ]
    table = pa.Table.from_batches(batches)
    async with Server({"t": table}, transport="ucx") as server:
        options = ClientOptions(timeout=30, ucx_path=path, reuse_connections=False)
        got = await within(30, fetch_async(server.uri, "t", options=options), "fetch")
    assert got.equals(table)
    assert len(landed) == len(batches), "every body should have landed in a slab"
    assert set(landed) == {16_000}


def test_contexts_send_messages_up_to_64_kib_eagerly() -> None:
    """A small body by rendezvous costs a round trip between the processes; UCX_RNDV_THRESH still wins.
    (In fresh interpreters: importing ucxx itself puts its defaults into the environment, as a user would.)"""
    code = (
        "from dissoc.transport.ucx.library import ucx_context;"
        "print(ucx_context('default').config['RNDV_THRESH'], ucx_context('listener').config['RNDV_THRESH'])"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_RNDV")}
    for extra, expected in (({}, "intra:64K,inter:64K"), ({"UCX_RNDV_THRESH": "8192"}, "intra:8K,inter:8K")):
        run = [sys.executable, "-c", code]
        done = subprocess.run(run, capture_output=True, text=True, env={**env, **extra}, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [expected, expected], extra


class _Collect:
    """A receiver that takes every message (as the client's session does)."""

    def __init__(self) -> None:
        self.got: list[tuple[int | None, bytes]] = []
        self.failed: list[Exception] = []

    def on_messages(self, messages: list[tuple[int | None, Any, int]], lent: bool) -> int:
        for tag, payload, nbytes in messages:
            body = payload[0] if isinstance(payload, tuple) else payload
            self.got.append((tag, bytes(memoryview(body)[:nbytes])))
        return len(messages)

    def on_failure(self, exc: Exception) -> None:
        self.failed.append(exc)


@pytest.mark.parametrize("raises", [False, True], ids=["lands", "raises"])
async def test_a_receivers_lander_places_runs_of_bodies(kind: Calls, raises: bool) -> None:
    """With a receiver and a lander, runs of tagged messages are taken, landed and received in one call
    each (tag_take_run); a body too large for the lander goes to the allocator, and a lander that raises
    fails the connection with a TransportError."""
    import dissoc.transport.ucx  # noqa: F401 - registers the "ucx" scheme

    slab = bytearray(1 << 20)
    base = ctypes.addressof(ctypes.c_char.from_buffer(slab))
    used = [0]

    def lander(tag: int, length: int) -> tuple[object, int] | None:
        if raises:
            raise RuntimeError("no room")
        if length > 4096:
            return None  # (the allocator's)
        at = used[0]
        used[0] += length
        return (memoryview(slab)[at : at + length], base + at)

    async with connected_pair("ucx", timeout=10) as (client, server):
        collect = _Collect()
        client.set_receiver(collect)
        client.set_lander(lander)
        bodies = [bytes([i]) * n for i, n in enumerate([100, 2000, 8000, 300, 4096])]
        for i, body in enumerate(bodies):
            await server.send_tagged(i, body)
        deadline = time.monotonic() + 10
        while len(collect.got) < len(bodies) and not collect.failed and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if raises:
            assert collect.failed and "the lander failed" in str(collect.failed[0])
            assert isinstance(collect.failed[0], TransportError)
        else:
            assert collect.got == list(enumerate(bodies))
            assert used[0] == 100 + 2000 + 300 + 4096  # the 8000-byte body went to the allocator
        client.set_receiver(None)
