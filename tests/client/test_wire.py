"""Garbage from the wire: a raw TCP peer answers the client's want_data with broken frames or a broken
Dissociated IPC stream. Each case must raise the right DissocError subclass, quickly (not by timing out),
never anything else, never hang, and never allocate what a hostile header announces."""

from __future__ import annotations

import contextlib
import random
import struct
import time
from collections.abc import Callable, Iterable
from typing import Any

import pyarrow as pa
import pytest
from helpers.e2e import CLOSE, RawServer, tagged, untagged, vm_rss, within

from dissoc.client import ClientOptions, fetch_async, stream_batches
from dissoc.codec import MessageEncoder
from dissoc.errors import CodecError, DissocError, ProtocolError, RemoteError, ResourceError, TransportError
from dissoc.protocol import encode_eos, encode_error, encode_metadata_header

pytestmark = pytest.mark.timeout(30)

TIMEOUT = 3.0  # the client's silence timeout; errors must come well before it
QUICK = 1.5

SCHEMA = pa.schema([("id", pa.int64()), ("s", pa.string())])
_ENC = MessageEncoder(SCHEMA)
SCHEMA_MD = bytes(_ENC.schema_message().metadata)


def _batch(i: int) -> tuple[bytes, bytes]:
    b = pa.record_batch(
        [pa.array(range(i * 10, i * 10 + 10), pa.int64()), pa.array([f"v{j}" for j in range(10)])],
        schema=SCHEMA,
    )
    (m,) = _ENC.encode(b)
    return bytes(m.metadata), m.body


MD1, BODY1 = _batch(1)
MD2, BODY2 = _batch(2)


def meta(seq: int, md: bytes) -> bytes:
    return untagged(encode_metadata_header(seq) + md)


def eos(seq: int) -> bytes:
    return untagged(encode_eos(seq))


def good_prefix() -> list[bytes]:
    """Schema and one complete batch (seqs 0 and 1)."""
    return [meta(0, SCHEMA_MD), meta(1, MD1), tagged(1, BODY1)]


async def _fetch_from(
    script: Callable[[], Iterable[Any]], timeout: float = TIMEOUT
) -> tuple[BaseException, float]:
    async with RawServer(script) as raw:
        started = time.monotonic()
        try:
            table = await within(
                timeout + 5, fetch_async(raw.uri(), "x", options=ClientOptions(timeout=timeout))
            )
        except AssertionError:
            raise
        except BaseException as e:
            return e, time.monotonic() - started
        raise AssertionError(f"expected an error, the client returned a table of {table.num_rows} rows")


def _check(exc: BaseException, elapsed: float, *expected: type[BaseException]) -> None:
    assert isinstance(exc, DissocError), f"not a DissocError: {type(exc).__name__}: {exc}"
    assert isinstance(exc, expected), (
        f"expected {' or '.join(t.__name__ for t in expected)}, got {type(exc).__name__}: {exc}"
    )
    assert elapsed < QUICK, f"the error came only after {elapsed:.2f} s (timeout {TIMEOUT} s): {exc}"


