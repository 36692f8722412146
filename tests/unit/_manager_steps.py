"""Test helpers: whole manager steps (a store, a reuse) on keys never used before."""

from __future__ import annotations

import itertools

from kvcache_offload import CPUOffloadingManager, OffloadKey
from tests.unit._keys import key

_ids = itertools.count(10**9)  # far from the small ids tests name themselves


def fresh_keys(n: int) -> list[OffloadKey]:
    """``n`` keys no other call of this helper has returned."""
    return [key(next(_ids)) for _ in range(n)]


def store(manager: CPUOffloadingManager, keys: list[OffloadKey]) -> None:
    """Prepare and complete a store of ``keys``, as one scheduler step."""
    manager.prepare_store(keys)
    manager.complete_store(keys)


def reuse(manager: CPUOffloadingManager, keys: list[OffloadKey]) -> None:
    """Touch, then load ``keys`` back, as a request that hits them."""
    manager.touch(keys)
    manager.prepare_load(keys)
    manager.complete_load(keys)
