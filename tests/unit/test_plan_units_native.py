"""The extension's one-group planner writes the same units as the Python planner, and leaves
every malformed job to the Python planner, which names what is wrong."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvcache_offload.dataplane.copy import plan_builder  # noqa: E402
from kvcache_offload.dataplane.copy.plan import SideGeometry, refs_arrays  # noqa: E402
from kvcache_offload.dataplane.copy.plan_builder import PlanBuilder  # noqa: E402
from kvcache_offload.dataplane.handlers.cpu_backend import allocate_cpu_tensors  # noqa: E402
from kvcache_offload.errors import TransferError  # noqa: E402
from tests._roundtrip import make_caches  # noqa: E402

pytestmark = pytest.mark.skipif(
    plan_builder._plan_units is None, reason="the host-copy extension is not built"
)

GPU_BLOCKS, CPU_BLOCKS = 40, 24


def _builders(factor: int, gpu_to_cpu: bool) -> PlanBuilder:
    kv = make_caches(
        num_tensors=2, num_gpu_blocks=GPU_BLOCKS, page=128,
        group_layers=[[(0, 128), (1, 112)]], gen=torch.Generator().manual_seed(factor),
    )  # fmt: skip
    gpu = [t.tensor.view(torch.int8).view(GPU_BLOCKS, -1) for t in kv.tensors]
    cpu = allocate_cpu_tensors(gpu, factor, CPU_BLOCKS, None)
    src_t, dst_t = (gpu, cpu) if gpu_to_cpu else (cpu, gpu)
    src = SideGeometry.from_tensors(src_t, 1 if gpu_to_cpu else factor)
    dst = SideGeometry.from_tensors(dst_t, factor if gpu_to_cpu else 1)
    return PlanBuilder([refs_arrays(r) for r in kv.group_data_refs], src, dst)


def _plan_both_ways(monkeypatch, builder, src_ids, dst_ids, size, start):
    """(native outcome, Python outcome): units of the plan or the TransferError's text."""
    outcomes = []
    for native in (plan_builder._plan_units, None):
        monkeypatch.setattr(plan_builder, "_plan_units", native)
        try:
            plan = builder.build(src_ids, dst_ids, (size,), (start,))
        except TransferError as exc:
            outcomes.append(("error", str(exc)))
            continue
        units = [(g.src_units.tolist(), g.dst_units.tolist()) for g in plan.groups]
        outcomes.append(("plan", units, plan.num_bytes, plan.num_fragments))
    return outcomes


@settings(max_examples=300, deadline=None)
@given(
    factor=st.sampled_from([1, 2, 3]),
    gpu_to_cpu=st.booleans(),
    size=st.integers(-1, 12),
    start=st.integers(-1, 7),
    extra_src=st.sampled_from([0, 0, 0, -1, 1]),
    extra_dst=st.sampled_from([0, 0, 0, -1, 1]),
    bad_id=st.sampled_from([None, None, None, -1, 10**6]),
    seed=st.integers(0, 2**16),
)
def test_native_and_python_planners_agree_on_every_job(
    factor, gpu_to_cpu, size, start, extra_src, extra_dst, bad_id, seed
):
    builder = _builders(factor, gpu_to_cpu)
    rng = np.random.default_rng(seed)
    # Blocks each side needs for `size` pieces starting `start` in, give or take one.
    cpu_blocks = max(0, -(-(max(size, 0) + max(start, 0) % factor) // factor))
    gpu_n, cpu_n = max(size, 0), cpu_blocks
    src_n, dst_n = (gpu_n, cpu_n) if gpu_to_cpu else (cpu_n, gpu_n)
    src_rows = GPU_BLOCKS if gpu_to_cpu else CPU_BLOCKS
    dst_rows = CPU_BLOCKS if gpu_to_cpu else GPU_BLOCKS
    src_ids = rng.integers(0, src_rows, max(0, src_n + extra_src)).astype(np.int64)
    dst_ids = rng.integers(0, dst_rows, max(0, dst_n + extra_dst)).astype(np.int64)
    if bad_id is not None and len(src_ids):
        src_ids[rng.integers(len(src_ids))] = bad_id
    with pytest.MonkeyPatch.context() as m:
        native, python = _plan_both_ways(m, builder, src_ids, dst_ids, size, start)
    assert native == python


@settings(max_examples=100, deadline=None)
@given(
    factor=st.sampled_from([1, 2, 3]),
    gpu_to_cpu=st.booleans(),
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_a_held_batch_plan_from_its_units_equals_the_merge_of_its_jobs_plans(
    factor, gpu_to_cpu, sizes, seed
):
    """What a handler's flush builds from the units its held jobs wrote (one plan, none per
    job) copies the same fragments, in the same order, as merging the jobs' own plans."""
    from kvcache_offload.dataplane.copy.plan import TransferPlan

    builder = _builders(factor, gpu_to_cpu)
    rng = np.random.default_rng(seed)
    plans, src_parts, dst_parts = [], [], []
    for size in sizes:
        start = int(rng.integers(0, factor))
        cpu_n = -(-(size + start % factor) // factor)
        gpu_n = size
        src_n, dst_n = (gpu_n, cpu_n) if gpu_to_cpu else (cpu_n, gpu_n)
        src_ids = rng.integers(0, GPU_BLOCKS if gpu_to_cpu else CPU_BLOCKS, src_n)
        dst_ids = rng.integers(0, CPU_BLOCKS if gpu_to_cpu else GPU_BLOCKS, dst_n)
        src_ids, dst_ids = src_ids.astype(np.int64), dst_ids.astype(np.int64)
        plans.append(builder.build(src_ids, dst_ids, (size,), (start,)))
        units = np.empty(2 * size, dtype=np.int64)
        assert builder.write_single_units(src_ids, dst_ids, size, start, units)
        src_parts.append(units[:size])
        dst_parts.append(units[size:])
    merged = TransferPlan.merge(plans)
    direct = builder.units_plan(np.concatenate(src_parts), np.concatenate(dst_parts))
    assert [
        (g.src_units.tolist(), g.dst_units.tolist(), g.ref_tensors.tolist(), g.index)
        for g in direct.groups
    ] == [
        (g.src_units.tolist(), g.dst_units.tolist(), g.ref_tensors.tolist(), g.index)
        for g in merged.groups
    ]
    assert (direct.num_fragments, direct.num_bytes, direct.max_size, direct.alignment) == (
        merged.num_fragments,
        merged.num_bytes,
        merged.max_size,
        merged.alignment,
    )
    assert direct.uniform_size == merged.uniform_size
