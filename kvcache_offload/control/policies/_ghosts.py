"""A bounded memory of recently evicted keys (ghosts), oldest forgotten first.

Several policies decide where a stored key goes by whether it was evicted recently: a key
stored again soon after leaving is worth keeping longer than a new one. They keep only keys,
never blocks, and at most ``limit`` of them, so the memory cost is a fixed multiple of the
cache size.
"""

from __future__ import annotations

from collections import OrderedDict

from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = ["GhostList"]


class GhostList:
    """Keys in eviction order; :meth:`remember` forgets the oldest beyond ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._keys: OrderedDict[OffloadKey, None] = OrderedDict()

    def remember(self, key: OffloadKey) -> None:
        """Record an evicted key as the newest ghost."""
        keys = self._keys
        keys[key] = None
        if len(keys) > self.limit:
            keys.popitem(last=False)

    def recall(self, key: OffloadKey) -> bool:
        """Forget ``key``; whether it was a ghost (its block is being stored again)."""
        keys = self._keys
        if key in keys:
            del keys[key]
            return True
        return False

    def pop(self, key: OffloadKey, default: None = None) -> None:
        """Forget ``key`` if present (the removal a queue policy applies to every container)."""
        self._keys.pop(key, default)

    def clear(self) -> None:
        self._keys.clear()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)
