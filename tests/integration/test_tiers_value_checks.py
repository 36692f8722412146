"""A value below the CPU tier that fails any check, its length included, is a miss, is deleted
and is counted (``corrupt_blocks``), on the disk tier and on a real Redis alike: a read never
answers an error for it, nor the value's bytes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcache_offload import KVCacheLayout, OffloadConfig
from kvcache_offload.aio import OffloadEngine
from kvcache_offload.errors import BlockStateError
from tests._redis import redis_server, skip_without_redis
from tests.unit._keys import key

BLOCK = 4096


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    skip_without_redis()
    with redis_server(tmp_path / "redis") as server:
        yield f"redis://127.0.0.1:{server.port}/0"


def engine_for(tier: str, tmp_path: Path, redis: str | None) -> OffloadEngine:
    tiers: dict[str, Any] = (
        {"disk_path": str(tmp_path / "disk")} if tier == "disk" else {"remote_url": redis}
    )
    return OffloadEngine(
        OffloadConfig(
            cpu_bytes_to_use=8 * BLOCK,
            layout=KVCacheLayout(bytes_per_block=BLOCK),
            backend="cpu",
            model_id="value-checks",
            **tiers,
        )
    )


@pytest.mark.parametrize("tier", ["disk", "redis"])
async def test_a_value_of_the_wrong_length_is_a_counted_deleted_miss(
    tier: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    redis = request.getfixturevalue("redis_url") if tier == "redis" else None
    engine = engine_for(tier, tmp_path, redis)
    async with engine:
        assert engine._tiers is not None
        below = engine._tiers.tier_set.tiers[0]
        k = key(7)
        await below.put([(k, b"\x01" * 100)])  # a valid frame of the wrong length
        assert await below.contains([k]) == [True]
        with pytest.raises(BlockStateError):
            await engine.read_block(k)
        assert await below.contains([k]) == [False]
        stats = next(t for t in engine.stats().tiers if t.name == below.name)
        assert stats.corrupt_blocks == 1
        # A good block next to it still loads.
        await below.put([(key(8), b"\x02" * BLOCK)])
        assert await engine.read_block(key(8)) == b"\x02" * BLOCK
