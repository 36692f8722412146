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

from typing import Any, final

from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = ["GhostList", "GhostPair", "StampedGhostList"]


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
        # The same walk as GhostPair._forget_oldest, kept inline in both: as a shared
        # function (and a trim beside it) it cost LRU-2 1 % of its instructions (cachegrind).
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
        self._log = _live_entries(self._log, self._head, self._dead)
        self._head = 0

    def recall(self, key: OffloadKey) -> bool:
        """Forget ``key``; whether it was a ghost (its block is being stored again)."""
        keys = self._keys
        if key in keys:
            del keys[key]
            _bury(self._dead, key)
            return True
        return False

    def recall_stamp(self, key: OffloadKey) -> int:
        """Forget ``key``; the stamp it was remembered with, or -1 if it was no ghost."""
        keys = self._keys
        stamp = keys.get(key, -1)  # not ``pop``: compiled, a generic method call
        if stamp >= 0:
            del keys[key]
            _bury(self._dead, key)
        return stamp

    def pop(self, key: OffloadKey, default: None = None) -> None:
        """Forget ``key`` if present (the removal a queue policy applies to every container)."""
        keys = self._keys
        if key in keys:
            del keys[key]
            _bury(self._dead, key)

    def clear(self) -> None:
        self._keys.clear()
        self._log.clear()
        self._head = 0
        self._dead.clear()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)


@final
class StampedGhostList:
    """A :class:`GhostList` whose owner never remembers a key twice with the same stamp (LRU-2:
    a ghost's stamp is its last access, and every access has a time of its own).

    Then a log entry is live exactly while the dict holds the entry's own stamp object for its
    key, so a recall leaves nothing to count: no dead-entry dict to fill on a recall and to
    drain on the walk (compiled, a probe of each per recalled key). The log keeps each
    remember's key and stamp object (boxed once, for the dict and the log alike).
    """

    __slots__ = ("_head", "_keys", "_log", "_stamps", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._keys: dict[OffloadKey, Any] = {}  # ghost -> its stamp (an int object)
        self._log: list[OffloadKey] = []  # every remember, oldest first, from ``_head`` on
        self._stamps: list[Any] = []  # the stamp object of each remember
        self._head = 0

    def remember(self, key: OffloadKey, stamp: int) -> None:
        """Record an evicted key as the newest ghost, with ``stamp`` (>= 0; a key already
        remembered keeps its place and stamp, as in an ordered dict)."""
        keys = self._keys
        size = len(keys)
        boxed: Any = stamp  # one int object for the dict and the log
        keys.setdefault(key, boxed)
        if len(keys) == size:
            return  # already a ghost
        log = self._log
        log.append(key)
        self._stamps.append(boxed)
        if size >= self.limit:
            self._forget_oldest()
        elif len(log) - self._head > 2 * size + 64:
            self._compact()

    def _forget_oldest(self) -> None:
        keys, log, stamps = self._keys, self._log, self._stamps
        head = self._head
        while True:
            key = log[head]
            stamp = stamps[head]
            head += 1
            if keys.get(key) is stamp:  # else a recalled key's entry
                del keys[key]
                break
        if head > 64 and 2 * head > len(log):
            del log[:head]
            del stamps[:head]
            head = 0
        self._head = head

    def _compact(self) -> None:
        """Drop the dead log entries (many recalled keys): same order, the dict untouched."""
        keys, log, stamps = self._keys, self._log, self._stamps
        live: list[OffloadKey] = []
        live_stamps: list[Any] = []
        for index in range(self._head, len(log)):
            key = log[index]
            stamp = stamps[index]
            if keys.get(key) is stamp:
                live.append(key)
                live_stamps.append(stamp)
        self._log = live
        self._stamps = live_stamps
        self._head = 0

    def recall_stamp(self, key: OffloadKey) -> int:
        """Forget ``key``; the stamp it was remembered with, or -1 if it was no ghost."""
        keys = self._keys
        stamp: int = keys.get(key, -1)  # not ``pop``: compiled, a generic method call
        if stamp >= 0:
            del keys[key]
        return stamp

    def pop(self, key: OffloadKey, default: None = None) -> None:
        """Forget ``key`` if present (the removal a queue policy applies to every container)."""
        keys = self._keys
        if key in keys:
            del keys[key]

    def clear(self) -> None:
        self._keys.clear()
        self._log.clear()
        self._stamps.clear()
        self._head = 0

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)