# name -> (script, expected classes)
CASES: dict[str, tuple[Callable[[], list[Any]], tuple[type[BaseException], ...]]] = {
    "random-bytes": (lambda: [random.Random(1234).randbytes(4096)], (ProtocolError, TransportError)),
    "truncated-frame-then-close": (lambda: [meta(0, SCHEMA_MD)[:30], CLOSE], (TransportError,)),
    "truncated-header-then-close": (lambda: [meta(0, SCHEMA_MD)[:10], CLOSE], (TransportError,)),
    "nonzero-frame-padding": (
        lambda: [struct.pack("<QQQ", 0x0101, 0, 5) + b"hello"],
        (ProtocolError, TransportError),
    ),
    "unknown-frame-kind": (
        lambda: [struct.pack("<QQQ", 3, 0, 5) + b"hello"],
        (ProtocolError, TransportError),
    ),
    "untagged-frame-with-tag": (
        lambda: [struct.pack("<QQQ", 1, 9, 5) + b"hello"],
        (ProtocolError, TransportError),
    ),
    "reserved-tag-bits": (
        lambda: [meta(0, SCHEMA_MD), meta(1, MD1), tagged((0xABCDEF << 32) | 1, BODY1), eos(2)],
        (ProtocolError,),
    ),
    "reserved-tag-bit-32": (
        lambda: [meta(0, SCHEMA_MD), meta(1, MD1), tagged((1 << 32) | 1, BODY1), eos(2)],
        (ProtocolError,),
    ),
    "unknown-body-type": (
        lambda: [meta(0, SCHEMA_MD), meta(1, MD1), tagged((0x05 << 56) | 1, BODY1), eos(2)],
        (ProtocolError,),
    ),
    "metadata-seq-gap": (
        lambda: [meta(0, SCHEMA_MD), meta(2, MD1), tagged(2, BODY1), eos(3)],
        (ProtocolError,),
    ),
    "first-message-not-seq-0": (lambda: [meta(1, SCHEMA_MD), eos(2)], (ProtocolError,)),
    "first-message-has-body": (lambda: [meta(0, MD1), tagged(0, BODY1), eos(1)], (ProtocolError,)),
    "duplicate-metadata-seq": (
        lambda: [meta(0, SCHEMA_MD), meta(1, MD1), meta(1, MD1), tagged(1, BODY1), eos(2)],
        (ProtocolError,),
    ),
    "duplicate-body-seq": (
        lambda: [*good_prefix(), tagged(1, BODY1), meta(2, MD2), tagged(2, BODY2), eos(3)],
        (ProtocolError,),
    ),
    "eos-count-too-high": (lambda: [*good_prefix(), eos(5)], (ProtocolError,)),
    "eos-count-too-low": (lambda: [*good_prefix(), eos(1)], (ProtocolError,)),
    "eos-6-bytes": (lambda: [*good_prefix(), untagged(encode_eos(2) + b"\x00")], (ProtocolError,)),
    "eos-4-bytes": (lambda: [*good_prefix(), untagged(encode_eos(2)[:4])], (ProtocolError,)),
    "empty-metadata-message": (lambda: [untagged(b"")], (ProtocolError,)),
    "unknown-prefix-type": (
        lambda: [meta(0, SCHEMA_MD), untagged(b"\x07\x01\x00\x00\x00" + MD1)],
        (ProtocolError,),
    ),
    "body-for-schema-after-it": (
        lambda: [meta(0, SCHEMA_MD), tagged(0, b"\x00" * 8), meta(1, MD1), tagged(1, BODY1), eos(2)],
        (ProtocolError,),
    ),
    "body-for-schema-before-it": (
        lambda: [tagged(0, b"\x00" * 8), meta(0, SCHEMA_MD), meta(1, MD1), tagged(1, BODY1), eos(2)],
        (ProtocolError,),
    ),
    "body-after-eos-for-unsent-seq": (
        lambda: [meta(0, SCHEMA_MD), meta(1, MD1), eos(2), tagged(2, BODY2), tagged(1, BODY1)],
        (ProtocolError,),
    ),
    "metadata-gap-beyond-window": (
        lambda: [meta(0, SCHEMA_MD), meta(1_000_000, MD1), tagged(1_000_000, BODY1), eos(1_000_001)],
        (ProtocolError, ResourceError),
    ),
    "garbage-flatbuffer": (
        lambda: [meta(0, SCHEMA_MD), meta(1, random.Random(5).randbytes(64)), tagged(1, BODY1), eos(2)],
        (CodecError, ProtocolError),
    ),
    "garbage-schema": (
        lambda: [meta(0, random.Random(6).randbytes(64)), eos(1)],
        (CodecError, ProtocolError),
    ),
    "body-shorter-than-metadata-says": (
        lambda: [meta(0, SCHEMA_MD), meta(1, MD1), tagged(1, BODY1[:8]), eos(2)],
        (CodecError,),
    ),
    "pairs-body-without-memory": (
        lambda: [meta(0, SCHEMA_MD), meta(1, MD1), tagged((1 << 56) | 1, struct.pack("<QQ", 0, 0)), eos(2)],
        (ProtocolError,),
    ),
    "close-before-eos": (lambda: [*good_prefix(), CLOSE], (TransportError,)),
    "close-before-last-body": (lambda: [meta(0, SCHEMA_MD), meta(1, MD1), eos(2), CLOSE], (TransportError,)),
    "close-mid-body": (
        lambda: [meta(0, SCHEMA_MD), meta(1, MD1), tagged(1, BODY1)[:40], CLOSE],
        (TransportError,),
    ),
    "error-json-invalid": (lambda: [untagged(b"\xe0\x00\x00\x00\x00{not json")], (ProtocolError,)),
    "error-json-not-object": (lambda: [untagged(b"\xe0\x00\x00\x00\x00[1, 2]")], (ProtocolError,)),
}


