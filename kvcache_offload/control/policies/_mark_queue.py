"""Keys in arrival order whose membership and stamp live in their blocks' marks.

LRU-2's probation queue holds each stored block, with the time of its store, until the block
is used or evicted; eviction walks it oldest first. As a dict of stamps plus a log
(:class:`~._stamp_queue.StampQueue`) every push, take and walk step probes that dict. But the
policy's block table already maps each key to its :class:`BlockStatus`, whose ``mark`` the
policy owns: here a member's mark is its stamp (> 0, unique, growing), so a push, a take and
the liveness test of a log entry read or write the block in hand instead. A log entry is live
while its key is stored with that same mark; one whose key left, moved on (mark <= 0 or
another stamp) or was stored again (a new stamp) is skipped, and the log is trimmed as its
head advances and filtered when dead entries outnumber live ones.
"""

from __future__ import annotations

from typing import final

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies.base import BlockStatus

__all__ = ["MarkQueue"]


@final
class MarkQueue:
    """Keys oldest first over ``blocks`` (the policy's key -> block table, read only here):
    :meth:`push` a block with a stamp, :meth:`take` it back; walk with :meth:`first`,
    :meth:`after` and :meth:`key_at` (:attr:`block` is then its block). A block is a member
    while its mark is its stamp."""

    __slots__ = ("_blocks", "_head", "_keys", "_size", "_stamps", "block")

    def __init__(self, blocks: dict[OffloadKey, BlockStatus]) -> None:
        self._blocks = blocks
        # The block of the member :meth:`first` or :meth:`after` returned last (a placeholder
        # before): the walk reads it to test the entry, so its caller need not look it up.
        self.block = BlockStatus(-1)
        self._keys: list[OffloadKey] = []  # every push, oldest first, from ``_head`` on
        self._stamps: list[int] = []  # the stamp of each push
        self._head = 0
        self._size = 0

    def push(self, key: OffloadKey, block: BlockStatus, stamp: int) -> None:
        """Make ``key`` (stored as ``block``, not a member) the newest, with ``stamp`` (> 0,
        greater than every stamp pushed before)."""
        block.mark = stamp
        self._keys.append(key)
        self._stamps.append(stamp)
        self._size += 1
        if len(self._keys) - self._head > 2 * self._size + 64:
            self._compact()

    def take(self, block: BlockStatus) -> int:
        """Remove a member (its ``block``) and return its stamp; its mark becomes 0."""
        stamp = block.mark
        block.mark = 0
        self._size -= 1
        return stamp

    @staticmethod
    def holds(block: BlockStatus) -> bool:
        """Whether ``block`` (stored, and enqueued by the policy) is a member."""
        return block.mark > 0

    def _live(self, index: int) -> bool:
        block = self._blocks.get(self._keys[index])
        return block is not None and block.mark == self._stamps[index]

    def first(self) -> int:
        """Where a walk oldest first starts: the oldest member's index (see :meth:`key_at`),
        or -1 when empty. The walk changes no member; :meth:`after` gives the next index."""
        if not self._size:
            return -1
        blocks, keys, stamps = self._blocks, self._keys, self._stamps
        head = self._head
        while True:
            block = blocks.get(keys[head])
            if block is not None and block.mark == stamps[head]:
                break
            head += 1
        self.block = block
        if head > 64 and 2 * head > len(keys):
            del keys[:head]
            del stamps[:head]
            head = 0
        self._head = head
        return head

    def after(self, index: int) -> int:
        """The index of the next member of the walk after ``index``, or -1 at its end."""
        blocks, keys, stamps = self._blocks, self._keys, self._stamps
        end = len(keys)
        index += 1
        while index < end:
            block = blocks.get(keys[index])
            if block is not None and block.mark == stamps[index]:
                self.block = block
                return index
            index += 1
        return -1

    def key_at(self, index: int) -> OffloadKey:
        """The key at a walk's ``index``."""
        return self._keys[index]

    def _compact(self) -> None:
        """The log less its dead entries, in the same order."""
        keys: list[OffloadKey] = []
        stamps: list[int] = []
        for index in range(self._head, len(self._keys)):
            if self._live(index):
                keys.append(self._keys[index])
                stamps.append(self._stamps[index])
        self._keys = keys
        self._stamps = stamps
        self._head = 0

    def adopt_table(self, blocks: dict[OffloadKey, BlockStatus]) -> None:
        """Look members up in ``blocks`` (the same blocks in another dict) from now on."""
        self._blocks = blocks

    def clear(self) -> None:
        """Forget every member (the block table is being emptied too)."""
        self._keys.clear()
        self._stamps.clear()
        self._head = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __repr__(self) -> str:
        live = [
            (self._keys[index], self._stamps[index])
            for index in range(self._head, len(self._keys))
            if self._live(index)
        ]
        return f"MarkQueue({live!r})"
