"""CellLayout: where a CPU block's bytes sit in a staging cell, and which runs a job covers.

Plain numpy geometry for :mod:`~kvcache_offload.dataplane.copy.staged`: a staging cell
mirrors a CPU cell, so one DMA piece per covered run moves a block between the two. (Not to
be confused with the KV-cache layouts of :mod:`~kvcache_offload.dataplane.layouts`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvcache_offload.dataplane.copy.plan import SideGeometry, TransferPlan

__all__ = ["CellExtents", "CellLayout"]


@dataclass(frozen=True)
class CellExtents:
    """Contiguous runs of one CPU block's covered bytes, in staging-cell coordinates."""

    stage_off: np.ndarray
    """``(m,)`` offset of each run within a staging cell."""
    length: np.ndarray
    cpu_start: np.ndarray
    """``(m,)`` host address of each run's first byte in CPU block 0."""
    cpu_stride: np.ndarray
    """``(m,)`` bytes between CPU blocks for each run."""


class CellLayout:
    """Where each canonical tensor's pages sit in a staging cell, and which runs a job covers.

    A staging cell mirrors a CPU cell: tensor ``t``'s ``factor`` pages at ``offset[t]``, the
    tensors back to back in canonical order; cells are ``stride`` bytes apart.
    """

    def __init__(
        self,
        gpu: SideGeometry,
        cpu: SideGeometry,
        group_refs: Sequence[tuple[np.ndarray, np.ndarray]],
    ) -> None:
        self.gpu, self.cpu = gpu, cpu
        self.factor = cpu.factor
        self.page = cpu.sub_bytes.astype(np.int64)
        cell_pages = self.page * self.factor
        self.offset = np.concatenate([[0], np.cumsum(cell_pages)[:-1]]).astype(np.int64)
        self.cell_bytes = int(cell_pages.sum())
        self.stride = -(-self.cell_bytes // 16) * 16
        self.group_refs = list(group_refs)
        self._cache: dict[tuple[int, int, int], CellExtents] = {}
        self.full_runs = [
            len(self.extents(g, 0, self.factor).length) if len(refs[0]) else 0
            for g, refs in enumerate(self.group_refs)
        ]

    @property
    def block_major(self) -> bool:
        """Whether a fully covered block is one contiguous host piece."""
        return bool(all(runs <= 1 for runs in self.full_runs))

    def extents(self, group: int, a: int, b: int) -> CellExtents:
        """Runs covered in a block of ``group`` whose sub-blocks ``a <= j < b`` are written."""
        key = (group, a, b)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        tensors, sizes = self.group_refs[group]
        runs: list[tuple[int, int, int, int]] = []  # stage_off, end, cpu_start, cpu_stride
        for t, size in zip(tensors.tolist(), sizes.tolist(), strict=True):
            page, off = int(self.page[t]), int(self.offset[t])
            base, stride = int(self.cpu.base[t]), int(self.cpu.row_stride[t])
            if size == page:
                runs.append((off + a * page, off + b * page, base + a * page, stride))
            else:
                for j in range(a, b):
                    runs.append((off + j * page, off + j * page + size, base + j * page, stride))
        runs.sort()
        merged: list[list[int]] = []
        for s, e, c, st in runs:
            if merged:
                ms, me, mc, mst = merged[-1]
                if s <= me and st == mst and c - s == mc - ms:
                    merged[-1][1] = max(me, e)
                    continue
            merged.append([s, e, c, st])
        arr = np.asarray(merged, dtype=np.int64).reshape(-1, 4)
        ext = CellExtents(
            arr[:, 0].copy(), arr[:, 1] - arr[:, 0], arr[:, 2].copy(), arr[:, 3].copy()
        )
        self._cache[key] = ext
        return ext

    def estimated_pieces(self, plan: TransferPlan, gpu_to_cpu: bool) -> int:
        """About how many DMA pieces ``plan`` needs (full blocks only, no coalescing)."""
        total = 0
        f = self.factor
        for g in plan.groups:
            units = g.dst_units if gpu_to_cpu else g.src_units
            n = len(units)
            if n:
                skip = int(units[0]) % f
                total += -(-(n + skip) // f) * max(1, self.full_runs[g.index])
        return total
