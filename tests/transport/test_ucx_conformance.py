"""Conformance of the UCX wire mapping (DESIGN.md section 3, the dissoc ucx module docstring): a raw client
written against ucxx's low-level API only — no dissoc client, transport, protocol or codec code — performs
the documented connection set-up by hand (the listener path: connect to host:port and go, as the reference
mapping has it; the worker-address path: dissoc's hello/reply handshake), asks for a ticket
with a tagged want_data message, reads the metadata stream as UCX active messages, receives each body by a
masked tag probe on its sequence number, and decodes the stream with pyarrow alone.

The server is ``dissoc serve --transport ucx`` in a child process (combined and split layouts).
"""

from __future__ import annotations

import base64
import contextlib
import json
import mmap
import os
import signal
import struct
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import pyarrow as pa
import pytest
from helpers.e2e import sample_table
from helpers.ucx_wire import (
    as_bytes as _bytes,
)
from helpers.ucx_wire import (
    child_server,
    message_fields,
)
from helpers.ucx_wire import (
    gather_pairs as _gather_pairs,
)
from helpers.ucx_wire import (
    ucx_array as _array,
)
from helpers.ucx_wire import (
    ucx_context as _ucx_context,
)
from helpers.ucx_wire import (
    ucxx_lib as _lib,
)

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(120)]

T = TypeVar("T")

# The documented constants of the handshake (dissoc/transport/ucx/handshake.py), restated here on purpose: a
# change there is a wire change, and must fail this test.
MAGIC = b"DISSOC-UCX/1\0"
HELLO_TAG = 0x444953534F430001
REPLY_TAG = 0x444953534F430002
BYE_TAG = 0x444953534F430003
SEQ_MASK = 0x00000000FFFFFFFF
ALL_BITS = 0xFFFFFFFFFFFFFFFF
DEADLINE = 30.0  # seconds for any one wait (the machine is shared)


# -------------------------------------------------------------------------------------------- raw UCX client


class RawClient:
    """One connection to a dissoc ucx server, made and used with ucxx's low-level API and polling."""

    def __init__(self, uri: str, path: str) -> None:
        lib = _lib()
        self.lib = lib
        parts = urlsplit(uri)
        assert parts.scheme == "ucx", uri
        query = parse_qs(parts.query)
        self.want_data = int(query["want_data"][0])
        self.worker = lib.UCXWorker(_ucx_context())
        self._keep: list[Any] = []  # buffers of requests in flight
        hello = MAGIC + bytes(self.worker.address.tobytes())
        if path == "listener":
            # One endpoint to host:port (peer-failure handling on) for everything: no handshake.
            assert parts.hostname is not None and parts.port is not None
            self.bootstrap = lib.UCXEndpoint.create(self.worker, parts.hostname, parts.port, True)
            self.ep = self.bootstrap
            return
        # An endpoint to the listener worker's address (from the URI); HELLO_TAG out, REPLY_TAG back.
        listener_address = base64.b64decode(query["worker"][0], validate=True)
        self.bootstrap = self.worker.create_endpoint_from_worker_address(
            lib.UCXAddress.create_from_buffer(listener_address), True
        )
        self.wait(self.send_tagged(HELLO_TAG, hello, self.bootstrap), "sending the handshake")
        reply_tag, reply = self.recv_tagged(REPLY_TAG, ALL_BITS)
        assert reply_tag == REPLY_TAG
        assert reply.startswith(MAGIC) and len(reply) > len(MAGIC), f"not a handshake answer: {reply[:32]!r}"
        # The data endpoint: to the connection's own worker on the server.
        self.ep = self.worker.create_endpoint_from_worker_address(
            lib.UCXAddress.create_from_buffer(reply[len(MAGIC) :]), False
        )

    # -- progress

    def poll(self, ready: Callable[[], T | None], what: str, timeout: float = DEADLINE) -> T:
        deadline = time.monotonic() + timeout
        while True:
            self.worker.progress()
            result = ready()
            if result is not None and result is not False:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: nothing within {timeout} s")
            time.sleep(0.0002)

    def wait(self, request: Any, what: str) -> None:
        self.poll(lambda: request.completed, what)
        request.check_error()

    # -- messages

    def _send_am(self, endpoint: Any, data: bytes) -> Any:
        array = _array(data)
        self._keep.append((array, data))
        return endpoint.am_send(array)

    def send_tagged(self, tag: int, data: bytes, endpoint: Any = None) -> Any:
        array = _array(data)
        self._keep.append((array, data))
        return (endpoint or self.ep).tag_send(array, self.lib.UCXXTag(tag))

    def recv_am(self) -> bytes:
        """The next active message on the data endpoint (the metadata stream)."""
        request = self.ep.am_recv()
        self.wait(request, "a metadata-stream active message")
        return _bytes(request.recv_buffer)

    def probe(self, tag: int, mask: int) -> Any | None:
        probe = self.worker.tag_probe(self.lib.UCXXTag(tag), self.lib.UCXXTagMask(mask), False)
        return probe if probe.matched else None

    def recv_tagged(self, tag: int, mask: int) -> tuple[int, bytes]:
        """Probe (masked) for a tagged message, then receive it into a buffer of the length the probe gave."""
        lib = self.lib
        probe = self.poll(
            lambda: (lambda p: p if p.matched else None)(
                self.worker.tag_probe(lib.UCXXTag(tag), lib.UCXXTagMask(mask), True)
            ),
            f"a tagged message {tag:#x} (mask {mask:#x})",
        )
        sender_tag, length = int(probe.sender_tag.value), int(probe.length)
        buffer = bytearray(length)
        array = _array(buffer) if length else _array(bytearray(1))
        request = self.worker.tag_recv_with_handle(array, probe)
        self.wait(request, f"receiving tagged message {sender_tag:#x}")
        return sender_tag, bytes(buffer)

    # -- closing

    def close(self, bye: bool = True) -> None:
        """Say goodbye on the data endpoint (BYE_TAG; not to a server that already closed), then close both
        endpoints."""
        if bye:
            self.wait(self.send_tagged(BYE_TAG, MAGIC), "sending BYE")
        for endpoint in {id(e): e for e in (self.ep, self.bootstrap)}.values():
            if endpoint.alive:
                endpoint.close()
        deadline = time.monotonic() + 2
        while self.bootstrap.alive and time.monotonic() < deadline:
            self.worker.progress()
            time.sleep(0.001)
        self._keep.clear()