@final
class _PairLog:
    """One list of a :class:`GhostPair`: its log from ``head`` on, its dead entries per key
    and its number of ghosts."""

    __slots__ = ("dead", "head", "keys", "size")

    def __init__(self) -> None:
        self.keys: list[OffloadKey] = []
        self.head = 0
        self.dead: dict[OffloadKey, int] = {}
        self.size = 0

    def compact(self) -> None:
        self.keys = _live_entries(self.keys, self.head, self.dead)
        self.head = 0

    def clear(self) -> None:
        self.keys.clear()
        self.head = 0
        self.dead.clear()
        self.size = 0


@final
class GhostPair:
    """Two ghost lists (0 and 1) of at most ``limit`` keys each, in one dict.

    Each list forgets its own oldest ghost, exactly as a :class:`GhostList` of its own. A key
    is a ghost of at most one of them: its owner remembers only a key that is a ghost of
    neither (an evicted key, recalled when it was stored). So one dict (ghost -> its list)
    answers :meth:`recall` with one probe where two lists take two for each key that is in
    neither, which is most stored keys (the adaptive LRU's probation and main ghosts).
    """

    __slots__ = ("_first", "_lists", "_second", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lists: dict[OffloadKey, int] = {}  # ghost -> its list
        self._first = _PairLog()
        self._second = _PairLog()

    def _log(self, which: int) -> _PairLog:
        return self._second if which else self._first

    def remember(self, key: OffloadKey, which: int) -> None:
        """Record an evicted key (a ghost of neither list) as list ``which``'s newest."""
        lists = self._lists
        size = len(lists)
        lists.setdefault(key, which)
        if len(lists) == size:
            return  # already a ghost (of this list, given the contract): it keeps its place
        log = self._second if which else self._first
        keys = log.keys
        keys.append(key)
        count = log.size
        log.size = count + 1
        if count >= self.limit:
            self._forget_oldest(log)
        elif log.dead and len(keys) - log.head > 2 * count + 64:
            log.compact()

    def _forget_oldest(self, log: _PairLog) -> None:
        lists, keys, dead = self._lists, log.keys, log.dead
        head = log.head
        while True:
            key = keys[head]
            head += 1
            if dead and _passed_dead(dead, key):  # a recalled key's entry
                continue
            del lists[key]
            break
        log.size -= 1
        if head > 64 and 2 * head > len(keys):
            del keys[:head]
            head = 0
        log.head = head

    def recall(self, key: OffloadKey) -> int:
        """Forget ``key``; the list it was a ghost of, or -1 (its block is being stored)."""
        lists = self._lists
        which = lists.get(key, -1)  # not ``pop``: compiled, a generic method call
        if which >= 0:
            del lists[key]
            log = self._second if which else self._first
            log.size -= 1
            _bury(log.dead, key)
        return which

    def size(self, which: int) -> int:
        """The number of ghosts of list ``which``."""
        return self._log(which).size

    def clear(self) -> None:
        self._lists.clear()
        self._first.clear()
        self._second.clear()

    def __contains__(self, key: object) -> bool:
        return key in self._lists

    def __len__(self) -> int:
        return len(self._lists)


def _live_entries(
    log: list[OffloadKey], head: int, dead: dict[OffloadKey, int]
) -> list[OffloadKey]:
    """The entries of ``log`` from ``head`` on less the dead ones, in the same order."""
    live: list[OffloadKey] = []
    for index in range(head, len(log)):
        key = log[index]
        if not _passed_dead(dead, key):
            live.append(key)
    return live


def _bury(dead: dict[OffloadKey, int], key: OffloadKey) -> None:
    """Count one more dead log entry of ``key`` (it just left its ghost dict)."""
    dead[key] = dead.get(key, 0) + 1


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
