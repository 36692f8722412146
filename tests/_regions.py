"""Region names for tests: tagged with this test session, so its leak check counts only its own."""

from __future__ import annotations

import os
import uuid

SESSION_ENV = "KVCACHE_OFFLOAD_TEST_SESSION"
SESSION_TAG = os.environ.setdefault(SESSION_ENV, f"pytest{os.getpid()}")
"""Inherited by subprocesses (servers, workers), so their regions carry it too."""


def region_name(label: str) -> str:
    """A unique region name of this session: ``<label>-<session tag>-<random>``."""
    return f"{label}-{SESSION_TAG}-{uuid.uuid4().hex[:8]}"
