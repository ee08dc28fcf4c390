"""Signed tickets: who may ask a server for which dataset, and until when.

A server started with a secret serves only tickets that carry a valid token. A *signed ticket* is one
URL-safe string, usable wherever a plain ticket (a dataset's name) is used::

    dt1.<NAME>.<EXPIRY>.<SCOPE>.<BIND>.<MAC>

- ``dt1``: the format and its version ("dissoc token, version 1");
- ``NAME``: the dataset's name, UTF-8, base64url without padding (``*`` grants every name on a Flight control
  plane; a data server serves only the name itself);
- ``EXPIRY``: unix seconds (decimal, no sign) after which the ticket is refused;
- ``SCOPE``: ``read`` (fetch, describe, list) or ``write`` (publish and remove through a control plane);
- ``BIND``: the client binding, UTF-8, base64url without padding, empty for none: when present, the ticket
  is only valid from a client whose mutual-TLS certificate subject is exactly this string;
- ``MAC``: HMAC-SHA256 with the server's secret over the ASCII bytes of everything before the last dot
  (``dt1.NAME.EXPIRY.SCOPE.BIND``), base64url without padding (43 characters).

Every field but the MAC is readable by anyone who holds the ticket (it is signed, not encrypted): dataset
names are not secret from whoever may fetch them. Comparison is constant-time (:func:`hmac.compare_digest`).
Ground floor: imports only the standard library and :mod:`dissoc.errors`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from dissoc.errors import DissocError

__all__ = [
    "ANY_NAME",
    "DEFAULT_TTL",
    "MIN_SECRET_BYTES",
    "PREFIX",
    "SCOPES",
    "Claims",
    "Scope",
    "Secret",
    "TokenError",
    "grants",
    "split_start",
    "is_signed",
    "load_secret",
    "mint",
    "parse_ttl",
    "peek",
    "verify",
]

log = logging.getLogger(__name__)

Scope = Literal["read", "write"]

#: The first field of every signed ticket (format version 1).
PREFIX: Final = "dt1"
#: The scopes a token can carry.
SCOPES: Final[tuple[Scope, ...]] = ("read", "write")
#: A token for this name grants every dataset of a Flight control plane (never a data-plane ticket).
ANY_NAME: Final = "*"
#: Seconds a minted ticket stays valid unless told otherwise (one hour).
DEFAULT_TTL: Final = 3600
#: Fewest bytes a secret may have (128 bits).
MIN_SECRET_BYTES: Final = 16

_B64: Final = re.compile(r"[A-Za-z0-9_-]*")
_DIGITS: Final = re.compile(r"[0-9]{1,12}")
_MAC_CHARS: Final = 43  # 32 bytes, base64url without padding
_TTL: Final = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*", re.IGNORECASE)
_TTL_UNITS: Final = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class TokenError(DissocError):
    """A ticket is not a valid signed ticket for the request: malformed, forged (signed with another
    secret), expired, of the wrong scope or name, or bound to another client. The message never holds the
    secret or the ticket's name."""


@dataclass(frozen=True, slots=True)
class Claims:
    """What a signed ticket says (checked by :func:`verify`, or read unchecked by :func:`peek`)."""

    name: str
    expires: int
    scope: Scope
    bind: str | None = None

    def grants(self, name: str) -> bool:
        """Whether these claims cover dataset ``name`` on a control plane (see :func:`grants`)."""
        return grants(self.name, name)


def grants(token_name: str, name: str) -> bool:
    """Whether a token for ``token_name`` covers dataset ``name`` on a Flight control plane: the name itself,
    the datasets under it (``token_name/...``: a Spark write's partitions), the name read from an offset
    (``token_name@OFFSET``, ``@earliest``, ``@latest``: a live stream), or any name for ``*``."""
    if token_name == ANY_NAME or name == token_name or name.startswith(token_name + "/"):
        return True
    base, start = split_start(name)
    return start is not None and base == token_name


def split_start(ticket: str) -> tuple[str, str | None]:
    """``("events", "12")`` for ``"events@12"`` (a live stream read from an offset: a number, ``earliest``
    or ``latest``); ``(ticket, None)`` for anything else."""
    base, at, start = ticket.rpartition("@")
    if at and base and (start.isdigit() or start in ("earliest", "latest")):
        return base, start
    return ticket, None


