"""The private CPU tier on a real GPU: exactly sized, pinned, mapped, released with its views."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from kvcache_offload.dataplane.copy.dma import get_cuda_runtime  # noqa: E402
from kvcache_offload.dataplane.handlers.cpu_backend import allocate_cpu_tensors  # noqa: E402


def test_private_tier_is_pinned_mapped_exactly_sized_and_released() -> None:
    runtime = get_cuda_runtime()
    if runtime is None:
        pytest.skip("the CUDA runtime library cannot be loaded")
    gpu = [torch.zeros((4, n), dtype=torch.int8, device="cuda") for n in (5000, 3000)]
    cpu = allocate_cpu_tensors(gpu, 1, 1001, pin_memory=True)
    ptr = cpu[0].data_ptr()
    assert all(t.is_pinned() for t in cpu)
    assert runtime.is_uva_mapped(ptr)
    assert runtime.is_uva_mapped(ptr + 1001 * 8000 - 1)  # the last byte is inside
    # A GPU round trip through the mapped memory.
    cpu[1][1000].fill_(9)
    gpu[1][0].copy_(cpu[1][1000], non_blocking=True)
    torch.cuda.synchronize()
    assert int(gpu[1][0, -1]) == 9
    cpu.clear()
    gc.collect()
    assert not runtime.is_uva_mapped(ptr)
