"""Start ``kvcache-offload serve`` in a subprocess on a free loopback port and wait for it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvcache_offload.dataplane.memory.region_files import run_files
from tests._ports import free_port
from tests._regions import region_name

ROOT = Path(__file__).resolve().parents[2]
BLOCK_BYTES = 4096
CAPACITY_BLOCKS = 32

SERVE = "import typer; from kvcache_offload_service.cli import serve; typer.run(serve)"


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM (graceful), then the exit code; kills it if it does not stop in time."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            out = process.stdout.read().decode() if process.stdout else ""
            raise RuntimeError(f"server exited with {process.returncode}:\n{out}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"server at {url} not ready after {timeout}s")


@contextmanager
def running_server(*args: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    port = free_port()
    full_env = {
        **os.environ,
        "KVCACHE_OFFLOAD_LAYOUT__BYTES_PER_BLOCK": str(BLOCK_BYTES),
        "KVCACHE_OFFLOAD_BACKEND": "cpu",
        # A shared region of this test session: the sidecar flow needs one.
        "KVCACHE_OFFLOAD_SHARED_REGION": "true",
        "KVCACHE_OFFLOAD_REGION_NAME": region_name("srv"),
        **(env or {}),
    }
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SERVE,
            "--port",
            str(port),
            "--cpu-bytes",
            str(CAPACITY_BLOCKS * BLOCK_BYTES),
            "--log-level",
            "warning",
            *args,
        ],
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    server = Server(url, process)
    try:
        wait_ready(url, process)
        yield server
    finally:
        if process.poll() is None:
            # On a timeout stop() kills it; the region's reaper then removes the file.
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.stop(timeout=10)
        _wait_gone(full_env["KVCACHE_OFFLOAD_REGION_NAME"])


def _wait_gone(region: str, timeout: float = 10.0) -> None:
    """A killed server's region file is removed by its reaper child, a moment later."""
    deadline = time.monotonic() + timeout
    while run_files("/dev/shm", region) and time.monotonic() < deadline:
        time.sleep(0.02)
