"""CUDA handlers: byte-exact round trips for every copy mechanism, ordering and shutdown."""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from kvcache_offload.contracts.load_store_spec import CPULoadStoreSpec  # noqa: E402
from kvcache_offload.errors import TransferError  # noqa: E402
from tests._roundtrip import (  # noqa: E402
    assert_same,
    expected_after_load,
    expected_after_store,
    finish,
    job_bytes,
    make_caches,
    poison,
    random_job,
    round_trip,
    skip_unless_available,
    snapshot,
)

MECHANISMS = ["kernel", "dma", "staged", "torch", "auto"]


def _handlers(kv, factor, num_cpu, mechanism, region=None, **kw):
    from kvcache_offload.dataplane.handlers.cuda import CpuGpuOffloadingHandlers

    return CpuGpuOffloadingHandlers(kv, factor, num_cpu, region, mechanism=mechanism, **kw)


def _one_group_caches(seed: int):
    """Three tensors of 4 KiB pages in one KV-cache group (one ref padded): small fragments,
    so ``auto`` takes the kernel."""
    return make_caches(
        num_tensors=3,
        num_gpu_blocks=64,
        page=4096,
        group_layers=[[(0, 4096), (1, 4000), (2, 4096)]],
        gen=torch.Generator().manual_seed(seed),
        device="cuda",
    )


def _record_lone_kernel_calls(h, planned_in_c: list[int] | None = None) -> list[object]:
    """The ``prev`` copy of every ``lone_kernel`` or ``lone_units`` issue of both directions
    (None: issued on an idle direction, as ``lone_units`` always is), in call order;
    ``planned_in_c`` gets one entry per job ``lone_units`` planned and issued in C."""
    calls: list[object] = []
    for one in (h.gpu_to_cpu_handler._launcher, h.cpu_to_gpu_handler._launcher):
        issue, units = one.lone_kernel, one.lone_units

        def recorded(*args, _issue=issue, **kw):
            calls.append(args[5] if len(args) > 5 else kw.get("prev"))
            return _issue(*args, **kw)

        def recorded_units(*args, _units=units, **kw):
            lane = _units(*args, **kw)
            if lane is not None:
                calls.append(None)
                if planned_in_c is not None:
                    planned_in_c.append(1)
            return lane

        one.lone_kernel = recorded
        one.lone_units = recorded_units
    return calls


def _assert_issued_from_c(h) -> None:
    """Where the issuer is built and Triton's launcher is one we checked, both directions'
    lone copies after the first (which compiles the kernel) are issued from C: the bytes
    this test checked went through it."""
    from kvcache_offload.dataplane.copy import triton_kernel
    from kvcache_offload.dataplane.copy.kernel_issue import kernel_issue_available

    if kernel_issue_available() and triton_kernel._direct_launch_supported():
        for one in (h.gpu_to_cpu_handler._launcher, h.cpu_to_gpu_handler._launcher):
            assert one._issue is not None, "the lone lane issues through Python"


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("factor", [1, 4])
def test_cuda_round_trip_is_byte_exact_with_groups_skips_and_padding(mechanism, factor):
    skip_unless_available(mechanism)
    gen = torch.Generator().manual_seed(10 + factor)
    rng = np.random.default_rng(factor)
    kv = make_caches(
        num_tensors=3,
        num_gpu_blocks=96,
        page=4096,
        # padded refs (4000 < 4096), a group sharing tensor 0, an empty group
        group_layers=[[(0, 4096), (1, 4000)], [(2, 4096)], [(0, 1024)], []],
        gen=gen,
        device="cuda",
    )
    job = random_job(
        rng,
        group_sizes=[13, 7, 0, 9],
        block_indices=[factor - 1, 2, 0, 5],
        factor=factor,
        num_gpu_blocks=96,
        num_cpu_blocks=40,
    )
    # group 3 has no refs: its ids are consumed, nothing is copied
    h = _handlers(kv, factor, 40, mechanism)
    try:
        store, load = round_trip(h, kv, job)
        assert store.success and load.success
        assert store.transfer_type == ("GPU", "CPU") and load.transfer_type == ("CPU", "GPU")
        assert store.transfer_size == load.transfer_size == job_bytes(kv, job)
        assert store.transfer_time > 0 and load.transfer_time > 0
    finally:
        h.shutdown()


