"""The staged copy path: a device gather/scatter plus one copy-engine DMA per offloaded block.

The copy engines reach the PCIe link's speed in both directions at once, but only with large
pieces (about 1 us of host time and a per-copy cost on the link for each); the UVA kernel
copies small fragments but tops out below the link. When the CPU side holds an offloaded
block as one contiguous piece (*block-major*: a shared-region cell, or the handlers'
private buffer, see
:func:`~kvcache_offload.dataplane.handlers.cpu_backend.allocate_cpu_tensors`), a job
can use both:

* store: the Triton kernel (:mod:`~kvcache_offload.dataplane.copy.triton_kernel`, here reading and
  writing device memory only) packs each CPU block's fragments from the per-layer GPU
  tensors into a contiguous GPU *staging* buffer laid out like the CPU cells; then one
  ``cudaMemcpyBatchAsync`` moves one contiguous piece per CPU block (2 MiB for a
  Llama-8B-like block) to its slot;
* load: the reverse (DMA each block's bytes into staging, then the kernel scatters them).

Only the bytes the job covers are moved: a block whose every page is written is one piece
(adjacent slots coalesce into one); a partly covered block (skip counts with
``block_size_factor`` > 1, groups that own only some tensors, padded pages) becomes one
piece per covered run. The job goes in chunks through a ring of ``depth`` staging buffers
of ``chunk_bytes`` each (bounded GPU memory per direction): the kernel runs on one stream,
the DMA on another, ring slots are handed over with CUDA events, so the kernel fills chunk
i+1 while the copy engine moves chunk i.

Issuing a job costs a kernel launch and a batched DMA call per chunk and about 1 us per
piece (1,024 pieces for a 2 GiB job), so by default a dedicated *submit thread* issues the
chunks: ``transfer_async`` only validates the job, records the compute-stream event a store
waits on, and queues it. Jobs of one handler are issued in submission order; each waits on
the previous job's end event, so they also complete in order.

The geometry (:class:`CellLayout`) is plain numpy; :class:`StagedCopier` owns the ring, the
two streams and the thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvcache_offload.dataplane.copy.dma import CudaRuntime
from kvcache_offload.dataplane.copy.plan import (
    SideGeometry,
    TransferPlan,
)
from kvcache_offload.dataplane.copy.triton_kernel import (
    DEFAULT_KERNEL_CONFIG,
    GROUP_ROW,
    KernelConfig,
    launch_copy_kernel,
)
from kvcache_offload.errors import ConfigError, TransferError

__all__ = ["DEFAULT_STAGING_CONFIG", "CellLayout", "StagedCopier", "StagedJob", "StagingConfig"]

logger = logging.getLogger(__name__)

MiB = 1024 * 1024

_THROTTLE_POLL_S = 100e-6

_PREPARE_LOCK = threading.Lock()
"""One job's tables are built at a time in this process. ``prepare`` is a few hundred short
numpy calls; two submit threads running it at once hand the GIL back and forth at every
call and each takes ~2 ms instead of ~0.4 ms (H200 host, a store and a load submitted
together), which delays the start of both jobs."""
_STAGE_ALIGN = 256


@dataclass(frozen=True)
class StagingConfig:
    chunk_bytes: int = 64 * MiB
    """Bytes of one staging buffer (rounded up to hold at least one CPU block)."""
    depth: int = 2
    """Staging buffers per direction (GPU memory: ``depth * chunk_bytes``)."""
    submit_thread: bool = True
    """Issue chunks from a dedicated thread (``transfer_async`` only queues the job)."""
    yield_s: float = 20e-6
    """The submit thread sleeps this long after issuing each chunk, so that the other
    direction's thread and the caller can take the GIL between chunks; 0: no pause. (On the
    H200 bench, one job per direction, 0, 20 and 100 us measured the same within noise; the
    thread stays far ahead of the copy engine either way.)"""
    throttle: bool = True
    """The submit thread issues a chunk only once its ring slot's previous use finished on the
    GPU (polling the slot's event with short sleeps). Issuing a whole job at once keeps the
    thread on the GIL for ~0.15 ms per chunk, which slowed the other direction's thread
    preparing its job (~1.2 ms instead of ~0.4 ms) when a store and a load start together;
    the GPU never waits for the host either way (a chunk takes ~1 ms on the link)."""
    auto_min_piece_bytes: int | None = 256 * 1024
    """``auto`` picks the staged path for a small-fragment job whose DMA pieces average at
    least this many bytes; None: never."""


DEFAULT_STAGING_CONFIG = StagingConfig()


@dataclass(frozen=True)
class _Extents:
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
        self._cache: dict[tuple[int, int, int], _Extents] = {}
        self.full_runs = [
            len(self.extents(g, 0, self.factor).length) if len(refs[0]) else 0
            for g, refs in enumerate(self.group_refs)
        ]

    @property
    def block_major(self) -> bool:
        """Whether a fully covered block is one contiguous host piece."""
        return bool(all(runs <= 1 for runs in self.full_runs))

    def extents(self, group: int, a: int, b: int) -> _Extents:
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
        ext = _Extents(arr[:, 0].copy(), arr[:, 1] - arr[:, 0], arr[:, 2].copy(), arr[:, 3].copy())
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


@dataclass
class _Chunk:
    table_offset: int
    n_groups: int
    n_units: int
    total_pairs: int
    piece_lo: int
    piece_hi: int


@dataclass
class _Prepared:
    chunks: list[_Chunk]
    table_entries: int
    dma_dst: np.ndarray
    dma_src: np.ndarray
    dma_size: np.ndarray


@dataclass
class StagedJob:
    """One job on its way through the staged path (owned by the handler's transfer)."""

    plan: TransferPlan
    start_event: torch.cuda.Event
    end_event: torch.cuda.Event
    table: Any
    """The handler's ``_TableSlot`` (pinned host table and its device copy)."""
    ready_event: torch.cuda.Event | None = None
    """Recorded on the compute stream at submission (stores wait on it)."""
    prev_end: torch.cuda.Event | None = None
    issued: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    end_recorded: bool = False


class StagedCopier:
    """The staged path of one direction: staging ring, gather/scatter and DMA streams, thread."""

    def __init__(
        self,
        gpu_tensors: Sequence[torch.Tensor],
        cpu_tensors: Sequence[torch.Tensor],
        block_size_factor: int,
        group_refs: Sequence[tuple[np.ndarray, np.ndarray]],
        gpu_to_cpu: bool,
        runtime: CudaRuntime,
        *,
        config: StagingConfig = DEFAULT_STAGING_CONFIG,
        kernel_config: KernelConfig = DEFAULT_KERNEL_CONFIG,
    ) -> None:
        if config.depth < 1 or config.chunk_bytes < 1:
            raise ConfigError(
                f"staging needs depth >= 1 and chunk_bytes >= 1, got {config.depth} and "
                f"{config.chunk_bytes}"
            )
        self.device = gpu_tensors[0].device
        self.gpu_to_cpu = gpu_to_cpu
        self.runtime = runtime
        self.config = config
        self.kernel_config = kernel_config
        self.layout = CellLayout(
            SideGeometry.from_tensors(gpu_tensors, 1),
            SideGeometry.from_tensors(cpu_tensors, block_size_factor),
            group_refs,
        )
        self.blocks_per_chunk = max(1, config.chunk_bytes // self.layout.stride)
        self.buffer_bytes = -(-self.blocks_per_chunk * self.layout.stride // _STAGE_ALIGN)
        self.buffer_bytes *= _STAGE_ALIGN
        self._ref_start = np.zeros(len(self.layout.group_refs) + 1, dtype=np.int64)
        for g, (tensors, _sizes) in enumerate(self.layout.group_refs):
            self._ref_start[g + 1] = self._ref_start[g] + len(tensors)
        self._ring: torch.Tensor | None = None
        self._ring_base = np.zeros(config.depth, dtype=np.int64)
        self._ref_tables: torch.Tensor | None = None
        self._ref_views: list[torch.Tensor] = []
        self._align = 1
        self._kernel_stream: torch.cuda.Stream | None = None
        self._dma_stream: torch.cuda.Stream | None = None
        self._filled: list[torch.cuda.Event] = []
        self._freed: list[torch.cuda.Event] = []
        self._freed_used = [False] * config.depth
        self._queue: queue.SimpleQueue[StagedJob | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- resources --------------------------------------------------------------------------
    def _ensure_ring(self) -> None:
        if self._ring is not None:
            return
        depth = self.config.depth
        self._ring = torch.empty((depth, self.buffer_bytes), dtype=torch.uint8, device=self.device)
        self._ring_base = np.asarray(
            [int(self._ring[s].data_ptr()) for s in range(depth)], dtype=np.int64
        )
        tables, self._align = self.ref_tables(self._ring_base)
        self._ref_tables = torch.from_numpy(tables).to(self.device)
        self._ref_views = list(self._ref_tables.unbind(0))
        self._kernel_stream = torch.cuda.Stream(self.device)
        self._dma_stream = torch.cuda.Stream(self.device)
        self._filled = [torch.cuda.Event() for _ in range(depth)]
        self._freed = [torch.cuda.Event() for _ in range(depth)]

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

    def memory_bytes(self) -> int:
        """GPU bytes held by the staging ring (0 until the first staged job)."""
        return 0 if self._ring is None else self.config.depth * self.buffer_bytes

    # -- planning ---------------------------------------------------------------------------
    def prepare(self, job: StagedJob) -> _Prepared:
        """Kernel job tables (into the job's pinned table) and the DMA piece arrays."""
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
            stage = stage + self._ring_base[chunk % self.config.depth]
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
            _Chunk(int(o), int(gl), int(u), int(p), int(b0), int(b1))
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
        return _Prepared(
            chunks,
            off,
            np.ascontiguousarray(dst),
            np.ascontiguousarray(src),
            np.ascontiguousarray(size),
        )

    # -- issuing ----------------------------------------------------------------------------
    def submit(self, job: StagedJob) -> None:
        """Issue ``job`` now, or hand it to the submit thread."""
        if self._closed:
            raise TransferError("the staged copier is shut down")
        if not self.config.submit_thread:
            self._issue_safely(job)
            return
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run,
                name="kvoffload-staged-" + ("store" if self.gpu_to_cpu else "load"),
                daemon=True,
            )
            self._thread.start()
        self._queue.put(job)

    def _run(self) -> None:
        with torch.cuda.device(self.device):
            while True:
                job = self._queue.get()
                if job is None:
                    return
                self._issue_safely(job)

    def _issue_safely(self, job: StagedJob) -> None:
        try:
            self._issue(job)
        except BaseException as exc:
            job.error = exc
            logger.warning("staged %s job failed to issue: %s", self._what, exc)
        finally:
            job.issued.set()

    @property
    def _what(self) -> str:
        return "store" if self.gpu_to_cpu else "load"

    def _issue(self, job: StagedJob) -> None:
        self._ensure_ring()
        with _PREPARE_LOCK:
            prep = self.prepare(job)
        ks, ds = self._kernel_stream, self._dma_stream
        assert ks is not None and ds is not None and self._ref_tables is not None
        slot = job.table
        first, last = (ks, ds) if self.gpu_to_cpu else (ds, ks)
        # The kernel stream is current for the whole job (the launches use it); events and
        # the DMA name their streams explicitly.
        with torch.cuda.device(self.device), torch.cuda.stream(ks):
            if job.ready_event is not None:
                first.wait_event(job.ready_event)
            if job.prev_end is not None:
                first.wait_event(job.prev_end)
            job.start_event.record(first)
            if prep.table_entries:
                n = prep.table_entries
                slot.dev[:n].copy_(slot.host[:n], non_blocking=True)
            src_factor, dst_factor = (1, self.layout.factor)
            if not self.gpu_to_cpu:
                src_factor, dst_factor = dst_factor, src_factor
            threaded = threading.current_thread() is self._thread
            pause = self.config.yield_s if threaded else 0.0
            throttle = threaded and self.config.throttle
            for c, chunk in enumerate(prep.chunks):
                s = c % self.config.depth
                if throttle and self._freed_used[s]:
                    freed = self._freed[s]
                    while not freed.query():
                        time.sleep(_THROTTLE_POLL_S)
                if self.gpu_to_cpu:
                    self._kernel_step(ks, s, slot, chunk, job.plan, src_factor, dst_factor)
                    self._dma_step(ds, ks, s, prep, chunk)
                else:
                    self._dma_step(ds, ks, s, prep, chunk)
                    self._kernel_step(ks, s, slot, chunk, job.plan, src_factor, dst_factor)
                if pause > 0 and c + 1 < len(prep.chunks):
                    time.sleep(pause)
            last.wait_stream(first)  # also orders a job without chunks
            job.end_event.record(last)
            job.end_recorded = True

    def _kernel_step(
        self,
        ks: torch.cuda.Stream,
        s: int,
        slot: Any,
        chunk: _Chunk,
        plan: TransferPlan,
        src_factor: int,
        dst_factor: int,
    ) -> None:
        """Store: wait for ring slot ``s`` to be free, gather, mark it filled.
        Load: wait for it to be filled, scatter, mark it free."""
        assert self._ref_tables is not None
        if self.gpu_to_cpu:
            if self._freed_used[s]:
                ks.wait_event(self._freed[s])
        else:
            ks.wait_event(self._filled[s])
        launch_copy_kernel(  # on the current stream: ks (see _issue)
            self._ref_views[s],
            slot.dev[chunk.table_offset :],
            n_groups=chunk.n_groups,
            n_units=chunk.n_units,
            total_pairs=chunk.total_pairs,
            max_size=plan.max_size,
            src_factor=src_factor,
            dst_factor=dst_factor,
            alignment=self._align,
            config=self.kernel_config,
        )
        if self.gpu_to_cpu:
            self._filled[s].record(ks)
        else:
            self._freed[s].record(ks)
            self._freed_used[s] = True

    def _dma_step(
        self, ds: torch.cuda.Stream, ks: torch.cuda.Stream, s: int, prep: _Prepared, chunk: _Chunk
    ) -> None:
        if self.gpu_to_cpu:
            ds.wait_event(self._filled[s])
        elif self._freed_used[s]:
            ds.wait_event(self._freed[s])
        lo, hi = chunk.piece_lo, chunk.piece_hi
        self.runtime.memcpy_batch_async(
            prep.dma_dst[lo:hi], prep.dma_src[lo:hi], prep.dma_size[lo:hi], ds.cuda_stream
        )
        if self.gpu_to_cpu:
            self._freed[s].record(ds)
            self._freed_used[s] = True
        else:
            self._filled[s].record(ds)

    # -- shutdown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Issue what is queued, stop the thread, free the ring. Idempotent; the caller
        waits for the jobs' end events before dropping them."""
        if self._closed:
            return
        self._closed = True
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def release(self) -> None:
        """Drop the ring and tables (after every job has ended)."""
        self._ring = None
        self._ref_tables = None
        self._ref_views = []

    def describe(self) -> dict[str, Any]:
        return {
            "chunk_bytes": self.buffer_bytes,
            "blocks_per_chunk": self.blocks_per_chunk,
            "depth": self.config.depth,
            "submit_thread": self.config.submit_thread,
            "yield_s": self.config.yield_s,
            "auto_min_piece_bytes": self.config.auto_min_piece_bytes,
            "block_major": self.layout.block_major,
            "staging_gpu_bytes": self.memory_bytes(),
        }
