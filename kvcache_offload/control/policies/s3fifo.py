"""S3-FIFO (Yang et al., SOSP'23) and a prefix-aware adaptive variant.

Most offloaded blocks are never read again (a conversation's last turn, unique documents).
S3-FIFO lets them leave quickly through a small probationary FIFO; blocks used while there,
or stored again soon after leaving it (ghost hit), go to the main queue, which evicts with
reinsertion while a small use counter lasts.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import ClassVar, Final, final

from mypy_extensions import mypyc_attr

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies._ghosts import GhostList
from kvcache_offload.control.policies._prefix_batch import QueuePolicy
from kvcache_offload.control.policies.base import Blocks, BlockStatus, Keys, Protected

__all__ = ["PrefixS3FIFOCachePolicy", "S3FIFOCachePolicy"]

_MAX_FREQ: Final = 3

# A block's mark: its use count (bits 0-1), its queue (bit 2: main) and the token of its
# live log entry (the entry's position plus one, from bit 3; 0: in no queue). Final:
# compiled, a plain module constant is a dict lookup per read.
_COUNT: Final = 3
_MAIN: Final = 4
_TOKEN_SHIFT: Final = 3


@final
class _QueueLog:
    """One queue oldest first, as (key, block) entries from ``head`` on. An entry is live
    while its block's mark names this queue and the entry's token (``base`` plus its index,
    plus one); a block that moved or left leaves a dead entry, skipped by walks, dropped
    when the head passes it or when dead entries outnumber live ones two to one."""

    __slots__ = ("base", "blocks", "head", "keys", "size", "where")

    def __init__(self, where: int) -> None:
        self.where = where  # 0 (small) or _MAIN
        self.keys: list[OffloadKey] = []
        self.blocks: list[BlockStatus] = []
        self.head = 0
        self.base = 0
        self.size = 0  # live entries

    def push(self, key: OffloadKey, block: BlockStatus, count: int) -> None:
        """Append ``block`` as the newest, with use count ``count`` (a block already in this
        queue moves: its old entry goes dead; the caller counts it once)."""
        keys = self.keys
        block.mark = ((self.base + len(keys) + 1) << _TOKEN_SHIFT) | self.where | count
        keys.append(key)
        self.blocks.append(block)

    def live(self, index: int, mark: int) -> bool:
        """Whether the entry at ``index``, whose block's mark is ``mark``, is live."""
        return (mark & _MAIN) == self.where and (mark >> _TOKEN_SHIFT) == self.base + index + 1

    def next_idle(self, index: int, protected: Collection[OffloadKey], guarded: bool) -> int:
        """The index of the first live, evictable entry from ``index`` on, or -1 (entries
        appended meanwhile included: the log is read as it is now)."""
        keys, blocks = self.keys, self.blocks
        where, token = self.where, self.base + index + 1
        while index < len(keys):
            block = blocks[index]
            mark = block.mark
            if (
                (mark & _MAIN) == where
                and (mark >> _TOKEN_SHIFT) == token
                and block.ref_cnt == 0
                and not (guarded and keys[index] in protected)
            ):
                return index
            index += 1
            token += 1
        return -1

    def tidy(self) -> None:
        """Move the head past the dead entries there; compact when dead entries outnumber
        live ones two to one. Never during a walk (it moves indices)."""
        keys, blocks = self.keys, self.blocks
        head, end = self.head, len(keys)
        while head < end and not self.live(head, blocks[head].mark):
            head += 1
        if end - head > 2 * self.size + 64:
            live_keys: list[OffloadKey] = []
            live_blocks: list[BlockStatus] = []
            for index in range(head, end):
                block = blocks[index]
                mark = block.mark
                if self.live(index, mark):
                    block.mark = ((len(live_keys) + 1) << _TOKEN_SHIFT) | (mark & (_MAIN | _COUNT))
                    live_keys.append(keys[index])
                    live_blocks.append(block)
            self.keys, self.blocks = live_keys, live_blocks
            self.base = 0
            head = 0
        elif head > 64 and 2 * head > end:
            del keys[:head]
            del blocks[:head]
            self.base += head
            head = 0
        self.head = head

    def clear(self) -> None:
        self.keys.clear()
        self.blocks.clear()
        self.head = self.base = self.size = 0

    def __len__(self) -> int:
        return self.size


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled, still subclassable
class S3FIFOCachePolicy(QueuePolicy):
    """S3-FIFO driven by the manager: ``touch`` is the access, a store is not.

    The small queue targets ``small_ratio`` of the capacity; a block leaving it moves to the
    main queue if it was used while there, else its key becomes a ghost (the ghost queue
    keeps at most as many keys as the main queue may hold). A store of a ghost key goes
    straight to the main queue.

    Both queues are logs (:class:`_QueueLog`) and each block's use count, queue and log
    token sit in its ``mark``. An eviction walks the logs and makes its moves in place
    (promotions and reinsertions append to the main log, which its walk then reaches, as a
    FIFO with reinsertion does); only when it has all its victims does it drop them from the
    table and remember their keys. A walk that cannot find enough puts every mark back and
    cuts the main log back to its length, so the queues are exactly as they were. The log
    decides exactly as an ordered-dict main queue with victims planned and then applied
    would (``tests/unit/test_policies_more.py`` keeps that model).
    """

    name = "s3fifo"
    queue_attributes = ("_ghost", "_main_ghost")  # the two logs: own ``remove``, ``clear``
    small_ratio: ClassVar[float] = 0.1
    adaptive: ClassVar[bool] = False
    """Move the small-queue target on ghost hits, as ARC moves its T1 target."""
    adapt_gain: ClassVar[float] = 1.0
    main_lru: ClassVar[bool] = False
    """Order the main queue by ``touch`` (exact LRU) instead of FIFO with reinsertion."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._small = _QueueLog(0)
        self._main = _QueueLog(_MAIN)
        self._small_target = 0.0
        # The tunables, read once: compiled, a class attribute costs a lookup on every read.
        self._adaptive = self.adaptive
        self._adapt_gain = self.adapt_gain
        self._main_lru = self.main_lru
        self._reset_learning()
        # The ghosts of the small queue: as many keys as the main queue may hold.
        ghost_limit = (
            cache_capacity if self.adaptive else max(1, cache_capacity - int(self._small_target))
        )
        self._ghost = GhostList(ghost_limit)
        self._main_ghost = GhostList(ghost_limit)

    def _reset_learning(self) -> None:
        self._small_target = float(max(1, round(self.cache_capacity * self.small_ratio)))

    def _learned_state(self) -> dict[str, object]:
        # "freq": the keys with a use count, which is every block (it is kept in the block).
        return {
            "small": len(self._small),
            "main": len(self._main),
            "freq": len(self._blocks),
            "small_target": self._small_target,
        }

    def _enqueue(self, key: OffloadKey, block: BlockStatus) -> None:
        ghost, main_ghost = self._ghost, self._main_ghost
        if key in ghost:
            if self._adaptive:
                step = self._adapt_gain * max(1.0, len(main_ghost) / len(ghost))
                self._small_target = min(self._small_target + step, float(self.cache_capacity))
            ghost.recall(key)
            log = self._main
        elif key in main_ghost:
            step = self._adapt_gain * max(1.0, len(ghost) / len(main_ghost))
            self._small_target = max(self._small_target - step, 1.0)
            main_ghost.recall(key)
            log = self._main
        else:
            log = self._small
        log.size += 1
        log.push(key, block, 0)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self._flush_batch()
        blocks = self._blocks
        main = self._main
        lru = self._main_lru
        # A list (the manager's argument) is walked by index: ``reversed`` of a sequence
        # costs a builtins lookup and call per touch and a generic iterator step per key.
        key_list = keys if isinstance(keys, list) else list(keys)
        for position in range(len(key_list) - 1, -1, -1):
            key = key_list[position]
            block = blocks.get(key)
            # A store just prepared is not an access.
            if block is None or block.ref_cnt == -1:
                continue
            mark = block.mark
            if lru and (mark & _MAIN):  # in the main queue, an LRU: to its newest end
                main.push(key, block, 0)
                continue
            if (mark & _COUNT) < _MAX_FREQ:
                block.mark = mark + 1
        if lru:
            main.tidy()

    def remove(self, key: OffloadKey) -> None:
        # A store failed: the key is live, so it sits in none of the ghost lists.
        self._flush_batch()
        block = self._blocks[key]
        del self._blocks[key]
        if block.mark & _MAIN:
            self._main.size -= 1
        else:
            self._small.size -= 1
        block.mark = 0

    def clear(self) -> None:
        self._small.clear()
        self._main.clear()
        super().clear()

    def _select_blocks(self, n: int, protected: Protected, keys: Keys, blocks: Blocks) -> bool:
        """The victims, in the order the walk takes them. Pinned and protected blocks keep
        their place; the walk over the main queue reaches the blocks it appends
        (promotions, reinsertions) after the ones it started with."""
        guarded = len(protected) > 0  # the manager passes none: skip the membership tests
        small, main = self._small, self._main
        small_keys, small_blocks = small.keys, small.blocks
        main_keys, main_blocks = main.keys, main.blocks
        main_len = len(main_keys)  # to cut the main log back to if the walk fails
        start = len(keys)
        start_blocks = len(blocks)
        changed: list[BlockStatus] = []  # every block whose mark the walk changed, ...
        old_marks: list[int] = []  # ... with its mark before (first change only matters)
        from_small: list[bool] = []
        si = small.head  # the small queue's walk: its next entry to look at
        mi = main.head
        small_len = small.size
        reinsert = not self._main_lru
        target = self._small_target
        victims = 0
        promoted = 0
        small_done = main_done = False
        ok = True
        while victims < n:
            if not small_done and (small_len >= target or main_done):
                chosen_index = small.next_idle(si, protected, guarded)
                si = chosen_index + 1 if chosen_index >= 0 else len(small_keys)
                if chosen_index >= 0:
                    small_len -= 1
                    key = small_keys[chosen_index]
                    block = small_blocks[chosen_index]
                    changed.append(block)
                    old_marks.append(block.mark)
                    if block.mark & _COUNT:
                        # Used while on probation: to the main queue (its walk reaches it).
                        main.push(key, block, 0)
                        promoted += 1
                        main_done = False
                    else:
                        keys.append(key)
                        blocks.append(block)
                        from_small.append(True)
                        block.mark = 0
                        victims += 1
                    continue
                small_done = True
            if main_done:
                ok = False
                break
            chosen_index = main.next_idle(mi, protected, guarded)
            mi = chosen_index + 1 if chosen_index >= 0 else len(main_keys)
            if chosen_index < 0:
                main_done = True
                if small_done:
                    ok = False
                    break
                continue
            key = main_keys[chosen_index]
            block = main_blocks[chosen_index]
            changed.append(block)
            old_marks.append(block.mark)
            count = block.mark & _COUNT
            if reinsert and count > 0:
                main.push(key, block, count - 1)  # reinserted with one use fewer
                continue
            keys.append(key)
            blocks.append(block)
            from_small.append(False)
            block.mark = 0
            victims += 1
        if not ok:
            # Back as it was: marks last changed first, so each ends at its first old mark.
            for i in range(len(changed) - 1, -1, -1):
                changed[i].mark = old_marks[i]
            del main_keys[main_len:]
            del main_blocks[main_len:]
            del keys[start:]
            del blocks[start_blocks:]
            return False
        table = self._blocks
        ghost = self._ghost
        main_ghost = self._main_ghost if self._adaptive else None
        taken_small = 0
        for i in range(n):
            key = keys[start + i]
            if from_small[i]:
                ghost.remember(key)
                taken_small += 1
            elif main_ghost is not None:
                main_ghost.remember(key)
            del table[key]
        small.size -= taken_small + promoted
        main.size += promoted - (n - taken_small)
        small.tidy()
        main.tidy()
        return True


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled, still subclassable
class PrefixS3FIFOCachePolicy(S3FIFOCachePolicy):
    """S3-FIFO tuned for prefix caches; the best shipped policy on the Mooncake traces.

    Three changes, each aimed at prefix lookups (which stop at the first miss): a store's
    keys enter tail first so a prefix loses its tail before its head; the main queue is an
    LRU ordered by ``touch`` (reverse key order keeps heads more recent than tails); and the
    small-queue target adapts, ARC-style, between ghost hits of the small and main queues,
    starting large so that it behaves like LRU until the ghosts show otherwise.
    """

    name = "s3fifo-prefix"
    prefix_order = True
    small_ratio = 0.9
    adaptive = True
    adapt_gain = 2.0
    main_lru = True
