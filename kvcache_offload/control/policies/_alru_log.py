"""The adaptive LRU's queues: logs of blocks whose place lives in each block's mark.

A queue is a log (:class:`BlockLog`) whose entries hold the block itself, and a block's queue,
stamp, tail flag and the token of its live log entry live in its ``mark`` (:func:`mark_of`):
a use reads and writes the block in hand and appends to two lists, where ordered dicts of
stamps would cost a hash probe per queue, a boxed stamp and a ``move_to_end`` call, and a
list of stamps a boxed int per use.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Final, final

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies.base import BlockStatus

DEMOTED: Final = -(1 << 62)
"""Age stamp of a demoted block: older than anything, so it is the first to go."""

# Where a block is (the low two bits of its mark): no queue, probation, demoted (the front
# of probation), main.
NOWHERE: Final = 0
PROBATION: Final = 1
DEMOTED_TAIL: Final = 2
MAIN: Final = 3
TAIL: Final = 4
"""Mark bit of a store tail still on probation."""
PROBATION_GHOSTS: Final = 0
MAIN_GHOSTS: Final = 1
"""The two lists of the ghost pair: keys evicted from probation, from main."""
TOKEN_SHIFT: Final = 3
TOKEN_BITS: Final = 27
TOKEN_MASK: Final = (1 << TOKEN_BITS) - 1
STAMP_SHIFT: Final = TOKEN_SHIFT + TOKEN_BITS


def mark_of(stamp: int, where: int) -> int:
    """A block's mark less its token (set by :meth:`BlockLog.push`): its stamp (the time of
    its last enqueue or use), its queue and no tail flag. Layout: stamp, token (the position
    of its live log entry), tail flag, queue; native while the stamp is below 2^32
    (:meth:`AdaptiveLRUCachePolicy._rebase`)."""
    return (stamp << STAMP_SHIFT) | where


@final
class BlockLog:
    """One queue in order: (key, block) entries from ``head`` on, oldest first (the demoted
    stack: newest first, read from the end). An entry is live while its block's mark holds
    this queue and the entry's token, ``base`` plus its index; a block that moved on or left
    leaves a dead entry, skipped by walks and dropped when the head passes it or dead
    entries outnumber live ones four to one (:meth:`compact`, which renumbers the live ones).
    No stamp list: the stamp is in the mark too, so a push appends two references and boxes
    nothing."""

    __slots__ = ("base", "blocks", "head", "keys", "size", "token_limit", "where")

    def __init__(self, where: int, token_limit: int = TOKEN_MASK) -> None:
        self.where = where
        self.keys: list[OffloadKey] = []
        self.blocks: list[BlockStatus] = []
        self.head = 0
        self.base = 0  # the token of index 0 (entries dropped from the front since renumbering)
        self.size = 0  # live entries
        self.token_limit = token_limit

    def push(self, key: OffloadKey, block: BlockStatus, mark: int) -> None:
        """Append ``block``, marked ``mark`` (no token) plus its entry's token."""
        keys = self.keys
        token = self.base + len(keys)
        block.mark = mark | (token << TOKEN_SHIFT)
        keys.append(key)
        self.blocks.append(block)
        # Dead entries may outnumber live ones four to one before a compaction: at two to one
        # compactions took 134 M of the 1,833 M manager instructions at 2 % of the
        # conversation trace; at four, 75 M fewer in all, at eight no fewer again (longer
        # walks past dead entries).
        if len(keys) - self.head > 4 * self.size + 64 or token >= self.token_limit:
            self.compact()

    def live(self, index: int) -> bool:
        mark = self.blocks[index].mark
        return (mark & 3) == self.where and (
            (mark >> TOKEN_SHIFT) & TOKEN_MASK
        ) == self.base + index

    def compact(self) -> None:
        """The log less its dead entries, in the same order, renumbered from 0."""
        keys: list[OffloadKey] = []
        blocks: list[BlockStatus] = []
        for index in range(self.head, len(self.keys)):
            if self.live(index):
                block = self.blocks[index]
                mark = block.mark
                block.mark = (mark & ~(TOKEN_MASK << TOKEN_SHIFT)) | (len(keys) << TOKEN_SHIFT)
                keys.append(self.keys[index])
                blocks.append(block)
        self.keys, self.blocks = keys, blocks
        self.head = 0
        self.base = 0

    def skip_dead(self) -> None:
        """Move the head past the dead entries there (every push leaves one behind)."""
        blocks, where = self.blocks, self.where
        head, end = self.head, len(blocks)
        token = self.base + head
        while head < end:
            mark = blocks[head].mark
            if (mark & 3) == where and ((mark >> TOKEN_SHIFT) & TOKEN_MASK) == token:
                break
            head += 1
            token += 1
        self.trim(head)

    def pop_dead(self) -> None:
        """Drop the dead entries at the end (the demoted stack's top): before a push, or
        the victims just taken from the top would be buried under it and walked past by
        every later eviction."""
        keys, blocks = self.keys, self.blocks
        while keys and not self.live(len(keys) - 1):
            keys.pop()
            blocks.pop()

    def trim(self, head: int) -> None:
        """Move the head to ``head`` (every entry before it dead)."""
        if head > 64 and 2 * head > len(self.keys):
            del self.keys[:head]
            del self.blocks[:head]
            self.base += head
            head = 0
        self.head = head

    def rebase(self, offset: int) -> None:
        """Subtract ``offset`` from the stamp of every live entry's block."""
        shifted = offset << STAMP_SHIFT
        for index in range(self.head, len(self.keys)):
            if self.live(index):
                block = self.blocks[index]
                block.mark = block.mark - shifted

    def clear(self) -> None:
        self.keys.clear()
        self.blocks.clear()
        self.head = 0
        self.base = 0
        self.size = 0

    def __len__(self) -> int:
        return self.size


def next_idle(
    log: BlockLog, index: int, step: int, protected: Collection[OffloadKey], guarded: bool
) -> int:
    """The index of the first live, evictable entry of ``log`` from ``index`` on, walking
    by ``step`` (1: oldest first; -1: the demoted stack, newest first), or -1."""
    blocks, keys, where = log.blocks, log.keys, log.where
    end = len(keys)
    base = log.base
    while 0 <= index < end:
        block = blocks[index]
        mark = block.mark
        if (
            (mark & 3) == where
            and ((mark >> TOKEN_SHIFT) & TOKEN_MASK) == base + index
            and block.ref_cnt == 0
            and not (guarded and keys[index] in protected)
        ):
            return index
        index += step
    return -1
