"""The object tier on ``file://``: no server needed, the same code path as S3, GCS and Azure.

What users rely on: blocks come back byte-exact, a restart finds what the store holds, another
fingerprint never sees them, a damaged object is a counted miss and is removed, the byte budget
deletes the oldest objects, the index follows deletions made elsewhere, and a bad URL is a
ConfigError at start.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvcache_offload import KVCacheLayout, OffloadConfig, load_config
from kvcache_offload.aio import OffloadEngine
from kvcache_offload.errors import ConfigError
from kvcache_offload.tiers.object_tier import ObjectTier, object_block_path
from tests.unit._aio_fakes import wait_for
from tests.unit._keys import keys

BLOCK = 4096
FP = "a" * 16


def data(i: int) -> bytes:
    return bytes((i * 29 + j) % 247 for j in range(BLOCK))


def url(path: Path) -> str:
    return f"file://{path}"


async def opened(path: Path, fingerprint: str = FP, **kwargs: object) -> ObjectTier:
    tier = ObjectTier(url(path), fingerprint, **kwargs)  # type: ignore[arg-type]
    await tier.open()
    return tier


async def test_blocks_come_back_byte_exact_and_survive_a_restart(tmp_path: Path) -> None:
    ks = keys(*range(5))
    tier = await opened(tmp_path)
    await tier.put([(k, data(i)) for i, k in enumerate(ks)])
    assert await tier.get(ks) == [data(i) for i in range(5)]
    await tier.aclose()

    again = await opened(tmp_path)
    assert again.stats().blocks == 5
    assert await again.contains(ks + keys(9)) == [True] * 5 + [False]
    assert await again.get(ks[2:3]) == [data(2)]
    await again.aclose()


async def test_another_fingerprint_sees_nothing(tmp_path: Path) -> None:
    tier = await opened(tmp_path)
    await tier.put([(keys(1)[0], data(1))])
    other = await opened(tmp_path, "b" * 16)
    assert await other.contains(keys(1)) == [False]
    assert await other.get(keys(1)) == [None]
    assert other.stats().blocks == 0


@pytest.mark.parametrize("damage", ["truncate", "flip", "other_key"])
async def test_a_damaged_object_is_a_counted_miss_and_is_removed(
    tmp_path: Path, damage: str
) -> None:
    k, k2 = keys(3, 4)
    tier = await opened(tmp_path)
    await tier.put([(k, data(3)), (k2, data(4))])
    path = tmp_path / object_block_path(FP, k)
    body = bytearray(path.read_bytes())
    if damage == "truncate":
        body = body[:-1]
    elif damage == "flip":
        body[-7] ^= 0x10
    else:  # a whole, valid frame of another key under this key's name
        body = bytearray((tmp_path / object_block_path(FP, k2)).read_bytes())
    path.write_bytes(bytes(body))
    assert await tier.get([k, k2]) == [None, data(4)]
    assert tier.stats().corrupt_blocks == 1
    assert not path.exists()
    assert await tier.contains([k]) == [False]


async def test_the_byte_budget_deletes_the_oldest_objects(tmp_path: Path) -> None:
    ks = keys(*range(6))
    frame_bytes = BLOCK + 22 + len(ks[0])
    tier = await opened(tmp_path, capacity_bytes=3 * frame_bytes)
    for i, k in enumerate(ks[:3]):
        await tier.put([(k, data(i))])
    await tier.get(ks[:1])  # read: now the newest
    await tier.put([(ks[3], data(3)), (ks[4], data(4))])
    assert tier.take_evicted() == [ks[1], ks[2]]
    assert await tier.contains(ks[:5]) == [True, False, False, True, True]
    assert not (tmp_path / object_block_path(FP, ks[1])).exists()
    assert tier.stats().bytes == 3 * frame_bytes
    assert tier.stats().evicted_blocks == 2


async def test_a_key_written_after_the_listing_is_found_by_one_check(tmp_path: Path) -> None:
    cached = await opened(tmp_path)
    uncached = await opened(tmp_path, absent_ttl_s=0.0)
    writer = await opened(tmp_path)
    k = keys(8)
    assert await cached.contains(k) == [False]
    assert await uncached.contains(k) == [False]
    await writer.put([(k[0], data(8))])
    # Found absent a moment ago: not asked again while that answer is fresh.
    assert await cached.contains(k) == [False]
    assert cached.stats().op_seconds["contains"].count == 1
    assert await uncached.contains(k) == [True]
    assert await uncached.contains(k) == [True]  # now in the index: no second check
    assert uncached.stats().op_seconds["contains"].count == 2
    assert await uncached.get(k) == [data(8)]


async def test_the_refreshed_listing_drops_objects_deleted_elsewhere(tmp_path: Path) -> None:
    ks = keys(1, 2)
    watcher = await opened(tmp_path, refresh_s=0.01)
    other = await opened(tmp_path)
    await watcher.put([(k, data(i)) for i, k in enumerate(ks)])
    await other.open()
    await other.delete(ks[:1])  # another instance, or a lifecycle rule

    answers: list[list[bool]] = []

    async def ask() -> None:
        answers.append(await watcher.contains(ks))

    async with asyncio.timeout(10):
        while not answers or answers[-1] != [False, True]:
            await ask()
            await asyncio.sleep(0.01)
    await watcher.aclose()


def test_a_bad_url_or_setting_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="object_url"):
        ObjectTier("ftp://host/x", FP)
    with pytest.raises(ConfigError, match="object_url"):
        ObjectTier("no-scheme", FP)
    with pytest.raises(ConfigError, match="object_endpoint"):
        ObjectTier(url(tmp_path), FP, endpoint="http://127.0.0.1:9000")
    with pytest.raises(ConfigError, match="object_bytes"):
        load_config(object_url=url(tmp_path), object_bytes=0)
    with pytest.raises(ConfigError, match="object_concurrency"):
        load_config(object_url=url(tmp_path), object_concurrency=0)


def test_every_object_setting_has_a_description() -> None:
    fields = OffloadConfig.model_fields
    for name in (n for n in fields if n.startswith("object_")):
        assert fields[name].description, name


async def test_an_engine_restores_from_file_after_the_cpu_tier_evicted(tmp_path: Path) -> None:
    cfg = OffloadConfig(
        cpu_bytes_to_use=2 * BLOCK,
        layout=KVCacheLayout(bytes_per_block=BLOCK),
        backend="cpu",
        eviction_policy="lru",
        disk_path=tmp_path / "disk",
        disk_bytes=BLOCK + 100,
        object_url=url(tmp_path / "objects"),
    )
    ks = keys(*range(4))
    async with OffloadEngine(cfg) as engine:
        assert engine.stats().tiers[-1].name == "object"
        assert [t.name for t in engine.stats().tiers] == ["disk", "object"]
        for i, k in enumerate(ks):
            await engine.write_blocks([k], [data(i)])
        await wait_for(lambda: engine.stats().tiers[1].put_blocks >= 4, 10.0)
        found = await engine.lookup(ks)
        assert found.hits == 4
        assert found.tiers[0] == "object"  # gone from the CPU tier and from the 1-block disk
        assert await engine.read_block(ks[0]) == data(0)
