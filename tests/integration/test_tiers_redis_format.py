"""RedisTier's value format on a real redis-server: two keys per block, one slot, one MSET.

Format 2 keeps a block's bytes and its frame header in two string keys written by one ``MSET``
(the server keeps the received value, where a hash field made it copy every 2 MiB). What must
hold: a reader never takes half a block, a lone half is a miss and is removed, format-1 values
(hashes under ``kvo:<fingerprint>:``) are never read, and a put still fails as one TierError.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from redis.crc import key_slot

from kvcache_offload.errors import TierError
from kvcache_offload.tiers import RedisTier, frame
from kvcache_offload.tiers.redis_tier import _growing_chunks, redis_block_names
from tests._redis import RedisServer, free_port, skip_without_redis, standalone_redis
from tests.unit._keys import key, keys

FINGERPRINT = "m" * 16


def block(i: int, size: int = 4096) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(size))


server = standalone_redis


def test_a_put_is_sent_in_chunks_of_1_1_2_4_and_so_on() -> None:
    items = [(k, b"") for k in keys(*range(13))]
    assert [len(c) for c in _growing_chunks(items)] == [1, 1, 2, 4, 5]
    assert [k for c in _growing_chunks(items) for k, _ in c] == [k for k, _ in items]


def test_put_hashes_overlap_sends_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off by default on any number of CPUs (it lost where measured); the option turns it on."""
    url = "redis://127.0.0.1:1/0"  # never connected
    for cpus in ({0, 1}, set(range(16))):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, c=cpus: c, raising=False)
        assert not RedisTier(url, FINGERPRINT).overlap_checksums
        assert RedisTier(url, FINGERPRINT, overlap_checksums=True).overlap_checksums


@pytest.mark.parametrize("overlap", [True, False])
async def test_each_block_is_one_mset_of_two_keys_in_one_slot(
    server: RedisServer, overlap: bool
) -> None:
    tier = RedisTier(server.url, FINGERPRINT, overlap_checksums=overlap)
    ks = keys(*range(13))
    try:
        await tier.put([(k, block(i)) for i, k in enumerate(ks)])
        assert server.command_calls("mset") == 13
        assert server.command_calls("hset") == 0
        for k in ks:
            name, header = redis_block_names(FINGERPRINT, k)
            assert key_slot(name) == key_slot(header)
            assert server.cli("type", name.decode()) == "string"
            assert server.cli("strlen", name.decode()) == "4096"
        assert await tier.get(ks) == [block(i) for i in range(13)]
        await tier.delete(ks[:3])
        assert server.cli("dbsize") == str(2 * 10)
    finally:
        await tier.aclose()


@pytest.mark.parametrize("lost", ["header", "bytes"])
async def test_a_block_missing_one_of_its_keys_is_a_miss_and_the_other_is_deleted(
    server: RedisServer, lost: str
) -> None:
    tier = RedisTier(server.url, FINGERPRINT)
    k = key(3)
    name, header = (n.decode() for n in redis_block_names(FINGERPRINT, k))
    try:
        await tier.put([(k, block(3))])
        assert server.cli("del", header if lost == "header" else name) == "1"
        assert await tier.get([k]) == [None]
        assert server.cli("exists", name, header) == "0"
        assert tier.stats().corrupt_blocks == 1
    finally:
        await tier.aclose()


async def test_a_format_1_value_of_the_same_layout_is_never_read(server: RedisServer) -> None:
    """An old instance's hash (fields ``h`` and ``d``) is invisible to this one, and left alone."""
    import redis.asyncio as aioredis

    tier = RedisTier(server.url, FINGERPRINT)
    bare = aioredis.Redis.from_url(server.url)
    k = key(5)
    old = f"kvo:{FINGERPRINT}:{k.hex()}".encode()
    try:
        await bare.hset(old, mapping={b"h": frame.encode_header(k, block(5)), b"d": block(5)})
        assert await tier.contains([k]) == [False]
        assert await tier.get([k]) == [None]
        await tier.put([(k, block(6))])
        assert await tier.get([k]) == [block(6)]
        assert await bare.hget(old, b"d") == block(5)
        assert all(n.startswith(b"kvo:v2:") for n in redis_block_names(FINGERPRINT, k))
    finally:
        await tier.aclose()
        await bare.aclose()


@pytest.mark.parametrize("overlap", [True, False])
async def test_a_put_to_a_dead_server_fails_as_one_tier_error(overlap: bool) -> None:
    skip_without_redis()
    url = f"redis://127.0.0.1:{free_port()}/0"
    tier = RedisTier(url, FINGERPRINT, overlap_checksums=overlap)
    try:
        with pytest.raises(TierError):
            await tier.put([(k, block(i)) for i, k in enumerate(keys(*range(8)))])
        assert tier.stats().errors >= 1
    finally:
        await tier.aclose()


async def test_a_put_cancelled_by_a_deadline_leaves_the_tier_usable(server: RedisServer) -> None:
    """The tier set bounds a write with ``asyncio.timeout``; the chunks in flight must end
    with it, and the next put must work once the server answers again."""
    assert server.process is not None
    tier = RedisTier(server.url, FINGERPRINT, overlap_checksums=True)
    ks = keys(*range(8))
    try:
        await tier.put([(ks[0], block(0))])  # connected
        server.process.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await tier.put([(k, block(i, 1 << 20)) for i, k in enumerate(ks)])
        finally:
            server.process.send_signal(signal.SIGCONT)
        await tier.put([(k, block(i)) for i, k in enumerate(ks)])
        assert await tier.get(ks) == [block(i) for i in range(8)]
    finally:
        await tier.aclose()
