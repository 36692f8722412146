"""The staged copy path's planning, checked without a GPU.

:class:`StagedCopier.prepare` turns a job into per-chunk kernel tables and DMA pieces. Here
the GPU tensors, the staging ring and the CPU tensors all live in host memory, and a
byte-for-byte emulation of the Triton kernel's table walk plus ``memmove`` for each DMA
piece runs the chunks in issue order. The result must equal the naive reference, with
poisoned destinations, several groups, skip counts, padding, a tensor shared by two
groups, chunks smaller than a job and a ring shorter than the chunk count.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvcache_offload.dataplane.copy.plan import SideGeometry, refs_arrays  # noqa: E402
from kvcache_offload.dataplane.copy.plan_builder import build_plan, parse_job  # noqa: E402
from kvcache_offload.dataplane.copy.staged import (  # noqa: E402
    StagedCopier,
    StagedJob,
    StagingConfig,
)
from kvcache_offload.dataplane.copy.triton_kernel import GROUP_ROW  # noqa: E402
from kvcache_offload.dataplane.handlers.cpu_backend import allocate_cpu_tensors  # noqa: E402
from tests._roundtrip import (  # noqa: E402
    assert_same,
    expected_after_load,
    expected_after_store,
    make_caches,
    poison,
    random_job,
    snapshot,
)


class _HostTable:
    def __init__(self) -> None:
        self.host = np.zeros(0, dtype=np.int64)

    def ensure(self, entries: int, need_device: bool) -> np.ndarray:
        if len(self.host) < entries:
            self.host = np.zeros(entries, dtype=np.int64)
        return self.host


def _emulate_kernel(ref: np.ndarray, table: np.ndarray, chunk, src_f: int, dst_f: int) -> None:
    """What ``_uva_copy_kernel`` does for one launch, pair by pair."""
    units = table[GROUP_ROW * chunk.n_groups :]
    for k in range(chunk.n_groups):
        pair_start, n, ref_start, unit_start = table[GROUP_ROW * k : GROUP_ROW * (k + 1)]
        stop = table[GROUP_ROW * (k + 1)] if k + 1 < chunk.n_groups else chunk.total_pairs
        for local in range(int(stop - pair_start)):
            r, i = divmod(local, int(n))
            row = ref[ref_start + r]
            su, du = units[unit_start + i], units[chunk.n_units + unit_start + i]
            src = row[0] + (su // src_f) * row[1] + (su % src_f) * row[2]
            dst = row[3] + (du // dst_f) * row[4] + (du % dst_f) * row[5]
            ctypes.memmove(int(dst), int(src), int(row[6]))


def _run(copier: StagedCopier, plan, ring: list[np.ndarray], first_slot: int = 0) -> int:
    base = np.asarray([a.ctypes.data for a in ring], dtype=np.int64)
    copier._ring_base = base
    tables, _align = copier.ref_tables(base)
    job = StagedJob(plan, None, None, _HostTable())  # type: ignore[arg-type]
    prep = copier.prepare(job, first_slot)
    table = job.table.host
    f = copier.layout.factor
    src_f, dst_f = (1, f) if copier.gpu_to_cpu else (f, 1)
    for c, chunk in enumerate(prep.chunks):
        ref = tables[(first_slot + c) % copier.config.depth]
        view = table[chunk.table_offset :]
        if not copier.gpu_to_cpu:
            for i in range(chunk.piece_lo, chunk.piece_hi):
                ctypes.memmove(int(prep.dma_dst[i]), int(prep.dma_src[i]), int(prep.dma_size[i]))
        _emulate_kernel(ref, view, chunk, src_f, dst_f)
        if copier.gpu_to_cpu:
            for i in range(chunk.piece_lo, chunk.piece_hi):
                ctypes.memmove(int(prep.dma_dst[i]), int(prep.dma_src[i]), int(prep.dma_size[i]))
    return len(prep.dma_size)


def _copiers(gpu, cpu, factor, kv, chunk_bytes, depth):
    refs = [refs_arrays(r) for r in kv.group_data_refs]
    cfg = StagingConfig(chunk_bytes=chunk_bytes, depth=depth)
    store = StagedCopier(gpu, cpu, factor, refs, True, None, config=cfg)  # type: ignore[arg-type]
    load = StagedCopier(gpu, cpu, factor, refs, False, None, config=cfg)  # type: ignore[arg-type]
    return store, load, refs


def _plan(spec, gpu_to_cpu, refs, gpu, cpu, factor):
    src_ids, dst_ids, sizes, starts = parse_job(spec, gpu_to_cpu)
    g, c = SideGeometry.from_tensors(gpu, 1), SideGeometry.from_tensors(cpu, factor)
    src, dst = (g, c) if gpu_to_cpu else (c, g)
    return build_plan(src_ids, dst_ids, sizes, starts, refs, src, dst)


@pytest.mark.parametrize("block_major", [True, False])
@pytest.mark.parametrize("factor", [1, 3])
@pytest.mark.parametrize(("chunk_cells", "depth"), [(1, 1), (2, 2), (5, 3), (1000, 2)])
def test_staged_plan_round_trip_is_byte_exact(block_major, factor, chunk_cells, depth):
    gen = torch.Generator().manual_seed(factor * 100 + chunk_cells)
    rng = np.random.default_rng(factor + depth)
    kv = make_caches(
        num_tensors=3,
        num_gpu_blocks=64,
        page=512,
        # a padded ref, a group sharing tensor 0, an empty group
        group_layers=[[(0, 512), (1, 400)], [(2, 512)], [(0, 128)], []],
        gen=gen,
    )
    gpu = [t.tensor for t in kv.tensors]
    if block_major:
        cpu = allocate_cpu_tensors(gpu, factor, 30)
    else:
        cpu = [torch.zeros((30, 512 * factor), dtype=torch.int8) for _ in gpu]
    cell = 3 * 512 * factor
    store, load, refs = _copiers(gpu, cpu, factor, kv, chunk_cells * cell, depth)
    job = random_job(
        rng,
        group_sizes=[11, 7, 5, 4],
        block_indices=[factor - 1, 2, 1, 3],
        factor=factor,
        num_gpu_blocks=64,
        num_cpu_blocks=30,
    )
    ring = [np.zeros(store.buffer_bytes, dtype=np.uint8) for _ in range(depth)]
    poison(cpu)
    cpu_before = snapshot(cpu)
    plan = _plan((job.gpu_spec, job.cpu_spec), True, refs, gpu, cpu, factor)
    _run(store, plan, ring)
    assert_same(cpu, expected_after_store(kv, cpu_before, job))

    gpu_before = snapshot(gpu)
    poison(gpu)
    gpu_poisoned = snapshot(gpu)
    plan = _plan((job.cpu_spec, job.gpu_spec), False, refs, gpu, cpu, factor)
    _run(load, plan, ring)
    assert_same(gpu, expected_after_load(kv, gpu_poisoned, snapshot(cpu), job))
    for g, gpu_block, _slot, _j in job.fragments:
        for ref in kv.group_data_refs[g]:
            n = ref.page_size_bytes
            assert torch.equal(
                gpu[ref.tensor_idx][gpu_block, :n], gpu_before[ref.tensor_idx][gpu_block, :n]
            )


def test_staged_plan_moves_one_piece_per_block_and_coalesces_adjacent_slots():
    gen = torch.Generator().manual_seed(1)
    kv = make_caches(
        num_tensors=4, num_gpu_blocks=32, page=256, group_layers=[[(t, 256) for t in range(4)]],
        gen=gen,
    )  # fmt: skip
    gpu = [t.tensor for t in kv.tensors]
    cpu = allocate_cpu_tensors(gpu, 2, 16)
    store, _load, refs = _copiers(gpu, cpu, 2, kv, 1 << 20, 2)
    assert store.layout.block_major
    from kvcache_offload.contracts.load_store_spec import CPULoadStoreSpec, GPULoadStoreSpec

    # CPU slots 3, 4, 5 are adjacent (one piece), 9 stands alone; 8 GPU blocks, factor 2.
    spec = (GPULoadStoreSpec(np.arange(8), [8], [0]), CPULoadStoreSpec(np.array([3, 4, 5, 9])))
    plan = _plan(spec, True, refs, gpu, cpu, 2)
    ring = [np.zeros(store.buffer_bytes, dtype=np.uint8) for _ in range(2)]
    assert _run(store, plan, ring) == 2
    assert store.layout.estimated_pieces(plan, True) == 4

    # Separate (not block-major) CPU tensors: one piece per tensor per block.
    cpu = [torch.zeros((16, 512), dtype=torch.int8) for _ in gpu]
    store, _load, refs = _copiers(gpu, cpu, 2, kv, 1 << 20, 2)
    assert not store.layout.block_major
    plan = _plan(spec, True, refs, gpu, cpu, 2)
    assert _run(store, plan, ring) == 16


@pytest.mark.parametrize("first_slot", [0, 1, 2])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("tables", ["native", "numpy", "general"])
@pytest.mark.parametrize("chunk_blocks", [8, 2])
def test_whole_block_jobs_take_the_quick_tables_and_stay_byte_exact(
    first_slot, padded, tables, chunk_blocks, monkeypatch
):
    """Whole blocks of one group (what a serving engine submits) skip the general planner;
    both give the same bytes and pieces, in one chunk or several, in whichever ring buffer
    the job starts, with the quick tables written by the host-copy extension or by numpy."""
    from kvcache_offload.contracts.load_store_spec import CPULoadStoreSpec, GPULoadStoreSpec
    from kvcache_offload.dataplane.copy import staged_tables

    quick = tables != "general"
    if tables == "native" and staged_tables._small_tables is None:
        pytest.skip("the host-copy extension is not built")
    if tables == "numpy":
        monkeypatch.setattr(staged_tables, "_small_tables", None)

    gen = torch.Generator().manual_seed(7 + first_slot)
    last = 400 if padded else 512  # a padded ref: the cell is one run, shorter than its stride
    kv = make_caches(
        num_tensors=3, num_gpu_blocks=32, page=512,
        group_layers=[[(0, 512), (1, 512), (2, last)]], gen=gen,
    )  # fmt: skip
    gpu = [t.tensor for t in kv.tensors]
    cpu = allocate_cpu_tensors(gpu, 1, 16)
    store, load, refs = _copiers(gpu, cpu, 1, kv, chunk_blocks * 3 * 512, 3)
    if not quick:
        for copier in (store, load):
            monkeypatch.setattr(copier, "_prepare_small", lambda job, slot: None)
    ring = [np.zeros(store.buffer_bytes, dtype=np.uint8) for _ in range(3)]
    # CPU slots 3, 4, 5 are adjacent: one DMA piece unless the cell is padded or a chunk
    # ends between them (2-block chunks: {3, 4}, {5, 11}, {0}).
    gpu_ids, cpu_ids = np.array([9, 2, 30, 17, 4]), np.array([3, 4, 5, 11, 0])
    fragments = [(0, int(g), int(c), 0) for g, c in zip(gpu_ids, cpu_ids, strict=True)]
    job = type("Job", (), {})()
    job.gpu_spec = GPULoadStoreSpec(gpu_ids, [5], [0])
    job.cpu_spec = CPULoadStoreSpec(cpu_ids)
    job.fragments = fragments

    poison(cpu)
    cpu_before = snapshot(cpu)
    plan = _plan((job.gpu_spec, job.cpu_spec), True, refs, gpu, cpu, 1)
    probe = StagedJob(plan, None, None, _HostTable())  # type: ignore[arg-type]
    assert (store._prepare_small(probe, first_slot) is not None) == quick
    pieces = _run(store, plan, ring, first_slot)
    assert pieces == (5 if padded else 3 if chunk_blocks == 8 else 4)
    assert_same(cpu, expected_after_store(kv, cpu_before, job))

    poison(gpu)
    gpu_poisoned = snapshot(gpu)
    plan = _plan((job.cpu_spec, job.gpu_spec), False, refs, gpu, cpu, 1)
    _run(load, plan, ring, first_slot)
    assert_same(gpu, expected_after_load(kv, gpu_poisoned, snapshot(cpu), job))


def test_private_cpu_tensors_are_block_major_views_of_one_buffer():
    gpu = [torch.zeros((4, n), dtype=torch.int8) for n in (64, 32, 16)]
    cpu = allocate_cpu_tensors(gpu, 2, 5)
    assert [tuple(t.shape) for t in cpu] == [(5, 128), (5, 64), (5, 32)]
    base = cpu[0].data_ptr()
    assert [t.data_ptr() - base for t in cpu] == [0, 128, 192]
    assert all(t.stride() == (224, 1) for t in cpu)
    assert all(bool((t == 0).all()) for t in cpu)


@pytest.mark.parametrize("seed", range(6))
def test_quick_tables_equal_the_general_planners_for_random_whole_block_jobs(seed, monkeypatch):
    """Same kernel tables and DMA pieces as the general planner, for random jobs of many
    blocks across several chunks (adjacent slots included), both directions."""
    from kvcache_offload.contracts.load_store_spec import CPULoadStoreSpec, GPULoadStoreSpec

    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    kv = make_caches(
        num_tensors=2, num_gpu_blocks=64, page=256, group_layers=[[(0, 256), (1, 256)]], gen=gen
    )
    gpu = [t.tensor for t in kv.tensors]
    cpu = allocate_cpu_tensors(gpu, 1, 64)
    chunk_blocks, depth = int(rng.integers(1, 9)), int(rng.integers(1, 4))
    store, load, refs = _copiers(gpu, cpu, 1, kv, chunk_blocks * 512, depth)
    n = int(rng.integers(1, 40))
    start = int(rng.integers(0, 64 - n))
    # Even seeds: one run of adjacent slots with a few swapped out; odd: scattered slots.
    cpu_ids = np.arange(start, start + n) if seed % 2 == 0 else rng.permutation(64)[:n]
    if seed % 2 == 0 and n > 3:
        i, j = rng.choice(n, 2, replace=False)
        cpu_ids[[i, j]] = cpu_ids[[j, i]]
    spec_gpu = GPULoadStoreSpec(rng.permutation(64)[:n], [n], [0])
    spec_cpu = CPULoadStoreSpec(cpu_ids)
    first_slot = int(rng.integers(0, 3))
    for copier, spec, to_cpu in (
        (store, (spec_gpu, spec_cpu), True),
        (load, (spec_cpu, spec_gpu), False),
    ):
        copier._ring_base = np.asarray([1 << 20, 1 << 22, 1 << 24][:depth], dtype=np.int64)
        plan = _plan(spec, to_cpu, refs, gpu, cpu, 1)
        quick_job = StagedJob(plan, None, None, _HostTable())  # type: ignore[arg-type]
        quick = copier._prepare_small(quick_job, first_slot)
        assert quick is not None
        monkeypatch.setattr(copier, "_prepare_small", lambda job, slot: None)
        general_job = StagedJob(plan, None, None, _HostTable())  # type: ignore[arg-type]
        general = copier.prepare(general_job, first_slot)
        monkeypatch.undo()
        for name in ("dma_dst", "dma_src", "dma_size"):
            np.testing.assert_array_equal(getattr(quick, name), getattr(general, name))
        assert len(quick.chunks) == len(general.chunks)
        for a, b in zip(quick.chunks, general.chunks, strict=True):
            assert (a.n_groups, a.n_units, a.total_pairs, a.piece_lo, a.piece_hi) == (
                b.n_groups, b.n_units, b.total_pairs, b.piece_lo, b.piece_hi)  # fmt: skip
            size = GROUP_ROW * a.n_groups + 2 * a.n_units
            np.testing.assert_array_equal(
                quick_job.table.host[a.table_offset : a.table_offset + size],
                general_job.table.host[b.table_offset : b.table_offset + size],
            )
