"""Keys in arrival order, oldest first, without an ``OrderedDict``.

S3-FIFO's small queue only ever appends new keys, walks from the oldest and removes the keys
its walk chose, nearly always at or near the oldest. Compiled, an ``OrderedDict`` costs a
linked node per key, an index lookup per removal and a resize of its node table whenever
the dict underneath resizes. Here a log holds the keys in arrival order with a moving head,
a removed key's entry becomes a hole that walks skip, and a set answers membership. A
removal looks for the key from where the last one was found (removals in walk order find
theirs at once), the log is trimmed as its head advances and filtered when holes outnumber
keys.
"""

from __future__ import annotations

from typing import Final, final

from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = ["FifoQueue"]

_HOLE: Final = OffloadKey(b"")  # a removed key's entry: equal to no key (keys are longer)


@final
class FifoQueue:
    """Keys oldest first: :meth:`append` a new key, :meth:`remove` any, walk with
    :meth:`first`, :meth:`after` and :meth:`key_at`."""

    __slots__ = ("_cursor", "_head", "_keys", "_log")

    def __init__(self) -> None:
        self._keys: set[OffloadKey] = set()
        self._log: list[OffloadKey] = []  # from ``_head`` on: keys and holes, oldest first
        self._head = 0  # the oldest key's entry (or the log's end)
        self._cursor = 0  # where the next removal starts looking

    def append(self, key: OffloadKey) -> None:
        """Make ``key`` (not present) the newest."""
        keys, log = self._keys, self._log
        keys.add(key)
        log.append(key)
        head = self._head
        if len(log) - head > 2 * len(keys) + 64:
            self._compact()
        elif head > 64 and 2 * head > len(log):
            del log[:head]
            self._cursor = max(0, self._cursor - head)
            self._head = 0

    def remove(self, key: OffloadKey) -> None:
        """Remove ``key`` (present)."""
        self._keys.remove(key)
        log = self._log
        end = len(log)
        index = self._cursor
        while index < end and log[index] != key:
            index += 1
        if index == end:  # not in walk order: look from the oldest
            index = self._head
            while log[index] != key:
                index += 1
        log[index] = _HOLE
        self._cursor = index + 1
        head = self._head
        if index == head:
            while head < end and log[head] == _HOLE:
                head += 1
            self._head = head
            if self._cursor < head:
                self._cursor = head

    def pop(self, key: OffloadKey, default: None = None) -> None:
        """Remove ``key`` if present (the removal a queue policy applies to every container)."""
        if key in self._keys:
            self.remove(key)

    def first(self) -> int:
        """Where a walk oldest first starts: the oldest key's index (see :meth:`key_at`), or
        -1 when empty. The walk changes nothing; :meth:`after` gives the next index."""
        return self._head if self._keys else -1

    def after(self, index: int) -> int:
        """The index of the next key of the walk after ``index``, or -1 at its end."""
        log = self._log
        end = len(log)
        index += 1
        while index < end:
            if log[index] != _HOLE:
                return index
            index += 1
        return -1

    def key_at(self, index: int) -> OffloadKey:
        """The key at a walk's ``index``."""
        return self._log[index]

    def _compact(self) -> None:
        """The log less its holes, in the same order."""
        self._log = [key for key in self._log[self._head :] if key != _HOLE]
        self._head = 0
        self._cursor = 0

    def clear(self) -> None:
        self._keys.clear()
        self._log.clear()
        self._head = 0
        self._cursor = 0

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return f"FifoQueue({[key for key in self._log[self._head :] if key != _HOLE]!r})"
