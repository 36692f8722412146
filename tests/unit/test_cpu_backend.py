"""CPU backend: byte-exact round trips, ordering, failures and shutdown of the handlers."""

from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvcache_offload.config import KVCacheLayout, OffloadConfig  # noqa: E402
from kvcache_offload.contracts.kv_caches import CanonicalKVCaches  # noqa: E402
from kvcache_offload.contracts.load_store_spec import CPULoadStoreSpec, GPULoadStoreSpec  # noqa: E402
from kvcache_offload.dataplane.copy.plan import CopySides  # noqa: E402
from kvcache_offload.dataplane.handlers.cpu_backend import (  # noqa: E402
    CpuBackendOffloadingHandlers,
)
from kvcache_offload.dataplane.handlers.host_copy_queue import HostCopyQueue  # noqa: E402
from kvcache_offload.dataplane.handlers.router import OffloadingWorker  # noqa: E402
from kvcache_offload.dataplane.handlers.threaded import (  # noqa: E402
    HOST_INLINE_MAX_BYTES,
    HOST_LONE_INLINE_MAX_BYTES,
    ThreadedOffloadingHandler,
)
from kvcache_offload.dataplane.memory import shared_offload_region  # noqa: E402
from kvcache_offload.dataplane.memory.block_memory import (  # noqa: E402
    HostBlockMemory,
    RegionBlockMemory,
    TensorBlockMemory,
)
from kvcache_offload.dataplane.memory.shared_offload_region import SharedOffloadRegion  # noqa: E402
from kvcache_offload.dataplane.spec import CPUOffloadingSpec  # noqa: E402
from kvcache_offload.errors import ConfigError, TransferError  # noqa: E402
from tests._regions import region_name  # noqa: E402
from tests._roundtrip import (  # noqa: E402
    finish,
    job_bytes,
    make_caches,
    random_job,
    round_trip,
)


