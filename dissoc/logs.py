"""Logging: what peers can make happen at will without letting them fill the log, stream ids, and the
command line's two formats.

A hostile peer can repeat a failure (a bad frame, a refused request, a failed stream) as fast as it likes;
:class:`RateLimitedLog` writes at most one line per kind every few seconds and says how many it left out.

Every stream, on the server (one want_data answered) and on the client (one ticket fetched), runs with a
stream id (:data:`stream_id`, 8 hex digits) that :class:`StreamFilter` puts on each record logged while it
runs (a connection carries the id of the stream it serves too, ``Connection.stream_id``, for the lines its
transport logs from its own callbacks): ``[stream 1a2b3c4d]`` in text, ``"stream"`` in JSON
(:class:`JsonFormatter`, one object a line).
Sequence numbers and tags are written in hex by the code that logs them (``fmt_seq``, ``fmt_tag``).
Ground floor: used by the transports, the servers and the client alike.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import secrets
import sys
import time
from typing import TextIO

__all__ = [
    "LOG_FORMATS",
    "JsonFormatter",
    "RateLimitedLog",
    "StreamFilter",
    "configure",
    "new_stream_id",
    "peer_log",
    "stream_id",
]

#: The stream the current task serves or fetches (None outside a stream); see :func:`new_stream_id`.
stream_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("dissoc_stream_id", default=None)

#: What ``--log-format`` accepts.
LOG_FORMATS = ("text", "json")

#: The attributes every LogRecord has; anything else on a record came from ``extra=`` and goes into JSON.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


def new_stream_id() -> str:
    """A fresh stream id (8 hex digits); ``stream_id.set(new_stream_id())`` starts a stream in the current
    context, so that the lines logged in it, and in the tasks it creates, carry it."""
    return secrets.token_hex(4)


class StreamFilter(logging.Filter):
    """Puts the current stream id on each record (``record.stream``, None outside a stream) and the text
    format's prefix (``record.stream_prefix``, empty outside one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        sid = getattr(record, "stream", None) or stream_id.get()
        record.stream = sid
        record.stream_prefix = f"[stream {sid}] " if sid else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``, ``stream`` when
    in a stream, what the call passed in ``extra=``, and ``exception`` with the traceback's text."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        sid = getattr(record, "stream", None) or stream_id.get()
        if sid:
            line["stream"] = sid
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in line and key not in ("stream", "stream_prefix"):
                line[key] = value if isinstance(value, str | int | float | bool | None) else repr(value)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure(level: int, fmt: str = "text", stream: TextIO | None = None) -> logging.Handler:
    """Send the ``dissoc`` loggers' records of ``level`` and above to ``stream`` (stderr) in ``fmt``
    (``"text"``: ``logger: [stream ID] message``; ``"json"``: :class:`JsonFormatter`). Replaces the handlers
    a previous call installed; returns the handler."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(StreamFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(name)s: %(stream_prefix)s%(message)s"))
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_dissoc", False)]:
        root.removeHandler(old)
    handler._dissoc = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    return handler


logger = logging.getLogger("dissoc.peers")


class RateLimitedLog:
    """At most one line per kind per ``interval`` seconds; the next line says how many were left out.

    ``kind`` is any hashable (a string naming what happened); a hostile peer repeating a failure cannot fill
    the log, and a kind that is never repeated costs one dict entry.
    """

    def __init__(self, logger: logging.Logger, interval: float = 5.0) -> None:
        self._logger = logger
        self._interval = interval
        self._last: dict[object, float] = {}
        self._suppressed: dict[object, int] = {}

    def log(self, level: int, kind: object, msg: str, *args: object, stream: str | None = None) -> bool:
        """Log ``msg % args`` at ``level`` unless a line of ``kind`` was logged less than ``interval`` ago
        (``stream``: the stream id the line is about, where the current context has none); returns whether it
        was logged."""
        if not self._logger.isEnabledFor(level):
            return False
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self._interval:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return False
        self._last[kind] = now
        suppressed = self._suppressed.pop(kind, 0)
        extra = {"stream": stream} if stream is not None else None
        if suppressed:
            self._logger.log(
                level,
                msg + " (%d more like this in the last %.0f s not logged)",
                *args,
                suppressed,
                now - last if last is not None else 0.0,
                extra=extra,
            )
        else:
            self._logger.log(level, msg, *args, extra=extra)
        return True


#: Rate-limited logging of what peers cause (failures they can repeat at will).
peer_log = RateLimitedLog(logger)