@pytest.mark.parametrize("name", list(CASES))
async def test_garbage_raises_the_right_error(name: str) -> None:
    script, expected = CASES[name]
    exc, elapsed = await _fetch_from(script)
    _check(exc, elapsed, *expected)


@pytest.mark.parametrize("length", [2**62, 2**64 - 1, (4 << 30) + 1])
@pytest.mark.parametrize("kind", ["tagged", "untagged"])
async def test_oversized_frame_allocates_nothing(kind: str, length: int) -> None:
    header = struct.pack("<QQQ", 2 if kind == "tagged" else 1, 1 if kind == "tagged" else 0, length)
    before = _self_rss()
    exc, elapsed = await _fetch_from(lambda: [meta(0, SCHEMA_MD), header, b"\x00" * 64])
    after = _self_rss()
    _check(exc, elapsed, ResourceError, TransportError)
    assert after - before < 64 << 20, (
        f"RSS grew by {(after - before) >> 20} MiB on an announced {length} bytes"
    )


def _self_rss() -> int:
    import os

    return vm_rss(os.getpid())


async def test_error_message_is_a_remote_error() -> None:
    exc, elapsed = await _fetch_from(lambda: [untagged(encode_error(0, "unknown_ticket", "no dataset 'x'"))])
    _check(exc, elapsed, RemoteError)
    assert isinstance(exc, RemoteError)
    assert exc.code == "unknown_ticket"
    assert "no dataset 'x'" in exc.message
    assert "no dataset 'x'" in str(exc)


async def test_error_message_mid_stream_is_a_remote_error() -> None:
    exc, elapsed = await _fetch_from(
        lambda: [*good_prefix(), meta(2, MD2), untagged(encode_error(3, "stream_failed", "disk on fire"))]
    )
    _check(exc, elapsed, RemoteError)
    assert "disk on fire" in str(exc)


async def test_valid_script_round_trips() -> None:
    """The hand-built frames are right: the same pieces in a valid order give the expected table."""
    async with RawServer(lambda: [*good_prefix(), meta(2, MD2), tagged(2, BODY2), eos(3)]) as raw:
        table = await within(
            10, fetch_async(raw.uri(want_data=99), "x", options=ClientOptions(timeout=TIMEOUT))
        )
        assert raw.requests == [(99, b"x")]  # want_data was sent tagged with the URI's value, ticket as body
    assert table.column("id").to_pylist() == list(range(10, 30))
    assert table.schema.equals(SCHEMA)


async def test_valid_script_bodies_before_metadata_round_trips() -> None:
    """Combined layout, bodies racing ahead of their metadata: the client matches them by sequence number."""
    script = [tagged(2, BODY2), tagged(1, BODY1), meta(0, SCHEMA_MD), meta(1, MD1), meta(2, MD2), eos(3)]
    async with RawServer(lambda: script) as raw:
        table = await within(10, fetch_async(raw.uri(), "x", options=ClientOptions(timeout=TIMEOUT)))
    assert table.column("id").to_pylist() == list(range(10, 30))


async def test_end_of_stream_while_metadata_waits_for_bodies_round_trips() -> None:
    """Metadata and the end of stream first, then the bodies (a split server's metadata stream runs ahead):
    the end of stream waits for the metadata held for its bodies, and every batch comes, in order."""
    count = 6
    batches = [_batch(i) for i in range(1, count + 1)]

    def script() -> list[bytes]:
        return [
            meta(0, SCHEMA_MD),
            *(meta(i, md) for i, (md, _) in enumerate(batches, 1)),
            eos(count + 1),
            *(tagged(i, body) for i, (_, body) in enumerate(batches, 1)),
        ]

    async with RawServer(script) as raw:
        table = await within(10, fetch_async(raw.uri(), "x", options=ClientOptions(timeout=TIMEOUT)))
    assert table.column("id").to_pylist() == list(range(10, (count + 1) * 10))


async def test_metadata_after_a_waiting_end_of_stream_is_refused_before_any_batch() -> None:
    """A metadata message after the end of stream (at its count) while earlier metadata waits for its body:
    the ProtocolError names it (not a later symptom of it), and no batch is handed over."""
    script = [meta(0, SCHEMA_MD), meta(1, MD1), eos(2), meta(2, MD2), tagged(1, BODY1), tagged(2, BODY2)]
    got: list[int] = []
    started = time.monotonic()
    async with RawServer(lambda: script) as raw:
        with pytest.raises(ProtocolError, match="expected only seqs before the end of stream"):
            options = ClientOptions(timeout=TIMEOUT)
            async for batch in stream_batches(raw.uri(), "x", options=options):
                assert isinstance(batch, pa.RecordBatch)
                got.extend(batch.column("id").to_pylist())
    assert got == []
    assert time.monotonic() - started < QUICK


