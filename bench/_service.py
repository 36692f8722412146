"""The installed ``kvcache-offload serve`` as a subprocess, for benchmarks that drive it over HTTP.

It runs this checkout's sources (``PYTHONPATH`` points at the repository root, and at a link
``kvcache_offload_service`` -> its ``api/``, so an editable install of another checkout stands
in for neither the library nor the service) with the defaults a user gets, plus whatever flags
or ``KVCACHE_OFFLOAD_*`` variables the benchmark names.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

__all__ = ["ROOT", "free_port", "running_service", "wait_listening"]

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")


def service_env(
    extra: Mapping[str, str] | None = None, source: Path = ROOT, service_link: Path | None = None
) -> dict[str, str]:
    """The environment of a served process; ``service_link``: a folder holding the link
    ``kvcache_offload_service`` -> ``source/api`` (``running_service`` makes one)."""
    first = [str(service_link)] if service_link is not None else []
    path = os.pathsep.join(p for p in (*first, str(source), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **(extra or {})}


@contextmanager
def running_service(
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    source: Path = ROOT,
    prefix: Sequence[str] = (),
) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """``kvcache-offload serve --port PORT *args`` until the block ends (then SIGTERM).

    ``source``: the checkout whose sources it runs (another one to compare against);
    ``prefix``: a command to run it under, e.g. ``taskset -c 0,1``.
    """
    port = free_port()
    command = str(Path(sys.executable).parent / "kvcache-offload")
    links = tempfile.TemporaryDirectory(prefix="kvcache-offload-bench-")
    (Path(links.name) / "kvcache_offload_service").symlink_to(Path(source).resolve() / "api")
    proc = subprocess.Popen(
        [*prefix, command, "serve", "--port", str(port), *args],
        env=service_env(env, source, Path(links.name)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_listening(port)
        yield port, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        links.cleanup()
