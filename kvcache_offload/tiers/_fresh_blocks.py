"""The blocks of a put batch that a byte-budgeted tier does not hold yet, and what they weigh.

A put may name blocks the tier already holds: those are only touched (their recency renewed),
never written again. A key named twice in one batch is written once, with its first payload.
The weight is the bytes the new blocks add to the tier's budget once framed
(:mod:`~kvcache_offload.tiers.frame`: header, key, payload), so that room is made before the
write starts.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.tiers import frame

__all__ = ["fresh_blocks"]


def fresh_blocks(
    items: Sequence[tuple[OffloadKey, bytes]],
    held: Container[OffloadKey],
    touch: Callable[[OffloadKey], object],
) -> tuple[dict[OffloadKey, bytes], int]:
    """The batch's blocks not in ``held`` (first payload of each key) and their framed bytes;
    ``touch`` is called for each block already held."""
    fresh: dict[OffloadKey, bytes] = {}
    for key, payload in items:
        if key in held:
            touch(key)
        else:
            fresh.setdefault(key, payload)
    incoming = sum(len(p) + frame.HEADER_PREFIX + len(k) for k, p in fresh.items())
    return fresh, incoming
