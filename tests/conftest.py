"""Shared fixtures and helpers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("ci", max_examples=60, deadline=None)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile("ci")


SHM_DIR = Path("/dev/shm")


def _region_files() -> set[str]:
    if not SHM_DIR.is_dir():
        return set()
    return {p.name for p in SHM_DIR.glob("kvcache_offload_*")}


@pytest.fixture(scope="session", autouse=True)
def no_region_file_outlives_the_tests() -> Iterator[None]:
    """Every shared region a test creates is gone when the suite ends (no /dev/shm leaks)."""
    before = _region_files()
    yield
    leaked = _region_files() - before
    assert not leaked, f"tests left shared-region files in /dev/shm: {sorted(leaked)}"
