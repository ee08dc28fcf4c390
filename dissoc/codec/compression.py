"""Per-buffer body compression (method BUFFER): an int64 uncompressed length, then an LZ4 or zstd frame.

A length of -1 means the bytes that follow are stored uncompressed. Decompression is bounded by the length the
metadata justifies, so a small input can never make the decoder allocate without limit.
"""

from __future__ import annotations

import struct

import lz4.frame
import numpy as np
import numpy.typing as npt
import zstandard

from dissoc.errors import CodecError

__all__ = ["CODECS", "compress_buffer", "decompress_buffer"]

CODECS = {"lz4": 0, "lz4_frame": 0, "zstd": 1}
_I64 = struct.Struct("<q")
# Largest expansion of one frame: LZ4 cannot exceed ~255:1; zstd can, so its bound is a policy choice.
_MAX_RATIO = {0: 256, 1: 1024}


def codec_id(name: str | None) -> int | None:
    """The BodyCompression codec id for a user-facing name (None for no compression)."""
    if name is None:
        return None
    try:
        return CODECS[name.lower()]
    except KeyError:
        raise CodecError(f"compression must be None, 'lz4' or 'zstd', got {name!r}") from None


def decompress_buffer(codec: int, src: memoryview, limit: int) -> memoryview | npt.NDArray[np.uint8]:
    """Undo one compressed buffer; ``limit`` is the uncompressed size the metadata justifies."""
    n = len(src)
    if n == 0:
        return src
    if n < 8:
        raise CodecError(f"compressed buffer: expected an 8-byte length prefix, got {n} bytes")
    size = _I64.unpack_from(src, 0)[0]
    data = src[8:]
    if size == -1:
        return data
    if size < 0:
        raise CodecError(f"compressed buffer: uncompressed length must be >= -1, got {size}")
    # Writers may store more than the metadata strictly needs (unsliced buffers, slack), so the bound is the
    # larger of that and what the codec can physically expand these bytes to: allocation stays proportional
    # to the input either way.
    limit = max(limit, _MAX_RATIO[codec] * len(data) + 1024)
    if size > limit:
        raise CodecError(
            f"compressed buffer: uncompressed length {size} exceeds the {limit} bytes the metadata allows"
        )
    try:
        if codec == 0:
            dec = lz4.frame.LZ4FrameDecompressor()
            got = dec.decompress(data, max_length=size + 1)
        else:
            reader = zstandard.ZstdDecompressor().stream_reader(bytes(data))
            got = reader.read(size + 1)
    except (RuntimeError, zstandard.ZstdError, ValueError, OSError) as e:
        raise CodecError(f"compressed buffer: {('LZ4', 'ZSTD')[codec]} data is corrupt ({e})") from None
    if len(got) != size:
        raise CodecError(f"compressed buffer: expected {size} uncompressed bytes, got {len(got)}")
    return np.frombuffer(got, np.uint8)


def compress_buffer(codec: int, data: memoryview) -> bytes | None:
    """The stored form of ``data`` (length prefix + frame), or None when compressing does not pay."""
    n = len(data)
    if n == 0:
        return None
    if codec == 0:
        packed: bytes = lz4.frame.compress(data, store_size=False)
    else:
        packed = zstandard.ZstdCompressor(level=1).compress(data)
    if len(packed) + 8 >= n:
        return None
    return _I64.pack(n) + packed
