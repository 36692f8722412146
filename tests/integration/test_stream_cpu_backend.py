"""A serving-like stream over the CPU backend: concurrent mixed jobs, cancellations, every
byte checked, nothing left pinned or in flight."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from kvcache_offload.dataplane.copy.host_copy import native_available
from tests._stream_stress import assert_quiescent, build, record_looks, run_stream


async def test_concurrent_mixed_stream_loads_every_byte_back_and_leaves_nothing_pinned() -> None:
    engine, tensors = build("cpu")
    async with engine:
        checked = await run_stream(engine, tensors)
        assert checked > 0
        assert_quiescent(engine)
        assert engine.worker is not None
        assert all(not h.pending_job_ids() for h in engine.worker.handlers)


async def test_callers_looking_for_their_own_ends_still_give_every_task_its_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The CPU backend dressed as the CUDA handlers: ends are seen only by looking (no
    # completion callback or descriptor) and small copies are done by the first look, with
    # completion_caller_looks on. A caller that then returned without yielding ran its jobs
    # back to back while another task's just-stored keys aged out of the tier (the GPU
    # stress failed so on an H200; this reproduced it key for key). Every await yields once.
    from kvcache_offload.dataplane.handlers.router import OffloadingWorker

    set_callback = OffloadingWorker.set_completion_callback

    def ends_seen_only_by_looking(self: OffloadingWorker, callback: object) -> bool:
        set_callback(self, (lambda: None) if callback is not None else None)
        return True

    monkeypatch.setattr(OffloadingWorker, "set_completion_callback", ends_seen_only_by_looking)
    monkeypatch.setattr(OffloadingWorker, "completion_fds", lambda self: [])
    monkeypatch.setattr(OffloadingWorker, "enable_watch_on_demand", lambda self: True)
    looked = record_looks(monkeypatch)
    for seed in range(3):
        looked.clear()
        engine, tensors = build("cpu", completion_caller_looks=True)
        async with engine:
            checked = await run_stream(engine, tensors, seed)
            assert checked > 0
            assert_quiescent(engine)
        assert any(looked)  # callers were asked to look (at least the run's first job)


def test_the_gil_free_host_copy_is_built_where_the_package_is_compiled() -> None:
    """``./scripts/setup.sh`` builds the C walk; without it the CPU backend is slower."""
    import os

    if os.environ.get("KVCACHE_OFFLOAD_EXPECT_COMPILED") != "1":
        pytest.skip("this install was not asked to be compiled (KVCACHE_OFFLOAD_EXPECT_COMPILED)")
    assert native_available()
