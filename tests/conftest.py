"""Shared fixtures and helpers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests._regions import SESSION_TAG

settings.register_profile("ci", max_examples=60, deadline=None)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile("ci")


SHM_DIR = Path("/dev/shm")


def _region_files() -> set[str]:
    """This session's region files only: other processes on the host may use the prefix."""
    if not SHM_DIR.is_dir():
        return set()
    return {p.name for p in SHM_DIR.glob(f"kvcache_offload_*{SESSION_TAG}*")}


@pytest.fixture(scope="session", autouse=True)
def no_region_file_outlives_the_tests() -> Iterator[None]:
    """Every shared region a test creates is gone when the suite ends (no /dev/shm leaks).

    Tests name their regions with ``tests._regions.region_name`` (or put them in a temporary
    directory), so files of other test runs or services on the host never count.
    """
    before = _region_files()
    yield
    leaked = _region_files() - before
    assert not leaked, f"tests left shared-region files in /dev/shm: {sorted(leaked)}"
