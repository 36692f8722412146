"""Turn one transfer job into fragment copies: the vectorised block-id arithmetic.

This is vLLM's ``compute_sub_block_ptrs`` walk (reference section 4.2), done once per job with
numpy and shared by every copy path (the UVA kernel, the batched DMA and the plain-torch
fallback, which is also the CPU backend). No torch here.

Vocabulary:

* A *side* is the source or the destination of a job. The GPU side addresses whole GPU pages
  (factor 1); the CPU side addresses *sub-blocks*: one CPU slot holds ``block_size_factor``
  GPU pages of each canonical tensor back to back.
* A *unit* is the index of a GPU-page-sized piece on one side: ``unit = block * factor + j``
  with ``j`` the sub-block. Its address in canonical tensor ``t`` is
  ``base[t] + (unit // factor) * row_stride[t] + (unit % factor) * sub_bytes[t]``.
* A *fragment* is one contiguous copy: one unit of one layer's canonical tensor, of the
  layer's un-padded page size (padding is never copied).

Per group ``g`` the job names ``group_sizes[g]`` GPU blocks starting at logical index
``block_indices[g]``; a side with factor ``f`` skips ``block_indices[g] % f`` leading units
of its first block, and consumes ``ceil((group_size + skip) / f)`` block ids. Every id of
both specs must be consumed exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcache_offload._imports import lazy_exports
from kvcache_offload.contracts.kv_caches import CanonicalKVCacheRef
from kvcache_offload.errors import TransferError

__all__ = [
    "CopySides",
    "GroupPlan",
    "SideGeometry",
    "TransferPlan",
    "alignment_of",
    "geometry_alignment",
    "refs_arrays",
]

# Building a job's plan lives in plan_builder (which imports this module); its names stay
# importable from here, loaded on first use.
__getattr__ = lazy_exports(
    __name__,
    dict.fromkeys(
        ("PlanBuilder", "build_plan", "parse_job"), "kvcache_offload.dataplane.copy.plan_builder"
    ),
)


_SMALL_TABLE = 16
"""Fragments of one group up to which the pointer table is filled with Python ints."""


@dataclass(frozen=True)
class _RefColumns:
    base: np.ndarray
    stride: np.ndarray
    sub: np.ndarray
    flat: tuple[np.ndarray, np.ndarray, np.ndarray]
    """Base, row stride and sub-block bytes as 1-D contiguous int64 arrays (for C callers)."""
    base_list: list[int]
    stride_list: list[int]
    sub_list: list[int]


@dataclass(frozen=True)
class SideGeometry:
    """Where the canonical tensors of one side live (int8 tensors, so strides are bytes)."""

    base: np.ndarray
    """``(T,)`` int64 data pointers."""
    row_stride: np.ndarray
    """``(T,)`` int64 bytes between consecutive blocks (rows)."""
    sub_bytes: np.ndarray
    """``(T,)`` int64 bytes between consecutive sub-blocks of one row (the GPU page)."""
    num_rows: int
    """Blocks per tensor (the smallest over the tensors)."""
    factor: int
    """Sub-blocks per row: 1 on the GPU side, ``block_size_factor`` on the CPU side."""

    def of_refs(self, tensors: np.ndarray) -> _RefColumns:
        """Base, row stride and sub-block bytes of the refs' tensors, as ``(R, 1)`` columns,
        as flat arrays and as Python lists (for jobs too small to amortise numpy calls).

        A handler's groups pass the same ref arrays job after job, so the gathers are done
        once per array and kept (the array is kept with them, so its id stays valid)."""
        cache: dict[int, tuple[np.ndarray, _RefColumns]]
        cache = self.__dict__.setdefault("_of_refs", {})
        hit = cache.get(id(tensors))
        if hit is not None and hit[0] is tensors:
            return hit[1]
        base, stride, sub = self.base[tensors], self.row_stride[tensors], self.sub_bytes[tensors]
        cols = _RefColumns(
            base[:, None], stride[:, None], sub[:, None], (base, stride, sub), base.tolist(),
            stride.tolist(), sub.tolist(),
        )  # fmt: skip
        if len(cache) < 64:
            cache[id(tensors)] = (tensors, cols)
        return cols

    @classmethod
    def from_tensors(cls, tensors: Sequence[Any], factor: int) -> SideGeometry:
        """Geometry of 2-D int8 tensors ``(num_rows, factor * sub)`` (torch or numpy)."""
        base, stride, sub, rows = [], [], [], []
        for t in tensors:
            shape = tuple(t.shape)
            if len(shape) != 2:
                raise TransferError(f"canonical tensors must be 2-D, got shape {shape}")
            if shape[1] % factor:
                raise TransferError(
                    f"a row of {shape[1]} bytes cannot hold {factor} equal sub-blocks"
                )
            if hasattr(t, "data_ptr"):
                base.append(int(t.data_ptr()))
                stride.append(int(t.stride(0)))
            else:  # numpy
                base.append(int(t.ctypes.data))
                stride.append(int(t.strides[0]))
            sub.append(shape[1] // factor)
            rows.append(shape[0])
        return cls(
            base=np.asarray(base, dtype=np.int64),
            row_stride=np.asarray(stride, dtype=np.int64),
            sub_bytes=np.asarray(sub, dtype=np.int64),
            num_rows=min(rows) if rows else 0,
            factor=factor,
        )


@dataclass(frozen=True)
class CopySides:
    """One direction's source and destination tensors (2-D int8, torch or numpy), with each
    side's sub-blocks per row: 1 on the GPU side, ``block_size_factor`` on the CPU side."""

    src: Sequence[Any]
    dst: Sequence[Any]
    src_factor: int = 1
    dst_factor: int = 1

    @classmethod
    def of_direction(
        cls, gpu: Sequence[Any], cpu: Sequence[Any], factor: int, gpu_to_cpu: bool
    ) -> CopySides:
        """GPU -> CPU (a store) or CPU -> GPU (a load) over the same tensor lists."""
        return cls(gpu, cpu, 1, factor) if gpu_to_cpu else cls(cpu, gpu, factor, 1)

    def geometry(self) -> tuple[SideGeometry, SideGeometry]:
        return (
            SideGeometry.from_tensors(self.src, self.src_factor),
            SideGeometry.from_tensors(self.dst, self.dst_factor),
        )