# -------------------------------------------------------------------------------------- the stream, by hand


def read_metadata_stream(client: RawClient) -> tuple[list[tuple[int, bytes]], int]:
    """Every metadata message (seq, flatbuffer) up to the end of stream, and the end of stream's number.

    Prefix: u8 type (1 = IPC metadata, 0 = end of stream, 0xE0 = error), u32 LE sequence number.
    """
    messages: list[tuple[int, bytes]] = []
    while True:
        message = client.recv_am()
        assert len(message) >= 5, f"a metadata-stream message shorter than its prefix: {message!r}"
        kind, seq = struct.unpack_from("<BI", message)
        if kind == 0:
            assert len(message) == 5, "the end of stream is exactly 5 bytes"
            return messages, seq
        assert kind == 1, f"expected type 1 (IPC metadata), got {kind:#x}: {message[:80]!r}"
        messages.append((seq, message[5:]))


def raw_fetch(
    meta: RawClient, data: RawClient, ticket: bytes, shm: mmap.mmap | None = None
) -> tuple[pa.Table, dict[str, Any]]:
    """Ask for ``ticket`` (on both connections when split) and rebuild the stream with pyarrow alone.

    With ``shm`` (the server's shared-memory segment), bodies are address/length pairs (body type 1): each
    listed buffer is copied out of the segment to its place in the packed body; ``info["offsets"]`` lists
    what to free."""
    meta.wait(meta.send_tagged(meta.want_data, ticket), "sending want_data")
    if data is not meta:
        data.wait(data.send_tagged(data.want_data, ticket), "sending want_data (data server)")
    messages, eos = read_metadata_stream(meta)
    seqs = [seq for seq, _ in messages]
    assert seqs == list(range(len(messages))), f"metadata sequence numbers in order from 0: {seqs}"
    assert eos == len(messages), "the end of stream carries the number of metadata messages sent"
    stream = bytearray()
    info: dict[str, Any] = {"types": [], "body_tags": [], "offsets": []}
    for seq, metadata in messages:
        header_type, body_length, buffers = message_fields(metadata)
        info["types"].append(header_type)
        body = b""
        if seq == 0:
            assert header_type == 1, "message 0 is the schema"
            assert body_length == 0
        else:
            assert header_type in (2, 3), (
                f"message {seq}: a DictionaryBatch or RecordBatch, got {header_type}"
            )
            # The body of message seq: tag = body type (bits 56-63) | seq (bits 0-31), matched on the seq.
            tag, body = data.recv_tagged(seq, SEQ_MASK)
            info["body_tags"].append(tag)
            assert tag & SEQ_MASK == seq
            assert tag & 0x00FFFFFF00000000 == 0, f"reserved tag bits set: {tag:#018x}"
            if shm is None:
                assert tag >> 56 == 0, f"body type 0 (packed) expected, got {tag >> 56}"
            else:
                assert tag >> 56 == 1, f"body type 1 (pairs) expected, got {tag >> 56}"
                body = _gather_pairs(body, buffers, body_length, shm, info["offsets"])
            assert len(body) == body_length, (seq, len(body), body_length)
        padding = -len(metadata) % 8
        stream += struct.pack("<Ii", 0xFFFFFFFF, len(metadata) + padding)
        stream += metadata + b"\0" * padding + body
    stream += struct.pack("<Ii", 0xFFFFFFFF, 0)
    return pa.ipc.open_stream(bytes(stream)).read_all(), info


