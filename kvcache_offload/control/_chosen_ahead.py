"""Victims chosen ahead of the next store (``CPUOffloadingManager.evict_ahead``), kept.

The chosen blocks leave the policy and the table but stay loadable (the manager's lookups and
loads find them in ``_ahead``); a store takes them first, and a use puts them back where the
policy had them (``CachePolicy.reinstate_blocks``), in the order chosen.

The engine chooses once a lone store's copy is on its way, so the next store's copy starts
without the policy's choice in front of it. Nothing is chosen while released keys wait: those
leave first at need, without the policy (and a rescued one would come back to a policy that
never evicted it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies.base import BlockStatus

if TYPE_CHECKING:
    from kvcache_offload.control.manager import CPUOffloadingManager


__all__ = ["forget_chosen", "rescue"]


def rescue(m: CPUOffloadingManager, keys: Sequence[OffloadKey]) -> None:
    """Give the blocks of ``keys`` chosen ahead back to the table and to the policy,
    which puts them where they were (``CachePolicy.reinstate_blocks``), in the order
    chosen; the caller's touch, if any, follows."""
    ahead = m._ahead
    back_keys: list[OffloadKey] = []
    for key in keys:
        if key in ahead:
            back_keys.append(key)
    if not back_keys:
        return
    if len(back_keys) > 1:  # the order they were chosen in (``ahead`` keeps it)
        wanted = set(back_keys)
        back_keys = [key for key in ahead if key in wanted]
    back_blocks: list[BlockStatus] = []
    for key in back_keys:
        back_blocks.append(ahead.pop(key))
    if not m._shared_table:
        table = m._blocks
        for index in range(len(back_keys)):
            table[back_keys[index]] = back_blocks[index]
    m._policy.reinstate_blocks(back_keys, back_blocks)
    m._ahead_rescued += len(back_keys)


def forget_chosen(m: CPUOffloadingManager, key: OffloadKey) -> BlockStatus | None:
    """:meth:`_forget` for a key chosen ahead (already out of the policy, the table and
    the released marks): its block, slot left as a new store needs it, or None when
    ``key`` was not chosen. The caller frees or fences the slot."""
    block = m._ahead.pop(key, None)
    if block is not None:
        block.ref_cnt = -1
    return block
