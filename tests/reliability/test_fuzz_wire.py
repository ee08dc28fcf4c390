"""Wire fuzzer: hypothesis-generated TCP frames, metadata-stream prefixes, data-stream tags, pair lists and
free_data lists, valid and mutated (truncated, bit-flipped, wrong or huge lengths, unknown kinds).

(a) At a running server over raw sockets: after each example the fuzz client sees a clean error or the
    connection closed within a bound (it half-closes after sending), and the server still serves a normal
    client correctly.
(b) At the client: a fake server answers ``fetch_async`` with a fuzzed stream; the client raises a
    ``DissocError`` subclass (nothing else) or returns a correct table, within a timeout.

Examples tried are counted per strategy, printed (``-s``) and checked against a minimum.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from helpers.e2e import CLOSE, RawServer, ServerThread, frame, listener_connections, within
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dissoc
from dissoc.client import ClientOptions, fetch_async
from dissoc.codec import MessageEncoder
from dissoc.errors import DissocError
from dissoc.protocol import encode_eos, encode_metadata_header
from dissoc.protocol.pairs import encode_free, encode_pairs
from dissoc.protocol.tags import make_body_tag
from dissoc.server import DEFAULT_FREE_DATA, DEFAULT_WANT_DATA

pytestmark = pytest.mark.slow

U64 = (1 << 64) - 1
SERVER_EXAMPLES = 400  # per server
CLIENT_EXAMPLES = 800  # (about 25 ms each on two cores)
MIN_PER_STRATEGY = 10
# Strategies with few distinct inputs: hypothesis does not repeat an example it has tried, so they are tried
# fewer times (the valid stream has only two: hang up at the end or not).
FEW_INPUTS = {"valid": 1, "drop": 10, "duplicate": 10, "swap": 10}
CLOSE_BOUND = 5.0  # seconds the server may take to answer and close after the fuzz client half-closes
CLIENT_TIMEOUT = 0.5  # the client's silence timeout in (b); every fetch is bounded by CLIENT_TIMEOUT + 4 s

SCHEMA = pa.schema([("id", pa.int64()), ("s", pa.string()), ("d", pa.dictionary(pa.int8(), pa.string()))])
TABLE = pa.Table.from_batches(
    [
        pa.record_batch(
            [
                pa.array(range(b * 6, b * 6 + 6), pa.int64()),
                pa.array([None, "a", "bb", "", "cccc", f"b{b}"]),
                pa.DictionaryArray.from_arrays(
                    pa.array([0, 1, None, 1, 0, 1], pa.int8()), pa.array(["x", "y"])
                ),
            ],
            schema=SCHEMA,
        )
        for b in range(2)
    ]
)


def _stream_frames() -> list[tuple[bool, int, bytes]]:
    """TABLE as (tagged, tag, payload) frames of a combined stream: metadata then body for each message."""
    enc = MessageEncoder(SCHEMA)
    messages = [enc.schema_message()]
    for batch in TABLE.to_batches():
        messages.extend(enc.encode(batch))
    out: list[tuple[bool, int, bytes]] = []
    for seq, m in enumerate(messages):
        out.append((False, 0, encode_metadata_header(seq) + bytes(m.metadata)))
        body = bytes(m.body) if m.body is not None else b""
        if seq > 0:
            out.append((True, make_body_tag(seq, 0), body))
    out.append((False, 0, encode_eos(len(messages))))
    return out


VALID_STREAM = _stream_frames()

# ------------------------------------------------------------------------------------------------ strategies

u64s = st.integers(0, U64)
u32s = st.integers(0, (1 << 32) - 1)


@st.composite
def tcp_frames(
    draw: st.DrawFn, payload: bytes | None = None, tag: int | None = None, tagged: bool = True
) -> bytes:
    """One TCP frame: valid, or with an unknown kind, non-zero padding, a wrong or huge length, truncated."""
    body = draw(st.binary(max_size=64)) if payload is None else payload
    kind = 2 if tagged else 1
    pad = 0
    length = len(body)
    mutation = draw(st.sampled_from(["valid", "valid", "kind", "pad", "length", "huge", "truncate"]))
    if mutation == "kind":
        kind = draw(st.integers(0, 255).filter(lambda k: k not in (1, 2)))
    elif mutation == "pad":
        pad = draw(st.integers(1, (1 << 56) - 1))
    elif mutation == "length":
        length = max(0, length + draw(st.integers(-16, 16).filter(lambda d: d != 0)))
    elif mutation == "huge":
        length = draw(st.integers(1 << 32, U64))
    t = draw(u64s) if tag is None else tag
    raw = (
        struct.pack("<QQQ", kind | (pad << 8), t if tagged else (t if mutation == "pad" else 0), length)
        + body
    )
    if mutation == "truncate":
        raw = raw[: draw(st.integers(0, len(raw) - 1))] if raw else raw
    return raw


@st.composite
def metadata_prefixes(draw: st.DrawFn) -> bytes:
    """A metadata-stream message: the 5-byte prefix (type, u32 LE seq), then a flatbuffer or garbage."""
    kind = draw(st.sampled_from([0x00, 0x01, 0xE0]) | st.integers(0, 255))
    rest = draw(st.sampled_from([b"", bytes(VALID_STREAM[0][2][5:])]) | st.binary(max_size=48))
    if kind == 0xE0 and draw(st.booleans()):
        rest = json.dumps({"code": draw(st.text(max_size=8)), "message": draw(st.text(max_size=16))}).encode()
    return struct.pack("<BI", kind, draw(u32s)) + rest


@st.composite
def body_tags(draw: st.DrawFn) -> int:
    """A data-stream tag: seq in bits 0-31, body type in bits 56-63, sometimes stray bits in 32-55."""
    tag: int = draw(u32s) | (draw(st.sampled_from([0, 1, 0xE0]) | st.integers(0, 255)) << 56)
    if draw(st.booleans()):
        tag |= draw(st.integers(0, (1 << 24) - 1)) << 32
    return tag


@st.composite
def pair_lists(draw: st.DrawFn) -> bytes:
    """A body of type 1: valid, or with a wrong total, a wrong count, or truncated."""
    pairs = draw(st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(0, 1 << 20)), max_size=6))
    raw = encode_pairs(pairs)
    mutation = draw(st.sampled_from(["valid", "total", "count", "truncate"]))
    if mutation == "total":
        raw = struct.pack("<Q", draw(u64s)) + raw[8:]
    elif mutation == "count":
        raw = raw[:8] + struct.pack("<Q", draw(u64s)) + raw[16:]
    elif mutation == "truncate":
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    return raw


@st.composite
def free_lists(draw: st.DrawFn) -> bytes:
    """A free_data message: one or more u64 addresses, or a length that is not a multiple of 8, or empty."""
    raw = encode_free(draw(st.lists(st.sampled_from([0, 64, 128]) | u64s, min_size=1, max_size=6)))
    mutation = draw(st.sampled_from(["valid", "valid", "ragged", "empty"]))
    if mutation == "ragged":
        raw += draw(st.binary(min_size=1, max_size=7))
    elif mutation == "empty":
        raw = b""
    return raw


def _flip(draw: st.DrawFn, raw: bytes) -> bytes:
    if not raw:
        return raw
    i = draw(st.integers(0, len(raw) - 1))
    return raw[:i] + bytes([raw[i] ^ (1 << draw(st.integers(0, 7)))]) + raw[i + 1 :]


# ------------------------------------------------------------------------------- (a) at a running server

SERVER_KINDS = ["want_data", "free_data", "metadata", "pairs", "random_frame", "bitflip", "truncated_stream"]


@st.composite
def server_inputs(draw: st.DrawFn) -> tuple[str, bytes]:
    """(strategy name, bytes a hostile client sends the server)."""
    kind = draw(st.sampled_from(SERVER_KINDS))
    frames: list[bytes] = []
    for _ in range(draw(st.integers(1, 4))):
        if kind == "want_data":
            ticket = draw(st.sampled_from([b"t", b"", b"nope", b"t" * 300]) | st.binary(max_size=16))
            frames.append(draw(tcp_frames(payload=ticket, tag=DEFAULT_WANT_DATA)))
        elif kind == "free_data":
            frames.append(draw(tcp_frames(payload=draw(free_lists()), tag=DEFAULT_FREE_DATA)))
        elif kind == "metadata":
            frames.append(draw(tcp_frames(payload=draw(metadata_prefixes()), tagged=False)))
        elif kind == "pairs":
            frames.append(draw(tcp_frames(payload=draw(pair_lists()), tag=draw(body_tags()))))
        else:
            frames.append(draw(tcp_frames()))
    raw = b"".join(frames)
    if kind in ("bitflip", "truncated_stream"):
        valid = frame(2, DEFAULT_WANT_DATA, b"t") + frame(2, DEFAULT_FREE_DATA, encode_free([0]))
        raw = _flip(draw, valid) if kind == "bitflip" else valid[: draw(st.integers(0, len(valid) - 1))]
    return kind, raw


def _read_until_closed(sock: socket.socket, bound: float) -> tuple[bytes, bool]:
    """Everything the server sends until it closes; (bytes, closed within ``bound``)."""
    deadline = time.monotonic() + bound
    out = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return bytes(out), False
        sock.settimeout(left)
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            return bytes(out), False
        except ConnectionResetError:
            return bytes(out), True
        if not chunk:
            return bytes(out), True
        out += chunk


def _frames_are_valid(raw: bytes) -> list[tuple[int, int, bytes]]:
    """The server's reply parsed as frames: every header it sent is a valid one (kind 1 or 2, zero padding);
    a frame cut by the close is allowed only at the end."""
    out = []
    pos = 0
    while pos + 24 <= len(raw):
        first, tag, length = struct.unpack_from("<QQQ", raw, pos)
        assert first in (1, 2), f"the server sent a frame header with first word {first:#x}"
        out.append((first, tag, raw[pos + 24 : pos + 24 + length]))
        pos += 24 + length
    return out


SERVERS: dict[str, dict[str, Any]] = {
    "combined-packed": {},
    "combined-pairs": {"body": "pairs", "memory": "shm", "arena_bytes": 16 << 20},
    "split-pairs": {"body": "pairs", "memory": "shm", "arena_bytes": 16 << 20, "split": True},
}


@pytest.fixture(scope="module", params=list(SERVERS))
def fuzzed_server(request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    with ServerThread({"t": TABLE}, **SERVERS[request.param]) as server:
        yield server


def _port(uri: str) -> int:
    return int(uri.split(":")[2].split("?")[0])


@pytest.mark.timeout(90)
def test_fuzz_at_the_server(fuzzed_server: ServerThread) -> None:
    counts: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    # Split: each example goes to the metadata or the data server.
    ports = sorted({_port(fuzzed_server.uri), _port(fuzzed_server.data_uri)})

    @settings(
        max_examples=SERVER_EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(server_inputs(), st.sampled_from(ports))
    def one(example: tuple[str, bytes], port: int) -> None:
        kind, raw = example
        counts[kind] += 1
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
            try:
                sock.sendall(raw)
                sock.shutdown(socket.SHUT_WR)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server already hung up on what it read
            reply, closed = _read_until_closed(sock, CLOSE_BOUND)
        assert closed, (
            f"{kind}: the server neither closed nor finished within {CLOSE_BOUND} s of {raw[:80]!r}"
        )
        frames = _frames_are_valid(reply)
        errors = [f for f in frames if f[2][:1] == b"\xe0" and f[0] == 1]
        outcomes["error" if errors else ("data" if frames else "closed")] += 1
        assert fuzzed_server._thread.is_alive(), f"{kind}: the server thread died"
        # (no pooled connection: the handlers counted below must be the fuzz connections')
        table = dissoc.fetch(
            fuzzed_server.uri,
            "t",
            data_uri=fuzzed_server.data_uri,
            options=ClientOptions(timeout=5, reuse_connections=False),
        )
        assert table.equals(TABLE), f"{kind}: a normal client got a wrong table after {raw[:80]!r}"

    one()
    server = fuzzed_server.server
    deadline = time.monotonic() + 10
    held = (lambda: server.placements.held_bytes) if server.placements is not None else (lambda: 0)
    while (listener_connections(server) or held()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert listener_connections(server) in (0, None), "the server still runs handlers for fuzz connections"
    assert server.placements is None or server.placements.held_bytes == 0, (
        f"{server.placements.held_bytes} B still listed to fuzz clients"
    )
    tried = sum(counts.values())
    where = f"{len(ports)} port(s)"
    print(f"\nfuzz at the server ({where}): {tried} examples {dict(counts)}; replies {dict(outcomes)}")
    for kind in SERVER_KINDS:
        assert counts[kind] >= MIN_PER_STRATEGY, f"strategy {kind} tried only {counts[kind]} examples"


# ------------------------------------------------------------------------------------------ (b) at the client

CLIENT_KINDS = [
    "valid",
    "drop",
    "duplicate",
    "swap",
    "retag",
    "prefix",
    "pairs_body",
    "length",
    "bitflip",
    "truncate",
    "garbage_frame",
    "error_message",
]


@st.composite
def client_streams(draw: st.DrawFn) -> tuple[str, list[bytes], bool]:
    """(strategy name, the fake server's frames, whether it hangs up at the end)."""
    kind = draw(st.sampled_from(CLIENT_KINDS))
    items = list(VALID_STREAM)
    i = draw(st.integers(0, len(items) - 1))
    if kind == "drop":
        del items[i]
    elif kind == "duplicate":
        items.insert(i, items[i])
    elif kind == "swap":
        j = draw(st.integers(0, len(items) - 1))
        items[i], items[j] = items[j], items[i]
    elif kind == "retag":
        k = draw(st.sampled_from([k for k, f in enumerate(items) if f[0]]))
        items[k] = (True, draw(body_tags()), items[k][2])
    elif kind == "prefix":
        k = draw(st.sampled_from([k for k, f in enumerate(items) if not f[0]]))
        items[k] = (False, 0, draw(metadata_prefixes())[:5] + items[k][2][5:])
    elif kind == "pairs_body":
        k = draw(st.sampled_from([k for k, f in enumerate(items) if f[0]]))
        items[k] = (True, items[k][1] | (1 << 56), draw(pair_lists()))
    elif kind == "error_message":
        items.insert(i, (False, 0, draw(metadata_prefixes())))
    raw_frames = [frame(2 if tagged else 1, tag, payload) for tagged, tag, payload in items]
    if kind == "length":
        k = draw(st.integers(0, len(raw_frames) - 1))
        payload = raw_frames[k][24:]
        raw_frames[k] = draw(tcp_frames(payload=payload, tag=struct.unpack_from("<Q", raw_frames[k], 8)[0]))
    elif kind == "bitflip":
        k = draw(st.integers(0, len(raw_frames) - 1))
        raw_frames[k] = _flip(draw, raw_frames[k])
    elif kind == "truncate":
        joined = b"".join(raw_frames)
        raw_frames = [joined[: draw(st.integers(0, len(joined) - 1))]]
    elif kind == "garbage_frame":
        raw_frames.insert(i, draw(tcp_frames(tagged=draw(st.booleans()))))
    hang_up = kind == "valid" or draw(st.integers(0, 9)) > 0  # mostly hang up; sometimes stay silent
    return kind, raw_frames, hang_up


async def _client_example(raw_frames: list[bytes], hang_up: bool) -> pa.Table | BaseException:
    script: list[Any] = [*raw_frames, CLOSE] if hang_up else list(raw_frames)
    async with RawServer(lambda: script) as raw:
        try:
            return await within(
                CLIENT_TIMEOUT + 4,
                fetch_async(raw.uri(), "t", options=ClientOptions(timeout=CLIENT_TIMEOUT)),
                "the client fed a fuzzed stream",
            )
        except AssertionError:
            raise
        except BaseException as e:
            return e


@pytest.mark.timeout(90)
def test_fuzz_at_the_client() -> None:
    counts: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()

    @settings(
        max_examples=CLIENT_EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(client_streams())
    def one(example: tuple[str, list[bytes], bool]) -> None:
        kind, raw_frames, hang_up = example
        counts[kind] += 1
        got = asyncio.run(_client_example(raw_frames, hang_up))
        outcomes["table" if isinstance(got, pa.Table) else type(got).__name__] += 1
        if kind == "valid":
            assert isinstance(got, pa.Table), f"a valid stream failed: {type(got).__name__}: {got}"
        if isinstance(got, pa.Table):
            got.validate(full=True)
            if kind in ("valid", "swap"):  # a swap of two frames is only reordering (or no change)
                assert got.equals(TABLE), f"{kind}: the client returned a table that differs from the source"
        else:
            assert isinstance(got, DissocError), f"{kind}: escaped {type(got).__name__}: {got!r}"

    one()
    print(f"\nfuzz at the client: {sum(counts.values())} examples {dict(counts)}; outcomes {dict(outcomes)}")
    for kind in CLIENT_KINDS:
        assert counts[kind] >= FEW_INPUTS.get(kind, MIN_PER_STRATEGY), (
            f"strategy {kind} tried only {counts[kind]} examples"
        )
