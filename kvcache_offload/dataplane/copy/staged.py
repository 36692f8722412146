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


The geometry is :class:`~kvcache_offload.dataplane.copy.staging_cells.CellLayout` (plain
numpy), the per-job tables are built by
:class:`~kvcache_offload.dataplane.copy.staged_tables.StagedTables`, and the knobs are
:class:`~kvcache_offload.dataplane.copy.staging_config.StagingConfig`; :class:`StagedCopier`
owns the ring, the two streams and the thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvcache_offload.dataplane.copy.dma import CudaRuntime
from kvcache_offload.dataplane.copy.kernel_issue import (
    MAX_PIECES,
    KernelIssue,
    bind_when_compiled,
    kernel_issue_available,
    raw_event,
)
from kvcache_offload.dataplane.copy.plan import SideGeometry, TransferPlan
from kvcache_offload.dataplane.copy.staged_job import ISSUED_NOW, StagedJob
from kvcache_offload.dataplane.copy.staged_tables import PreparedJob, StagedChunk, StagedTables
from kvcache_offload.dataplane.copy.staging_cells import CellLayout
from kvcache_offload.dataplane.copy.staging_config import DEFAULT_STAGING_CONFIG, StagingConfig
from kvcache_offload.dataplane.copy.triton_kernel import (
    DEFAULT_KERNEL_CONFIG,
    BoundCopyKernel,
    KernelConfig,
    on_device,
)
from kvcache_offload.errors import ConfigError, TransferError

__all__ = [
    "DEFAULT_STAGING_CONFIG",
    "ISSUED_NOW",
    "CellLayout",
    "StagedCopier",
    "StagedJob",
    "StagingConfig",
]

logger = logging.getLogger(__name__)

_THROTTLE_POLL_S = 100e-6

_PREPARE_LOCK = threading.Lock()
"""One job's tables are built at a time in this process. ``prepare`` is a few hundred short
numpy calls; two submit threads running it at once hand the GIL back and forth at every
call and each takes ~2 ms instead of ~0.4 ms (H200 host, a store and a load submitted
together), which delays the start of both jobs."""
_STAGE_ALIGN = 256


