"""RedisTier's value format on a real redis-server: two keys per block, one slot, one MSET.

Format 2 keeps a block's bytes and its frame header in two string keys written by one ``MSET``
(the server keeps the received value, where a hash field made it copy every 2 MiB). What must
hold: a reader never takes half a block, a lone half is a miss and is removed, format-1 values
(hashes under ``kvo:<fingerprint>:``) are never read, and a put still fails as one TierError.
A standalone put streams its ``MSET`` commands down one connection, each header sent after its
block's bytes: a put cut off halfway must write nothing of the block it was sending and leave
the tier usable, and a refused command must not leave unread replies on the connection.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from redis.crc import key_slot

from kvcache_offload.errors import TierError
from kvcache_offload.tiers import RedisTier, frame
from kvcache_offload.tiers.redis_tier import redis_block_names
from tests._redis import RedisServer, free_port, skip_without_redis, standalone_redis
from tests.unit._keys import key, keys

FINGERPRINT = "m" * 16


def block(i: int, size: int = 4096) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(size))


server = standalone_redis


def connections_received(server: RedisServer) -> int:
    stats = server.cli("info", "stats")
    return int(stats.split("total_connections_received:")[1].split()[0])


def test_put_hashes_on_a_thread_only_where_a_core_is_spare(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From four usable CPUs (the disk tier's check-thread rule); the option overrides it."""
    url = "redis://127.0.0.1:1/0"  # never connected
    for cpus, default in (({0, 1}, False), (set(range(16)), True)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, c=cpus: c, raising=False)
        assert RedisTier(url, FINGERPRINT).hash_thread is default
        assert RedisTier(url, FINGERPRINT, hash_thread=not default).hash_thread is not default


@pytest.mark.parametrize("hash_thread", [True, False])
async def test_each_block_is_one_mset_of_two_keys_in_one_slot_on_one_connection(
    server: RedisServer, hash_thread: bool
) -> None:
    tier = RedisTier(server.url, FINGERPRINT, hash_thread=hash_thread)
    ks = keys(*range(13))
    try:
        await tier.put([(ks[0], block(0))])  # connected
        connections = connections_received(server)
        await tier.put([(k, block(i)) for i, k in enumerate(ks)])
        assert connections_received(server) == connections + 1  # this redis-cli's, no other
        assert server.command_calls("mset") == 14
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


@pytest.mark.parametrize("hash_thread", [True, False])
async def test_a_put_to_a_dead_server_fails_as_one_tier_error(hash_thread: bool) -> None:
    skip_without_redis()
    url = f"redis://127.0.0.1:{free_port()}/0"
    tier = RedisTier(url, FINGERPRINT, hash_thread=hash_thread)
    try:
        with pytest.raises(TierError):
            await tier.put([(k, block(i)) for i, k in enumerate(keys(*range(8)))])
        assert tier.stats().errors >= 1
    finally:
        await tier.aclose()


@pytest.mark.parametrize("hash_thread", [True, False])
async def test_a_put_cancelled_by_a_deadline_writes_no_half_block_and_leaves_the_tier_usable(
    server: RedisServer, hash_thread: bool
) -> None:
    """The tier set bounds a write with ``asyncio.timeout``. Cut off with a command half sent,
    the put must drop its connection (the server discards the partial command), not hand it
    back to the pool, and the next put must work once the server answers again."""
    assert server.process is not None
    tier = RedisTier(server.url, FINGERPRINT, hash_thread=hash_thread)
    ks = keys(*range(8))
    big = [(k, bytes([i]) * (4 << 20)) for i, k in enumerate(ks)]  # more than the socket holds
    try:
        await tier.put([(ks[0], block(0))])  # connected
        server.process.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await tier.put(big)
        finally:
            server.process.send_signal(signal.SIGCONT)
        for k in ks[1:]:  # whatever the server had taken of them is no block
            names = [n.decode() for n in redis_block_names(FINGERPRINT, k)]
            assert server.cli("exists", *names) in ("0", "2")
        await tier.put([(k, block(i)) for i, k in enumerate(ks)])
        assert await tier.get(ks) == [block(i) for i in range(8)]
    finally:
        await tier.aclose()


async def test_a_refused_put_is_one_tier_error_and_the_connection_stays_in_step(
    server: RedisServer,
) -> None:
    """Every reply of a streamed put is read even after an error reply (here OOM), so the next
    command on the pooled connection gets its own reply, not a stale one."""
    tier = RedisTier(server.url, FINGERPRINT)
    ks = keys(*range(4))
    try:
        await tier.put([(ks[0], block(0))])  # connected
        server.cli("config", "set", "maxmemory-policy", "noeviction")
        server.cli("config", "set", "maxmemory", "1")
        try:
            with pytest.raises(TierError, match=r"OutOfMemory|OOM"):
                await tier.put([(k, block(i)) for i, k in enumerate(ks)])
        finally:
            server.cli("config", "set", "maxmemory", "512mb")
        assert await tier.get(ks[:1]) == [block(0)]
        assert await tier.contains(ks) == [True, False, False, False]
        await tier.put([(k, block(i)) for i, k in enumerate(ks)])
        assert await tier.get(ks) == [block(i) for i in range(4)]
        assert tier.stats().errors == 1
    finally:
        await tier.aclose()
