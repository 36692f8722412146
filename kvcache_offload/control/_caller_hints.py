"""The caller's word on dead blocks: ``release`` (leave first when room is needed) and
``discard`` (free now), and how released keys leave at need.

The policy cannot know which blocks are dead, and the lab's dead-block oracle
(``docs/policy-lab.md``) is worth more than any policy on the conversation trace: a hint from
the serving engine is the one source of that knowledge.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies.base import BlockStatus

if TYPE_CHECKING:
    from kvcache_offload.control.manager import CPUOffloadingManager

from kvcache_offload.control import _chosen_ahead
from kvcache_offload.control._fences import take_blocks
from kvcache_offload.control._manager_io import check_keys, event

__all__ = ["discard", "release", "released_victims", "take_released"]


def release(m: CPUOffloadingManager, keys: Sequence[OffloadKey]) -> int:
    check_keys(keys)
    table = m._blocks
    released = m._released
    ahead = m._ahead
    fresh: dict[OffloadKey, None] = {}
    for key in keys:
        if (key in table or key in ahead) and key not in released:
            fresh[key] = None
    if fresh and ahead:  # a release that marks nothing leaves the choice as it is
        _chosen_ahead.rescue(m, list(ahead))
    released.update(fresh)
    return len(fresh)


def released_victims(m: CPUOffloadingManager, needed: int) -> list[tuple[OffloadKey, BlockStatus]]:
    """Up to ``needed`` idle released blocks, oldest release first, pinned (``ref_cnt``
    + 1) until the caller knows the store goes ahead. With fewer than ``needed``, every
    idle released block is pinned, so the policy, asked for the rest, takes none."""
    table = m._blocks
    chosen: list[tuple[OffloadKey, BlockStatus]] = []
    for key in m._released:
        if len(chosen) == needed:
            break
        block = table.get(key)
        if block is not None and block.ref_cnt == 0:  # idle: not read, not pinned here
            block.ref_cnt = 1
            chosen.append((key, block))
    return chosen


def take_released(
    m: CPUOffloadingManager,
    chosen: list[tuple[OffloadKey, BlockStatus]],
    evicted_keys: list[OffloadKey],
    recycled: list[BlockStatus],
) -> None:
    """Evict the released victims of a store that goes ahead (idle again by now): out of
    the policy and the released list; the caller handles them as the policy's victims."""
    remove = m._policy.remove
    released = m._released
    for key, block in chosen:
        remove(key)  # the caller drops the evicted keys from its own table
        del released[key]
        evicted_keys.append(key)
        recycled.append(block)
    m._released_evictions += len(chosen)


def discard(m: CPUOffloadingManager, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
    dropped: list[OffloadKey] = []
    m._free_list.extend(take_blocks(m, keys, True, dropped))
    m._discarded_blocks += len(dropped)
    if dropped and m.events is not None:
        m.events.append(event(dropped, True))
    return dropped