async def test_random_fuzz_never_escapes_dissoc_error() -> None:
    """Random mutations of a valid stream: any outcome is a table or a DissocError, never a hang or crash."""
    rng = random.Random(42)
    valid = b"".join([*good_prefix(), meta(2, MD2), tagged(2, BODY2), eos(3)])
    for _ in range(25):
        data = bytearray(valid)
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        cut = rng.choice([len(data), rng.randrange(len(data))])
        payload = bytes(data[:cut])

        def script(p: bytes = payload) -> list[object]:
            return [p, CLOSE]

        async with RawServer(script) as raw:
            with contextlib.suppress(DissocError):  # a table or a DissocError are both fine
                await within(6, fetch_async(raw.uri(), "x", options=ClientOptions(timeout=2)))


@pytest.mark.parametrize("bodies_first", [False, True])
async def test_one_connection_may_send_a_whole_part_beyond_the_window_first(bodies_first: bool) -> None:
    """The spec lets metadata and bodies arrive in any order: on one connection, a server may send every
    metadata message (or every body) first, far past the client's window; the client must read on for
    what it waits for instead of pausing the connection that carries it."""
    count = 40
    batches = [_batch(i) for i in range(1, count + 1)]
    metas = [meta(i + 1, md) for i, (md, _) in enumerate(batches)]
    bodies = [tagged(i + 1, body) for i, (_, body) in enumerate(batches)]
    first, second = (bodies, metas) if bodies_first else (metas, bodies)

    def script() -> list[bytes]:
        return [meta(0, SCHEMA_MD), *first, *second, eos(count + 1)]

    async with RawServer(script) as raw:
        options = ClientOptions(timeout=TIMEOUT, window=8)
        table = await within(TIMEOUT + 5, fetch_async(raw.uri(), "x", options=options))
    assert table.column("id").to_pylist() == list(range(10, (count + 1) * 10))


@pytest.mark.parametrize("window", [1, 8, 100])
async def test_metadata_arriving_in_runs_is_held_only_up_to_the_window(
    window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hundreds of metadata messages back to back (offered a run at a time, ``Receiver.on_messages``) before
    their bodies: the client holds at most ``window`` of them, the rest wait for the window, and every batch
    comes in order."""
    from dissoc.session.session import Session

    count = 300
    batches = [_batch(i) for i in range(1, count + 1)]
    metas = [meta(i + 1, md) for i, (md, _) in enumerate(batches)]
    bodies = [tagged(i + 1, body) for i, (_, body) in enumerate(batches)]
    most = [0]
    runs = [0]
    real_take = Session.take

    def take(self: Any, messages: list[Any], lent: bool) -> int:
        taken = real_take(self, messages, lent)
        runs[0] += sum(tag is None for tag, _, _ in messages[:taken]) > 1
        most[0] = max(most[0], len(self.stream._held))
        return taken

    monkeypatch.setattr(Session, "take", take)

    def script() -> list[bytes]:
        return [b"".join([meta(0, SCHEMA_MD), *metas]), b"".join(bodies), eos(count + 1)]

    async with RawServer(script) as raw:
        options = ClientOptions(timeout=TIMEOUT, window=window)
        table = await within(TIMEOUT + 5, fetch_async(raw.uri(), "x", options=options))
    assert table.column("id").to_pylist() == list(range(10, (count + 1) * 10))
    assert most[0] <= window
    assert runs[0] >= (1 if window > 1 else 0)


async def test_a_wake_up_that_hands_over_nothing_is_waited_past() -> None:
    """A wake-up may release nothing the consumer is handed: the consumer waits on for what comes next
    instead of taking from an empty queue."""
    import asyncio

    from dissoc.protocol import StreamEnded
    from dissoc.session.session import Session
    from dissoc.uri import DissocURI

    uri = DissocURI.parse("tcp://127.0.0.1:9?want_data=7")
    session = Session(uri, uri, b"t", ClientOptions(timeout=5))
    later = asyncio.get_running_loop().call_later
    later(0.05, session._wake)  # nothing ready: woken for nothing
    ended = StreamEnded(1)

    def hand_over() -> None:
        session.ready.append(ended)
        session._wake()

    later(0.2, hand_over)
    await within(5, session.wait())
    assert list(session.ready) == [ended]
