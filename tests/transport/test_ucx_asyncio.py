"""Peers written with ucxx's public asyncio API (``ucxx.create_endpoint``, ``ucxx.create_listener``) and
dissoc's UCX listener path, both ways (issue 30; :mod:`dissoc.transport.ucx.peer_info`).

ucxx's asyncio endpoints exchange 16 bytes of peer information on the UCX stream API before anything else,
the listener's side first. dissoc's listener sends its 16 bytes to a peer that stays silent after
connecting, and dissoc's client answers a listener's; neither sends anything on the stream to a peer that
follows the reference mapping (it sends want_data at once; tests/transport/test_ucx_reference.py).

**dissoc's server.** ``ASYNCIO_CLIENT`` is a client written with ucxx's asyncio API only (no dissoc code at
all): ``await ucxx.create_endpoint(host, port)``, want_data as ``ep.send(ticket, tag=want_data,
force_tag=True)``, the metadata stream by ``ep.am_recv()``, each body by ``ep.tag_probe``/``ep.recv`` with
its exact tag (body type << 56 | seq), free_data as ``ep.send`` with the URI's tag. It runs in a child
process (ucxx's asyncio API keeps a context and a progress thread for the life of the process), against
``dissoc serve --transport ucx`` in another, in every stream layout: combined, split (a metadata and a data
listener), and pair lists over shared memory (the client copies the listed ranges out of the segment and
frees them), combined and split. It hands back what it received; the test checks the wire (prefixes,
sequence numbers, tags) and rebuilds the table with pyarrow (tests/helpers/ucx_wire.py).

**dissoc's client.** ``ASYNCIO_SERVER`` is a server written with ucxx's asyncio API only, in a child process:
``ucxx.create_listener`` (its handler runs only once dissoc's client has answered the peer information),
want_data by ``ep.tag_probe``/``ep.recv(..., force_tag=True)``, the schema and each batch as
``ep.am_send`` with the 5-byte prefix, bodies by ``ep.send(..., tag=seq, force_tag=True)``. Three listeners
(combined; the split layout's metadata and data) share its one worker, each with its own want_data tag.
``dissoc.client.fetch_async`` fetches through the listener path, and the server reports each connection
gone once dissoc's client let go of it.

The contract itself is checked on the wire with ucxx's low-level API: a silent peer gets the listener's 16
bytes (ucxx's format and checksum); a peer that sends want_data at once gets nothing on the stream. In this
process, dissoc's client and server on the listener path: the exchange happens only when the client stays
silent, and ends with the connection.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import mmap
import os
import pickle
import selectors
import struct
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pyarrow as pa
import pytest
from helpers.e2e import PYTHON, REPO, sample_table
from helpers.transport import connected_pair
from helpers.ucx_wire import (
    BODY_PACKED,
    BODY_PAIRS,
    KIND_EOS,
    KIND_ERROR,
    KIND_METADATA,
    RESERVED_BITS,
    SEQ_MASK,
    SPLIT_STREAM,
    as_bytes,
    child_server,
    gather_pairs,
    message_fields,
    plain_table,
    ucx_array,
    ucxx_lib,
)

from dissoc.transport.ucx import peer_info

pytest.importorskip("ucxx")

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(120)]

DEADLINE = 20.0  # seconds for any one wait (the machine is shared)


# ------------------------------------------------------------------------------------------------ datasets


#: ticket -> table: plain, and mixed (dictionaries, nulls, nested types: a dictionary batch first)
SERVED: dict[str, pa.Table] = {"plain": plain_table(), "mixed": sample_table()}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The served tables as Arrow IPC files (a server's tickets are the file stems)."""
    root = tmp_path_factory.mktemp("asyncio")
    paths = []
    for name, table in SERVED.items():
        path = root / f"{name}.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------------- ucxx's asyncio client


