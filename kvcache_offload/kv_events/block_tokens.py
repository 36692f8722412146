"""The token ids behind keys derived from ``token_ids``, kept until their store is published.

vLLM's ``BlockStored`` carries the tokens of the stored blocks and the hash of the block before
them; routers such as llm-d's KV indexer and Dynamo's KV router hash those tokens with their own
recipe, which is how they match blocks across engines whose block hashes differ. A key carries
neither, so whoever derives keys from token ids (the HTTP layer, an embedding application)
hands the tokens over with :meth:`BlockTokens.remember`; the publisher takes them back once
per published store. The memory is bounded: the oldest entries go first.

The publisher wants Python ints (vLLM's wire format is a list of them), and making 4M of them
holds the GIL for ~100-200 ms. :func:`token_blocks` makes them a slice at a time, so a caller
with a large numpy array runs it in a worker thread and the event loop takes the GIL between
slices; :meth:`BlockTokens.remember_blocks` then only files the blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = ["BlockTokenEntry", "BlockTokens", "token_blocks"]

SLICE_IDS = 65_536
"""Token ids turned into Python ints per step of :func:`token_blocks` (a few ms of GIL)."""


def token_blocks(
    token_ids: Sequence[int] | np.ndarray, block_size: int, count: int
) -> list[tuple[int, ...]]:
    """The first ``count`` full blocks of ``block_size`` ids, as tuples of Python ints.

    Made ``SLICE_IDS`` ids per C call, so that in a worker thread it gives the event loop the
    GIL between slices.
    """
    if block_size <= 0:
        return []
    flat = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    count = min(count, flat.size // block_size)
    blocks = []
    for i in range(count):
        block: list[int] = []
        for start in range(i * block_size, (i + 1) * block_size, SLICE_IDS):
            block += flat[start : min(start + SLICE_IDS, (i + 1) * block_size)].tolist()
        blocks.append(tuple(block))
    return blocks


@dataclass(frozen=True, slots=True)
class BlockTokenEntry:
    parent: OffloadKey | None
    """The key of the block before this one in its prefix (None for the first block)."""
    token_ids: tuple[int, ...]
    block_size: int


class BlockTokens:
    """Bounded key -> :class:`BlockTokenEntry` memory (oldest forgotten first)."""

    def __init__(self, capacity: int = 65_536) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[bytes, BlockTokenEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def remember(
        self,
        keys: Sequence[OffloadKey],
        token_ids: Sequence[int] | np.ndarray,
        block_size: int,
    ) -> None:
        """Keys ``keys[i]`` name tokens ``[i * block_size, (i + 1) * block_size)``, chained."""
        self.remember_blocks(keys, token_blocks(token_ids, block_size, len(keys)), block_size)

    def remember_blocks(
        self, keys: Sequence[OffloadKey], blocks: Sequence[tuple[int, ...]], block_size: int
    ) -> None:
        """Keys ``keys[i]`` name the tokens ``blocks[i]`` (from :func:`token_blocks`), chained."""
        entries = self._entries
        for i, block in enumerate(blocks[: len(keys)]):
            key = bytes(keys[i])
            entries[key] = BlockTokenEntry(keys[i - 1] if i else None, block, block_size)
            entries.move_to_end(key)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def take(self, key: OffloadKey) -> BlockTokenEntry | None:
        """The entry for ``key``, forgotten as it is returned (None when unknown)."""
        return self._entries.pop(bytes(key), None)

    def clear(self) -> None:
        self._entries.clear()
