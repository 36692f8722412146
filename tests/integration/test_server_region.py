"""A server with a shared /dev/shm region describes it and removes it on shutdown."""

from __future__ import annotations

import mmap
import os
import signal

import httpx

from tests._regions import region_name
from tests.integration._server import running_server


def test_region_is_described_then_released_by_a_graceful_shutdown() -> None:
    name = region_name("api-test")  # never collide with another test's region
    env = {"KVCACHE_OFFLOAD_REGION_NAME": name}
    with running_server("--shared-region", "--log-level", "info", env=env) as srv:
        r = httpx.get(f"{srv.url}/v1/region", timeout=10)
        assert r.status_code == 200, r.text
        info = r.json()
        path = info["path"]
        assert name in path and os.path.exists(path)
        assert info["cpu_page_size"] > 0
        code = srv.stop()
        output = srv.process.stdout.read().decode() if srv.process.stdout else ""
    assert code in (0, -signal.SIGTERM), output
    assert not os.path.exists(path), f"{path} still exists after shutdown"


def test_a_sidecar_client_writes_blocks_through_the_region_described_by_the_server() -> None:
    """prepare -> write into the mapped file where /v1/region says -> complete -> bytes serve."""
    name = region_name("api-sidecar")
    env = {"KVCACHE_OFFLOAD_REGION_NAME": name}
    with (
        running_server("--shared-region", env=env) as srv,
        httpx.Client(base_url=srv.url, timeout=10) as client,
    ):
        info = client.get("/v1/region").json()
        key = (42).to_bytes(8, "big").hex() + "00000000"
        lease = client.post("/v1/store/prepare", json={"keys": [key]}).json()
        (slot,) = lease["block_ids"]
        row = info["row_stride"]
        payload = bytes(range(256)) * (row // 256) + bytes(row % 256)
        with open(info["path"], "r+b") as f, mmap.mmap(f.fileno(), info["total_size_bytes"]) as mm:
            start = info["data_offset"] + slot * row
            mm[start : start + row] = payload
        done = client.post(
            "/v1/store/complete",
            json={"lease_id": lease["lease_id"], "transfer_bytes": row, "transfer_seconds": 1e-3},
        )
        assert done.status_code == 200, done.text
        served = client.get(f"/v1/blocks/{key}")
        assert served.status_code == 200
        assert served.content == payload
        assert srv.stop() in (0, -signal.SIGTERM)
    assert not os.path.exists(info["path"]), "the region outlived a graceful shutdown"
