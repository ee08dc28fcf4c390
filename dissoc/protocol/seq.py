"""Sequence numbers: unsigned 32-bit, starting at 0 (the schema), rolling over after ``0xFFFFFFFF`` to 0.

Because numbers roll over, "before" and "after" only make sense within a window: ``seq_diff(a, b)`` is the
signed distance from ``b`` to ``a`` taken in ``[-2**31, 2**31)``, which is correct as long as the two numbers
are less than ``2**31`` messages apart (the spec assumes no more than that are ever outstanding).
"""

from __future__ import annotations

__all__ = [
    "SEQ_HALF",
    "SEQ_MAX",
    "SEQ_MODULUS",
    "check_seq",
    "fmt_seq",
    "next_seq",
    "seq_add",
    "seq_diff",
    "seq_distance",
    "seq_lt",
]

SEQ_MAX = 0xFFFFFFFF
"""The largest sequence number; the one after it is 0."""

SEQ_MODULUS = 1 << 32
"""Sequence arithmetic is modulo this."""

SEQ_HALF = 1 << 31
"""Half the sequence space: the widest window in which ordering comparisons are meaningful."""


def check_seq(seq: int) -> int:
    """Return ``seq`` unchanged if it is a valid u32 sequence number, else raise :class:`ValueError`.

    This guards values produced locally (a programming error); numbers decoded from the wire are u32 by
    construction.
    """
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= SEQ_MAX:
        raise ValueError(f"sequence number must be an int in [0, 0x{SEQ_MAX:08x}], got {seq!r}")
    return seq


def next_seq(seq: int) -> int:
    """The sequence number after ``seq`` (``0xFFFFFFFF`` is followed by 0)."""
    return (check_seq(seq) + 1) & SEQ_MAX


def seq_add(seq: int, n: int) -> int:
    """``seq`` advanced by ``n`` (which may be negative or larger than the sequence space), modulo 2**32."""
    return (check_seq(seq) + n) & SEQ_MAX


def seq_distance(start: int, end: int) -> int:
    """Forward distance from ``start`` to ``end``: how many ``next_seq`` steps lead from one to the other.

    Always in ``[0, 2**32)``; ``seq_distance(0xFFFFFFFF, 0) == 1``.
    """
    return (check_seq(end) - check_seq(start)) & SEQ_MAX


def seq_diff(a: int, b: int) -> int:
    """Signed modular difference ``a - b`` in ``[-2**31, 2**31)``: positive when ``a`` comes after ``b``."""
    d = seq_distance(b, a)
    return d - SEQ_MODULUS if d >= SEQ_HALF else d


def seq_lt(a: int, b: int) -> bool:
    """Whether ``a`` comes strictly before ``b``, across roll-over (within a window of ``2**31``)."""
    return seq_diff(a, b) < 0


def fmt_seq(seq: int) -> str:
    """A sequence number as it appears in logs and error messages: ``0x0000002a``."""
    return f"0x{seq:08x}"
