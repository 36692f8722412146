"""A serving-like stream over the CPU backend: concurrent mixed jobs, cancellations, every
byte checked, nothing left pinned or in flight."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from kvcache_offload.dataplane.copy.host_copy import native_available
from tests._stream_stress import assert_quiescent, build, run_stream


async def test_concurrent_mixed_stream_loads_every_byte_back_and_leaves_nothing_pinned() -> None:
    engine, tensors = build("cpu")
    async with engine:
        checked = await run_stream(engine, tensors)
        assert checked > 0
        assert_quiescent(engine)
        assert engine.worker is not None
        assert all(not h.pending_job_ids() for h in engine.worker.handlers)


def test_the_gil_free_host_copy_is_built_where_the_package_is_compiled() -> None:
    """``./scripts/setup.sh`` builds the C walk; without it the CPU backend is slower."""
    import os

    if os.environ.get("KVCACHE_OFFLOAD_EXPECT_COMPILED") != "1":
        pytest.skip("this install was not asked to be compiled (KVCACHE_OFFLOAD_EXPECT_COMPILED)")
    assert native_available()
