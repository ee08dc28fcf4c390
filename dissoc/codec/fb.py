"""A small, bounds-checked flatbuffers table reader.

The generated flatbuffers accessors trust their input; bytes from the wire cannot be trusted, so every offset
read here is checked against the bytes present before it is followed, and every failure becomes a
:class:`~dissoc.errors.CodecError`. Vectors of structs are handed back as one memoryview so callers can read
them in bulk with numpy instead of one accessor call per element.
"""

from __future__ import annotations

import struct
from typing import Final

from dissoc.errors import CodecError

__all__ = ["Table", "root_table"]

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")

_u16 = _U16.unpack_from
_u32 = _U32.unpack_from
_i32 = _I32.unpack_from

_SCALARS: Final = {
    "b": struct.Struct("<b"),
    "B": struct.Struct("<B"),
    "?": struct.Struct("<?"),
    "h": struct.Struct("<h"),
    "H": struct.Struct("<H"),
    "i": struct.Struct("<i"),
    "I": struct.Struct("<I"),
    "q": struct.Struct("<q"),
    "Q": struct.Struct("<Q"),
}


def root_table(buf: memoryview, what: str = "flatbuffer") -> Table:
    """The root table of the flatbuffer ``buf`` (a byte memoryview)."""
    n = len(buf)
    if n < 8:
        raise CodecError(f"{what}: expected at least 8 bytes of flatbuffer, got {n}")
    return Table(buf, _u32(buf, 0)[0], what)


class Table:
    """One flatbuffers table at absolute position ``pos`` of ``buf``, with checked field access."""

    __slots__ = ("_buf", "_n", "_pos", "_vt", "_vtsize", "what")

    def __init__(self, buf: memoryview, pos: int, what: str) -> None:
        n = len(buf)
        self.what = what
        if pos < 0 or pos + 4 > n:
            raise CodecError(f"{what}: table offset {pos} outside the {n}-byte flatbuffer")
        vt = pos - _i32(buf, pos)[0]
        if vt < 0 or vt + 4 > n:
            raise CodecError(f"{what}: vtable offset {vt} outside the {n}-byte flatbuffer")
        vtsize = _u16(buf, vt)[0]
        if vtsize < 4 or vtsize & 1 or vt + vtsize > n:
            raise CodecError(f"{what}: vtable size {vtsize} at {vt} is invalid for a {n}-byte flatbuffer")
        self._buf = buf
        self._n = n
        self._pos = pos
        self._vt = vt
        self._vtsize = vtsize

    def _field(self, fid: int, size: int) -> int:
        """Absolute position of field ``fid`` (0 when absent), checked to hold ``size`` bytes."""
        o = 4 + 2 * fid
        if o >= self._vtsize:
            return 0
        off = _u16(self._buf, self._vt + o)[0]
        if off == 0:
            return 0
        p: int = self._pos + off
        if p + size > self._n:
            raise CodecError(f"{self.what}: field {fid} at {p} runs past the {self._n}-byte flatbuffer")
        return p

    def slots(self, count: int) -> list[int]:
        """Absolute positions of fields ``0..count-1`` (0 where absent), read from the vtable at once.

        Positions are only checked to lie inside the buffer; readers check the size they read.
        """
        have = min(count, (self._vtsize - 4) // 2)
        offs = struct.unpack_from(f"<{have}H", self._buf, self._vt + 4) if have > 0 else ()
        pos, n = self._pos, self._n
        out = [0] * count
        for i, o in enumerate(offs):
            if o:
                p = pos + o
                if p >= n:
                    raise CodecError(f"{self.what}: field {i} at {p} lies past the {n}-byte flatbuffer")
                out[i] = p
        return out

    def has(self, fid: int) -> bool:
        o = 4 + 2 * fid
        return o < self._vtsize and int(_u16(self._buf, self._vt + o)[0]) != 0

    def scalar(self, fid: int, fmt: str, default: int | bool) -> int:
        s = _SCALARS[fmt]
        p = self._field(fid, s.size)
        if p == 0:
            return int(default)
        return int(s.unpack_from(self._buf, p)[0])

    def _deref(self, fid: int) -> int:
        p = self._field(fid, 4)
        if p == 0:
            return 0
        target: int = p + _u32(self._buf, p)[0]
        if target + 4 > self._n:
            raise CodecError(
                f"{self.what}: field {fid} points to {target}, past the {self._n}-byte flatbuffer"
            )
        return target

    def table(self, fid: int, what: str | None = None) -> Table | None:
        t = self._deref(fid)
        if t == 0:
            return None
        return Table(self._buf, t, what or self.what)

    def _vector(self, fid: int, elem_size: int) -> tuple[int, int]:
        """(position of the first element, element count); (0, -1) when the field is absent."""
        v = self._deref(fid)
        if v == 0:
            return 0, -1
        count = _u32(self._buf, v)[0]
        start = v + 4
        if start + count * elem_size > self._n:
            raise CodecError(
                f"{self.what}: vector field {fid} claims {count} elements of {elem_size} bytes, "
                f"only {self._n - start} bytes remain"
            )
        return start, count

    def vector_bytes(self, fid: int, elem_size: int) -> memoryview | None:
        """The raw bytes of a vector of scalars or structs (None when absent)."""
        start, count = self._vector(fid, elem_size)
        if count < 0:
            return None
        return self._buf[start : start + count * elem_size]

    def tables(self, fid: int, what: str | None = None) -> list[Table]:
        """A vector of tables (empty when absent)."""
        start, count = self._vector(fid, 4)
        if count <= 0:
            return []
        buf = self._buf
        w = what or self.what
        out = []
        for i in range(count):
            p = start + 4 * i
            out.append(Table(buf, p + _u32(buf, p)[0], w))
        return out

    def string(self, fid: int) -> str | None:
        start, count = self._vector(fid, 1)
        if count < 0:
            return None
        try:
            return str(self._buf[start : start + count], "utf-8")
        except UnicodeDecodeError as e:
            raise CodecError(f"{self.what}: string field {fid} is not valid UTF-8 ({e.reason})") from None

    def union(self, type_fid: int, what: str | None = None) -> tuple[int, Table | None]:
        """A union's (type tag, table); the table field id is ``type_fid + 1``."""
        kind = self.scalar(type_fid, "B", 0)
        return kind, self.table(type_fid + 1, what)
