"""An HTTP client wired to an app over a small real engine (ASGI, no sockets)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from fastapi import FastAPI

from kvcache_offload.aio import OffloadEngine
from kvcache_offload.config import OffloadConfig, load_config
from kvcache_offload_service import create_app
from tests._regions import region_name

BLOCK_BYTES = 4096
CAPACITY_BLOCKS = 16


def small_config(**overrides: Any) -> OffloadConfig:
    """A tiny CPU tier in a shared region of this test session (the sidecar flow needs one)."""
    values: dict[str, Any] = {
        "cpu_bytes_to_use": CAPACITY_BLOCKS * BLOCK_BYTES,
        "layout": {"bytes_per_block": BLOCK_BYTES},
        "backend": "cpu",
        "shared_region": True,
        "region_name": region_name("unit"),
    }
    values.update(overrides)
    return load_config(**values)


def hex_key(i: int, group: int = 0) -> str:
    return (i.to_bytes(8, "big") + group.to_bytes(4, "big")).hex()


@dataclass
class Served:
    app: FastAPI
    engine: OffloadEngine
    client: httpx.AsyncClient


@asynccontextmanager
async def served(
    config: OffloadConfig | None = None, headers: dict[str, str] | None = None
) -> AsyncIterator[Served]:
    engine = OffloadEngine(config or small_config())
    async with engine:
        app = create_app(engine)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://test", headers=headers
        ) as client:
            yield Served(app, engine, client)


async def wait_for(predicate: Any, timeout: float = 5.0) -> None:
    """Wait until ``predicate()`` is true (checked every few ms), failing after ``timeout``."""
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.005)


async def store(client: httpx.AsyncClient, keys: list[str]) -> dict[str, Any]:
    prepared = await client.post("/v1/store/prepare", json={"keys": keys})
    assert prepared.status_code == 200, prepared.text
    done = await client.post("/v1/store/complete", json={"lease_id": prepared.json()["lease_id"]})
    assert done.status_code == 200, done.text
    return dict(prepared.json())