def _caches(seed: int, page: int = 512, groups=None, num_gpu_blocks: int = 64):
    gen = torch.Generator().manual_seed(seed)
    return make_caches(
        num_tensors=3,
        num_gpu_blocks=num_gpu_blocks,
        page=page,
        group_layers=groups or [[(0, page), (1, page - 16)], [(2, page)], [(0, page // 4)], []],
        gen=gen,
    )


NATIVE = pytest.mark.skipif(
    not HostCopyQueue.available(), reason="the host-copy extension is not built"
)
QUEUES = [pytest.param(True, id="native-queue", marks=NATIVE), pytest.param(False, id="py-thread")]


@pytest.mark.parametrize("native_queue", QUEUES)
@pytest.mark.parametrize("inline_max_bytes", [0, HOST_INLINE_MAX_BYTES])
@pytest.mark.parametrize("factor", [1, 2, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_round_trip_is_byte_exact_with_groups_skip_counts_and_padding(
    factor, seed, inline_max_bytes, native_queue
):
    # The native copy queue and the Python copy thread (inline 0), and the inline copy of a
    # small job on an idle handler.
    kv = _caches(seed)
    job = random_job(
        np.random.default_rng(seed),
        group_sizes=[11, 6, 0, 4],
        block_indices=[factor - 1, 3, 0, 7],
        factor=factor,
        num_gpu_blocks=64,
        num_cpu_blocks=30,
    )
    h = CpuBackendOffloadingHandlers(
        kv, factor, 30, inline_max_bytes=inline_max_bytes, native_queue=native_queue
    )
    assert h.native_queue is native_queue
    try:
        store, load = round_trip(h, kv, job)
        assert (store.success, load.success) == (True, True)
        assert store.transfer_type == ("GPU", "CPU") and load.transfer_type == ("CPU", "GPU")
        assert store.transfer_size == load.transfer_size == job_bytes(kv, job)
        assert store.transfer_time is not None and store.transfer_time >= 0
    finally:
        h.shutdown()


def test_odd_page_sizes_copy_byte_granular():
    gen = torch.Generator().manual_seed(3)
    kv = make_caches(
        num_tensors=2, num_gpu_blocks=20, page=333, group_layers=[[(0, 331), (1, 333)]], gen=gen
    )
    job = random_job(
        np.random.default_rng(3),
        group_sizes=[9],
        block_indices=[2],
        factor=3,
        num_gpu_blocks=20,
        num_cpu_blocks=10,
    )
    h = CpuBackendOffloadingHandlers(kv, 3, 10)
    try:
        round_trip(h, kv, job)
    finally:
        h.shutdown()


def test_small_staging_splits_a_job_into_batches_and_stays_exact():
    kv = _caches(4, page=4096)
    job = random_job(
        np.random.default_rng(4),
        group_sizes=[20, 9, 0, 0],
        block_indices=[1, 0, 0, 0],
        factor=2,
        num_gpu_blocks=64,
        num_cpu_blocks=40,
    )
    h = CpuBackendOffloadingHandlers(kv, 2, 40, max_staging_bytes=3 * 4096 + 7)
    try:
        round_trip(h, kv, job)
    finally:
        h.shutdown()


@pytest.mark.parametrize("native_queue", QUEUES)
def test_jobs_complete_in_submission_order_and_wait_ignores_unknown_ids(native_queue):
    kv = _caches(5)
    h = CpuBackendOffloadingHandlers(kv, 1, 64, inline_max_bytes=0, native_queue=native_queue)
    store = h.gpu_to_cpu_handler
    rng = np.random.default_rng(5)
    try:
        ids = list(range(10, 30))
        for j in ids:
            job = random_job(
                rng,
                group_sizes=[int(rng.integers(1, 20)), 0, 0, 0],
                block_indices=[0, 0, 0, 0],
                factor=1,
                num_gpu_blocks=64,
                num_cpu_blocks=64,
            )
            assert store.transfer_async(j, (job.gpu_spec, job.cpu_spec))
        store.wait({999, *ids})
        results = store.get_finished()
        assert [r.job_id for r in results] == ids
        assert all(r.success for r in results)
        assert store.get_finished() == []
    finally:
        h.shutdown()


def test_completion_callback_fires_from_the_copy_thread():
    kv = _caches(6)
    h = CpuBackendOffloadingHandlers(kv, 1, 64)
    seen = threading.Event()
    h.gpu_to_cpu_handler.set_completion_callback(seen.set)
    try:
        job = random_job(
            np.random.default_rng(6),
            group_sizes=[3, 0, 0, 0],
            block_indices=[0, 0, 0, 0],
            factor=1,
            num_gpu_blocks=64,
            num_cpu_blocks=64,
        )
        h.gpu_to_cpu_handler.transfer_async(1, (job.gpu_spec, job.cpu_spec))
        assert seen.wait(10)
        finish(h.gpu_to_cpu_handler, [1])
    finally:
        h.shutdown()


@pytest.mark.parametrize(
    "spec",
    [
        # ids out of range
        (GPULoadStoreSpec([0, 64], [2, 0, 0, 0], [0, 0, 0, 0]), CPULoadStoreSpec([0, 1])),
        (GPULoadStoreSpec([0, 1], [2, 0, 0, 0], [0, 0, 0, 0]), CPULoadStoreSpec([0, 64])),
        # too many CPU ids for the groups
        (GPULoadStoreSpec([0, 1], [2, 0, 0, 0], [0, 0, 0, 0]), CPULoadStoreSpec([0, 1, 2])),
        # too few CPU ids
        (GPULoadStoreSpec([0, 1], [2, 0, 0, 0], [0, 0, 0, 0]), CPULoadStoreSpec([0])),
        # wrong number of groups
        (GPULoadStoreSpec([0, 1], [2], [0]), CPULoadStoreSpec([0, 1])),
        # spec types swapped
        (CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([0, 1], [2, 0, 0, 0], [0, 0, 0, 0])),
    ],
)
def test_bad_submission_raises_and_the_router_returns_false(spec):
    kv = _caches(7)
    h = CpuBackendOffloadingHandlers(kv, 1, 64)
    try:
        with pytest.raises(TransferError):
            h.gpu_to_cpu_handler.transfer_async(1, spec)
        worker = OffloadingWorker()
        worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, h.gpu_to_cpu_handler)
        if isinstance(spec[0], GPULoadStoreSpec):
            assert worker.transfer_async(2, spec) is False
        assert h.gpu_to_cpu_handler.get_finished() == []
    finally:
        h.shutdown()


def test_duplicate_job_id_in_flight_is_refused():
    gate = threading.Event()
    h = _gated_handler(gate)
    try:
        spec = _one_block_spec()
        assert h.transfer_async(1, spec)
        with pytest.raises(TransferError, match="already in flight"):
            h.transfer_async(1, spec)
    finally:
        gate.set()
        h.shutdown()


def _one_block_spec():
    return (GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([0]))


def _gated_handler(
    gate: threading.Event,
    fail: bool = False,
    inline_max_bytes: int = 0,
    started: threading.Event | None = None,
) -> ThreadedOffloadingHandler:
    gpu = [torch.zeros((4, 64), dtype=torch.int8)]
    cpu = [torch.zeros((4, 64), dtype=torch.int8)]
    from kvcache_offload.contracts.kv_caches import CanonicalKVCacheRef

    def run(plan, token):
        if started is not None:
            started.set()
        if not gate.wait(10):
            raise AssertionError("gate never opened")
        if fail:
            raise RuntimeError("simulated copy failure")

    return ThreadedOffloadingHandler(
        sides=CopySides(gpu, cpu),
        group_data_refs=[[CanonicalKVCacheRef(0, 64)]],
        gpu_to_cpu=True,
        run_plan=run,
        inline_max_bytes=inline_max_bytes,
    )


def test_an_inline_copy_that_raises_is_reported_as_failed_and_wait_returns():
    gate = threading.Event()
    gate.set()
    h = _gated_handler(gate, fail=True, inline_max_bytes=1 << 20)
    try:
        assert h.transfer_async(1, _one_block_spec())
        h.wait({1})  # an inline job is already done: nothing to wait for
        [result] = h.get_finished()
        assert (result.job_id, result.success) == (1, False)
    finally:
        h.shutdown()


def test_a_copy_that_raises_is_reported_as_failed_in_order():
    gate = threading.Event()
    h = _gated_handler(gate, fail=True)
    try:
        assert h.transfer_async(1, _one_block_spec())
        assert h.transfer_async(2, _one_block_spec())
        assert h.get_finished() == []  # nothing finished while the gate is closed
        gate.set()
        results = finish(h, [1, 2])
        assert [(r.job_id, r.success) for r in results] == [(1, False), (2, False)]
    finally:
        h.shutdown()


def test_shutdown_with_jobs_in_flight_waits_for_the_running_one_and_drops_the_rest():
    gate, started = threading.Event(), threading.Event()
    h = _gated_handler(gate, started=started)
    for j in range(1, 6):
        assert h.transfer_async(j, _one_block_spec())
    assert started.wait(10)  # job 1 runs (else shutdown would rightly cancel it unstarted)
    done = threading.Event()
    t = threading.Thread(target=lambda: (h.shutdown(), done.set()))
    t.start()
    assert not done.wait(0.05)  # blocked on the running job
    gate.set()
    assert done.wait(10)
    t.join(10)
    assert h.get_finished() == []
    with pytest.raises(TransferError, match="shut down"):
        h.transfer_async(9, _one_block_spec())
    h.shutdown()  # idempotent


@pytest.mark.parametrize("native_queue", QUEUES)
def test_loads_and_stores_run_concurrently_and_both_stay_exact(native_queue):
    kv = _caches(8, page=2048, groups=[[(0, 2048), (1, 2048), (2, 2048)]], num_gpu_blocks=128)
    h = CpuBackendOffloadingHandlers(kv, 1, 128, inline_max_bytes=0, native_queue=native_queue)
    try:
        rng = np.random.default_rng(8)
        perm_g, perm_c = rng.permutation(128), rng.permutation(128)
        for t in h.cpu_tensors:
            t.copy_(torch.randint(-128, 128, t.shape, dtype=torch.int8))
        a = (GPULoadStoreSpec(perm_g[:64], [64], [0]), CPULoadStoreSpec(perm_c[:64]))
        b_gpu = GPULoadStoreSpec(perm_g[64:], [64], [0])
        b_cpu = CPULoadStoreSpec(perm_c[64:])
        gpu_before = [t.tensor.clone() for t in kv.tensors]
        cpu_before = [t.clone() for t in h.cpu_tensors]
        assert h.gpu_to_cpu_handler.transfer_async(1, a)
        assert h.cpu_to_gpu_handler.transfer_async(2, (b_cpu, b_gpu))
        finish(h.gpu_to_cpu_handler, [1])
        finish(h.cpu_to_gpu_handler, [2])
        ga, ca = torch.from_numpy(perm_g[:64]), torch.from_numpy(perm_c[:64])
        gb, cb = torch.from_numpy(perm_g[64:]), torch.from_numpy(perm_c[64:])
        for t, g0, c0, c1 in zip(kv.tensors, gpu_before, cpu_before, h.cpu_tensors, strict=True):
            assert torch.equal(c1[ca], g0[ga])  # stored
            assert torch.equal(t.tensor[gb], c0[cb])  # loaded
            assert torch.equal(t.tensor[ga], g0[ga])  # store source untouched
    finally:
        h.shutdown()


def test_block_memory_over_cpu_tensors_sees_stored_blocks_and_feeds_loads():
    kv = _caches(9, groups=[[(0, 512), (1, 500), (2, 512)]])
    h = CpuBackendOffloadingHandlers(kv, 2, 8)
    mem = TensorBlockMemory(h.cpu_tensors)
    try:
        assert mem.block_nbytes == 3 * 512 * 2
        gpu_spec = GPULoadStoreSpec([5, 9], [2], [0])
        h.gpu_to_cpu_handler.transfer_async(1, (gpu_spec, CPULoadStoreSpec([3])))
        finish(h.gpu_to_cpu_handler, [1])
        data = mem.read(3)
        t0 = kv.tensors[0].tensor
        assert data[:512] == t0[5].numpy().tobytes() and data[512:1024] == t0[9].numpy().tobytes()
        # an uploaded block (remote client) is loadable to the "GPU"
        payload = bytes(np.random.default_rng(9).integers(0, 256, mem.block_nbytes, np.uint8))
        mem.write(6, payload)
        h.cpu_to_gpu_handler.transfer_async(2, (CPULoadStoreSpec([6]), gpu_spec))
        finish(h.cpu_to_gpu_handler, [2])
        assert kv.tensors[2].tensor[9].numpy().tobytes() == payload[2048 + 512 : 3072]
        assert kv.tensors[1].tensor[5, :500].numpy().tobytes() == payload[1024 : 1024 + 500]
        assert mem.read_many([6, 3]) == payload + data
    finally:
        mem.close()
        h.shutdown()


def test_host_block_memory_checks_ids_and_sizes():
    from kvcache_offload.errors import CapacityError

    mem = HostBlockMemory(4, 8)
    mem.write_many([1, 2], bytes(range(16)))
    assert mem.read(2) == bytes(range(8, 16))
    with pytest.raises(CapacityError):
        mem.read(4)
    with pytest.raises(TransferError):
        mem.write(0, b"short")
    assert mem.describe()["total_bytes"] == 32


def test_round_trip_through_a_shared_region_views(tmp_path):
    kv = _caches(10, groups=[[(0, 512), (1, 400)], [(2, 512)]])
    region = SharedOffloadRegion(
        "unit-cpu", num_blocks=20, cpu_page_size=3 * 512 * 2, rank=0, shm_dir=tmp_path
    )
    try:
        h = CpuBackendOffloadingHandlers(kv, 2, 20, region)
        job = random_job(
            np.random.default_rng(10),
            group_sizes=[7, 3],
            block_indices=[1, 0],
            factor=2,
            num_gpu_blocks=64,
            num_cpu_blocks=20,
        )
        round_trip(h, kv, job)
        mem = RegionBlockMemory(region)
        slot = int(job.cpu_spec.block_ids[0])
        assert mem.read(slot)[:1024] == h.cpu_tensors[0][slot].numpy().tobytes()
        mem.close()
        h.shutdown()
        del h
    finally:
        region.cleanup()


def test_cpu_page_mismatch_is_a_config_error():
    kv = _caches(11)
    gpu = [t.tensor for t in kv.tensors]
    from kvcache_offload.dataplane.handlers.cuda import SingleDirectionOffloadingHandler

    with pytest.raises(ConfigError):
        SingleDirectionOffloadingHandler(gpu, gpu, 2, kv.group_data_refs, True)


# -- the spec ---------------------------------------------------------------------------------


def _spec(kv: CanonicalKVCaches, **overrides) -> CPUOffloadingSpec:
    per_block = sum(t.page_size_bytes for t in kv.tensors)
    layout = KVCacheLayout(gpu_block_sizes=[16] * 4, bytes_per_block=per_block, num_gpu_blocks=64)
    config = OffloadConfig(cpu_bytes_to_use=per_block * 10, layout=layout, **overrides)
    return CPUOffloadingSpec(config, layout)


def test_spec_builds_cpu_backend_handlers_for_cpu_tensors():
    kv = _caches(12)
    spec = _spec(kv)
    handlers = list(spec.get_handlers(kv))
    assert [(s.medium(), d.medium()) for s, d, _ in handlers] == [("GPU", "CPU"), ("CPU", "GPU")]
    assert spec.num_blocks == 10
    assert next(iter(spec.get_handlers(kv)))[2] is handlers[0][2]  # cached
    mem = spec.get_block_memory()
    assert isinstance(mem, TensorBlockMemory) and mem.num_blocks == 10
    spec.shutdown()
    spec.shutdown()


def test_spec_refuses_cuda_backend_for_cpu_tensors():
    kv = _caches(13)
    with pytest.raises(ConfigError, match="cuda"):
        list(_spec(kv, backend="cuda").get_handlers(kv))


def test_spec_without_handlers_gives_host_block_memory():
    kv = _caches(14)
    spec = _spec(kv)
    mem = spec.get_block_memory()
    assert isinstance(mem, HostBlockMemory)
    assert mem.block_nbytes == spec.kv_bytes_per_offloaded_block
    spec.shutdown()


def test_spec_with_shared_region_maps_views_and_cleans_up(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_offload_region, "DEFAULT_SHM_DIR", str(tmp_path))
    kv = _caches(15)
    spec = _spec(kv, shared_region=True, region_name=region_name("spec-test"))
    list(spec.get_handlers(kv))
    mem = spec.get_block_memory()
    assert isinstance(mem, RegionBlockMemory)
    assert mem.block_nbytes == spec.kv_bytes_per_offloaded_block
    job = random_job(
        np.random.default_rng(15),
        group_sizes=[2, 0, 0, 0],
        block_indices=[0, 0, 0, 0],
        factor=1,
        num_gpu_blocks=64,
        num_cpu_blocks=10,
    )
    store = spec._handlers.gpu_to_cpu_handler
    store.transfer_async(1, (job.gpu_spec, job.cpu_spec))
    finish(store, [1])
    slot, block = int(job.cpu_spec.block_ids[0]), int(job.gpu_spec.block_ids[0])
    assert mem.read(slot)[:512] == kv.tensors[0].tensor[block].numpy().tobytes()
    spec.shutdown()
    assert list(tmp_path.iterdir()) == []


def test_spec_block_memory_region_and_plan_modules_import_without_torch():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import kvcache_offload.dataplane.spec, kvcache_offload.dataplane.memory.block_memory\n"
        "import kvcache_offload.dataplane.memory.shared_offload_region\n"
        "import kvcache_offload.dataplane.copy.plan\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_closing_the_specs_region_block_memory_releases_the_region(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_offload_region, "DEFAULT_SHM_DIR", str(tmp_path))
    kv = _caches(16)
    spec = _spec(kv, shared_region=True, region_name=region_name("svc-close"))
    mem = spec.get_block_memory()  # the service maps every row: waits for one worker more
    assert len(list(tmp_path.iterdir())) == 1
    mem.close()  # what the engine does on aclose
    assert list(tmp_path.iterdir()) == []
    spec.shutdown()


def test_a_small_job_on_an_idle_handler_is_reported_when_submitted():
    kv = _caches(7)
    h = CpuBackendOffloadingHandlers(kv, 1, 64, inline_max_bytes=4096, lone_inline_max_bytes=0)
    seen = threading.Event()
    h.gpu_to_cpu_handler.set_completion_callback(seen.set)
    try:
        small = GPULoadStoreSpec([3], [1, 0, 0, 0], [0, 0, 0, 0]), CPULoadStoreSpec([5])
        assert h.gpu_to_cpu_handler.transfer_async(1, small)
        assert seen.is_set()  # reported at once, no copy thread involved
        [result] = h.gpu_to_cpu_handler.get_finished()
        assert (result.job_id, result.success) == (1, True)
        ids = list(range(40))
        big = GPULoadStoreSpec(ids, [40, 0, 0, 0], [0, 0, 0, 0]), CPULoadStoreSpec(ids)
        assert h.gpu_to_cpu_handler.transfer_async(2, big)  # > 4096 bytes: via the copy thread
        assert [r.job_id for r in finish(h.gpu_to_cpu_handler, [2])] == [2]
    finally:
        h.shutdown()


def _recording_handler(
    gpu_to_cpu: bool,
    copiers: list[str],
    gate: threading.Event | None = None,
    started: threading.Event | None = None,
) -> ThreadedOffloadingHandler:
    """64-byte blocks; inline copies up to 1 block, lone ones up to 4; each copy records the
    thread that ran it, and one on the copy thread sets ``started`` and then waits for
    ``gate`` (when given)."""
    gpu = [torch.zeros((8, 64), dtype=torch.int8)]
    cpu = [torch.zeros((8, 64), dtype=torch.int8)]
    from kvcache_offload.contracts.kv_caches import CanonicalKVCacheRef

    here = threading.current_thread()

    def run(plan, token):
        copiers.append(threading.current_thread().name)
        if threading.current_thread() is here:
            return
        if started is not None:
            started.set()
        if gate is not None and not gate.wait(10):
            raise AssertionError("gate never opened")

    return ThreadedOffloadingHandler(
        sides=CopySides(gpu, cpu) if gpu_to_cpu else CopySides(cpu, gpu),
        group_data_refs=[[CanonicalKVCacheRef(0, 64)]],
        gpu_to_cpu=gpu_to_cpu,
        run_plan=run,
        thread_name="copy-" + ("store" if gpu_to_cpu else "load"),
        inline_max_bytes=64,
        lone_inline_max_bytes=256,
    )


def _blocks_spec(gpu_to_cpu: bool, blocks: list[int]):
    gpu, cpu = GPULoadStoreSpec(blocks, [len(blocks)], [0]), CPULoadStoreSpec(blocks)
    return (gpu, cpu) if gpu_to_cpu else (cpu, gpu)


def test_a_lone_job_is_copied_inline_only_while_the_other_direction_is_idle():
    here = threading.current_thread().name
    copiers: list[str] = []
    gate, load_started = threading.Event(), threading.Event()
    store = _recording_handler(True, copiers)
    load = _recording_handler(False, copiers, gate, load_started)
    store.pair_with(load)
    try:
        # Both idle: a 2-block job (above the 1-block limit, within the lone one) is copied
        # by the submitting thread, and is done when submitted.
        assert store.transfer_async(1, _blocks_spec(True, [0, 1]))
        assert copiers == [here]
        assert [r.job_id for r in store.get_finished()] == [1]
        # Above the lone limit: the copy thread.
        assert load.transfer_async(2, _blocks_spec(False, [0, 1, 2, 3, 4]))
        assert load_started.wait(10)  # its copy thread has recorded itself
        # The load direction copies (held at the gate): the store's 1-block job is still
        # copied inline, its 2-block job goes to the store's own thread.
        assert store.transfer_async(3, _blocks_spec(True, [4]))
        assert copiers[-1] == here
        assert [r.job_id for r in store.get_finished()] == [3]
        assert store.transfer_async(4, _blocks_spec(True, [2, 3]))
        assert [r.job_id for r in finish(store, [4])] == [4]
        assert copiers[-1] == "copy-store"
        gate.set()
        assert [r.job_id for r in finish(load, [2])] == [2]
        assert sorted(copiers) == sorted([here, here, "copy-load", "copy-store"])
        # Both idle again: inline again, in either direction.
        assert load.transfer_async(5, _blocks_spec(False, [0, 1, 2]))
        assert copiers[-1] == here
        assert [r.job_id for r in load.get_finished()] == [5]
    finally:
        gate.set()
        store.shutdown()
        load.shutdown()


def test_an_unpaired_handler_takes_its_own_idle_thread_for_a_lone_engine():
    here = threading.current_thread().name
    copiers: list[str] = []
    store = _recording_handler(True, copiers)
    try:
        assert store.transfer_async(1, _blocks_spec(True, [0, 1, 2]))
        assert copiers == [here]
        assert [r.job_id for r in store.get_finished()] == [1]
    finally:
        store.shutdown()


@pytest.mark.parametrize("native_queue", QUEUES)
def test_the_cpu_backend_copies_a_lone_mid_sized_job_inline_unless_inline_copies_are_off(
    native_queue,
):
    kv = _caches(17, page=1 << 16, groups=[[(0, 1 << 16), (1, 1 << 16), (2, 1 << 16)]])
    ids = list(range(8))  # 1.5 MiB: above HOST_INLINE_MAX_BYTES, within the lone limit
    job = GPULoadStoreSpec(ids, [8], [0]), CPULoadStoreSpec(ids)
    assert HOST_INLINE_MAX_BYTES < 8 * 3 * (1 << 16) <= HOST_LONE_INLINE_MAX_BYTES
    for inline_max_bytes, inline in ((HOST_INLINE_MAX_BYTES, True), (0, False)):
        h = CpuBackendOffloadingHandlers(
            kv, 1, 64, inline_max_bytes=inline_max_bytes, native_queue=native_queue
        )
        store = h.gpu_to_cpu_handler
        assert store._other_direction is h.cpu_to_gpu_handler
        assert h.cpu_to_gpu_handler._other_direction is store
        seen = threading.Event()
        store.set_completion_callback(seen.set)
        try:
            assert store.transfer_async(1, job)
            if inline or native_queue:  # else the copy thread may have called back already
                # An inline copy calls back before transfer_async returns; a native queue's
                # copy never calls back (it signals its descriptor).
                assert seen.is_set() is inline
            assert [r.job_id for r in finish(store, [1])] == [1]
            _assert_cpu_rows_hold(h, {b: b for b in ids})
        finally:
            h.shutdown()


@NATIVE
def test_the_native_queue_announces_each_end_on_its_descriptor_not_the_callback():
    import select

    kv = _caches(11)
    h = CpuBackendOffloadingHandlers(kv, 1, 64, inline_max_bytes=0)
    store = h.gpu_to_cpu_handler
    called = threading.Event()
    store.set_completion_callback(called.set)  # only inline copies call back
    fd = store.completion_fd()
    assert fd is not None
    worker = OffloadingWorker()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, store)
    assert worker.completion_fds() == [fd]
    try:
        job = random_job(
            np.random.default_rng(11), group_sizes=[5, 0, 0, 0], block_indices=[0, 0, 0, 0],
            factor=1, num_gpu_blocks=64, num_cpu_blocks=64,
        )  # fmt: skip
        assert store.transfer_async(1, (job.gpu_spec, job.cpu_spec))
        readable, _, _ = select.select([fd], [], [], 10)
        assert readable == [fd]
        [result] = store.get_finished()
        assert (result.job_id, result.success) == (1, True)
        assert not called.is_set()
    finally:
        h.shutdown()
    assert store.completion_fd() is None


@NATIVE
def test_shutting_down_the_native_queue_drops_queued_jobs_and_refuses_new_ones():
    kv = _caches(12, page=1 << 16, groups=[[(0, 1 << 16), (1, 1 << 16), (2, 1 << 16)]])
    h = CpuBackendOffloadingHandlers(kv, 1, 64, inline_max_bytes=0)
    store = h.gpu_to_cpu_handler
    spec = (GPULoadStoreSpec(np.arange(64), [64], [0]), CPULoadStoreSpec(np.arange(64)))
    for j in range(1, 40):  # 12 MiB each: most are still queued at shutdown
        assert store.transfer_async(j, spec)
    h.shutdown()
    assert store.get_finished() == []
    assert store.num_pending == 0
    with pytest.raises(TransferError, match="shut down"):
        store.transfer_async(99, spec)
    h.shutdown()  # idempotent


@NATIVE
def test_fresh_ref_arrays_of_the_same_refs_reuse_one_native_group():
    import dataclasses

    kv = _caches(13)
    h = CpuBackendOffloadingHandlers(kv, 1, 64, inline_max_bytes=0)
    store = h.gpu_to_cpu_handler
    queue = store._queue
    assert queue is not None
    try:
        spec = (GPULoadStoreSpec([1, 2], [2, 0, 0, 0], [0] * 4), CPULoadStoreSpec([5, 6]))
        plan = store.plan(spec)
        copies = []
        for _ in range(100):  # equal refs, a new array each time (as a split plan would have)
            groups = [dataclasses.replace(g, ref_tensors=g.ref_tensors.copy()) for g in plan.groups]
            copies.append(queue.submit(dataclasses.replace(plan, groups=groups)))
        queue.wait(copies)
        queue.collect()
        assert all(c.done() and not c.cancelled() for c in copies)
        assert len(queue._group_of_refs) == len([g for g in plan.groups if len(g.ref_tensors)])
        gpu = [t.tensor for t in kv.tensors]
        for g in plan.groups:
            for t, size in zip(g.ref_tensors.tolist(), g.ref_sizes.tolist(), strict=True):
                for gb, cb in ((1, 5), (2, 6)):
                    assert torch.equal(
                        h.cpu_tensors[t][cb, :size], gpu[t].view(torch.int8).view(64, -1)[gb, :size]
                    )
    finally:
        h.shutdown()


@pytest.mark.parametrize("native_queue", QUEUES)
def test_a_job_held_behind_one_copied_at_once_is_still_flushed_by_the_poller(native_queue):
    """The poller schedules its end-of-tick flush only when a handler holds a job: the
    first job of the tick is copied at once (idle handler), the second is held behind it
    and must still go out and complete, after the first."""
    import asyncio

    from kvcache_offload.aio.poller import TransferPoller

    kv = _caches(8)
    h = CpuBackendOffloadingHandlers(kv, 1, 64, native_queue=native_queue)
    store = h.gpu_to_cpu_handler
    worker = OffloadingWorker()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, store)
    worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, h.cpu_to_gpu_handler)
    rng = np.random.default_rng(8)
    jobs = [
        random_job(
            rng,
            group_sizes=[2, 0, 0, 0],
            block_indices=[0, 0, 0, 0],
            factor=1,
            num_gpu_blocks=64,
            num_cpu_blocks=64,
        )
        for _ in range(2)
    ]

    async def run() -> list[int]:
        poller = TransferPoller(worker)
        assert poller.batched
        task = asyncio.create_task(poller.run())
        try:
            done: list[int] = []
            futures = []
            for job in jobs:
                spec = (job.gpu_spec, job.cpu_spec)
                futures.append(poller.submit(spec, lambda r: done.append(r.job_id)))
            assert store.holds_jobs()  # the second, behind the first's unreported copy
            results = await asyncio.wait_for(asyncio.gather(*futures), 5)
            assert all(r.success for r in results)
            assert not store.holds_jobs()
            return done
        finally:
            task.cancel()

    try:
        assert asyncio.run(run()) == [0, 1]
    finally:
        h.shutdown()


def _single_group_caches(seed: int, page: int = 1 << 12, num_gpu_blocks: int = 64):
    return _caches(seed, page=page, groups=[[(0, page), (1, page), (2, page)]],
                   num_gpu_blocks=num_gpu_blocks)  # fmt: skip


def _assert_cpu_rows_hold(h, expected: dict[int, int]) -> None:
    """CPU block -> the GPU block whose bytes it must hold (factor 1)."""
    for t_gpu, t_cpu in zip(h.gpu_tensors, h.cpu_tensors, strict=True):
        for cpu_block, gpu_block in expected.items():
            assert torch.equal(t_cpu[cpu_block], t_gpu[gpu_block]), (cpu_block, gpu_block)


@NATIVE
def test_jobs_held_behind_a_queued_copy_go_out_as_units_in_order_and_byte_exact():
    kv = _single_group_caches(21, page=1 << 16)
    h = CpuBackendOffloadingHandlers(kv, 1, 64, native_queue=True)
    store = h.gpu_to_cpu_handler
    store.set_batching(True)
    try:
        big = list(range(32))  # 6 MiB: above the lone limit, so it goes to the queue
        assert store.transfer_async(0, (GPULoadStoreSpec(big, [32], [0]), CPULoadStoreSpec(big)))
        rng = np.random.default_rng(21)
        expected = {b: b for b in big}
        small = []
        for job_id in range(1, 11):
            gpu = [int(b) for b in rng.choice(64, size=2, replace=False)]
            cpu = [32 + job_id % 7, 48 + job_id]  # job_id % 7 repeats: a later job wins
            small.append(job_id)
            assert store.transfer_async(
                job_id, (GPULoadStoreSpec(gpu, [2], [0]), CPULoadStoreSpec(cpu))
            )
            expected.update(zip(cpu, gpu, strict=True))
        held = store.held_jobs().jobs
        assert [job_id for job_id, _ in held] == small
        assert all(type(job).__name__ == "_HeldUnits" for _, job in held)  # no plan built
        store.flush()
        results = finish(store, [0, *small])
        assert [r.job_id for r in results] == [0, *small]
        assert all(r.success for r in results)
        assert [r.transfer_size for r in results[1:]] == [2 * 3 * (1 << 16)] * 10
        _assert_cpu_rows_hold(h, expected)
    finally:
        h.shutdown()


@NATIVE
def test_a_held_batch_mixing_units_and_a_planned_job_is_merged_in_order():
    kv = _single_group_caches(22)
    h = CpuBackendOffloadingHandlers(kv, 1, 64, native_queue=True)
    store = h.gpu_to_cpu_handler
    store.set_batching(True)
    try:
        big = list(range(64))
        assert store.transfer_async(0, (GPULoadStoreSpec(big, [64], [0]), CPULoadStoreSpec(big)))
        # A strided id view: the C planner refuses it, so this job is held as a plan.
        strided = np.arange(0, 8, dtype=np.int64)[::2]
        planned = (
            GPULoadStoreSpec.checked_parts(strided, (4,), (0,)),
            CPULoadStoreSpec([1, 2, 3, 4]),
        )
        assert store.transfer_async(1, (GPULoadStoreSpec([10], [1], [0]), CPULoadStoreSpec([1])))
        assert store.transfer_async(2, planned)
        assert store.transfer_async(3, (GPULoadStoreSpec([20], [1], [0]), CPULoadStoreSpec([4])))
        kinds = [type(job).__name__ for _, job in store.held_jobs().jobs]
        assert kinds == ["_HeldUnits", "TransferPlan", "_HeldUnits"]
        store.flush()
        assert [r.job_id for r in finish(store, [0, 1, 2, 3])] == [0, 1, 2, 3]
        # Job 2 overwrote job 1's block 1, job 3 overwrote job 2's block 4.
        _assert_cpu_rows_hold(h, {0: 0, 1: 0, 2: 2, 3: 4, 4: 20, 5: 5, 63: 63})
    finally:
        h.shutdown()


def _small_engine(layers: int = 2):
    """An engine over ``layers`` CPU tensors of 16 blocks (a 16-block CPU tier), and them."""
    from kvcache_offload.aio import OffloadEngine
    from kvcache_offload.dataplane import layouts

    shape = (16, 2, 16, 2, 32)
    tensors = [torch.randint(-128, 128, shape, dtype=torch.int8) for _ in range(layers)]
    kv = layouts.blocks_first_per_layer(tensors)
    page = layouts.block_nbytes(kv)
    config = OffloadConfig(
        cpu_bytes_to_use=16 * page,
        layout=KVCacheLayout(gpu_block_sizes=[16], bytes_per_block=page, num_gpu_blocks=16),
    )
    return OffloadEngine(config, kv_caches=kv), tensors


async def test_gpu_block_ids_as_a_strided_numpy_view_store_and_load_through_the_engine():
    """A strided view (every other block) is copied, not refused by the C planner's buffer
    check (which would surface as "worker refused job")."""
    from kvcache_offload import make_offload_key

    engine, tensors = _small_engine(layers=4)
    keys = [make_offload_key(bytes([i]) * 8, 0) for i in range(4)]
    evens = np.arange(0, 8, dtype=np.int64)[::2]  # blocks 0, 2, 4, 6: a strided view
    odds = np.arange(8, 16, dtype=np.int64)[1::2]  # blocks 9, 11, 13, 15
    assert not evens.flags.c_contiguous and not odds.flags.c_contiguous
    want = [t[evens].clone() for t in tensors]
    async with engine:
        stored = await engine.store(keys, evens)
        assert stored.keys_stored == keys
        loaded = await engine.load(keys, odds)
        assert loaded.keys_loaded == keys
    for t, w in zip(tensors, want, strict=True):
        assert torch.equal(t[odds], w)


@pytest.mark.parametrize(
    ("blocks", "error", "message"),
    [
        ([0.0, 1.0], ConfigError, "must be integers, got float64"),
        ([True, False], ConfigError, "must be integers, got bool"),
        (["a", "b"], ConfigError, "must be integers"),
        ([0, None], ConfigError, "must be integers, got object"),
        # Not on the host (a CUDA tensor reads the same): no silent device sync.
        (torch.zeros(2, dtype=torch.int64, device="meta"), ConfigError, "in host memory"),
        ([[0, 1], [2]], ConfigError, "must be integers in host memory"),  # ragged
        ([-1, 0], TransferError, r"refused job \d+ \(\w+ -> \w+\): source block ids must be in"),
        ([0, 99], TransferError, r"must be in \[0, 16\), got 0\.\.99"),
    ],
)
async def test_bad_gpu_block_ids_name_the_problem_and_leave_nothing_behind(blocks, error, message):
    from kvcache_offload import make_offload_key

    keys = [make_offload_key(bytes([i]) * 8, 0) for i in range(2)]
    engine, _ = _small_engine()
    async with engine:
        with pytest.raises(error, match=message):
            await engine.store(keys, blocks)
        stats = engine.stats()
        assert (stats.blocks_writing, stats.blocks_reading) == (0, 0)
        assert (await engine.lookup(keys)).hits == 0
        # The engine still works: the same keys store from valid ids.
        assert (await engine.store(keys, np.array([3, 4], dtype=np.int32))).keys_stored == keys
        # Loading into the same bad ids fails alike and unpins the keys.
        with pytest.raises(error, match=message.replace("source", "destination")):
            await engine.load(keys, blocks)
        stats = engine.stats()
        assert (stats.blocks_writing, stats.blocks_reading) == (0, 0)
        assert (await engine.load(keys, [5, 6])).keys_loaded == keys
