"""Chained block keys derived from token ids, reproducible by any client in any language.

A client that only has token ids (no vLLM block hashes) can let the server derive the keys, or
compute them itself with this recipe and get byte-identical keys:

* Only full blocks are keyed: ``n = len(token_ids) // block_size`` blocks; trailing tokens
  that do not fill a block are ignored (they cannot be offloaded either).
* ``root = sha256(b"kvcache-offload/v1" + salt_utf8)`` where ``salt`` is an optional string
  (e.g. a tenant or LoRA name) that keeps otherwise identical prefixes apart; empty when absent.
* ``hash[i] = sha256(parent || tokens_i)``, with ``parent = root`` for block 0 and
  ``hash[i - 1]`` afterwards, and ``tokens_i`` the ``block_size`` token ids of block ``i`` each
  packed as a little-endian signed 32-bit integer.
* ``key[i] = hash[i] || group_idx`` as 4 big-endian bytes (see :func:`make_offload_key`), so a
  key is 36 bytes, 72 hex characters.

Chaining makes a block's key name its whole prefix, which is what a prefix cache needs: two
requests share ``key[i]`` exactly when their first ``(i + 1) * block_size`` tokens agree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvcache_offload.contracts.offload_key import (
    OffloadKey,
    make_offload_key,
)
from kvcache_offload.errors import InvalidKeyError

__all__ = ["KEY_HASH_DOMAIN", "chained_block_hashes", "token_block_keys"]

KEY_HASH_DOMAIN = b"kvcache-offload/v1"
"""Prefix of the root hash input; a new recipe would change it."""

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _packed_tokens(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a little-endian int32 array, refusing values that do not fit."""
    try:
        wide = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidKeyError(f"token ids must be integers, got {exc}") from None
    if wide.size and (wide.min() < _INT32_MIN or wide.max() > _INT32_MAX):
        raise InvalidKeyError("token ids must fit in a signed 32-bit integer")
    return wide.astype("<i4")


def chained_block_hashes(
    token_ids: Sequence[int] | np.ndarray, block_size: int, salt: str | None = None
) -> list[bytes]:
    """The 32-byte chained sha256 hash of every full block of ``token_ids``."""
    if not isinstance(block_size, int) or block_size <= 0:
        raise InvalidKeyError(f"block_size must be a positive int, got {block_size!r}")
    packed = _packed_tokens(token_ids)
    num_blocks = packed.size // block_size
    parent = hashlib.sha256(KEY_HASH_DOMAIN + (salt or "").encode()).digest()
    raw = packed[: num_blocks * block_size].tobytes()
    stride = block_size * 4
    hashes: list[bytes] = []
    for i in range(num_blocks):
        parent = hashlib.sha256(parent + raw[i * stride : (i + 1) * stride]).digest()
        hashes.append(parent)
    return hashes


def token_block_keys(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    group_idx: int = 0,
    salt: str | None = None,
) -> list[OffloadKey]:
    """Offload keys for the full blocks of ``token_ids`` in KV-cache group ``group_idx``."""
    return [
        make_offload_key(h, group_idx) for h in chained_block_hashes(token_ids, block_size, salt)
    ]
