"""Straight-line encoders, generated once per schema of flat columns.

A schema of only fixed-width, boolean, binary, string and null columns is encoded the same way for every
batch: the same buffers of the same columns, in the same order. :func:`compile_flat` writes that order out as
the source of one function with no loop and no dispatch on kinds, for the common case of a batch whose
columns are not sliced (every array offset 0) and which has rows; it returns ``None`` for anything else, and
the encoder's general one-pass loop takes the batch. Both must give the same bytes (the tests compare them).

Why generate code: per message, a 3-column encode is some 5 µs of Python, 2 µs of it in pyarrow's column
wrappers, which nothing avoids; the kind dispatch and per-column offset handling of the loop are most of the
rest, and a function specialised to the schema drops them (as ``dataclasses`` and ``namedtuple`` write their
methods). The source comes only from the column kinds and widths, never from names or data.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Sequence
from typing import Any

from dissoc.codec.message import MessageTemplate

__all__ = ["FLAT_KINDS", "compile_flat"]

#: The column kinds a generated encoder handles: (name, width) with width the bytes per value (fixed), the
#: offset width 4 or 8 (binary), unused for null and bool.
FLAT_KINDS = ("null", "fixed", "bool", "binary")

_OFFSET_FORMATS = {4: struct.Struct("<i"), 8: struct.Struct("<q")}


def _validity(i: int) -> list[str]:
    """A column's validity bitmap: sent only where the column has nulls."""
    return [
        f"if z{i}:",
        f"    v = b{i}[0]",
        "    if v.size != bitmap:",
        "        v = v.slice(0, bitmap)",
        "    add(v)",
        "    if bitmap_pad:",
        "        add(pads[bitmap_pad])",
        "    spans += (pos, bitmap)",
        "    pos += bitmap_padded",
        "else:",
        "    spans += (pos, 0)",
    ]


def _fixed(i: int, width: int) -> list[str]:
    if width == 0:  # fixed_size_binary(0): values without bytes
        return ["spans += (pos, 0)"]
    lines = [
        f"d = b{i}[1]",
        f"if d.size != nb{width}:",
        f"    d = d.slice(0, nb{width})",
        "add(d)",
        f"spans += (pos, nb{width})",
    ]
    if width % 8:
        lines += [f"pad = -nb{width} & 7", "if pad:", "    add(pads[pad])", f"pos += nb{width} + pad"]
    else:
        lines.append(f"pos += nb{width}")
    return lines


def _bool(i: int) -> list[str]:
    return [
        f"d = b{i}[1]",
        "if d.size != bitmap:",
        "    d = d.slice(0, bitmap)",
        "add(d)",
        "if bitmap_pad:",
        "    add(pads[bitmap_pad])",
        "spans += (pos, bitmap)",
        "pos += bitmap_padded",
    ]


def _binary(i: int, width: int) -> list[str]:
    # The offsets as they are (they start at 0 or above; readers skip bytes before the first), the data from
    # the buffer's start up to the last offset.
    return [
        f"o = b{i}[1]",
        f"last = offset{width}(o, n * {width})[0]",
        f"if o.size != offsets{width}:",
        f"    o = o.slice(0, offsets{width})",
        "add(o)",
        f"if offsets_pad{width}:",
        f"    add(pads[offsets_pad{width}])",
        f"spans += (pos, offsets{width})",
        f"pos += offsets{width} + offsets_pad{width}",
        "if last > 0:",
        f"    d = b{i}[2]",
        "    if d.size != last:",
        "        d = d.slice(0, last)",
        "    add(d)",
        "    pad = -last & 7",
        "    if pad:",
        "        add(pads[pad])",
        "    spans += (pos, last)",
        "    pos += last + pad",
        "else:",
        "    spans += (pos, 0)",
    ]


