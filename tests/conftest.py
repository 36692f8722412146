"""Shared fixtures and helpers."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests._regions import SESSION_TAG

settings.register_profile("ci", max_examples=60, deadline=None)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile("ci")


SHM_DIR = Path("/dev/shm")


def _service_from_this_checkout() -> None:
    """Make ``kvcache_offload_service`` this checkout's ``api/`` folder, here and in servers
    the tests start: an editable install made before the service got that name, or made from
    another checkout, would otherwise import a missing or different service."""
    alias = Path(tempfile.mkdtemp(prefix="kvcache-service-"))
    atexit.register(shutil.rmtree, alias, True)
    (alias / "kvcache_offload_service").symlink_to(Path(__file__).resolve().parents[1] / "api")
    sys.path.insert(0, str(alias))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(alias), os.environ.get("PYTHONPATH", "")) if p
    )


_service_from_this_checkout()


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
