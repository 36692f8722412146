"""Offload keys: a block hash plus its KV-cache group index, as one bytes object."""

from __future__ import annotations

from typing import NewType

from kvcache_offload.errors import InvalidKeyError

__all__ = [
    "OffloadKey",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
    "validate_offload_key",
]


OffloadKey = NewType("OffloadKey", bytes)
"""Block hash bytes followed by the KV-cache group index as 4 big-endian bytes.

Raw bytes (not tuples) keep hashing cheap and put no extra objects on the GC's plate.
"""

_GROUP_IDX_BYTES = 4

_MAX_GROUP_IDX = 2**32 - 1


_GROUP_SUFFIXES = tuple(i.to_bytes(_GROUP_IDX_BYTES, "big") for i in range(256))
"""The suffixes of the first 256 group indices (a model has a handful of groups)."""


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Join a block hash and its KV-cache group index into one key."""
    # A server builds a key per block of every request: the common call (bytes, a small
    # int) is one concatenation, without the checks' isinstance calls and int.to_bytes.
    if type(block_hash) is bytes and type(group_idx) is int and 0 <= group_idx < 256:
        return block_hash + _GROUP_SUFFIXES[group_idx]  # type: ignore[return-value]
    if not isinstance(block_hash, bytes | bytearray | memoryview):
        raise InvalidKeyError(f"block hash must be bytes, got {type(block_hash).__name__}")
    if not isinstance(group_idx, int) or not 0 <= group_idx <= _MAX_GROUP_IDX:
        raise InvalidKeyError(f"group index must be an int in [0, 2**32), got {group_idx!r}")
    return OffloadKey(bytes(block_hash) + group_idx.to_bytes(_GROUP_IDX_BYTES, "big"))


def validate_offload_key(key: object) -> OffloadKey:
    """Return ``key`` if it is a well-formed offload key, else raise :class:`InvalidKeyError`."""
    if not isinstance(key, bytes):
        raise InvalidKeyError(f"offload key must be bytes, got {type(key).__name__}")
    if len(key) <= _GROUP_IDX_BYTES:
        raise InvalidKeyError(
            f"offload key must hold a block hash plus a 4-byte group index "
            f"(> {_GROUP_IDX_BYTES} bytes), got {len(key)} bytes"
        )
    return OffloadKey(key)


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """The block-hash part of a key (all but the last 4 bytes)."""
    return bytes(validate_offload_key(key)[:-_GROUP_IDX_BYTES])


def get_offload_group_idx(key: OffloadKey) -> int:
    """The group-index part of a key (last 4 bytes, big-endian, unsigned)."""
    return int.from_bytes(validate_offload_key(key)[-_GROUP_IDX_BYTES:], "big")