ASYNCIO_CLIENT = textwrap.dedent(
    '''
    """A Dissociated IPC client written with ucxx's public asyncio API only. argv: a JSON object with
    ``uri`` and ``data_uri`` (the same when combined), ``tickets`` (fetched in turn), ``shm`` (the
    shared-memory segment pair lists point into, or null) and ``out`` (where the results are pickled: per
    ticket, every metadata-stream message as received, each body as (tag, payload), the ranges copied out
    of the segment by offset, and the data server's error message in the split layout)."""
    import asyncio, json, mmap, os, pickle, struct, sys
    from urllib.parse import parse_qs, urlsplit
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx

    KIND_METADATA, KIND_ERROR = 0x01, 0xE0
    config = json.loads(sys.argv[1])


    def where(uri):
        parts = urlsplit(uri)
        query = parse_qs(parts.query)
        free_data = int(query["free_data"][0]) if "free_data" in query else None
        return parts.hostname, parts.port, int(query["want_data"][0]), free_data


    async def recv_tagged(ep, tag):
        """The message tagged exactly ``tag`` (force_tag: the tag as the server sent it), into a buffer of
        the length a probe gives."""
        while True:
            probe = ep.tag_probe(tag, force_tag=True)
            if probe.matched:
                break
            if ep.closed:
                raise ConnectionError(f"the server closed the connection before tag {tag:#x}")
            await asyncio.sleep(0.0005)
        buffer = bytearray(max(1, probe.length))
        await ep.recv(buffer, tag=tag, force_tag=True)
        return bytes(buffer[: probe.length])


    async def fetch(meta, data, ticket, shm):
        await meta.ep.send(ticket, tag=meta.want_data, force_tag=True)
        if data is not meta:
            await data.ep.send(ticket, tag=data.want_data, force_tag=True)
        result = {"messages": [], "bodies": {}, "ranges": {}, "data_error": None}
        while True:
            message = bytes(memoryview(await meta.ep.am_recv()).cast("B"))
            result["messages"].append(message)
            kind, seq = struct.unpack_from("<BI", message)
            if kind != KIND_METADATA:
                break
            if seq == 0:  # the schema: no body
                continue
            # body type 0 (packed) or, over shared memory, 1 (a pair list) in the top byte; the seq below
            tag = (1 << 56 | seq) if shm is not None else seq
            body = await recv_tagged(data.ep, tag)
            result["bodies"][seq] = (tag, body)
            if shm is not None:
                total, count = struct.unpack_from("<QQ", body)
                for i in range(count):
                    offset, length = struct.unpack_from("<QQ", body, 16 + 16 * i)
                    if length:
                        result["ranges"][offset] = shm[offset : offset + length]
        if kind == KIND_ERROR and data is not meta:
            result["data_error"] = await recv_tagged(data.ep, KIND_ERROR << 56)
        if result["ranges"]:
            offsets = sorted(result["ranges"])
            await data.ep.send(struct.pack(f"<{len(offsets)}Q", *offsets), tag=data.free_data, force_tag=True)
        return result


    class Server:
        def __init__(self, uri):
            self.host, self.port, self.want_data, self.free_data = where(uri)
            self.ep = None


    async def main():
        meta = Server(config["uri"])
        data = meta if config["data_uri"] == config["uri"] else Server(config["data_uri"])
        for server in {id(meta): meta, id(data): data}.values():
            server.ep = await ucxx.create_endpoint(server.host, server.port)
        shm = None
        if config["shm"]:
            fd = os.open("/dev/shm/" + config["shm"], os.O_RDONLY)
            shm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            os.close(fd)
        results = [await fetch(meta, data, ticket.encode(), shm) for ticket in config["tickets"]]
        with open(config["out"], "wb") as out:
            pickle.dump(results, out)
        for server in {id(meta): meta, id(data): data}.values():
            await server.ep.close()


    asyncio.run(asyncio.wait_for(main(), 60))
    '''
)


def run_asyncio_client(
    uris: tuple[str, str], tickets: list[str], out: Path, shm: str | None = None
) -> list[dict[str, Any]]:
    """``ASYNCIO_CLIENT`` in a child process: what it received, per ticket."""
    config = {"uri": uris[0], "data_uri": uris[1], "tickets": tickets, "shm": shm, "out": str(out)}
    done = subprocess.run(
        [PYTHON, "-c", ASYNCIO_CLIENT, json.dumps(config)], cwd=REPO, capture_output=True, timeout=90
    )
    assert done.returncode == 0, (
        f"ucxx's asyncio client failed (status {done.returncode}): "
        f"{done.stderr.decode(errors='replace')[-3000:]}"
    )
    with out.open("rb") as f:
        results: list[dict[str, Any]] = pickle.load(f)
    return results


