"""OffloadEngine with secondary tiers on real components: a directory and real redis-server.

What users rely on: blocks stored by one instance are found and loaded byte-exact by another
sharing the tier; a load of a key held only below returns the right bytes, also when many loads
cross tiers at once; the prefix spans tiers; a dead tier is a miss, never an error.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcache_offload import KVCacheLayout, OffloadConfig
from kvcache_offload.aio import EngineEvent, KeyState, OffloadEngine
from kvcache_offload.contracts.offload_key import OffloadKey
from kvcache_offload.errors import BlockStateError, TierError
from kvcache_offload.tiers import RedisTier
from kvcache_offload.tiers.redis_tier import redis_block_names
from tests._redis import (
    RedisServer,
    redis_cluster,
    redis_server,
    redis_url_of,
    requires_redis,
    skip_without_redis,
)
from tests.unit._aio_fakes import wait_for
from tests.unit._keys import key, key_ids, keys

BLOCK = 4096


def data(i: int) -> bytes:
    return bytes((i * 31 + j) % 253 for j in range(BLOCK))


def config(cpu_blocks: int = 8, **tiers: Any) -> OffloadConfig:
    return OffloadConfig(
        cpu_bytes_to_use=cpu_blocks * BLOCK,
        layout=KVCacheLayout(bytes_per_block=BLOCK),
        backend="cpu",
        model_id="test-model",
        **tiers,
    )


def tier_stats(engine: OffloadEngine, name: str) -> Any:
    return next(t for t in engine.stats().tiers if t.name == name)


async def written(engine: OffloadEngine, name: str, n: int, timeout: float = 20.0) -> None:
    await wait_for(lambda: tier_stats(engine, name).put_blocks >= n, timeout)


@pytest.fixture
def standalone(tmp_path: Path) -> Iterator[RedisServer]:
    skip_without_redis()
    with redis_server(tmp_path) as server:
        yield server


@pytest.fixture(params=["standalone", "cluster"])
def redis_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with redis_url_of(request.param, tmp_path) as url:
        yield url


async def test_two_engines_share_blocks_through_redis(redis_url: str) -> None:
    ks = keys(*range(20))
    blocks = [data(i) for i in range(20)]
    async with (
        OffloadEngine(config(32, remote_url=redis_url)) as first,
        OffloadEngine(config(32, remote_url=redis_url)) as second,
    ):
        await first.write_blocks(ks, blocks)
        await written(first, "redis", 20)

        found = await second.lookup(ks)
        assert found.hits == 20
        assert found.tiers == ["redis"] * 20
        for k, expected in zip(ks, blocks, strict=True):
            assert await second.read_block(k) == expected
        # Now promoted: the second instance holds them in its own CPU tier.
        assert (await second.lookup(ks)).tiers == ["CPU"] * 20
        assert second.stats().tier_promoted_blocks == 20


async def test_another_model_id_never_sees_the_blocks(standalone: RedisServer) -> None:
    async with (
        OffloadEngine(config(remote_url=standalone.url)) as first,
        OffloadEngine(
            config(remote_url=standalone.url).model_copy(update={"model_id": "other"})
        ) as other,
    ):
        await first.write_blocks(keys(1), [data(1)])
        await written(first, "redis", 1)
        assert (await other.lookup(keys(1))).hits == 0


async def test_lookup_prefix_spans_tiers_and_names_each_keys_tier(tmp_path: Path) -> None:
    cfg = config(2, disk_path=tmp_path, disk_bytes="1MiB", eviction_policy="lru")
    async with OffloadEngine(cfg) as engine:
        await engine.write_blocks(keys(0), [data(0)])
        await engine.write_blocks(keys(1), [data(1)])
        await written(engine, "disk", 2)
        await engine.write_blocks(keys(3), [data(3)])  # evicts key 0 from the 2-block CPU tier
        await engine.touch(keys(1))
        result = await engine.lookup(keys(1, 0, 2, 3))
        assert result.states == [KeyState.READY, KeyState.READY, KeyState.ABSENT, KeyState.READY]
        assert result.tiers == ["CPU", "disk", None, "CPU"]
        assert result.hits == 2
        prefix = await engine.lookup(keys(1, 0, 2, 3), prefix_only=True)
        assert prefix.tiers == ["CPU", "disk", None]


async def test_events_name_the_tier_a_block_went_to(tmp_path: Path) -> None:
    async with OffloadEngine(config(4, disk_path=tmp_path)) as engine:
        seen: list[tuple[str, list[OffloadKey]]] = []
        async with engine.subscribe(types=["stored"]) as events:
            await engine.write_blocks(keys(5), [data(5)])
            async with asyncio.timeout(10):
                async for event in events:
                    assert isinstance(event, EngineEvent)
                    seen.append((event.medium, event.keys))
                    if event.medium == "disk":
                        break
        assert seen == [("CPU", keys(5)), ("disk", keys(5))]


@pytest.mark.parametrize("mode", ["through", "back"])
async def test_blocks_evicted_before_the_writer_reached_them_still_go_below(
    tmp_path: Path, mode: str
) -> None:
    # LRU: the eviction order the comments below walk through
    cfg = config(2, disk_path=tmp_path, disk_bytes="1MiB", tier_write=mode, eviction_policy="lru")
    async with OffloadEngine(cfg) as engine:
        for i in range(8):  # a 2-block CPU tier: each store evicts while writes are queued
            await engine.write_blocks(keys(i), [data(i)])
        await written(engine, "disk", 8 if mode == "through" else 6)
        # Keys 6 and 7 are still in the CPU tier; reading 0-5 promotes them and evicts 6 and
        # 7, which (write-back) go below only then: until that write lands they are parked,
        # and a read in between finds them there.
        for i in (0, 1, 2, 3, 4, 5, 6, 7):
            assert await engine.read_block(key(i)) == data(i), i
        await written(engine, "disk", 8)
        for i in (6, 7):
            assert await engine.read_block(key(i)) == data(i), i


async def test_an_evicted_block_is_found_while_its_write_below_is_still_queued(
    tmp_path: Path,
) -> None:
    """Write-back with a writer that lags: the evicted block is held nowhere below yet, and a
    lookup and a read in that window still find it (and its bytes), never a miss."""
    cfg = config(2, disk_path=tmp_path, disk_bytes="1MiB", tier_write="back")
    async with OffloadEngine(cfg) as engine:
        await engine.lookup(keys(99))  # opens the tiers
        disk = engine._tiers.tier_set.tiers[0]  # type: ignore[union-attr]
        gate = asyncio.Event()
        put = disk.put

        async def slow_put(items: Any) -> None:
            await gate.wait()
            await put(items)

        disk.put = slow_put  # type: ignore[method-assign]
        await engine.write_blocks(keys(0, 1), [data(0), data(1)])
        await engine.write_blocks(keys(2), [data(2)])  # evicts key 0: its write waits
        await engine.write_blocks(keys(3), [data(3)])  # evicts key 1
        assert tier_stats(engine, "disk").put_blocks == 0
        found = await engine.lookup(keys(0, 1))
        assert found.hits == 2 and found.tiers == ["disk", "disk"]
        assert await engine.read_block(key(0)) == data(0)  # promoted from the parked bytes
        gate.set()
        await written(engine, "disk", 2)
        assert await engine.read_block(key(1)) == data(1)


async def test_write_back_writes_only_what_the_cpu_tier_evicts(tmp_path: Path) -> None:
    cfg = config(2, disk_path=tmp_path, disk_bytes="1MiB", tier_write="back")
    async with OffloadEngine(cfg) as engine:
        await engine.write_blocks(keys(0, 1), [data(0), data(1)])
        await engine.write_blocks(keys(2), [data(2)])  # evicts key 0
        await written(engine, "disk", 1)
        assert tier_stats(engine, "disk").put_blocks == 1
        assert await engine.read_block(key(0)) == data(0)


async def test_concurrent_loads_crossing_tiers_return_the_right_bytes(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from tests.integration.test_aio_engine_cpu_backend import build_engine, gpu_block

    engine, tensors = build_engine(
        num_cpu_blocks=6, config={"disk_path": tmp_path, "disk_bytes": "64MiB"}
    )
    async with engine:
        expected = {i: gpu_block(tensors, i) for i in range(16)}
        for i in range(16):
            await engine.store(keys(i), [i])
        await written(engine, "disk", 16)
        for t in tensors:
            t[16:].zero_()

        async def load(i: int, round_: int) -> None:
            target = 16 + (i + round_) % 16
            await engine.load(keys(i), [target])
            got = b"".join(t[target].numpy().tobytes() for t in tensors)
            assert got == expected[i], f"key {i} round {round_}"

        for round_ in range(4):
            order = list(range(16))
            async with asyncio.timeout(60):
                # 4 at a time: each pins a CPU slot while a promotion needs a free one.
                for start in range(0, 16, 4):
                    await asyncio.gather(*(load(i, round_) for i in order[start : start + 4]))
        assert engine.stats().tier_promoted_blocks > 0


async def test_a_key_in_no_tier_still_fails_a_load_as_not_ready(tmp_path: Path) -> None:
    async with OffloadEngine(config(2, disk_path=tmp_path)) as engine:
        with pytest.raises(BlockStateError):
            await engine.read_block(key(42))


async def test_a_dead_redis_is_a_miss_and_an_error_count(tmp_path: Path) -> None:
    from tests._redis import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    async with OffloadEngine(config(4, remote_url=url)) as engine:
        await engine.write_blocks(keys(1), [data(1)])
        result = await engine.lookup(keys(1, 2))
        assert result.hits == 1
        assert result.tiers == ["CPU", None]
        await wait_for(lambda: tier_stats(engine, "redis").errors >= 1, 10)
        assert not tier_stats(engine, "redis").available


@requires_redis
async def test_a_corrupt_redis_value_is_a_miss_and_is_deleted(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        tier = RedisTier(server.url, "f" * 16)
        k: OffloadKey = key(7)
        try:
            await tier.put([(k, data(7))])
            assert await tier.get([k]) == [data(7)]
            name, header = (n.decode() for n in redis_block_names("f" * 16, k))
            assert server.cli("set", name, "garbage") == "OK"
            assert await tier.get([k]) == [None]
            assert server.cli("exists", name, header) == "0"
            assert tier.stats().corrupt_blocks == 1
        finally:
            await tier.aclose()


async def test_a_64_key_lookup_all_in_redis_is_one_round_trip(
    standalone: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from redis.asyncio.connection import AbstractConnection

    sends: list[int] = []
    send = AbstractConnection.send_packed_command

    async def counted(self: Any, command: Any, check_health: bool = True) -> None:
        sends.append(1)
        await send(self, command, check_health)

    ks = keys(*range(64))
    async with (
        OffloadEngine(config(64, remote_url=standalone.url)) as first,
        OffloadEngine(config(64, remote_url=standalone.url)) as second,
    ):
        await first.write_blocks(ks, [data(i) for i in range(64)])
        await written(first, "redis", 64)
        await second.lookup(ks[:1])  # connects: the handshake is not the lookup's
        before = standalone.command_calls("exists")
        monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)
        result = await second.lookup(ks)
        monkeypatch.undo()
        assert result.hits == 64
        assert result.tiers == ["redis"] * 64
        assert len(sends) == 1  # one write (one script call for the 64 keys), then its reply
        assert standalone.command_calls("exists") - before == 64


async def test_a_cluster_tier_outlives_the_node_named_in_its_url(tmp_path: Path) -> None:
    """Blocks on the other nodes are still served while the seed node is gone, and all of
    them again once it is back."""
    skip_without_redis()
    with redis_cluster(tmp_path) as cluster:
        tier = RedisTier(cluster.url, "c" * 16)
        ks = keys(*range(24))
        try:
            await tier.put([(k, data(i)) for i, k in enumerate(ks)])
            seed = cluster.nodes[0]
            names = [redis_block_names("c" * 16, k)[0].decode() for k in ks]
            on_seed = [seed.cli("exists", name) == "1" for name in names]
            assert 0 < sum(on_seed) < len(ks)
            seed.kill()
            with pytest.raises(TierError):  # a batch with keys on the dead node fails whole,
                await tier.get(ks)  # and the client is dropped, slot map and all
            elsewhere = [k for k, seeded in zip(ks, on_seed, strict=True) if not seeded]
            got = await tier.get(elsewhere)
            expected = [data(i) for i, seeded in enumerate(on_seed) if not seeded]
            assert got == expected

            seed.start()  # same port and node id, no data: it rejoins its slots, empty
            async with asyncio.timeout(30):
                while True:
                    with contextlib.suppress(TierError):
                        got = await tier.get(ks)
                        break
                    await asyncio.sleep(0.05)
            assert got == [None if seeded else data(i) for i, seeded in enumerate(on_seed)]
            await tier.put([(k, data(i)) for i, k in enumerate(ks)])
            assert await tier.get(ks) == [data(i) for i in range(len(ks))]
        finally:
            await tier.aclose()


async def test_blocks_chosen_ahead_stay_in_the_cpu_tier_until_taken_then_go_below(
    tmp_path: Path,
) -> None:
    """A lone store chooses the next store's victims once its copy is on its way (a 5 MiB
    store goes to the CPU backend's copy thread, so it is in flight alone): they stay in the
    CPU tier, loadable, until a store takes their slots; then (write-back) they go below and
    load back byte-exact."""
    torch = pytest.importorskip("torch")
    from kvcache_offload.dataplane import layouts

    gen = torch.Generator().manual_seed(5)
    # One layer, 8 GPU blocks of 1.25 MiB: four of them are one store above the CPU
    # backend's 4 MiB limit for copying a lone job inline.
    tensors = [torch.randint(-128, 127, (8, 2, 16, 5, 8192), dtype=torch.int8, generator=gen)]
    kv = layouts.blocks_first_per_layer(tensors)
    page = layouts.block_nbytes(kv)
    cfg = OffloadConfig(
        cpu_bytes_to_use=8 * page,
        layout=KVCacheLayout(gpu_block_sizes=[16], bytes_per_block=page, num_gpu_blocks=8),
        backend="cpu",
        model_id="test-model",
        disk_path=tmp_path,
        disk_bytes="64MiB",
        tier_write="back",
        eviction_policy="lru",
        transfer={"evict_ahead_fraction": 0.5},  # up to 4 of the 8 blocks chosen ahead
    )

    def gpu_block(b: int) -> bytes:
        return tensors[0][b].numpy().tobytes()

    expected = {i: gpu_block(i) for i in range(8)}
    async with OffloadEngine(cfg, kv_caches=kv) as engine:
        await engine.store(keys(0, 1, 2, 3), [0, 1, 2, 3])
        await engine.store(keys(4, 5, 6, 7), [4, 5, 6, 7])
        # The second store filled the tier and, its copy in flight, had the first store's
        # blocks chosen for the next one: still in the CPU tier, nothing written below.
        assert engine.manager.stats().chosen_ahead == 4  # type: ignore[attr-defined]
        found = await engine.lookup(keys(0, 1, 2, 3))
        assert found.hits == 4 and found.tiers == ["CPU"] * 4
        assert tier_stats(engine, "disk").put_blocks == 0

        third = await engine.store(keys(8, 9, 10, 11), [0, 1, 2, 3])
        assert key_ids(third.evicted_keys) == [0, 1, 2, 3]
        stats = engine.stats()
        assert (stats.evicted_blocks, stats.evicted_ahead_blocks) == (4, 4)
        await written(engine, "disk", 4)
        found = await engine.lookup(keys(0, 1, 2, 3))
        assert found.hits == 4 and found.tiers == ["disk"] * 4
        await engine.load(keys(2, 3), [6, 7])
        assert gpu_block(6) == expected[2]
        assert gpu_block(7) == expected[3]
