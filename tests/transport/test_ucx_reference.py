"""Interoperability with the reference UCX mapping (issue 18; spec/FACTS.md section 4, DESIGN.md section 3):
dissoc's UCX server serves a peer that does exactly what apache/arrow-experiments' ``dissociated-ipc/``
client does, with no private handshake, and dissoc's client fetches from a server that does exactly what
that example's server does.

**Server side.** :class:`RefClient` is written with ucxx's low-level API only (no dissoc client, transport,
protocol or codec code; pyarrow decodes): it connects one endpoint to the listener's ``host:port`` (UCX
peer-failure handling on), sends want_data as a tagged message whose tag is the URI's ``want_data`` value
and whose payload is the ticket, and reads everything the server answers on that same endpoint: the
metadata stream as UCX active messages (the 5-byte prefix, then the flatbuffer ``Message``; the project's
error extension is prefix 0xE0 + JSON), and the bodies as tagged messages (tag = body type << 56 | seq)
found by probing its worker with the sequence number under the mask 0x00000000FFFFFFFF. In the split
layout it connects to both listeners and sends the same want_data to each. With pairs over shared memory
it copies each listed buffer out of the segment named in the data URI's ``remote_handle`` and sends
free_data (tagged, the URI's ``free_data`` value). The server is ``dissoc serve --transport ucx`` in a child
process. The wire constants are restated here on purpose: a change to them is a wire change.

**Client side.** ``REF_SERVER`` is a reference-style server written with ucxx and pyarrow alone, run in a
child process: a listener on its worker accepting one client at a time, want_data received by probing its
tag, the schema and each batch sent as active messages with the 5-byte prefix (the IPC stream split by
hand at its encapsulation boundaries), bodies as tagged messages (body type 0), then the end of stream.
``dissoc.client.fetch_async`` fetches from it through the listener, forced (``ucx_path="listener"``) and
chosen automatically for a URI without ``worker=``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import mmap
import os
import struct
import subprocess
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit, urlunsplit

import pyarrow as pa
import pytest
from helpers.e2e import PYTHON, REPO, read_lines
from helpers.ucx_wire import (
    BODY_PACKED,
    BODY_PAIRS,
    KIND_EOS,
    KIND_ERROR,
    KIND_METADATA,
    RESERVED_BITS,
    SEQ_MASK,
    SPLIT_STREAM,
    child_server,
    message_fields,
    plain_table,
)
from helpers.ucx_wire import (
    as_bytes as _bytes,
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

pytest.importorskip("ucxx")

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(180)]

T = TypeVar("T")

# (the wire's constants come from helpers.ucx_wire, restated there on purpose)
ALL_BITS = 0xFFFFFFFFFFFFFFFF
MAX_TICKET_BYTES = 64 << 10  # the server's default max_ticket_bytes
DEADLINE = 20.0  # seconds for any one wait (the machine is shared)


# -------------------------------------------------------------------------------------- the reference client


class RefClient:
    """A reference-style peer: its own worker and ONE endpoint, to the listener at the URI's host:port.

    Nothing is sent before want_data (no handshake), and every answer is expected on that endpoint. The
    URI's other parameters (``worker=`` included) are ignored, as the reference client ignores them."""

    def __init__(self, uri: str) -> None:
        lib = _lib()
        self.lib = lib
        parts = urlsplit(uri)
        assert parts.scheme == "ucx", uri
        assert parts.hostname is not None and parts.port is not None, uri
        query = parse_qs(parts.query)
        self.want_data = int(query["want_data"][0])
        self.free_data = int(query["free_data"][0]) if "free_data" in query else None
        self.worker = lib.UCXWorker(_ucx_context())
        self._keep: list[Any] = []  # buffers of requests in flight
        self.ep = lib.UCXEndpoint.create(self.worker, parts.hostname, parts.port, True)

    # -- progress

    def poll(self, ready: Callable[[], T | None], what: str, timeout: float = DEADLINE) -> T:
        """Progress the worker until ``ready()`` gives something; fail (saying why) at the deadline or when
        the server closed the connection and nothing ready remains."""
        deadline = time.monotonic() + timeout
        while True:
            self.worker.progress()
            result = ready()
            if result is not None and result is not False:
                return result
            if not self.ep.alive:
                # one more round: what arrived before the close is still delivered
                self.worker.progress()
                result = ready()
                if result is not None and result is not False:
                    return result
                raise AssertionError(f"{what}: the server closed the connection")
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: nothing within {timeout} s")
            time.sleep(0.0002)

    def check(self, request: Any, what: str) -> None:
        """A completed request's error, if any, as a test failure that says what was waited for (UCX
        cancels the requests of an endpoint the server closed)."""
        try:
            request.check_error()
        except Exception as exc:
            closed = "" if self.ep.alive else " (the server closed the connection)"
            raise AssertionError(f"{what}: {type(exc).__name__}: {exc}{closed}") from exc

    def wait(self, request: Any, what: str) -> None:
        self.poll(lambda: request.completed, what)
        self.check(request, what)

    def idle(self, seconds: float) -> None:
        """Progress for ``seconds`` (letting anything in flight arrive)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.worker.progress()
            time.sleep(0.002)

    # -- messages

    def send_tagged(self, tag: int, data: bytes) -> None:
        """A tagged message with exactly this tag (ucxx's low-level send: no tag mixing)."""
        array = _array(data)
        self._keep.append((array, data))
        self.wait(self.ep.tag_send(array, self.lib.UCXXTag(tag)), f"sending a tagged message {tag:#x}")

    def recv_am(self, what: str = "a metadata-stream active message", timeout: float = DEADLINE) -> bytes:
        """The next active message on the endpoint (the metadata stream)."""
        request = self.ep.am_recv()
        self.poll(lambda: request.completed, what, timeout)
        self.check(request, what)
        return _bytes(request.recv_buffer)

    def probe(self, tag: int, mask: int) -> Any | None:
        """A non-removing probe: the matching message's probe info, or None."""
        probe = self.worker.tag_probe(self.lib.UCXXTag(tag), self.lib.UCXXTagMask(mask), False)
        return probe if probe.matched else None

    def recv_tagged(self, tag: int, mask: int, what: str = "") -> tuple[int, bytes]:
        """Probe (masked, removing) for a tagged message, then receive it into a buffer of the length the
        probe gave, as the reference client does (``ucp_tag_probe_nb`` then ``ucp_tag_msg_recv_nbx``)."""
        lib = self.lib
        what = what or f"a tagged message {tag:#x} (mask {mask:#x})"

        def matched() -> Any | None:
            probe = self.worker.tag_probe(lib.UCXXTag(tag), lib.UCXXTagMask(mask), True)
            return probe if probe.matched else None

        probe = self.poll(matched, what)
        sender_tag, length = int(probe.sender_tag.value), int(probe.length)
        buffer = bytearray(max(length, 1))
        request = self.worker.tag_recv_with_handle(_array(buffer), probe)
        self.poll(lambda: request.completed, f"receiving tagged message {sender_tag:#x}")
        self.check(request, what)
        return sender_tag, bytes(buffer[:length])

    # -- closing

    def close(self) -> None:
        """Close the endpoint (the reference client's disconnect) and let UCX complete it."""
        if self.ep.alive:
            self.ep.close()
        deadline = time.monotonic() + 2
        while self.ep.alive and time.monotonic() < deadline:
            self.worker.progress()
            time.sleep(0.001)
        self._keep.clear()


# -------------------------------------------------------------------------------------- the stream, by hand


def collect_stream(
    meta: RefClient, data: RefClient
) -> tuple[list[tuple[int, bytes]], int, dict[int, tuple[int, bytes]]]:
    """The metadata stream (seq, flatbuffer) up to the end of stream, the end of stream's number, and each
    batch's body (seq -> (tag, payload)), taken as they come: a body is probed for (its seq under the mask,
    removing) as soon as its metadata arrived, so a server that waits for a body to be received before it
    sends the next metadata message is served too.

    Prefix: u8 type (1 = IPC metadata, 0 = end of stream, 0xE0 = error), u32 LE sequence number."""
    lib = meta.lib
    messages: list[tuple[int, bytes]] = []
    bodies: dict[int, tuple[int, bytes]] = {}
    receiving: dict[int, tuple[Any, Any, bytearray, int]] = {}  # seq -> (request, probe, buffer, length)
    wanted: list[int] = []
    am = meta.ep.am_recv()
    eos: int | None = None
    deadline = time.monotonic() + DEADLINE
    while eos is None or len(bodies) < len(wanted):
        meta.worker.progress()
        if data is not meta:
            data.worker.progress()
        activity = False
        if eos is None and am.completed:
            meta.check(
                am, "the first metadata-stream active message" if not messages else "a metadata message"
            )
            message = _bytes(am.recv_buffer)
            activity = True
            assert len(message) >= 5, f"a metadata-stream message shorter than its prefix: {message!r}"
            kind, seq = struct.unpack_from("<BI", message)
            if kind == KIND_EOS:
                assert len(message) == 5, "the end of stream is exactly 5 bytes"
                eos = seq
            else:
                assert kind == KIND_METADATA, (
                    f"expected type 1 (IPC metadata), got {kind:#x}: {message[:200]!r}"
                )
                messages.append((seq, message[5:]))
                if seq != 0:
                    wanted.append(seq)
                am = meta.ep.am_recv()
        for seq in wanted:
            if seq in bodies or seq in receiving:
                continue
            probe = data.worker.tag_probe(lib.UCXXTag(seq), lib.UCXXTagMask(SEQ_MASK), True)
            if probe.matched:
                length = int(probe.length)
                buffer = bytearray(max(length, 1))
                request = data.worker.tag_recv_with_handle(_array(buffer), probe)
                receiving[seq] = (request, probe, buffer, length)
                activity = True
        for seq, (request, probe, buffer, length) in list(receiving.items()):
            if request.completed:
                data.check(request, f"the body of message {seq}")
                bodies[seq] = (int(probe.sender_tag.value), bytes(buffer[:length]))
                del receiving[seq]
                activity = True
        if activity:
            deadline = time.monotonic() + DEADLINE
            continue
        where = (
            "the first metadata-stream active message"
            if not messages
            else (
                "the end of stream"
                if eos is None
                else f"the bodies of messages {sorted(set(wanted) - set(bodies))}"
            )
        )
        for client in {id(meta): meta, id(data): data}.values():
            if not client.ep.alive:
                # what arrived before the close is still taken (the next round); then it is over
                client.worker.progress()
                arrived = (eos is None and am.completed) or any(r.completed for r, *_ in receiving.values())
                if not arrived:
                    raise AssertionError(f"waiting for {where}: the server closed the connection")
        if time.monotonic() > deadline:
            raise AssertionError(f"waiting for {where}: nothing within {DEADLINE} s")
        time.sleep(0.0002)
    return messages, eos, bodies


def ref_fetch(
    meta: RefClient, data: RefClient, ticket: bytes, shm: mmap.mmap | None = None
) -> tuple[pa.Table, dict[str, Any]]:
    """Ask for ``ticket`` (want_data to both servers when split) and rebuild the stream with pyarrow alone.

    With ``shm`` (the server's shared-memory segment) bodies must be pair lists (body type 1): each listed
    buffer is copied out of the segment to its place in the packed body; ``info["offsets"]`` lists what to
    free. ``info``: ``types`` (header type per message), ``body_tags`` (in seq order)."""
    meta.send_tagged(meta.want_data, ticket)
    if data is not meta:
        data.send_tagged(data.want_data, ticket)
    messages, eos, bodies = collect_stream(meta, data)
    seqs = [seq for seq, _ in messages]
    assert seqs == list(range(len(messages))), f"metadata sequence numbers in order from 0: {seqs}"
    assert eos == len(messages), f"the end of stream carries the next unused number ({len(messages)}): {eos}"
    assert sorted(bodies) == seqs[1:], "one body per message after the schema"
    stream = bytearray()
    info: dict[str, Any] = {"types": [], "body_tags": [], "offsets": []}
    for seq, metadata in messages:
        header_type, body_length, buffers = message_fields(metadata)
        info["types"].append(header_type)
        body = b""
        if seq == 0:
            assert header_type == 1, f"message 0 is the schema, got header type {header_type}"
            assert body_length == 0, "the schema has no body"
        else:
            assert header_type in (2, 3), (
                f"message {seq}: a DictionaryBatch or RecordBatch, got {header_type}"
            )
            # The body of message seq: tag = body type (bits 56-63) | seq (bits 0-31), matched on the seq.
            tag, body = bodies[seq]
            info["body_tags"].append(tag)
            assert tag & SEQ_MASK == seq
            assert tag & RESERVED_BITS == 0, f"reserved tag bits set: {tag:#018x}"
            if shm is None:
                assert tag >> 56 == BODY_PACKED, f"body type 0 (packed) expected, got {tag >> 56}"
            else:
                assert tag >> 56 == BODY_PAIRS, f"body type 1 (pairs) expected, got {tag >> 56}"
                body = _gather_pairs(body, buffers, body_length, shm, info["offsets"])
            assert len(body) == body_length, (seq, len(body), body_length)
        padding = -len(metadata) % 8
        stream += struct.pack("<Ii", 0xFFFFFFFF, len(metadata) + padding)
        stream += metadata + b"\0" * padding + body
    stream += struct.pack("<Ii", 0xFFFFFFFF, 0)
    return pa.ipc.open_stream(bytes(stream)).read_all(), info


def assert_nothing_else_arrives(client: RefClient) -> None:
    """After a stream: no tagged message is left that belongs to no request (a bounded look)."""
    client.idle(0.3)
    assert client.probe(0, 0) is None, "a tagged message arrived that belongs to no request"


# ------------------------------------------------------------------------------------------------ datasets


def mixed_table() -> pa.Table:
    """3 batches of: a dictionary-encoded column with nulls, strings with nulls, list<struct<int, string>>,
    struct<list<int>, bool>, a map and large binary with nulls."""
    dictionary = pa.array(["alpha", "beta", "gamma"])
    item = pa.struct([("k", pa.int32()), ("v", pa.string())])
    out = []
    for b in range(3):
        ids = list(range(b * 301, (b + 1) * 301))
        out.append(
            pa.record_batch(
                {
                    "d": pa.DictionaryArray.from_arrays(
                        pa.array([None if i % 9 == 0 else i % 3 for i in ids], pa.int16()), dictionary
                    ),
                    "s": pa.array([None if i % 4 == 0 else f"s{i}" * (i % 5) for i in ids], pa.string()),
                    "ls": pa.array(
                        [
                            None
                            if i % 6 == 0
                            else [{"k": j, "v": None if j % 2 else f"v{j}"} for j in range(i % 4)]
                            for i in ids
                        ],
                        pa.list_(item),
                    ),
                    "st": pa.array(
                        [None if i % 10 == 0 else {"xs": list(range(i % 3)), "ok": i % 2 == 0} for i in ids],
                        pa.struct([("xs", pa.list_(pa.int64())), ("ok", pa.bool_())]),
                    ),
                    "m": pa.array(
                        [[(f"k{i}", i)] if i % 7 else None for i in ids], pa.map_(pa.string(), pa.int64())
                    ),
                    "bin": pa.array(
                        [None if i % 8 == 0 else bytes([i % 256]) * (i % 11) for i in ids], pa.large_binary()
                    ),
                }
            )
        )
    return pa.Table.from_batches(out)


def big_table() -> pa.Table:
    """64 batches of 1 MiB (int64): a stream long enough to leave mid-way."""
    batches = [pa.record_batch({"v": pa.array(range(b << 17, (b + 1) << 17), pa.int64())}) for b in range(64)]
    return pa.Table.from_batches(batches)


SERVED: dict[str, pa.Table] = {"plain": plain_table(), "mixed": mixed_table()}
#: header types of each stream: the schema, (the dictionary,) then the record batches
TYPES = {"plain": [1] + [3] * 8, "mixed": [1, 2, 3, 3, 3]}


def _write(path: Path, table: pa.Table) -> Path:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The served tables as Arrow IPC files (the server's tickets are the file stems)."""
    root = tmp_path_factory.mktemp("reference")
    paths = {name: _write(root / f"{name}.arrow", table) for name, table in SERVED.items()}
    paths["big"] = _write(root / "big.arrow", big_table())
    return paths


# ----------------------------------------------------------------------------------------- child processes


@contextlib.contextmanager
def dissoc_server(
    files: list[Path], *options: str, split: bool = False
) -> Iterator[tuple[Any, tuple[str, str]]]:
    """``dissoc serve --transport ucx FILES...``: the process and (uri, data_uri) (the same when combined)."""
    argv = ["-m", "dissoc.cli", "serve", "--transport", "ucx", *(["--split"] if split else []), *options]
    with child_server([*argv, *map(str, files)], len(files)) as (proc, lines):
        assert [line["ticket"] for line in lines] == [f.stem for f in files]
        uri, data_uri = lines[0]["uri"], lines[0]["data_uri"]
        assert (uri != data_uri) == split
        yield proc, (uri, data_uri)


@pytest.fixture(scope="module", params=["combined", "split"])
def server(request: pytest.FixtureRequest, served: dict[str, Path]) -> Iterator[tuple[str, str]]:
    """``dissoc serve --transport ucx`` (packed bodies) on plain and mixed: (metadata URI, data URI)."""
    with dissoc_server([served["plain"], served["mixed"]], split=request.param == "split") as (_, uris):
        yield uris


def _connect(uris: tuple[str, str]) -> tuple[RefClient, RefClient]:
    meta_uri, data_uri = uris
    meta = RefClient(meta_uri)
    data = meta if data_uri == meta_uri else RefClient(data_uri)
    return meta, data


def _close(meta: RefClient, data: RefClient) -> None:
    meta.close()
    if data is not meta:
        data.close()


# ------------------------------------------------------------------------------- tests: dissoc's server


@pytest.mark.parametrize("ticket", ["plain", "mixed"])
def test_reference_client_fetches_the_table(server: tuple[str, str], ticket: str) -> None:
    """A reference-style client (listener endpoint, tagged want_data, no handshake) gets the whole stream:
    5-byte prefixes, the schema as seq 0, the messages in order, one body per batch tagged body type 0 | seq,
    the end of stream carrying the count; pyarrow rebuilds a table equal to the source. The connection then
    serves a second request, numbered from 0 again, and nothing stray is left on it."""
    meta, data = _connect(server)
    try:
        for _ in range(2):
            table, info = ref_fetch(meta, data, ticket.encode())
            assert table.equals(SERVED[ticket]), ticket
            assert table.schema.equals(SERVED[ticket].schema, check_metadata=True)
            assert info["types"] == TYPES[ticket]
            assert info["body_tags"] == list(range(1, len(TYPES[ticket])))  # body type 0: the tag is the seq
        assert_nothing_else_arrives(data)
        if data is not meta:
            assert_nothing_else_arrives(meta)
    finally:
        _close(meta, data)


def test_reference_client_unknown_ticket_gets_the_error_message(server: tuple[str, str]) -> None:
    """An unknown ticket: the metadata stream answers with the 0xE0 error message (seq 0, JSON with code
    ``unknown_ticket``); in the split layout the data server answers on its only stream with a tagged
    message of body type 0xE0 carrying the same message. The connection then serves a valid ticket."""
    meta, data = _connect(server)
    try:
        meta.send_tagged(meta.want_data, b"no-such-ticket")
        message = meta.recv_am("the answer to an unknown ticket")
        kind, seq = struct.unpack_from("<BI", message)
        assert kind == KIND_ERROR, f"expected the error message (0xE0), got {message[:80]!r}"
        assert seq == 0, "the error carries the next unused sequence number (none was used)"
        error = json.loads(message[5:].decode("utf-8"))
        assert error["code"] == "unknown_ticket"
        assert "no-such-ticket" in error["message"]
        if data is not meta:
            data.send_tagged(data.want_data, b"no-such-ticket")
            tag, payload = data.recv_tagged(0, 0, "the data server's answer to an unknown ticket")
            assert tag == KIND_ERROR << 56
            assert payload[0] == KIND_ERROR and json.loads(payload[5:])["code"] == "unknown_ticket"
        table, _ = ref_fetch(meta, data, b"plain")
        assert table.equals(SERVED["plain"])
    finally:
        _close(meta, data)


def test_two_reference_clients_at_once_are_kept_apart(server: tuple[str, str]) -> None:
    """Two reference clients connected at once, interleaving their requests for different tickets: each
    gets exactly its own stream (the server tells their want_data apart without any help from them)."""
    first, second = _connect(server), _connect(server)
    try:
        for (meta, data), name in ((first, "plain"), (second, "mixed")):
            meta.send_tagged(meta.want_data, name.encode())
            if data is not meta:
                data.send_tagged(data.want_data, name.encode())
        for (meta, data), ticket in ((second, "mixed"), (first, "plain")):
            messages, eos, bodies = collect_stream(meta, data)
            assert eos == len(messages) == len(TYPES[ticket]), ticket
            assert [message_fields(m)[0] for _, m in messages] == TYPES[ticket]
            assert sorted(bodies) == list(range(1, eos))
            for seq, (tag, body) in bodies.items():
                assert tag == seq
                assert len(body) == message_fields(messages[seq][1])[1]
        for _, data in (first, second):
            assert_nothing_else_arrives(data)
    finally:
        _close(*first)
        _close(*second)


PAIRS_ARENA_MIB = 4  # the default quota is a quarter: 1 MiB, one fetch of "plain"


@pytest.mark.parametrize("layout", ["combined", "split"])
def test_reference_client_pairs_over_shared_memory_and_free_data(
    served: dict[str, Path], layout: str
) -> None:
    """``--body pairs --memory shm``: bodies are pair lists (body type 1, one pair per buffer); the client
    copies each listed buffer out of the segment named in the data URI's ``remote_handle`` and frees the
    offsets with a tagged free_data (the URI's ``free_data`` tag, little-endian u64 offsets) on the data
    connection. A client may hold 1 MiB unfreed (a quarter of the 4 MiB arena) and one fetch of ``plain``
    lists 1 MiB: the fetches after the first work only if the frees did."""
    options = ["--body", "pairs", "--memory", "shm", "--arena-mib", str(PAIRS_ARENA_MIB)]
    with dissoc_server([served["plain"], served["mixed"]], *options, split=layout == "split") as (_, uris):
        query = parse_qs(urlsplit(uris[1]).query)
        assert query["memory"] == ["shm"]
        name = base64.b64decode(query["remote_handle"][0], validate=True).decode()
        meta, data = _connect(uris)
        assert data.free_data is not None, "a pairs data URI names its free_data tag"
        fd = os.open(f"/dev/shm/{name}", os.O_RDONLY)
        try:
            with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as shm:
                for ticket in ["plain", "mixed", "plain", "plain"]:
                    got, info = ref_fetch(meta, data, ticket.encode(), shm)
                    assert got.equals(SERVED[ticket]), ticket
                    assert info["types"] == TYPES[ticket]
                    assert [t & SEQ_MASK for t in info["body_tags"]] == list(range(1, len(TYPES[ticket])))
                    assert info["offsets"], "bodies went as pairs"
                    payload = struct.pack(f"<{len(info['offsets'])}Q", *info["offsets"])
                    data.send_tagged(data.free_data, payload)
        finally:
            os.close(fd)
            _close(meta, data)


# --------------------------------------------------------------------------- robustness of dissoc's server


def fd_count(pid: int) -> int:
    """The descriptors process ``pid`` has open (UCX workers, endpoints and shared memory hold some)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def _serve_one(uri: str, ticket: str = "plain") -> float:
    """A normal reference client's fetch (connect, fetch, disconnect); the seconds it took."""
    start = time.monotonic()
    client = RefClient(uri)
    try:
        table, _ = ref_fetch(client, client, ticket.encode())
        assert table.equals(SERVED[ticket])
    finally:
        client.close()
    return time.monotonic() - start


def _baseline(proc: Any, uri: str) -> int:
    """The server's fd count at rest after two normal clients came and went (UCX opens some of its
    resources on first use): stable for a second."""
    for _ in range(2):
        _serve_one(uri)
    previous, deadline = -1, time.monotonic() + 10
    while time.monotonic() < deadline:
        now = fd_count(proc.pid)
        if now == previous:
            return now
        previous = now
        time.sleep(1.0)
    return previous


def _assert_recovered(proc: Any, uri: str, baseline: int, what: str) -> None:
    """After ``what``: the server is alive, serves a normal client promptly, and its fd count comes back
    to ``baseline`` within a few seconds."""
    assert proc.poll() is None, f"the server died after {what} (status {proc.returncode})"
    took = _serve_one(uri)
    assert took < 10, f"after {what}, a normal client took {took:.1f} s"
    assert proc.poll() is None, f"the server died after {what} (status {proc.returncode})"
    deadline = time.monotonic() + 8
    while (count := fd_count(proc.pid)) > baseline and time.monotonic() < deadline:
        time.sleep(0.25)
    assert count <= baseline, f"after {what}: {count} fds open in the server, {baseline} before"


@pytest.fixture
def robust_server(served: dict[str, Path]) -> Iterator[tuple[Any, str, int]]:
    """A combined ``dissoc serve --transport ucx --want-data-timeout 1`` on plain, mixed and big: the
    process, its URI and its fd baseline."""
    files = [served["plain"], served["mixed"], served["big"]]
    with dissoc_server(files, "--want-data-timeout", "1") as (proc, (uri, _)):
        yield proc, uri, _baseline(proc, uri)


# A reference client in its own process that asks for "big", reads the start of the stream, says so, and
# waits to be killed.
KILLED_CLIENT = textwrap.dedent(
    """
    import os, struct, sys, time
    from urllib.parse import parse_qs, urlsplit
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx._lib.libucxx as lib
    from ucxx._lib.arr import Array

    parts = urlsplit(sys.argv[1])
    want_data = int(parse_qs(parts.query)["want_data"][0])
    context = lib.UCXContext({}, (lib.Feature.TAG, lib.Feature.AM))
    worker = lib.UCXWorker(context)
    ep = lib.UCXEndpoint.create(worker, parts.hostname, parts.port, True)

    def wait(request):
        deadline = time.monotonic() + 20
        while not request.completed:
            if time.monotonic() > deadline:
                sys.exit("timed out")
            worker.progress()
            time.sleep(0.0002)
        request.check_error()
        return request

    ticket = b"big"
    wait(ep.tag_send(Array(ticket), lib.UCXXTag(want_data)))
    for _ in range(2):  # the schema and the first batch's metadata (its body is never taken)
        wait(ep.am_recv())
    print("streaming", flush=True)
    while True:
        worker.progress()
        time.sleep(0.01)
    """
)


@pytest.mark.parametrize("how", ["close", "kill"])
def test_a_client_that_leaves_mid_stream_costs_nothing_lasting(
    robust_server: tuple[Any, str, int], how: str
) -> None:
    """A reference client asks for 64 MiB and leaves after the first metadata messages without receiving a
    body: closing its endpoint, or killed (SIGKILL) in its own process. The server stays up, serves the
    next client promptly, and releases what the connection held (fd count back to the baseline)."""
    proc, uri, baseline = robust_server
    if how == "close":
        client = RefClient(uri)
        client.send_tagged(client.want_data, b"big")
        for _ in range(2):
            message = client.recv_am()
            assert message[0] == KIND_METADATA
        client.close()
    else:
        peer = subprocess.Popen(
            [PYTHON, "-c", KILLED_CLIENT, uri], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            line = peer.stdout.readline() if peer.stdout is not None else b""
            assert line.strip() == b"streaming", (line, peer.stderr.read() if peer.stderr else b"")
        finally:
            peer.kill()
            peer.communicate(timeout=10)
    _assert_recovered(proc, uri, baseline, f"a client that left mid-stream ({how})")


def test_an_oversized_want_data_is_refused_and_costs_nothing_lasting(
    robust_server: tuple[Any, str, int],
) -> None:
    """64 KiB + 1 of junk on the want_data tag (over max_ticket_bytes): the server drops the connection
    (after, at most, a ``request_too_large`` error message), stays up, and serves the next client."""
    proc, uri, baseline = robust_server
    client = RefClient(uri)
    try:
        # posted, not waited for: the server may drop the connection without taking the payload (it is
        # refused from its size), and then this send fails, as it should
        junk = _array(os.urandom(MAX_TICKET_BYTES + 1))
        send = client.ep.tag_send(junk, client.lib.UCXXTag(client.want_data))
        request = client.ep.am_recv()
        deadline = time.monotonic() + DEADLINE
        while client.ep.alive and time.monotonic() < deadline:
            client.worker.progress()
            time.sleep(0.001)
        client.worker.progress()
        assert not client.ep.alive, "the server keeps a connection that sent an oversized want_data"
        answered = False
        if request.completed:
            try:
                request.check_error()
                answered = True
            except Exception:  # canceled by the close: no message came first
                pass
        if answered:
            message = _bytes(request.recv_buffer)
            assert message[0] == KIND_ERROR, f"only an error may answer it: {message[:80]!r}"
            assert json.loads(message[5:])["code"] == "request_too_large"
        del send, junk
    finally:
        client.close()
    _assert_recovered(proc, uri, baseline, "an oversized want_data")


def test_a_random_ticket_gets_an_error_and_the_connection_goes_on(
    robust_server: tuple[Any, str, int],
) -> None:
    """A want_data of valid length but random bytes (not even UTF-8, most likely): answered with the 0xE0
    ``unknown_ticket`` error; the same connection then fetches a real ticket, and the server recovers."""
    proc, uri, baseline = robust_server
    client = RefClient(uri)
    try:
        client.send_tagged(client.want_data, os.urandom(1024))
        message = client.recv_am("the answer to a random ticket")
        kind, seq = struct.unpack_from("<BI", message)
        assert (kind, seq) == (KIND_ERROR, 0), message[:80]
        assert json.loads(message[5:])["code"] == "unknown_ticket"
        table, _ = ref_fetch(client, client, b"mixed")
        assert table.equals(SERVED["mixed"])
    finally:
        client.close()
    _assert_recovered(proc, uri, baseline, "a random ticket")


def test_a_client_that_never_sends_want_data_is_dropped(robust_server: tuple[Any, str, int]) -> None:
    """A reference client that connects and sends nothing: with ``--want-data-timeout 1`` the server closes
    the connection within a few seconds (the client sees its endpoint fail), serves others meanwhile, and
    recovers."""
    proc, uri, baseline = robust_server
    silent = RefClient(uri)
    try:
        silent.idle(0.2)  # the connection is made
        took = _serve_one(uri)  # others are served while it sits there
        assert took < 10
        start = time.monotonic()
        while silent.ep.alive and time.monotonic() - start < 10:
            silent.worker.progress()
            time.sleep(0.005)
        assert not silent.ep.alive, "the server kept a connection that never sent want_data for 10 s"
    finally:
        silent.close()
    _assert_recovered(proc, uri, baseline, "a client that never sent want_data")


# ------------------------------------------------------------------------------- the reference-style server


REF_SERVER = textwrap.dedent(
    '''
    """A reference-style Dissociated IPC server over UCX, with ucxx and pyarrow only: serves the IPC files
    given (ticket = file stem) to one client at a time (the newest: an idle client is set aside when
    another connects, as a tagged receive on the one worker cannot tell them apart), telling the test on
    stdout when a connection comes and when it goes. argv: ROLE WANT_DATA FILE..., where ROLE is
    ``combined`` (metadata stream and bodies), ``metadata`` (the metadata stream only) or ``data`` (the
    bodies only: the split layout's two servers)."""
    import json, os, signal, struct, sys, time
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import pyarrow as pa
    import ucxx._lib.libucxx as lib
    from ucxx._lib.arr import Array

    ALL = 0xFFFFFFFFFFFFFFFF
    role, want_data = sys.argv[1], int(sys.argv[2])
    send_metadata, send_bodies = role in ("combined", "metadata"), role in ("combined", "data")
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))


    # SPLIT_STREAM


    streams = {os.path.splitext(os.path.basename(p))[0]: split_stream(p) for p in sys.argv[3:]}
    context = lib.UCXContext({}, (lib.Feature.TAG, lib.Feature.AM))
    worker = lib.UCXWorker(context)
    accepted = []


    def on_request(conn_request, *args):
        accepted.append(listener.create_endpoint_from_conn_request(conn_request, True))


    listener = lib.UCXListener.create(worker, 0, on_request, (), None, False)
    uri = f"ucx://127.0.0.1:{listener.port}?want_data={want_data}"
    print(json.dumps({"uri": uri, "tickets": sorted(streams)}), flush=True)


    def wait(ep, request, keep):
        deadline = time.monotonic() + 30
        while not request.completed:
            if stop or not ep.alive or time.monotonic() > deadline:
                raise ConnectionError("the client went away")
            worker.progress()
            time.sleep(0.0002)
        request.check_error()


    def send_am(ep, data):
        array = Array(data)
        return ep.am_send(array), (array, data)


    def send_tagged(ep, tag, data):
        array = Array(data)
        return ep.tag_send(array, lib.UCXXTag(tag)), (array, data)


    def event(**what):
        """A line on stdout for the test: {"accepted": n} and {"gone": n} (connection n's endpoint failed:
        its client closed it or died)."""
        print(json.dumps(what), flush=True)


    lingering = []  # (n, endpoint) of clients that went idle while a newer one connected


    def reap():
        for n, old in list(lingering):
            if not old.alive:
                lingering.remove((n, old))
                event(gone=n)


    def serve(ep):
        """Answer ep's want_data until it leaves (True) or, idle, another client connects (False: the newer
        one is served from now on; this one lingers until it leaves)."""
        while not stop and ep.alive:
            worker.progress()
            reap()
            if accepted:  # checked before probing: a want_data from now on is the newer client's
                return False
            probe = worker.tag_probe(lib.UCXXTag(want_data), lib.UCXXTagMask(ALL), True)
            if not probe.matched:
                time.sleep(0.0005)
                continue
            ticket = bytearray(max(1, int(probe.length)))
            request = worker.tag_recv_with_handle(Array(ticket), probe)
            wait(ep, request, ticket)
            name = bytes(ticket[: int(probe.length)]).decode(errors="replace")
            messages = streams.get(name)
            if messages is None:
                if not send_metadata:
                    continue
                error = json.dumps({"code": "unknown_ticket", "message": f"no {name!r}"}).encode()
                wait(ep, *send_am(ep, struct.pack("<BI", 0xE0, 0) + error))
                continue
            # every send of the stream is posted at once (metadata, then its body), then all are waited for
            sent = []
            for seq, (metadata, body) in enumerate(messages):
                if send_metadata:
                    sent.append(send_am(ep, struct.pack("<BI", 1, seq) + metadata))
                if seq and send_bodies:
                    sent.append(send_tagged(ep, seq, body))  # body type 0: the tag is the seq
            if send_metadata:
                sent.append(send_am(ep, struct.pack("<BI", 0, len(messages))))
            for request, keep in sent:
                wait(ep, request, keep)
            print(json.dumps({"served": name, "messages": len(messages)}), file=sys.stderr, flush=True)
        return True


    count = 0
    while not stop:
        worker.progress()
        reap()
        if not accepted:
            time.sleep(0.001)
            continue
        ep = accepted.pop(0)
        count += 1
        event(accepted=count)
        try:
            gone = serve(ep)
        except ConnectionError:
            gone = True
        if not gone:
            lingering.append((count, ep))
        elif not ep.alive:
            event(gone=count)
        del ep
    '''
).replace("# SPLIT_STREAM\n", SPLIT_STREAM)


@pytest.fixture(scope="module")
def ref_server(served: dict[str, Path]) -> Iterator[str]:
    """The reference-style server (ucxx + pyarrow only) serving plain and mixed: its URI (no ``worker=``)."""
    with ref_server_process(served, "combined", 51) as (_, uri):
        yield uri


@pytest.fixture(scope="module")
def ref_split_servers(served: dict[str, Path]) -> Iterator[tuple[str, str]]:
    """The split layout's two reference-style servers (metadata stream; bodies): their URIs."""
    meta, data = ref_server_process(served, "metadata", 61), ref_server_process(served, "data", 62)
    with meta as (_, uri), data as (_, data_uri):
        yield uri, data_uri


@contextlib.contextmanager
def ref_server_process(
    served: dict[str, Path], role: str, want_data: int
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``REF_SERVER`` in a child process serving plain and mixed in ``role``: the process and its URI."""
    argv = ["-c", REF_SERVER, role, str(want_data), str(served["plain"]), str(served["mixed"])]
    with child_server(argv, 1) as (proc, lines):
        assert lines[0]["tickets"] == ["mixed", "plain"]
        yield proc, str(lines[0]["uri"])


@pytest.fixture(params=["combined", "split"])
def ref_uris(request: pytest.FixtureRequest) -> tuple[str, str]:
    """The reference-style server's (metadata URI, data URI): the same when combined."""
    if request.param == "combined":
        uri: str = request.getfixturevalue("ref_server")
        return uri, uri
    uris: tuple[str, str] = request.getfixturevalue("ref_split_servers")
    return uris


def test_the_reference_client_and_server_of_this_file_agree(ref_uris: tuple[str, str]) -> None:
    """The test's own reference client fetches from the test's own reference server(s) (both ucxx only),
    combined and split: the two halves of this file speak the same mapping, so a failure of the tests
    against dissoc is dissoc's."""
    for ticket in ["plain", "mixed"]:
        meta, data = _connect(ref_uris)
        try:
            table, info = ref_fetch(meta, data, ticket.encode())
            assert table.equals(SERVED[ticket])
            assert info["types"] == TYPES[ticket]
            assert_nothing_else_arrives(data)
        finally:
            _close(meta, data)


@pytest.mark.parametrize("ticket", ["plain", "mixed"])
@pytest.mark.parametrize("path", ["listener", "auto"])
def test_dissoc_client_fetches_from_a_reference_style_server(
    ref_uris: tuple[str, str], path: str, ticket: str
) -> None:
    """dissoc's client fetches from a server that follows the reference mapping and knows no handshake
    (combined, and split: the metadata stream from one, the bodies from the other): forced onto the
    listener path (``ClientOptions(ucx_path="listener")``) and, with the default ``auto``, chosen because
    the URIs have no ``worker=``. The table equals the source."""
    from dissoc.client import ClientOptions, fetch_async

    uri, data_uri = ref_uris
    assert "worker=" not in uri + data_uri
    options = ClientOptions(timeout=10.0, ucx_path=path)

    async def fetch() -> pa.Table:
        got = fetch_async(uri, ticket, data_uri=None if data_uri == uri else data_uri, options=options)
        return await asyncio.wait_for(got, 60)

    table = asyncio.run(fetch())
    assert table.equals(SERVED[ticket]), ticket
    assert table.schema.equals(SERVED[ticket].schema)


def test_dissoc_client_lets_go_of_a_reference_style_server(served: dict[str, Path]) -> None:
    """After a fetch, dissoc's client closes its connection so that a reference-style server notices (its
    endpoint, peer-failure handling on, fails) within a few seconds, though such a server sends no BYE of
    its own: a server that gives each connection a worker, as the reference does, is not left holding one
    per fetch until the client process exits."""
    from dissoc.client import ClientOptions, fetch_async

    with ref_server_process(served, "combined", 51) as (proc, uri):
        options = ClientOptions(timeout=10.0, ucx_path="listener")

        async def fetch_then_listen() -> tuple[pa.Table, list[str]]:
            table = await asyncio.wait_for(fetch_async(uri, "plain", options=options), 60)
            # the event loop keeps running (whatever the client closes in the background goes on) while the
            # server's report is awaited
            try:
                lines = await asyncio.to_thread(read_lines, proc, 2, 10)
            except AssertionError as exc:
                raise AssertionError(
                    f"the reference-style server still holds dissoc's client's connection 10 s after the "
                    f"fetch ({exc})"
                ) from None
            return table, lines

        table, lines = asyncio.run(fetch_then_listen())
        assert table.equals(SERVED["plain"])
        assert [json.loads(line) for line in lines] == [{"accepted": 1}, {"gone": 1}]


def without_worker(uri: str) -> str:
    """``uri`` without its ``worker=`` parameter: how a reference-style peer would publish it."""
    parts = urlsplit(uri)
    query = "&".join(p for p in parts.query.split("&") if p.split("=", 1)[0] != "worker")
    return urlunsplit(parts._replace(query=query))


def test_dissoc_client_auto_path_without_worker_reaches_dissoc_server(server: tuple[str, str]) -> None:
    """The two halves together: dissoc's client, given dissoc's server's URIs without ``worker=`` (as a
    reference-style peer publishes them), fetches through the listener with no handshake."""
    from dissoc.client import ClientOptions, fetch_async

    uri, data_uri = (without_worker(u) for u in server)
    assert "worker=" not in uri + data_uri
    options = ClientOptions(timeout=10.0)

    async def fetch() -> pa.Table:
        got = fetch_async(uri, "mixed", data_uri=None if data_uri == uri else data_uri, options=options)
        return await asyncio.wait_for(got, 60)

    assert asyncio.run(fetch()).equals(SERVED["mixed"])
