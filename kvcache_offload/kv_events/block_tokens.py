"""The token ids behind keys derived from ``token_ids``, kept until their store is published.

vLLM's ``BlockStored`` carries the tokens of the stored blocks and the hash of the block before
them; routers such as llm-d's KV indexer and Dynamo's KV router hash those tokens with their own
recipe, which is how they match blocks across engines whose block hashes differ. A key carries
neither, so whoever derives keys from token ids (the HTTP layer, an embedding application)
hands the tokens over with :meth:`BlockTokens.remember`; the publisher takes them back once
per published store. The memory is bounded: the oldest entries go first.

Remembering runs on the event loop (the service calls it for every prepared store), so it
costs one array copy of the blocks' tokens, never a Python object per token: 4M ids as
Python ints took ~130-180 ms of the loop. The tokens stay a read-only int64 array until a
store is published.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = ["BlockTokenEntry", "BlockTokens"]


@dataclass(frozen=True, slots=True, eq=False)
class BlockTokenEntry:
    parent: OffloadKey | None
    """The key of the block before this one in its prefix (None for the first block)."""
    tokens: np.ndarray
    """The block's token ids: a read-only int64 array of ``block_size`` ids."""
    block_size: int

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The block's token ids as Python ints."""
        return tuple(self.tokens.tolist())


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
        tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        count = min(len(keys), tokens.size // block_size) if block_size > 0 else 0
        blocks = tokens[: count * block_size].reshape(count, block_size).copy()
        blocks.flags.writeable = False  # one copy, shared read-only by the entries' rows
        entries = self._entries
        for i in range(count):
            key = bytes(keys[i])
            entries[key] = BlockTokenEntry(keys[i - 1] if i else None, blocks[i], block_size)
            entries.move_to_end(key)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def take(self, key: OffloadKey) -> BlockTokenEntry | None:
        """The entry for ``key``, forgotten as it is returned (None when unknown)."""
        return self._entries.pop(bytes(key), None)

    def clear(self) -> None:
        self._entries.clear()
