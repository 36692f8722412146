"""SIEVE (Zhang et al., NSDI'24): one FIFO, a visited bit per block and a moving hand.

A hit only sets a bit; the hand sweeps from old to new, clearing bits and evicting the
first unvisited idle block, and survivors keep their place. Cheap hits and quick removal
of blocks that are never read again, with no second queue to size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, final

from mypy_extensions import mypyc_attr

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies._prefix_batch import QueuePolicy
from kvcache_offload.control.policies.base import Blocks, BlockStatus, Keys, Protected

__all__ = ["SIEVECachePolicy"]

# A block's mark: its log entry's token (the entry's position plus one, 0: in no queue)
# shifted past the visited bit. Final: compiled, a plain module constant is a dict lookup.
_VISITED: Final = 1
_TOKEN_SHIFT: Final = 1
_CHOSEN: Final = -2
"""Mark of a block chosen as a victim by the walk in progress (a token no entry has)."""


@final
class _SieveLog:
    """The queue oldest first, as (key, block) entries from ``head`` on: an entry is live
    while its block's mark holds the entry's token (``base`` plus its index, plus one). A
    block that left leaves a dead entry, dropped when the head passes it or when dead
    entries outnumber live ones four to one (:meth:`compact`, which also moves the hand)."""

    __slots__ = ("base", "blocks", "hand", "head", "keys", "size")

    def __init__(self) -> None:
        self.keys: list[OffloadKey] = []
        self.blocks: list[BlockStatus] = []
        self.head = 0
        self.base = 0  # the token of index 0, less one (entries dropped since renumbering)
        self.hand = 0  # the index of the entry the hand is at (``len`` = past the newest)
        self.size = 0  # live entries

    def push(self, key: OffloadKey, block: BlockStatus) -> None:
        """Append ``block`` as the newest, visited bit clear."""
        keys = self.keys
        block.mark = (self.base + len(keys) + 1) << _TOKEN_SHIFT
        keys.append(key)
        self.blocks.append(block)
        self.size += 1
        if len(keys) - self.head > 4 * self.size + 64:
            self.compact()

    def compact(self) -> None:
        """The log less its dead entries, in the same order, renumbered; the hand stays on
        the same live entry (or past the newest)."""
        keys: list[OffloadKey] = []
        blocks: list[BlockStatus] = []
        hand = self.hand
        new_hand = -1
        base = self.base
        for index in range(self.head, len(self.keys)):
            if index == hand:
                new_hand = len(keys)
            block = self.blocks[index]
            mark = block.mark
            if (mark >> _TOKEN_SHIFT) == base + index + 1:
                block.mark = ((len(keys) + 1) << _TOKEN_SHIFT) | (mark & _VISITED)
                keys.append(self.keys[index])
                blocks.append(block)
        self.hand = new_hand if new_hand >= 0 else len(keys)
        self.keys, self.blocks = keys, blocks
        self.head = 0
        self.base = 0

    def clear(self) -> None:
        self.keys.clear()
        self.blocks.clear()
        self.head = self.base = self.hand = self.size = 0

    def __len__(self) -> int:
        return self.size


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled, still subclassable
class SIEVECachePolicy(QueuePolicy):
    """SIEVE over one log with the hand as an index into it.

    The entries from the hand to the newest are the ones the hand has yet to reach in this
    lap (new blocks join their end); those before it, the ones it passed, oldest first.
    When the hand passes the newest it wraps to the oldest. Pinned and protected blocks are
    passed over unchanged. An eviction changes nothing until it has all its victims (a
    store that cannot get them leaves the queue exactly as it was). The logs decide exactly as
    two ordered dicts planned and then applied would (``tests/unit/test_policies_more.py``
    keeps that model), at a fraction of the cost (``docs/policy-lab.md``, "Speed").
    """

    name = "sieve"
    queue_attributes = ()  # the log: its own ``remove`` and ``clear``

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._log = _SieveLog()

    def _learned_state(self) -> dict[str, object]:
        return {
            "queue": len(self._log),
            "visited": sum(1 for block in self._blocks.values() if block.mark & _VISITED),
        }

    def _enqueue(self, key: OffloadKey, block: BlockStatus) -> None:
        self._log.push(key, block)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self._flush_batch()
        blocks = self._blocks
        for key in reversed(keys):
            block = blocks.get(key)
            # A store just prepared is not an access.
            if block is not None and block.ref_cnt != -1:
                block.mark |= _VISITED

    def remove(self, key: OffloadKey) -> None:
        self._flush_batch()
        block = self._blocks.pop(key)
        block.mark = 0  # its entry goes dead
        self._log.size -= 1

    def clear(self) -> None:
        self._log.clear()
        super().clear()

    def _select_blocks(self, n: int, protected: Protected, keys: Keys, blocks: Blocks) -> bool:
        """The hand's walk until ``n`` victims. It may lap; a whole lap with neither a
        victim nor a bit cleared means the remaining blocks are all pinned or protected:
        then every bit it cleared is set again and nothing changes."""
        log = self._log
        log_keys, log_blocks = log.keys, log.blocks
        guarded = len(protected) > 0  # the manager passes none: skip the membership tests
        start = len(keys)
        start_blocks = len(blocks)
        cleared: list[BlockStatus] = []
        marks: list[int] = []  # each victim's mark before the walk, to put back on failure
        hand = log.hand
        base = log.base
        victims = 0
        idle_steps = 0
        limit = log.size
        while victims < n:
            if hand >= len(log_keys):
                hand = log.head  # wrap: the entries the hand passed become the ones ahead
                if idle_steps > limit or log.size == victims:
                    break
            index = hand
            hand += 1
            block = log_blocks[index]
            mark = block.mark
            if (mark >> _TOKEN_SHIFT) != base + index + 1:
                continue  # a dead entry (or a victim of this walk): not a step
            if idle_steps > limit:
                break
            if block.ref_cnt != 0 or (guarded and log_keys[index] in protected):
                idle_steps += 1
            elif mark & _VISITED:
                block.mark = mark & ~_VISITED
                cleared.append(block)
                idle_steps = 0
            else:
                keys.append(log_keys[index])
                blocks.append(block)
                marks.append(mark)
                block.mark = _CHOSEN
                victims += 1
                idle_steps = 0
        if victims < n:
            # Victims first: one may have had its bit cleared earlier in the walk.
            for i in range(len(marks)):
                blocks[start_blocks + i].mark = marks[i]
            for block in cleared:
                block.mark |= _VISITED
            del keys[start:]
            del blocks[start_blocks:]
            return False
        table = self._blocks
        for i in range(n):
            blocks[start_blocks + i].mark = 0
            del table[keys[start + i]]
        log.size -= n
        log.hand = hand
        # The head moves past the dead entries there (victims the hand took at the front).
        head = log.head
        while head < len(log_keys) and head < hand:
            if (log_blocks[head].mark >> _TOKEN_SHIFT) == base + head + 1:
                break
            head += 1
        if head > 64 and 2 * head > len(log_keys):
            del log_keys[:head]
            del log_blocks[:head]
            log.base = base + head
            log.hand = hand - head
            head = 0
        log.head = head
        return True
