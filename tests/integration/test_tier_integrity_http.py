"""32 HTTP clients of a real service over the disk tier, and over a real Redis: mixed PUT, GET,
lookup and discard traffic (sessions ending while the next one stores into their slots) never
gets a block's bytes wrong. ``python -m bench.tier_integrity`` runs the same traffic longer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from bench.tier_integrity import drive, tier_drops
from tests._redis import redis_server, skip_without_redis
from tests.integration._server import running_server

SECONDS = 8.0


def check(url: str) -> None:
    counts = asyncio.run(drive(url, clients=32, seconds=SECONDS))
    drops = tier_drops(httpx.get(f"{url}/v1/stats", timeout=10).json())
    assert counts.wrong == 0, f"{counts.wrong} GETs returned another key's bytes {drops}"
    assert counts.errors == 0, counts.statuses
    assert counts.get_bytes > 0  # the check ran on real answers


def test_32_clients_over_the_disk_tier_never_get_wrong_bytes(tmp_path: Path) -> None:
    with running_server("--disk-path", str(tmp_path / "disk"), "--disk-bytes", "64MiB") as srv:
        check(srv.url)


def test_32_clients_over_redis_never_get_wrong_bytes(tmp_path: Path) -> None:
    skip_without_redis()
    with redis_server(tmp_path / "redis") as redis:
        url = f"redis://127.0.0.1:{redis.port}/0"
        with running_server("--remote-url", url) as srv:
            check(srv.url)