@dataclass
class GroupPlan:
    """The fragments of one KV-cache group: every ref times every unit pair."""

    ref_tensors: np.ndarray
    """``(R,)`` int64 canonical tensor index of each ref (layer)."""
    ref_sizes: np.ndarray
    """``(R,)`` int64 bytes to copy per fragment of each ref (un-padded page)."""
    src_units: np.ndarray
    """``(G,)`` int64 source units."""
    dst_units: np.ndarray
    """``(G,)`` int64 destination units, co-indexed with ``src_units``."""
    index: int = 0
    """The KV-cache group this is."""
    ref_offset: int = 0
    """Index of the first of ``ref_tensors`` among the group's refs (a job split by refs
    between two mechanisms has parts that start past 0)."""

    @property
    def num_fragments(self) -> int:
        return len(self.ref_tensors) * len(self.src_units)

    @property
    def num_bytes(self) -> int:
        return int(self.ref_sizes.sum()) * len(self.src_units)


@dataclass
class TransferPlan:
    groups: list[GroupPlan]
    num_fragments: int
    num_bytes: int
    uniform_size: int | None
    """The fragment size when every fragment has the same size, else None."""
    max_size: int
    alignment: int
    """Largest power of two (<= 16) dividing every fragment size; pointers checked apart."""

    @classmethod
    def of_groups(cls, groups: list[GroupPlan]) -> TransferPlan:
        groups = [g for g in groups if g.num_fragments]
        sizes = {int(s) for g in groups for s in g.ref_sizes}
        bits = 0
        for s in sizes:
            bits |= s
        alignment = alignment_of(bits)
        return cls(
            groups=groups,
            num_fragments=sum(g.num_fragments for g in groups),
            num_bytes=sum(g.num_bytes for g in groups),
            uniform_size=next(iter(sizes)) if len(sizes) == 1 else None,
            max_size=max(sizes, default=0),
            alignment=alignment,
        )

    @classmethod
    def merge(cls, plans: Sequence[TransferPlan]) -> TransferPlan:
        """One plan that copies every fragment of ``plans`` (jobs of one handler, so a KV-cache
        group has the same refs in each): each group's units are concatenated in order."""
        by_group: dict[int, list[GroupPlan]] = {}
        # The totals in the same pass (a batch merges one plan per job: no generator each).
        first_plan = plans[0]
        uniform_size = first_plan.uniform_size
        max_size, alignment = first_plan.max_size, first_plan.alignment
        num_fragments = num_bytes = 0
        for plan in plans:
            for g in plan.groups:
                by_group.setdefault(g.index, []).append(g)
            num_fragments += plan.num_fragments
            num_bytes += plan.num_bytes
            if uniform_size is not None and plan.uniform_size != uniform_size:
                uniform_size = None
            if plan.max_size > max_size:
                max_size = plan.max_size
            if plan.alignment < alignment:
                alignment = plan.alignment
        groups = []
        for index in sorted(by_group):
            parts = by_group[index]
            first = parts[0]
            if len(parts) == 1:
                groups.append(first)
                continue
            groups.append(
                GroupPlan(
                    first.ref_tensors,
                    first.ref_sizes,
                    np.concatenate([g.src_units for g in parts]),
                    np.concatenate([g.dst_units for g in parts]),
                    index,
                    first.ref_offset,
                )
            )
        return cls(groups, num_fragments, num_bytes, uniform_size, max_size, alignment)

    def fill_pointer_table(
        self, src: SideGeometry, dst: SideGeometry, out: np.ndarray
    ) -> np.ndarray:
        """Write absolute addresses into ``out[0]`` (src), ``out[1]`` (dst) and, when
        ``out`` has three rows, sizes into ``out[2]``; fragments ordered group by group,
        ref-major. Returns ``out[:, :num_fragments]``."""
        n = self.num_fragments
        if out.shape[1] < n:
            raise TransferError(f"pointer table holds {out.shape[1]} fragments, need {n}")
        col = 0
        for g in self.groups:
            r, k = len(g.ref_tensors), len(g.src_units)
            if r == 0 or k == 0:
                continue
            t = g.ref_tensors
            small = r * k <= _SMALL_TABLE
            for side, units, row in ((src, g.src_units, 0), (dst, g.dst_units, 1)):
                refs = side.of_refs(t)
                if small:  # a few fragments: Python ints beat a dozen tiny numpy calls
                    f = side.factor
                    us = [divmod(u, f) for u in units.tolist()]
                    cols = zip(refs.base_list, refs.stride_list, refs.sub_list, strict=True)
                    out[row, col : col + r * k] = [
                        b + q * st + m * sb for b, st, sb in cols for q, m in us
                    ]
                    continue
                block = out[row, col : col + r * k].reshape(r, k)
                if side.factor == 1:
                    np.multiply(units, refs.stride, out=block)
                else:
                    rows, subs = np.divmod(units, side.factor)
                    np.multiply(rows, refs.stride, out=block)
                    block += subs * refs.sub
                block += refs.base
            if out.shape[0] > 2:
                if small:
                    out[2, col : col + r * k] = [s for s in g.ref_sizes.tolist() for _ in range(k)]
                else:
                    out[2, col : col + r * k].reshape(r, k)[:] = g.ref_sizes[:, None]
            col += r * k
        return out[:, :n]


def refs_arrays(refs: Sequence[CanonicalKVCacheRef]) -> tuple[np.ndarray, np.ndarray]:
    """``(tensor indices, page sizes)`` of one group's refs as int64 arrays."""
    return (
        np.fromiter((r.tensor_idx for r in refs), dtype=np.int64, count=len(refs)),
        np.fromiter((r.page_size_bytes for r in refs), dtype=np.int64, count=len(refs)),
    )


def geometry_alignment(*sides: SideGeometry) -> int:
    """Largest power of two (<= 16) dividing every base, row stride and sub-block size."""
    bits = 0
    for side in sides:
        for arr in (side.base, side.row_stride, side.sub_bytes):
            if len(arr):
                bits |= int(np.bitwise_or.reduce(arr))
    return alignment_of(bits)


def alignment_of(bits: int) -> int:
    """Largest power of two (<= 16) dividing ``bits``, an OR of sizes or addresses."""
    alignment = 16
    while alignment > 1 and bits % alignment:
        alignment //= 2
    return alignment
