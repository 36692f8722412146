"""A serving-like stream over the CUDA handlers, once per copy mechanism: concurrent mixed
loads and stores, cancellations, every byte checked, nothing pinned or in flight after."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests._stream_stress import assert_quiescent, build, run_stream  # noqa: E402

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("mechanism", ["auto", "kernel", "dma", "staged"])
async def test_concurrent_mixed_stream_is_byte_exact_for_every_mechanism(mechanism: str) -> None:
    engine, tensors = build("cuda", mechanism)
    async with engine:
        checked = await run_stream(engine, tensors)
        assert checked > 0
        assert_quiescent(engine)
        assert engine.worker is not None
        assert all(not h.pending_job_ids() for h in engine.worker.handlers)