def rebuild(result: dict[str, Any], pairs: bool) -> tuple[pa.Table, list[int]]:
    """Check what the client received against the wire format, then rebuild the stream with pyarrow: the
    table and the header type of each message."""
    messages = result["messages"]
    *metadata, eos = messages
    assert struct.unpack_from("<BI", eos) == (KIND_EOS, len(metadata)), (
        "the end of stream counts the messages"
    )
    assert len(eos) == 5
    stream = bytearray()
    types = []
    segment: mmap.mmap | None = None
    if pairs:  # the ranges the client copied, where they were in the segment
        segment = mmap.mmap(-1, max(o + len(r) for o, r in result["ranges"].items()))
        for offset, data in result["ranges"].items():
            segment[offset : offset + len(data)] = data
    offsets: list[int] = []
    assert sorted(result["bodies"]) == list(range(1, len(metadata))), "one body per message after the schema"
    for expected_seq, message in enumerate(metadata):
        kind, seq = struct.unpack_from("<BI", message)
        assert (kind, seq) == (KIND_METADATA, expected_seq)
        flatbuffer = message[5:]
        header_type, body_length, buffers = message_fields(flatbuffer)
        types.append(header_type)
        body = b""
        if seq:
            tag, body = result["bodies"][seq]
            assert tag & SEQ_MASK == seq and tag & RESERVED_BITS == 0, f"{tag:#018x}"
            assert tag >> 56 == (BODY_PAIRS if pairs else BODY_PACKED)
            if segment is not None:
                body = gather_pairs(body, buffers, body_length, segment, offsets)
            assert len(body) == body_length
        padding = -len(flatbuffer) % 8
        stream += struct.pack("<Ii", 0xFFFFFFFF, len(flatbuffer) + padding)
        stream += flatbuffer + b"\0" * padding + body
    stream += struct.pack("<Ii", 0xFFFFFFFF, 0)
    assert sorted(offsets) == sorted(result["ranges"]), "the ranges copied are those the pairs list"
    return pa.ipc.open_stream(bytes(stream)).read_all(), types


@contextlib.contextmanager
def dissoc_server(files: list[Path], *options: str, split: bool = False) -> Iterator[tuple[str, str]]:
    """``dissoc serve --transport ucx FILES...`` in a child process: (uri, data_uri), the same when combined.
    It must exit cleanly on SIGTERM afterwards."""
    argv = ["-m", "dissoc.cli", "serve", "--transport", "ucx", *(["--split"] if split else []), *options]
    with child_server([*argv, *map(str, files)], len(files)) as (_, lines):
        assert [line["ticket"] for line in lines] == [f.stem for f in files]
        yield lines[0]["uri"], lines[0]["data_uri"]


