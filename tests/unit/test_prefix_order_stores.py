"""The prefix-order policies (``lru2``, ``s3fifo-prefix``) queue each store's blocks tail
first, so a prefix loses its deepest block before its head. Stores that follow one another
with no other manager call in between (an engine storing for several requests, stores-only
traffic) must still queue in the order they arrived: merged into one batch and reversed,
the later store's blocks were queued as older than the earlier store's and evicted first.
"""

from __future__ import annotations

import itertools

import pytest

from kvcache_offload import CPUOffloadingManager, OffloadKey
from kvcache_offload.control.policies.base import BlockStatus
from kvcache_offload.control.policies.registry import get_cache_policy_cls
from tests.unit._keys import key

_ids = itertools.count()


def _fresh(n: int) -> list[OffloadKey]:
    return [key(next(_ids)) for _ in range(n)]


def _store(manager: CPUOffloadingManager, keys: list[OffloadKey]) -> None:
    manager.prepare_store(keys)
    manager.complete_store(keys)


def _stored(manager: CPUOffloadingManager, keys: list[OffloadKey]) -> list[bool]:
    return [bool(manager.lookup(k)) for k in keys]


@pytest.mark.parametrize("policy", ["lru2", "s3fifo-prefix"])
def test_stores_back_to_back_are_evicted_oldest_store_first_tail_first(policy: str) -> None:
    manager = CPUOffloadingManager(16, policy)
    first, second, third, fourth = (_fresh(4) for _ in range(4))
    for keys in (first, second, third, fourth):  # back to back: nothing in between
        _store(manager, keys)
    _store(manager, _fresh(1))  # the tier is full: one block goes
    assert _stored(manager, first) == [True, True, True, False]  # the oldest store's tail
    assert all(_stored(manager, second + third + fourth))
    _store(manager, _fresh(3))
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
    first, second = _fresh(4), _fresh(4)
    _store(manager, first)
    _store(manager, second)
    assert Counting.inserted == 8
    _store(manager, _fresh(12))  # four blocks go
    assert _stored(manager, first) == [False] * 4  # the older store went first, all of it
    assert all(_stored(manager, second))
    _store(manager, _fresh(1))
    assert _stored(manager, second) == [True, True, True, False]
