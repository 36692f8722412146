"""A bounded memory of recently evicted keys (ghosts), oldest forgotten first.

Several policies decide where a stored key goes by whether it was evicted recently: a key
stored again soon after leaving is worth keeping longer than a new one. They keep only keys,
never blocks, and at most ``limit`` of them, so the memory cost is a fixed multiple of the
cache size. Each ghost carries an int stamp that the list only stores (LRU-2 keeps a key's
last access there); the other policies leave it at 0.

It is a plain dict (ghost -> stamp) plus a log of every key remembered, oldest first, with a
moving head. A recalled key leaves the dict at once and its log entry goes dead: a count of
the dead entries per key says which ones to skip (a key's dead entries all come before its
live one), so the oldest ghost is the first entry not counted dead. The log is trimmed as
the head advances and filtered when dead entries outnumber live ones. Compiled, that costs a
fraction of an ``OrderedDict`` (no linked node per key, no ``popitem(last=False)`` method
call), and a remember allocates nothing but the log slot (no int object per entry).
"""

from __future__ import annotations

from typing import final

from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = ["GhostList"]


@final
class GhostList:
    """Keys in eviction order; :meth:`remember` forgets the oldest beyond ``limit``."""

    __slots__ = ("_dead", "_head", "_keys", "_log", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._keys: dict[OffloadKey, int] = {}  # ghost -> its stamp
        self._log: list[OffloadKey] = []  # every remember, oldest first, from ``_head`` on
        self._head = 0
        self._dead: dict[OffloadKey, int] = {}  # key -> its dead log entries from the head on

    def remember(self, key: OffloadKey, stamp: int = 0) -> None:
        """Record an evicted key as the newest ghost, with ``stamp`` (a key already
        remembered keeps its place and stamp, as in an ordered dict)."""
        keys = self._keys
        size = len(keys)
        keys.setdefault(key, stamp)
        if len(keys) == size:
            return  # already a ghost
        log = self._log
        log.append(key)
        if size >= self.limit:
            self._forget_oldest()
        elif self._dead and len(log) - self._head > 2 * size + 64:
            self._compact()

    def _forget_oldest(self) -> None:
        keys, log, dead = self._keys, self._log, self._dead
        head = self._head
        while True:
            key = log[head]
            head += 1
            if dead and _passed_dead(dead, key):  # a recalled key's entry
                continue
            del keys[key]
            break
        if head > 64 and 2 * head > len(log):
            del log[:head]
            head = 0
        self._head = head

    def _compact(self) -> None:
        """Drop the dead log entries (many recalled keys): same order, the dict untouched."""
        dead = self._dead
        live: list[OffloadKey] = []
        log = self._log
        for index in range(self._head, len(log)):
            key = log[index]
            if not _passed_dead(dead, key):
                live.append(key)
        self._log = live
        self._head = 0

    def _bury(self, key: OffloadKey) -> None:
        """Count ``key``'s log entry dead (it just left the dict)."""
        dead = self._dead
        dead[key] = dead.get(key, 0) + 1

    def recall(self, key: OffloadKey) -> bool:
        """Forget ``key``; whether it was a ghost (its block is being stored again)."""
        keys = self._keys
        if key in keys:
            del keys[key]
            self._bury(key)
            return True
        return False

    def recall_stamp(self, key: OffloadKey) -> int:
        """Forget ``key``; the stamp it was remembered with, or -1 if it was no ghost."""
        keys = self._keys
        stamp = keys.get(key, -1)  # not ``pop``: compiled, a generic method call
        if stamp >= 0:
            del keys[key]
            self._bury(key)
        return stamp

    def pop(self, key: OffloadKey, default: None = None) -> None:
        """Forget ``key`` if present (the removal a queue policy applies to every container)."""
        keys = self._keys
        if key in keys:
            del keys[key]
            self._bury(key)

    def clear(self) -> None:
        self._keys.clear()
        self._log.clear()
        self._head = 0
        self._dead.clear()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)


def _passed_dead(dead: dict[OffloadKey, int], key: OffloadKey) -> bool:
    """Whether the log entry of ``key`` just passed is one counted dead (then one fewer is)."""
    count = dead.get(key, 0)
    if not count:
        return False
    if count == 1:
        del dead[key]
    else:
        dead[key] = count - 1
    return True