class StagedCopier(StagedTables):
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
        self._small_groups = {}
        self._ring: torch.Tensor | None = None
        self._ring_base = np.zeros(config.depth, dtype=np.int64)
        self._ref_tables: torch.Tensor | None = None
        self._kernels: list[BoundCopyKernel] = []
        """One bound copy kernel per ring buffer (its ref table points into that buffer)."""
        self._issuers: list[KernelIssue | None] = []
        """Each ring buffer's kernel bound to the C issuer, once a launch compiled it."""
        self._issue_unbound = kernel_issue_available()
        self._align = 1
        self._kernel_stream: torch.cuda.Stream | None = None
        self._dma_stream: torch.cuda.Stream | None = None
        self._filled: list[torch.cuda.Event] = []
        self._freed: list[torch.cuda.Event] = []
        self._freed_used = [False] * config.depth
        self._next_slot = 0
        """Ring buffer of the next job's first chunk: successive small jobs alternate
        buffers, so one job's DMA overlaps the previous job's gather or scatter."""
        self._queue: queue.SimpleQueue[StagedJob | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

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
        src_factor, dst_factor = (1, self.layout.factor)
        if not self.gpu_to_cpu:
            src_factor, dst_factor = dst_factor, src_factor
        self._kernels = [
            BoundCopyKernel(
                view,
                src_factor=src_factor,
                dst_factor=dst_factor,
                alignment=self._align,
                config=self.kernel_config,
            )
            for view in self._ref_tables.unbind(0)
        ]
        self._issuers = [None] * depth
        self._kernel_stream = torch.cuda.Stream(self.device)
        self._dma_stream = torch.cuda.Stream(self.device)
        self._filled = [torch.cuda.Event() for _ in range(depth)]
        self._freed = [torch.cuda.Event() for _ in range(depth)]

    def memory_bytes(self) -> int:
        """GPU bytes held by the staging ring (0 until the first staged job)."""
        return 0 if self._ring is None else self.config.depth * self.buffer_bytes

    def submit(self, job: StagedJob, inline: bool = False) -> None:
        """Issue ``job`` now (``inline``, or without a submit thread), or hand it to the
        submit thread. The caller issues inline only once the thread has issued every job
        queued before (the jobs of a direction go out in order)."""
        if self._closed:
            raise TransferError("the staged copier is shut down")
        if inline or not self.config.submit_thread:
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
            if job.issued is not ISSUED_NOW:
                job.issued.set()

    @property
    def _what(self) -> str:
        return "store" if self.gpu_to_cpu else "load"

    def _issue(self, job: StagedJob) -> None:
        self._ensure_ring()
        first_slot = self._next_slot
        with _PREPARE_LOCK:
            prep = self.prepare(job, first_slot)
        depth = self.config.depth
        self._next_slot = (first_slot + len(prep.chunks)) % depth
        ks, ds = self._kernel_stream, self._dma_stream
        assert ks is not None and ds is not None and self._ref_tables is not None
        slot = job.table
        first, last = (ks, ds) if self.gpu_to_cpu else (ds, ks)
        threaded = threading.current_thread() is self._thread
        # Every call names its stream: no stream context to enter and leave per job.
        with on_device(self.device):
            if (
                not threaded
                and len(prep.chunks) == 1
                and self._issue_one_chunk(job, prep, first_slot)
            ):
                job.end_recorded = True
                return
            if job.ready_event is not None:
                first.wait_event(job.ready_event)
            if job.prev_end is not None:
                first.wait_event(job.prev_end)
            job.start_event.record(first)
            if prep.table_entries:
                n = prep.table_entries
                self.runtime.memcpy_async(slot.dev_ptr, slot.host_ptr, 8 * n, ks.cuda_stream)
            pause = self.config.yield_s if threaded else 0.0
            throttle = threaded and self.config.throttle
            for c, chunk in enumerate(prep.chunks):
                s = (first_slot + c) % depth
                if throttle and self._freed_used[s]:
                    freed = self._freed[s]
                    while not freed.query():
                        time.sleep(_THROTTLE_POLL_S)
                if self.gpu_to_cpu:
                    self._kernel_step(ks, s, slot, chunk, job.plan)
                    self._dma_step(ds, ks, s, prep, chunk)
                else:
                    self._dma_step(ds, ks, s, prep, chunk)
                    self._kernel_step(ks, s, slot, chunk, job.plan)
                if pause > 0 and c + 1 < len(prep.chunks):
                    time.sleep(pause)
            if not prep.chunks:
                last.wait_stream(first)  # else the last chunk's event already orders them
            job.end_event.record(last)
            job.end_recorded = True

    def _issue_one_chunk(self, job: StagedJob, prep: PreparedJob, s: int) -> bool:
        """Issue a job of one chunk (a serving job, on the caller's thread) in one call of the
        C issuer: the calls below in the same order, except that its DMA pieces (at most
        ``MAX_PIECES``) are one ``cudaMemcpyAsync`` each where more than four go out as one
        ``cudaMemcpyBatchAsync`` below. False, having issued nothing, where ring buffer
        ``s``'s kernel is not bound (yet) or the job does not fit it."""
        chunk = prep.chunks[0]
        issue = self._issuers[s]  # sized by _ensure_ring, which _issue ran first
        if issue is None:
            if not self._issue_unbound:
                return False
            issue = self._bind(s)
            if issue is None:
                return False
        if chunk.piece_hi - chunk.piece_lo > MAX_PIECES:
            return False
        ks, ds = self._kernel_stream, self._dma_stream
        assert ks is not None and ds is not None
        first = ks if self.gpu_to_cpu else ds
        slot = job.table
        done = issue.issue_staged(
            self.gpu_to_cpu, ks.cuda_stream, ds.cuda_stream,
            0 if job.ready_event is None else raw_event(job.ready_event, first),
            0 if job.prev_end is None else raw_event(job.prev_end, first),
            raw_event(job.start_event, first), raw_event(job.end_event, first),
            slot.host_ptr, slot.dev_ptr, prep.table_entries, chunk.table_offset,
            chunk.n_groups, chunk.n_units, chunk.total_pairs, job.plan.max_size,
            raw_event(self._freed[s], first), self._freed_used[s],
            raw_event(self._filled[s], first),
            prep.dma_dst, prep.dma_src, prep.dma_size, chunk.piece_lo, chunk.piece_hi,
        )  # fmt: skip
        if done:
            self._freed_used[s] = True
        return done

    def _bind(self, s: int) -> KernelIssue | None:
        """Ring buffer ``s``'s kernel bound to the C issuer, once a launch compiled it."""
        issue, retry = bind_when_compiled(self._kernels[s], self.runtime)
        if issue is None and not retry:
            self._issue_unbound = False  # no ring buffer's kernel can be bound
        self._issuers[s] = issue
        return issue

    def _kernel_step(
        self,
        ks: torch.cuda.Stream,
        s: int,
        slot: Any,
        chunk: StagedChunk,
        plan: TransferPlan,
    ) -> None:
        """Store: wait for ring slot ``s`` to be free, gather, mark it filled.
        Load: wait for it to be filled, scatter, mark it free."""
        assert self._ref_tables is not None
        if self.gpu_to_cpu:
            if self._freed_used[s]:
                ks.wait_event(self._freed[s])
        else:
            ks.wait_event(self._filled[s])
        self._kernels[s].launch(
            slot.dev,
            n_groups=chunk.n_groups,
            n_units=chunk.n_units,
            total_pairs=chunk.total_pairs,
            max_size=plan.max_size,
            stream=ks.cuda_stream,
            job_offset=chunk.table_offset,
        )
        if self.gpu_to_cpu:
            self._filled[s].record(ks)
        else:
            self._freed[s].record(ks)
            self._freed_used[s] = True

    def _dma_step(
        self,
        ds: torch.cuda.Stream,
        ks: torch.cuda.Stream,
        s: int,
        prep: PreparedJob,
        chunk: StagedChunk,
    ) -> None:
        if self.gpu_to_cpu:
            ds.wait_event(self._filled[s])
        elif self._freed_used[s]:
            ds.wait_event(self._freed[s])
        lo, hi = chunk.piece_lo, chunk.piece_hi
        dst, src, size = prep.dma_dst, prep.dma_src, prep.dma_size
        if lo != 0 or hi != len(size):  # else the job's one chunk: its arrays as they are
            dst, src, size = dst[lo:hi], src[lo:hi], size[lo:hi]  # (three views cost ~1 us)
        self.runtime.memcpy_pieces(dst, src, size, ds.cuda_stream)
        if self.gpu_to_cpu:
            self._freed[s].record(ds)
            self._freed_used[s] = True
        else:
            self._filled[s].record(ds)

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
        self._kernels = []

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