@pytest.mark.parametrize("mechanism", ["kernel", "torch"])
def test_cuda_odd_page_sizes_copy_exactly(mechanism):
    """Unaligned sizes force the byte-granular kernel variant."""
    skip_unless_available(mechanism)
    gen = torch.Generator().manual_seed(3)
    kv = make_caches(
        num_tensors=2,
        num_gpu_blocks=32,
        page=1000,
        group_layers=[[(0, 999), (1, 1000)]],
        gen=gen,
        device="cuda",
    )
    job = random_job(
        np.random.default_rng(3),
        group_sizes=[11],
        block_indices=[1],
        factor=2,
        num_gpu_blocks=32,
        num_cpu_blocks=16,
    )
    h = _handlers(kv, 2, 16, mechanism)
    try:
        round_trip(h, kv, job)
    finally:
        h.shutdown()


def test_cuda_auto_copies_large_fragments_through_the_kernel_too():
    # While the kernel works, auto never picks the plain DMA: 1 MiB pieces take the kernel
    # like small ones (transfer.mechanism="dma" forces the DMA).
    from kvcache_offload.dataplane.copy.triton_kernel import triton_available

    skip_unless_available("dma")
    if not triton_available()[0]:
        pytest.skip("triton unavailable")
    gen = torch.Generator().manual_seed(4)
    kv = make_caches(
        num_tensors=1,
        num_gpu_blocks=16,
        page=1 << 20,
        group_layers=[[(0, 1 << 20)], [(0, 4096)]],
        gen=gen,
        device="cuda",
    )
    h = _handlers(kv, 1, 16, "auto")
    try:
        big = random_job(
            np.random.default_rng(0),
            group_sizes=[4, 0],
            block_indices=[0, 0],
            factor=1,
            num_gpu_blocks=16,
            num_cpu_blocks=16,
        )
        small = random_job(
            np.random.default_rng(1),
            group_sizes=[0, 4],
            block_indices=[0, 0],
            factor=1,
            num_gpu_blocks=16,
            num_cpu_blocks=16,
        )
        round_trip(h, kv, big, job_ids=(1, 2))
        round_trip(h, kv, small, job_ids=(3, 4))
        assert h.gpu_to_cpu_handler.jobs_by_mechanism == {
            "kernel": 2,
            "dma": 0,
            "staged": 0,
            "torch": 0,
        }
    finally:
        h.shutdown()


