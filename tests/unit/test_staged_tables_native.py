"""The extension's tables of a whole-block staged job are the numpy fallback's, byte for byte,
and it refuses input that would make it write outside its buffers.

``StagedTables._prepare_small`` writes a serving job's kernel tables and DMA pieces in one
call of ``staged_small_tables``; its numpy body is the fallback where the extension is not
built. The GPU consumes only those bytes, so the contract is identity: the same job table
(every entry, the padding the numpy body leaves alone included), the same pieces and the
same chunks, for any job size, chunk size, ring depth and first ring buffer, both
directions, adjacent and scattered CPU slots, padded and unpadded cells.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvcache_offload.contracts.load_store_spec import (  # noqa: E402
    CPULoadStoreSpec,
    GPULoadStoreSpec,
)
from kvcache_offload.dataplane.copy import staged_tables  # noqa: E402
from kvcache_offload.dataplane.copy.plan import SideGeometry, refs_arrays  # noqa: E402
from kvcache_offload.dataplane.copy.plan_builder import build_plan, parse_job  # noqa: E402
from kvcache_offload.dataplane.copy.staged import (  # noqa: E402
    StagedCopier,
    StagedJob,
    StagingConfig,
)
from kvcache_offload.dataplane.copy.triton_kernel import GROUP_ROW  # noqa: E402
from kvcache_offload.dataplane.handlers.cpu_backend import allocate_cpu_tensors  # noqa: E402
from tests._roundtrip import make_caches  # noqa: E402

pytestmark = pytest.mark.skipif(
    staged_tables._small_tables is None, reason="the host-copy extension is not built"
)

BLOCKS = 256
PAGE = 64
SENTINEL = -7
"""What the job table holds before a job: entries a path does not write keep it."""

GEOMETRIES = {
    # (canonical tensors, (tensor, page bytes) refs per group); a CPU cell is one run in each
    "whole": (2, [[(0, PAGE), (1, PAGE)]]),  # a cell is one full run: adjacent slots coalesce
    "padded": (2, [[(0, PAGE), (1, 48)]]),  # one run shorter than the cell: a piece per block
    "two groups": (2, [[(0, PAGE)], [(1, PAGE)]]),  # half a cell each; group 1 at ref row 1
    # CPU rows PAGE / 2 apart (overlapping views): slots two apart look adjacent to the CPU
    # side, but the staging side is not, so nothing may coalesce
    "overlapping rows": (1, [[(0, PAGE)]]),
}


class _Table:
    """A job table as ``TableSlot.ensure`` hands it out, pre-filled with :data:`SENTINEL`."""

    def __init__(self, entries: int) -> None:
        self.host = np.full(entries, SENTINEL, dtype=np.int64)

    def ensure(self, entries: int, need_device: bool) -> np.ndarray:
        assert entries <= len(self.host)
        return self.host


@functools.cache
def _setup(geometry: str, k: int, depth: int, gpu_to_cpu: bool):
    num_tensors, group_layers = GEOMETRIES[geometry]
    kv = make_caches(
        num_tensors=num_tensors, num_gpu_blocks=BLOCKS, page=PAGE, group_layers=group_layers,
        gen=torch.Generator().manual_seed(0),
    )  # fmt: skip
    gpu = [t.tensor for t in kv.tensors]
    if geometry == "overlapping rows":
        flat = torch.zeros(BLOCKS * PAGE, dtype=torch.int8)
        cpu = [flat.as_strided((BLOCKS, PAGE), (PAGE // 2, 1))]
    else:
        cpu = allocate_cpu_tensors(gpu, 1, BLOCKS)
    refs = [refs_arrays(r) for r in kv.group_data_refs]
    copier = StagedCopier(
        gpu, cpu, 1, refs, gpu_to_cpu, None,  # type: ignore[arg-type]
        config=StagingConfig(chunk_bytes=1, depth=depth),
    )  # fmt: skip
    copier.blocks_per_chunk = k  # the chunk size under test, whatever the cell's size
    copier._ring_base = (np.arange(depth, dtype=np.int64) + 1) << 30
    g, c = SideGeometry.from_tensors(gpu, 1), SideGeometry.from_tensors(cpu, 1)
    return copier, refs, (g, c) if gpu_to_cpu else (c, g)


def _prepare_both(monkeypatch, copier, plan, first_slot, table_entries):
    """(C, numpy, C's outcome): each path's PreparedJob and job table, from equal starting
    tables, and whether the C call wrote the first ("ran") or refused the units."""
    native, outcome = staged_tables._small_tables, []

    def spy(*args):
        try:
            result = native(*args)
        except TypeError:
            outcome.append("refused")
            raise
        outcome.append("ran")
        return result

    out = []
    for tables in (spy, None):
        monkeypatch.setattr(staged_tables, "_small_tables", tables)
        job = StagedJob(plan, None, None, _Table(table_entries))  # type: ignore[arg-type]
        prep = copier._prepare_small(job, first_slot)
        assert prep is not None  # both take the whole-block path
        out.append((prep, job.table.host))
    return (*out, outcome)


@settings(max_examples=150, deadline=None)
@given(
    geometry=st.sampled_from(sorted(GEOMETRIES)),
    group=st.integers(0, 1),
    n=st.integers(1, 200),
    k=st.sampled_from([1, 2, 3, 7, 32, 200, 1024]),
    depth=st.integers(1, 3),
    first_slot=st.integers(0, 5),
    gpu_to_cpu=st.booleans(),
    cpu_slots=st.sampled_from(["adjacent", "runs", "scattered", "descending", "every other"]),
    units=st.sampled_from(["int64", "int64", "int64", "int32", "strided"]),
    seed=st.integers(0, 2**16),
)
def test_native_tables_equal_the_numpy_fallbacks(
    geometry, group, n, k, depth, first_slot, gpu_to_cpu, cpu_slots, units, seed
):
    copier, refs, (src, dst) = _setup(geometry, k, depth, gpu_to_cpu)
    group = group if len(refs) > 1 else 0
    rng = np.random.default_rng(seed)
    if cpu_slots == "adjacent":
        start = int(rng.integers(0, BLOCKS - n + 1))
        cpu_ids = np.arange(start, start + n)
    elif cpu_slots == "runs":  # a few adjacent runs, cut at random places
        cpu_ids = rng.permutation(BLOCKS)[:n]
        cpu_ids.sort()
        cut = rng.integers(0, n + 1, 3)
        cpu_ids = np.concatenate(np.split(cpu_ids, np.sort(cut))[::-1])
    elif cpu_slots == "every other" and 2 * n - 1 <= BLOCKS:
        start = int(rng.integers(0, BLOCKS - 2 * n + 2))
        cpu_ids = np.arange(start, start + 2 * n - 1, 2)
    elif cpu_slots == "descending":
        start = int(rng.integers(n - 1, BLOCKS))
        cpu_ids = np.arange(start, start - n, -1)
    else:
        cpu_ids = rng.permutation(BLOCKS)[:n]
    sizes = [0] * len(refs)
    sizes[group] = n
    gpu_spec = GPULoadStoreSpec(rng.permutation(BLOCKS)[:n], sizes, [0] * len(refs))
    cpu_spec = CPULoadStoreSpec(cpu_ids.astype(np.int64))
    spec = (gpu_spec, cpu_spec) if gpu_to_cpu else (cpu_spec, gpu_spec)
    plan = build_plan(*parse_job(spec, gpu_to_cpu), refs, src, dst)
    g = plan.groups[0]
    if units == "int32":  # not what the planners make: the C call refuses, numpy copes
        g.src_units, g.dst_units = g.src_units.astype(np.int32), g.dst_units.astype(np.int32)
    elif units == "strided":
        g.src_units = np.repeat(g.src_units, 2)[::2]
        g.dst_units = np.repeat(g.dst_units, 2)[::2]
    table_entries = staged_tables._small_entries(n, k) + 8
    with pytest.MonkeyPatch.context() as m:
        (native, native_table), (numpy, numpy_table), outcome = _prepare_both(
            m, copier, plan, first_slot, table_entries
        )
    as_planned = all(
        u.dtype == np.int64 and u.flags.c_contiguous for u in (g.src_units, g.dst_units)
    )
    assert outcome == ["ran" if as_planned else "refused"]  # (one strided unit is contiguous)
    np.testing.assert_array_equal(native_table, numpy_table)
    assert native.table_entries == numpy.table_entries
    assert native.chunks == numpy.chunks
    for name in ("dma_dst", "dma_src", "dma_size"):
        a, b = getattr(native, name), getattr(numpy, name)
        assert a.dtype == b.dtype == np.int64 and a.flags.c_contiguous
        np.testing.assert_array_equal(a, b)
    # the chunks' pieces tile the piece arrays in order
    assert native.chunks[0].piece_lo == 0 and native.chunks[-1].piece_hi == len(native.dma_size)
    assert all(a.piece_hi == b.piece_lo for a, b in itertools.pairwise(native.chunks))


def _args(**change):
    """Valid arguments of ``staged_small_tables`` for a 3-block job (a store) in chunks of
    two blocks through a ring of two buffers, with ``change`` applied."""
    n, k, depth = 3, 2, 2
    args = {
        "gpu_units": np.arange(n, dtype=np.int64),
        "cpu_units": np.arange(10, 10 + n, dtype=np.int64),
        "host": np.full(staged_tables._small_entries(n, k), SENTINEL, dtype=np.int64),
        "pieces": np.full(3 * n, SENTINEL, dtype=np.int64),
        "ring_base": np.arange(1, depth + 1, dtype=np.int64) << 30,
        "k": k, "depth": depth, "first_slot": 1, "group_row": GROUP_ROW, "ref_row": 0,
        "refs": 2, "length": 128, "stride": 128, "cpu_start": 1 << 40, "cpu_stride": 128,
        "stage_off": 0, "gpu_to_cpu": True,
    }  # fmt: skip
    args.update(change)
    return args


def _call(args):
    return staged_tables._small_tables(*args.values())


def test_native_tables_fill_a_table_of_exactly_the_needed_size():
    count, chunks = _call(_args())
    assert count == 2  # slots 10, 11 in chunk 0 and 12 in chunk 1 (pieces never cross chunks)
    assert chunks == ((0, 1, 2, 4, 0, 1), (8, 1, 1, 2, 1, 2))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"host": np.zeros(13, dtype=np.int64)}, "job table holds 13 entries, this job needs 14"),
        ({"pieces": np.zeros(8, dtype=np.int64)}, "piece buffer holds 8 entries"),
        ({"cpu_units": np.arange(2, dtype=np.int64)}, "one length"),
        (
            {"gpu_units": np.zeros(0, dtype=np.int64), "cpu_units": np.zeros(0, dtype=np.int64)},
            "one length >= 1",
        ),
        ({"k": 0}, "k >= 1"),
        ({"depth": 0}, "depth >= 1"),
        ({"depth": 3}, "ring_base holds 2 entries, depth is 3"),
        ({"group_row": 3}, "group_row"),
        ({"group_row": 1 << 40}, "group_row"),
    ],
)
def test_native_tables_refuse_bad_input_before_writing(change, message):
    args = _args(**change)
    host, pieces = args["host"].copy(), args["pieces"].copy()
    with pytest.raises(ValueError, match=message):
        _call(args)
    np.testing.assert_array_equal(args["host"], host)
    np.testing.assert_array_equal(args["pieces"], pieces)


@pytest.mark.parametrize(
    "units",
    [
        np.arange(3, dtype=np.int32),
        np.arange(3, dtype=np.uint64),
        np.arange(3, dtype=np.float64),
        np.arange(6, dtype=np.int64)[::2],
        [0, 1, 2],
    ],
    ids=["int32", "uint64", "float64", "strided", "list"],
)
def test_native_tables_refuse_units_that_are_not_contiguous_int64(units):
    args = _args(gpu_units=units)
    host = args["host"].copy()
    with pytest.raises(TypeError, match="gpu_units must be C-contiguous int64"):
        _call(args)
    with pytest.raises(TypeError, match="cpu_units must be C-contiguous int64"):
        _call(_args(cpu_units=units))
    np.testing.assert_array_equal(args["host"], host)


def test_native_tables_need_writable_contiguous_buffers():
    with pytest.raises(TypeError):
        _call(_args(host=bytes(80)))  # read-only
    strided = np.zeros(20, dtype=np.int64)[::2]
    with pytest.raises((TypeError, BufferError, ValueError)):
        _call(_args(host=strided))