# ------------------------------------------------------------------------------------------------- fixtures


SERVED = {"trips": sample_table(batches=4), "empty": sample_table(batches=1).slice(0, 0)}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The served tables as Arrow IPC files (the server's tickets are the file stems)."""
    root = tmp_path_factory.mktemp("conformance")
    paths = {}
    for name, table in SERVED.items():
        paths[name] = root / f"{name}.arrow"
        with pa.OSFile(str(paths[name]), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table)
    return paths


@pytest.fixture(scope="module", params=["combined", "split"])
def server(request: pytest.FixtureRequest, served: dict[str, Path]) -> Iterator[tuple[str, str]]:
    """``dissoc serve --transport ucx`` in a child process: (metadata URI, data URI)."""
    with cli_server(served, split=request.param == "split") as (_, uris):
        yield uris


@contextlib.contextmanager
def cli_server(served: dict[str, Path], split: bool = False) -> Iterator[tuple[Any, tuple[str, str]]]:
    """``dissoc serve --transport ucx`` on the served files: the process and (uri, data_uri)."""
    args = [str(served["trips"]), str(served["empty"]), *(["--split"] if split else [])]
    with child_server(["-m", "dissoc.cli", "serve", "--transport", "ucx", *args], 2) as (proc, lines):
        assert [line["ticket"] for line in lines] == ["trips", "empty"]
        yield proc, (lines[0]["uri"], lines[0]["data_uri"])


# A pairs server with a small arena (the command line has no option for its size).
PAIRS_SERVER = textwrap.dedent(
    """
    import asyncio, json, signal, sys
    from pathlib import Path
    from dissoc.server import Server

    async def main():
        arena, paths = int(sys.argv[1]), sys.argv[2:]
        datasets = {Path(p).stem: p for p in paths}
        server = Server(datasets, transport="ucx", body="pairs", memory="shm", arena_bytes=arena)
        async with server:
            stop = asyncio.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                asyncio.get_running_loop().add_signal_handler(sig, stop.set)
            for name in datasets:
                line = {"ticket": name, "uri": server.uri, "data_uri": server.data_uri}
                print(json.dumps(line), flush=True)
            await stop.wait()

    asyncio.run(main())
    """
)


def _connect(uris: tuple[str, str], path: str) -> tuple[RawClient, RawClient]:
    meta_uri, data_uri = uris
    meta = RawClient(meta_uri, path)
    data = meta if data_uri == meta_uri else RawClient(data_uri, path)
    return meta, data


def _close(meta: RawClient, data: RawClient) -> None:
    meta.close()
    if data is not meta:
        data.close()


# ---------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("path", ["listener", "address"])
def test_raw_client_fetches_the_table(server: tuple[str, str], path: str) -> None:
    meta, data = _connect(server, path)
    try:
        table, info = raw_fetch(meta, data, b"trips")
        assert table.equals(SERVED["trips"])
        assert table.schema.equals(SERVED["trips"].schema, check_metadata=True)
        # sample_table: one dictionary column, 4 batches -> schema, the dictionary, then the 4 batches
        assert info["types"] == [1, 2, 3, 3, 3, 3]
        assert [tag & SEQ_MASK for tag in info["body_tags"]] == [1, 2, 3, 4, 5]
        # The server keeps the connection for another request: the same stream again, renumbered from 0.
        again, _ = raw_fetch(meta, data, b"trips")
        assert again.equals(SERVED["trips"])
        empty, info = raw_fetch(meta, data, b"empty")
        assert empty.num_rows == 0 and empty.schema.equals(SERVED["empty"].schema)
        assert info["types"] == [1] and info["body_tags"] == []
    finally:
        _close(meta, data)


@pytest.mark.parametrize("path", ["listener", "address"])
def test_raw_client_unknown_ticket_gets_the_error_message(server: tuple[str, str], path: str) -> None:
    meta, data = _connect(server, path)
    try:
        meta.wait(meta.send_tagged(meta.want_data, b"no-such-ticket"), "sending want_data")
        message = meta.recv_am()
        kind, seq = struct.unpack_from("<BI", message)
        assert kind == 0xE0, f"expected the error message (0xE0), got {message[:80]!r}"
        assert seq == 0, "the error carries the next unused sequence number (none was used)"
        error = json.loads(message[5:].decode("utf-8"))
        assert error["code"] == "unknown_ticket"
        assert "no-such-ticket" in error["message"]
        if data is not meta:
            # The data server reports it on its only stream: tagged, body type 0xE0, the same message.
            data.wait(data.send_tagged(data.want_data, b"no-such-ticket"), "sending want_data (data server)")
            tag, payload = data.recv_tagged(0, 0)
            assert tag == 0xE0 << 56
            assert payload[0] == 0xE0 and json.loads(payload[5:])["code"] == "unknown_ticket"
        # The connection stays usable after the error.
        table, _ = raw_fetch(meta, data, b"trips")
        assert table.equals(SERVED["trips"])
    finally:
        _close(meta, data)


def test_raw_clients_on_both_paths_at_once_are_kept_apart(server: tuple[str, str]) -> None:
    """Two raw clients (one per path) connected at once, interleaving their requests: each connection
    has its own worker on the server, so each gets exactly its own stream."""
    first = _connect(server, "listener")
    second = _connect(server, "address")
    try:
        for meta, data in (first, second):
            meta.wait(meta.send_tagged(meta.want_data, b"trips"), "sending want_data")
            if data is not meta:
                data.wait(data.send_tagged(data.want_data, b"trips"), "sending want_data")
        for meta, _ in (second, first):
            messages, eos = read_metadata_stream(meta)
            assert eos == len(messages) == 6
        for _, data in (first, second):
            for seq in range(1, 6):
                tag, _ = data.recv_tagged(seq, SEQ_MASK)
                assert tag == seq
        # Nothing else arrives on either connection (a bounded look: progress for a moment, then probe).
        for _, data in (first, second):
            deadline = time.monotonic() + 0.3
            while time.monotonic() < deadline:
                data.worker.progress()
                time.sleep(0.005)
            assert data.probe(0, 0) is None, "a message arrived that belongs to no request of this client"
    finally:
        _close(*first)
        _close(*second)


INTS = pa.table({"v": pa.array(range(4 * 16384), pa.int64())}).to_batches(max_chunksize=16384)


@pytest.mark.parametrize("path", ["listener", "address"])
def test_raw_client_pairs_over_shared_memory_and_free_data(served: dict[str, Path], path: str) -> None:
    """Body type 1: the raw client reads each listed buffer from the server's segment (the data URI's
    ``remote_handle``), rebuilds the packed body, and frees the offsets with free_data. The arena holds one
    fetch of ``ints`` (512 KiB of buffers) but not two: fetching it again only works if the frees worked."""
    ints = served["trips"].parent / "ints.arrow"
    with pa.OSFile(str(ints), "wb") as sink, pa.ipc.new_file(sink, INTS[0].schema) as writer:
        for batch in INTS:
            writer.write_batch(batch)
    argv = ["-c", PAIRS_SERVER, str(768 << 10), str(served["trips"]), str(ints)]
    with child_server(argv, 2) as (_, lines):
        uri, data_uri = lines[0]["uri"], lines[0]["data_uri"]
        query = parse_qs(urlsplit(data_uri).query)
        assert query["memory"] == ["shm"]
        name = base64.b64decode(query["remote_handle"][0], validate=True).decode()
        free_data = int(query["free_data"][0])
        client = RawClient(uri, path)
        fd = os.open(f"/dev/shm/{name}", os.O_RDONLY)
        try:
            with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as shm:
                for ticket, expected in [
                    (b"trips", SERVED["trips"]),
                    *[(b"ints", pa.Table.from_batches(INTS))] * 2,
                ]:
                    got, info = raw_fetch(client, client, ticket, shm)
                    assert got.equals(expected), ticket
                    assert info["offsets"], "bodies went as pairs"
                    # free_data: little-endian u64 offsets, here in two messages
                    half = len(info["offsets"]) // 2
                    for part in (info["offsets"][:half], info["offsets"][half:]):
                        payload = struct.pack(f"<{len(part)}Q", *part)
                        client.wait(client.send_tagged(free_data, payload), "sending free_data")
        finally:
            os.close(fd)
            client.close()


def test_bye_from_the_client_makes_the_server_close_the_connection(server: tuple[str, str]) -> None:
    """A client's BYE_TAG: the server closes the connection, which on the listener path the client sees as
    its endpoint closing (peer-failure handling reports it)."""
    client = RawClient(server[0], "listener")
    try:
        client.wait(client.send_tagged(BYE_TAG, MAGIC), "sending BYE")
        client.poll(lambda: not client.bootstrap.alive, "the server closing the bootstrap endpoint")
    finally:
        client.close(bye=False)


@pytest.mark.parametrize("path", ["listener", "address"])
def test_server_says_bye_before_it_closes(served: dict[str, Path], path: str) -> None:
    """A server that stops (SIGTERM) sends BYE_TAG (payload MAGIC) on each connection's data endpoint."""
    with cli_server(served) as (proc, (uri, _)):
        client = RawClient(uri, path)
        try:
            got, _ = raw_fetch(client, client, b"trips")
            assert got.equals(SERVED["trips"])
            proc.send_signal(signal.SIGTERM)
            tag, payload = client.recv_tagged(BYE_TAG, ALL_BITS)
            assert (tag, payload) == (BYE_TAG, MAGIC)
        finally:
            client.close(bye=False)


@pytest.mark.parametrize("path", ["address"])
def test_a_handshake_with_a_corrupted_worker_address_does_not_crash_the_server(
    served: dict[str, Path], path: str
) -> None:
    # (Only the same-host path has a handshake.)
    """Bad input from the wire never crashes the server: a handshake carrying MAGIC and a worker address
    whose format version is unknown (UCX asserts on those) is rejected, and the server goes on serving."""
    with cli_server(served) as (proc, (uri, _)):
        lib = _lib()
        worker = lib.UCXWorker(_ucx_context())
        address = bytearray(worker.address.tobytes())
        address[0] |= 0x0F  # format version 15
        hello = _array(MAGIC + bytes(address))
        parts = urlsplit(uri)
        listener_address = base64.b64decode(parse_qs(parts.query)["worker"][0], validate=True)
        endpoint = worker.create_endpoint_from_worker_address(
            lib.UCXAddress.create_from_buffer(listener_address), True
        )
        request = endpoint.tag_send(hello, lib.UCXXTag(HELLO_TAG))
        deadline = time.monotonic() + DEADLINE
        while not request.completed and time.monotonic() < deadline:
            worker.progress()
            time.sleep(0.0005)
        assert request.completed, "sending the handshake did not complete"
        # The server rejects it or dies; give it a moment either way before asking whether it is still there.
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and proc.poll() is None:
            worker.progress()
            time.sleep(0.01)
        assert proc.poll() is None, f"the server died on a bad handshake (status {proc.returncode})"
        good = RawClient(uri, path)
        try:
            table, _ = raw_fetch(good, good, b"trips")
            assert table.equals(SERVED["trips"])
        finally:
            good.close()
