"""The one exception family that dissoc raises.

Everything that goes wrong because of data from outside (the wire, a file, a peer) surfaces as a subclass of
:class:`DissocError`. Backend exceptions (socket errors, UCX errors, flatbuffers index errors) are
translated at the edge of the layer that meets them.
"""

from __future__ import annotations

__all__ = [
    "CodecError",
    "DevicePathError",
    "DissocError",
    "ProtocolError",
    "RemoteError",
    "ResourceError",
    "TransportError",
]


class DissocError(Exception):
    """Root of every error dissoc raises on purpose."""


class CodecError(DissocError, ValueError):
    """Malformed or unsupported Arrow IPC data (metadata, body, framing, compression)."""


class ProtocolError(DissocError):
    """A peer broke the Dissociated IPC rules (bad prefix, reserved tag bits, sequence gap, duplicate...)."""


class TransportError(DissocError):
    """Connecting, reading or writing failed, or the connection closed early."""


class RemoteError(DissocError):
    """The server reported an error (for example an unknown ticket)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ResourceError(DissocError):
    """A memory or in-flight limit would be exceeded."""


class DevicePathError(DissocError):
    """Bodies landing on the device would go through host memory, and the client required the device path
    (``ClientOptions(require_device_path=True)``, ``dissoc get --require-device-path``)."""
