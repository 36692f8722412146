"""Fenced slots: taken from their keys but kept from reuse while a client outside the
process may still write them (``CPUOffloadingManager.fence``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcache_offload.contracts.offload_key import OffloadKey

if TYPE_CHECKING:
    from kvcache_offload.control.manager import CPUOffloadingManager

from kvcache_offload.control import _chosen_ahead
from kvcache_offload.control._manager_io import check_keys

__all__ = ["fence", "release_fenced"]


def fence(m: CPUOffloadingManager, keys: Sequence[OffloadKey]) -> list[int]:
    check_keys(keys)
    table = m._blocks
    fenced: list[int] = []
    ahead = m._ahead
    for key in keys:
        block = table.get(key)
        if block is None and ahead:
            block = _chosen_ahead.forget_chosen(m, key)
            if block is not None:
                m._fenced[block.block_id] = block
                fenced.append(block.block_id)
            continue
        if block is None:
            continue
        if block.ref_cnt == -1:
            m._writing -= 1
            m._failed_store_blocks += 1
        elif block.ref_cnt > 0:
            m._reading -= 1
        m._forget(key, block)
        m._fenced[block.block_id] = block
        fenced.append(block.block_id)
    return fenced


def release_fenced(m: CPUOffloadingManager, block_ids: Sequence[int]) -> None:
    for block_id in block_ids:
        block = m._fenced.pop(block_id, None)
        if block is not None:
            m._free_list.append(block)
