"""The manager's list-based policy calls (``insert_blocks``, ``evict_blocks``) and its
hand-built results behave exactly as the per-pair contract they stand in for."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

import pytest

from kvcache_offload import CPUOffloadingManager
from kvcache_offload.contracts.load_store_spec import CPULoadStoreSpec
from kvcache_offload.contracts.manager import OffloadingEvent, PrepareStoreOutput
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.control.policies import get_cache_policy_cls
from kvcache_offload.control.policies.base import BlockStatus, CachePolicy
from kvcache_offload.errors import BlockStateError, InvalidKeyError
from tests.unit._keys import key, key_ids, keys

POLICIES = ["lru", "arc", "slru", "sieve", "s3fifo", "s3fifo-prefix", "lru2", "alru", "adaptive"]


def _blocks(*ids: int) -> list[BlockStatus]:
    out = []
    for block_id in ids:
        block = BlockStatus(block_id)
        block.ref_cnt = 0
        out.append(block)
    return out


@pytest.mark.parametrize("name", POLICIES)
def test_insert_blocks_and_evict_blocks_match_insert_many_and_evict(name: str) -> None:
    cls = get_cache_policy_cls(name)
    by_lists, by_pairs = cls(cache_capacity=8), cls(cache_capacity=8)
    stored = keys(*range(6))
    by_lists.insert_blocks(list(stored), _blocks(*range(6)))
    by_pairs.insert_many(list(zip(stored, _blocks(*range(6)), strict=True)))
    by_lists.touch(keys(2, 4))
    by_pairs.touch(keys(2, 4))
    victim_keys: list[OffloadKey] = []
    victim_blocks: list[BlockStatus] = []
    assert by_lists.evict_blocks(3, frozenset(), victim_keys, victim_blocks)
    pairs = by_pairs.evict(3, frozenset())
    assert pairs is not None
    assert victim_keys == [k for k, _ in pairs]
    assert [b.block_id for b in victim_blocks] == [b.block_id for _, b in pairs]
    assert len(by_lists) == len(by_pairs) == 3


@pytest.mark.parametrize("name", POLICIES)
def test_evict_blocks_that_cannot_appends_nothing(name: str) -> None:
    policy = get_cache_policy_cls(name)(cache_capacity=4)
    blocks = _blocks(0, 1)
    blocks[1].ref_cnt = 1  # being read: not evictable
    policy.insert_blocks(list(keys(0, 1)), blocks)
    out_keys: list[OffloadKey] = [key(99)]
    out_blocks: list[BlockStatus] = []
    assert not policy.evict_blocks(2, frozenset(), out_keys, out_blocks)
    assert out_keys == [key(99)] and out_blocks == []
    assert len(policy) == 2
    assert policy.evict_blocks(1, frozenset(), out_keys, out_blocks)
    assert key_ids(out_keys) == [99, 0]


@pytest.mark.parametrize("name", ["lru", "arc", "slru", "s3fifo", "s3fifo-prefix", "lru2"])
def test_a_subclass_overriding_insert_or_evict_still_sees_every_call(name: str) -> None:
    base = get_cache_policy_cls(name)
    seen: list[str] = []

    class Watched(base):  # type: ignore[misc, valid-type]
        def insert(self, key: OffloadKey, block: BlockStatus) -> None:
            seen.append("insert")
            super().insert(key, block)

        def insert_many(self, pairs: Sequence[tuple[OffloadKey, BlockStatus]]) -> None:
            seen.append("insert_many")
            super().insert_many(pairs)

        def evict(
            self, n: int, protected: Collection[OffloadKey]
        ) -> list[tuple[OffloadKey, BlockStatus]] | None:
            seen.append("evict")
            return super().evict(n, protected)

    m = CPUOffloadingManager(2, Watched)
    m.prepare_store(keys(1, 2))
    m.complete_store(keys(1, 2))
    assert "insert_many" in seen
    out = m.prepare_store(keys(3))
    assert out is not None and len(out.evicted_keys) == 1
    assert "evict" in seen


def test_a_queue_policy_subclass_overriding_select_is_obeyed() -> None:
    from kvcache_offload.control.policies.lru2 import LRU2CachePolicy

    class NewestFirst(LRU2CachePolicy):
        def _select(
            self, n: int, protected: Collection[OffloadKey]
        ) -> list[tuple[OffloadKey, BlockStatus]] | None:
            newest = list(self._blocks)[-n:]
            victims = [(k, self._blocks[k]) for k in newest]
            for k, _ in victims:
                self._probation.take(self._blocks[k])
                del self._blocks[k]
            return victims

    m = CPUOffloadingManager(2, NewestFirst)
    m.prepare_store(keys(1, 2))
    m.complete_store(keys(1, 2))
    out = m.prepare_store(keys(3))
    assert out is not None and key_ids(out.evicted_keys) == [2]


class _PairsOnly(CachePolicy):
    """A third-party policy implementing only the per-pair contract."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.blocks: dict[OffloadKey, BlockStatus] = {}

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self.blocks.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.blocks[key] = block

    def remove(self, key: OffloadKey) -> None:
        del self.blocks[key]

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        pass

    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        idle = [(k, b) for k, b in self.blocks.items() if b.ref_cnt == 0 and k not in protected]
        if len(idle) < n:
            return None
        for k, _ in idle[:n]:
            del self.blocks[k]
        return idle[:n]

    def clear(self) -> None:
        self.blocks.clear()

    def __len__(self) -> int:
        return len(self.blocks)