@pytest.mark.parametrize(
    "mechanism",
    [
        "kernel",
        "dma",
        "staged",
        "torch",
        "auto-staged-when-busy",
        "auto-when-mixed",
        "auto-mixed-on-idle",
    ],
)
def test_cuda_concurrent_loads_and_stores_are_both_exact(mechanism, monkeypatch):
    # auto-staged-when-busy: the first job of each direction takes the kernel, the ones
    # queued behind it the staged path, so both paths' jobs interleave in one direction.
    # auto-when-mixed: the same, as both directions are in flight together (the staged path
    # for large jobs on an idle direction off).
    # auto-mixed-on-idle: the default rule: only the very first job (nothing copying either
    # way) takes the kernel; the first load finds the stores copying and takes the staged
    # path though its own direction is idle.
    kw = {}
    mode = mechanism
    if mechanism in ("auto-staged-when-busy", "auto-when-mixed", "auto-mixed-on-idle"):
        import dataclasses

        from kvcache_offload.dataplane.copy.staging_config import DEFAULT_STAGING_CONFIG

        skip_unless_available("staged")
        # This layout's blocks are 128 KiB pieces on the CPU side: let auto stage them.
        staging = dataclasses.replace(DEFAULT_STAGING_CONFIG, auto_min_piece_bytes=64 * 1024)
        rule = True if mechanism == "auto-staged-when-busy" else "mixed"
        mechanism, kw = "auto", {"staged_when_busy": rule, "staging": staging}
        if mode == "auto-when-mixed":
            kw["staged_mixed_min_job_bytes"] = 0
    skip_unless_available(mechanism)
    gen = torch.Generator().manual_seed(5)
    kv = make_caches(
        num_tensors=4,
        num_gpu_blocks=256,
        page=32768,
        group_layers=[[(0, 32768), (1, 32768), (2, 32768), (3, 32768)]],
        gen=gen,
        device="cuda",
    )
    h = _handlers(kv, 1, 256, mechanism, **kw)
    try:
        gpu_tensors = [t.tensor for t in kv.tensors]
        rng = np.random.default_rng(5)
        perm_gpu = rng.permutation(256)
        perm_cpu = rng.permutation(256)
        from kvcache_offload.contracts.load_store_spec import GPULoadStoreSpec

        a_gpu = GPULoadStoreSpec(perm_gpu[:128], [128], [0])
        a_cpu = CPULoadStoreSpec(perm_cpu[:128])
        b_gpu = GPULoadStoreSpec(perm_gpu[128:], [128], [0])
        b_cpu = CPULoadStoreSpec(perm_cpu[128:])
        # Fill CPU slots of B with known bytes to load, poison A's slots.
        poison(h.cpu_tensors)
        for t in h.cpu_tensors:
            t[torch.from_numpy(perm_cpu[128:])] = torch.randint(
                -128, 128, (128, t.shape[1]), dtype=torch.int8, generator=gen
            )
        gpu_before, cpu_before = snapshot(gpu_tensors), snapshot(h.cpu_tensors)
        jobs_store, jobs_load = [], []
        if kw:
            # Each job queues behind the one before, whatever the host's speed: a slow
            # submission in between (the first launch of a kernel) let the previous copy
            # end first, and the next job then rightly took the kernel.
            from kvcache_offload.dataplane.handlers.cuda.inflight import InFlightCopy

            monkeypatch.setattr(InFlightCopy, "done", lambda self: False)
        for i in range(3):  # several rounds, both directions in flight at once
            assert h.gpu_to_cpu_handler.transfer_async(10 + i, (a_gpu, a_cpu))
            assert h.cpu_to_gpu_handler.transfer_async(20 + i, (b_cpu, b_gpu))
            jobs_store.append(10 + i)
            jobs_load.append(20 + i)
        monkeypatch.undo()
        rs = finish(h.gpu_to_cpu_handler, jobs_store)
        rl = finish(h.cpu_to_gpu_handler, jobs_load)
        assert [r.job_id for r in rs] == jobs_store and all(r.success for r in rs)
        assert [r.job_id for r in rl] == jobs_load and all(r.success for r in rl)
        if mode == "auto-mixed-on-idle":
            stores, loads = (
                h.gpu_to_cpu_handler.jobs_by_mechanism,
                h.cpu_to_gpu_handler.jobs_by_mechanism,
            )
            assert (stores["kernel"], stores["staged"]) == (1, 2), stores
            assert (loads["kernel"], loads["staged"]) == (0, 3), loads
        elif kw:  # both paths ran in each direction
            for handler in (h.gpu_to_cpu_handler, h.cpu_to_gpu_handler):
                used = {m for m, n in handler.jobs_by_mechanism.items() if n}
                assert used == {"kernel", "staged"}, handler.jobs_by_mechanism

        from tests._roundtrip import Job

        frag_a = [
            (0, int(g), int(c), 0) for g, c in zip(perm_gpu[:128], perm_cpu[:128], strict=True)
        ]
        frag_b = [
            (0, int(g), int(c), 0) for g, c in zip(perm_gpu[128:], perm_cpu[128:], strict=True)
        ]
        want_cpu = expected_after_store(kv, cpu_before, Job(a_gpu, a_cpu, frag_a))
        # gpu_before with B loaded from the (unchanged) B slots
        kv_before = type(kv)(
            [type(kv.tensors[0])(t, kv.tensors[0].page_size_bytes) for t in gpu_before],
            kv.group_data_refs,
        )
        want_gpu = expected_after_load(kv_before, gpu_before, cpu_before, Job(b_gpu, b_cpu, frag_b))
        assert_same(h.cpu_tensors, want_cpu)
        assert_same(gpu_tensors, want_gpu)
    finally:
        h.shutdown()


@pytest.mark.parametrize("mechanism", ["kernel", "dma", "staged", "torch", "auto"])
@pytest.mark.parametrize("compute", ["default stream", "side stream"])
def test_cuda_store_waits_for_the_compute_stream(mechanism, compute):
    """The KV written by a slow kernel on the compute stream is what gets stored, on the
    default stream (raw handle 0) as on another one, for the first store and for later ones
    (the lone kernel lane issues from C once the first copy compiled the kernel). The host
    must not wait for the GPU before submitting (no host copy after the sleep), or the
    test would pass whether the store waited or not."""
    skip_unless_available(mechanism)
    gen = torch.Generator().manual_seed(6)
    kv = make_caches(
        num_tensors=1,
        num_gpu_blocks=64,
        page=65536,
        group_layers=[[(0, 65536)]],
        gen=gen,
        device="cuda",
    )
    h = _handlers(kv, 1, 64, mechanism)
    side = torch.cuda.Stream() if compute == "side stream" else torch.cuda.current_stream()
    try:
        from kvcache_offload.contracts.load_store_spec import GPULoadStoreSpec

        gpu = kv.tensors[0].tensor
        for job_id, (first, value) in enumerate([(0, 42), (1, 43), (0, 44), (1, 45)], start=1):
            ids = np.arange(first, 64, 2)
            gpu_ids = torch.from_numpy(ids).cuda()
            torch.cuda.synchronize()
            with torch.cuda.stream(side):
                torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the compute stream
                gpu.index_fill_(0, gpu_ids, value)  # no host copy: the host does not wait
                assert h.gpu_to_cpu_handler.transfer_async(
                    job_id, (GPULoadStoreSpec(ids, [len(ids)], [0]), CPULoadStoreSpec(ids))
                )
            finish(h.gpu_to_cpu_handler, [job_id])
            stored = h.cpu_tensors[0][torch.from_numpy(ids)]
            assert bool((stored == value).all()), f"store {job_id} copied before the model wrote"
    finally:
        h.shutdown()


