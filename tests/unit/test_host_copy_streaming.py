"""Copies into the CPU tier with non-temporal stores: the same bytes as a plain copy."""

from __future__ import annotations

import numpy as np
import pytest

from kvcache_offload.dataplane.copy import host_copy

torch = pytest.importorskip("torch")

from kvcache_offload.dataplane.handlers.cpu_backend import CpuBackendOffloadingHandlers  # noqa: E402
from tests._roundtrip import make_caches, random_job, round_trip  # noqa: E402

native = pytest.mark.skipif(
    not host_copy.native_available(), reason="the _hostcopy extension is not built"
)


def _i64(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


@native
@pytest.mark.parametrize("streaming", [False, True])
def test_copy_units_writes_every_byte_at_any_size_and_alignment(streaming: bool) -> None:
    # Sizes around the streaming threshold and destinations off the 16-byte grid exercise
    # the aligned head, the 64-byte body and the tail of the non-temporal path.
    from kvcache_offload.dataplane.copy._hostcopy import copy_units

    rng = np.random.default_rng(7)
    for size in (1, 15, 4095, 4096, 4097, 4096 + 63, 65_536 + 5, 1 << 20):
        for skew in (0, 1, 8, 15):
            src = rng.integers(0, 256, 2 * size + 64, dtype=np.uint8)
            dst = np.zeros(2 * size + 64 + skew, dtype=np.uint8)
            base_s, base_d = src.ctypes.data, dst.ctypes.data + skew
            # one ref, two units: unit u lives at base + u * size
            copy_units(
                _i64([base_s]), _i64([size]), _i64([0]), 1,
                _i64([base_d]), _i64([size]), _i64([0]), 1,
                _i64([size]), _i64([1, 0]), _i64([0, 1]), streaming,
            )  # fmt: skip
            got = dst[skew : skew + 2 * size]
            want = np.concatenate([src[size : 2 * size], src[:size]])
            assert np.array_equal(got, want), (size, skew)
            assert not dst[:skew].any() and not dst[skew + 2 * size :].any()


def test_the_cpu_backend_streams_stores_only_and_round_trips_exactly() -> None:
    gen = torch.Generator().manual_seed(5)
    kv = make_caches(
        num_tensors=3,
        num_gpu_blocks=32,
        page=8192,
        group_layers=[[(0, 8192), (1, 8000), (2, 8192)]],
        gen=gen,
        device="cpu",
    )
    for stream_stores in (True, False):
        h = CpuBackendOffloadingHandlers(kv, 1, 32, stream_stores=stream_stores)
        try:
            assert h.host_copiers["store"].streaming is stream_stores
            assert h.host_copiers["load"].streaming is False
            rng = np.random.default_rng(int(stream_stores))
            for i, blocks in enumerate((1, 6, 20)):  # inline and queued jobs
                job = random_job(
                    rng, group_sizes=[blocks], block_indices=[0], factor=1,
                    num_gpu_blocks=32, num_cpu_blocks=32,
                )  # fmt: skip
                store, load = round_trip(h, kv, job, job_ids=(2 * i, 2 * i + 1))
                assert store.success and load.success
        finally:
            h.shutdown()


@native
@pytest.mark.parametrize("streaming", [False, True])
def test_a_queue_copying_a_plan_now_writes_what_the_copier_writes(streaming: bool) -> None:
    # A small job that finds its copy thread idle is copied inline through the queue's
    # registered groups (CopyQueue.run_now): the same bytes as HostCopier.run.
    from kvcache_offload.dataplane.copy.host_copy import HostCopier
    from kvcache_offload.dataplane.copy.plan import CopySides
    from kvcache_offload.dataplane.copy.plan_builder import PlanBuilder
    from kvcache_offload.dataplane.handlers.host_copy_queue import HostCopyQueue

    gen = torch.Generator().manual_seed(11)
    kv = make_caches(
        num_tensors=2,
        num_gpu_blocks=16,
        page=4096,
        group_layers=[[(0, 4096), (1, 4000)]],
        gen=gen,
        device="cpu",
    )
    h = CpuBackendOffloadingHandlers(kv, 1, 16)
    sides = CopySides.of_direction(h.gpu_tensors, h.cpu_tensors, 1, True)
    copier = HostCopier(sides, streaming=streaming)
    queue = HostCopyQueue(copier, "test-run-now")
    try:
        assert queue.runs_now
        handler = h.gpu_to_cpu_handler
        planner = PlanBuilder(handler._group_refs, handler.src_geom, handler.dst_geom)
        rng = np.random.default_rng(3)
        job = random_job(
            rng,
            group_sizes=[5],
            block_indices=[0],
            factor=1,
            num_gpu_blocks=16,
            num_cpu_blocks=16,
        )
        plan = planner.plan_job((job.gpu_spec, job.cpu_spec), True)
        for t in h.cpu_tensors:
            t.zero_()
        copier.run(plan)
        want = [t.clone() for t in h.cpu_tensors]
        for t in h.cpu_tensors:
            t.zero_()
        queue.run_now(plan)
        assert all(torch.equal(a, b) for a, b in zip(h.cpu_tensors, want, strict=True))
        assert any(t.any() for t in want)
    finally:
        queue.close()
        h.shutdown()
