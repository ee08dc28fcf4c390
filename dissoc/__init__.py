"""dissoc: Apache Arrow's Dissociated IPC protocol in Python.

Arrow IPC metadata travels on one stream and message bodies on another (packed bytes, or address/length pairs
that point at shared, remote or GPU memory), matched by sequence number.
"""

from __future__ import annotations

from dissoc.errors import (
    CodecError,
    DissocError,
    ProtocolError,
    RemoteError,
    ResourceError,
    TransportError,
)

__version__ = "0.1.0"

__all__ = [
    "CodecError",
    "DissocError",
    "ProtocolError",
    "RemoteError",
    "ResourceError",
    "TransportError",
    "__version__",
]