@pytest.mark.parametrize("mechanism", ["kernel", "dma", "staged", "torch"])
def test_cuda_jobs_complete_in_submission_order_with_event_times(mechanism):
    skip_unless_available(mechanism)
    gen = torch.Generator().manual_seed(7)
    kv = make_caches(
        num_tensors=2,
        num_gpu_blocks=128,
        page=65536,
        group_layers=[[(0, 65536), (1, 65536)]],
        gen=gen,
        device="cuda",
    )
    h = _handlers(kv, 1, 128, mechanism)
    store = h.gpu_to_cpu_handler
    try:
        rng = np.random.default_rng(7)
        t0 = time.perf_counter()
        ids = list(range(100, 108))
        for j in ids:
            job = random_job(
                rng,
                group_sizes=[int(rng.integers(1, 64))],
                block_indices=[0],
                factor=1,
                num_gpu_blocks=128,
                num_cpu_blocks=128,
            )
            assert store.transfer_async(j, (job.gpu_spec, job.cpu_spec))
        seen = []
        deadline = time.monotonic() + 30
        while len(seen) < len(ids) and time.monotonic() < deadline:
            seen.extend(store.get_finished())
        elapsed = time.perf_counter() - t0
        assert [r.job_id for r in seen] == ids
        assert all(r.success and 0 < r.transfer_time < elapsed for r in seen)
        assert store.get_finished() == []
        store.wait({999})  # unknown ids are ignored
    finally:
        h.shutdown()


@pytest.mark.parametrize("mechanism", ["kernel", "dma", "staged", "torch"])
def test_cuda_bad_submission_raises_and_shutdown_with_jobs_in_flight(mechanism):
    skip_unless_available(mechanism)
    from kvcache_offload.contracts.load_store_spec import GPULoadStoreSpec
    from kvcache_offload.dataplane.handlers.router import OffloadingWorker

    gen = torch.Generator().manual_seed(8)
    kv = make_caches(
        num_tensors=1,
        num_gpu_blocks=512,
        page=1 << 20,
        group_layers=[[(0, 1 << 20)]],
        gen=gen,
        device="cuda",
    )
    h = _handlers(kv, 1, 512, mechanism)
    worker = OffloadingWorker()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, h.gpu_to_cpu_handler)
    worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, h.cpu_to_gpu_handler)
    # block id out of range -> the router turns the handler's error into False
    bad = (GPULoadStoreSpec([0, 600], [2], [0]), CPULoadStoreSpec([0, 1]))
    assert worker.transfer_async(1, bad) is False
    ids = np.arange(512)
    for j in range(2, 6):
        assert worker.transfer_async(j, (GPULoadStoreSpec(ids, [512], [0]), CPULoadStoreSpec(ids)))
    worker.shutdown()  # 4 x 512 MiB in flight
    with pytest.raises(TransferError):
        h.gpu_to_cpu_handler.transfer_async(
            9, (GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([0]))
        )
    assert h.gpu_to_cpu_handler.get_finished() == []


def test_cuda_round_trip_through_a_pinned_shared_region():
    region_mod = pytest.importorskip("kvcache_offload.dataplane.memory.shared_offload_region")
    from kvcache_offload.dataplane.layouts import block_nbytes

    gen = torch.Generator().manual_seed(9)
    kv = make_caches(
        num_tensors=3,
        num_gpu_blocks=64,
        page=8192,
        group_layers=[[(0, 8192), (1, 8000)], [(2, 8192)]],
        gen=gen,
        device="cuda",
    )
    factor = 2
    import uuid

    region = region_mod.SharedOffloadRegion(
        f"cudatest-{uuid.uuid4().hex[:12]}",
        num_blocks=24,
        cpu_page_size=block_nbytes(kv) * factor,
        num_workers=1,
        rank=0,
    )
    try:
        h = _handlers(kv, factor, 24, "auto", region=region)
        assert region.is_pinned
        job = random_job(
            np.random.default_rng(9),
            group_sizes=[9, 6],
            block_indices=[1, 0],
            factor=factor,
            num_gpu_blocks=64,
            num_cpu_blocks=24,
        )
        round_trip(h, kv, job)
        assert h.gpu_to_cpu_handler.mechanism == "auto"
        assert h.gpu_to_cpu_handler.kernel_ok  # the region is mapped for the UVA kernel
        h.shutdown()
        del h
    finally:
        region.cleanup()


