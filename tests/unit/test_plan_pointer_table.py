"""The pointer table a job's plan writes for the DMA and the host copy: every fragment's
source and destination address and size, whether filled with numpy or (small jobs) with
Python ints, equals the address arithmetic done fragment by fragment."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvcache_offload.dataplane.copy import plan as plan_module  # noqa: E402
from kvcache_offload.dataplane.copy.plan import SideGeometry, refs_arrays  # noqa: E402
from kvcache_offload.dataplane.copy.plan_builder import build_plan, parse_job  # noqa: E402
from kvcache_offload.dataplane.handlers.cpu_backend import allocate_cpu_tensors  # noqa: E402
from tests._roundtrip import make_caches, random_job  # noqa: E402


def _expected(plan, src: SideGeometry, dst: SideGeometry) -> np.ndarray:
    rows: list[list[int]] = [[], [], []]
    for g in plan.groups:
        for t, size in zip(g.ref_tensors.tolist(), g.ref_sizes.tolist(), strict=True):
            for su, du in zip(g.src_units.tolist(), g.dst_units.tolist(), strict=True):
                for side, u, row in ((src, su, 0), (dst, du, 1)):
                    q, m = divmod(u, side.factor)
                    addr = int(side.base[t]) + q * int(side.row_stride[t])
                    rows[row].append(addr + m * int(side.sub_bytes[t]))
                rows[2].append(size)
    return np.asarray(rows, dtype=np.int64)


@pytest.mark.parametrize("small_table", [0, 10**9])  # numpy everywhere, Python ints everywhere
@pytest.mark.parametrize("factor", [1, 3])
@pytest.mark.parametrize("gpu_to_cpu", [True, False])
@pytest.mark.parametrize("sizes", [[1, 0], [2, 1], [11, 6]])
def test_table_matches_fragment_by_fragment_arithmetic(
    monkeypatch, small_table, factor, gpu_to_cpu, sizes
):
    monkeypatch.setattr(plan_module, "_SMALL_TABLE", small_table)
    kv = make_caches(
        num_tensors=3,
        num_gpu_blocks=32,
        page=256,
        group_layers=[[(0, 256), (1, 240)], [(2, 128)]],
        gen=torch.Generator().manual_seed(factor),
    )
    gpu = [t.tensor.view(torch.int8).view(32, -1) for t in kv.tensors]
    cpu = allocate_cpu_tensors(gpu, factor, 24, None)
    job = random_job(
        np.random.default_rng(len(sizes) + sum(sizes)),
        group_sizes=sizes,
        block_indices=[factor - 1, 0],
        factor=factor,
        num_gpu_blocks=32,
        num_cpu_blocks=24,
    )
    src_t, dst_t = (gpu, cpu) if gpu_to_cpu else (cpu, gpu)
    src = SideGeometry.from_tensors(src_t, 1 if gpu_to_cpu else factor)
    dst = SideGeometry.from_tensors(dst_t, factor if gpu_to_cpu else 1)
    pair = (job.gpu_spec, job.cpu_spec) if gpu_to_cpu else (job.cpu_spec, job.gpu_spec)
    src_ids, dst_ids, group_sizes, block_indices = parse_job(pair, gpu_to_cpu)
    refs = [refs_arrays(r) for r in kv.group_data_refs]
    plan = build_plan(src_ids, dst_ids, group_sizes, block_indices, refs, src, dst)
    out = np.full((3, plan.num_fragments + 2), -1, dtype=np.int64)
    for _ in range(2):  # the second fill reads the per-geometry cache
        table = plan.fill_pointer_table(src, dst, out)
        assert np.array_equal(table, _expected(plan, src, dst))
    assert (out[:, plan.num_fragments :] == -1).all()  # nothing written past the fragments
