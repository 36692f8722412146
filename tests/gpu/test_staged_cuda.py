"""The staged path on a GPU: gather/scatter through a small staging ring plus batched DMA."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from kvcache_offload.contracts.load_store_spec import CPULoadStoreSpec, GPULoadStoreSpec  # noqa: E402
from tests._roundtrip import (  # noqa: E402
    Job,
    assert_same,
    expected_after_load,
    expected_after_store,
    finish,
    make_caches,
    poison,
    random_job,
    round_trip,
    skip_unless_available,
    snapshot,
)


def _handlers(kv, factor, num_cpu, mechanism="staged", staged_min_job_bytes=None, **staging):
    from kvcache_offload.dataplane.handlers.cuda import (
        CpuGpuOffloadingHandlers,
        StagingConfig,
    )

    extra = {} if staged_min_job_bytes is None else {"staged_min_job_bytes": staged_min_job_bytes}
    return CpuGpuOffloadingHandlers(
        kv, factor, num_cpu, mechanism=mechanism, staging=StagingConfig(**staging), **extra
    )


def _assert_one_chunk_jobs_issued_from_c(handler) -> None:
    """Where the issuer is built and Triton's launcher is one we checked, the inline jobs of
    one chunk after the first launch went out through the C issuer: the bytes this test
    checked went through it."""
    from kvcache_offload.dataplane.copy import triton_kernel
    from kvcache_offload.dataplane.copy.kernel_issue import kernel_issue_available

    if kernel_issue_available() and triton_kernel._direct_launch_supported():
        issuers = handler._launcher._staged._issuers
        assert any(i is not None for i in issuers), "one-chunk staged jobs issued from Python"


@pytest.mark.parametrize("submit_thread", [True, False])
@pytest.mark.parametrize("factor", [1, 3])
@pytest.mark.parametrize(("chunk_cells", "depth"), [(1, 1), (3, 2), (4, 3)])
def test_staged_round_trip_through_a_small_ring_is_byte_exact(
    submit_thread, factor, chunk_cells, depth
):
    """Jobs of many chunks (ring wraps many times), groups, skips, padding, a shared tensor."""
    skip_unless_available("staged")
    gen = torch.Generator().manual_seed(factor * 10 + chunk_cells)
    kv = make_caches(
        num_tensors=3,
        num_gpu_blocks=128,
        page=4096,
        group_layers=[[(0, 4096), (1, 4000)], [(2, 4096)], [(0, 1024)], []],
        gen=gen,
        device="cuda",
    )
    cell = 3 * 4096 * factor
    h = _handlers(
        kv, factor, 80, chunk_bytes=chunk_cells * cell, depth=depth, submit_thread=submit_thread
    )
    try:
        job = random_job(
            np.random.default_rng(factor + depth),
            group_sizes=[31, 17, 9, 5],
            block_indices=[factor - 1, 2, 1, 4],
            factor=factor,
            num_gpu_blocks=128,
            num_cpu_blocks=80,
        )
        store, load = round_trip(h, kv, job)
        assert store.success and load.success and store.transfer_time > 0
        assert h.gpu_to_cpu_handler.jobs_by_mechanism["staged"] == 1
        assert h.cpu_to_gpu_handler.jobs_by_mechanism["staged"] == 1
    finally:
        h.shutdown()


def test_auto_picks_staged_for_whole_blocks_and_the_kernel_for_scattered_pieces():
    skip_unless_available("staged")
    from kvcache_offload.dataplane.copy.triton_kernel import triton_available
    from kvcache_offload.dataplane.handlers.cuda import SingleDirectionOffloadingHandler

    if not triton_available()[0]:
        pytest.skip("triton unavailable")
    gen = torch.Generator().manual_seed(2)
    kv = make_caches(
        num_tensors=16,
        num_gpu_blocks=64,
        page=32768,
        group_layers=[[(t, 32768) for t in range(16)]],
        gen=gen,
        device="cuda",
    )
    # A job this small goes through the kernel by default (staged_min_job_bytes); the
    # threshold is lowered here to check the staged choice itself.
    h = _handlers(kv, 1, 64, mechanism="auto", staged_min_job_bytes=0)
    try:
        job = random_job(
            np.random.default_rng(2),
            group_sizes=[40],
            block_indices=[0],
            factor=1,
            num_gpu_blocks=64,
            num_cpu_blocks=64,
        )
        round_trip(h, kv, job)
        assert h.gpu_to_cpu_handler.jobs_by_mechanism["staged"] == 1
        assert h.cpu_to_gpu_handler.jobs_by_mechanism["staged"] == 1
    finally:
        h.shutdown()
    # One pinned tensor per canonical tensor (not block-major): 32 KiB pieces -> kernel.
    gpu = [t.tensor for t in kv.tensors]
    cpu = [torch.zeros((64, 32768), dtype=torch.int8, pin_memory=True) for _ in gpu]
    store = SingleDirectionOffloadingHandler(
        gpu, cpu, 1, kv.group_data_refs, True, staged_min_job_bytes=0
    )
    try:
        assert store.transfer_async(1, (job.gpu_spec, job.cpu_spec))
        finish(store, [1])
        assert store.jobs_by_mechanism["kernel"] == 1
    finally:
        store.shutdown()


def test_staged_concurrent_loads_and_stores_of_many_jobs_are_exact():
    """Both directions in flight at once, several jobs each, through two-buffer rings."""
    skip_unless_available("staged")
    gen = torch.Generator().manual_seed(5)
    kv = make_caches(
        num_tensors=8,
        num_gpu_blocks=256,
        page=16384,
        group_layers=[[(t, 16384) for t in range(8)]],
        gen=gen,
        device="cuda",
    )
    h = _handlers(kv, 1, 256, chunk_bytes=5 * 8 * 16384, depth=2)
    try:
        gpu_tensors = [t.tensor for t in kv.tensors]
        rng = np.random.default_rng(5)
        perm_gpu, perm_cpu = rng.permutation(256), rng.permutation(256)
        a_gpu = GPULoadStoreSpec(perm_gpu[:128], [128], [0])
        a_cpu = CPULoadStoreSpec(perm_cpu[:128])
        b_gpu = GPULoadStoreSpec(perm_gpu[128:], [128], [0])
        b_cpu = CPULoadStoreSpec(perm_cpu[128:])
        poison(h.cpu_tensors)
        for t in h.cpu_tensors:
            t[torch.from_numpy(perm_cpu[128:])] = torch.randint(
                -128, 128, (128, t.shape[1]), dtype=torch.int8, generator=gen
            )
        gpu_before, cpu_before = snapshot(gpu_tensors), snapshot(h.cpu_tensors)
        stores, loads = [], []
        for i in range(4):
            assert h.gpu_to_cpu_handler.transfer_async(10 + i, (a_gpu, a_cpu))
            assert h.cpu_to_gpu_handler.transfer_async(20 + i, (b_cpu, b_gpu))
            stores.append(10 + i)
            loads.append(20 + i)
        rs = finish(h.gpu_to_cpu_handler, stores)
        rl = finish(h.cpu_to_gpu_handler, loads)
        assert [r.job_id for r in rs] == stores and all(r.success for r in rs)
        assert [r.job_id for r in rl] == loads and all(r.success for r in rl)
        pairs = list(zip(perm_gpu.tolist(), perm_cpu.tolist(), strict=True))
        frag_a = [(0, g, c, 0) for g, c in pairs[:128]]
        frag_b = [(0, g, c, 0) for g, c in pairs[128:]]
        want_cpu = expected_after_store(kv, cpu_before, Job(a_gpu, a_cpu, frag_a))
        kv_before = type(kv)(
            [type(kv.tensors[0])(t, kv.tensors[0].page_size_bytes) for t in gpu_before],
            kv.group_data_refs,
        )
        want_gpu = expected_after_load(kv_before, gpu_before, cpu_before, Job(b_gpu, b_cpu, frag_b))
        assert_same(h.cpu_tensors, want_cpu)
        assert_same(gpu_tensors, want_gpu)
    finally:
        h.shutdown()


@pytest.mark.parametrize("submit_thread", [True, False])
def test_staged_shutdown_with_jobs_in_flight_finishes_them_and_refuses_more(submit_thread):
    skip_unless_available("staged")
    from kvcache_offload.errors import TransferError

    gen = torch.Generator().manual_seed(8)
    kv = make_caches(
        num_tensors=4,
        num_gpu_blocks=512,
        page=65536,
        group_layers=[[(t, 65536) for t in range(4)]],
        gen=gen,
        device="cuda",
    )
    h = _handlers(kv, 1, 512, chunk_bytes=8 << 20, depth=2, submit_thread=submit_thread)
    gpu_tensors = [t.tensor for t in kv.tensors]
    for t in h.cpu_tensors:
        t[256:] = torch.randint(-128, 128, (256, t.shape[1]), dtype=torch.int8, generator=gen)
    cpu_tensors = list(h.cpu_tensors)  # shutdown() lets go of the tier; the test keeps it
    gpu_before, cpu_before = snapshot(gpu_tensors), snapshot(cpu_tensors)
    low, high = np.arange(256), np.arange(256, 512)
    store_spec = (GPULoadStoreSpec(low, [256], [0]), CPULoadStoreSpec(low))
    load_spec = (CPULoadStoreSpec(high), GPULoadStoreSpec(high, [256], [0]))
    for j in range(1, 5):  # 4 x 64 MiB each way in flight
        assert h.gpu_to_cpu_handler.transfer_async(j, store_spec)
        assert h.cpu_to_gpu_handler.transfer_async(100 + j, load_spec)
    h.shutdown()
    assert h.gpu_to_cpu_handler.pending_job_ids() == []
    assert h.cpu_to_gpu_handler.pending_job_ids() == []
    with pytest.raises(TransferError):
        h.gpu_to_cpu_handler.transfer_async(9, store_spec)
    assert h.gpu_to_cpu_handler.get_finished() == []
    assert h.gpu_to_cpu_handler.describe()["staging"]["staging_gpu_bytes"] == 0
    for g, c, g0, c0 in zip(gpu_tensors, cpu_tensors, gpu_before, cpu_before, strict=True):
        assert torch.equal(c[:256], g0[:256])  # every store landed before shutdown returned
        assert torch.equal(g[256:].cpu(), c0[256:])  # and every load


def test_small_staged_jobs_go_inline_and_land_after_a_threaded_one():
    """A serving-size staged job is issued on the caller's thread, a large one by the submit
    thread; a small load into blocks a large load is still writing lands last, and the
    jobs complete in submission order."""
    skip_unless_available("staged")
    gen = torch.Generator().manual_seed(11)
    page = 16384
    kv = make_caches(
        num_tensors=4, num_gpu_blocks=128, page=page,
        group_layers=[[(t, page) for t in range(4)]], gen=gen, device="cuda",
    )  # fmt: skip
    cell = 4 * page
    h = _handlers(kv, 1, 128, staged_min_job_bytes=16 * cell, chunk_bytes=4 * cell, depth=2)
    try:
        load = h.cpu_to_gpu_handler
        gpu_tensors = [t.tensor for t in kv.tensors]
        for t in h.cpu_tensors:
            t.copy_(torch.randint(-128, 128, tuple(t.shape), dtype=torch.int8, generator=gen))
        big_gpu, big_cpu = np.arange(64), np.arange(64, 128)
        small_gpu, small_cpu = np.array([5, 40, 63]), np.array([1, 2, 3])
        jobs = [
            (1, (CPULoadStoreSpec(big_cpu), GPULoadStoreSpec(big_gpu, [64], [0]))),
            (2, (CPULoadStoreSpec(small_cpu), GPULoadStoreSpec(small_gpu, [3], [0]))),
            (3, (CPULoadStoreSpec(small_cpu[:1]), GPULoadStoreSpec(np.array([100]), [1], [0]))),
        ]
        for job_id, spec in jobs:
            assert load.transfer_async(job_id, spec)
        results = finish(load, [1, 2, 3])
        assert [r.job_id for r in results] == [1, 2, 3] and all(r.success for r in results)
        assert load.jobs_by_mechanism["staged"] == 3
        _assert_one_chunk_jobs_issued_from_c(load)
        want = {int(g): int(c) for g, c in zip(big_gpu, big_cpu, strict=True)}
        want.update({int(g): int(c) for g, c in zip(small_gpu, small_cpu, strict=True)})
        want[100] = int(small_cpu[0])
        for g, c in want.items():
            for t, cpu in zip(gpu_tensors, h.cpu_tensors, strict=True):
                assert torch.equal(t[g].cpu(), cpu[c]), (g, c)
    finally:
        h.shutdown()