@pytest.mark.parametrize("mechanism", ["kernel", "auto"])
@pytest.mark.parametrize("factor", [1, 2])
def test_lone_one_group_jobs_take_the_lean_kernel_lane_and_copy_exactly(mechanism, factor):
    # A serving engine's lone request (one group, idle direction) skips the plan objects;
    # its bytes, results and a later bad job's error must be those of the general path.
    # Jobs of up to 8 units pass them to the kernel as parameters (inline), larger ones
    # (12 blocks here) upload a job table.
    skip_unless_available("kernel")
    kv = _one_group_caches(21 + factor)
    h = _handlers(kv, factor, 32, mechanism)
    planned_in_c: list[int] = []
    calls = _record_lone_kernel_calls(h, planned_in_c)
    try:
        rng = np.random.default_rng(factor)
        sizes = (1, 8, 5, 12, 3)
        for i, blocks in enumerate(sizes):
            job = random_job(
                rng,
                group_sizes=[blocks],
                block_indices=[factor - 1],
                factor=factor,
                num_gpu_blocks=64,
                num_cpu_blocks=32,
            )
            store, load = round_trip(h, kv, job, job_ids=(10 + 2 * i, 11 + 2 * i))
            assert store.success and load.success
            assert store.transfer_size == load.transfer_size == job_bytes(kv, job)
            assert store.transfer_time > 0 and load.transfer_time > 0
        assert len(calls) == 2 * len(sizes)  # every job of this test went through the lane
        _assert_issued_from_c(h)
        if h.gpu_to_cpu_handler._launcher._issue is not None:
            # At least after each direction's first copy (which compiles and binds the
            # kernel, unless an earlier test compiled it) the jobs were planned in the
            # issuer's C call, with the lane's own copy objects.
            assert len(planned_in_c) >= 2 * len(sizes) - 2
            assert len(h.gpu_to_cpu_handler._pools.lane_copies) == 1
        bad = random_job(
            rng, group_sizes=[2], block_indices=[0], factor=factor, num_gpu_blocks=64,
            num_cpu_blocks=32,
        )  # fmt: skip
        bad.cpu_spec = CPULoadStoreSpec(np.array([31, 99] if factor == 1 else [99]))
        with pytest.raises(TransferError, match="99"):  # the slot does not exist
            h.gpu_to_cpu_handler.transfer_async(50, (bad.gpu_spec, bad.cpu_spec))
        assert len(calls) == 2 * len(sizes)
    finally:
        h.shutdown()


def test_under_mixed_a_direction_stays_busy_for_one_copy_duration_after_its_copy(monkeypatch):
    # "mixed" asks whether the other direction is copying; a copy that ended less than one
    # copy's duration ago still counts, so short gaps inside a burst do not flip the rule.
    import types

    from kvcache_offload.contracts.load_store_spec import GPULoadStoreSpec
    from kvcache_offload.dataplane.handlers.cuda import handler as handler_module

    skip_unless_available("kernel")
    gen = torch.Generator().manual_seed(9)
    kv = make_caches(
        num_tensors=2,
        num_gpu_blocks=16,
        page=262144,  # an 8 MiB copy: it lasts far longer than this test's own steps
        group_layers=[[(0, 262144), (1, 262144)]],
        gen=gen,
        device="cuda",
    )
    h = _handlers(kv, 1, 16, "auto", staged_when_busy="mixed")
    try:
        stores = h.gpu_to_cpu_handler
        assert not stores.copying()  # nothing copied yet
        ids = np.arange(16)
        assert stores.transfer_async(1, (GPULoadStoreSpec(ids, [16], [0]), CPULoadStoreSpec(ids)))
        (result,) = finish(stores, [1])
        assert result.success and result.transfer_time is not None and result.transfer_time > 0
        ended = time.perf_counter()
        clock = types.SimpleNamespace(perf_counter=lambda: ended)
        monkeypatch.setattr(handler_module, "time", clock)
        assert stores.copying()  # just ended: still in the burst
        clock.perf_counter = lambda: ended + 2 * result.transfer_time + 1.0
        assert not stores.copying()  # idle for longer than a copy: the burst is over
    finally:
        h.shutdown()


