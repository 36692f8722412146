"""A real SeaweedFS S3 gateway for tests (``bench/_seaweedfs.py``), on ports outside the
ephemeral range (``tests/_ports.py``), skipped only where the ``weed`` binary is missing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench._seaweedfs import MISSING, PORT_FLAGS, WEED, SeaweedServer
from tests._ports import free_port

__all__ = ["SeaweedServer", "seaweed_server"]


@contextmanager
def seaweed_server(tmp_path: Path) -> Iterator[SeaweedServer]:
    if WEED is None:
        pytest.skip(MISSING)
    server = SeaweedServer(tmp_path / "seaweedfs", {flag: free_port() for flag in PORT_FLAGS})
    server.start()
    try:
        yield server
    finally:
        server.stop()
