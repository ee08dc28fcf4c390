"""Dissociated IPC URIs: ``SCHEME://HOST:PORT?want_data=N[&free_data=M][&remote_handle=B64][&memory=KIND]``.

* ``want_data`` (required) and ``free_data`` (optional) are unsigned 64-bit decimal integers, the tags of the
  messages that start a stream and free memory.
* ``remote_handle`` (optional) is standard base64, percent-encoded in the query; readers also accept the
  URL-safe alphabet and missing padding. It is decoded to bytes.
* ``memory`` (optional) says what pair-list addresses point at: ``shm``, ``ucx`` or ``cuda``.
* Any other query parameters are kept, percent-decoded, in :attr:`DissocURI.params`.

SCHEME is the transport: ``tcp``, ``tls`` (the TCP transport inside TLS: a scheme of its own, so that no
reader can take a TLS server's URI for a plaintext one by skipping a query field), ``ucx``, or one registered
with :func:`register_scheme`.

HOST may be an IPv6 address in brackets (``tcp://[::1]:9000?want_data=1``); :attr:`DissocURI.host` holds it
without them. Anything malformed raises :class:`UriError` (a :class:`~dissoc.errors.DissocError` and a
:class:`ValueError`) saying what was expected and what was found.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import quote, unquote

from dissoc.errors import DissocError

__all__ = [
    "DEFAULT_SCHEMES",
    "MEMORY_KINDS",
    "RESERVED_PARAMS",
    "DissocURI",
    "UriError",
    "known_schemes",
    "register_scheme",
]


class UriError(DissocError, ValueError):
    """A Dissociated IPC URI is malformed or names something unknown."""


# tls: tcp inside TLS; inproc: in-process, for tests (mem: its name until 0.2)
DEFAULT_SCHEMES: Final = frozenset({"tcp", "tls", "ucx", "inproc", "mem"})
"""Schemes known without registration."""

MEMORY_KINDS: Final = frozenset({"shm", "ucx", "cuda"})
"""Accepted values of the ``memory`` parameter."""

RESERVED_PARAMS: Final = ("want_data", "free_data", "remote_handle", "memory")
"""Query parameters with their own fields (never in :attr:`DissocURI.params`)."""

_U64_MAX: Final = (1 << 64) - 1
_schemes: set[str] = set(DEFAULT_SCHEMES)

_SCHEME_RE: Final = re.compile(r"[a-z][a-z0-9+.\-]*")
_REG_NAME_RE: Final = re.compile(r"[A-Za-z0-9._~\-]+")
_DIGITS_RE: Final = re.compile(r"[0-9]+")
_BAD_PERCENT_RE: Final = re.compile(r"%(?![0-9A-Fa-f]{2})")
_CONTROL_RE: Final = re.compile(r"[\x00-\x20\x7f]")


def register_scheme(name: str) -> None:
    """Make ``name`` (lower-case URI scheme syntax) a known scheme, for transports added later."""
    if not isinstance(name, str) or not _SCHEME_RE.fullmatch(name):
        raise UriError(f"scheme: expected lower-case letters, digits, '+', '-' or '.', got {name!r}")
    _schemes.add(name)


def known_schemes() -> frozenset[str]:
    """The schemes currently accepted."""
    return frozenset(_schemes)


def _check_u64(name: str, value: object, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _U64_MAX:
        raise UriError(f"{name}: expected an unsigned 64-bit integer, got {value!r}")


def _check_host(host: object) -> None:
    if not isinstance(host, str) or not host:
        raise UriError(f"host: expected a non-empty host name or address, got {host!r}")
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise UriError(f"host: expected a valid IPv6 address, got {host!r}") from None
    elif not _REG_NAME_RE.fullmatch(host):
        raise UriError(
            f"host: expected letters, digits, '.', '-', '_' or '~' (or an IPv6 address), got {host!r}"
        )


def _check_text(what: str, text: object) -> str:
    if not isinstance(text, str):
        raise UriError(f"{what}: expected a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UriError(f"{what}: expected text encodable as UTF-8, got {text!r}") from None
    return text


def _parse_u64(name: str, text: str) -> int:
    if not _DIGITS_RE.fullmatch(text):
        raise UriError(f"{name}: expected an unsigned decimal integer, got {text!r}")
    digits = text.lstrip("0") or "0"
    if len(digits) > 20 or int(digits) > _U64_MAX:
        raise UriError(f"{name}: expected a value at most 2**64-1 ({_U64_MAX}), got {text}")
    return int(digits)


def _decode_b64(text: str) -> bytes:
    core = text.replace("-", "+").replace("_", "/").rstrip("=")
    if "=" in core or len(core) % 4 == 1:
        raise UriError(f"remote_handle: expected base64, got {text!r} (bad padding or length)")
    try:
        return base64.b64decode(core + "=" * (-len(core) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise UriError(f"remote_handle: expected base64, got {text!r}") from None


def _unquote(what: str, text: str) -> str:
    if _BAD_PERCENT_RE.search(text):
        raise UriError(f"{what}: expected '%' followed by two hex digits, got {text!r}")
    try:
        return unquote(text, encoding="utf-8", errors="strict")
    except UnicodeDecodeError:
        raise UriError(f"{what}: percent-encoded bytes are not UTF-8 in {text!r}") from None


@dataclass(frozen=True)
class DissocURI:
    """A parsed Dissociated IPC URI (immutable; every field validated on construction).

    ``str(uri)`` gives the canonical text form and ``DissocURI.parse(str(uri)) == uri``.
    """

    scheme: str
    host: str
    port: int
    want_data: int
    free_data: int | None = None
    remote_handle: bytes | None = None
    memory: str | None = None
    params: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.scheme, str) or not _SCHEME_RE.fullmatch(self.scheme):
            raise UriError(f"scheme: expected a lower-case URI scheme, got {self.scheme!r}")
        if self.scheme not in _schemes:
            raise UriError(
                f"scheme: expected one of {', '.join(sorted(_schemes))}, got {self.scheme!r} "
                "(transports register theirs with dissoc.uri.register_scheme)"
            )
        _check_host(self.host)
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise UriError(f"port: expected an integer in [0, 65535], got {self.port!r}")
        _check_u64("want_data", self.want_data, optional=False)
        _check_u64("free_data", self.free_data, optional=True)
        if self.remote_handle is not None:
            if not isinstance(self.remote_handle, bytes | bytearray | memoryview):
                raise UriError(f"remote_handle: expected bytes, got {type(self.remote_handle).__name__}")
            object.__setattr__(self, "remote_handle", bytes(self.remote_handle))
        if self.memory is not None and self.memory not in MEMORY_KINDS:
            raise UriError(f"memory: expected one of {', '.join(sorted(MEMORY_KINDS))}, got {self.memory!r}")
        if not isinstance(self.params, dict):
            raise UriError(f"params: expected a dict of str to str, got {type(self.params).__name__}")
        params: dict[str, str] = {}
        for key, value in self.params.items():
            _check_text("query parameter name", key)
            if not key:
                raise UriError("query parameter name: expected a non-empty name, got ''")
            if key in RESERVED_PARAMS:
                raise UriError(f"params: {key!r} has its own field; expected only other parameters")
            params[key] = _check_text(f"query parameter {key!r}", value)
        object.__setattr__(self, "params", params)  # a private copy: the URI stays immutable

    def __hash__(self) -> int:
        return hash(
            (
                self.scheme,
                self.host,
                self.port,
                self.want_data,
                self.free_data,
                self.remote_handle,
                self.memory,
                tuple(sorted(self.params.items())),
            )
        )

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` for connecting (an IPv6 host without brackets)."""
        return (self.host, self.port)

    @classmethod
    def parse(cls, text: str) -> DissocURI:
        """Parse ``SCHEME://HOST:PORT?want_data=N[&free_data=M][&remote_handle=B64][&memory=KIND][&...]``.

        Raises :class:`UriError` for anything malformed, naming the part and what was expected.
        """
        if not isinstance(text, str):
            raise UriError(f"URI: expected a string, got {type(text).__name__}")
        shown = text if len(text) <= 200 else text[:200] + "..."
        if _CONTROL_RE.search(text):
            raise UriError(f"URI: expected no spaces or control characters, got {shown!r}")
        scheme, sep, rest = text.partition("://")
        if not sep:
            raise UriError(f"URI: expected SCHEME://HOST:PORT?want_data=N, got {shown!r}")
        scheme = scheme.lower()
        if "#" in rest:
            raise UriError(f"URI: expected no fragment ('#...'), got {shown!r}")
        location, has_query, query = rest.partition("?")
        authority, _, path = location.partition("/")
        if path:
            raise UriError(f"URI: expected no path after HOST:PORT, got '/{path}' in {shown!r}")
        host, port = _parse_authority(authority, shown)
        if not has_query:
            raise UriError(f"URI: expected a query with want_data (?want_data=N), got none in {shown!r}")
        values: dict[str, str] = {}
        for part in query.split("&"):
            if not part:
                continue
            raw_key, eq, raw_value = part.partition("=")
            if not eq:
                raise UriError(f"query: expected name=value, got {part!r}")
            key = _unquote("query parameter name", raw_key)
            if not key:
                raise UriError(f"query: expected a parameter name before '=', got {part!r}")
            if key in values:
                raise UriError(f"query: expected each parameter once, got {key!r} twice")
            values[key] = _unquote(f"query parameter {key!r}", raw_value)
        if "want_data" not in values:
            raise UriError(f"query: expected the required want_data parameter, got none in {shown!r}")
        want_data = _parse_u64("want_data", values.pop("want_data"))
        free_text = values.pop("free_data", None)
        free_data = None if free_text is None else _parse_u64("free_data", free_text)
        handle_text = values.pop("remote_handle", None)
        remote_handle = None if handle_text is None else _decode_b64(handle_text)
        memory = values.pop("memory", None)
        return cls(scheme, host, port, want_data, free_data, remote_handle, memory, values)

    def to_string(self) -> str:
        """The canonical text form (what ``str()`` returns)."""
        host = f"[{quote(self.host, safe=':')}]" if ":" in self.host else self.host
        query = [f"want_data={self.want_data}"]
        if self.free_data is not None:
            query.append(f"free_data={self.free_data}")
        if self.remote_handle is not None:
            query.append(
                "remote_handle=" + quote(base64.b64encode(self.remote_handle).decode("ascii"), safe="")
            )
        if self.memory is not None:
            query.append(f"memory={self.memory}")
        query.extend(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in self.params.items())
        return f"{self.scheme}://{host}:{self.port}?{'&'.join(query)}"

    def __str__(self) -> str:
        return self.to_string()