class Secret:
    """A server's signing key. Its ``repr`` and ``str`` never show the key (it is safe to log)."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes | bytearray | memoryview | str) -> None:
        raw = key.encode("utf-8") if isinstance(key, str) else bytes(key)
        if len(raw) < MIN_SECRET_BYTES:
            raise TokenError(
                f"a secret needs at least {MIN_SECRET_BYTES} bytes, got {len(raw)} (make one with "
                "'head -c 32 /dev/urandom > FILE' or 'openssl rand -hex 32 > FILE')"
            )
        self._key = raw

    @classmethod
    def generate(cls, nbytes: int = 32) -> Secret:
        """A new random secret (``os.urandom``)."""
        return cls(os.urandom(max(nbytes, MIN_SECRET_BYTES)))

    def mac(self, message: bytes) -> bytes:
        """HMAC-SHA256 of ``message`` under this secret."""
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def mint(
        self,
        name: str,
        *,
        ttl: float = DEFAULT_TTL,
        expires: int | None = None,
        scope: Scope = "read",
        bind: str | None = None,
    ) -> str:
        """A signed ticket for ``name`` (see :func:`mint`)."""
        return mint(self, name, ttl=ttl, expires=expires, scope=scope, bind=bind)

    def verify(
        self,
        ticket: str | bytes,
        *,
        scope: Scope | None = None,
        name: str | None = None,
        peer: str | None = None,
        now: float | None = None,
    ) -> Claims:
        """The checked claims of ``ticket`` (see :func:`verify`)."""
        return verify(self, ticket, scope=scope, name=name, peer=peer, now=now)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:
        return hash(hashlib.sha256(self._key).digest())

    def __repr__(self) -> str:
        return f"Secret(<{len(self._key)} bytes>)"

    __str__ = __repr__


def load_secret(path: str | os.PathLike[str]) -> Secret:
    """The secret held in the file ``path`` (its bytes, trailing whitespace and newlines left out).

    A missing, unreadable, empty or too short (under :data:`MIN_SECRET_BYTES`) file is a TokenError naming
    the file, never its contents. A file that others than its owner may read is used, with a warning.
    """
    p = Path(path)
    try:
        raw = p.read_bytes().rstrip(b" \t\r\n")
        mode = p.stat().st_mode
    except OSError as e:
        raise TokenError(f"cannot read the secret file {str(p)!r}: {e.strerror or e}") from None
    if not raw:
        raise TokenError(f"the secret file {str(p)!r} is empty")
    if len(raw) < MIN_SECRET_BYTES:
        raise TokenError(
            f"the secret in {str(p)!r} is {len(raw)} bytes; at least {MIN_SECRET_BYTES} are needed (make one "
            "with 'head -c 32 /dev/urandom > FILE' or 'openssl rand -hex 32 > FILE')"
        )
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("the secret file %r can be read by others than its owner (chmod 600 it)", str(p))
    return Secret(raw)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    if not _B64.fullmatch(text) or len(text) % 4 == 1:
        raise binascii.Error("not base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _as_secret(secret: Secret | bytes) -> Secret:
    return secret if isinstance(secret, Secret) else Secret(secret)


def mint(
    secret: Secret | bytes,
    name: str,
    *,
    ttl: float = DEFAULT_TTL,
    expires: int | None = None,
    scope: Scope = "read",
    bind: str | None = None,
) -> str:
    """A signed ticket for dataset ``name``, valid for ``ttl`` seconds from now (or until the unix time
    ``expires``), with ``scope`` ``"read"`` or ``"write"``, bound to the client whose certificate subject is
    ``bind`` (None: any client)."""
    if not isinstance(name, str) or not name:
        raise TokenError("a signed ticket needs a non-empty dataset name")
    if scope not in SCOPES:
        raise TokenError(f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    if expires is None:
        if not ttl > 0:
            raise TokenError(f"ttl must be a positive number of seconds, got {ttl!r}")
        expires = int(time.time() + ttl)
    if isinstance(expires, bool) or not isinstance(expires, int) or not 0 <= expires < 10**12:
        raise TokenError(f"expires must be unix seconds, got {expires!r}")
    if bind is not None and not bind:
        raise TokenError("bind must be a non-empty certificate subject, or None")
    body = ".".join(
        [
            PREFIX,
            _b64(name.encode("utf-8")),
            str(expires),
            scope,
            _b64(bind.encode("utf-8")) if bind is not None else "",
        ]
    )
    return body + "." + _b64(_as_secret(secret).mac(body.encode("ascii")))


def is_signed(ticket: str | bytes | bytearray | memoryview) -> bool:
    """Whether ``ticket`` has the shape of a signed ticket (``dt1.`` and six fields; nothing is checked)."""
    try:
        _split(ticket)
    except TokenError:
        return False
    return True


def _split(ticket: str | bytes | bytearray | memoryview) -> tuple[str, list[str]]:
    """(signed body, its fields) of a well-formed ticket, else TokenError."""
    if isinstance(ticket, str):
        if not ticket.isascii():
            raise TokenError("the ticket is not a signed ticket (it is not ASCII)")
        text = ticket
    else:
        try:
            text = bytes(ticket).decode("ascii")
        except UnicodeDecodeError:
            raise TokenError("the ticket is not a signed ticket (it is not ASCII)") from None
    fields = text.split(".")
    if len(fields) != 6 or fields[0] != PREFIX:
        raise TokenError(f"the ticket is not a signed ticket ({PREFIX}.NAME.EXPIRY.SCOPE.BIND.MAC)")
    return text.rpartition(".")[0], fields


def _claims(fields: list[str]) -> Claims:
    _, name_b64, expiry, scope, bind_b64, _mac = fields
    try:
        name = _unb64(name_b64).decode("utf-8")
        bind = _unb64(bind_b64).decode("utf-8") if bind_b64 else None
    except (binascii.Error, ValueError):
        raise TokenError("the signed ticket is malformed (a field is not base64url UTF-8)") from None
    if not _DIGITS.fullmatch(expiry):
        raise TokenError("the signed ticket is malformed (its expiry is not unix seconds)")
    if scope not in SCOPES or not name:
        raise TokenError("the signed ticket is malformed (unknown scope, or no name)")
    return Claims(name, int(expiry), scope, bind)


def peek(ticket: str | bytes | bytearray | memoryview) -> Claims | None:
    """The claims of a signed ticket, *unchecked* (for clients: which name a ticket is for); None when
    ``ticket`` is not a well-formed signed ticket."""
    try:
        return _claims(_split(ticket)[1])
    except TokenError:
        return None


def verify(
    secret: Secret | bytes,
    ticket: str | bytes | bytearray | memoryview,
    *,
    scope: Scope | None = None,
    name: str | None = None,
    peer: str | None = None,
    now: float | None = None,
) -> Claims:
    """The claims of ``ticket`` once checked: signed with ``secret`` (compared in constant time), not
    expired at ``now`` (default: the current time), of ``scope`` when given, for dataset ``name`` when given
    (as :func:`grants` says), and, when it carries a binding, presented by the client whose certificate
    subject ``peer`` is exactly that binding. Anything else raises :class:`TokenError`."""
    body, fields = _split(ticket)
    mac_b64 = fields[5]
    expected = _b64(_as_secret(secret).mac(body.encode("ascii")))
    # compare_digest on the text: constant time whatever the first differing character (equal lengths
    # are not required; a different length is refused as fast as a wrong MAC of the right length)
    if len(mac_b64) != _MAC_CHARS or not hmac.compare_digest(mac_b64, expected):
        raise TokenError("the ticket's signature is not valid for this server (forged, or another secret)")
    claims = _claims(fields)
    if claims.expires < (time.time() if now is None else now):
        raise TokenError("the signed ticket has expired")
    if scope is not None and claims.scope != scope:
        raise TokenError(f"the signed ticket has scope {claims.scope!r}; this request needs {scope!r}")
    if name is not None and not claims.grants(name):
        raise TokenError("the signed ticket is for another dataset")
    if claims.bind is not None and claims.bind != peer:
        raise TokenError("the signed ticket is bound to another client")
    return claims


def parse_ttl(text: str) -> float:
    """Seconds from ``"90"``, ``"90s"``, ``"10m"``, ``"2h"`` or ``"1d"`` (TokenError otherwise)."""
    found = _TTL.fullmatch(text)
    if found is None:
        raise TokenError(f"not a duration: {text!r} (expected e.g. 90, 90s, 10m, 2h, 1d)")
    seconds = float(found.group(1)) * _TTL_UNITS[found.group(2).lower()]
    if seconds <= 0:
        raise TokenError(f"a duration must be positive, got {text!r}")
    return seconds
