"""The buffer-size rules: which buffers each layout has, and how many bytes each needs for a node's length.

One table for every reader of message bodies: the decoder (its vectorised size checks, decompression bounds
and byte swapping) and :mod:`dissoc.codec.layout` (size checks of bodies it never reads). Every buffer of a
node has a *role* (validity bitmap, offsets, views, ...); :data:`ROLES` lists the roles of each layout's
buffers in IPC order and :data:`ROLE_SIZES` says what each role must hold for a node of a given length.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from dissoc.codec.schema import FieldPlan, Layout

__all__ = [
    "BITS",
    "DATA",
    "FIXED",
    "IPC_BUFFERS",
    "MAX_NODE_LENGTH",
    "NO_VALIDITY",
    "OFF4",
    "OFF8",
    "ROLES",
    "ROLE_SIZES",
    "SIZES4",
    "SIZES8",
    "SKIP",
    "TYPE_IDS",
    "UNIONS",
    "VALIDITY",
    "VIEWS",
    "SizeRules",
    "decompressed_bound",
    "last_offset",
    "long_view_bytes",
    "node_required_sizes",
    "required_sizes",
    "roles",
    "size_rules",
]

# Buffer roles.
VALIDITY, BITS, FIXED, OFF4, OFF8, DATA, VIEWS, TYPE_IDS, SIZES4, SIZES8, SKIP = range(11)

#: The roles of each layout's buffers, in IPC order. A VIEW node has one more DATA buffer per variadic buffer;
#: a union of a V4 (pre-1.0) message has a validity buffer first, which readers skip.
ROLES: dict[Layout, tuple[int, ...]] = {
    Layout.NULL: (),
    Layout.BOOL: (VALIDITY, BITS),
    Layout.FIXED: (VALIDITY, FIXED),
    Layout.BINARY: (VALIDITY, OFF4, DATA),
    Layout.LARGE_BINARY: (VALIDITY, OFF8, DATA),
    Layout.VIEW: (VALIDITY, VIEWS),
    Layout.LIST: (VALIDITY, OFF4),
    Layout.LARGE_LIST: (VALIDITY, OFF8),
    Layout.LIST_VIEW: (VALIDITY, SIZES4, SIZES4),
    Layout.LARGE_LIST_VIEW: (VALIDITY, SIZES8, SIZES8),
    Layout.FIXED_LIST: (VALIDITY,),
    Layout.STRUCT: (VALIDITY,),
    Layout.SPARSE_UNION: (TYPE_IDS,),
    Layout.DENSE_UNION: (TYPE_IDS, SIZES4),
    Layout.RUN_END: (),
}

#: Fixed buffer counts per layout in the IPC (VIEW adds its variadic buffers).
IPC_BUFFERS: dict[Layout, int] = {layout: len(r) for layout, r in ROLES.items()}
#: Layouts without a validity bitmap.
NO_VALIDITY = frozenset(layout for layout, r in ROLES.items() if VALIDITY not in r)
UNIONS = frozenset((Layout.SPARSE_UNION, Layout.DENSE_UNION))

#: Per role, what a buffer must hold for a node of length n: (bytes per element, an extra element when
#: n > 0 (offsets), bit-packed, validity (nothing needed without nulls)). FIXED, absent here, has the plan's
#: width in bytes per element.
ROLE_SIZES: dict[int, tuple[int, int, bool, bool]] = {
    VALIDITY: (0, 0, True, True),
    BITS: (0, 0, True, False),
    OFF4: (4, 1, False, False),
    OFF8: (8, 1, False, False),
    SIZES4: (4, 0, False, False),
    SIZES8: (8, 0, False, False),
    VIEWS: (16, 0, False, False),
    TYPE_IDS: (1, 0, False, False),
    DATA: (0, 0, False, False),
    SKIP: (0, 0, False, False),
}

#: Node lengths above this need more bytes than any body can have (see :func:`required_sizes`).
MAX_NODE_LENGTH = 1 << 56


def roles(p: FieldPlan, nbuf: int, drop_first: bool) -> tuple[int, ...]:
    """The roles of a node's ``nbuf`` IPC buffers (``drop_first``: a V4 union's validity buffer first)."""
    r = ROLES[p.layout]
    if p.layout == Layout.VIEW:
        r += (DATA,) * (nbuf - 2)
    return (SKIP, *r) if drop_first else r


class SizeRules(NamedTuple):
    """Per IPC buffer of a batch: its owning node and its :data:`ROLE_SIZES` entry, as arrays."""

    node: npt.NDArray[np.int64]
    mul: npt.NDArray[np.int64]
    plus: npt.NDArray[np.int64]
    bits: npt.NDArray[np.bool_]
    validity: npt.NDArray[np.bool_]


def size_rules(
    flat: list[FieldPlan], nbuf: npt.NDArray[np.int64], drop_first: npt.NDArray[np.bool_]
) -> SizeRules:
    """The size rules of every IPC buffer of the nodes ``flat`` (with ``nbuf`` buffers each)."""
    node, mul, plus, bits, validity = [], [], [], [], []
    for i, p in enumerate(flat):
        for role in roles(p, int(nbuf[i]), bool(drop_first[i])):
            m, extra, b, v = ROLE_SIZES.get(role, (p.width, 0, False, False))
            node.append(i)
            mul.append(m)
            plus.append(extra)
            bits.append(b)
            validity.append(v)
    return SizeRules(
        np.array(node, np.int64),
        np.array(mul, np.int64),
        np.array(plus, np.int64),
        np.array(bits, bool),
        np.array(validity, bool),
    )


def required_sizes(rules: SizeRules, nodes: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The bytes each buffer must hold for this batch's node lengths (what Arrow will read)."""
    node, mul, plus, bits, validity = rules
    # Lengths beyond any real buffer are clamped first, so that (length + 1) * width cannot wrap around int64
    # into a small requirement (a node of length 2**63 - 1 once passed as needing a negative size).
    length = np.minimum(nodes[node, 0], MAX_NODE_LENGTH)
    req: npt.NDArray[np.int64] = np.where(bits, (length + 7) // 8, (length + (length > 0) * plus) * mul)
    req[validity & (nodes[node, 1] == 0)] = 0
    return req


def node_required_sizes(p: FieldPlan, length: int, null_count: int, nbuf: int, drop_first: bool) -> list[int]:
    """The bytes each of one node's ``nbuf`` buffers must hold for its length (Python integers: no clamp)."""
    out: list[int] = []
    for role in roles(p, nbuf, drop_first):
        mul, plus, bits, validity = ROLE_SIZES.get(role, (p.width, 0, False, False))
        if validity and not null_count:
            out.append(0)
        elif bits:
            out.append((length + 7) // 8)
        else:
            out.append((length + (plus if length else 0)) * mul)
    return out


# The slow paths (compressed bodies): how much a buffer may decompress to.


def decompressed_bound(role: int, p: FieldPlan, length: int, limit: int) -> int:
    """The largest uncompressed size the metadata justifies for one buffer: twice a need counted generously
    (sizes too get an offsets' extra element) plus slack, for writers that store more than readers need."""
    slack = 4096
    if role in (VALIDITY, BITS):
        need = (length + 7) // 8
    elif role == FIXED:
        need = length * p.width
    elif role in (OFF4, SIZES4):
        need = (length + 1) * 4
    elif role in (OFF8, SIZES8):
        need = (length + 1) * 8
    elif role == VIEWS:
        need = length * 16
    elif role == TYPE_IDS:
        need = length
    else:
        return limit
    return min(limit, 2 * need + slack)


def last_offset(data: memoryview | npt.NDArray[np.uint8], width: int, length: int) -> int:
    """The last of ``length + 1`` (native) offsets: what the data buffer must hold; 0 when unreadable."""
    if length == 0 or len(data) < (length + 1) * width:
        return 0
    return max(int(np.frombuffer(data, "<i4" if width == 4 else "<i8", 1, length * width)[0]), 0)


def long_view_bytes(data: memoryview | npt.NDArray[np.uint8], length: int) -> int:
    """Total length of the out-of-line (native) views: no variadic buffer needs more."""
    if length == 0 or len(data) < length * 16:
        return 0
    lens = np.frombuffer(data, "<i4", length * 4)[::4].astype(np.int64)
    return int(lens[lens > 12].sum())