@pytest.mark.parametrize(
    ("one_way_min_store_bytes", "staged_jobs"),
    [(0, 0), (8 * 1024 * 1024, 0), (1024 * 1024, 3)],
)
def test_staged_when_mixed_sends_only_large_one_way_jobs_to_the_copy_engines(
    monkeypatch, one_way_min_store_bytes, staged_jobs
):
    # With traffic one way only, jobs queued behind copies in flight keep the batched
    # kernel under "mixed" unless they reach staged_one_way_min_store_bytes (here 1 MiB
    # jobs: the first finds the direction idle and takes the kernel); the bytes are exact.
    import dataclasses

    from kvcache_offload.contracts.load_store_spec import GPULoadStoreSpec
    from kvcache_offload.dataplane.copy.staging_config import DEFAULT_STAGING_CONFIG
    from kvcache_offload.dataplane.handlers.cuda.inflight import InFlightCopy

    skip_unless_available("staged")
    staging = dataclasses.replace(DEFAULT_STAGING_CONFIG, auto_min_piece_bytes=64 * 1024)
    gen = torch.Generator().manual_seed(8)
    kv = make_caches(
        num_tensors=4,
        num_gpu_blocks=64,
        page=32768,
        group_layers=[[(0, 32768), (1, 32768), (2, 32768), (3, 32768)]],
        gen=gen,
        device="cuda",
    )
    h = _handlers(
        kv,
        1,
        64,
        "auto",
        staged_when_busy="mixed",
        staging=staging,
        staged_one_way_min_store_bytes=one_way_min_store_bytes,
    )
    try:
        assert h.gpu_to_cpu_handler.staged_when_busy and h.cpu_to_gpu_handler.staged_when_busy
        gpu_tensors = [t.tensor for t in kv.tensors]
        poison(h.cpu_tensors)
        cpu_before, gpu_before = snapshot(h.cpu_tensors), snapshot(gpu_tensors)
        monkeypatch.setattr(InFlightCopy, "done", lambda self: False)  # every job queues
        specs = []
        for i in range(4):
            ids = np.arange(8 * i, 8 * i + 8)
            specs.append((GPULoadStoreSpec(ids, [8], [0]), CPULoadStoreSpec(ids)))
            assert h.gpu_to_cpu_handler.transfer_async(30 + i, specs[-1])
        monkeypatch.undo()
        results = finish(h.gpu_to_cpu_handler, [30, 31, 32, 33])
        assert all(r.success for r in results)
        assert h.gpu_to_cpu_handler.jobs_by_mechanism["staged"] == staged_jobs
        assert h.gpu_to_cpu_handler.jobs_by_mechanism["kernel"] == 4 - staged_jobs
        from tests._roundtrip import Job

        want = cpu_before
        for gpu_spec, cpu_spec in specs:
            frags = [(0, int(b), int(b), 0) for b in gpu_spec.block_ids]
            want = expected_after_store(kv, want, Job(gpu_spec, cpu_spec, frags))
        assert_same(h.cpu_tensors, want)
        assert_same(gpu_tensors, gpu_before)
    finally:
        h.shutdown()


