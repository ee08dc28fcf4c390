"""The scheme registry: ``tcp``, ``tls``, ``inproc``, ``ucx``, ... mapped to their ``connect``/``serve``
functions.

Each transport module registers itself when imported (:func:`register_transport`); ``ucx``, ``tls`` and
``inproc`` are imported only when their scheme is first used, so that importing :mod:`dissoc` never imports
ucxx or ssl, nor the in-process transport of the tests.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

from dissoc.errors import TransportError
from dissoc.transport.base import Connection, Handler, Listener

__all__ = ["ConnectFunction", "ServeFunction", "connect", "register_transport", "registered_schemes", "serve"]

ConnectFunction: TypeAlias = "Callable[..., Awaitable[Connection]]"
ServeFunction: TypeAlias = "Callable[..., Awaitable[Listener]]"


@dataclass(frozen=True)
class _Entry:
    connect: ConnectFunction
    serve: ServeFunction


_REGISTRY: dict[str, _Entry] = {}
# Imported on first use: ucx needs ucxx; tls loads OpenSSL, which plaintext users need not pay for; inproc
# is for tests (mem: its name until 0.2).
_LAZY: dict[str, str] = {
    "ucx": "dissoc.transport.ucx",
    "tls": "dissoc.transport.tls",
    "inproc": "dissoc.transport.inproc",
    "mem": "dissoc.transport.inproc",
}


def register_transport(scheme: str, connect: ConnectFunction, serve: ServeFunction) -> None:
    """Register ``connect(host, port, **options)`` and ``serve(host, port, handler, **options)``."""
    _REGISTRY[scheme.lower()] = _Entry(connect, serve)


def registered_schemes() -> list[str]:
    """The schemes with a loaded transport."""
    return sorted(_REGISTRY)


def _entry(scheme: str) -> _Entry:
    key = scheme.lower()
    entry = _REGISTRY.get(key)
    if entry is None and key in _LAZY:
        try:
            importlib.import_module(_LAZY[key])
        except ImportError as exc:
            raise TransportError(
                f"the {key!r} transport is not available ({exc}); install the extra that provides it, "
                f"e.g. pip install 'dissoc[{key}]'"
            ) from exc
        entry = _REGISTRY.get(key)
    if entry is None:
        raise TransportError(f"unknown transport scheme {scheme!r}; expected one of {registered_schemes()}")
    return entry


async def connect(scheme: str, host: str, port: int, **options: Any) -> Connection:
    """Connect with the transport registered for ``scheme`` (``tcp``, ``inproc``, ...)."""
    return await _entry(scheme).connect(host, port, **options)


async def serve(scheme: str, host: str, port: int, handler: Handler, **options: Any) -> Listener:
    """Listen with the transport registered for ``scheme``; ``handler`` runs once per accepted connection."""
    return await _entry(scheme).serve(host, port, handler, **options)
