"""Real ``redis-server`` processes for tests: standalone or a 3-node cluster on free loopback ports.

The server comes from the OS package (``.ci/run`` installs it). Each server gets its own
temporary directory, no persistence, and ``maxmemory`` with ``allkeys-lru`` as a deployment
would use. Readiness is awaited by polling ``PING`` / ``CLUSTER INFO``, never by sleeping.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests._ports import free_port

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")

_MISSING = "redis-server is not installed (.ci/run installs the Debian package)"
requires_redis = pytest.mark.skipif(REDIS_SERVER is None or REDIS_CLI is None, reason=_MISSING)


def skip_without_redis() -> None:
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip(_MISSING)


def _cli(port: int, *args: str, timeout: float = 5.0) -> str:
    assert REDIS_CLI is not None
    done = subprocess.run(
        [REDIS_CLI, "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return done.stdout.strip()


def wait_until(condition, timeout: float = 20.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise TimeoutError(f"{what} not reached after {timeout}s")


@dataclass
class RedisServer:
    """One ``redis-server`` process; :meth:`kill` and :meth:`start` again keep the port."""

    port: int
    workdir: Path
    extra: list[str] = field(default_factory=list)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS_SERVER is not None
        self.workdir.mkdir(parents=True, exist_ok=True)
        options = {
            "port": str(self.port),
            "bind": "127.0.0.1",
            "save": "",
            "appendonly": "no",
            "dir": str(self.workdir),
            "maxmemory": "512mb",
            "maxmemory-policy": "allkeys-lru",
        }
        args = [part for name, value in options.items() for part in (f"--{name}", value)]
        log = self.workdir / "redis.log"
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                [REDIS_SERVER, *args, *self.extra], stdout=out, stderr=subprocess.STDOUT
            )
        process = self.process

        def up() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"redis-server exited:\n{log.read_text()[-2000:]}")
            return _cli(self.port, "ping") == "PONG"

        wait_until(up, what=f"redis on {self.port}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def cli(self, *args: str) -> str:
        return _cli(self.port, *args)

    def command_calls(self, command: str) -> int:
        """Times the server ran ``command`` (``INFO commandstats``; script calls included)."""
        stats = self.cli("info", "commandstats")
        found = re.search(rf"^cmdstat_{command}:calls=(\d+)", stats, re.M)
        return int(found.group(1)) if found else 0


@pytest.fixture
def standalone_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server for one test (skips where the OS package is missing)."""
    skip_without_redis()
    with redis_server(tmp_path) as running:
        yield running


@contextmanager
def redis_server(tmp: Path) -> Iterator[RedisServer]:
    server = RedisServer(free_port(), tmp / "redis")
    server.start()
    try:
        yield server
    finally:
        server.kill()


@dataclass
class RedisCluster:
    nodes: list[RedisServer]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"


@contextmanager
def redis_cluster(tmp: Path, size: int = 3) -> Iterator[RedisCluster]:
    """``size`` masters, no replicas, all 16384 slots covered."""
    nodes = []
    try:
        for i in range(size):
            port = free_port()
            # The bus port defaults to port + 10000, which can be above 65535: pick one.
            node = RedisServer(
                port,
                tmp / f"cluster-{i}",
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    f"nodes-{port}.conf",
                    "--cluster-port",
                    str(free_port()),
                ],
            )
            nodes.append(node)
            node.start()
        addresses = [f"127.0.0.1:{n.port}" for n in nodes]
        assert REDIS_CLI is not None
        subprocess.run(
            [
                REDIS_CLI,
                "--cluster",
                "create",
                *addresses,
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            check=True,
            timeout=60,
        )
        for node in nodes:
            wait_until(
                lambda n=node: "cluster_state:ok" in n.cli("cluster", "info"),
                what=f"cluster node {node.port} ok",
            )
        yield RedisCluster(nodes)
    finally:
        for node in nodes:
            node.kill()


@contextmanager
def redis_url_of(kind: str, tmp: Path) -> Iterator[str]:
    """The URL of a fresh ``"standalone"`` server or ``"cluster"`` (3 masters) under ``tmp``."""
    skip_without_redis()
    if kind == "standalone":
        with redis_server(tmp) as server:
            yield server.url
    else:
        with redis_cluster(tmp) as cluster:
            yield cluster.url
