"""A copy kernel's job table: written on the host, uploaded to the GPU before the launch.

``n_groups`` rows of ``pair_start, units, ref_start, unit_start``, then every source unit,
then every destination unit (``copy/triton_kernel.py`` describes the tables).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvcache_offload.dataplane.copy.dma import CudaRuntime
from kvcache_offload.dataplane.copy.triton_kernel import GROUP_ROW
from kvcache_offload.dataplane.handlers.cuda.inflight import TableSlot

__all__ = ["fill_job_table", "upload_table", "write_group_row"]


def fill_job_table(groups: list[Any], ref_start: np.ndarray, out: np.ndarray) -> int:
    """Group rows then source and destination units; returns the number of units."""
    n_groups = len(groups)
    if n_groups == 1:  # the common case: four scalars and two unit runs, no reductions
        g = groups[0]
        n_units = len(g.src_units)
        write_group_row(out, n_units, int(ref_start[g.index]) + g.ref_offset)
        out[GROUP_ROW : GROUP_ROW + n_units] = g.src_units
        out[GROUP_ROW + n_units : GROUP_ROW + 2 * n_units] = g.dst_units
        return n_units
    counts = np.fromiter((len(g.src_units) for g in groups), np.int64, n_groups)
    refs = np.fromiter((len(g.ref_tensors) for g in groups), np.int64, n_groups)
    n_units = int(counts.sum())
    rows = out[: GROUP_ROW * n_groups].reshape(n_groups, GROUP_ROW)
    pairs = counts * refs
    rows[0, 0] = 0
    np.cumsum(pairs[:-1], out=rows[1:, 0])
    rows[:, 1] = counts
    rows[:, 2] = [ref_start[g.index] + g.ref_offset for g in groups]
    rows[0, 3] = 0
    np.cumsum(counts[:-1], out=rows[1:, 3])
    base = GROUP_ROW * n_groups
    np.concatenate([g.src_units for g in groups], out=out[base : base + n_units])
    np.concatenate([g.dst_units for g in groups], out=out[base + n_units : base + 2 * n_units])
    return n_units


def write_group_row(out: np.ndarray, n_units: int, ref_row: int) -> None:
    """The job table's row of a job of one group: its first pair, its unit count, the row of
    its first ref in the ref table, its first unit."""
    out[0], out[1], out[2], out[3] = 0, n_units, ref_row, 0


def upload_table(
    runtime: CudaRuntime | None, slot: TableSlot, entries: int, stream: torch.cuda.Stream
) -> None:
    """The job table's first ``entries`` values to the GPU, on ``stream``: one runtime
    call where the runtime is loaded, else a dispatched ``copy_``."""
    assert slot.host is not None and slot.dev is not None
    if runtime is not None:
        runtime.memcpy_async(slot.dev_ptr, slot.host_ptr, 8 * entries, stream.cuda_stream)
    else:
        with torch.cuda.stream(stream):
            slot.dev[:entries].copy_(slot.host[:entries], non_blocking=True)