def _parse_authority(authority: str, shown: str) -> tuple[str, int]:
    if "@" in authority:
        raise UriError(f"URI: expected HOST:PORT without user information, got {authority!r}")
    if authority.startswith("["):
        end = authority.find("]")
        if end < 0:
            raise UriError(f"host: expected ']' closing the IPv6 address, got {authority!r}")
        host = _unquote("host", authority[1:end])
        if not host:
            raise UriError(f"host: expected an IPv6 address inside the brackets, got {authority!r}")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise UriError(f"host: expected a valid IPv6 address inside the brackets, got {host!r}") from None
        after = authority[end + 1 :]
        if not after.startswith(":"):
            raise UriError(f"URI: expected ':PORT' after the IPv6 address, got {after!r} in {shown!r}")
        port_text = after[1:]
    else:
        host, colon, port_text = authority.rpartition(":")
        if not colon:
            raise UriError(f"URI: expected HOST:PORT, got {authority!r} (no port) in {shown!r}")
        if ":" in host:
            raise UriError(f"host: expected an IPv6 address to be in brackets ([...]), got {host!r}")
        if not host:
            raise UriError(f"host: expected a host name or address before ':{port_text}', got none")
    if not _DIGITS_RE.fullmatch(port_text) or len(port_text) > 5 or int(port_text) > 65535:
        raise UriError(f"port: expected a decimal integer in [0, 65535], got {port_text!r}")
    return host, int(port_text)
