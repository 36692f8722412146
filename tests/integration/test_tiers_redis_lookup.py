"""RedisTier lookups on a real redis-server: one answer per key, by script or by pipeline.

A standalone server answers a lookup with one script call (one command for the whole batch);
a server that refuses scripts must still get a correct per-key answer, from the pipeline.
"""

from __future__ import annotations

from kvcache_offload.tiers import RedisTier
from tests._redis import RedisServer, standalone_redis
from tests.unit._keys import keys

FINGERPRINT = "l" * 16


server = standalone_redis


async def _lookup_every_other_key(tier: RedisTier) -> list[bool]:
    ks = keys(*range(10))
    await tier.put([(k, b"block-%d" % i) for i, k in enumerate(ks) if i % 2 == 0])
    return await tier.contains(ks)


async def test_a_lookup_is_one_script_call_answering_each_key(server: RedisServer) -> None:
    tier = RedisTier(server.url, FINGERPRINT)
    try:
        evals, exists = server.command_calls("eval"), server.command_calls("exists")
        assert await _lookup_every_other_key(tier) == [i % 2 == 0 for i in range(10)]
        assert server.command_calls("eval") - evals == 1
        assert server.command_calls("exists") - exists == 10
    finally:
        await tier.aclose()


async def test_a_server_refusing_scripts_is_asked_with_a_pipeline(server: RedisServer) -> None:
    assert server.cli("acl", "setuser", "default", "-@scripting") == "OK"
    tier = RedisTier(server.url, FINGERPRINT)
    try:
        assert await _lookup_every_other_key(tier) == [i % 2 == 0 for i in range(10)]
        exists = server.command_calls("exists")
        assert await tier.contains(keys(0, 1)) == [True, False]  # not asked by script again
        assert server.command_calls("exists") - exists == 2
        assert tier.stats().errors == 0
    finally:
        await tier.aclose()
