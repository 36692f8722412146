"""A server with a shared /dev/shm region describes it and removes it on shutdown."""

from __future__ import annotations

import os
import signal

import httpx

from tests.integration._server import running_server


def test_region_is_described_then_released_by_a_graceful_shutdown() -> None:
    name = f"api-test-{os.getpid()}"  # never collide with another test's region
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
