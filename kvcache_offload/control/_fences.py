"""Fenced slots: taken from their keys but kept from reuse while a client outside the
process may still write them (``CPUOffloadingManager.fence``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies.base import BlockStatus

if TYPE_CHECKING:
    from kvcache_offload.control.manager import CPUOffloadingManager

from kvcache_offload.control import _chosen_ahead
from kvcache_offload.control._manager_io import check_keys

__all__ = ["fence", "release_fenced", "take_blocks"]


def take_blocks(
    m: CPUOffloadingManager,
    keys: Sequence[OffloadKey],
    idle_only: bool,
    taken_keys: list[OffloadKey],
) -> list[BlockStatus]:
    """Take the blocks of ``keys`` from their keys (a block chosen ahead too), in order,
    and append those keys to ``taken_keys``; the caller frees or fences the slots. With
    ``idle_only`` a block being written or read stays; without, its count is settled."""
    check_keys(keys)
    table = m._blocks
    ahead = m._ahead
    taken: list[BlockStatus] = []
    for key in keys:
        block = table.get(key)
        if block is None:
            if not ahead:
                continue
            block = _chosen_ahead.forget_chosen(m, key)
            if block is None:
                continue
        else:
            ref_cnt = block.ref_cnt
            if ref_cnt != 0:
                if idle_only:
                    continue
                if ref_cnt == -1:
                    m._writing -= 1
                    m._failed_store_blocks += 1
                else:
                    m._reading -= 1
            m._forget(key, block)
        taken.append(block)
        taken_keys.append(key)
    return taken


def fence(m: CPUOffloadingManager, keys: Sequence[OffloadKey]) -> list[int]:
    fenced: list[int] = []
    for block in take_blocks(m, keys, False, []):
        m._fenced[block.block_id] = block
        fenced.append(block.block_id)
    return fenced


def release_fenced(m: CPUOffloadingManager, block_ids: Sequence[int]) -> None:
    for block_id in block_ids:
        block = m._fenced.pop(block_id, None)
        if block is not None:
            m._free_list.append(block)