def test_a_policy_with_only_the_pair_contract_works_through_the_defaults() -> None:
    m = CPUOffloadingManager(2, _PairsOnly)
    m.prepare_store(keys(1, 2))
    m.complete_store(keys(1, 2))
    out = m.prepare_store(keys(3, 4))
    assert out is not None and key_ids(out.evicted_keys) == [1, 2]
    assert out.store_spec.block_ids.tolist() == [1, 0]


def test_hand_built_results_equal_their_classes_own() -> None:
    # The manager builds these without their Python constructors: they must stay plain.
    assert [f.name for f in dataclasses.fields(PrepareStoreOutput)] == [
        "keys_to_store",
        "store_spec",
        "evicted_keys",
    ]
    assert not hasattr(PrepareStoreOutput, "__post_init__")
    m = CPUOffloadingManager(4)
    out = m.prepare_store(keys(1, 2))
    assert out == PrepareStoreOutput(list(keys(1, 2)), out.store_spec, [])
    own = CPULoadStoreSpec.from_owned_list([0, 1])
    assert vars(out.store_spec) == vars(own)
    assert out.store_spec.block_ids.tolist() == own.block_ids.tolist() == [0, 1]
    assert type(out.store_spec) is CPULoadStoreSpec
    m.complete_store(keys(1, 2))
    spec = m.prepare_load(keys(2))
    assert type(spec) is CPULoadStoreSpec and spec.block_ids.tolist() == [1]
    empty = m.prepare_store(keys(1))
    assert empty is not None and empty.keys_to_store == [] and empty.store_spec.block_ids.size == 0


def test_hand_built_events_equal_their_class_own() -> None:
    # The manager builds its events without the dataclass constructor, too.
    assert [f.name for f in dataclasses.fields(OffloadingEvent)] == ["keys", "medium", "removed"]
    assert not hasattr(OffloadingEvent, "__post_init__")
    m = CPUOffloadingManager(2, enable_events=True)
    m.prepare_store(keys(1, 2))
    m.complete_store(keys(1, 2))
    m.prepare_store(keys(3))  # evicts the least recent key
    events = list(m.take_events())
    assert events == [
        OffloadingEvent(list(keys(1, 2)), "CPU", False),
        OffloadingEvent(list(keys(1)), "CPU", True),
    ]
    assert all(type(e) is OffloadingEvent for e in events)


def test_a_malformed_key_after_an_absent_one_raises_and_changes_nothing() -> None:
    m = CPUOffloadingManager(4)
    with pytest.raises(InvalidKeyError):
        m.prepare_store([key(1), b"abc"])  # type: ignore[list-item]
    with pytest.raises(InvalidKeyError):
        m.prepare_store([key(1), "not bytes"])  # type: ignore[list-item]
    with pytest.raises(InvalidKeyError):
        m.prepare_store([key(1), ["unhashable"]])  # type: ignore[list-item]
    assert m.stats().free == 4 and m.lookup(key(1)) is False


def test_load_checks_name_a_malformed_key_before_a_state_error() -> None:
    m = CPUOffloadingManager(4)
    m.prepare_store(keys(1))
    m.complete_store(keys(1))
    with pytest.raises(InvalidKeyError):
        m.prepare_load([key(2), b"abc"])  # type: ignore[list-item]
    with pytest.raises(InvalidKeyError):
        m.prepare_load([key(1), memoryview(key(1))])  # type: ignore[list-item]
    with pytest.raises(BlockStateError):
        m.prepare_load([key(1), key(2)])
    assert m.stats().reading == 0


def test_a_bytes_subclass_key_is_still_accepted() -> None:
    class Key(bytes):
        pass

    m = CPUOffloadingManager(4)
    out = m.prepare_store([Key(key(1))])  # type: ignore[list-item]
    assert out is not None and len(out.keys_to_store) == 1
    m.complete_store(keys(1))
    assert m.prepare_load([Key(key(1))]).block_ids.tolist() == [0]  # type: ignore[list-item]


@pytest.mark.parametrize("name", ["sieve", "s3fifo", "s3fifo-prefix", "lru2"])
def test_victims_are_the_inserted_blocks_themselves(name: str) -> None:
    # These policies hand back the blocks their selection found, not a second lookup's.
    policy = get_cache_policy_cls(name)(cache_capacity=8)
    blocks = _blocks(*range(6))
    policy.insert_blocks(list(keys(*range(6))), blocks)
    policy.touch(keys(1, 3))
    victim_keys: list[OffloadKey] = []
    victim_blocks: list[BlockStatus] = []
    assert policy.evict_blocks(4, frozenset(), victim_keys, victim_blocks)
    by_key = dict(zip(keys(*range(6)), blocks, strict=True))
    assert all(b is by_key[k] for k, b in zip(victim_keys, victim_blocks, strict=True))


@pytest.mark.parametrize("as_tuple", [False, True])
def test_touch_and_complete_store_name_a_malformed_key_in_a_list_or_tuple(
    as_tuple: bool,
) -> None:
    m = CPUOffloadingManager(4, "s3fifo")
    m.prepare_store(keys(1, 2))
    for bad in (b"abc", "not bytes"):
        batch: Sequence[object] = [key(1), bad, key(2)]
        if as_tuple:
            batch = tuple(batch)
        with pytest.raises(InvalidKeyError):
            m.touch(batch)  # type: ignore[arg-type]
        with pytest.raises(InvalidKeyError):
            m.complete_store(batch)  # type: ignore[arg-type]
    assert m.stats().writing == 2  # nothing completed
    m.complete_store(tuple(keys(1, 2)))
    m.touch(tuple(keys(1, 2)))
    assert m.stats().writing == 0 and m.lookup(key(2)) is True
