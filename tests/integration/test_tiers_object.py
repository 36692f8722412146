"""The object-store tier on a real S3 gateway (SeaweedFS), in-process and as services.

What users rely on: instances with one layout fingerprint read each other's blocks byte-exact
through the bucket, an instance with another fingerprint sees none of them, a damaged object is
a counted miss and never wrong bytes, and an S3 server that stops under load costs misses, not
5xx, with the tier back once the server is.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import obstore
import pytest

from kvcache_offload import KVCacheLayout, OffloadConfig
from kvcache_offload.aio import EngineEvent, OffloadEngine
from kvcache_offload.errors import OffloadError
from kvcache_offload.tiers import layout_fingerprint
from kvcache_offload.tiers.object_tier import object_block_path
from tests._redis import wait_until
from tests._seaweedfs import SeaweedServer, seaweed_server
from tests.integration._server import BLOCK_BYTES, running_server
from tests.unit._aio_fakes import wait_for
from tests.unit._keys import keys

pytestmark = pytest.mark.timeout(240)

BLOCK = 4096


def data(i: int) -> bytes:
    return bytes((i * 37 + j) % 251 for j in range(BLOCK))


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    with seaweed_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture
def prefix(seaweed: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """A prefix of its own for each test, and the S3 credentials in the environment."""
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    return f"t-{uuid.uuid4().hex[:12]}"


def config(seaweed: SeaweedServer, prefix: str, model_id: str = "test-model") -> OffloadConfig:
    return OffloadConfig(
        cpu_bytes_to_use=32 * BLOCK,
        layout=KVCacheLayout(bytes_per_block=BLOCK),
        backend="cpu",
        model_id=model_id,
        object_url=seaweed.url(prefix),
        object_endpoint=seaweed.endpoint,
    )


def object_stats(engine: OffloadEngine) -> Any:
    return next(t for t in engine.stats().tiers if t.name == "object")


async def written(engine: OffloadEngine, n: int) -> None:
    await wait_for(lambda: object_stats(engine).put_blocks >= n, 30.0)


async def test_two_instances_read_each_others_blocks_byte_exact(
    seaweed: SeaweedServer, prefix: str
) -> None:
    mine, theirs = keys(*range(10)), keys(*range(100, 110))
    async with (
        OffloadEngine(config(seaweed, prefix)) as first,
        OffloadEngine(config(seaweed, prefix)) as second,
    ):
        await first.write_blocks(mine, [data(i) for i in range(10)])
        await second.write_blocks(theirs, [data(i) for i in range(100, 110)])
        await written(first, 10)
        await written(second, 10)

        found = await second.lookup(mine)
        assert found.hits == 10
        assert found.tiers == ["object"] * 10
        for i, k in enumerate(mine):
            assert await second.read_block(k) == data(i)
        assert (await first.lookup(theirs)).tiers == ["object"] * 10
        for i, k in zip(range(100, 110), theirs, strict=True):
            assert await first.read_block(k) == data(i)
        assert object_stats(second).get_blocks == 10
        assert object_stats(second).get_bytes == 10 * BLOCK

    # A restart finds what the bucket holds by listing it: no request per key.
    async with OffloadEngine(config(seaweed, prefix)) as third:
        assert (await third.lookup(mine + theirs)).hits == 20
        assert object_stats(third).blocks == 20
        assert object_stats(third).op_seconds["contains"].count == 0
        assert await third.read_block(theirs[3]) == data(103)


async def test_another_fingerprint_sees_none_of_the_blocks(
    seaweed: SeaweedServer, prefix: str
) -> None:
    ks = keys(*range(6))
    async with OffloadEngine(config(seaweed, prefix)) as first:
        await first.write_blocks(ks, [data(i) for i in range(6)])
        await written(first, 6)
    async with OffloadEngine(config(seaweed, prefix, model_id="another-model")) as other:
        assert (await other.lookup(ks)).hits == 0
        assert object_stats(other).blocks == 0
        with pytest.raises(OffloadError):
            await other.read_block(ks[0])
        assert object_stats(other).get_blocks == 0


async def test_a_truncated_or_flipped_object_is_a_counted_miss_and_is_deleted(
    seaweed: SeaweedServer, prefix: str
) -> None:
    ks = keys(*range(3))
    cfg = config(seaweed, prefix)
    async with OffloadEngine(cfg) as first:
        await first.write_blocks(ks, [data(i) for i in range(3)])
        await written(first, 3)
    fingerprint = layout_fingerprint(
        model_id="test-model",
        kv_dtype=cfg.kv_dtype,
        block_nbytes=BLOCK,
        block_tokens=16,
        gpu_block_sizes=[16],
        world_size=1,
    )
    store = seaweed.store(prefix)
    paths = [object_block_path(fingerprint, k) for k in ks]
    whole = bytes(await (await obstore.get_async(store, paths[0])).bytes_async())
    await obstore.put_async(store, paths[0], whole[:-100])  # truncated
    flipped = bytearray(bytes(await (await obstore.get_async(store, paths[1])).bytes_async()))
    flipped[len(flipped) // 2] ^= 0x01
    await obstore.put_async(store, paths[1], bytes(flipped))

    async with OffloadEngine(cfg) as second:
        assert (await second.lookup(ks)).hits == 3  # listed: damage shows only when read
        for k in ks[:2]:
            with pytest.raises(OffloadError):
                await second.read_block(k)
        assert await second.read_block(ks[2]) == data(2)
        assert object_stats(second).corrupt_blocks == 2
        assert (await second.lookup(ks[:2])).hits == 0
    for path in paths[:2]:
        with pytest.raises(FileNotFoundError):
            await obstore.head_async(store, path)


async def test_events_name_the_object_tier_as_the_medium(
    seaweed: SeaweedServer, prefix: str
) -> None:
    async with OffloadEngine(config(seaweed, prefix)) as engine:
        seen: list[str] = []
        async with engine.subscribe(types=["stored"]) as events:
            await engine.write_blocks(keys(5), [data(5)])
            async for event in events:
                assert isinstance(event, EngineEvent)
                seen.append(event.medium)
                if event.medium == "object":
                    break
        assert seen == ["CPU", "object"]


# -- as services ---------------------------------------------------------------------------


def hexkey(i: int) -> str:
    return (b"object-test-%06d" % i).hex() + "00000000"


def block(i: int) -> bytes:
    return bytes((i * 131 + j) % 241 for j in range(BLOCK_BYTES))


def put(client: httpx.Client, url: str, ids: list[int]) -> httpx.Response:
    return client.put(
        f"{url}/v1/blocks",
        params=[("keys", hexkey(i)) for i in ids],
        content=b"".join(block(i) for i in ids),
    )


def tier(client: httpx.Client, url: str) -> dict[str, Any]:
    stats = client.get(f"{url}/v1/stats").json()
    return next(t for t in stats["tiers"] if t["name"] == "object")


def test_s3_stopped_under_load_gives_no_5xx_and_the_tier_comes_back(tmp_path: Path) -> None:
    with seaweed_server(tmp_path) as s3:
        args = ("--object-url", s3.url("chaos"), "--object-endpoint", s3.endpoint)
        env = s3.env()
        with running_server(*args, env=env) as service, httpx.Client(timeout=30) as client:
            statuses: list[int] = []
            next_id = 0
            for step in range(50):
                if step == 10:
                    wait_until(lambda: tier(client, service.url)["put_blocks"] >= 20)
                    s3.stop()
                ids = [next_id, next_id + 1]
                next_id += 2
                statuses.append(put(client, service.url, ids).status_code)
                # Older keys fell out of the 32-block CPU tier: the lookup asks the bucket.
                answer = client.post(
                    f"{service.url}/v1/lookup", json={"keys": [hexkey(i) for i in range(next_id)]}
                )
                statuses.append(answer.status_code)
                got = client.get(f"{service.url}/v1/blocks/{hexkey(ids[0])}")
                statuses.append(got.status_code)
                assert got.content == block(ids[0])
            assert not [s for s in statuses if s >= 500], statuses
            assert tier(client, service.url)["errors"] > 0

            s3.start()  # same ports, same data
            written_before = tier(client, service.url)["put_blocks"]

            def a_write_lands() -> bool:
                nonlocal next_id
                assert put(client, service.url, [next_id]).status_code == 200
                next_id += 1
                return int(tier(client, service.url)["put_blocks"]) > written_before

            wait_until(a_write_lands, timeout=60, what="a write reaching the restarted S3")
            # A block written before the stop, long gone from the CPU tier, is read back.
            got = client.get(f"{service.url}/v1/blocks/{hexkey(0)}")
            assert got.status_code == 200
            assert got.content == block(0)