def compile_flat(
    columns: Sequence[tuple[str, int]],
    template: MessageTemplate,
    make: Callable[[bytes, list[Any], int], Any],
    pads: Sequence[bytes],
) -> Callable[[Any], Any]:
    """A function ``encode(batch)`` for batches whose columns are ``columns`` ((kind, width) per column, kinds
    from :data:`FLAT_KINDS`): ``make(template.fill(body_length, rows, nodes, spans), body, body_length)`` for
    a batch with rows and no sliced column, else ``None``. ``pads[k]`` is ``k`` zero bytes. Made once per
    process for each set of arguments (a stream's encoder is made per request; the code of a 60-column
    schema takes some 5 ms to generate)."""
    return _compile_flat(tuple(columns), template, make, tuple(pads))


@functools.lru_cache(maxsize=256)
def _compile_flat(
    columns: tuple[tuple[str, int], ...],
    template: MessageTemplate,
    make: Callable[[bytes, list[Any], int], Any],
    pads: tuple[bytes, ...],
) -> Callable[[Any], Any]:
    for kind, width in columns:
        if kind not in FLAT_KINDS:
            raise ValueError(f"compile_flat: {kind!r} is not a flat kind")
        if kind == "binary" and width not in _OFFSET_FORMATS:
            raise ValueError(f"compile_flat: offsets are 4 or 8 bytes wide, not {width}")
        if kind == "fixed" and width < 0:
            raise ValueError(f"compile_flat: a fixed width cannot be negative, not {width}")
    arrays = [i for i, (kind, _) in enumerate(columns) if kind != "null"]
    body: list[str] = []
    if arrays:
        names = ", ".join(f"c{i}" if i in arrays else "_" for i in range(len(columns)))
        body.append(f"{names}, = batch.columns")
        body.append(f"if {' or '.join(f'c{i}.offset' for i in arrays)}:")
        body.append("    return None")
    else:
        body.append(f"if batch.num_columns != {len(columns)}:")
        body.append("    return None")
    body += ["bitmap = (n + 7) >> 3", "bitmap_pad = -bitmap & 7", "bitmap_padded = bitmap + bitmap_pad"]
    for width in sorted({w for k, w in columns if k == "fixed" and w}):
        body.append(f"nb{width} = n * {width}")
    for width in sorted({w for k, w in columns if k == "binary"}):
        body += [f"offsets{width} = (n + 1) * {width}", f"offsets_pad{width} = -offsets{width} & 7"]
    body += ["body = []", "add = body.append", "spans = []", "pos = 0"]
    nodes: list[str] = []
    for i, (kind, width) in enumerate(columns):
        if kind == "null":
            nodes += ["n", "n"]
            continue
        nodes += ["n", f"z{i}"]
        body += [f"z{i} = c{i}.null_count", f"b{i} = c{i}.buffers()"]
        body += _validity(i)
        if kind == "fixed":
            body += _fixed(i, width)
        elif kind == "bool":
            body += _bool(i)
        else:
            body += _binary(i, width)
    args = ", ".join(["k0", "pos", "k1", "n", "k2", *nodes, "k3", "*spans", "k4"])
    body.append(f"return make(pack({args}), body, pos)")
    source = "\n".join(
        ["def encode(batch):", "    n = batch.num_rows", "    if not n:", "        return None"]
        + ["    " + line for line in body]
    )
    pack, chunks = template.plain_parts()
    namespace: dict[str, Any] = {
        "pack": pack,
        **{f"k{i}": chunk for i, chunk in enumerate(chunks)},
        "make": make,
        "pads": pads,
        "offset4": _OFFSET_FORMATS[4].unpack_from,
        "offset8": _OFFSET_FORMATS[8].unpack_from,
    }
    exec(compile(source, f"<dissoc flat encoder of {len(columns)} columns>", "exec"), namespace)
    encode: Callable[[Any], Any] = namespace["encode"]
    encode.__doc__ = f"The RecordBatch message of a batch of these columns:\n{source}"
    return encode
