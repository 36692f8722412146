"""A server with a shared /dev/shm region describes it and removes it on shutdown."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time

import httpx

from tests._regions import region_name
from tests.integration._server import (
    BLOCK_BYTES,
    CAPACITY_BLOCKS,
    ROOT,
    SERVE,
    free_port,
    running_server,
)


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


def test_a_second_service_on_the_same_region_exits_2_and_leaves_the_first_intact() -> None:
    name = region_name("api-dup")
    env = {"KVCACHE_OFFLOAD_REGION_NAME": name}
    key = (7).to_bytes(8, "big").hex() + "00000000"
    with running_server(env=env) as first, httpx.Client(base_url=first.url, timeout=10) as c:
        block = bytes([7]) * BLOCK_BYTES
        assert c.put("/v1/blocks", params={"keys": [key]}, content=block).status_code == 200
        second = subprocess.run(
            [sys.executable, "-c", SERVE, "--port", str(free_port()), "--cpu-bytes",
             str(CAPACITY_BLOCKS * BLOCK_BYTES)],
            env={**os.environ, "KVCACHE_OFFLOAD_LAYOUT__BYTES_PER_BLOCK": str(BLOCK_BYTES),
                 "KVCACHE_OFFLOAD_SHARED_REGION": "true", **env},
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
        assert second.returncode == 2, second.stderr
        assert "already used by another service" in second.stderr
        assert "Traceback" not in second.stderr
        assert c.get("/v1/region").json()["sealed"] is False
        assert c.get(f"/v1/blocks/{key}").content == block


def test_a_late_sidecar_write_after_lease_expiry_never_reaches_another_keys_block() -> None:
    """--lease-ttl 1 and a writer that sleeps past it: its bytes land in a fenced slot."""
    with (
        running_server("--lease-ttl", "1") as srv,
        httpx.Client(base_url=srv.url, timeout=10) as client,
    ):
        info = client.get("/v1/region").json()
        late_key = (1).to_bytes(8, "big").hex() + "00000000"
        lease = client.post("/v1/store/prepare", json={"keys": [late_key]}).json()
        deadline = time.monotonic() + 10
        while client.get("/v1/stats").json()["leases_expired"].get("store", 0) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # Other keys fill every slot the service may hand out.
        others = [(100 + i).to_bytes(8, "big").hex() + "00000000" for i in range(CAPACITY_BLOCKS)]
        body = b"".join(bytes([i % 250 + 1]) * BLOCK_BYTES for i in range(len(others)))
        r = client.put("/v1/blocks", params={"keys": others}, content=body)
        assert r.status_code == 507  # one slot is fenced: the late writer may still write it
        stored = others[: CAPACITY_BLOCKS - 1]
        r = client.put(
            "/v1/blocks", params={"keys": stored}, content=body[: len(stored) * BLOCK_BYTES]
        )
        assert r.status_code == 200, r.text
        (slot,) = lease["block_ids"]
        row = info["row_stride"]
        with open(info["path"], "r+b") as f, mmap.mmap(f.fileno(), info["total_size_bytes"]) as mm:
            start = info["data_offset"] + slot * row
            mm[start : start + row] = b"\xee" * row  # the late write
        for i, k in enumerate(stored):
            assert client.get(f"/v1/blocks/{k}").content == bytes([i % 250 + 1]) * BLOCK_BYTES
        done = client.post("/v1/store/complete", json={"lease_id": lease["lease_id"]})
        assert done.status_code == 410


def test_a_stale_writer_reopening_the_old_runs_region_path_cannot_reach_the_new_run() -> None:
    """A sidecar client that kept ``/v1/region``'s path and slot numbers from before a service
    restart, and opens that path again to write, never lands in the new run's blocks."""
    name = region_name("api-rerun")
    env = {"KVCACHE_OFFLOAD_REGION_NAME": name}
    with running_server("--shared-region", env=env) as old_run:
        old = httpx.get(f"{old_run.url}/v1/region", timeout=10).json()
    key = (7).to_bytes(8, "big").hex() + "00000000"
    with (
        running_server("--shared-region", env=env) as new_run,
        httpx.Client(base_url=new_run.url, timeout=10) as client,
    ):
        new = client.get("/v1/region").json()
        block = bytes(range(256)) * (new["row_stride"] // 256) + bytes(new["row_stride"] % 256)
        stored = client.put(
            "/v1/blocks", params={"keys": key}, content=block,
            headers={"Content-Type": "application/octet-stream"},
        )  # fmt: skip
        assert stored.status_code == 200, stored.text
        try:  # the stale client: every slot of the old run, through the old path
            with (
                open(old["path"], "r+b") as f,
                mmap.mmap(f.fileno(), old["total_size_bytes"]) as mm,
            ):
                mm[old["data_offset"] :] = b"\xee" * (old["total_size_bytes"] - old["data_offset"])
        except FileNotFoundError:
            pass  # the old run's file is gone: nothing to write into
        assert client.get(f"/v1/blocks/{key}").content == block
        assert new["path"] != old["path"]
