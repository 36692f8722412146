"""``kvcache-offload serve`` with secondary tiers, as separate processes on real servers.

Two services with separate CPU tiers share one Redis (standalone and cluster); a Redis killed
mid-traffic never turns into a 5xx and writes resume once it is back; a disk tier is found
again after a restart, and a file truncated by hand is a miss, never wrong bytes.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._redis import (
    redis_cluster,
    redis_server,
    redis_url_of,
    skip_without_redis,
    wait_until,
)
from tests.integration._server import BLOCK_BYTES, running_server

pytestmark = pytest.mark.timeout(240)


def hexkey(i: int) -> str:
    return (b"tier-test-%06d" % i).hex() + "00000000"


def block(i: int) -> bytes:
    return bytes((i * 131 + j) % 241 for j in range(BLOCK_BYTES))


def put(client: httpx.Client, url: str, ids: list[int]) -> httpx.Response:
    return client.put(
        f"{url}/v1/blocks",
        params=[("keys", hexkey(i)) for i in ids],
        content=b"".join(block(i) for i in ids),
    )


def lookup(client: httpx.Client, url: str, ids: list[int]) -> dict[str, Any]:
    response = client.post(f"{url}/v1/lookup", json={"keys": [hexkey(i) for i in ids]})
    assert response.status_code == 200, response.text
    return dict(response.json())


def tier(client: httpx.Client, url: str, name: str) -> dict[str, Any]:
    stats = client.get(f"{url}/v1/stats").json()
    return next(t for t in stats["tiers"] if t["name"] == name)


def tier_metric(client: httpx.Client, url: str, family: str, name: str) -> float:
    """The value of ``kvcache_offload_tier_<family>{tier="<name>"}`` on ``/metrics``."""
    found = re.search(
        rf'^kvcache_offload_tier_{family}\{{tier="{name}"\}} (\S+)$',
        client.get(f"{url}/metrics").text,
        re.MULTILINE,
    )
    assert found is not None, f"{family} of tier {name} not exported"
    return float(found.group(1))


@pytest.fixture(params=["standalone", "cluster"])
def redis_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with redis_url_of(request.param, tmp_path) as url:
        yield url


def test_two_services_share_blocks_through_one_redis(redis_url: str) -> None:
    args = ("--remote-url", redis_url, "--model-id", "shared-test")
    with (
        running_server(*args) as first,
        running_server(*args) as second,
        httpx.Client(timeout=10) as client,
    ):
        ids = list(range(8))
        assert put(client, first.url, ids).status_code == 200
        wait_until(
            lambda: lookup(client, second.url, ids)["hits"] == 8, what="blocks visible below"
        )
        answer = lookup(client, second.url, ids)
        assert answer["tiers"] == ["redis"] * 8
        for i in ids:
            got = client.get(f"{second.url}/v1/blocks/{hexkey(i)}")
            assert got.status_code == 200
            assert got.content == block(i)
        assert lookup(client, second.url, ids)["tiers"] == ["CPU"] * 8
        # Bytes written and read are counted per tier, payload only (as for the disk).
        total = 8 * BLOCK_BYTES
        wait_until(lambda: tier_metric(client, first.url, "put_bytes_total", "redis") == total)
        assert tier_metric(client, second.url, "get_bytes_total", "redis") == total
        assert tier_metric(client, second.url, "get_blocks_total", "redis") == 8
        assert tier_metric(client, second.url, "put_bytes_total", "redis") == 0


def test_redis_killed_mid_traffic_gives_no_5xx_and_writes_resume(tmp_path: Path) -> None:
    skip_without_redis()
    with redis_server(tmp_path) as redis, running_server("--remote-url", redis.url) as service:
        statuses: list[int] = []
        with httpx.Client(timeout=30) as client:
            next_id = 0
            for step in range(60):
                if step == 20:
                    redis.kill()
                ids = [next_id, next_id + 1]
                next_id += 2
                statuses.append(put(client, service.url, ids).status_code)
                # Older keys fell out of the 32-block CPU tier: the lookup asks Redis.
                answer = client.post(
                    f"{service.url}/v1/lookup", json={"keys": [hexkey(i) for i in range(next_id)]}
                )
                statuses.append(answer.status_code)
                got = client.get(f"{service.url}/v1/blocks/{hexkey(ids[0])}")
                statuses.append(got.status_code)
                assert got.content == block(ids[0])
            assert not [s for s in statuses if s >= 500], statuses
            assert tier(client, service.url, "redis")["errors"] > 0

            redis.start()  # same port, empty
            written_before = tier(client, service.url, "redis")["put_blocks"]

            def a_write_lands() -> bool:
                nonlocal next_id
                put(client, service.url, [next_id])
                next_id += 1
                return int(redis.cli("dbsize") or 0) > 0

            wait_until(a_write_lands, timeout=30, what="a write reaching the restarted Redis")
            assert tier(client, service.url, "redis")["put_blocks"] > written_before


@pytest.mark.timeout(120)
def test_a_cluster_node_killed_mid_traffic_gives_no_5xx_and_only_right_bytes(
    tmp_path: Path,
) -> None:
    """The node named in the URL dies: lookups, stores and reads go on from the CPU tier."""
    skip_without_redis()
    with (
        redis_cluster(tmp_path) as cluster,
        running_server("--remote-url", cluster.url) as service,
        # Every request has to answer within the read deadline plus a little; a hang fails.
        httpx.Client(timeout=5) as client,
    ):
        statuses: list[int] = []
        served = 0
        for step in range(40):
            if step == 10:
                cluster.nodes[0].kill()
            ids = [2 * step, 2 * step + 1]
            statuses.append(put(client, service.url, ids).status_code)
            answer = client.post(
                f"{service.url}/v1/lookup", json={"keys": [hexkey(i) for i in range(2 * step + 2)]}
            )
            statuses.append(answer.status_code)
            # The newest block is in the CPU tier; an old one fell out of its 32 blocks and
            # comes from a surviving node, or is a miss (409), never other bytes.
            for i in (ids[1], step % 20):
                got = client.get(f"{service.url}/v1/blocks/{hexkey(i)}")
                statuses.append(got.status_code)
                if got.status_code == 200:
                    assert got.content == block(i)
                    served += 1
        assert not [s for s in statuses if s >= 500], statuses
        assert served >= 40  # at least every newest block
        stats = tier(client, service.url, "redis")
        assert stats["errors"] > 0
        assert tier_metric(client, service.url, "errors_total", "redis") > 0


def test_disk_tier_survives_a_restart_and_a_truncated_file_is_a_miss(tmp_path: Path) -> None:
    disk = tmp_path / "blocks"
    args = ("--disk-path", str(disk), "--disk-bytes", "64MiB")
    ids = list(range(6))
    with running_server(*args) as service, httpx.Client(timeout=10) as client:
        assert put(client, service.url, ids).status_code == 200
        wait_until(lambda: tier(client, service.url, "disk")["put_blocks"] == 6)
        # uvicorn re-raises the caught SIGTERM after a clean shutdown, hence -SIGTERM.
        assert service.stop() in (0, -signal.SIGTERM)

    files = sorted(disk.rglob("*.kvb"))
    assert len(files) == 6
    victim = next(f for f in files if f.name.startswith(hexkey(3)))
    os.truncate(victim, victim.stat().st_size // 2)

    with running_server(*args) as service, httpx.Client(timeout=10) as client:
        answer = lookup(client, service.url, ids)
        assert answer["tiers"] == ["disk", "disk", "disk", None, "disk", "disk"]
        assert answer["hits"] == 3
        for i in (0, 1, 2, 4, 5):
            got = client.get(f"{service.url}/v1/blocks/{hexkey(i)}")
            assert got.status_code == 200
            assert got.content == block(i)  # the checksum was verified on the way up
        assert client.get(f"{service.url}/v1/blocks/{hexkey(3)}").status_code == 409
        metrics = client.get(f"{service.url}/metrics").text
        assert 'kvcache_offload_tier_get_blocks_total{tier="disk"} 5.0' in metrics
