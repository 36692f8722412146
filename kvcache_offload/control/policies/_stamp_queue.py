"""Keys ordered by a growing stamp, oldest first, without an ``OrderedDict``.

The miniature caches keep their queues ordered by the time of each key's last move, and only
ever read or drop the oldest. Compiled, an ``OrderedDict`` costs a linked node per key and a
method call per move; here a plain dict holds each key's stamp and a log holds every
(key, stamp) pushed, oldest first. A log entry whose stamp is no longer its key's (the key
moved on or left) is stale and skipped; the log is trimmed as its head advances and rebuilt
when stale entries outnumber live ones.
"""

from __future__ import annotations

from typing import final

from kvcache_offload.contracts.offload_key import OffloadKey

__all__ = ["StampQueue"]


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
        if len(self._log_keys) > 2 * len(self.stamps) + 64:
            self._rebuild()

    def remove(self, key: OffloadKey) -> None:
        del self.stamps[key]

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
        del self.stamps[key]
        head = self._head + 1
        if head > 64 and 2 * head > len(self._log_keys):
            del self._log_keys[:head]
            del self._log_stamps[:head]
            head = 0
        self._head = head
        return key

    def _rebuild(self) -> None:
        """The log from the live keys only, oldest first."""
        live = sorted(self.stamps.items(), key=_stamp_of)
        self._log_keys = [key for key, _ in live]
        self._log_stamps = [stamp for _, stamp in live]
        self._head = 0

    def clear(self) -> None:
        self.stamps.clear()
        self._log_keys.clear()
        self._log_stamps.clear()
        self._head = 0

    def __len__(self) -> int:
        return len(self.stamps)


def _stamp_of(item: tuple[OffloadKey, int]) -> int:
    return item[1]
