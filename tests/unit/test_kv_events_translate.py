"""Which engine events become which vLLM KV events, and how keys become block hashes."""

from __future__ import annotations

import numpy as np

from kvcache_offload.aio.types import EngineEvent, EventType
from kvcache_offload.contracts.offload_key import (
    OffloadKey,
    make_offload_key,
)
from kvcache_offload.keys import chained_block_hashes, token_block_keys
from kvcache_offload.kv_events import (
    BlockTokens,
    EventTranslator,
    WireCodec,
    external_block_hash,
    split_key,
    token_blocks,
)


def event(type: EventType, keys: list[OffloadKey], medium: str = "CPU") -> EngineEvent:
    return EngineEvent(seq=1, timestamp=0.0, type=type, keys=keys, medium=medium)


def key(i: int, group: int = 0) -> OffloadKey:
    return make_offload_key(i.to_bytes(32, "big"), group)


def translator(**kwargs: object) -> EventTranslator:
    return EventTranslator(WireCodec("map"), block_sizes=(16,), **kwargs)  # type: ignore[arg-type]


def test_external_hash_is_vllms_low_64_bits_or_the_raw_bytes() -> None:
    digest = bytes(range(32))
    assert external_block_hash(digest, "int") == int.from_bytes(digest[-8:], "big")
    assert external_block_hash(digest, "bytes") == digest
    assert external_block_hash(b"\xff" * 32, "int") == 2**64 - 1


def test_offload_keys_split_into_vllm_block_hash_and_group() -> None:
    digest = bytes(range(32))
    assert split_key(make_offload_key(digest, 7)) == (digest, 7)


def test_stored_keys_become_one_block_stored_per_group_in_order() -> None:
    keys = [key(1), key(2, group=1), key(3)]
    out = translator().translate(event(EventType.STORED, keys))
    assert [(e.block_hashes, e.group_idx) for e in out] == [([1, 3], 0), ([2], 1)]
    assert all(e.medium == "CPU" and e.token_ids == [] and e.block_size == 16 for e in out)
    assert all(e.parent_block_hash is None for e in out)


def test_evictions_become_block_removed_and_reset_all_blocks_cleared() -> None:
    t = translator()
    (removed,) = t.translate(event(EventType.EVICTED, [key(5), key(6)]))
    assert type(removed).__name__ == "BlockRemoved"
    assert (removed.block_hashes, removed.medium, removed.group_idx) == ([5, 6], "CPU", 0)
    (cleared,) = t.translate(event(EventType.RESET, []))
    assert type(cleared).__name__ == "AllBlocksCleared"


def test_loads_failures_and_lease_expiry_publish_nothing() -> None:
    t = translator()
    for kind in (EventType.LOAD_COMPLETED, EventType.STORE_FAILED, EventType.LEASE_EXPIRED):
        assert t.translate(event(kind, [key(1)])) == []


def test_media_are_renamed_for_the_router() -> None:
    (stored,) = translator(media={"CPU": "CPU_TIER1"}).translate(event(EventType.STORED, [key(1)]))
    assert stored.medium == "CPU_TIER1"


def test_token_derived_keys_carry_tokens_block_size_and_parent_hash() -> None:
    tokens = list(range(64))
    keys = token_block_keys(tokens, 16)
    hashes = chained_block_hashes(tokens, 16)
    memory = BlockTokens()
    memory.remember(keys, tokens, 16)
    t = translator(tokens=memory)
    # Blocks 0 and 1 were offloaded earlier: this store holds blocks 2 and 3.
    (stored,) = t.translate(event(EventType.STORED, keys[2:]))
    assert stored.token_ids == tokens[32:64]
    assert stored.block_size == 16
    assert stored.block_hashes == [external_block_hash(h, "int") for h in hashes[2:]]
    assert stored.parent_block_hash == external_block_hash(hashes[1], "int")
    (first,) = t.translate(event(EventType.STORED, keys[:1]))
    assert first.parent_block_hash is None and first.token_ids == tokens[:16]


def test_a_store_mixing_known_and_unknown_tokens_splits_into_runs() -> None:
    tokens = list(range(32))
    keys = token_block_keys(tokens, 16)
    memory = BlockTokens()
    memory.remember(keys, tokens, 16)
    out = translator(tokens=memory).translate(event(EventType.STORED, [keys[0], key(9), keys[1]]))
    assert [e.token_ids for e in out] == [tokens[:16], [], tokens[16:]]
    assert out[2].parent_block_hash == out[0].block_hashes[0]


def test_block_tokens_memory_is_bounded_and_forgets_published_keys() -> None:
    memory = BlockTokens(capacity=2)
    keys = [key(i) for i in range(3)]
    memory.remember(keys, list(range(48)), 16)
    assert len(memory) == 2
    assert memory.take(keys[0]) is None
    entry = memory.take(keys[2])
    assert entry is not None and entry.parent == keys[1] and entry.token_ids == tuple(range(32, 48))
    assert memory.take(keys[2]) is None


def test_remembered_tokens_are_published_unchanged_from_a_list_or_the_services_array() -> None:
    """The service hands large bodies' ids over as one int64 array (kept as an array, not as
    Python ints on the loop): the published ids are the same Python ints, also at the extremes
    keys allow (int32), and a later change to the caller's array does not reach them."""
    ids = [0, 1, 151_999, 2**31 - 1, -(2**31), 65_536] * 8  # 48 ids: three blocks of 16
    keys = token_block_keys(ids, 16)
    codec = WireCodec("map")
    for given in (list(ids), np.asarray(ids, dtype=np.int64)):
        memory = BlockTokens()
        memory.remember(keys, given, 16)
        if isinstance(given, np.ndarray):
            given[:] = -1
        t = EventTranslator(codec, block_sizes=(16,), tokens=memory)
        (stored,) = t.translate(event(EventType.STORED, keys))
        assert stored.token_ids == ids and all(type(i) is int for i in stored.token_ids)
        (decoded,) = codec.decode_batch(codec.encode_batch([stored])).events
        assert decoded.token_ids == ids


def test_blocks_made_a_slice_at_a_time_are_the_same_ints(monkeypatch) -> None:
    """The service turns a large body's ids into Python ints in a worker thread, a few
    thousand per step; the blocks are the same whatever the step."""
    from kvcache_offload.kv_events import block_tokens

    ids = np.random.default_rng(3).integers(-(2**31), 2**31, 1000)
    whole = token_blocks(ids, 96, 20)
    monkeypatch.setattr(block_tokens, "SLICE_IDS", 7)  # steps that straddle the blocks
    assert (
        token_blocks(ids, 96, 20)
        == whole
        == [tuple(ids[i * 96 : (i + 1) * 96].tolist()) for i in range(10)]
    )
    assert all(type(i) is int for block in whole for i in block)


def test_tokens_beyond_the_last_full_block_or_the_keys_are_not_remembered() -> None:
    keys = [key(i) for i in range(4)]
    memory = BlockTokens()
    memory.remember(keys, list(range(40)), 16)  # two full blocks, eight ids left over
    assert len(memory) == 2
    memory.remember(keys[:1], list(range(100, 164)), 16)  # one key for four blocks' ids
    entry = memory.take(keys[0])
    assert entry is not None and entry.token_ids == tuple(range(100, 116))
