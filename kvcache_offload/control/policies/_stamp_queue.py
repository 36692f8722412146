"""Keys ordered by a growing stamp, oldest first, without an ``OrderedDict``.

The miniature caches keep their queues ordered by the time of each key's last move, and only
ever read or drop the oldest; LRU-2 walks its probation queue oldest first. Compiled, an
``OrderedDict`` costs a linked node per key and a method call per move; here a plain dict
holds each key's stamp and a log holds every (key, stamp) pushed, oldest first. A log entry
whose stamp is no longer its key's (the key moved on or left) is stale and skipped; the log
is trimmed as its head advances and filtered when stale entries outnumber live ones.
"""

from __future__ import annotations

from typing import final

from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = ["StampQueue", "live_log"]


@final
class StampQueue:
    """``stamps`` maps each key to its stamp; stamps must be unique and only grow."""

    __slots__ = ("_head", "_log_keys", "_log_stamps", "stamps")

    def __init__(self) -> None:
        self.stamps: dict[OffloadKey, int] = {}
        self._log_keys: list[OffloadKey] = []
        self._log_stamps: list[int] = []
        self._head = 0

    def push(self, key: OffloadKey, stamp: int) -> None:
        """Make ``key`` (present or not) the newest, with ``stamp``."""
        self.stamps[key] = stamp
        self._log_keys.append(key)
        self._log_stamps.append(stamp)
        if len(self._log_keys) - self._head > 2 * len(self.stamps) + 64:
            self._rebuild()

    def remove(self, key: OffloadKey) -> None:
        del self.stamps[key]

    def take(self, key: OffloadKey) -> int:
        """Remove ``key`` (present) and return its stamp."""
        stamps = self.stamps
        stamp = stamps[key]  # get and del: compiled, ``dict.pop`` is a generic method call
        del stamps[key]
        return stamp

    def pop(self, key: OffloadKey, default: None = None) -> None:
        """Drop ``key`` if present (the removal a queue policy applies to every container)."""
        self.stamps.pop(key, default)

    def oldest(self) -> OffloadKey | None:
        """The oldest key, or None when empty; :meth:`oldest_stamp` is then its stamp."""
        stamps = self.stamps
        if not stamps:
            return None
        keys, log_stamps = self._log_keys, self._log_stamps
        head = self._head
        while stamps.get(keys[head], -1) != log_stamps[head]:
            head += 1
        self._head = head
        return keys[head]

    def oldest_stamp(self) -> int:
        """The stamp of the key :meth:`oldest` returned last."""
        return self._log_stamps[self._head]

    def pop_oldest(self) -> OffloadKey:
        """Drop and return the oldest key (the queue must not be empty)."""
        key = self.oldest()
        if key is None:
            raise IndexError("pop_oldest on an empty StampQueue")
        self.drop_found()
        return key

    def drop_found(self) -> None:
        """Drop the key :meth:`oldest` returned last, the queue unchanged since (what
        :meth:`pop_oldest` does without looking for it again)."""
        head = self._head
        del self.stamps[self._log_keys[head]]
        head += 1
        if head > 64 and 2 * head > len(self._log_keys):
            del self._log_keys[:head]
            del self._log_stamps[:head]
            head = 0
        self._head = head

    def first(self) -> int:
        """Where a walk oldest first starts: the oldest key's index (see :meth:`key_at`), or
        -1 when empty. The walk changes no key; :meth:`after` gives the next index."""
        stamps = self.stamps
        if not stamps:
            return -1
        keys, log_stamps = self._log_keys, self._log_stamps
        head = self._head
        while stamps.get(keys[head], -1) != log_stamps[head]:
            head += 1
        if head > 64 and 2 * head > len(keys):
            del keys[:head]
            del log_stamps[:head]
            head = 0
        self._head = head
        return head

    def after(self, index: int) -> int:
        """The index of the next key of the walk after ``index``, or -1 at its end."""
        stamps = self.stamps
        keys, log_stamps = self._log_keys, self._log_stamps
        end = len(keys)
        index += 1
        while index < end:
            if stamps.get(keys[index], -1) == log_stamps[index]:
                return index
            index += 1
        return -1

    def key_at(self, index: int) -> OffloadKey:
        """The key at a walk's ``index``."""
        return self._log_keys[index]

    def _rebuild(self) -> None:
        """The log less its stale entries: stamps only grow, so it stays oldest first."""
        self._log_keys, self._log_stamps = live_log(
            self.stamps, self._log_keys, self._log_stamps, self._head
        )
        self._head = 0

    def clear(self) -> None:
        self.stamps.clear()
        self._log_keys.clear()
        self._log_stamps.clear()
        self._head = 0

    def __len__(self) -> int:
        return len(self.stamps)

    def __repr__(self) -> str:
        return f"StampQueue({sorted(self.stamps.items(), key=_stamp_of)!r})"


def live_log(
    stamps: dict[OffloadKey, int], log_keys: list[OffloadKey], log_stamps: list[int], head: int
) -> tuple[list[OffloadKey], list[int]]:
    """The entries of a (key, stamp) log from ``head`` on whose stamp is still the key's
    current one in ``stamps``, in log order: a log compacted without touching the dict."""
    live_keys: list[OffloadKey] = []
    live_stamps: list[int] = []
    for index in range(head, len(log_keys)):
        key = log_keys[index]
        stamp = log_stamps[index]
        if stamps.get(key, -1) == stamp:
            live_keys.append(key)
            live_stamps.append(stamp)
    return live_keys, live_stamps


def _stamp_of(item: tuple[OffloadKey, int]) -> int:
    return item[1]
