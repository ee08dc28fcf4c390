"""Data-stream tags: u64 with the sequence number in bits 0-31, zero in bits 32-55, the body type in 56-63.

Body type 0 is a packed IPC body, body type 1 a list of address/length pairs. Type 1 is therefore
``1 << 56`` (the spec's diagrams write ``<< 55``; the spec text, followed here, says the most significant
byte -- see FACTS.md section 4).
"""

from __future__ import annotations

from typing import Final, NamedTuple

from dissoc.errors import ProtocolError
from dissoc.protocol.seq import check_seq

__all__ = [
    "BODY_PACKED",
    "ARENA_TAG",
    "BODY_ARENA",
    "BODY_ERROR",
    "BODY_PAIRS",
    "BODY_TYPE_SHIFT",
    "ERROR_TAG",
    "KNOWN_BODY_TYPES",
    "RESERVED_MASK",
    "SEQ_MASK",
    "TAG_MAX",
    "BodyTag",
    "body_type_name",
    "fmt_tag",
    "make_body_tag",
    "parse_body_tag",
]

SEQ_MASK: Final = 0x00000000FFFFFFFF
"""Bits of a tag holding the sequence number (the mask a receiver probes with)."""

RESERVED_MASK: Final = 0x00FFFFFF00000000
"""Reserved bits 32-55; they MUST be 0."""

BODY_TYPE_SHIFT: Final = 56
"""The body type lives in the most significant byte."""

TAG_MAX: Final = 0xFFFFFFFFFFFFFFFF

BODY_PACKED: Final = 0
"""Body type 0: the packed IPC body bytes."""

BODY_PAIRS: Final = 1
"""Body type 1: u64 total, u64 count, then (address-or-offset, length) u64 pairs."""

BODY_ERROR: Final = 0xE0
"""Project extension: a data server's error report (JSON ``{"code", "message"}``), for split layouts where the
data connection carries only tagged messages. Never passed to the reorder buffer."""

ERROR_TAG: Final = BODY_ERROR << 56

BODY_ARENA: Final = 0xE1
"""Project extension: a data server with private arenas (``private_memory``) says which arena this
connection's pair lists point into (JSON, :mod:`dissoc.protocol.arena`), after want_data was accepted and
before the stream's first pair list. Never passed to the reorder buffer."""

ARENA_TAG: Final = BODY_ARENA << 56

KNOWN_BODY_TYPES: Final = frozenset({BODY_PACKED, BODY_PAIRS})

_NAMES: Final = {BODY_PACKED: "packed", BODY_PAIRS: "pairs"}


class BodyTag(NamedTuple):
    """A decoded data-stream tag."""

    seq: int
    body_type: int


def body_type_name(body_type: int) -> str:
    """A readable name for a body type (``packed``, ``pairs`` or ``unknown(0x..)``)."""
    return _NAMES.get(body_type, f"unknown(0x{body_type:02x})")


def fmt_tag(tag: int) -> str:
    """A tag as it appears in logs and error messages: ``0x0100000000000007``."""
    return f"0x{tag:016x}"


def body_type_of(tag: int) -> int:
    """The body-type byte of a data-stream tag (bits 56-63), unchecked: for dispatch on the receive path;
    :func:`parse_body_tag` validates."""
    return tag >> BODY_TYPE_SHIFT


def seq_of(tag: int) -> int:
    """The sequence number of a data-stream tag (bits 0-31), unchecked."""
    return tag & SEQ_MASK


def make_body_tag(seq: int, body_type: int) -> int:
    """The tag for the body of message ``seq`` sent as ``body_type`` (``BODY_PACKED`` or ``BODY_PAIRS``).

    Raises :class:`ValueError` for an out-of-range sequence number or an unknown body type (both are local
    programming errors).
    """
    check_seq(seq)
    if body_type not in KNOWN_BODY_TYPES:
        raise ValueError(f"body type must be one of {sorted(KNOWN_BODY_TYPES)}, got {body_type!r}")
    return (body_type << BODY_TYPE_SHIFT) | seq


def parse_body_tag(tag: int) -> BodyTag:
    """Split a received tag into ``(seq, body_type)``.

    Raises :class:`~dissoc.errors.ProtocolError` if the tag is not a u64, has reserved bits set, or names an
    unknown body type.
    """
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= TAG_MAX:
        raise ProtocolError(f"data-stream tag: expected an unsigned 64-bit integer, got {tag!r}")
    if tag & RESERVED_MASK:
        raise ProtocolError(
            f"data-stream tag {fmt_tag(tag)}: expected reserved bits 32-55 to be 0, "
            f"got 0x{(tag & RESERVED_MASK):016x}"
        )
    body_type = tag >> BODY_TYPE_SHIFT
    if body_type not in KNOWN_BODY_TYPES:
        raise ProtocolError(
            f"data-stream tag {fmt_tag(tag)}: expected body type 0 (packed) or 1 (pairs) in bits 56-63, "
            f"got 0x{body_type:02x}"
        )
    return BodyTag(tag & SEQ_MASK, body_type)
