"""Misuse raises a typed error with a clear message and leaves the manager unchanged."""

from __future__ import annotations

import pytest

from kvcache_offload import (
    BlockStateError,
    ConfigError,
    CPUOffloadingManager,
    InvalidKeyError,
    OffloadError,
    UnknownPolicyError,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from tests.unit._keys import key, keys


def populated() -> CPUOffloadingManager:
    m = CPUOffloadingManager(3, "lru")
    m.prepare_store(keys(1, 2))
    m.complete_store(keys(1))
    return m


def test_unknown_policy_name_lists_the_registered_ones() -> None:
    with pytest.raises(UnknownPolicyError, match="lru"):
        CPUOffloadingManager(4, "fifo-that-does-not-exist")


def test_policy_module_path_that_does_not_exist_is_a_typed_error() -> None:
    with pytest.raises(UnknownPolicyError, match="no_such_module"):
        CPUOffloadingManager(4, "no_such_module:Policy")


def test_out_of_tree_policy_loads_by_module_path() -> None:
    m = CPUOffloadingManager(2, "kvcache_offload.control.policies.lru:LRUCachePolicy")
    assert m.prepare_store(keys(1)) is not None


def test_negative_capacity_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="num_blocks"):
        CPUOffloadingManager(-1)


@pytest.mark.parametrize("capacity", [2.5, "4", None])
def test_capacity_of_the_wrong_type_is_a_type_error(capacity: object) -> None:
    # The compiled build raises its own TypeError at the call boundary; the pure-Python
    # build raises the same class from its own check.
    with pytest.raises(TypeError):
        CPUOffloadingManager(capacity)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [b"", b"abcd", "str-key", 12, None])
def test_malformed_keys_are_rejected_by_every_call(bad: object) -> None:
    m = populated()
    before = m.stats()
    for call in (
        lambda: m.lookup(bad),  # type: ignore[arg-type]
        lambda: m.prepare_store([key(5), bad]),  # type: ignore[list-item]
        lambda: m.touch([bad]),  # type: ignore[list-item]
        lambda: m.prepare_load([bad]),  # type: ignore[list-item]
        lambda: m.complete_load([bad]),  # type: ignore[list-item]
        lambda: m.complete_store([bad]),  # type: ignore[list-item]
        # A bad key after good ones: nothing before it may have been applied.
        lambda: m.complete_store([key(2), bad]),  # type: ignore[list-item]
        lambda: m.complete_store([key(2), bad], success=False),  # type: ignore[list-item]
        lambda: m.prepare_load([key(1), bad]),  # type: ignore[list-item]
        lambda: m.touch([key(2), bad]),  # type: ignore[list-item]
    ):
        with pytest.raises(InvalidKeyError):
            call()
    assert m.stats() == before
    assert m.lookup(key(5)) is False
    assert m.lookup(key(2)) is None  # still being written


def test_complete_load_of_a_block_not_being_read_is_a_state_error() -> None:
    m = populated()
    before = m.stats()
    with pytest.raises(BlockStateError, match="not being read"):
        m.complete_load(keys(1))
    with pytest.raises(BlockStateError):
        m.complete_load(keys(9))
    assert m.stats() == before


def test_prepare_load_of_a_missing_or_unfinished_block_changes_nothing() -> None:
    m = populated()
    before = m.stats()
    with pytest.raises(BlockStateError, match="being written"):
        m.prepare_load(keys(1, 2))  # 1 ready, 2 being written: 1 must not stay pinned
    with pytest.raises(BlockStateError, match="absent"):
        m.prepare_load(keys(1, 7))
    assert m.stats() == before
    assert m.prepare_store(keys(3)) is not None


def test_completing_more_loads_than_were_prepared_changes_nothing() -> None:
    m = populated()
    m.prepare_load(keys(1))
    with pytest.raises(BlockStateError, match="only 1 in flight"):
        m.complete_load(keys(1, 1))
    assert m.stats().reading == 1


def test_errors_share_one_root() -> None:
    assert issubclass(BlockStateError, OffloadError)
    assert issubclass(UnknownPolicyError, ConfigError)


def test_offload_key_round_trips_hash_and_group() -> None:
    k = make_offload_key(b"\x01\x02hash", 7)
    assert get_offload_block_hash(k) == b"\x01\x02hash"
    assert get_offload_group_idx(k) == 7
    with pytest.raises(InvalidKeyError):
        make_offload_key(b"h", -1)
    with pytest.raises(InvalidKeyError):
        make_offload_key("h", 0)  # type: ignore[arg-type]
    with pytest.raises(InvalidKeyError):
        get_offload_group_idx(b"abc")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([0.5, 1], "must be integers, got float64"),
        ([True], "must be integers, got bool"),
        (["a"], "must be integers"),
        ([0, None], "must be integers, got object"),
    ],
)
def test_block_id_specs_refuse_anything_but_integers(ids: list[object], message: str) -> None:
    import numpy as np

    from kvcache_offload.contracts.load_store_spec import CPULoadStoreSpec, GPULoadStoreSpec

    with pytest.raises(ConfigError, match=message):
        CPULoadStoreSpec(ids)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=message):
        GPULoadStoreSpec(ids, [len(ids)], [0])  # type: ignore[arg-type]
    spec = CPULoadStoreSpec([1])
    with pytest.raises(ConfigError, match=message):
        spec.block_ids = ids  # type: ignore[assignment]
    # Integers of any width and kind are taken as int64; an empty list is no ids.
    assert CPULoadStoreSpec(np.array([[3], [4]], dtype=np.uint16)).block_ids.tolist() == [3, 4]
    assert CPULoadStoreSpec(np.array([5, 6], dtype=np.int32)).block_ids.dtype == np.int64
    assert CPULoadStoreSpec([]).block_ids.tolist() == []
