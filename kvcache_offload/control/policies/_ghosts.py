"""A bounded memory of recently evicted keys (ghosts), oldest forgotten first.

Several policies decide where a stored key goes by whether it was evicted recently: a key
stored again soon after leaving is worth keeping longer than a new one. They keep only keys,
never blocks, and at most ``limit`` of them, so the memory cost is a fixed multiple of the
cache size. Each ghost carries an int stamp; a policy may give its own (LRU-2 keeps a key's
last access there) or let the list number its remembers.

It is a plain dict (ghost -> stamp) plus a log of every (key, stamp) remembered, oldest
first, with a moving head: a log entry is live while its stamp is still its key's, so the
oldest ghost is the first live entry, and the log is trimmed as the head advances and
filtered when dead entries outnumber live ones (no dict write). Compiled, that costs a
fraction of an ``OrderedDict`` (no linked node per key, no ``popitem(last=False)`` method
call).
"""

from __future__ import annotations

from typing import final

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies._stamp_queue import live_log

__all__ = ["GhostList"]


@final
class GhostList:
    """Keys in eviction order; :meth:`remember` forgets the oldest beyond ``limit``."""

    __slots__ = ("_count", "_head", "_keys", "_log_keys", "_log_stamps", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._keys: dict[OffloadKey, int] = {}  # ghost -> its stamp
        self._log_keys: list[OffloadKey] = []
        self._log_stamps: list[int] = []
        self._head = 0
        self._count = 0  # the stamp of the next remember that brings none

    def remember(self, key: OffloadKey, stamp: int = -1) -> None:
        """Record an evicted key as the newest ghost (a key already remembered keeps its
        place and stamp, as in an ordered dict). ``stamp``, if given, must be >= 0 and differ
        from every stamp the key was remembered with before; else the list numbers it."""
        if stamp < 0:
            stamp = self._count
            self._count = stamp + 1
        keys = self._keys
        if keys.setdefault(key, stamp) != stamp:
            return  # already a ghost (its stamp differs from any new one)
        self._log_keys.append(key)
        self._log_stamps.append(stamp)
        if len(keys) > self.limit:
            self._forget_oldest()
        elif len(self._log_keys) - self._head > 2 * len(keys) + 64:
            self._compact()

    def _forget_oldest(self) -> None:
        keys, log_keys, log_stamps = self._keys, self._log_keys, self._log_stamps
        head = self._head
        while True:
            key = log_keys[head]
            stamp = log_stamps[head]
            head += 1
            if keys.get(key, -1) == stamp:
                del keys[key]
                break
        if head > 64 and 2 * head > len(log_keys):
            del log_keys[:head]
            del log_stamps[:head]
            head = 0
        self._head = head

    def _compact(self) -> None:
        """Drop the dead log entries (many recalled keys): same order, the dict untouched."""
        self._log_keys, self._log_stamps = live_log(
            self._keys, self._log_keys, self._log_stamps, self._head
        )
        self._head = 0

    def recall(self, key: OffloadKey) -> bool:
        """Forget ``key``; whether it was a ghost (its block is being stored again)."""
        keys = self._keys
        if key in keys:
            del keys[key]
            return True
        return False

    def recall_stamp(self, key: OffloadKey) -> int:
        """Forget ``key``; the stamp it was remembered with, or -1 if it was no ghost."""
        keys = self._keys
        stamp = keys.get(key, -1)  # not ``pop``: compiled, a generic method call
        if stamp >= 0:
            del keys[key]
        return stamp

    def pop(self, key: OffloadKey, default: None = None) -> None:
        """Forget ``key`` if present (the removal a queue policy applies to every container)."""
        self._keys.pop(key, default)

    def clear(self) -> None:
        self._keys.clear()
        self._log_keys.clear()
        self._log_stamps.clear()
        self._head = 0
        self._count = 0

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)
