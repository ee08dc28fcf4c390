"""The sans-IO core of Dissociated IPC: bytes in, values and events out; no sockets, no event loop.

* :mod:`~dissoc.protocol.seq` -- u32 sequence numbers with roll-over.
* :mod:`~dissoc.protocol.framing` -- metadata-stream messages (5-byte prefix: type, sequence number).
* :mod:`~dissoc.protocol.tags` -- data-stream tags (sequence number, reserved bits, body type).
* :mod:`~dissoc.protocol.pairs` -- body type 1 pair lists and free_data messages.
* :mod:`~dissoc.protocol.arena` -- the arena announcement (a project extension, for private arenas).
* :mod:`~dissoc.protocol.reorder` -- matching metadata with bodies and releasing messages in order.
* :mod:`~dissoc.protocol.server` -- what a server sends for one stream (numbering, framing).
* :mod:`~dissoc.protocol.client` -- what a client makes of what arrives: every ordering rule, the window, flow
  towards the consumer, end of stream; :mod:`~dissoc.protocol.events` what it reports.
"""

from __future__ import annotations

from dissoc.protocol.arena import MAX_ARENA_PAYLOAD, ArenaAnnouncement, decode_arena, encode_arena
from dissoc.protocol.client import ClientStream, Keep, Received
from dissoc.protocol.events import ClientEvent, ClientState, MessageReady, SchemaReceived, StreamEnded
from dissoc.protocol.framing import (
    EMPTY_TICKET,
    PREFIX_SIZE,
    BytesLike,
    EndOfStream,
    ErrorMessage,
    MessageType,
    MetadataMessage,
    StreamMessage,
    as_byte_view,
    decode_stream_message,
    encode_eos,
    encode_error,
    encode_error_payload,
    encode_metadata_header,
    encode_metadata_message,
    encode_prefix,
    peek_prefix,
)
from dissoc.protocol.pairs import (
    PAIRS_HEADER_SIZE,
    U64_MAX,
    PairList,
    decode_free,
    decode_pairs,
    encode_free,
    encode_pairs,
)
from dissoc.protocol.reorder import DEFAULT_MAX_PENDING_BYTES, DEFAULT_WINDOW, Complete, ReorderBuffer
from dissoc.protocol.seq import (
    SEQ_HALF,
    SEQ_MAX,
    SEQ_MODULUS,
    check_seq,
    fmt_seq,
    next_seq,
    seq_add,
    seq_diff,
    seq_distance,
    seq_lt,
)
from dissoc.protocol.server import ServerMessage, ServerState, ServerStream, StreamStateError
from dissoc.protocol.tags import (
    ARENA_TAG,
    BODY_ARENA,
    BODY_ERROR,
    BODY_PACKED,
    BODY_PAIRS,
    BODY_TYPE_SHIFT,
    ERROR_TAG,
    KNOWN_BODY_TYPES,
    RESERVED_MASK,
    SEQ_MASK,
    TAG_MAX,
    BodyTag,
    body_type_name,
    body_type_of,
    fmt_tag,
    make_body_tag,
    parse_body_tag,
    seq_of,
)

__all__ = [
    "ARENA_TAG",
    "BODY_ARENA",
    "BODY_PACKED",
    "BODY_ERROR",
    "BODY_PAIRS",
    "EMPTY_TICKET",
    "ERROR_TAG",
    "BODY_TYPE_SHIFT",
    "DEFAULT_MAX_PENDING_BYTES",
    "DEFAULT_WINDOW",
    "KNOWN_BODY_TYPES",
    "MAX_ARENA_PAYLOAD",
    "PAIRS_HEADER_SIZE",
    "PREFIX_SIZE",
    "RESERVED_MASK",
    "SEQ_HALF",
    "SEQ_MASK",
    "SEQ_MAX",
    "SEQ_MODULUS",
    "TAG_MAX",
    "U64_MAX",
    "ArenaAnnouncement",
    "BodyTag",
    "BytesLike",
    "ClientEvent",
    "ClientState",
    "ClientStream",
    "Complete",
    "EndOfStream",
    "ErrorMessage",
    "Keep",
    "MessageReady",
    "MessageType",
    "MetadataMessage",
    "PairList",
    "Received",
    "ReorderBuffer",
    "SchemaReceived",
    "ServerMessage",
    "ServerState",
    "ServerStream",
    "StreamEnded",
    "StreamMessage",
    "StreamStateError",
    "as_byte_view",
    "body_type_name",
    "body_type_of",
    "check_seq",
    "decode_free",
    "decode_pairs",
    "decode_arena",
    "decode_stream_message",
    "encode_arena",
    "encode_eos",
    "encode_error",
    "encode_error_payload",
    "encode_free",
    "encode_metadata_header",
    "encode_metadata_message",
    "encode_pairs",
    "encode_prefix",
    "fmt_seq",
    "fmt_tag",
    "make_body_tag",
    "next_seq",
    "parse_body_tag",
    "peek_prefix",
    "seq_add",
    "seq_diff",
    "seq_distance",
    "seq_lt",
    "seq_of",
]
