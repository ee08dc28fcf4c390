"""The scheme registry: ``tcp``, ``tls``, ``inproc``, ``ucx``, ... mapped to their ``connect``/``serve``
functions.

Each transport module registers itself when imported (:func:`register_transport`); ``ucx``, ``tls`` and
``inproc`` are imported only when their scheme is first used, so that importing :mod:`dissoc` never imports
ucxx or ssl, nor the in-process transport of the tests.
"""

from __future__ import annotations

import importlib
import inspect
import typing
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


def serve_options(scheme: str) -> frozenset[str] | None:
    """The keyword options the ``serve`` of ``scheme``'s transport takes (its keyword-only parameters, and the
    keys of a ``**options: Unpack[SomeTypedDict]``); None when it takes any. Loads the transport
    (:class:`~dissoc.errors.TransportError` when it cannot be)."""
    serve = _entry(scheme).serve
    taken: set[str] = set()
    for p in inspect.signature(serve).parameters.values():
        if p.kind is p.KEYWORD_ONLY:
            taken.add(p.name)
        elif p.kind is p.VAR_KEYWORD:
            hint = p.annotation
            if isinstance(hint, str):  # (postponed annotations: evaluated in the function's module)
                try:
                    hint = eval(hint, getattr(serve, "__globals__", {}))
                except Exception:
                    return None
            args = typing.get_args(hint) if typing.get_origin(hint) is typing.Unpack else ()
            if not args or not typing.is_typeddict(args[0]):
                return None
            taken.update(args[0].__required_keys__, args[0].__optional_keys__)
    return frozenset(taken)


async def connect(scheme: str, host: str, port: int, **options: Any) -> Connection:
    """Connect with the transport registered for ``scheme`` (``tcp``, ``inproc``, ...)."""
    return await _entry(scheme).connect(host, port, **options)


async def serve(scheme: str, host: str, port: int, handler: Handler, **options: Any) -> Listener:
    """Listen with the transport registered for ``scheme``; ``handler`` runs once per accepted connection."""
    return await _entry(scheme).serve(host, port, handler, **options)
