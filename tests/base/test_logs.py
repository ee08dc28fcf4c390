"""Logs people and machines can read: ``--log-format json`` writes one JSON object a line, every line logged
while a stream is served or fetched carries that stream's id, and sequence numbers and tags are in hex."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from helpers.e2e import PYTHON, REPO, ordered_table, read_lines, sample_table

from dissoc.client import ClientOptions, fetch_async
from dissoc.logs import JsonFormatter, StreamFilter, configure, new_stream_id, stream_id
from dissoc.server import Server

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """The dissoc handler at debug level in JSON, writing to a buffer; the previous logging restored."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    out = io.StringIO()
    handler = configure(logging.DEBUG, "json", stream=out)
    try:
        yield out
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        assert root.handlers == handlers


def records(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_json_line_has_time_level_logger_message_stream_and_extras() -> None:
    record = logging.LogRecord("dissoc.x", logging.WARNING, __file__, 1, "seq %s of %d", ("0x2a", 3), None)
    record.peer = "127.0.0.1:5"
    token = stream_id.set("0badcafe")
    try:
        StreamFilter().filter(record)
        line = json.loads(JsonFormatter().format(record))
    finally:
        stream_id.reset(token)
    assert line["level"] == "warning" and line["logger"] == "dissoc.x"
    assert line["message"] == "seq 0x2a of 3"
    assert line["stream"] == "0badcafe" and line["peer"] == "127.0.0.1:5"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", str(line["time"]))


def test_json_line_carries_the_traceback_and_no_stream_outside_one() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record = logging.LogRecord("dissoc", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = json.loads(JsonFormatter().format(record))
    assert "stream" not in line
    assert "ValueError: boom" in str(line["exception"])


def test_text_format_prefixes_the_stream(captured: io.StringIO) -> None:
    out = io.StringIO()
    handler = configure(logging.INFO, "text", stream=out)
    try:
        log = logging.getLogger("dissoc.test")
        log.info("outside")
        token = stream_id.set(new_stream_id())
        log.info("inside")
        sid = stream_id.get()
        stream_id.reset(token)
    finally:
        logging.getLogger().removeHandler(handler)
    assert out.getvalue().splitlines() == ["dissoc.test: outside", f"dissoc.test: [stream {sid}] inside"]
    assert sid is not None and re.fullmatch(r"[0-9a-f]{8}", sid)


def test_configure_refuses_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="text, json"):
        configure(logging.INFO, "xml")


@pytest.mark.parametrize("split", [False, True], ids=["combined", "split"])
async def test_every_line_of_a_stream_carries_its_id(captured: io.StringIO, split: bool) -> None:
    table = sample_table(batches=3)
    async with Server({"t": table}, split=split) as server:
        for _ in range(2):
            got = await fetch_async(
                server.uri, "t", data_uri=server.data_uri, options=ClientOptions(reuse_connections=False)
            )
            assert got.equals(table)
    lines = records(captured)
    served = [r for r in lines if str(r["message"]).startswith("stream of 't' done")]
    asked = [r for r in lines if str(r["message"]).startswith("want_data tag=")]
    fetched = [r for r in lines if str(r["message"]).startswith("stream of 't' from")]
    assert len(served) == (4 if split else 2) and len(fetched) == 2 and len(asked) == len(served)
    # the server's lines of one request share an id; each request and each fetch has its own
    for line in served + asked + fetched:
        assert re.fullmatch(r"[0-9a-f]{8}", str(line.get("stream"))), line
    assert {r["stream"] for r in served} == {r["stream"] for r in asked}
    assert len({r["stream"] for r in served}) == len(served)
    assert len({r["stream"] for r in fetched}) == 2
    # sequence numbers and tags are written in hex
    assert all(re.search(r"tag=0x[0-9a-f]+", str(r["message"])) for r in asked)
    assert all(re.search(r"done: 0x[0-9a-f]+ messages", str(r["message"])) for r in served)
    # nothing outside a stream claims one
    listening = [r for r in lines if "listening on" in str(r["message"])]
    assert listening and all("stream" not in r for r in listening)


def test_serve_log_format_json_from_the_environment(tmp_path: Path) -> None:
    import os

    path = tmp_path / "t.arrow"
    table = sample_table(batches=2)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    env = {**os.environ, "DISSOC_LOG_FORMAT": "json", "DISSOC_LOG_LEVEL": "debug"}
    proc = subprocess.Popen(
        [PYTHON, "-m", "dissoc.cli", "serve", str(path)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        ready = json.loads(read_lines(proc, 1, 20)[0])
        got = subprocess.run(
            [PYTHON, "-m", "dissoc.cli", "get", ready["uri"], "t"], cwd=REPO, capture_output=True, timeout=30
        )
        assert got.returncode == 0, got.stderr
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    lines = [json.loads(line) for line in err.decode().splitlines()]  # every line is JSON
    assert any(r["message"].startswith("log_format from env DISSOC_LOG_FORMAT") for r in lines)
    in_stream = [r for r in lines if r["message"].startswith("stream of 't' done")]
    assert len(in_stream) == 1 and "stream" in in_stream[0]


async def test_a_connection_failing_mid_stream_is_logged_with_the_stream_it_carried(
    captured: io.StringIO,
) -> None:
    """The transport's own line about a connection (here: a corrupt frame from the client while its stream
    is being served) is logged from the connection's callback, outside the stream's task: it carries the
    stream id through the connection."""
    import asyncio

    from helpers.e2e import frame, tagged

    from dissoc.logs import peer_log
    from dissoc.server.options import DEFAULT_WANT_DATA

    peer_log._last.clear()  # another test's corrupt frame within the interval would hold this line back
    table = ordered_table(50, 20_000)
    async with Server({"t": table}) as server:
        uri = server.uris[0]
        reader, writer = await asyncio.open_connection(uri.host, uri.port)
        writer.write(tagged(DEFAULT_WANT_DATA, b"t"))
        await writer.drain()
        await reader.readexactly(24)  # the stream began
        writer.write(frame(9, 0, b"garbage"))  # no such frame kind
        await writer.drain()
        for _ in range(100):
            if "frame" in captured.getvalue() and "corrupt" in captured.getvalue():
                break
            await asyncio.sleep(0.02)
        writer.close()
    lines = records(captured)
    asked = [r for r in lines if str(r["message"]).startswith("want_data tag=")]
    corrupt = [r for r in lines if "corrupt" in str(r["message"]) and r["logger"] == "dissoc.peers"]
    assert len(asked) == 1 and corrupt, lines[-5:]
    assert corrupt[0]["stream"] == asked[0]["stream"]
