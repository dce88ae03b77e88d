"""Compression of stored payloads (snapshot heads, transcript fragments, large events).

A packed value is either the bytes as they were (JSON, which never starts with
``x``) or a zlib stream (which always does: 0x78 is the header of every
default-window stream). Values written before packing existed therefore stay
readable, and a value too small to gain from compression is stored as is.
"""

from __future__ import annotations

import zlib
from typing import Final

MIN_BYTES: Final = 128
"""Values shorter than this are stored as they are: zlib's header would eat the gain."""
LEVEL: Final = 6


def pack(data: bytes) -> bytes:
    """``data`` compressed if that makes it shorter, else unchanged."""
    if len(data) < MIN_BYTES:
        return data
    packed = zlib.compress(data, LEVEL)
    return packed if len(packed) < len(data) else data


def is_packed(value: bytes) -> bool:
    return len(value) >= 2 and value[0] == 0x78 and (value[0] * 256 + value[1]) % 31 == 0


def unpack(value: bytes, max_bytes: int) -> bytes:
    """The bytes ``pack`` was given; ValueError if they would exceed ``max_bytes`` or are corrupt."""
    if not is_packed(value):
        return value
    inflater = zlib.decompressobj()
    try:
        data = inflater.decompress(value, max_bytes + 1)
    except zlib.error as exc:
        raise ValueError(f"a compressed value is corrupt ({exc})") from exc
    if len(data) > max_bytes or inflater.unconsumed_tail:
        raise ValueError(f"a compressed value inflates past {max_bytes} bytes")
    if not inflater.eof:
        raise ValueError("a compressed value is truncated")
    return data
