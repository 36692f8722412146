"""Evicting for a store: blocks chosen ahead first, then released keys, then the policy's
choice; the keys of the store itself survive.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies.base import Blocks, BlockStatus, Keys

if TYPE_CHECKING:
    from kvcache_offload.control.manager import CPUOffloadingManager

from kvcache_offload.control import _caller_hints
from kvcache_offload.control._manager_io import event

_NOTHING_PROTECTED: frozenset[OffloadKey] = frozenset()

__all__ = ["choose", "evict", "evict_ahead"]


def evict(
    m: CPUOffloadingManager, needed: int, present: Blocks, evicted_keys: Keys, recycled: Blocks
) -> bool:
    """Evict ``needed`` idle blocks into ``evicted_keys`` and ``recycled``, their slots
    reset for a new store, published as one eviction event: blocks chosen ahead first,
    then the choice of :func:`choose`; ``present`` (ready blocks of the caller's keys)
    survive. False, with nothing changed, when too few blocks are evictable."""
    if m._num_idle() < needed:
        return False
    ahead = m._ahead
    taken = 0
    if ahead:
        # Oldest first, ahead of the policy's own victims (they were chosen first); out
        # of the chosen ones only once the policy found the rest.
        taken = min(needed, len(ahead))
        if taken == len(ahead):
            evicted_keys.extend(ahead)
            recycled.extend(ahead.values())
        else:
            for key, block in ahead.items():
                if len(evicted_keys) == taken:
                    break
                evicted_keys.append(key)
                recycled.append(block)
        if taken < needed and not choose(m, needed - taken, present, evicted_keys, recycled):
            del evicted_keys[:]
            del recycled[:]
            return False
        if taken == len(ahead):
            ahead.clear()
        else:
            for index in range(taken):
                del ahead[evicted_keys[index]]
        m._ahead_evictions += taken
    elif not choose(m, needed, present, evicted_keys, recycled):
        return False
    for block in recycled:
        block.ref_cnt = -1  # freed slots wait in the state a new store needs
    m._evictions += len(recycled)
    if m.events is not None:
        m.events.append(event(evicted_keys, True))
    return True


def choose(
    m: CPUOffloadingManager, needed: int, present: Blocks, evicted_keys: Keys, recycled: Blocks
) -> bool:
    """Take ``needed`` idle blocks out of the policy and the table (released ones first,
    then the policy's choice) into ``evicted_keys`` and ``recycled``, their state left
    as it was (idle); ``present`` survive. False, with nothing changed, when the policy
    cannot find that many."""
    # Every key of this call must survive the eviction. The ready ones are pinned for it
    # (blocks being read or written are never evicted anyway): the same effect as passing
    # the keys as ``protected``, without building a set of them.
    for block in present:
        block.ref_cnt += 1
    chosen = _caller_hints.released_victims(m, needed) if m._released else []
    evicted = False
    first = len(evicted_keys)
    try:
        # The released victims are pinned while the policy picks the rest, so a refused
        # store changes nothing; they go only if it succeeds.
        evicted = len(chosen) == needed or m._policy.evict_blocks(
            needed - len(chosen), _NOTHING_PROTECTED, evicted_keys, recycled
        )
    finally:
        for block in present:
            block.ref_cnt -= 1
        for _key, block in chosen:
            block.ref_cnt -= 1
    if not evicted:
        return False
    if chosen:
        _caller_hints.take_released(m, chosen, evicted_keys, recycled)
    if not m._shared_table:
        table = m._blocks
        for index in range(first, len(evicted_keys)):
            del table[evicted_keys[index]]
    return True


def evict_ahead(m: CPUOffloadingManager, free_target: int) -> int:
    """Choose the next store's victims now (see ``_chosen_ahead.py``)."""
    if m._released or not m._policy.chooses_ahead:
        return 0
    ahead = m._ahead
    needed = min(free_target - m._num_free() - len(ahead), m._num_idle() - len(ahead))
    if needed <= 0:
        return 0
    keys: list[OffloadKey] = []
    blocks: list[BlockStatus] = []
    if not choose(m, needed, [], keys, blocks):
        return 0
    for index in range(len(keys)):
        ahead[keys[index]] = blocks[index]
    return len(keys)
