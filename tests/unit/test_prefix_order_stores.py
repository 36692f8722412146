"""The prefix-order policies (``lru2``, ``s3fifo-prefix``) queue each store's blocks tail
first, so a prefix loses its deepest block before its head. Stores that follow one another
with no other manager call in between (an engine storing for several requests, stores-only
traffic) must still queue in the order they arrived: merged into one batch and reversed,
the later store's blocks were queued as older than the earlier store's and evicted first.
"""

from __future__ import annotations

import pytest

from kvcache_offload import CPUOffloadingManager, OffloadKey
from kvcache_offload.control.policies.base import BlockStatus
from kvcache_offload.control.policies.registry import get_cache_policy_cls
from tests.unit._manager_steps import fresh_keys, store


def _stored(manager: CPUOffloadingManager, keys: list[OffloadKey]) -> list[bool]:
    return [bool(manager.lookup(k)) for k in keys]


@pytest.mark.parametrize("policy", ["lru2", "s3fifo-prefix"])
def test_stores_back_to_back_are_evicted_oldest_store_first_tail_first(policy: str) -> None:
    manager = CPUOffloadingManager(16, policy)
    first, second, third, fourth = (fresh_keys(4) for _ in range(4))
    for keys in (first, second, third, fourth):  # back to back: nothing in between
        store(manager, keys)
    store(manager, fresh_keys(1))  # the tier is full: one block goes
    assert _stored(manager, first) == [True, True, True, False]  # the oldest store's tail
    assert all(_stored(manager, second + third + fourth))
    store(manager, fresh_keys(3))
    assert _stored(manager, first) == [False] * 4
    assert all(_stored(manager, second + third + fourth))


@pytest.mark.parametrize("policy", ["lru2", "s3fifo-prefix"])
def test_a_policy_overriding_insert_still_batches_one_store_at_a_time(policy: str) -> None:
    # ``insert_many`` (the path for subclasses that change ``insert``) keeps stores apart too.
    base = get_cache_policy_cls(policy)

    class Counting(base):  # type: ignore[misc, valid-type]
        inserted = 0

        def insert(self, key: OffloadKey, block: BlockStatus) -> None:
            type(self).inserted += 1
            super().insert(key, block)

    manager = CPUOffloadingManager(16, Counting)
    first, second = fresh_keys(4), fresh_keys(4)
    store(manager, first)
    store(manager, second)
    assert Counting.inserted == 8
    store(manager, fresh_keys(12))  # four blocks go
    assert _stored(manager, first) == [False] * 4  # the older store went first, all of it
    assert all(_stored(manager, second))
    store(manager, fresh_keys(1))
    assert _stored(manager, second) == [True, True, True, False]
