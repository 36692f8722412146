"""S3-FIFO (Yang et al., SOSP'23) and a prefix-aware adaptive variant.

Most offloaded blocks are never read again (a conversation's last turn, unique documents).
S3-FIFO lets them leave quickly through a small probationary FIFO; blocks used while there,
or stored again soon after leaving it (ghost hit), go to the main queue, which evicts with
reinsertion while a small use counter lasts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import ClassVar, Final

from mypy_extensions import mypyc_attr

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies._fifo_queue import FifoQueue
from kvcache_offload.control.policies._ghosts import GhostList
from kvcache_offload.control.policies._prefix_batch import PlannedQueuePolicy
from kvcache_offload.control.policies._virtual_fifo import VirtualFifo
from kvcache_offload.control.policies.base import BlockStatus

__all__ = ["PrefixS3FIFOCachePolicy", "S3FIFOCachePolicy"]

_MAX_FREQ: Final = 3


# The moves of a plan. Final: compiled, a plain module constant is a dict lookup per read.
_SMALL_TO_MAIN: Final = 0
_SMALL_EVICT: Final = 1
_MAIN_REINSERT: Final = 2
_MAIN_EVICT: Final = 3


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled, still subclassable
class S3FIFOCachePolicy(PlannedQueuePolicy):
    """S3-FIFO driven by the manager: ``touch`` is the access, a store is not.

    The small queue targets ``small_ratio`` of the capacity; a block leaving it moves to the
    main queue if it was used while there, else its key becomes a ghost (the ghost queue
    keeps at most as many keys as the main queue may hold). A store of a ghost key goes
    straight to the main queue.
    """

    name = "s3fifo"
    queue_attributes = ("_small", "_main", "_ghost", "_main_ghost")
    small_ratio: ClassVar[float] = 0.1
    adaptive: ClassVar[bool] = False
    """Move the small-queue target on ghost hits, as ARC moves its T1 target."""
    adapt_gain: ClassVar[float] = 1.0
    main_lru: ClassVar[bool] = False
    """Order the main queue by ``touch`` (exact LRU) instead of FIFO with reinsertion."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._small = FifoQueue()
        self._main: OrderedDict[OffloadKey, None] = OrderedDict()
        # Each block's use count (0 to _MAX_FREQ) is its ``mark``: no per-key dict to probe.
        self._small_target = 0.0
        # The tunables, read once: compiled, a class attribute costs a lookup on every read.
        self._adaptive = self.adaptive
        self._adapt_gain = self.adapt_gain
        self._main_lru = self.main_lru
        # The mark of a block entering the main queue: its use count (0), or, when the main
        # queue is an LRU (which reads no count), -1, so ``touch`` tells a main-queue block by
        # its mark instead of looking its key up in the queue.
        self._main_mark = -1 if self.main_lru else 0
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
        return {"freq": len(self._blocks), "small_target": self._small_target}

    def _enqueue(self, key: OffloadKey, block: BlockStatus) -> None:
        block.mark = 0
        ghost, main_ghost = self._ghost, self._main_ghost
        if key in ghost:
            if self._adaptive:
                step = self._adapt_gain * max(1.0, len(main_ghost) / len(ghost))
                self._small_target = min(self._small_target + step, float(self.cache_capacity))
            ghost.recall(key)
            block.mark = self._main_mark
            self._main[key] = None
        elif key in main_ghost:
            step = self._adapt_gain * max(1.0, len(ghost) / len(main_ghost))
            self._small_target = max(self._small_target - step, 1.0)
            main_ghost.recall(key)
            block.mark = self._main_mark
            self._main[key] = None
        else:
            self._small.append(key)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self._flush_batch()
        blocks = self._blocks
        move = self._main.move_to_end  # bound once: compiled, a call by name looks it up each time
        # A list (the manager's argument) is walked by index: ``reversed`` of a sequence
        # costs a builtins lookup and call per touch and a generic iterator step per key.
        key_list = keys if isinstance(keys, list) else list(keys)
        for position in range(len(key_list) - 1, -1, -1):
            key = key_list[position]
            block = blocks.get(key)
            # A store just prepared is not an access.
            if block is None or block.ref_cnt == -1:
                continue
            count = block.mark
            if count < 0:  # in the main queue, an LRU
                move(key)
                continue
            if count < _MAX_FREQ:
                block.mark = count + 1

    def _plan(
        self,
        n: int,
        protected: Collection[OffloadKey],
        moves: list[int],
        keys: list[OffloadKey],
        found: list[BlockStatus],
    ) -> bool:
        """Choose the victims without changing anything: the steps to apply, or False.

        Skipped (pinned or protected) blocks keep their place; the walk over the main queue
        sees the keys it re-appends (promotions, reinsertions) after the original ones.
        """
        blocks = self._blocks
        guarded = len(protected) > 0  # the manager passes none: skip the membership tests
        small = self._small
        index = small.first()  # the small queue's walk: its next key to look at
        main = VirtualFifo(self._main)
        new_freq: dict[OffloadKey, int] = {}
        small_len = len(small)
        reinsert = not self._main_lru
        victims = 0
        small_done = main_done = False
        while victims < n:
            if not small_done and (small_len >= self._small_target or main_done):
                key: OffloadKey | None = None
                chosen: BlockStatus | None = None
                while index >= 0:  # the next evictable key of the small queue
                    candidate = small.key_at(index)
                    index = small.after(index)
                    block = blocks[candidate]
                    if block.ref_cnt == 0 and not (guarded and candidate in protected):
                        key = candidate
                        chosen = block
                        break
                if key is not None and chosen is not None:
                    small_len -= 1
                    keys.append(key)
                    found.append(chosen)
                    if chosen.mark > 0:
                        moves.append(_SMALL_TO_MAIN)
                        new_freq[key] = 0
                        main.append(key)
                        main_done = False
                    else:
                        moves.append(_SMALL_EVICT)
                        victims += 1
                    continue
                small_done = True
            if main_done:
                return False
            key = main.pop()
            mark = 0
            while key is not None:  # the next evictable key of the main queue
                block = blocks[key]
                if block.ref_cnt == 0 and not (guarded and key in protected):
                    mark = block.mark
                    break
                key = main.pop()
            if key is None:
                main_done = True
                if small_done:
                    return False
                continue
            keys.append(key)
            found.append(block)
            if reinsert:
                count = new_freq.get(key)
                if count is None:
                    count = mark
                if count > 0:
                    new_freq[key] = count - 1
                    moves.append(_MAIN_REINSERT)
                    main.append(key)
                    continue
            moves.append(_MAIN_EVICT)
            victims += 1
        return True

    def _apply(
        self,
        moves: list[int],
        keys: list[OffloadKey],
        found: list[BlockStatus],
        victim_keys: list[OffloadKey],
        victim_blocks: list[BlockStatus],
    ) -> None:
        blocks = self._blocks
        small, main, ghost = self._small, self._main, self._ghost
        main_mark = self._main_mark
        main_ghost = self._main_ghost if self._adaptive else None
        for index in range(len(keys)):
            step = moves[index]
            key = keys[index]
            if step == _SMALL_TO_MAIN:
                small.remove(key)
                main[key] = None
                found[index].mark = main_mark
            elif step == _MAIN_REINSERT:
                main.move_to_end(key)
                found[index].mark -= 1
            else:
                if step == _SMALL_EVICT:
                    small.remove(key)
                    ghost.remember(key)
                else:
                    del main[key]
                    if main_ghost is not None:
                        main_ghost.remember(key)
                del blocks[key]  # the plan's block: no second lookup (nor a generic ``pop``)
                victim_keys.append(key)
                victim_blocks.append(found[index])


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
