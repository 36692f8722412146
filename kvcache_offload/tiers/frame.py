"""The checksummed frame a block travels in below the CPU tier.

A frame is a small header plus the block's bytes. The header names the key (so a file or value
that landed under the wrong name is caught), the payload length (a torn write is caught) and a
CRC-32 of the payload (flipped bits are caught)::

    magic "KVT1" | crc32 u32 | payload length u64 | key length u16 | key bytes     (little endian)

Tiers keep the header and the payload apart where they can (Redis hash fields) and together
where they cannot (one file), so the 2 MiB payload is never copied just to prepend 22 bytes.
"""

from __future__ import annotations

import struct
import zlib

from kvcache_offload.base import OffloadKey

__all__ = ["HEADER_PREFIX", "checksum", "decode_header", "encode_header", "verify"]

_MAGIC = b"KVT1"
_FIXED = struct.Struct("<4sIQH")
HEADER_PREFIX = _FIXED.size
"""Bytes of the header before the key."""


def checksum(payload: bytes | memoryview) -> int:
    """CRC-32 of the payload (zlib releases the GIL, so callers run it in a worker thread)."""
    return zlib.crc32(payload)


def encode_header(key: OffloadKey, payload: bytes | memoryview, crc: int | None = None) -> bytes:
    """The header for ``payload`` stored under ``key``."""
    if crc is None:
        crc = checksum(payload)
    return _FIXED.pack(_MAGIC, crc, len(payload), len(key)) + bytes(key)


def decode_header(header: bytes) -> tuple[int, int, bytes] | None:
    """``(crc, payload length, key)`` of a well-formed header, else None."""
    if len(header) < HEADER_PREFIX:
        return None
    magic, crc, length, key_len = _FIXED.unpack_from(header)
    if magic != _MAGIC or len(header) < HEADER_PREFIX + key_len:
        return None
    return crc, length, bytes(header[HEADER_PREFIX : HEADER_PREFIX + key_len])


def verify(key: OffloadKey, header: bytes | None, payload: bytes | memoryview | None) -> bool:
    """True when header and payload are a complete, uncorrupted frame of ``key``."""
    if header is None or payload is None:
        return False
    parsed = decode_header(header)
    if parsed is None:
        return False
    crc, length, stored_key = parsed
    return stored_key == bytes(key) and length == len(payload) and crc == checksum(payload)