LAYOUTS = {
    "combined": ((), False),
    "split": ((), True),
    "pairs": (("--body", "pairs", "--memory", "shm", "--arena-mib", "4"), False),
    "pairs-split": (("--body", "pairs", "--memory", "shm", "--arena-mib", "4"), True),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_ucxx_asyncio_client_fetches_from_dissoc_server(
    served: list[Path], tmp_path: Path, layout: str
) -> None:
    """A client written with ucxx's asyncio API only connects with ``ucxx.create_endpoint`` (which returns
    only once the listener's peer information came) and fetches each ticket in turn on the same
    connection(s): pyarrow rebuilds tables equal to the served ones. With packed bodies an unknown ticket is
    answered with the error message (and, split, the data server's tagged error too); with pair lists the
    client may hold 1 MiB unfreed (a quarter of the 4 MiB arena) and each fetch of ``plain`` lists 1 MiB:
    the fetches after the first work only if its free_data did."""
    options, split = LAYOUTS[layout]
    pairs = bool(options)
    tickets = ["plain", "mixed", "plain", "plain"] if pairs else ["plain", "no-such-ticket", "mixed"]
    with dissoc_server(served, *options, split=split) as uris:
        assert (uris[0] != uris[1]) == split
        shm = None
        if pairs:
            query = parse_qs(urlsplit(uris[1]).query)
            assert query["memory"] == ["shm"]
            shm = base64.b64decode(query["remote_handle"][0], validate=True).decode()
        results = run_asyncio_client(uris, tickets, tmp_path / "results.pickle", shm)
    assert len(results) == len(tickets)
    for ticket, result in zip(tickets, results, strict=True):
        if ticket not in SERVED:
            (message,) = result["messages"]
            assert struct.unpack_from("<BI", message) == (KIND_ERROR, 0), message[:80]
            assert json.loads(message[5:])["code"] == "unknown_ticket"
            if split:
                error = result["data_error"]
                assert error[0] == KIND_ERROR and json.loads(error[5:])["code"] == "unknown_ticket"
            continue
        table, types = rebuild(result, pairs)
        assert table.equals(SERVED[ticket]), ticket
        assert table.schema.equals(SERVED[ticket].schema, check_metadata=True)
        assert types[0] == 1 and set(types[1:]) <= {2, 3}
        assert bool(result["ranges"]) == pairs


# --------------------------------------------------------------------------- the exchange, on the wire


@pytest.fixture(scope="module")
def combined_uri(served: list[Path]) -> Iterator[str]:
    """A combined ``dissoc serve --transport ucx`` for the wire checks: its URI."""
    with dissoc_server(served) as (uri, _):
        yield uri


class LowLevelPeer:
    """A client of ucxx's low-level API whose context has the stream API, its 16-byte stream receive
    posted as soon as it connects."""

    def __init__(self, uri: str) -> None:
        lib = ucxx_lib()
        self.lib = lib
        parts = urlsplit(uri)
        assert parts.hostname is not None and parts.port is not None
        self.want_data = int(parse_qs(parts.query)["want_data"][0])
        context = lib.UCXContext({}, (lib.Feature.TAG, lib.Feature.AM, lib.Feature.STREAM))
        self.worker = lib.UCXWorker(context)
        self.ep = lib.UCXEndpoint.create(self.worker, parts.hostname, parts.port, True)
        self.info = bytearray(16)
        self.stream = self.ep.stream_recv(ucx_array(self.info))
        self._keep: list[Any] = []

    def progress(self, seconds: float, until: Any = None) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (until is not None and until()):
            self.worker.progress()
            time.sleep(0.0005)

    def ask(self, ticket: bytes) -> bytes:
        """want_data (tagged, as the reference mapping has it); the first metadata-stream message."""
        array = ucx_array(ticket)
        self._keep.append((array, ticket))
        self.ep.tag_send(array, self.lib.UCXXTag(self.want_data))
        am = self.ep.am_recv()
        self.progress(DEADLINE, lambda: am.completed)
        assert am.completed, "no answer to want_data"
        am.check_error()
        return as_bytes(am.recv_buffer)

    def close(self) -> None:
        if self.ep.alive:
            self.ep.close()
        self.progress(2, lambda: not self.ep.alive)


def test_a_silent_peer_gets_ucxx_peer_information(combined_uri: str) -> None:
    """A peer that sends nothing after connecting (as ucxx's asyncio client, which waits for them) gets the
    listener's 16 bytes on the stream within a second: (msg_tag, checksum) as two native u64, the checksum
    the first 64 bits of the SHA-1 of ``repr((msg_tag,))``. The connection then serves want_data as usual."""
    peer = LowLevelPeer(combined_uri)
    try:
        started = time.monotonic()
        peer.progress(5, lambda: peer.stream.completed)
        assert peer.stream.completed, "no peer information on the stream within 5 s"
        took = time.monotonic() - started
        peer.stream.check_error()
        msg_tag, check = struct.unpack("QQ", peer.info)
        assert check == int(hashlib.sha1(repr((msg_tag,)).encode()).hexdigest()[:16], 16)
        assert took < 2, f"the listener's peer information took {took:.2f} s"
        from ucxx._lib_async.utils import hash64bits  # ucxx's own checksum agrees

        assert hash64bits(msg_tag) == check
        answer = peer.ask(b"no-such-ticket")
        assert answer[0] == KIND_ERROR
    finally:
        peer.close()


def test_a_reference_peer_gets_nothing_on_the_stream(combined_uri: str) -> None:
    """A peer that sends want_data at once, as the reference mapping has it, gets its answer and nothing on
    the stream (a peer whose UCX lacks the stream API would log a warning for every stream message)."""
    peer = LowLevelPeer(combined_uri)
    try:
        answer = peer.ask(b"no-such-ticket")
        assert answer[0] == KIND_ERROR
        peer.progress(0.5)
        assert not peer.stream.completed, (
            "the server sent on the stream to a peer that sent want_data at once"
        )
    finally:
        peer.close()


def test_more_than_the_peer_information_on_the_stream_ends_the_connection(combined_uri: str) -> None:
    """After the 16 bytes, nothing more is expected on the stream: UCX would keep whatever a peer sends
    there, outside every budget, so the server drops a connection that sends more."""
    from dissoc.transport.ucx.peer_info import pack_peer_info

    peer = LowLevelPeer(combined_uri)
    try:
        sent = [pack_peer_info(), b"x" * 4096]
        for data in sent:
            array = ucx_array(data)
            peer._keep.append((array, data))
            peer.ep.stream_send(array)
        peer.progress(DEADLINE, lambda: not peer.ep.alive)
        assert not peer.ep.alive, "the server kept a connection that sends beyond the peer information"
    finally:
        peer.close()


def test_peer_information_is_ucxx_own() -> None:
    """dissoc's 16 bytes are what ucxx's asyncio endpoints send (``struct.pack("QQ", tag, hash64bits(tag))``)
    and dissoc reads theirs; anything else (a wrong checksum, another length) is not taken for them."""
    from ucxx._lib_async.utils import hash64bits

    for tag in (0, 1, 0xFFFFFFFFFFFFFFFF, 0x1234_5678_9ABC_DEF0):
        assert peer_info.pack_peer_info(tag) == struct.pack("QQ", tag, hash64bits(tag))
        assert peer_info.parse_peer_info(struct.pack("QQ", tag, hash64bits(tag))) == tag
        assert peer_info.parse_peer_info(struct.pack("QQ", tag, hash64bits(tag) ^ 1)) is None
    mine = peer_info.pack_peer_info()
    assert len(mine) == 16 and peer_info.parse_peer_info(mine) is not None
    assert peer_info.parse_peer_info(mine[:15]) is None


@pytest.mark.parametrize("idle", [False, True])
async def test_the_exchange_ends_with_the_connection(idle: bool, caplog: pytest.LogCaptureFixture) -> None:
    """dissoc's client and server on the listener path, in this process. A client that sends at once: no
    peer information either way. One that stays idle past the listener's delay: the server's 16 bytes, then
    the client's answer, each taken on the other side. Either way, once both sides closed, no exchange is
    left registered and no request is outstanding. The server's receive nobody answered was cancelled by its
    endpoint's (forced) close; the client's completes when ucxx's close of its endpoint does, and where that
    takes longer than the connection waits, the receive is given up with the worker (its 16-byte buffer
    kept until the worker goes), as any request of dissoc's own would be; so is the receive that watches
    the stream for anything beyond the 16 bytes."""
    caplog.set_level(logging.DEBUG, logger="dissoc.transport.ucx.peer_info")
    async with connected_pair("ucx", timeout=10) as (client, server):
        drivers = [client._driver, server._driver]  # type: ignore[attr-defined]
        if idle:
            await asyncio.sleep(peer_info.LISTENER_DELAY + 0.3)
        await client.send_tagged(7, b"want_data")
        assert bytes((await asyncio.wait_for(server.recv_tagged(7), 10)).view()) == b"want_data"
        await server.send(b"metadata")
        assert bytes(await asyncio.wait_for(client.recv(), 10)) == b"metadata"
    taken = [r.getMessage() for r in caplog.records if "sent ucxx's peer information" in r.getMessage()]
    assert len(taken) == (2 if idle else 0), taken
    assert not peer_info._EXCHANGES, "an exchange outlived its connection"
    for driver in drivers:
        assert driver.closed and not driver.pending
    client_driver, server_driver = drivers
    assert not server_driver.orphans, "the server gave a request up with the worker instead of completing it"
    # (the 16-byte receive, and after an exchange the one that watches the stream for more)
    sizes = (16, peer_info._GUARD_BYTES)
    assert all(len(keep) in sizes for keep, _ in client_driver.orphans), client_driver.orphans


# ------------------------------------------------------------------------------------- ucxx's asyncio server


ASYNCIO_SERVER = textwrap.dedent(
    '''
    """A Dissociated IPC server written with ucxx's public asyncio API only: serves the IPC files given
    (ticket = file stem) on three listeners sharing ucxx's one worker, each with its own want_data tag:
    combined (metadata stream and bodies), and the split layout's metadata and data servers. Prints one
    JSON line with the URIs, then {"accepted": n, "listener": name} and {"gone": n} per connection (its
    handler starts once the client's peer information came; it is gone once UCX reports the client closed
    the connection). argv: FILE..."""
    import asyncio, itertools, json, os, signal, struct, sys
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import pyarrow as pa
    import ucxx

    WANT_DATA = {"combined": 51, "metadata": 61, "data": 62}


    def event(**what):
        print(json.dumps(what), flush=True)


    # SPLIT_STREAM


    streams = {os.path.splitext(os.path.basename(p))[0]: split_stream(p) for p in sys.argv[1:]}
    count = itertools.count(1)


    def handler_for(role):
        want_data = WANT_DATA[role]
        send_metadata, send_bodies = role in ("combined", "metadata"), role in ("combined", "data")

        async def handler(ep):
            n = next(count)
            event(accepted=n, listener=role)
            try:
                while not ep.closed:
                    probe = ep.tag_probe(want_data, force_tag=True)
                    if not probe.matched:
                        await asyncio.sleep(0.001)
                        continue
                    ticket = bytearray(max(1, probe.length))
                    await ep.recv(ticket, tag=want_data, force_tag=True)
                    messages = streams.get(bytes(ticket[: probe.length]).decode(errors="replace"))
                    if messages is None:
                        continue
                    for seq, (metadata, body) in enumerate(messages):
                        if send_metadata:
                            await ep.am_send(struct.pack("<BI", 1, seq) + metadata)
                        if seq and send_bodies:
                            await ep.send(body, tag=seq, force_tag=True)  # body type 0: the tag is the seq
                    if send_metadata:
                        await ep.am_send(struct.pack("<BI", 0, len(messages)))
            finally:  # the client went away (or a send failed: the test then finds its table wrong)
                event(gone=n)
                await ep.close()

        return handler


    async def main():
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        listeners = {role: ucxx.create_listener(handler_for(role)) for role in WANT_DATA}
        event(**{
            role: f"ucx://127.0.0.1:{listener.port}?want_data={WANT_DATA[role]}"
            for role, listener in listeners.items()
        })
        await stop.wait()
        for listener in listeners.values():
            listener.close()


    asyncio.run(main())
    '''
).replace("# SPLIT_STREAM\n", SPLIT_STREAM)


class AsyncioServer:
    """``ASYNCIO_SERVER`` in a child process: its URIs, and its connection events read from stdout."""

    def __init__(self, proc: subprocess.Popen[bytes], uris: dict[str, str]) -> None:
        self.proc = proc
        self.uris = uris
        self._buffer = b""

    def events(self, count: int) -> list[dict[str, Any]]:
        """The next ``count`` JSON lines on its stdout within ``DEADLINE`` seconds (other lines are skipped:
        UCX logs there)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + DEADLINE
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while len(out) < count:
                if b"\n" in self._buffer:
                    line, self._buffer = self._buffer.split(b"\n", 1)
                    if line.startswith(b"{"):
                        out.append(json.loads(line))
                    continue
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    raise AssertionError(
                        f"expected {count} events from the server within {DEADLINE} s: {out}"
                    )
                chunk = os.read(fd, 65536)
                assert chunk, f"the server's stdout closed after {out} (status {self.proc.poll()})"
                self._buffer += chunk
        return out


@pytest.fixture(scope="module")
def asyncio_server(served: list[Path]) -> Iterator[AsyncioServer]:
    with child_server(["-c", ASYNCIO_SERVER, *map(str, served)], 1) as (proc, lines):
        yield AsyncioServer(proc, lines[0])


@pytest.mark.parametrize("ticket", ["plain", "mixed"])
@pytest.mark.parametrize("layout", ["combined", "split"])
def test_dissoc_client_fetches_from_ucxx_asyncio_server(
    asyncio_server: AsyncioServer, layout: str, ticket: str
) -> None:
    """dissoc's client (``ucx_path="listener"``) fetches from a server written with ucxx's asyncio API,
    combined and split: the server's handler starts (dissoc's client answered its peer information), the
    table equals the source, and each connection is gone on the server's side within a few seconds of the
    fetch (dissoc's client lets go)."""
    from dissoc.client import ClientOptions, fetch_async

    uris = asyncio_server.uris
    if layout == "combined":
        uri, data_uri, roles = uris["combined"], None, ["combined"]
    else:
        uri, data_uri, roles = uris["metadata"], uris["data"], ["metadata", "data"]
    options = ClientOptions(timeout=10.0, ucx_path="listener")

    async def fetch() -> pa.Table:
        return await asyncio.wait_for(fetch_async(uri, ticket, data_uri=data_uri, options=options), 60)

    table = asyncio.run(fetch())
    assert table.equals(SERVED[ticket]), ticket
    assert table.schema.equals(SERVED[ticket].schema)
    events = asyncio_server.events(2 * len(roles))
    accepted = {e["accepted"]: e["listener"] for e in events if "accepted" in e}
    gone = {e["gone"] for e in events if "gone" in e}
    assert sorted(accepted.values()) == sorted(roles), events
    assert gone == set(accepted), f"the server still holds a connection of dissoc's client: {events}"
