"""A bounded memory of recently evicted keys (ghosts), oldest forgotten first.

Several policies decide where a stored key goes by whether it was evicted recently: a key
stored again soon after leaving is worth keeping longer than a new one. They keep only keys,
never blocks, and at most ``limit`` of them, so the memory cost is a fixed multiple of the
cache size.

It is a plain dict (insertion order is ghost order) plus a log of the remembered keys with a
moving head: the oldest ghost is found by skipping log entries whose key was recalled or
remembered again since. Compiled, that costs a fraction of an ``OrderedDict`` (no linked
node per key, no ``popitem(last=False)`` method call).
"""

from __future__ import annotations

from typing import final

from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = ["GhostList"]


@final
class GhostList:
    """Keys in eviction order; :meth:`remember` forgets the oldest beyond ``limit``."""

    __slots__ = ("_base", "_head", "_keys", "_log", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        # ghost -> its position in the log (absolute: ``_base`` + index in ``_log``).
        self._keys: dict[OffloadKey, int] = {}
        self._log: list[OffloadKey] = []
        self._head = 0
        self._base = 0

    def remember(self, key: OffloadKey) -> None:
        """Record an evicted key as the newest ghost (a key already remembered keeps its
        place, as in an ordered dict)."""
        keys = self._keys
        log = self._log
        position = self._base + len(log)
        if keys.setdefault(key, position) != position:
            return
        log.append(key)
        if len(keys) > self.limit:
            self._forget_oldest()
        elif len(log) > 2 * len(keys) + 64:
            self._compact()

    def _forget_oldest(self) -> None:
        keys, log = self._keys, self._log
        head, base = self._head, self._base
        while True:
            key = log[head]
            position = base + head
            head += 1
            if keys.get(key, -1) == position:
                del keys[key]
                break
        self._head = head
        if head > 64 and 2 * head > len(log):
            del log[:head]
            self._base = base + head
            self._head = 0

    def _compact(self) -> None:
        """Rebuild the log from the dict (many recalled entries): same order, no stale ones."""
        keys = self._keys
        log = list(keys)
        for index, key in enumerate(log):
            keys[key] = index
        self._log = log
        self._head = 0
        self._base = 0

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
        self._log.clear()
        self._head = 0
        self._base = 0

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)