@pytest.mark.parametrize("mechanism", ["kernel", "auto"])
@pytest.mark.parametrize("factor", [1, 2])
def test_held_one_group_jobs_go_out_as_one_kernel_copy_exactly_and_in_order(mechanism, factor):
    # Jobs queued behind a copy in flight are held as kernel units (no plan objects) and
    # issued as one copy at the flush. A later job writing a slot a held job writes flushes
    # the batch first and lands after it; a batch that mixes a planned job with unit jobs
    # goes through the general path. Bytes, results and order must be the general path's.
    from kvcache_offload.contracts.load_store_spec import GPULoadStoreSpec
    from kvcache_offload.dataplane.handlers.cuda.handler import SingleDirectionOffloadingHandler
    from tests._roundtrip import Job

    skip_unless_available("kernel")
    kv = _one_group_caches(31 + factor)
    h = _handlers(kv, factor, 32, mechanism)
    calls = _record_lone_kernel_calls(h)
    planned = {"n": 0}
    plan = SingleDirectionOffloadingHandler.plan
    from kvcache_offload.dataplane.handlers.cuda import held_units as held_units_module

    native_hold = held_units_module._hold_units_native
    held_in_c: list[int] = []

    def counted_hold(*args):
        outcome = native_hold(*args)
        held_in_c.append(outcome)
        return outcome

    def counted_plan(self, spec):
        planned["n"] += 1
        return plan(self, spec)

    try:
        SingleDirectionOffloadingHandler.plan = counted_plan
        if native_hold is not None:  # the extension's one-call hold, where it is built
            held_units_module._hold_units_native = counted_hold
        rng = np.random.default_rng(factor)
        store, load = h.gpu_to_cpu_handler, h.cpu_to_gpu_handler
        store.set_batching(True)
        load.set_batching(True)
        gpu_free = [int(x) for x in rng.permutation(64)]
        cpu_free = [int(x) for x in rng.permutation(32)]

        def job(blocks: int, start: int = 0, slots: list[int] | None = None) -> Job:
            skip = start % factor
            gpu_ids = [gpu_free.pop() for _ in range(blocks)]
            if slots is None:
                slots = [cpu_free.pop() for _ in range(-(-(blocks + skip) // factor))]
            fragments = [
                (0, gpu_ids[i], slots[(skip + i) // factor], (skip + i) % factor)
                for i in range(blocks)
            ]
            return Job(
                GPULoadStoreSpec(np.array(gpu_ids), [blocks], [start]),
                CPULoadStoreSpec(np.array(slots)),
                fragments,
            )

        a, b, c, d = job(8, factor - 1), job(2), job(1), job(3)
        e = job(2, slots=[int(x) for x in b.cpu_spec.block_ids])  # rewrites b's slots
        g_job = job(1)
        cpu_tensors = h.cpu_tensors
        gpu_tensors = [t.tensor for t in kv.tensors]
        poison(cpu_tensors)
        expected = snapshot(cpu_tensors)
        order = [a, b, c, d, e, g_job]
        for i, j in enumerate(order):
            assert store.transfer_async(100 + i, (j.gpu_spec, j.cpu_spec))
        store.flush()
        results = finish(store, [100 + i for i in range(len(order))])
        assert [r.job_id for r in results] == [100 + i for i in range(len(order))]
        for r, j in zip(results, order, strict=True):
            assert r.success and r.transfer_size == job_bytes(kv, j)
        for j in order:
            expected = expected_after_store(kv, expected, j)
        assert_same(cpu_tensors, expected)  # e landed after b: its bytes won
        # a alone, then b, c and d as one kernel copy behind it; e and g, a batch with a
        # planned job (e waited for b's batch), through the general path.
        assert len(calls) == 2 and calls[0] is None and calls[1] is not None
        assert planned["n"] == 2  # e when it could not be held, and g at the mixed flush
        assert store.jobs_by_mechanism["kernel"] == len(order)

        # Loads back into poisoned GPU blocks: a alone, the rest one held batch.
        poison(gpu_tensors)
        gpu_expected = snapshot(gpu_tensors)
        cpu_now = snapshot(cpu_tensors)
        loads = [a, c, d, g_job]
        for i, j in enumerate(loads):
            assert load.transfer_async(200 + i, (j.cpu_spec, j.gpu_spec))
        load.flush()
        results = finish(load, [200 + i for i in range(len(loads))])
        assert all(r.success for r in results)
        for j in loads:
            gpu_expected = expected_after_load(kv, gpu_expected, cpu_now, j)
        assert_same(gpu_tensors, gpu_expected)
        assert len(calls) == 4 and calls[3] is not None
        assert planned["n"] == 2
        _assert_issued_from_c(h)  # the held batches behind a copy included
        if native_hold is not None:
            # b, c, d, e (refused: b's slots), g behind a; c, d, g behind a's load.
            assert held_in_c == [1, 1, 1, 0, 1, 1, 1, 1]
    finally:
        SingleDirectionOffloadingHandler.plan = plan
        held_units_module._hold_units_native = native_hold
        h.shutdown()


def test_a_held_batch_goes_out_once_it_matches_the_bytes_in_flight(monkeypatch):
    # Behind copies in flight, jobs are held for the end of the loop tick, but a batch goes
    # out early once it holds batch_min_bytes and at least as many bytes as its direction has
    # in flight (the copy queued behind never runs dry), and always at batch_max_bytes.
    # Every job still lands exactly, in order.
    from kvcache_offload.contracts.load_store_spec import GPULoadStoreSpec
    from kvcache_offload.dataplane.handlers.cuda.inflight import InFlightCopy
    from tests._roundtrip import Job

    skip_unless_available("kernel")
    kv = _one_group_caches(41)
    h = _handlers(kv, 1, 32, "kernel")

    def store_job(gpu_ids: list[int], slots: list[int]) -> Job:
        return Job(
            GPULoadStoreSpec(np.array(gpu_ids), [len(gpu_ids)], [0]),
            CPULoadStoreSpec(np.array(slots)),
            [(0, g, s, 0) for g, s in zip(gpu_ids, slots, strict=True)],
        )

    try:
        store = h.gpu_to_cpu_handler
        store.set_batching(True)
        block = job_bytes(kv, store_job([0], [0]))
        # Half a block off each bound, so the test does not hang on how a padded page counts.
        store.batch_min_bytes, store.batch_max_bytes = 3 * block // 2, 11 * block // 2
        cpu_tensors = h.cpu_tensors
        poison(cpu_tensors)
        expected = snapshot(cpu_tensors)
        jobs: list[Job] = []

        def submit(gpu_ids: list[int]) -> bool:
            """Submit a store of ``gpu_ids`` into the same slots; whether jobs are held."""
            j = store_job(gpu_ids, gpu_ids)
            assert store.transfer_async(300 + len(jobs), (j.gpu_spec, j.cpu_spec))
            jobs.append(j)
            return store.holds_jobs()

        monkeypatch.setattr(InFlightCopy, "done", lambda self: False)  # nothing ends meanwhile
        assert not submit([0, 1, 2, 3])  # an idle direction: out at once, 4 blocks in flight
        # 1 block held, 2 (over the minimum, less than in flight), 3, then 4: out.
        assert [submit([10 + i]) for i in range(4)] == [True, True, True, False]
        assert store.describe()["batches"] == 1
        # 8 blocks in flight now: held up to the maximum (5.5 blocks).
        assert [submit([20 + i]) for i in range(6)] == [True] * 5 + [False]
        assert store.describe()["batches"] == 2
        assert submit([30])  # held until the flush
        monkeypatch.undo()
        store.flush()
        ids = [300 + i for i in range(len(jobs))]
        results = finish(store, ids)
        assert [r.job_id for r in results] == ids and all(r.success for r in results)
        for j in jobs:
            expected = expected_after_store(kv, expected, j)
        assert_same(cpu_tensors, expected)
    finally:
        h.shutdown()


def _thread_cpu_s(native_id: int) -> float:
    """CPU seconds a thread of this process has used (Linux: /proc's schedstat, ns)."""
    with open(f"/proc/self/task/{native_id}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


@pytest.mark.parametrize("mechanism", ["kernel", "staged", "dma"])
def test_waits_sleep_through_their_own_event_and_copies_record_no_blocking_events(mechanism):
    # Blocking-sync events cost the driver an interrupt per record, so the copies' events
    # spin and only a thread that sleeps until a copy ends waits on a blocking event of its
    # own (EndWait). That thread must still sleep, not spin: here the copy waits ~0.2 s for
    # the compute stream, during which neither the watcher thread nor a caller in wait()
    # may burn the CPU, and both must still see the copy end with the right bytes.
    import os
    import threading

    from kvcache_offload.contracts.load_store_spec import GPULoadStoreSpec
    from kvcache_offload.dataplane.handlers.cuda.end_wait import end_wait_available

    skip_unless_available(mechanism)
    if not end_wait_available():
        pytest.skip("the _kernel_issue extension is not built")
    if not os.path.exists("/proc/self/task"):
        pytest.skip("reads thread CPU times from /proc")
    kv = make_caches(
        num_tensors=1,
        num_gpu_blocks=64,
        page=65536,
        group_layers=[[(0, 65536)]],
        gen=torch.Generator().manual_seed(12),
        device="cuda",
    )
    h = _handlers(kv, 1, 64, mechanism)
    stores = h.gpu_to_cpu_handler
    try:
        assert stores.describe()["sleeps_through_end_wait"]
        assert not stores._pools.blocking_events
        gpu = kv.tensors[0].tensor
        ended = threading.Event()
        stores.set_completion_callback(ended.set)
        (watcher,) = [t for t in threading.enumerate() if t.name == "kvoffload-done-store"]
        for job_id, (first, value) in enumerate([(0, 42), (1, 43)], start=1):
            ids = np.arange(first, 64, 2)
            gpu_ids = torch.from_numpy(ids).cuda()  # before the sleep: this copy waits
            torch.cuda.synchronize()
            torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU time on the compute stream
            gpu.index_fill_(0, gpu_ids, value)  # no host copy: the host does not wait
            spec = (GPULoadStoreSpec(ids, [len(ids)], [0]), CPULoadStoreSpec(ids))
            watcher_before, caller_before = _thread_cpu_s(watcher.native_id), time.thread_time()
            t0 = time.perf_counter()
            ended.clear()
            assert stores.transfer_async(job_id, spec)
            if job_id == 1:
                assert ended.wait(10.0)  # the watcher slept on its own event, then reported
            else:
                stores.wait({job_id})  # the caller sleeps the same way
            waited = time.perf_counter() - t0
            assert waited > 0.05, "the copy did not wait for the compute stream"
            watcher_cpu = _thread_cpu_s(watcher.native_id) - watcher_before
            caller_cpu = time.thread_time() - caller_before
            assert watcher_cpu < 0.25 * waited, f"the watcher spun: {watcher_cpu:.3f} s CPU"
            if job_id == 2:
                assert caller_cpu < 0.25 * waited, f"wait() spun: {caller_cpu:.3f} s CPU"
            (result,) = finish(stores, [job_id])
            assert result.success
            assert bool((h.cpu_tensors[0][torch.from_numpy(ids)] == value).all())
    finally:
        h.shutdown()
