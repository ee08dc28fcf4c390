"""The arena announcement: a project extension that tells a client, in band, where its pair lists point.

A data server started with private arenas (``Server(private_memory=True)``) gives each data connection an
arena of its own, and its data URI no longer names one (``memory=KIND&arena=private``, no ``remote_handle``,
no ``rma_*``). Once the connection's want_data was accepted, and before the first pair list of each stream,
the server sends one tagged message on the data connection:

* tag :data:`~dissoc.protocol.tags.ARENA_TAG` (``0xE1 << 56``: body type ``0xE1`` in the most significant
  byte, sequence number and reserved bits 0), next to the error extension's ``0xE0``;
* payload: UTF-8 JSON, one object whose fields are the ones the data URI would carry for a shared arena:
  ``"memory"`` (``"shm"`` or ``"ucx"``), ``"remote_handle"`` (standard base64 of the handle: the segment's
  name, or the packed UCX remote key) and, as strings, the kind's other URI parameters (``rma_worker``,
  ``rma_base``, ``rma_length`` for ``ucx``), at most :data:`MAX_ARENA_PAYLOAD` bytes.

Every stream on the connection names the same arena; it lives until the connection closes. Pure: bytes in,
values out.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from typing import Final

from dissoc.errors import ProtocolError

__all__ = ["ARENA_MEMORY_KINDS", "MAX_ARENA_PAYLOAD", "ArenaAnnouncement", "decode_arena", "encode_arena"]

MAX_ARENA_PAYLOAD: Final = 64 << 10
"""Largest announcement a client reads (a UCX worker address and remote key are a few hundred bytes)."""

ARENA_MEMORY_KINDS: Final = frozenset({"shm", "ucx"})
"""The memory kinds an announcement may name (private arenas are host memory)."""

_RESERVED: Final = frozenset({"memory", "remote_handle", "want_data", "free_data"})


@dataclass(frozen=True, slots=True)
class ArenaAnnouncement:
    """Where one connection's pair lists point: what a data URI says about a shared arena."""

    memory: str
    remote_handle: bytes
    params: dict[str, str] = field(default_factory=dict)


def encode_arena(memory: str, remote_handle: bytes, params: dict[str, str] | None = None) -> bytes:
    """The announcement's payload (ASCII JSON). Raises :class:`ValueError` for an unknown memory kind, an
    empty handle, a parameter that would shadow a field, or a payload over :data:`MAX_ARENA_PAYLOAD`."""
    if memory not in ARENA_MEMORY_KINDS:
        raise ValueError(
            f"arena announcement: memory must be one of {sorted(ARENA_MEMORY_KINDS)}, got {memory!r}"
        )
    if not remote_handle:
        raise ValueError("arena announcement: expected a non-empty remote_handle")
    obj: dict[str, str] = {"memory": memory, "remote_handle": base64.b64encode(bytes(remote_handle)).decode()}
    for key, value in (params or {}).items():
        if key in _RESERVED:
            raise ValueError(f"arena announcement: parameter {key!r} has its own field")
        obj[str(key)] = str(value)
    payload = json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode("ascii")
    if len(payload) > MAX_ARENA_PAYLOAD:
        raise ValueError(f"arena announcement: {len(payload)} bytes, more than {MAX_ARENA_PAYLOAD}")
    return payload


def decode_arena(payload: bytes | bytearray | memoryview) -> ArenaAnnouncement:
    """Parse an announcement; :class:`~dissoc.errors.ProtocolError` for anything but one JSON object of
    strings with a known ``memory`` and a non-empty base64 ``remote_handle``, within
    :data:`MAX_ARENA_PAYLOAD` bytes."""
    view = memoryview(payload)
    if view.nbytes > MAX_ARENA_PAYLOAD:
        raise ProtocolError(
            f"arena announcement: expected at most {MAX_ARENA_PAYLOAD} bytes, got {view.nbytes}"
        )
    try:
        obj = json.loads(str(view, "utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProtocolError(f"arena announcement: expected UTF-8 JSON, got unparseable bytes ({e})") from None
    if not isinstance(obj, dict) or not all(isinstance(v, str) for v in obj.values()):
        raise ProtocolError("arena announcement: expected one JSON object whose values are strings")
    memory = obj.pop("memory", None)
    if memory not in ARENA_MEMORY_KINDS:
        raise ProtocolError(
            f"arena announcement: expected memory {' or '.join(sorted(ARENA_MEMORY_KINDS))}, got {memory!r}"
        )
    text = obj.pop("remote_handle", "")
    try:
        handle = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(
            f"arena announcement: expected a base64 remote_handle, got {text[:80]!r}"
        ) from None
    if not handle:
        raise ProtocolError("arena announcement: expected a non-empty remote_handle")
    for key in ("want_data", "free_data"):
        if key in obj:
            raise ProtocolError(f"arena announcement: {key!r} belongs in the data URI, not here")
    return ArenaAnnouncement(memory, handle, obj)
