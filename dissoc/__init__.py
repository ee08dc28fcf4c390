"""dissoc: Apache Arrow's Dissociated IPC protocol in Python.

Arrow IPC metadata travels on one stream and message bodies on another (packed bytes, or address/length pairs
that point at shared, remote or GPU memory), matched by sequence number.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dissoc.errors import (
    CodecError,
    DevicePathError,
    DissocError,
    ProtocolError,
    RemoteError,
    ResourceError,
    TransportError,
)

if TYPE_CHECKING:  # what the lazy names below are, for type checkers and IDEs
    from dissoc.client import fetch, fetch_async, open_stream, stream_batches
    from dissoc.server import Server, ServerOptions

__version__ = "0.2.0"

__all__ = [
    "CodecError",
    "DevicePathError",
    "DissocError",
    "ProtocolError",
    "RemoteError",
    "ResourceError",
    "Server",
    "ServerOptions",
    "TransportError",
    "__version__",
    "fetch",
    "fetch_async",
    "open_stream",
    "stream_batches",
]

_LAZY = {
    "Server": ("dissoc.server", "Server"),
    "ServerOptions": ("dissoc.server", "ServerOptions"),
    "fetch": ("dissoc.client", "fetch"),
    "fetch_async": ("dissoc.client", "fetch_async"),
    "open_stream": ("dissoc.client", "open_stream"),
    "stream_batches": ("dissoc.client", "stream_batches"),
}


def __getattr__(name: str) -> object:
    # The servers and client pull in asyncio and the transports: load them on first use only.
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'dissoc' has no attribute {name!r}")
