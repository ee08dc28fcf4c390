"""dissoc's Arrow IPC codec: messages, stream and file formats, compression and dictionaries.

Pure: bytes in, values out. No I/O beyond the readers' and writers' own sources and sinks, no event loop, no
transport. Mirrors ``pyarrow.ipc``'s naming.
"""

from __future__ import annotations

from dissoc.codec.decoder import Landing, MessageDecoder
from dissoc.codec.encoder import EncodedMessage, MessageEncoder
from dissoc.codec.ipc import (
    FileReader,
    FileWriter,
    StreamReader,
    StreamWriter,
    frame_prefix,
    iter_messages,
    new_file,
    new_stream,
    open_file,
    open_stream,
)
from dissoc.codec.ipcread import frame_room
from dissoc.codec.message import HeaderType, ParsedMessage, has_body, parse, peek_header

__all__ = [
    "EncodedMessage",
    "FileReader",
    "FileWriter",
    "HeaderType",
    "Landing",
    "MessageDecoder",
    "MessageEncoder",
    "ParsedMessage",
    "StreamReader",
    "StreamWriter",
    "frame_prefix",
    "frame_room",
    "has_body",
    "iter_messages",
    "new_file",
    "new_stream",
    "open_file",
    "open_stream",
    "parse",
    "peek_header",
]
