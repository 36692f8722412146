"""Keys in arrival order whose membership and stamp live in their blocks' marks.

LRU-2's probation queue holds each stored block, with the time of its store, until the block
is used or evicted; eviction walks it oldest first. As a dict of stamps plus a log
(:class:`~._stamp_queue.StampQueue`) every push, take and walk step probes that dict. But the
policy owns each block's ``mark``: here a member's mark is its stamp (> 0, unique, growing),
so a push, a take and the liveness test of a log entry read or write the block in hand
instead. The log keeps each push's key and block; a member's ``second_mark`` (unused by its
owner while the block is on probation) holds the token of its entry: the entry's position,
counted from the log's first push or last compaction. An entry is live while its block's
mark is > 0 and its second mark is that token. Only :meth:`push` sets a mark > 0, and no
token is handed out twice between two compactions (a compaction drops every dead entry and
renumbers the live ones), so an entry whose block was taken (used, evicted, or its store
failed) never becomes live again, even when the manager hands that block to another key:
the walk reads no block table. No list of stamps: compiled, each stamp in a list is an int
object allocated per push. Dead entries are skipped, the log is trimmed as its head advances
(past the members an eviction took, :meth:`taken_through`) and filtered when dead entries
outnumber live ones.
"""

from __future__ import annotations

from typing import final

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies.base import BlockStatus

__all__ = ["MarkQueue"]


@final
class MarkQueue:
    """Keys oldest first: :meth:`push` a block with a stamp, :meth:`take` it back; walk with
    :meth:`first`, :meth:`after` and :meth:`key_at` (:attr:`block` is then its block). A
    block is a member while its mark is its stamp; its owner sets marks > 0 only through
    :meth:`push`, and leaves a member's ``second_mark`` (its entry's token) alone."""

    __slots__ = ("_base", "_blocks", "_head", "_keys", "_size", "block")

    def __init__(self) -> None:
        # The block of the member :meth:`first` or :meth:`after` returned last (a placeholder
        # before): the walk reads it to test the entry, so its caller need not look it up.
        self.block = BlockStatus(-1)
        self._keys: list[OffloadKey] = []  # every push, oldest first, from ``_head`` on
        self._blocks: list[BlockStatus] = []  # the block of each push
        self._head = 0
        self._base = 0  # the token of index 0 (entries dropped from the front since renumbering)
        self._size = 0

    def push(self, key: OffloadKey, block: BlockStatus, stamp: int) -> None:
        """Make ``key`` (stored as ``block``, not a member) the newest, with ``stamp`` (> 0,
        greater than every stamp pushed before)."""
        keys = self._keys
        block.mark = stamp
        block.second_mark = self._base + len(keys)
        keys.append(key)
        self._blocks.append(block)
        size = self._size + 1
        self._size = size
        if len(keys) - self._head > 2 * size + 64:
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
        block = self._blocks[index]
        return block.mark > 0 and block.second_mark == self._base + index

    def first(self) -> int:
        """Where a walk oldest first starts: the oldest member's index (see :meth:`key_at`),
        or -1 when empty. The walk changes no member; :meth:`after` gives the next index."""
        if not self._size:
            return -1
        keys, blocks = self._keys, self._blocks
        head = self._head
        base = self._base
        while True:
            block = blocks[head]
            if block.mark > 0 and block.second_mark == base + head:
                break
            head += 1
        self.block = block
        if head > 64 and 2 * head > len(keys):
            del keys[:head]
            del blocks[:head]
            self._base = base + head
            head = 0
        self._head = head
        return head

    def after(self, index: int) -> int:
        """The index of the next member of the walk after ``index``, or -1 at its end."""
        blocks = self._blocks
        end = len(blocks)
        base = self._base
        index += 1
        while index < end:
            block = blocks[index]
            if block.mark > 0 and block.second_mark == base + index:
                self.block = block
                return index
            index += 1
        return -1

    def taken_through(self, index: int) -> None:
        """Every member of the walk up to ``index`` has been taken: the next walk starts
        after it, instead of skipping those entries again."""
        if index >= self._head:
            self._head = index + 1

    def key_at(self, index: int) -> OffloadKey:
        """The key at a walk's ``index``."""
        return self._keys[index]

    def _compact(self) -> None:
        """The log less its dead entries, in the same order, renumbered from 0."""
        keys: list[OffloadKey] = []
        blocks: list[BlockStatus] = []
        for index in range(self._head, len(self._keys)):
            if self._live(index):
                block = self._blocks[index]
                block.second_mark = len(keys)
                keys.append(self._keys[index])
                blocks.append(block)
        self._keys = keys
        self._blocks = blocks
        self._head = 0
        self._base = 0

    def clear(self) -> None:
        """Forget every member (the block table is being emptied too)."""
        self._keys.clear()
        self._blocks.clear()
        self._head = 0
        self._base = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __repr__(self) -> str:
        live = [
            (self._keys[index], self._blocks[index].mark)
            for index in range(self._head, len(self._keys))
            if self._live(index)
        ]
        return f"MarkQueue({live!r})"
