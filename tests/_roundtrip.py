"""Byte-exact round-trip helpers shared by the CPU-backend and CUDA transfer tests.

The expected result is computed by a deliberately naive reference (one Python slice per
fragment, straight from the specs), independent of ``kvcache_offload.dataplane.copy.plan``.
Destinations are poisoned first and compared whole, so a byte written where it should not
be, or not written where it should, fails the test.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvcache_offload.contracts.handler import (
    OffloadingHandler,
    TransferResult,
)
from kvcache_offload.contracts.kv_caches import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
)
from kvcache_offload.contracts.load_store_spec import CPULoadStoreSpec, GPULoadStoreSpec

POISON = -77


def random_int8(shape: Sequence[int], gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    return torch.randint(-128, 128, tuple(shape), dtype=torch.int8, generator=gen).to(device)


def make_caches(
    *,
    num_tensors: int,
    num_gpu_blocks: int,
    page: int,
    group_layers: Sequence[Sequence[tuple[int, int]]],
    gen: torch.Generator,
    device: str = "cpu",
) -> CanonicalKVCaches:
    """``group_layers[g]`` lists ``(tensor_idx, unpadded_page_bytes)`` refs of group g."""
    tensors = [
        CanonicalKVCacheTensor(random_int8((num_gpu_blocks, page), gen, device), page)
        for _ in range(num_tensors)
    ]
    refs = [[CanonicalKVCacheRef(t, size) for t, size in group] for group in group_layers]
    return CanonicalKVCaches(tensors, refs)


@dataclass
class Job:
    gpu_spec: GPULoadStoreSpec
    cpu_spec: CPULoadStoreSpec
    fragments: list[tuple[int, int, int, int]]
    """(group, gpu block, cpu slot, sub-block j) for every GPU block of the job."""


def random_job(
    rng: np.random.Generator,
    *,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    factor: int,
    num_gpu_blocks: int,
    num_cpu_blocks: int,
) -> Job:
    total_gpu = sum(group_sizes)
    gpu_ids = rng.choice(num_gpu_blocks, total_gpu, replace=False)
    cpu_counts = [
        -(-(size + start % factor) // factor) if size else 0
        for size, start in zip(group_sizes, block_indices, strict=True)
    ]
    cpu_ids = rng.choice(num_cpu_blocks, sum(cpu_counts), replace=False)
    fragments = []
    g_off = c_off = 0
    for g, (size, start) in enumerate(zip(group_sizes, block_indices, strict=True)):
        skip = start % factor
        for i in range(size):
            k = skip + i
            fragments.append(
                (g, int(gpu_ids[g_off + i]), int(cpu_ids[c_off + k // factor]), k % factor)
            )
        g_off += size
        c_off += cpu_counts[g]
    return Job(
        GPULoadStoreSpec(gpu_ids, group_sizes, block_indices),
        CPULoadStoreSpec(cpu_ids),
        fragments,
    )


def expected_after_store(
    kv: CanonicalKVCaches, cpu_before: list[torch.Tensor], job: Job
) -> list[torch.Tensor]:
    out = [t.clone() for t in cpu_before]
    for g, gpu_block, slot, j in job.fragments:
        for ref in kv.group_data_refs[g]:
            page = kv.tensors[ref.tensor_idx].page_size_bytes
            src = kv.tensors[ref.tensor_idx].tensor[gpu_block, : ref.page_size_bytes].cpu()
            out[ref.tensor_idx][slot, j * page : j * page + ref.page_size_bytes] = src
    return out


def expected_after_load(
    kv: CanonicalKVCaches,
    gpu_before: list[torch.Tensor],
    cpu: list[torch.Tensor],
    job: Job,
) -> list[torch.Tensor]:
    out = [t.clone() for t in gpu_before]
    for g, gpu_block, slot, j in job.fragments:
        for ref in kv.group_data_refs[g]:
            page = kv.tensors[ref.tensor_idx].page_size_bytes
            src = cpu[ref.tensor_idx][slot, j * page : j * page + ref.page_size_bytes]
            out[ref.tensor_idx][gpu_block, : ref.page_size_bytes] = src
    return out


def snapshot(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().cpu().clone() for t in tensors]


def assert_same(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        a = a.detach().cpu()
        if not torch.equal(a, e):
            diff = (a != e).nonzero()
            raise AssertionError(
                f"tensor {i}: {len(diff)} bytes differ, first at {diff[0].tolist()} "
                f"(got {int(a[tuple(diff[0])])}, expected {int(e[tuple(diff[0])])})"
            )


def finish(
    handler: OffloadingHandler, job_ids: Sequence[int], timeout: float = 30.0
) -> list[TransferResult]:
    """``wait`` on the jobs, then collect exactly their results (in completion order)."""
    handler.wait(set(job_ids))
    results: list[TransferResult] = []
    deadline = time.monotonic() + timeout
    while len(results) < len(job_ids):
        results.extend(handler.get_finished())
        if time.monotonic() > deadline:
            raise AssertionError(f"jobs {job_ids} did not all finish: got {results}")
    return results


def poison(tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        t.fill_(POISON)


def round_trip(
    handlers: object,
    kv: CanonicalKVCaches,
    job: Job,
    *,
    job_ids: tuple[int, int] = (1, 2),
) -> tuple[TransferResult, TransferResult]:
    """Store ``job`` into poisoned CPU tensors, check; load it into poisoned GPU, check."""
    cpu_tensors: list[torch.Tensor] = handlers.cpu_tensors  # type: ignore[attr-defined]
    gpu_tensors = [t.tensor for t in kv.tensors]
    poison(cpu_tensors)
    gpu_before = snapshot(gpu_tensors)
    cpu_before = snapshot(cpu_tensors)
    store = handlers.gpu_to_cpu_handler  # type: ignore[attr-defined]
    assert store.transfer_async(job_ids[0], (job.gpu_spec, job.cpu_spec))
    (store_result,) = finish(store, [job_ids[0]])
    assert_same(cpu_tensors, expected_after_store(kv, cpu_before, job))
    assert_same(gpu_tensors, gpu_before)  # the source is untouched

    poison(gpu_tensors)
    gpu_poisoned = snapshot(gpu_tensors)
    cpu_now = snapshot(cpu_tensors)
    load = handlers.cpu_to_gpu_handler  # type: ignore[attr-defined]
    assert load.transfer_async(job_ids[1], (job.cpu_spec, job.gpu_spec))
    (load_result,) = finish(load, [job_ids[1]])
    assert_same(gpu_tensors, expected_after_load(kv, gpu_poisoned, cpu_now, job))
    assert_same(cpu_tensors, cpu_now)
    # Every mapped fragment came back exactly as it was before the store.
    for g, gpu_block, _slot, _j in job.fragments:
        for ref in kv.group_data_refs[g]:
            got = gpu_tensors[ref.tensor_idx][gpu_block, : ref.page_size_bytes].cpu()
            want = gpu_before[ref.tensor_idx][gpu_block, : ref.page_size_bytes]
            assert torch.equal(got, want)
    return store_result, load_result


def job_bytes(kv: CanonicalKVCaches, job: Job) -> int:
    return sum(ref.page_size_bytes for g, *_ in job.fragments for ref in kv.group_data_refs[g])


def skip_unless_available(mechanism: str) -> None:
    """Skip a CUDA test whose copy mechanism this machine cannot run (no Triton, or a CUDA
    runtime without ``cudaMemcpyBatchAsync``)."""
    import pytest

    from kvcache_offload.dataplane.copy.dma import get_cuda_runtime
    from kvcache_offload.dataplane.copy.triton_kernel import triton_available

    if mechanism in ("kernel", "staged") and not triton_available()[0]:
        pytest.skip("triton unavailable")
    if mechanism in ("dma", "staged"):
        rt = get_cuda_runtime()
        if rt is None or not rt.has_batch_memcpy:
            pytest.skip("cudaMemcpyBatchAsync unavailable")
