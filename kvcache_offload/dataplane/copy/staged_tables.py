"""The tables of one staged job: the kernel's per-chunk job tables and the DMA pieces.

Pure numpy, no GPU: :class:`StagedTables` is the planning half of
:class:`~kvcache_offload.dataplane.copy.staged.StagedCopier` (which sets the attributes
declared here), so it can be checked byte for byte on a host (``tests/unit/test_staged_plan.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvcache_offload.dataplane.copy.staging_cells import CellLayout
from kvcache_offload.dataplane.copy.staging_config import StagingConfig
from kvcache_offload.dataplane.copy.triton_kernel import GROUP_ROW

if TYPE_CHECKING:
    from kvcache_offload.dataplane.copy.staged_job import StagedJob

try:  # the host-copy extension's tables of a serving job (a dozen numpy calls less per job)
    from kvcache_offload.dataplane.copy._hostcopy import staged_small_tables as _small_tables
except ImportError:  # pragma: no cover - exercised where the extension is not built
    _small_tables = None

__all__ = ["PreparedJob", "StagedChunk", "StagedTables"]


@dataclass
class StagedChunk:
    table_offset: int
    n_groups: int
    n_units: int
    total_pairs: int
    piece_lo: int
    piece_hi: int


@dataclass
class PreparedJob:
    chunks: list[StagedChunk]
    table_entries: int
    dma_dst: np.ndarray
    dma_src: np.ndarray
    dma_size: np.ndarray


class StagedTables:
    """``ref_tables`` (per ring buffer) and ``prepare`` (per job) of one direction."""

    layout: CellLayout
    config: StagingConfig
    gpu_to_cpu: bool
    blocks_per_chunk: int
    _ring_base: np.ndarray
    _ref_start: np.ndarray
    _small_groups: dict[int, _SmallGroup | None]
    """:meth:`_small_group`'s answers by group index (the copier starts it empty)."""

    def ref_tables(self, ring_base: np.ndarray) -> tuple[np.ndarray, int]:
        """The kernel's ref table for each ring buffer (``(depth, refs, 8)``: the GPU side and
        the staging side of every (group, ref)) and the alignment every address keeps."""
        lay, gpu = self.layout, self.layout.gpu
        tables = []
        bits = 0
        for base in ring_base.tolist():
            rows = []
            for tensors, sizes in lay.group_refs:
                if not len(tensors):
                    continue
                stage = [
                    base + lay.offset[tensors],
                    np.full(len(tensors), lay.stride, np.int64),
                    lay.page[tensors],
                ]
                dev = [gpu.base[tensors], gpu.row_stride[tensors], gpu.sub_bytes[tensors]]
                src, dst = (dev, stage) if self.gpu_to_cpu else (stage, dev)
                cols = [np.asarray(c, dtype=np.int64) for c in (*src, *dst, sizes)]
                cols.append(np.zeros(len(tensors), dtype=np.int64))
                rows.append(np.stack(cols, axis=1))
                for c in cols:
                    bits |= int(np.bitwise_or.reduce(c))
            tables.append(np.concatenate(rows) if rows else np.zeros((1, 8), dtype=np.int64))
        align = 16
        while align > 1 and bits % align:
            align //= 2
        return np.ascontiguousarray(np.stack(tables)), align

    def prepare(self, job: StagedJob, first_slot: int = 0) -> PreparedJob:
        """Kernel job tables (into the job's pinned table) and the DMA piece arrays; chunk
        ``c`` goes through ring buffer ``(first_slot + c) % depth``."""
        quick = self._prepare_small(job, first_slot)
        if quick is not None:
            return quick
        lay, f, k = self.layout, self.layout.factor, self.blocks_per_chunk
        plan = job.plan
        per_group = []  # (group, gpu units, stage units abs, chunk of each unit)
        pieces: list[tuple[np.ndarray, ...]] = []
        block_base = 0
        for g in plan.groups:
            cpu_units = g.dst_units if self.gpu_to_cpu else g.src_units
            gpu_units = g.src_units if self.gpu_to_cpu else g.dst_units
            n = len(cpu_units)
            if n == 0 or len(g.ref_tensors) == 0:
                continue
            skip = int(cpu_units[0]) % f
            local = np.arange(skip, skip + n, dtype=np.int64)
            pos = block_base + local // f
            stage_units = pos * f + local % f
            per_group.append((g, gpu_units, stage_units, pos // k))
            nb = (skip + n - 1) // f + 1
            first_unit = np.maximum(np.arange(nb, dtype=np.int64) * f - skip, 0)
            block_ids = cpu_units[first_unit] // f
            positions = block_base + np.arange(nb, dtype=np.int64)
            cats = [(0, 1, skip, min(skip + n, f))]
            if nb > 2:
                cats.append((1, nb - 1, 0, f))
            if nb > 1:
                cats.append((nb - 1, nb, 0, skip + n - (nb - 1) * f))
            for lo, hi, a, b in cats:
                ext = lay.extents(g.index, a, b)
                p, bid = positions[lo:hi], block_ids[lo:hi]
                m = len(ext.length)
                stage = (p % k)[:, None] * lay.stride + ext.stage_off[None, :]
                cpu = ext.cpu_start[None, :] + bid[:, None] * ext.cpu_stride[None, :]
                size = np.broadcast_to(ext.length[None, :], (len(p), m))
                chunk = np.broadcast_to((p // k)[:, None], (len(p), m))
                pieces.append(
                    (stage.reshape(-1), cpu.reshape(-1), size.reshape(-1), chunk.reshape(-1))
                )
            block_base += nb
        n_chunks = -(-block_base // k)
        # DMA pieces: coalesce runs adjacent on both sides within one chunk.
        if pieces:
            stage, cpu, size, chunk = (np.concatenate(c) for c in zip(*pieces, strict=True))
            cont = (
                (chunk[1:] == chunk[:-1])
                & (stage[1:] == stage[:-1] + size[:-1])
                & (cpu[1:] == cpu[:-1] + size[:-1])
            )
            starts = np.flatnonzero(np.concatenate([[True], ~cont]))
            size = np.add.reduceat(size, starts)
            stage, cpu, chunk = stage[starts], cpu[starts], chunk[starts]
            stage = stage + self._ring_base[(chunk + first_slot) % self.config.depth]
            bounds = np.searchsorted(chunk, np.arange(n_chunks + 1))
        else:
            stage = cpu = size = np.zeros(0, dtype=np.int64)
            bounds = np.zeros(n_chunks + 1, dtype=np.int64)
        dst, src = (cpu, stage) if self.gpu_to_cpu else (stage, cpu)
        # Kernel tables, one per chunk, 16-byte aligned in the job's table: vectorised over
        # chunks, one pass per group (a Python loop over chunks costs ~1 ms per job).
        n_groups = len(per_group)
        counts = np.zeros((n_groups, n_chunks), dtype=np.int64)
        for i, (_g, _gu, _su, ch) in enumerate(per_group):
            counts[i] = np.bincount(ch, minlength=n_chunks)
        live = counts > 0
        refs = np.asarray([len(g.ref_tensors) for g, *_r in per_group], dtype=np.int64)
        # per chunk: rows of its live groups, then source units, then destination units
        n_live = live.sum(axis=0)
        n_units = counts.sum(axis=0)
        sizes = GROUP_ROW * n_live + 2 * n_units
        sizes += sizes & 1
        offsets = np.zeros(n_chunks + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        entries = int(offsets[-1])
        host = job.table.ensure(max(entries, 2), need_device=True)
        rank: np.ndarray = (
            np.cumsum(live, axis=0) - live
        )  # a live group's row among its chunk's rows
        unit_start = np.cumsum(counts, axis=0) - counts
        pair_start = np.cumsum(counts * refs[:, None], axis=0) - counts * refs[:, None]
        src_at = offsets[:-1] + GROUP_ROW * n_live
        for i, (g, gpu_units, stage_units, ch) in enumerate(per_group):
            cs = np.flatnonzero(live[i])
            row = offsets[cs] + GROUP_ROW * rank[i, cs]
            host[row] = pair_start[i, cs]
            host[row + 1] = counts[i, cs]
            host[row + 2] = self._ref_start[g.index] + g.ref_offset
            host[row + 3] = unit_start[i, cs]
            first = np.concatenate([[0], np.cumsum(counts[i])[:-1]])
            at = src_at[ch] + unit_start[i, ch] + np.arange(len(ch), dtype=np.int64) - first[ch]
            rel = stage_units - ch * (k * f)
            s_units, d_units = (gpu_units, rel) if self.gpu_to_cpu else (rel, gpu_units)
            host[at] = s_units
            host[at + n_units[ch]] = d_units
        chunks = [
            StagedChunk(int(o), int(gl), int(u), int(p), int(b0), int(b1))
            for o, gl, u, p, b0, b1 in zip(
                offsets[:-1].tolist(),
                n_live.tolist(),
                n_units.tolist(),
                (pair_start[-1] + counts[-1] * refs[-1]).tolist() if n_groups else [],
                bounds[:-1].tolist(),
                bounds[1:].tolist(),
                strict=True,
            )
        ]
        off = entries
        return PreparedJob(
            chunks,
            off,
            np.ascontiguousarray(dst),
            np.ascontiguousarray(src),
            np.ascontiguousarray(size),
        )

    def _prepare_small(self, job: StagedJob, first_slot: int) -> PreparedJob | None:
        """What a serving engine submits: whole blocks of one group whose CPU cell is one
        run. A few scalars and two unit runs per chunk and one DMA piece per run of adjacent
        slots, with no per-group or per-extent passes: the general path costs a few hundred
        numpy calls per job, more than the copy of a serving-size job takes on the link.
        One call of the host-copy extension where it is built, else the numpy body
        (:meth:`_prepare_small_numpy`, the same bytes)."""
        plan = job.plan
        if len(plan.groups) != 1 or self.layout.factor != 1:
            return None
        g = plan.groups[0]
        n = len(g.src_units)
        if n == 0 or g.ref_offset != 0:
            return None
        facts = self._small_group(g.index)
        if facts is None or len(g.ref_tensors) != facts.refs:
            return None  # several runs per cell, or a job split by refs (part of each cell)
        if _small_tables is None:
            return self._prepare_small_numpy(job, first_slot, facts)
        k = self.blocks_per_chunk
        cpu_units, gpu_units = (g.dst_units, g.src_units) if self.gpu_to_cpu else (
            g.src_units, g.dst_units)  # fmt: skip
        entries = GROUP_ROW + 2 * n if n <= k else _small_entries(n, k)  # n <= k: one chunk
        host = job.table.ensure(entries, need_device=True)
        pieces = np.empty(3 * n, dtype=np.int64)  # rows: destination, source, size
        try:  # the planners' units (contiguous int64) as they are: no conversion per job
            count, info = _small_tables(
                gpu_units, cpu_units, host, pieces, self._ring_base, k, self.config.depth,
                first_slot, GROUP_ROW, facts.ref_row, facts.refs, facts.length,
                self.layout.stride, facts.cpu_start, facts.cpu_stride, facts.stage_off,
                self.gpu_to_cpu,
            )  # fmt: skip
        except TypeError:  # units of another type or layout: numpy copes, same bytes
            return self._prepare_small_numpy(job, first_slot, facts)
        return PreparedJob(
            [StagedChunk(*chunk) for chunk in info],
            entries,
            pieces[:count],
            pieces[n : n + count],
            pieces[2 * n : 2 * n + count],
        )

    def _small_group(self, index: int) -> _SmallGroup | None:
        """The facts :meth:`_prepare_small` needs of group ``index``, looked up once (None:
        its cell is not one run, so its jobs take the general path)."""
        cache = self._small_groups
        if index in cache:
            return cache[index]
        ext = self.layout.extents(index, 0, 1)
        facts = None
        if len(ext.length) == 1:
            facts = _SmallGroup(
                len(self.layout.group_refs[index][0]),
                int(self._ref_start[index]),
                int(ext.length[0]),
                int(ext.cpu_start[0]),
                int(ext.cpu_stride[0]),
                int(ext.stage_off[0]),
            )
        cache[index] = facts
        return facts

    def _prepare_small_numpy(
        self, job: StagedJob, first_slot: int, facts: _SmallGroup
    ) -> PreparedJob:
        """:meth:`_prepare_small` in numpy: the fallback without the extension, and the
        reference its C version is tested against."""
        g = job.plan.groups[0]
        n = len(g.src_units)
        k, depth, refs = self.blocks_per_chunk, self.config.depth, facts.refs
        n_chunks = -(-n // k)
        cpu_units, gpu_units = (g.dst_units, g.src_units) if self.gpu_to_cpu else (
            g.src_units, g.dst_units)  # fmt: skip
        per_chunk = GROUP_ROW + 2 * k
        per_chunk += per_chunk & 1
        entries = _small_entries(n, k)
        host = job.table.ensure(entries, need_device=True)
        ref_start = facts.ref_row
        local = np.arange(min(n, k), dtype=np.int64)
        length, stride = facts.length, self.layout.stride
        cpu_stride = facts.cpu_stride
        cpu = facts.cpu_start + cpu_units.astype(np.int64) * cpu_stride
        if n_chunks == 1:
            stage = self._ring_base[first_slot % depth] + facts.stage_off + local * stride
        else:
            pos = np.arange(n, dtype=np.int64)
            chunk_of = pos // k
            base = self._ring_base[(first_slot + chunk_of) % depth]
            stage = base + facts.stage_off + (pos - chunk_of * k) * stride
        chunks = []
        size = np.full(n, length, dtype=np.int64)
        starts = None
        if n > 1 and length == stride == cpu_stride:
            breaks = cpu[1:] != cpu[:-1] + length
            if n_chunks > 1:
                breaks[k - 1 :: k] = True  # a piece never crosses into the next buffer
            starts = np.flatnonzero(np.concatenate([[True], breaks]))
            size = np.diff(np.append(starts, n)) * length
            cpu, stage = cpu[starts], stage[starts]
        for c in range(n_chunks):
            lo, hi = c * k, min(n, (c + 1) * k)
            m, off = hi - lo, c * per_chunk
            host[off] = 0
            host[off + 1] = m
            host[off + 2] = ref_start + g.ref_offset
            host[off + 3] = 0
            units = gpu_units[lo:hi]
            src, dst = (units, local[:m]) if self.gpu_to_cpu else (local[:m], units)
            host[off + GROUP_ROW : off + GROUP_ROW + m] = src
            host[off + GROUP_ROW + m : off + GROUP_ROW + 2 * m] = dst
            if starts is None:
                piece_lo, piece_hi = lo, hi
            else:
                piece_lo, piece_hi = (int(x) for x in np.searchsorted(starts, (lo, hi)))
            chunks.append(StagedChunk(off, 1, m, m * refs, piece_lo, piece_hi))
        dst_arr, src_arr = (cpu, stage) if self.gpu_to_cpu else (stage, cpu)
        return PreparedJob(
            chunks,
            entries,
            np.ascontiguousarray(dst_arr, dtype=np.int64),
            np.ascontiguousarray(src_arr, dtype=np.int64),
            np.ascontiguousarray(size, dtype=np.int64),
        )


class _SmallGroup(NamedTuple):
    """What a whole-block job of one group needs of its group's geometry (one cell run)."""

    refs: int
    ref_row: int
    """The group's first row in the ring's ref tables."""
    length: int
    cpu_start: int
    cpu_stride: int
    stage_off: int


def _small_entries(n: int, k: int) -> int:
    """Job-table entries of an ``n``-block job of one group in chunks of ``k`` blocks: per
    chunk a group row and two unit runs, each chunk but the last padded to ``2k`` units and
    every chunk to an even count (16-byte aligned)."""
    if n <= k:
        entries = GROUP_ROW + 2 * n
    else:
        per_chunk = GROUP_ROW + 2 * k
        per_chunk += per_chunk & 1
        n_chunks = -(-n // k)
        entries = (n_chunks - 1) * per_chunk + GROUP_ROW + 2 * (n - (n_chunks - 1) * k)
    return entries + (entries & 1)
