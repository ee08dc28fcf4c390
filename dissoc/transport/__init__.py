"""Transports: one small asyncio interface (:class:`Connection`, :class:`Listener`) and its implementations.

- ``tcp`` (:mod:`dissoc.transport.tcp`): the default, production data path; no extra dependencies.
- ``inproc`` (:mod:`dissoc.transport.inproc`): in-process, with fault injection, for tests (import its names
  from there).

:func:`connect` and :func:`serve` dispatch on a URI scheme (:mod:`dissoc.transport.registry`); ``ucx``
(:mod:`dissoc.transport.ucx`), ``tls`` and ``inproc`` are imported on first use of their scheme.
"""

from __future__ import annotations

from dissoc.buffers import ALIGNMENT, DEFAULT_POOL, BufferPool, BytesLike, aligned_empty, default_allocator
from dissoc.transport.base import (
    DEFAULT_MAX_BUFFERED_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    TAG_MASK_ALL,
    Allocator,
    BufferLimitError,
    Connection,
    FrameError,
    Handler,
    Listener,
    MessageTooLargeError,
    SendData,
)
from dissoc.transport.message import TaggedMessage
from dissoc.transport.registry import connect, register_transport, registered_schemes, serve
from dissoc.transport.tcp import (
    DEFAULT_KEEPALIVE,
    Keepalive,
    TcpConnection,
    TcpListener,
    connect_tcp,
    serve_tcp,
)

__all__ = [
    "ALIGNMENT",
    "DEFAULT_KEEPALIVE",
    "DEFAULT_MAX_BUFFERED_BYTES",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_POOL",
    "TAG_MASK_ALL",
    "Allocator",
    "BufferLimitError",
    "BufferPool",
    "BytesLike",
    "Connection",
    "FrameError",
    "Handler",
    "Keepalive",
    "Listener",
    "MessageTooLargeError",
    "SendData",
    "TaggedMessage",
    "TcpConnection",
    "TcpListener",
    "aligned_empty",
    "connect",
    "connect_tcp",
    "default_allocator",
    "register_transport",
    "registered_schemes",
    "serve",
    "serve_tcp",
]
